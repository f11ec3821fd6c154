"""Async mode: training through gradcomp's parameter server (1 server + W workers).

Rank 0 is the server: it holds the parameters and applies every pushed
gradient on arrival with SGD (the study's momentum, or ``async_momentum``, learning rate
``lr / workers``: a round of one push per worker then moves the parameters as
far as one sync step, which averages the same gradients, so both modes spend
the same learning-rate budget per sample). Ranks
``1..W`` are workers: each step a worker pulls the parameters, computes the
gradient of its own batch (the same data order as the sync mode) and pushes
it. Pushes and pulls are both compressed in the compressed runs: pushes with
the codec and error feedback per parameter (``error_feedback`` of the
compressor choice), pulls as deltas compressed by the same codec, with the
server keeping a residual per worker (``compress_pull=True``). The ``none``
baseline pushes and pulls raw float32.

A worker counts every byte it moved: pushes and pull requests sent, replies
and pulled parameters received (the meter's phases ``"push"`` and ``"pull"``).
Worker 0 (rank 1) evaluates its replica at the marks; the final accuracy is
that of the server's parameters after the last update.
Sync with backup workers (``ps_mode="sync"``) runs here too: see :func:`train_async_rank`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gradcomp.compressors import NoCompression
from gradcomp.lab.study.common import RankLog, start_together
from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.data import Digits, worker_batches
from gradcomp.timeline import StepTimeline, now
from gradcomp.lab.study.dgc import dgc_compressor, optimizer_momentum
from gradcomp.lab.study.model import evaluate
from gradcomp.lab.study.timing import ComputeDelay
from gradcomp.lab.study.workloads import batch_loss, build_model

__all__ = ["async_world_size", "train_async_rank"]

#: Seconds a worker may stay silent before the server declares it dead.
WORKER_TIMEOUT_S = 120.0


def async_world_size(cfg: TrainConfig) -> int:
    """Ranks of an async run: one server plus ``cfg.workers`` workers."""
    return cfg.workers + 1


def train_async_rank(rank: int, world_size: int, cfg: TrainConfig, compressor: str, data: Digits,
                     progress=None, ps_mode: str = "async", link_clock=None) -> RankLog:
    """Train one async run as ``rank`` of an initialised group of ``cfg.workers + 1`` ranks.

    Args:
        compressor: a name of :data:`gradcomp.lab.study.config.COMPRESSORS`.
        data: the study's split.
        progress: optional object with ``put(step)``; worker 0 calls it now and then.
        link_clock: the changing link\'s restart handle (:func:`~gradcomp.lab.study.common.start_together`).
        ps_mode: the server's mode: ``"async"``, or ``"sync"`` with
            ``cfg.backup_workers`` backup workers (learning rate ``cfg.lr``: the
            server averages a step's pushes).

    Returns:
        This rank's :class:`RankLog` (``role`` ``"server"`` on rank 0, whose
        ``final`` is the test evaluation of the trained parameters).

    Raises:
        gradcomp.ps.WorkerFailedError / PSAbortedError: a rank of the run failed.
    """
    from gradcomp import ps

    if world_size != async_world_size(cfg):
        raise ValueError(f"async mode needs {async_world_size(cfg)} ranks (1 server + {cfg.workers} "
                         f"workers), got {world_size}")
    choice = COMPRESSORS[compressor]
    compressed = compressor != "none"
    codec = choice.build(cfg.threshold) if compressed else NoCompression()
    if choice.dgc:
        codec = dgc_compressor(codec, cfg, len(data.y_train), ps_mode)
    sync = ps_mode == "sync"
    config = ps.PSConfig(
        mode=ps_mode, steps=cfg.steps, num_servers=1, backup_workers=(cfg.backup_workers or 0) if sync else 0,
        compressor=codec,
        error_feedback=choice.error_feedback,
        compress_pull=compressed,
        optimizer=functools.partial(torch.optim.SGD, lr=cfg.lr if sync else cfg.lr / cfg.workers,
                                    momentum=optimizer_momentum(choice.dgc, cfg, ps_mode)),
        on_worker_failure="fail", worker_timeout=WORKER_TIMEOUT_S, timeout=cfg.timeout)

    models: list[nn.Module] = []
    timeline = StepTimeline()
    delay = ComputeDelay(rank - 1, cfg.straggler, cfg.compute_jitter, cfg.seed, cfg.straggler_from_s)

    def model_fn() -> nn.Module:
        models.append(build_model(cfg, data))
        # the first layer's weight gets its gradient last: a slow worker's push comes late
        delay.attach(next(models[-1].parameters()), timeline)
        return models[-1]

    log = RankLog(rank, role="server" if rank == 0 else "worker")
    index = rank - 1
    batches = [] if rank == 0 else list(
        worker_batches(len(data.y_train), cfg.workers, index, cfg.batch_size, cfg.seed, cfg.steps))

    def loss_fn(model: nn.Module, step: int, worker_index: int) -> torch.Tensor:
        delay.begin(step + 1, now())
        idx = batches[step]
        return batch_loss(model, data.x_train[idx], data.y_train[idx])

    def on_step(step: int, loss: float, worker, result) -> None:
        first = index == 0
        log.record(cfg, "async", step + 1, loss, worker.meter, models[0] if first else None, data,
                   progress if first else None)

    start_together(log, rank, delay, link_clock)
    out = ps.run(rank, world_size, model_fn, loss_fn, config, on_step=on_step, timeline=timeline)
    meter_dict = out["stats"]["traffic"]
    if rank == 0:
        model = models[0]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(out["params"][name])
        log.final = evaluate(model, data.x_test, data.y_test)
        stats = out["stats"]
        log.extra.update({k: stats[k] for k in ("updates", "accepted", "dropped", "rejected", "backup_workers",
                                                "staleness_histogram", "busy_s", "busy_intervals")})
    return log.finish(meter_dict, models[0] if rank != 0 and index == 0 else None, data,
                      timeline if rank != 0 else None)
