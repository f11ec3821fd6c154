"""Traffic accounting: the bytes a rank really moved, and what uncompressed would have.

Counters are kept per phase (``"reduce_scatter"``, ``"allgather"``, ...) and,
for collectives that know where their peers are (the hierarchical allreduce),
also per tier of the network: ``"intra_host"`` (ranks of one host) and
``"inter_host"`` (what the links between hosts carried). Events that are not
bytes (a dropped push, a changed quorum) are counted by kind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

__all__ = ["TrafficMeter", "PhaseCounters", "TIERS"]

#: the network tiers a collective may record its bytes under
TIERS = ("intra_host", "inter_host")


@dataclass
class PhaseCounters:
    """Counters of one phase (e.g. ``"reduce_scatter"``, ``"allgather"``, ``"push"``, ``"pull"``).

    All sizes are bytes; ``messages_*`` count point-to-point messages.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes_sent: int = 0
    raw_bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    seconds: float = 0.0


_FIELDS = tuple(f.name for f in fields(PhaseCounters))


class TrafficMeter:
    """Per-rank counters of wire traffic, split by phase; thread-safe.

    ``bytes_sent`` / ``bytes_received`` are the payload bytes this rank put on /
    took off the transport. ``raw_bytes_sent`` is what the same exchange would
    have sent uncompressed in float32 (for a ring allreduce of n elements over N
    ranks: ``2 (N - 1) / N * 4 n`` per rank). ``compression_ratio`` =
    ``raw_bytes_sent / bytes_sent``.

    ``tiers`` holds the same counters per network tier (:data:`TIERS`) for the
    bytes a collective recorded with ``tier=`` (the hierarchical allreduce
    records every byte under one tier); a byte recorded with a tier counts in
    its phase too, so the totals are unchanged.

    ``switches`` logs every codec switch an adaptive policy
    (:class:`gradcomp.Adaptive`) made, one JSON-ready dict per switch (step,
    bucket, from, to and the agreed timings that decided it), and every move of
    an adaptive local SGD period (:class:`gradcomp.SyncPeriod`; ``kind``
    ``"sync_every"``, with its reason); every rank logs the same entries, so
    :meth:`merge` keeps each distinct entry once.

    ``events`` counts what happened to the exchange rather than bytes, by kind
    (:meth:`record_event`): pushes a parameter server dropped or applied stale
    (``"push_dropped"``, ``"push_stale"``), changes of a torchft quorum's size
    (``"quorum_change"``), steps not committed (``"step_rolled_back"``), ...; each
    rank counts its own, so :meth:`merge` adds them.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.phases: dict[str, PhaseCounters] = {}
        self.tiers: dict[str, PhaseCounters] = {}
        self.steps = 0
        self.switches: list[dict] = []
        self.events: dict[str, int] = {}
        self._scope = threading.local()  # the calling thread's tier_scope, if any

    @contextmanager
    def tier_scope(self, tier: str) -> Iterator[None]:
        """Within the block, bytes and seconds this thread records without a
        tier count in ``tier`` (one of :data:`TIERS`): for a collective that
        runs over one tier's group without knowing it (e.g. the replicate
        all-reduce of HSDP, :mod:`gradcomp.hsdp`). Records naming a tier keep it.

        Raises:
            ValueError: ``tier`` is not one of :data:`TIERS`.
        """
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        outer = getattr(self._scope, "tier", None)
        self._scope.tier = tier
        try:
            yield
        finally:
            self._scope.tier = outer

    def _phase(self, phase: str) -> PhaseCounters:
        c = self.phases.get(phase)
        if c is None:
            c = self.phases[phase] = PhaseCounters()
        return c

    def _counters(self, phase: str, tier: str | None) -> list[PhaseCounters]:
        if tier is None:
            tier = getattr(self._scope, "tier", None)
        if tier is None:
            return [self._phase(phase)]
        if tier not in TIERS:
            raise ValueError(f"tier must be None or one of {TIERS}, got {tier!r}")
        c = self.tiers.get(tier)
        if c is None:
            c = self.tiers[tier] = PhaseCounters()
        return [self._phase(phase), c]

    def record_send(self, nbytes: int, raw_nbytes: int | None = None, phase: str = "default",
                    messages: int = 1, tier: str | None = None) -> None:
        """Count ``nbytes`` sent (and their uncompressed equivalent ``raw_nbytes``,
        default ``nbytes``) in ``phase`` and, if given, in ``tier`` (one of :data:`TIERS`)."""
        with self._lock:
            for c in self._counters(phase, tier):
                c.bytes_sent += int(nbytes)
                c.raw_bytes_sent += int(nbytes if raw_nbytes is None else raw_nbytes)
                c.messages_sent += messages

    def record_recv(self, nbytes: int, raw_nbytes: int | None = None, phase: str = "default",
                    messages: int = 1, tier: str | None = None) -> None:
        """Count ``nbytes`` received (and their uncompressed equivalent)."""
        with self._lock:
            for c in self._counters(phase, tier):
                c.bytes_received += int(nbytes)
                c.raw_bytes_received += int(nbytes if raw_nbytes is None else raw_nbytes)
                c.messages_received += messages

    def record_raw(self, sent: int = 0, received: int = 0, phase: str = "default") -> None:
        """Add to the uncompressed-equivalent counters only (when the formula for
        the uncompressed exchange differs from the compressed one's messages)."""
        with self._lock:
            c = self._phase(phase)
            c.raw_bytes_sent += int(sent)
            c.raw_bytes_received += int(received)

    def record_time(self, seconds: float, phase: str = "default", tier: str | None = None) -> None:
        """Add wall time (seconds) spent in a phase (and in ``tier``, if given)."""
        with self._lock:
            for c in self._counters(phase, tier):
                c.seconds += float(seconds)

    def record_switch(self, entry: dict) -> None:
        """Log one switch (a JSON-ready dict, see :attr:`switches`)."""
        with self._lock:
            self.switches.append(dict(entry))

    def record_event(self, kind: str, count: int = 1) -> None:
        """Count ``count`` events of ``kind`` (see :attr:`events`).

        Args:
            kind: a non-empty name, e.g. ``"push_dropped"`` or ``"quorum_change"``.
            count: an int >= 0.

        Raises:
            TypeError / ValueError: ``kind`` not a non-empty str, ``count`` not an int >= 0.
        """
        if not isinstance(kind, str) or not kind:
            raise TypeError(f"kind must be a non-empty str, got {kind!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        with self._lock:
            self.events[kind] = self.events.get(kind, 0) + count

    def step(self) -> None:
        """Mark the end of a training step (for per-step averages)."""
        with self._lock:
            self.steps += 1

    def _sum(self, name: str):
        with self._lock:
            return sum(getattr(c, name) for c in self.phases.values())

    @property
    def bytes_sent(self) -> int:
        return self._sum("bytes_sent")

    @property
    def bytes_received(self) -> int:
        return self._sum("bytes_received")

    @property
    def raw_bytes_sent(self) -> int:
        return self._sum("raw_bytes_sent")

    @property
    def raw_bytes_received(self) -> int:
        return self._sum("raw_bytes_received")

    @property
    def compression_ratio(self) -> float:
        """``raw_bytes_sent / bytes_sent`` (1.0 when nothing was sent)."""
        sent = self.bytes_sent
        return self.raw_bytes_sent / sent if sent else 1.0

    def reset(self) -> None:
        with self._lock:
            self.phases.clear()
            self.tiers.clear()
            self.steps = 0
            self.switches.clear()
            self.events.clear()

    def merge(self, other: "TrafficMeter | dict") -> None:
        """Add another meter's counters (or its :meth:`as_dict`) into this one."""
        if isinstance(other, TrafficMeter):  # counter by counter: no JSON copy on the hot path
            with other._lock:
                phases = {name: {f: getattr(c, f) for f in _FIELDS} for name, c in other.phases.items()}
                tiers = {name: {f: getattr(c, f) for f in _FIELDS} for name, c in other.tiers.items()}
                steps, switches, events = other.steps, list(other.switches), dict(other.events)
        else:
            phases, steps, switches = other.get("phases", {}), int(other.get("steps", 0)), other.get("switches", ())
            tiers, events = other.get("tiers", {}), other.get("events", {})
        with self._lock:
            for name, vals in phases.items():
                c = self._phase(name)
                for f, val in vals.items():
                    setattr(c, f, getattr(c, f) + val)
            for name, vals in tiers.items():
                c = self.tiers.setdefault(name, PhaseCounters())
                for f, val in vals.items():
                    setattr(c, f, getattr(c, f) + val)
            self.steps = max(self.steps, steps)
            for entry in switches:
                if entry not in self.switches:
                    self.switches.append(dict(entry))
            for kind, count in events.items():
                self.events[kind] = self.events.get(kind, 0) + int(count)

    def as_dict(self) -> dict:
        """JSON-ready totals, per-phase counters and per-tier counters (``"tiers"``:
        ``{"intra_host": {...}, "inter_host": {...}}``, empty when no collective
        recorded a tier)."""
        with self._lock:
            phases = {k: asdict(c) for k, c in self.phases.items()}
            tiers = {k: asdict(c) for k, c in self.tiers.items()}
            steps = self.steps
            switches = [dict(e) for e in self.switches]
            events = dict(sorted(self.events.items()))
        tot = {f: sum(p[f] for p in phases.values()) for f in asdict(PhaseCounters())}
        sent = tot["bytes_sent"]
        return {
            "bytes_sent": tot["bytes_sent"],
            "bytes_received": tot["bytes_received"],
            "raw_bytes_sent": tot["raw_bytes_sent"],
            "raw_bytes_received": tot["raw_bytes_received"],
            "compression_ratio": (tot["raw_bytes_sent"] / sent) if sent else 1.0,
            "steps": steps,
            "phases": phases,
            "tiers": tiers,
            "switches": switches,
            "events": events,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    def __repr__(self):
        return (f"TrafficMeter(bytes_sent={self.bytes_sent}, bytes_received={self.bytes_received}, "
                f"raw_bytes_sent={self.raw_bytes_sent}, compression_ratio={self.compression_ratio:.3f})")
