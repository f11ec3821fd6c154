"""Allreduce benchmark (same as ``gradcomp bench allreduce``); see gradcomp/lab/bench/allreduce.py."""

import sys

from gradcomp.lab.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
