"""``python -m gradcomp.ps``: see :mod:`gradcomp.lab.ps_demo`."""

import sys

from gradcomp.lab.ps_demo import main

if __name__ == "__main__":
    sys.exit(main())
