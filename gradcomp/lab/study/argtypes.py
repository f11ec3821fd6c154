"""The argument types of ``gradcomp train``'s parser: each turns one option's text into its value or
raises ``argparse.ArgumentTypeError`` with a one-line reason."""

from __future__ import annotations

import argparse

from gradcomp.lab.study.config import ALL_MODES, MODES, parse_compressors

__all__ = ["link_schedule_type",
    "positive_int_type", "positive_float_type", "nonnegative_float_type", "nonnegative_int_type",
    "modes_type", "seed_type", "compressor_list_type", "files_type", "cv_type", "straggler_type",
    "accuracy_type", "scenarios_type",
]


def _int_in(text: str, lo: int, hi: float, expected: str) -> int:
    """``text`` as an int in ``[lo, hi)``, else ArgumentTypeError("expected <expected>, got ...")."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not lo <= val < hi:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {val}")
    return val


def positive_int_type(text: str) -> int:
    return _int_in(text, 1, float("inf"), "an integer >= 1")


def positive_float_type(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not val > 0 or val == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return val


def nonnegative_float_type(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= val < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return abs(val)  # "-0" is 0.0


def nonnegative_int_type(text: str) -> int:
    return _int_in(text, 0, float("inf"), "an integer >= 0")


def modes_type(text: str) -> tuple[str, ...]:
    """``--mode``: ``both`` (sync and async) or a comma-separated list of ALL_MODES."""
    if text == "both":
        return MODES
    if text == "pipeline":
        return ("pipeline",)  # runs alone (gradcomp.lab.study.pipeline)
    names = [m.strip() for m in text.split(",")]
    if "pipeline" in names:
        raise argparse.ArgumentTypeError("pipeline runs alone: --mode pipeline")
    bad = [m for m in names if m not in ALL_MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"invalid choice: {(bad or [text])[0]!r} (choose from "
                                         f"{', '.join(ALL_MODES)}, both, pipeline or a comma-separated list)")
    return tuple(dict.fromkeys(names))


def seed_type(text: str) -> int:
    return _int_in(text, 0, 2**32, "an integer in [0, 2**32 - 1]")


def compressor_list_type(text: str) -> tuple[str, ...]:
    try:
        return parse_compressors(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def files_type(text: str) -> list[str]:
    paths = [t.strip() for t in text.split(",")]
    if not all(paths):
        raise argparse.ArgumentTypeError(f"expected comma-separated file paths, got {text!r}")
    return paths


def cv_type(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        val = -1.0
    if not 0 <= val <= 10:
        raise argparse.ArgumentTypeError(f"expected a coefficient of variation in [0, 10], got {text!r}")
    return val


def straggler_type(text: str) -> tuple[int, float, float]:
    """``--straggler RANK:FACTOR[@SECONDS]`` -> ``(rank, factor, from_s)``."""
    from gradcomp.lab.study.timing import parse_straggler_onset

    try:
        return parse_straggler_onset(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--straggler ", "")) from None


def link_schedule_type(text: str) -> str:
    """``--link``: ``none`` (or ``loopback``), a rate, or a schedule ``RATE@SECONDS,...``,
    normalised (``"1000mbit@0,100mbit@120"`` -> ``"1gbit@0,100mbit@120"``)."""
    from gradcomp.lab.shaping import link_schedule
    from gradcomp.lab.units import format_rate, format_schedule

    if text in ("none", "loopback"):
        return "none"
    try:
        return format_schedule(link_schedule(text, "rate"), format_rate)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; or none (the unshaped loopback)") from None


def accuracy_type(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        val = -1.0
    if not 0 < val <= 1:
        raise argparse.ArgumentTypeError(f"expected an accuracy in (0, 1], got {text!r}")
    return val


def scenarios_type(text: str):
    from gradcomp.lab.study.scenarios import parse_scenarios

    try:
        return parse_scenarios(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
