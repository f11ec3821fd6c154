"""The lab's one parser and formatter of element counts and link rates.

* counts: ``25M``, ``1B``, ``7B``, ``1.5k``, ``125000`` (SI: k = 1e3, M = 1e6,
  B/G = 1e9, T = 1e12);
* link rates: ``10gbit``, ``100mbit``, ``1.5gbit``, ``800kbit``, ``400bit``
  (bits per second with SI prefixes, as ``tc`` writes them: 1 mbit = 1e6 bit/s),
  always in **bits** per second at the edges (``rate_bps``); a caller that
  prices bytes divides by 8 itself;
* topologies: ``2x4`` (hosts x ranks per host);
* comma-separated lists of counts or rates;
* schedules of values over time: ``1gbit@0,100mbit@120`` (each value from the given
  second on, :func:`parse_schedule`).
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_count", "parse_rate", "parse_list", "parse_topology", "parse_schedule", "format_count", "format_schedule",
           "format_rate"]

_COUNT = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"


def parse_count(text: str, name: str = "count") -> int:
    """A positive element count such as ``25M`` or ``7B``.

    Raises:
        ValueError: not a positive number with an optional k/M/B/G/T suffix.
    """
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([kKMBGT]?)\s*", str(text))
    if not m:
        raise ValueError(f"{name} must be a positive number with an optional suffix k, M, B or T "
                         f"(e.g. 25M, 7B), got {text!r}")
    value = float(m.group(1)) * _COUNT[m.group(3)]
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"{name} must be at least 1, got {text!r}")
    return int(round(value))


def parse_rate(text: str | int | float, name: str = "link rate") -> float:
    """A link rate in bits per second: ``"10gbit"`` -> ``1e10``; a number is taken as bit/s.

    Args:
        text: a number followed by bit, kbit, mbit, gbit or tbit (any case,
            ``tc``'s decimal units), or an int / float of bit/s.
        name: what the value is, for the error message (``"--link"``).

    Raises:
        ValueError: not such a rate, or not a finite rate > 0.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"{name} must be like 100mbit, 1gbit or 2.5gbit, or a number of bit/s, got {text!r}")
    if isinstance(text, str):
        m = re.fullmatch(rf"\s*({_NUMBER})\s*([kmgt]?bit)\s*", text.lower())
        if not m:
            raise ValueError(f"{name} must be like 100mbit, 1gbit or 2.5gbit (bits per second; units "
                             f"bit, kbit, mbit, gbit, tbit), got {text!r}")
        rate_bps = float(m.group(1)) * _RATE[m.group(3)]
    else:
        rate_bps = float(text)
    if not (math.isfinite(rate_bps) and rate_bps > 0):
        raise ValueError(f"{name} must be a positive rate, got {text!r}")
    return rate_bps


def parse_list(text: str, parse, name: str) -> list:
    """``parse`` applied to each item of a comma-separated list (empty items skipped).

    Raises:
        ValueError: an empty list or an item ``parse`` rejects.
    """
    items = [s for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"{name} must be a comma-separated list, got {text!r}")
    return [parse(s.strip(), name) for s in items]


def format_count(n: float) -> str:
    """``25000000`` -> ``25M``; ``7e9`` -> ``7B``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def format_rate(rate_bps: float) -> str:
    """Bits per second as ``tc`` writes them, four significant digits:
    ``1e8`` -> ``"100mbit"``, ``1.5e9`` -> ``"1.5gbit"``, ``94123456`` -> ``"94.12mbit"``."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:.4g}{unit}"
    return f"{rate_bps:.4g}bit"


def parse_topology(text: str, name: str = "topology") -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: hosts x ranks per host, each at least 1.

    Raises:
        ValueError: not ``HxR`` with positive integers ``H`` and ``R``.
    """
    m = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", str(text))
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"{name} must be HOSTSxRANKS_PER_HOST with positive integers, such as 2x4, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_schedule(text: str, parse, name: str, value_format: str, example: str,
                   from_zero: bool = True) -> list[tuple[float, object]]:
    """``"1gbit@0,100mbit@120"`` -> ``[(0.0, 1e9), (120.0, 1e8)]``: values over time, each
    in force from its start (seconds) until the next one's.

    Args:
        text: comma-separated ``VALUE@SECONDS`` items with start times increasing;
            one item without ``@SECONDS`` is a value in force from 0 on.
        parse: ``parse(item_text, name)`` -> the value (raises ValueError).
        name: the option, for the messages (``"--link"``).
        value_format: how a value is written, for the messages (``"RATE"``).
        example: a valid schedule, for the messages.
        from_zero: the first item must start at 0 (a link has a rate from the start).

    Returns:
        ``[(start_s, value), ...]`` sorted by start, starts finite, >= 0 and distinct.

    Raises:
        ValueError: a malformed item, a bad value (``parse``'s message), a start that
            is not a finite number of seconds >= 0, starts not increasing, or (``from_zero``)
            a first start other than 0; each message names ``name`` and the format.
    """
    form = (f"{name} must be {value_format}@SECONDS[,{value_format}@SECONDS...] with start times "
            f"in seconds, increasing{', the first 0' if from_zero else ''} (e.g. {example})")
    items = [s.strip() for s in str(text).split(",")]
    if not items or not all(items):
        raise ValueError(f"{form}, got {text!r}")
    out: list[tuple[float, object]] = []
    for item in items:
        value_s, at, start_s = item.rpartition("@") if "@" in item else (item, "", "0")
        if not at and len(items) > 1:
            raise ValueError(f"{form}: {item!r} has no @SECONDS, got {text!r}")
        m = re.fullmatch(rf"\s*{_NUMBER}\s*s?\s*", start_s)
        start = float(start_s.strip().rstrip("s")) if m else math.nan
        if not (math.isfinite(start) and start >= 0):
            raise ValueError(f"{form}: the start of {item!r} is not a number of seconds >= 0, got {text!r}")
        if out and start <= out[-1][0]:
            raise ValueError(f"{form}: start times must increase, got {text!r}")
        out.append((start, parse(value_s.strip(), name)))
    if from_zero and out[0][0] != 0:
        raise ValueError(f"{form}: the first starts at {out[0][0]:g} s, got {text!r}")
    return out


def format_schedule(schedule, fmt) -> str:
    """The inverse of :func:`parse_schedule`: ``[(0, 1e9), (120, 1e8)]`` with ``fmt=format_rate``
    -> ``"1gbit@0,100mbit@120"``; a single phase from 0 is written as its value alone."""
    if len(schedule) == 1 and schedule[0][0] == 0:
        return fmt(schedule[0][1])
    return ",".join(f"{fmt(v)}@{t:g}" for t, v in schedule)
