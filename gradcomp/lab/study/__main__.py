"""``python -m gradcomp.lab.study``: the same as ``gradcomp train``."""

import sys

from gradcomp.lab.study.command import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m gradcomp.lab.study"))
