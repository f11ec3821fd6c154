"""The rate of an emulated link over time: phases of a schedule, each redrawn by jitter.

:class:`RateSchedule` is the arithmetic (the rate host ``h``'s link runs at ``t`` seconds after
the schedule's origin); :class:`Shaper` is the thread that applies it at every phase start and
jitter redraw (the cluster's ``tc qdisc change``) and restarts it from phase 0 on request;
:class:`ScheduleRemote` lets a rank in another process ask for that restart (at its run's
start), so that every run of a study meets the same phases. Used by
:class:`gradcomp.lab.cluster.LocalCluster`; see docs/changing-conditions.md.
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from gradcomp.lab.units import parse_rate, parse_schedule

__all__ = ["RateSchedule", "Shaper", "ScheduleRemote", "link_rate_bps", "link_schedule",
           "MIN_RATE_BPS", "MAX_RATE_BPS"]

@dataclass(frozen=True)
class RateSchedule:
    """Which rate each host's link runs at, over time.

    Attributes:
        phases: ``((start_s, rate_bps), ...)``, starts increasing, the first 0: from each start
            on, the link's base rate is that phase's rate (bit/s).
        jitter: fraction ``f`` in [0, 1): in jitter period ``p >= 1`` (``period_s`` seconds
            each, period 0 unjittered) host ``h``'s rate is the base times ``1 + f u``,
            ``u ~ U(-1, 1)`` seeded by ``(seed, h, p)``.
        period_s: seconds per jitter period; seed: the redraws' seed.
    """

    phases: tuple[tuple[float, int], ...]
    jitter: float = 0.0
    period_s: float = 1.0
    seed: int = 0

    def __post_init__(self):
        starts = [t for t, _ in self.phases]
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"phases must start at 0 with increasing starts, got {self.phases!r}")

    @property
    def changing(self) -> bool:
        """Whether the rate ever changes (several phases, or jitter)."""
        return len(self.phases) > 1 or self.jitter > 0

    def phase_at(self, t_s: float) -> int:
        """The index of the phase in force ``t_s`` seconds after the origin."""
        return max(0, bisect.bisect_right([t for t, _ in self.phases], t_s) - 1)

    def base_at(self, t_s: float) -> int:
        """The phase's rate in bit/s at ``t_s`` (before jitter)."""
        return self.phases[self.phase_at(t_s)][1]

    def rate_at(self, host: int, t_s: float) -> int:
        """Host ``host``'s link rate in bit/s at ``t_s`` (the base, jittered)."""
        base = self.base_at(t_s)
        period = int(t_s // self.period_s)
        if self.jitter == 0 or period == 0:
            return base
        import numpy as np

        u = np.random.default_rng([self.seed, host, period]).uniform(-1.0, 1.0)
        return int(round(base * (1.0 + self.jitter * u)))

    def next_change(self, t_s: float) -> float:
        """The first time after ``t_s`` at which a rate may change (inf: none)."""
        nxt = [t for t, _ in self.phases if t > t_s]
        out = nxt[0] if nxt else math.inf
        if self.jitter > 0:
            out = min(out, (math.floor(t_s / self.period_s) + 1) * self.period_s)
        return out


class Shaper:
    """Applies a :class:`RateSchedule` on a thread: ``apply(t_s)`` sets every link to its rate
    at ``t_s`` seconds after the origin, called at each change.

    Args:
        schedule: what to apply.
        apply: sets the links (raises on failure; the failure ends the thread unless stopping).
    """

    def __init__(self, schedule: RateSchedule, apply: Callable[[float], None]):
        self.schedule, self.apply = schedule, apply
        self.origin = time.monotonic()
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, name: str) -> None:
        """Start applying from now (the origin); phase 0's rate is assumed in force."""
        self.origin = time.monotonic()
        self._spawn(self._loop, name)

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=name)
        t.start()
        self._threads.append(t)

    def restart(self) -> float:
        """Start the schedule again from 0 now: phase 0's rates are applied before this
        returns. Returns the new origin (``time.monotonic()`` clock)."""
        with self._lock:
            self.apply(0.0)
            self.origin = time.monotonic()
        self._wake.set()
        return self.origin

    def now_s(self) -> float:
        """Seconds since the origin."""
        return time.monotonic() - self.origin

    def _loop(self) -> None:
        done = -math.inf  # the last time applied
        while not self._stop.is_set():
            origin = self.origin
            t_next = self.schedule.next_change(max(time.monotonic() - origin, done))
            if t_next == math.inf:
                timeout = None
            else:
                timeout = max(0.0, origin + t_next - time.monotonic())
            if self._wake.wait(timeout):
                self._wake.clear()
                done = 0.0
                continue
            with self._lock:
                if self._stop.is_set() or self.origin != origin:
                    continue
                try:
                    self.apply(t_next)
                except Exception:
                    if self._stop.is_set():
                        return
                    raise
                done = t_next

    def remote(self, name: str = "gradcomp-shaper-remote", ctx=None) -> "ScheduleRemote":
        """A handle for ranks in other processes (``ctx``: their multiprocessing context,
        default :func:`gradcomp.launch.start_method`'s): a thread here answers its
        :meth:`ScheduleRemote.restart` requests."""
        if ctx is None:
            import multiprocessing as mp

            from gradcomp.launch import start_method

            ctx = mp.get_context(start_method())
        handle = ScheduleRemote(ctx)

        def serve():
            while not self._stop.is_set():
                try:
                    handle.requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                handle.acks.put(self.restart())

        self._spawn(serve, name)
        return handle

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads (waits up to ``timeout`` seconds for each)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)
        self._threads = []


