"""Kernel microbenchmark (same as ``gradcomp bench kernels``); see gradcomp/bench/kernels/."""

import sys

from gradcomp.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
