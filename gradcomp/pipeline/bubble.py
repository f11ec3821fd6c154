"""The pipeline bubble: its formula, and the per-stage timelines it is measured from.

:func:`bubble_fraction` is the textbook bubble of GPipe (Huang et al. 2019) and 1F1B
(PipeDream-Flush, Narayanan et al. 2021), with interleaved 1F1B's chunks, for ``p`` equal,
communication-free stages; the planner and the study take it from here.

A :class:`StageTimeline` records one pipeline rank's spans (``forward``, ``backward``,
``weight`` for a split backward, ``codec`` for boundary compression) and *send marks* (when a
message's data was ready to leave), on the host's monotonic clock (``time.perf_counter``), so
that the stages' events merge. :func:`analyze` splits each stage's time in a window into the
spans' categories, ``idle`` (the input did not exist yet, and the drain after the last
operation) and ``wait`` (the input was in flight, or a send or the schedule's bookkeeping);
the measured bubble of a stage is ``(idle + wait) / window``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Span", "StageTimeline", "analyze", "bubble_fraction", "CATEGORIES"]

CATEGORIES = ("forward", "backward", "weight", "codec", "wait", "idle")
_COMPUTE = ("forward", "backward", "weight")


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle share of a pipeline step: ``(p - 1) / (v m + p - 1)`` for ``p`` stages, ``m``
    micro-batches and ``v`` model chunks per rank.

    ``v = 1``: GPipe (Huang et al. 2019) and 1F1B, which reorders the work but does not
    shorten the step; ``v > 1``: interleaved 1F1B (Narayanan et al. 2021). Stages are taken
    as equal and communication as free.

    Raises:
        ValueError: ``stages``, ``microbatches`` or ``chunks`` not an integer >= 1.
    """
    for name, v in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return (stages - 1) / (chunks * microbatches + stages - 1)


@dataclass
class Span:
    """One operation of a stage: ``kind`` on micro-batch ``mb`` of (virtual)
    stage ``stage``, from ``t0`` to ``t1`` seconds; ``inner_codec``: seconds of
    decompression inside it; ``needs``: the send mark key it waited for."""

    kind: str
    stage: int
    mb: int
    t0: float
    t1: float
    inner_codec: float = 0.0
    needs: tuple | None = None


@dataclass
class StageTimeline:
    """What one pipeline rank records (picklable): spans, send marks, step windows.

    Attributes:
        rank: the pipeline rank; spans: operations in time order;
        marks: ``{(direction, src_stage, mb, step): t}`` send marks;
        steps: ``(t0, t1)`` of each step on this rank.
    """

    rank: int
    spans: list[Span] = field(default_factory=list)
    marks: dict = field(default_factory=dict)
    steps: list[tuple[float, float]] = field(default_factory=list)
    step: int = 0

    @contextmanager
    def span(self, kind: str, stage: int, mb: int, needs: tuple | None = None):
        """Record the enclosed code as one span; yields it (set ``inner_codec`` inside)."""
        s = Span(kind, stage, mb, time.perf_counter(), 0.0, needs=needs)
        try:
            yield s
        finally:
            s.t1 = time.perf_counter()
            self.spans.append(s)

    def mark(self, direction: str, src_stage: int, mb: int) -> None:
        """A message of ``direction`` (``"fwd"``/``"bwd"``) from ``src_stage`` for ``mb`` is ready."""
        self.marks[(direction, src_stage, mb, self.step)] = time.perf_counter()

    @contextmanager
    def step_window(self):
        """Record the enclosed code as one step (marks made inside carry its number)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.steps.append((t0, time.perf_counter()))
            self.step += 1


def _split_gap(gap0: float, gap1: float, ready: float | None) -> tuple[float, float]:
    """(idle, wait) of a gap that ended when an input ready at ``ready`` was used."""
    if ready is None:
        return 0.0, gap1 - gap0
    idle = min(max(ready - gap0, 0.0), gap1 - gap0)
    return idle, gap1 - gap0 - idle


def analyze(timelines: list[StageTimeline], skip: int = 0, steps: list[int] | None = None) -> dict:
    """Time per category and bubble per rank, summed over steps.

    Step ``i``'s window runs from the earliest rank's start to the latest
    rank's end of step ``i`` (:meth:`StageTimeline.step_window`).

    Args:
        timelines: one per rank (rank order), on a shared clock.
        skip: leading steps to leave out (warm-up).
        steps: the step numbers to analyse (default: all after ``skip``).

    Returns:
        ``{"per_rank": [{category: seconds, "window": s, "bubble": f, "idle_fraction": f}],
        "bubble": overall fraction, "idle_fraction": overall, "window_s": total seconds}``.

    Raises:
        ValueError: a step number that not every timeline recorded.
    """
    marks: dict = {}
    for tl in timelines:
        marks.update(tl.marks)
    n = min(len(tl.steps) for tl in timelines)
    if steps is None:
        steps = list(range(skip, n))
    elif any(not 0 <= i < n for i in steps):
        raise ValueError(f"steps must be in [0, {n}), got {steps}")
    windows = {i: (min(tl.steps[i][0] for tl in timelines), max(tl.steps[i][1] for tl in timelines))
               for i in steps}
    per_rank = []
    for tl in timelines:
        acc = dict.fromkeys(CATEGORIES, 0.0)
        total = 0.0
        for i, (w0, w1) in windows.items():
            total += w1 - w0
            spans = sorted((s for s in tl.spans if w0 <= s.t0 and s.t1 <= w1), key=lambda s: s.t0)
            cursor = w0
            for s in spans:
                ready = None
                if s.needs is not None:
                    ready = marks.get((*s.needs, i))
                if s.t0 > cursor:
                    idle, wait = _split_gap(cursor, s.t0, ready)
                    acc["idle"] += idle
                    acc["wait"] += wait
                dur = s.t1 - max(s.t0, cursor)
                inner = min(s.inner_codec, max(dur, 0.0))
                acc[s.kind] += max(dur, 0.0) - inner
                acc["codec"] += inner
                cursor = max(cursor, s.t1)
            acc["idle"] += max(0.0, w1 - cursor)
        blocked = acc["idle"] + acc["wait"]
        per_rank.append({**acc, "window": total,
                         "bubble": blocked / total if total else 0.0,
                         "idle_fraction": acc["idle"] / total if total else 0.0})
    total = sum(r["window"] for r in per_rank)
    return {"per_rank": per_rank,
            "bubble": sum(r["idle"] + r["wait"] for r in per_rank) / total if total else 0.0,
            "idle_fraction": sum(r["idle"] for r in per_rank) / total if total else 0.0,
            "window_s": total / max(1, len(per_rank))}