class ScheduleRemote:
    """A picklable handle (pass it to the ranks at their launch) with which one rank
    restarts the link schedule of the cluster it runs in."""

    def __init__(self, ctx):
        self.requests, self.acks = ctx.Queue(), ctx.Queue()

    def restart(self, timeout: float = 60.0) -> float:
        """Restart the schedule from phase 0 and wait until phase 0's rates are in force.

        Returns:
            The schedule's new origin on the ``time.monotonic()`` clock (one clock for every
            process of the machine).

        Raises:
            TimeoutError: no answer within ``timeout`` seconds.
        """
        self.requests.put(0)
        try:
            return self.acks.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the emulated cluster did not restart its link schedule within "
                               f"{timeout:g} s") from None


#: The link rates a cluster shapes, in bit/s (100 kbit/s to 400 gbit/s).
MIN_RATE_BPS, MAX_RATE_BPS = 1e5, 4e11


def link_rate_bps(rate: str | int | float, name: str = "rate") -> int:
    """A link rate a cluster can shape, in bit/s: :func:`gradcomp.lab.units.parse_rate`'s syntax
    (``"100mbit"``, ``"2.5gbit"``, or a number of bit/s), from 100 kbit/s to 400 gbit/s.

    Raises:
        ValueError: not a rate, or outside that range.
    """
    rate_bps = parse_rate(rate, name)
    if not MIN_RATE_BPS <= rate_bps <= MAX_RATE_BPS:
        raise ValueError(f"{name} must be between 100kbit and 400gbit, got {rate!r}")
    return int(round(rate_bps))


def link_schedule(rate, name: str = "rate") -> tuple[tuple[float, int], ...]:
    """A link's rate over time, ``((start_s, rate_bps), ...)``: a rate (:func:`link_rate_bps`),
    a schedule ``"1gbit@0,100mbit@120"`` (each rate from that second on,
    :func:`gradcomp.lab.units.parse_schedule`), or such ``(start_s, rate)`` pairs.

    Raises:
        ValueError: a bad rate or schedule (the message names ``name`` and the format).
    """
    if isinstance(rate, str):
        return tuple(parse_schedule(rate, link_rate_bps, name, "RATE", "1gbit@0,100mbit@120"))
    if not isinstance(rate, (list, tuple)):
        return ((0.0, link_rate_bps(rate, name)),)
    try:
        return RateSchedule(tuple((float(t), link_rate_bps(r, name)) for t, r in rate)).phases
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a rate or (start_s, rate) pairs starting at 0: {e}") from None
