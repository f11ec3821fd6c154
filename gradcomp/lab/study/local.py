"""Local mode: local SGD / DiLoCo through :class:`gradcomp.LocalSGD`.

Every worker trains its own replica with the study's SGD (learning rate,
momentum, batch and data order as in the sync mode) and synchronises every
``cfg.sync_every`` steps: the pseudo-gradient (the parameters' change since
the last synchronisation) is averaged with the run's codec (``ring`` or
``two_phase`` for dense codecs, ``allgather`` for sparse ones) and error
feedback per the compressor choice, then applied by averaging
(``cfg.outer="avg"``) or DiLoCo's outer Nesterov step (``"nesterov"``: lr 0.7,
momentum 0.9); ``cfg.fragments`` / ``cfg.overlap`` make it Streaming DiLoCo
(see :mod:`gradcomp.localsgd`). The ``none`` baseline of this mode moves
float32 pseudo-gradients on the same schedule.

After the last step every fragment changed since its last synchronisation is
synchronised once more (counted), so the evaluated model is the one every
rank holds; the curves' points evaluate rank 0's replica as it is at the
mark. Counted bytes are what a worker sent, as in the sync mode.

Time: each step is attributed like a sync step
(:func:`gradcomp.timeline.sync_step_phases`): ``compute`` runs from the step's
start to the ``"handoff"`` mark after the inner optimizer step (forward,
backward, a straggler's delay, the inner step), the exposed window from there
to the return of :meth:`~gradcomp.LocalSGD.step` holds the exchange (its
``"collective"`` span, split into compress / communicate / decompress), the
``wait`` for the slowest rank at a synchronisation, and the outer update
(``other``). Steps without an exchange have an empty window; with
``overlap`` the exchange runs behind the next steps' compute and only what
is still running when its update is due shows. The ``threshold-ef`` threshold is calibrated on
gradients (see :mod:`gradcomp.lab.study.study`), a smaller scale than
pseudo-gradients', so in this mode it keeps far more than 1% of the entries
unless ``--threshold`` sets one.
"""

from __future__ import annotations

import torch

from gradcomp.localsgd import LocalSGD
from gradcomp.meter import TrafficMeter
from gradcomp.timeline import StepTimeline, now
from gradcomp.lab.study.common import RankLog, start_together
from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.data import Digits, worker_batches
from gradcomp.lab.study.workloads import batch_loss, build_model
from gradcomp.lab.study.timing import ComputeDelay

__all__ = ["train_local_rank", "LOCAL"]

#: the mode's name in results
LOCAL = "local"


def train_local_rank(rank: int, world_size: int, cfg: TrainConfig, compressor: str, data: Digits,
                     progress=None, link_clock=None, adaptive: bool = False) -> RankLog:
    """Train one run of the local mode as ``rank`` of an initialised process
    group of ``cfg.workers`` ranks; every rank is a worker, rank 0 evaluates.

    Args:
        compressor: a name of :data:`gradcomp.lab.study.config.COMPRESSORS`.
        data: the study's split.
        progress: optional object with ``put(step)``; rank 0 calls it now and then.
        link_clock: the changing link\'s restart handle (:func:`~gradcomp.lab.study.common.start_together`).

        adaptive: the auto mode: the period and the codec chosen online
            (``LocalSGD(sync_every="auto", compressor="auto")`` within
            ``cfg.min_sync_every..cfg.max_sync_every``, fed each step's loss); ``compressor``
            is then ``"auto"``.

    Returns:
        This rank's :class:`RankLog`; ``extra`` holds the number of fragment
        exchanges (``local_syncs``) and, adaptive, on rank 0, ``decisions``: the
        period and codec in force from each change on (``t_s`` on the training
        clock, ``step``, ``sync_every``, ``codec``, ``quotas``: each worker's inner steps per
        round under partial work, or None).
    """
    if world_size != cfg.workers:
        raise ValueError(f"local mode needs {cfg.workers} ranks (one per worker), got {world_size}")
    choice = COMPRESSORS[compressor]
    model = build_model(cfg, data)
    meter = TrafficMeter()
    timeline = StepTimeline()
    partial = adaptive if cfg.partial_work is None else cfg.partial_work
    if adaptive:
        ls = LocalSGD(model, sync_every="auto", compressor="auto", min_sync_every=cfg.min_sync_every,
                      max_sync_every=cfg.max_sync_every, comm_share=cfg.comm_share, period_cost=cfg.period_cost,
                      outer_optimizer=cfg.outer, meter=meter, algorithm=cfg.algorithm_for(choice), timeout=cfg.timeout,
                      timeline=timeline, partial_work=partial)
    else:
        ls = LocalSGD(model, sync_every=cfg.sync_every, compressor=choice.build(cfg.threshold),
                      outer_optimizer=cfg.outer, meter=meter, error_feedback=choice.error_feedback,
                      algorithm=cfg.algorithm_for(choice), fragments=cfg.fragments, overlap=cfg.overlap,
                      timeout=cfg.timeout, timeline=timeline, partial_work=partial)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    log = RankLog(rank)
    decisions: list[dict] = []
    delay = ComputeDelay(rank, cfg.straggler, cfg.compute_jitter, cfg.seed, cfg.straggler_from_s)
    start_together(log, rank, delay, link_clock)
    batches = worker_batches(len(data.y_train), cfg.workers, rank, cfg.batch_size, cfg.seed, cfg.steps,
                             labels=data.y_train, label_skew=cfg.label_skew)
    lossf = float("nan")
    for step, idx in enumerate(batches, 1):
        t0 = now()
        timeline.begin_step(t0)
        computes = ls.should_compute  # False: partial work, this worker's share of the round is done
        if computes:
            loss = batch_loss(model, data.x_train[idx], data.y_train[idx])
            with timeline.span("delay"):  # a slow worker reaches the synchronisation late
                slept = delay.sleep(step, now() - t0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        handoff = now()
        timeline.mark("handoff", handoff)
        if computes:
            delay.observe(handoff - t0 - slept)
        if adaptive and computes:
            ls.step(loss=loss.detach())  # the loss factor of the period (AdaComm)
        else:
            ls.step()
        quotas = None if ls.partial is None else ls.partial.quotas
        if adaptive and (not decisions or (decisions[-1]["sync_every"], decisions[-1]["codec"],
                                           decisions[-1].get("quotas")) != (ls.sync_every, ls.codec, quotas)):
            decisions.append({"t_s": log.elapsed(), "step": step, "sync_every": ls.sync_every, "codec": ls.codec,
                              "quotas": quotas})
        if step == cfg.steps:
            ls.sync()  # the evaluated model is the one every rank holds
        timeline.mark("backward_end")  # the end of the exposed window: the exchange returned
        timeline.mark("apply_start")
        lossf = loss.item() if computes else lossf  # an idle step repeats the last loss
        timeline.end_step()
        log.record(cfg, LOCAL, step, lossf, meter, model if rank == 0 else None, data,
                   progress if rank == 0 else None)
    ls.close()
    log.extra["local_syncs"] = ls.syncs
    if adaptive and rank == 0:  # every rank holds the same agreed choices
        log.extra["decisions"] = decisions
    log.finish(meter, model if rank == 0 else None, data, timeline)
    if rank == 0:
        log.final = log.evals[-1]
    return log
