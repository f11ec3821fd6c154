"""Time in the study: emulated stragglers and jitter, time to target, summary statistics.

Stragglers and compute jitter (applied inside each worker's compute, before
its backward pass, so the delay holds back the gradients as slow hardware
would):

* ``--straggler RANK:FACTOR[@SECONDS]``: worker ``RANK``'s compute takes ``FACTOR``
  times as long (from ``SECONDS`` into the run's training clock on): each step it sleeps ``(FACTOR - 1) x`` its measured compute
  before its gradients leave the backward pass (sync and async:
  :meth:`ComputeDelay.attach`, this step's forward + backward; local mode:
  :meth:`ComputeDelay.sleep`, the median of its last 5 steps);
* ``--compute-jitter CV``: every worker's compute of every step is stretched
  by a factor ``F`` drawn from a lognormal with mean 1 and coefficient of
  variation ``CV`` (``sigma^2 = ln(1 + CV^2)``, ``mu = -sigma^2 / 2``),
  seeded by ``(seed, worker, step)`` so a run reproduces. Compute cannot be
  sped up, so a draw below 1 leaves the step as it is: the realised factor
  is ``max(1, F)``.

Both multiply: a straggler with jitter sleeps ``(FACTOR x max(1, F) - 1) x``
its compute.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

__all__ = ["ComputeDelay", "jitter_factor", "time_to_target", "percentile", "mean_ci95",
           "parse_straggler", "parse_straggler_onset", "step_series", "server_queue", "summarize_time"]


def parse_straggler(text: str, workers: int | None = None) -> tuple[int, float]:
    """``"1:3"`` -> ``(1, 3.0)``.

    Raises:
        ValueError: not ``RANK:FACTOR`` with an integer worker rank in
            ``[0, workers)`` and a finite ``FACTOR >= 1``.
    """
    rank_s, sep, factor_s = str(text).partition(":")
    try:
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        raise ValueError(f"--straggler must be RANK:FACTOR (e.g. 1:3), got {text!r}") from None
    if not sep:
        raise ValueError(f"--straggler must be RANK:FACTOR (e.g. 1:3), got {text!r}")
    if rank < 0 or (workers is not None and rank >= workers):
        hi = f"{workers - 1}" if workers is not None else "workers - 1"
        raise ValueError(f"--straggler rank must be a worker in 0..{hi}, got {rank}")
    if not (1.0 <= factor < 1e3):
        raise ValueError(f"--straggler FACTOR must be a number >= 1 (and < 1000), got {factor_s!r}")
    return rank, factor


def parse_straggler_onset(text: str, workers: int | None = None) -> tuple[int, float, float]:
    """``"1:3@60"`` -> ``(1, 3.0, 60.0)``: worker 1 turns 3x slower 60 s into the run;
    ``"1:3"`` -> ``(1, 3.0, 0.0)`` (slow from the start).

    Raises:
        ValueError: not one ``RANK:FACTOR[@SECONDS]`` (:func:`parse_straggler`; SECONDS a
            finite number >= 0); the message names ``--straggler`` and the format.
    """
    from gradcomp.lab.units import parse_schedule

    form = "RANK:FACTOR[@SECONDS]"
    if "," in str(text):
        raise ValueError(f"--straggler must be one {form} (e.g. 1:3@60: worker 1 turns 3x slower "
                         f"60 s into the run), got {text!r}")
    items = parse_schedule(text, lambda t, n: parse_straggler(t, workers), "--straggler", "RANK:FACTOR",
                           "1:3@60", from_zero=False)
    start, (rank, factor) = items[0]  # one item: parse_schedule gave exactly one
    return rank, factor, start


def jitter_factor(cv: float, seed: int, worker: int, step: int) -> float:
    """A lognormal draw with mean 1 and coefficient of variation ``cv``
    (1.0 when ``cv == 0``), deterministic in ``(seed, worker, step)``."""
    if cv <= 0:
        return 1.0
    import numpy as np

    sigma = math.sqrt(math.log1p(cv * cv))
    z = np.random.default_rng([int(seed), int(worker), int(step), 0x6A17]).standard_normal()
    return float(math.exp(sigma * z - sigma * sigma / 2))


@dataclass
class ComputeDelay:
    """The sleep that stretches one worker's compute (see the module docstring).

    Attributes:
        worker: this worker's index; straggler: ``(worker, factor)`` or None;
        jitter_cv: the compute jitter's CV; seed: its seed.
        straggler_from_s: the straggler is slow from this many seconds after :meth:`start` on.
    """

    worker: int
    straggler: tuple[int, float] | None = None
    jitter_cv: float = 0.0
    seed: int = 0
    straggler_from_s: float = 0.0
    last_slept: float = 0.0
    _recent: list = field(default_factory=list)
    _step: int = 0
    _t0: float | None = None
    _origin: float | None = None

    @property
    def active(self) -> bool:
        return self.jitter_cv > 0 or (self.straggler is not None and self.straggler[0] == self.worker)

    def start(self, origin: float) -> None:
        """The run's training clock started at ``origin`` (``time.perf_counter()``)."""
        self._origin = origin

    def slow_now(self) -> bool:
        """Whether this worker is the straggler and its onset has passed."""
        if self.straggler is None or self.straggler[0] != self.worker:
            return False
        return self.straggler_from_s <= 0 or (
            self._origin is not None and time.perf_counter() - self._origin >= self.straggler_from_s)

    def factor(self, step: int) -> float:
        """Total stretch of step ``step``'s compute (>= 1), as of now."""
        f = max(1.0, jitter_factor(self.jitter_cv, self.seed, self.worker, step))
        if self.slow_now():
            f *= self.straggler[1]
        return f

    def sleep(self, step: int, forward_s: float) -> float:
        """Sleep for this step's extra compute; returns the seconds really slept.

        ``forward_s``: this step's forward time (used only before the first
        measured compute, see :meth:`observe`).
        """
        if not self.active:
            return 0.0
        base = statistics.median(self._recent) if self._recent else 3.0 * forward_s
        extra = (self.factor(step) - 1.0) * base
        if extra <= 0:
            return 0.0
        t0 = time.perf_counter()
        time.sleep(extra)
        return time.perf_counter() - t0  # what it really slept (a loaded host oversleeps)

    def attach(self, param, timeline=None):
        """Delay this worker's gradients from inside its backward pass.

        Registers a hook on ``param``'s gradient (choose the parameter whose
        gradient is computed last: the first layer's weight of a
        feed-forward model). When it fires, the step's forward and almost
        all of its backward are done: it sleeps ``(factor(step) - 1) x`` the
        seconds since :meth:`begin`, before the gradient is handed on (to
        DDP's reducer or the optimizer), so the factor applies to this very
        step's measured compute. The sleep is recorded as a ``"delay"`` span
        of ``timeline`` and in :attr:`last_slept`. Returns the hook handle.
        """
        def hook(grad):
            if self.active and self._t0 is not None:
                t = time.perf_counter()
                extra = (self.factor(self._step) - 1.0) * (t - self._t0)
                if extra > 0:
                    time.sleep(extra)
                    t1 = time.perf_counter()
                    self.last_slept = t1 - t
                    if timeline is not None:
                        timeline.add_span("delay", t, t1)
            return grad

        return param.register_hook(hook)

    def begin(self, step: int, t0: float) -> None:
        """Step ``step`` started at ``t0`` (for :meth:`attach`'s hook)."""
        self._step, self._t0, self.last_slept = step, t0, 0.0

    def observe(self, compute_s: float) -> None:
        """The step's measured compute without the sleep (the next steps' base)."""
        self._recent = [*self._recent[-4:], compute_s]


