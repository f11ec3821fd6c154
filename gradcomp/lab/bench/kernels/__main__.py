"""``python -m gradcomp.lab.bench.kernels``: the same as ``gradcomp bench kernels``."""

import sys

from .cli import main

sys.exit(main())
