"""Sync mode: DistributedDataParallel with gradcomp's compressed allreduce hook.

Every worker computes the gradient of its own batch; DDP hands the gradient
buckets to :func:`gradcomp.ddp.compressed_allreduce_hook`, which averages them
with a compressed collective (``--algorithm`` for dense codecs,
``--sparse-algorithm`` for top-k, ``allgather`` for the other sparse ones:
:meth:`gradcomp.lab.study.config.TrainConfig.algorithm_for`) and counts the wire bytes in a
:class:`~gradcomp.TrafficMeter`. The ``none`` baseline goes through the same
hook and transport with :class:`~gradcomp.NoCompression`, so its bytes are
measured the same way; the ``native`` row is the baseline a user would call,
the backend's own ``dist.all_reduce`` of every bucket (the hook's plain
allreduce, :mod:`gradcomp.comm.native`), counted at the same nominal ring bytes.

The hook compresses every bucket from the first step (``start_iter=0``,
``min_compress_numel=0``; the default model fits in one DDP bucket): every
counted step moves compressed bytes, and the baseline's are raw float32 bytes
of the same transport, so the traffic ratio compares like with like. (The
hook's default ``start_iter=2`` would send the first two steps as plain
allreduces, counted in the meter's ``"plain_allreduce"`` phase.)
"""

from __future__ import annotations

import math
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

from gradcomp.meter import TrafficMeter
from gradcomp.timeline import StepTimeline, now
from gradcomp.lab.study.common import RankLog, start_together, param_digest
from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.data import Digits, worker_batches
from gradcomp.lab.study.dgc import dgc_compressor, optimizer_momentum
from gradcomp.lab.study.workloads import batch_loss, build_model
from gradcomp.lab.study.timing import ComputeDelay

__all__ = ["train_sync_rank", "LOW_RANK_START"]

#: the first compressed step of both low-rank rows (``powersgd4`` and PyTorch's
#: ``torch-powersgd4``, alike): the earliest PyTorch's hook allows (two exact steps first)
LOW_RANK_START = 2


def train_sync_rank(rank: int, world_size: int, cfg: TrainConfig, compressor: str, data: Digits,
                    progress=None, link_clock=None) -> RankLog:
    """Train one run of the sync mode as ``rank`` of an initialised process group
    of ``cfg.workers`` ranks; every rank is a worker, rank 0 evaluates.

    Args:
        compressor: a name of :data:`gradcomp.lab.study.config.COMPRESSORS`.
        data: the study's split (:func:`gradcomp.lab.study.data.load_digits_split`).
        progress: optional object with ``put(step)``; rank 0 calls it now and then.
        link_clock: the changing link\'s restart handle (:func:`~gradcomp.lab.study.common.start_together`).

    Returns:
        This rank's :class:`RankLog`; counted bytes are the bytes this rank sent
        in the hook's collectives.
    """
    from gradcomp.ddp import GradCompState, compressed_allreduce_hook

    if world_size != cfg.workers:
        raise ValueError(f"sync mode needs {cfg.workers} ranks (one per worker), got {world_size}")
    choice = COMPRESSORS[compressor]
    model = build_model(cfg, data)
    # the low-rank rows run one bucket: PyTorch's powerSGD_hook waits on its next allreduce inside
    # a future's callback, and on gloo two buckets in flight then issue collectives in different
    # orders on different ranks and hang (the wide MLP's 4.5 MB make two); gradcomp's alike
    one_bucket_mb = math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20) + 1
    ddp = DistributedDataParallel(model, bucket_cap_mb=one_bucket_mb if choice.low_rank else None)
    meter = TrafficMeter()
    timeline = StepTimeline()
    codec = choice.build(cfg.threshold, link=cfg.auto_link, start_iter=LOW_RANK_START if choice.low_rank else 0)
    if choice.dgc:
        codec = dgc_compressor(codec, cfg, len(data.y_train))
    if choice.torch_hook:  # PyTorch's own hook, counted in the run's meter
        codec.meter, codec.timeline = meter, timeline
        ddp.register_comm_hook(None, codec.hook)
    state = None if choice.torch_hook else GradCompState(
        compressor=codec,
        error_feedback=choice.error_feedback,
        algorithm=cfg.algorithm_for(choice),
        server_error_feedback=choice.server_ef,
        min_compress_numel=sys.maxsize if choice.native else 0,  # native: every bucket a plain allreduce
        start_iter=0,
        meter=meter,
        timeout=cfg.timeout,
        timeline=timeline,
    )
    if state is not None:
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    lr, momentum = choice.optimizer(cfg.lr, optimizer_momentum(choice.dgc, cfg))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    log = RankLog(rank)
    delay = ComputeDelay(rank, cfg.straggler, cfg.compute_jitter, cfg.seed, cfg.straggler_from_s)
    # the first layer's weight gets its gradient last: a slow worker's gradients come late
    delay.attach(next(model.parameters()), timeline)
    start_together(log, rank, delay, link_clock)
    batches = worker_batches(len(data.y_train), cfg.workers, rank, cfg.batch_size, cfg.seed, cfg.steps,
                             labels=data.y_train, label_skew=cfg.label_skew)
    for step, idx in enumerate(batches, 1):
        t0 = now()
        timeline.begin_step(t0)
        delay.begin(step, t0)
        loss = batch_loss(ddp, data.x_train[idx], data.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # returns when DDP has waited for every bucket's collective
        timeline.mark("backward_end")
        timeline.mark("apply_start")
        opt.step()
        lossf = loss.item()
        timeline.end_step()
        log.record(cfg, "sync", step, lossf, meter, model if rank == 0 else None, data,
                   progress if rank == 0 else None)
    if state is not None:
        state.close()
    log.extra["param_sha256"] = param_digest(model)
    log.finish(meter, model if rank == 0 else None, data, timeline)
    if rank == 0:
        log.final = log.evals[-1]
    return log
