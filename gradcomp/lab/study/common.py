"""Pieces shared by the sync and async training loops (run inside each rank)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.data import Digits
from gradcomp.lab.study.model import evaluate

__all__ = ["RankLog", "counted_bytes", "param_digest", "start_together"]


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters' bytes, in order (equal digests:
    bit-identical parameters)."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def counted_bytes(mode: str, meter, raw: bool = False) -> int:
    """The bytes a worker's meter (a TrafficMeter or its ``as_dict()``) counts
    for the report: what it sent in sync, local and ft mode (a ring rank receives
    as much as it sends), what it sent plus received in async mode (pushes and pulls).
    ``raw``: the uncompressed float32 equivalent of the same."""
    d = meter if isinstance(meter, dict) else meter.as_dict()
    prefix = "raw_" if raw else ""
    sent = d[f"{prefix}bytes_sent"]
    return sent if mode in ("sync", "local", "ft") else sent + d[f"{prefix}bytes_received"]


@dataclass
class RankLog:
    """What one rank records during a run (returned to the launcher, picklable).

    Attributes:
        rank: the rank that recorded it; role: ``"worker"`` or ``"server"``.
        losses: this rank's training loss at every step (empty for a server).
        marks: steps at which ``traffic`` (and, on the evaluating rank, ``evals``) were taken.
        traffic: this rank's cumulative counted wire bytes at each mark.
        evals: ``(test_loss, test_accuracy)`` at each mark (evaluating rank only).
        final: ``(test_loss, test_accuracy)`` of the trained model (on the rank
            that holds it: sync rank 0, the async server).
        meter: the rank's ``TrafficMeter.as_dict()`` at the end.
        wall_s: seconds of the training loop on this rank (evaluation excluded).
        clock: training-clock seconds at each mark (evaluation excluded).
        steps: the per-step timeline (:class:`gradcomp.timeline.StepRecord`), if recorded.
        extra: role-specific counters (e.g. the server's staleness histogram).

    Evaluation never runs inside the timed loop: at a mark the evaluating
    rank copies its parameters (a snapshot, its copy time excluded from the
    clock) and :meth:`finish` evaluates the snapshots after the loop.
    """

    rank: int
    role: str = "worker"
    losses: list[float] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    traffic: list[int] = field(default_factory=list)
    evals: list[tuple[float, float]] = field(default_factory=list)
    final: tuple[float, float] | None = None
    meter: dict = field(default_factory=dict)
    wall_s: float = 0.0
    clock: list[float] = field(default_factory=list)
    steps: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    _t0: float = field(default=0.0, repr=False)
    _paused: float = field(default=0.0, repr=False)
    _snapshots: list = field(default_factory=list, repr=False)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._paused = 0.0

    def elapsed(self) -> float:
        """Training-clock seconds since :meth:`start` (snapshot copies excluded)."""
        return time.perf_counter() - self._t0 - self._paused

    def record(self, cfg: TrainConfig, mode: str, step: int, loss: float, meter,
               model: torch.nn.Module | None, data: Digits, progress=None) -> None:
        """Record step ``step`` (1-based): its loss, and at marks the bytes
        counted so far (:func:`counted_bytes` of ``meter``) and, when ``model``
        is given, a test evaluation. ``progress.put(step)`` now and then."""
        self.losses.append(float(loss))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            t = time.perf_counter()
            self.marks.append(step)
            self.clock.append(t - self._t0 - self._paused)
            self.traffic.append(counted_bytes(mode, meter))
            if model is not None:
                self._snapshots.append([p.detach().clone() for p in model.parameters()])
            self._paused += time.perf_counter() - t
        if progress is not None and (step % max(1, cfg.steps // 100) == 0 or step == cfg.steps):
            progress.put(step)

    def finish(self, meter, model: torch.nn.Module | None = None, data: Digits | None = None,
               timeline=None) -> "RankLog":
        """Stop the clock, keep the meter's counters (a TrafficMeter or its
        ``as_dict()``) and the timeline's steps, and evaluate the snapshots
        taken at the marks on ``model`` (its parameters are restored after)."""
        self.wall_s = self.elapsed()
        self.meter = meter if isinstance(meter, dict) else meter.as_dict()
        if timeline is not None:
            self.steps = list(timeline.steps)
        if self._snapshots and model is not None:
            params = list(model.parameters())
            keep = [p.detach().clone() for p in params]
            with torch.no_grad():
                for snap in self._snapshots:
                    for p, s in zip(params, snap):
                        p.copy_(s)
                    self.evals.append(evaluate(model, data.x_test, data.y_test))
                for p, s in zip(params, keep):
                    p.copy_(s)
            self._snapshots = []
        return self


def start_together(log: RankLog, rank: int, delay=None, link_clock=None) -> None:
    """Start a run's training clock on every rank of the group at once (a barrier).

    With a changing link (``link_clock``: the cluster's
    :class:`~gradcomp.lab.shaping.ScheduleRemote`) rank 0 first restarts the link's schedule,
    so that every run meets its phases from its own start; a straggler's onset
    (``delay``: :class:`~gradcomp.lab.study.timing.ComputeDelay`) counts from the same start.
    Rank 0 records in ``log.extra["link_origin_lag_s"]`` the seconds from the schedule's
    origin to the clock's start.

    Raises:
        TimeoutError: the cluster did not answer the restart (rank 0).
    """
    origin = link_clock.restart() if link_clock is not None and rank == 0 else None
    dist.barrier()
    log.start()
    if delay is not None:
        delay.start(log._t0)
    if origin is not None:
        log.extra["link_origin_lag_s"] = time.monotonic() - origin - log.elapsed()