def time_to_target(times: list[float], steps: list[int], accuracies: list[float],
                   target: float) -> tuple[float, int] | None:
    """``(seconds, step)`` of the first evaluation with accuracy >= ``target``, or None.

    Args:
        times: training-clock seconds at each evaluation (evaluation excluded).
        steps: the steps evaluated; accuracies: the accuracy at each.
    """
    for t, s, a in zip(times, steps, accuracies):
        if a >= target:
            return t, s
    return None


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (Student's t, ``n - 1``
    degrees of freedom); half-width NaN for fewer than two values."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    df = len(xs) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    return m, t * statistics.stdev(xs) / math.sqrt(len(xs))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


class _Busy:
    """Server busy intervals of other workers' requests, for overlap queries."""

    def __init__(self, intervals, exclude: int):
        import bisect

        self._bisect = bisect
        merged: list[list[float]] = []
        for _, a, b in sorted((iv for iv in intervals if iv[0] != exclude), key=lambda iv: iv[1]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.merged = merged

    def overlap(self, lo: float, hi: float) -> float:
        i = max(0, self._bisect.bisect_right(self.starts, lo) - 1)
        total = 0.0
        while i < len(self.merged) and self.merged[i][0] < hi:
            a, b = self.merged[i]
            total += max(0.0, min(b, hi) - max(a, lo))
            i += 1
        return total


def server_queue(server_extra: dict, workers: list) -> dict:
    """The server's busy share and its queue of waiting requests (async runs).

    ``queue_mean`` / ``queue_histogram``: when the server starts handling a
    request, how many other workers are blocked on a request of their own
    (their ``communicate`` spans, same clock): the requests queued behind it.
    """
    intervals = server_extra.get("busy_intervals") or []
    if not intervals:
        return {}
    blocked = []
    for w in workers:
        spans = sorted((a, b) for rec in w.steps for p, a, b in rec.spans if p == "communicate")
        blocked.append((w.rank, spans))
    import bisect

    hist: dict[int, int] = {}
    for rank, t0, _ in intervals:
        n = 0
        for r, spans in blocked:
            if r == rank:
                continue
            i = bisect.bisect_right(spans, (t0, math.inf)) - 1
            if i >= 0 and spans[i][0] <= t0 < spans[i][1]:
                n += 1
        hist[n] = hist.get(n, 0) + 1
    total = sum(hist.values())
    span = max(t1 for _, _, t1 in intervals) - min(t0 for _, t0, _ in intervals)
    return {"server_busy_share": server_extra.get("busy_s", 0.0) / span if span > 0 else math.nan,
            "queue_mean": sum(k * v for k, v in hist.items()) / total,
            "queue_histogram": dict(sorted(hist.items()))}


def summarize_time(mode: str, cfg, workers: list, server_extra: dict | None = None) -> dict:
    """Time figures of one run from its workers' :class:`~gradcomp.lab.study.common.RankLog`\\ s.

    Sync and local steps are attributed with :func:`gradcomp.timeline.sync_step_phases`
    (each step's wait measured against the latest hand-off of any worker in
    that step); async steps with :func:`gradcomp.timeline.async_step_phases`,
    where the part of a worker's blocked round trips during which the server
    was handling other workers' requests (``server_extra["busy_intervals"]``,
    same clock) counts as ``wait``: its request queued behind theirs.

    Returns:
        ``step_time_median_s`` / ``step_time_p95_s`` (sync: the slowest
        worker's step; async: over every worker's steps), ``phases_mean_s`` /
        ``phases_median_s`` (per phase, the mean over workers of the per-step
        mean / median), ``idle_share`` (mean over workers of wait / step
        time), ``idle_share_per_worker``, ``idle_share_fast`` (the same over
        workers that are not the straggler), ``exposed_comm_share``,
        ``other_share`` (the largest share no phase claimed), ``samples_per_s``.
        Empty when the logs hold no timeline.
    """
    from gradcomp.timeline import PHASES, async_step_phases, sync_step_phases

    if not workers or not all(w.steps for w in workers):
        return {}
    nsteps = min(len(w.steps) for w in workers)
    per_worker: list[list[dict]] = [[] for _ in workers]
    intervals = (server_extra or {}).get("busy_intervals") or []
    busy = [_Busy(intervals, w.rank) if intervals else None for w in workers]
    for i in range(nsteps):
        if mode in ("sync", "local"):  # local: every rank waits for the slowest at a sync
            last = max(w.steps[i].marks.get("handoff", w.steps[i].start) for w in workers)
            for k, w in enumerate(workers):
                per_worker[k].append(sync_step_phases(w.steps[i], last))
        else:
            for k, w in enumerate(workers):
                p = async_step_phases(w.steps[i])
                if busy[k] is not None:  # blocked while the server served other workers: waiting
                    rec = w.steps[i]
                    queued = sum(busy[k].overlap(a, b) for ph, a, b in rec.spans if ph == "communicate")
                    queued = min(queued, p["communicate"])
                    p["wait"] += queued
                    p["communicate"] -= queued
                    rec.phases.update(wait=p["wait"], communicate=p["communicate"])
                per_worker[k].append(p)
    walls = [[w.steps[i].wall for i in range(nsteps)] for w in workers]
    if mode in ("sync", "local"):
        step_times = [max(walls[k][i] for k in range(len(workers))) for i in range(nsteps)]
    else:
        step_times = [t for ws in walls for t in ws]
    keys = (*PHASES, "exposed_comm")

    def share(k: int, key: str) -> float:
        total = sum(walls[k])
        return sum(p[key] for p in per_worker[k]) / total if total > 0 else 0.0

    idle = [share(k, "wait") for k in range(len(workers))]
    straggler = cfg.straggler[0] if cfg.straggler is not None else None
    fast = [idle[k] for k, w in enumerate(workers) if _worker_index(mode, w) != straggler]
    wall = max(w.wall_s for w in workers)
    return {
        "step_time_median_s": _median(step_times),
        "step_time_p95_s": percentile(step_times, 95),
        "phases_mean_s": {key: statistics.fmean(statistics.fmean(p[key] for p in pw)
                                                for pw in per_worker) for key in keys},
        "phases_median_s": {key: statistics.fmean(_median([p[key] for p in pw])
                                                  for pw in per_worker) for key in keys},
        "idle_share": statistics.fmean(idle),
        "idle_share_per_worker": idle,
        "idle_share_fast": statistics.fmean(fast) if fast else math.nan,
        "exposed_comm_share": statistics.fmean(share(k, "exposed_comm") for k in range(len(workers))),
        "other_share": max(share(k, "other") for k in range(len(workers))),
        "compute_s_per_worker": [statistics.fmean(p["compute"] for p in pw) for pw in per_worker],
        "samples_per_s": cfg.workers * cfg.batch_size * nsteps / wall if wall > 0 else math.nan,
    }


def step_series(workers: list) -> dict:
    """Per step of a sync or local run, when it ended and how much of it the workers idled.

    Returns:
        ``{"t_s": [...], "idle_share": [...]}``: the step's end on the training clock (the
        slowest worker's end, seconds since the earliest first step's start) and the mean over
        workers of the step's ``wait`` (:func:`gradcomp.timeline.sync_step_phases`) over the
        slowest worker's step time.
    """
    from gradcomp.timeline import sync_step_phases

    nsteps = min(len(w.steps) for w in workers)
    t0 = min(w.steps[0].start for w in workers)
    ts, idle = [], []
    for i in range(nsteps):
        recs = [w.steps[i] for w in workers]
        last = max(r.marks.get("handoff", r.start) for r in recs)
        wall = max(r.wall for r in recs)
        ts.append(max(r.start + r.wall for r in recs) - t0)
        waits = [sync_step_phases(r, last)["wait"] for r in recs]
        idle.append(statistics.fmean(waits) / wall if wall > 0 else 0.0)
    return {"t_s": ts, "idle_share": idle}


def _worker_index(mode: str, log) -> int:
    """The worker index of a log (async ranks start after the server)."""
    return log.rank - 1 if mode == "async" else log.rank
