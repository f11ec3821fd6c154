"""Kernel microbenchmark (same as ``gradcomp bench kernels``); see gradcomp/lab/bench/kernels/."""

import sys

from gradcomp.lab.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
