"""Where the study's results go: the output directory, checked before anything runs, and
values made ready for ``json.dump``."""

from __future__ import annotations

import math
import os
import time

__all__ = ["DEFAULT_OUT", "prepare_out", "json_ready"]

#: the parent of the timestamped result directories when ``--out`` is not given
DEFAULT_OUT = "./gradcomp-results"


def prepare_out(out: str | None, overwrite: bool = False) -> str:
    """The directory the results go to, created and checked writable before
    anything runs: ``out``, or a new ``DEFAULT_OUT/<YYYYmmdd-HHMMSS>`` (``-2``,
    ``-3``, ... when taken).

    Raises:
        ValueError: ``out`` is a file, cannot be created or written, or already
            holds results and ``overwrite`` is False (one-line reasons).
    """
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = os.path.join(DEFAULT_OUT, stamp)
        k = 2
        while os.path.exists(out):
            out = os.path.join(DEFAULT_OUT, f"{stamp}-{k}")
            k += 1
    from gradcomp._validate import writable_dir

    if os.path.isdir(out) and not overwrite and os.path.exists(os.path.join(out, "results.json")):
        raise ValueError(f"--out {out} already holds results (results.json); pass --overwrite to "
                         "replace them, or choose another directory")
    return writable_dir("--out", out)


def json_ready(x):
    """``x`` with NaN/inf floats as None, tuples as lists (for ``json.dump``)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    return x
