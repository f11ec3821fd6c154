"""Step timeline: where each training step's seconds went, on one rank.

A :class:`StepTimeline` records, per step, timestamped *spans* (an interval in
one phase, from any thread) and *marks* (instants). The training loop opens
and closes steps and marks its boundaries; the transports report what they
do while a timeline is *active* on their thread (:meth:`StepTimeline.active`),
so the library records nothing and costs nothing when no timeline is set:

* ``"communicate"``: a transport blocked waiting for its transfers
  (:meth:`gradcomp.comm.p2p.Transfer.wait`, the parameter server's waits);
* ``"compress"`` / ``"decompress"``: the codec's work (compressing this
  rank's data or a partial sum; decoding received payloads into the result);
* ``"collective"``: the whole compressed collective (the DDP hook's job).

Clock: :func:`time.perf_counter` (``CLOCK_MONOTONIC`` on Linux), the same
clock for every process of one machine, so the ranks of an emulated cluster
(or of one host) compare their timestamps directly: that is how the time a
rank spends waiting for its slowest peer (the *bubble*) is told apart from
transfer time (see :func:`sync_step_phases`). A step's phases are
attributed so that they add up to its wall time exactly (``other`` takes
what no phase claims).

Cost: a span is two clock reads and one list append under a lock; what the
study's steps pay for it: docs/results/time-study.md.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["StepTimeline", "StepRecord", "PHASES", "active", "span", "now", "sync_step_phases",
           "async_step_phases", "interval_overlap"]

#: The phases a step's wall time is split into (seconds each), in report order.
PHASES = ("compute", "compress", "communicate", "wait", "decompress", "apply", "other")

_local = threading.local()


def now() -> float:
    """The timeline clock, in seconds."""
    return time.perf_counter()


@dataclass
class StepRecord:
    """One step's raw timestamps (seconds on the shared clock).

    Attributes:
        start, end: the step's boundaries.
        marks: name -> instant (e.g. ``"backward_end"``, ``"handoff"``).
        spans: ``(phase, t0, t1)`` recorded by any thread during the step.
        phases: the attributed seconds per phase (filled by the attribution).
    """

    start: float
    end: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return self.end - self.start


class StepTimeline:
    """Per-step spans and marks of one rank; thread-safe.

    Spans recorded while no step is open (between steps) go to the step that
    opens next, since their work delays it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.steps: list[StepRecord] = []
        self._open: StepRecord | None = None
        self._pending: list[tuple[str, float, float]] = []

    def begin_step(self, t: float | None = None) -> None:
        """Open a step at ``t`` (default now)."""
        with self._lock:
            rec = StepRecord(start=now() if t is None else t)
            rec.spans.extend(self._pending)
            self._pending = []
            self._open = rec

    def end_step(self, t: float | None = None) -> StepRecord:
        """Close the open step at ``t`` (default now) and return its record.

        Raises:
            RuntimeError: no step is open.
        """
        with self._lock:
            rec = self._open
            if rec is None:
                raise RuntimeError("StepTimeline.end_step without begin_step")
            rec.end = now() if t is None else t
            self.steps.append(rec)
            self._open = None
            return rec

    def mark(self, name: str, t: float | None = None) -> None:
        """Record instant ``name`` in the open step (the last one wins)."""
        t = now() if t is None else t
        with self._lock:
            if self._open is not None:
                self._open.marks[name] = t

    def marked(self, name: str) -> float | None:
        """Instant ``name`` of the open step, or None."""
        with self._lock:
            return self._open.marks.get(name) if self._open is not None else None

    def add_span(self, phase: str, t0: float, t1: float) -> None:
        """Record that ``[t0, t1]`` was spent in ``phase``."""
        with self._lock:
            (self._open.spans if self._open is not None else self._pending).append((phase, t0, t1))

    @contextmanager
    def span(self, phase: str):
        """``with timeline.span("compute"): ...`` records the block as one span."""
        t0 = now()
        try:
            yield
        finally:
            self.add_span(phase, t0, now())

    @contextmanager
    def active(self):
        """Make this timeline the one the transports report to, on this thread."""
        prev = getattr(_local, "timeline", None)
        _local.timeline = self
        try:
            yield self
        finally:
            _local.timeline = prev

    def phase_totals(self) -> dict[str, float]:
        """Seconds per phase summed over the attributed steps."""
        out = dict.fromkeys(PHASES, 0.0)
        for rec in self.steps:
            for k, val in rec.phases.items():
                out[k] = out.get(k, 0.0) + val
        return out


