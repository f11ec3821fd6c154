"""Allreduce benchmark (same as ``gradcomp bench allreduce``); see gradcomp/bench/allreduce.py."""

import sys

from gradcomp.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
