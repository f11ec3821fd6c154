"""``python -m gradcomp``: the same as the ``gradcomp`` command."""

import sys

from gradcomp.lab.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m gradcomp"))
