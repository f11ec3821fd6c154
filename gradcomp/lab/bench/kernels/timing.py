"""The kernel benchmark's timing harness: thread settings, warm-up, interleaved rounds, statistics.

Every candidate of a case is called once per round (the order rotated by one each
round), round after round, so a
change in the machine's load hits them alike; the statistics are the median
and the 10th / 90th percentiles of the per-call wall times (seconds).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .cases import Case, op_bytes

__all__ = ["Timed", "sync_for", "warm", "measure", "stats", "all_threads", "set_threads", "restore_threads"]


@dataclass
class Timed:
    """A function timed in a case: ``kind`` is ``"backend"`` or ``"baseline"``; ``bytes``
    (read + written) is ``None`` until computed from a call's result."""

    fn: Callable[[], object]
    kind: str
    bytes: int | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)


def sync_for(device: str) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA); a no-op on the CPU."""
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def warm(case: Case, timed: dict[str, Timed], block: int, notes: list) -> dict[str, float]:
    """One untimed call each (compiles the torch.compile peer); selection byte counts
    come from the result. A failing function is dropped with a note. Returns the
    seconds of each first call."""
    first: dict[str, float] = {}
    for name in list(timed):
        t = timed[name]
        t0 = time.perf_counter()
        try:
            result = t.fn()
        except Exception as e:
            notes.append(f"{case.op} n={case.n} {case.dtype} threads={case.threads}: {name} failed: "
                         f"{type(e).__name__}: {e}")
            del timed[name]
            continue
        first[name] = time.perf_counter() - t0
        if t.bytes is None and t.kind == "backend":
            t.bytes = op_bytes(case, block, result)
    return first


def measure(timed: dict[str, Timed], repeat: int, budget: float, sync) -> None:
    """Interleaved rounds: each round times every function once, the order rotated by one
    each round (so no function always runs right after the same one: the reference leaves
    the caches full of its temporaries' dirty lines); no new round starts once 3 are done
    and ``budget`` seconds have passed."""
    start = time.perf_counter()
    order = list(timed.values())
    for r in range(repeat):
        k = r % len(order)
        for t in order[k:] + order[:k]:
            t0 = time.perf_counter()
            t.fn()
            sync()
            t.times.append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget:
            break


def stats(times: list[float]) -> dict:
    a = np.asarray(times)
    return {
        "median_s": float(np.median(a)),
        "p10_s": float(np.percentile(a, 10)),
        "p90_s": float(np.percentile(a, 90)),
        "rounds": len(times),
    }


def all_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(setting: str) -> int:
    """``torch.set_num_threads`` and the native module's OpenMP threads for ``setting``
    (``"all"`` or a count); returns the count."""
    t = all_threads() if setting == "all" else int(setting)
    torch.set_num_threads(t)
    _native_threads(t)
    return t


def restore_threads(torch_threads: int) -> None:
    """Back to ``torch_threads`` torch threads and the native module's default."""
    torch.set_num_threads(torch_threads)
    _native_threads(0)


def _native_threads(t: int) -> None:
    try:
        from gradcomp.kernels import cpu

        if cpu.unavailable_reason() is None:
            cpu.set_num_threads(t)
    except ImportError:
        pass
