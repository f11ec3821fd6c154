"""``python -m gradcomp.train``: the same as ``gradcomp train``."""

import sys

from gradcomp.train.command import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m gradcomp.train"))
