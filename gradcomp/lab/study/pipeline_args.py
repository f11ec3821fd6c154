"""The command-line options of ``gradcomp train --mode pipeline`` (light to import)."""

from __future__ import annotations

import argparse

from gradcomp.lab.study.menu import DEFAULT_HIDDEN

__all__ = ["PIPELINE_SCHEDULES", "add_pipeline_arguments", "hidden_widths"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "pipedream")


def add_pipeline_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``--mode pipeline`` (ignored by the other modes)."""
    g = p.add_argument_group("pipeline mode (--mode pipeline)")
    g.add_argument("--stages", type=int, default=2, metavar="P",
                   help="pipeline stages, one process each (default 2); --workers W runs W/P replicas")
    g.add_argument("--microbatches", default="4", metavar="LIST",
                   help="micro-batches per step, one run per value (e.g. 1,2,4,8,16; default 4)")
    g.add_argument("--schedule", default="gpipe", metavar="LIST",
                   help=f"schedules among {','.join(PIPELINE_SCHEDULES)} (default gpipe)")
    g.add_argument("--vertical-sync", action="store_true",
                   help="pipedream: every stage uses the input stage's weight version")
    g.add_argument("--hidden", default=",".join(map(str, DEFAULT_HIDDEN)), metavar="LIST",
                   help="hidden widths of the digits MLP, in every mode (default 384,256: 3 layers)")
    return p


def hidden_widths(text: str) -> tuple[int, ...]:
    """``--hidden``'s comma-separated widths.

    Raises:
        ValueError: not a list of integers >= 1 (the message names the option).
    """
    try:
        widths = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(f"--hidden expects comma-separated widths >= 1, got {text!r}")
    return widths