def active() -> StepTimeline | None:
    """The timeline active on this thread, or None."""
    return getattr(_local, "timeline", None)


@contextmanager
def span(phase: str):
    """Record the block as a ``phase`` span of the active timeline (no-op without one)."""
    tl = getattr(_local, "timeline", None)
    if tl is None:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        tl.add_span(phase, t0, now())


def interval_overlap(spans, lo: float, hi: float, phase: str) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``phase`` spans."""
    if hi <= lo:
        return 0.0
    cut = sorted((max(a, lo), min(b, hi)) for p, a, b in spans if p == phase and b > lo and a < hi)
    total, cur_lo, cur_hi = 0.0, None, None
    for a, b in cut:
        if cur_hi is None or a > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = a, b
        else:
            cur_hi = max(cur_hi, b)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def sync_step_phases(rec: StepRecord, last_handoff: float) -> dict[str, float]:
    """Attribute a synchronous data-parallel step's wall time to :data:`PHASES`.

    The step needs the marks ``"handoff"`` (the gradients are computed: the
    last bucket went to the communication hook), ``"backward_end"``
    (``loss.backward()`` returned: DDP has waited for every bucket's
    collective) and ``"apply_start"`` (optimizer step begins). ``last_handoff``
    is the latest ``"handoff"`` of any rank in this step (shared clock): no
    collective can finish before it.

    * ``compute``: step start -> handoff (forward, backward; a straggler's delay);
    * the *exposed communication* window, handoff -> backward end, split into
      ``wait`` (up to ``last_handoff``: blocked on a slower peer, the bubble),
      then, in the rest of the window, ``compress`` and ``decompress`` (the
      codec's spans) and ``communicate`` (the rest of the ``"collective"``
      span: blocked on transfers, and the transport's own work of posting
      and matching messages);
    * ``apply``: apply start -> step end (optimizer step);
    * ``other``: whatever is left (DDP's bookkeeping, Python), so the phases
      sum to the step's wall time.

    Returns:
        Seconds per phase (also stored in ``rec.phases``), plus
        ``exposed_comm`` (the window's length, not a separate share of the sum).
    """
    handoff = rec.marks.get("handoff", rec.marks.get("backward_end", rec.start))
    back = rec.marks.get("backward_end", handoff)
    apply_start = rec.marks.get("apply_start", back)
    compute = max(0.0, handoff - rec.start)
    exposed = max(0.0, back - handoff)
    wait = min(exposed, max(0.0, last_handoff - handoff))
    lo = handoff + wait
    compress = interval_overlap(rec.spans, lo, back, "compress")
    decompress = interval_overlap(rec.spans, lo, back, "decompress")
    collective = interval_overlap(rec.spans, lo, back, "collective")
    communicate = max(0.0, collective - compress - decompress)
    apply = max(0.0, rec.end - apply_start)
    phases = {"compute": compute, "compress": compress, "communicate": communicate, "wait": wait,
              "decompress": decompress, "apply": apply}
    phases["other"] = max(0.0, rec.wall - sum(phases.values()))
    rec.phases = dict(phases)
    phases["exposed_comm"] = exposed
    return phases


def async_step_phases(rec: StepRecord) -> dict[str, float]:
    """Attribute an asynchronous (parameter-server) worker step to :data:`PHASES`.

    The worker records disjoint spans: ``compute`` (forward, backward, a
    straggler's delay), ``compress`` (its push), ``communicate`` (blocked on
    a transfer to or from the server), ``wait`` (the part of a round trip
    the server reported its request queued behind other workers' requests),
    ``decompress`` and ``apply`` (decoding the pulled parameters into the
    replica). Each phase is the time its spans cover within the step;
    ``other`` is the rest. ``exposed_comm`` is ``communicate + wait``: nothing
    overlaps a worker's round trips.
    """
    phases = {p: interval_overlap(rec.spans, rec.start, rec.end, p) for p in PHASES if p != "other"}
    phases["other"] = max(0.0, rec.wall - sum(phases.values()))
    rec.phases = dict(phases)
    phases["exposed_comm"] = phases["communicate"] + phases["wait"]
    return phases
