"""``python -m gradcomp.ps``: see :mod:`gradcomp.ps.demo`."""

import sys

from gradcomp.ps.demo import main

if __name__ == "__main__":
    sys.exit(main())
