"""The lab's command-line parser: a bad value is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import sys

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE (see PROG
    --help)``, on stderr with exit status 2, instead of the usage block and the message."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)
