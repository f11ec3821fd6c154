"""Ft mode: synchronous training on torchft's per-step quorum, a late worker left out by a timeout.

Every worker is a torchft replica group of one process. A worker computes its
gradient first and only then asks to join the step's quorum: a slow worker is
late to the quorum, not to the collective, and the lighthouse forms the quorum
without it after ``cfg.ft_timeout`` seconds (its join timeout; at least
``workers - 1`` members). The gradients, one flat buffer, are averaged by
:class:`gradcomp.integrations.torchft.ManagedAllreduce` over the workers at the
quorum's step. A worker that joins behind heals from a peer, contributes
nothing to that step (its stale gradient is dropped, as a backup worker's late
push is) and applies the step's average. The lighthouse and a control store
run in rank 0's process; a worker past the last step keeps the quorums (zeros,
no update) until every worker is past it, so that all end on the same
parameters. Rank 0 evaluates. The why of each choice, and what torchft could
not do: docs/fault-tolerance.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp.meter import TrafficMeter
from gradcomp.timeline import StepTimeline, now
from gradcomp.lab.study.common import RankLog, param_digest, start_together
from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.data import Digits, worker_batches
from gradcomp.lab.study.timing import ComputeDelay
from gradcomp.lab.study.workloads import batch_loss, build_model

__all__ = ["train_ft_rank", "replica_manager", "FT", "lighthouse_settings"]

#: the mode's name in results
FT = "ft"
#: seconds a collective, a checkpoint transfer or a quorum request may take before it fails
FT_OP_TIMEOUT_S = 60.0
#: seconds a worker past the last step pauses before each quorum it keeps for the others
PASSIVE_PAUSE_S = 0.01
#: seconds a worker past the last step waits for a quorum before it checks whether all are past it
PASSIVE_QUORUM_S = 2.0
#: the lighthouse's heartbeat timeout: a worker silent this long is dead (milliseconds)
HEARTBEAT_TIMEOUT_MS = 5000


def lighthouse_settings(cfg: TrainConfig) -> dict:
    """``torchft.coordination.LighthouseServer`` keywords of a run: quorums of at
    least ``workers - 1`` (one worker may be left out), the join timeout
    ``cfg.ft_timeout`` and a quorum tick of half of it (1 to 100 ms), so that
    a timeout is noticed within half of itself."""
    join_ms = max(1, round(cfg.ft_timeout * 1000))
    return {"min_replicas": max(1, cfg.workers - 1), "join_timeout_ms": join_ms,
            "quorum_tick_ms": min(100, max(1, join_ms // 2)), "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS}


def _algorithm(cfg: TrainConfig, choice) -> str:
    """ManagedAllreduce's algorithm: allgather for sparse codecs, else ``cfg.algorithm``
    where it is a flat one (ring, two_phase), else ring."""
    if choice.sparse:
        return "allgather"
    return cfg.algorithm if cfg.algorithm in ("ring", "two_phase") else "ring"


def _control(rank: int, cfg: TrainConfig, addr: str):
    """Rank 0 starts the lighthouse and the control store; every rank learns their
    addresses over the launch's group. Returns ``(lighthouse or None, address, store)``."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=FT_OP_TIMEOUT_S)
    box: list = [None]
    lighthouse = store = None
    if rank == 0:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", **lighthouse_settings(cfg))
        port = lighthouse.address().rsplit(":", 1)[1]  # it names the machine's hostname: use this namespace's address
        store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        box = [(f"http://{addr}:{port}", addr, store.port)]
    dist.broadcast_object_list(box, src=0)
    address, host, port = box[0]
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    return lighthouse, address, store


@dataclass
class _Replica:
    """What one worker's training loop works with (see :func:`train_ft_rank`)."""

    rank: int
    cfg: TrainConfig
    data: Digits
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    manager: object  # torchft.Manager
    ar: object  # ManagedAllreduce
    control: object  # the control store (torch.distributed.TCPStore)
    log: RankLog
    timeline: StepTimeline
    delay: ComputeDelay
    batches: list
    progress: object


class _Watcher:
    """Rank 0's thread that stops the lighthouse once every worker is past the last
    step (or :meth:`stop` is called): that ends every pending quorum request."""

    def __init__(self, lighthouse, control, workers: int):
        from torch.distributed import TCPStore

        self.lighthouse, self.workers = lighthouse, workers
        # a connection of its own: the training loop uses ``control`` meanwhile
        self.store = TCPStore(control.host, control.port, is_master=False,
                              timeout=datetime.timedelta(seconds=FT_OP_TIMEOUT_S))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gradcomp-ft-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.02):
            if int(self.store.add("finished", 0)) >= self.workers:
                break
        self.lighthouse.shutdown()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(FT_OP_TIMEOUT_S)


def replica_manager(model, opt, *, replica_id: str, addr: str, lighthouse: str, timeout: datetime.timedelta,
                    **manager_kw):
    """A torchft replica group of one process training ``model`` with ``opt``: its store,
    process group and ``Manager`` (``manager_kw``: the Manager's quorum options). The state
    a healing replica receives (model and optimizer) goes over the quorum's own group: torchft's
    HTTP transport names the machine's hostname, which a network namespace cannot reach."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore(addr, 0, is_master=True, wait_for_workers=False)

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                       "opt": opt.state_dict()},
                      replica_id=replica_id, lighthouse_addr=lighthouse, store_addr=addr, store_port=store.port,
                      rank=0, world_size=1, hostname=addr, timeout=timeout,
                      checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
                      **manager_kw)
    return store, pg, manager


def _manager(rank: int, cfg: TrainConfig, addr: str, lighthouse: str, model, opt):
    """This worker's torchft replica group: its store, process group and Manager."""
    timeout = datetime.timedelta(seconds=min(cfg.timeout, FT_OP_TIMEOUT_S))
    return replica_manager(model, opt, replica_id=f"worker{rank}", addr=addr, lighthouse=lighthouse, timeout=timeout,
                           min_replica_size=1, use_async_quorum=True,  # commit with whoever is at the quorum's step
                           quorum_timeout=timeout, init_sync=False)  # every replica starts from the seed's model


def train_ft_rank(rank: int, world_size: int, cfg: TrainConfig, compressor: str, data: Digits,
                  progress=None, link_clock=None) -> RankLog:
    """Train one run of the ft mode as ``rank`` of an initialised process group
    of ``cfg.workers`` ranks (used only to start: the training runs on torchft's
    groups); every rank is a worker, rank 0 evaluates and hosts the lighthouse.

    Args:
        compressor: a name of :data:`gradcomp.lab.study.config.COMPRESSORS`
            (not a DGC, ``auto`` or ``native`` row).
        data: the study's split.
        progress: optional object with ``put(step)``; rank 0 calls it now and then.
        link_clock: the changing link's restart handle (:func:`~gradcomp.lab.study.common.start_together`).

    Returns:
        This rank's :class:`RankLog`; its meter counts the bytes sent and the
        events ``"quorum_change"``, ``"not_participating"`` and ``"step_rolled_back"``.

    Raises:
        ValueError: a world size other than ``cfg.workers``, or a row the mode cannot run.
        ImportError: torchft is not installed.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    logging.getLogger("torchft").setLevel(logging.ERROR)  # a warning per reconfigured quorum
    warnings.filterwarnings("ignore", module="torchft")
    from gradcomp.integrations.torchft import ManagedAllreduce

    if world_size != cfg.workers:
        raise ValueError(f"ft mode needs {cfg.workers} ranks (one per worker), got {world_size}")
    choice = COMPRESSORS[compressor]
    if FT not in choice.modes:
        raise ValueError(f"compressor {compressor!r} does not run in ft mode")
    addr = os.environ.get("GRADCOMP_CLUSTER_ADDR", "127.0.0.1")
    model = build_model(cfg, data)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    lighthouse, lighthouse_addr, control = _control(rank, cfg, addr)
    _store, pg, manager = _manager(rank, cfg, addr, lighthouse_addr, model, opt)
    ar = ManagedAllreduce(manager, pg, choice.build(cfg.threshold), algorithm=_algorithm(cfg, choice),
                          timeout=min(cfg.timeout, FT_OP_TIMEOUT_S))
    if not choice.error_feedback:
        ar.error_feedback = False  # the row's codec alone, as in the sync mode
    log, timeline = RankLog(rank), StepTimeline()
    delay = ComputeDelay(rank, cfg.straggler, cfg.compute_jitter, cfg.seed, cfg.straggler_from_s)
    batches = list(worker_batches(len(data.y_train), cfg.workers, rank, cfg.batch_size, cfg.seed, cfg.steps))
    watcher = _Watcher(lighthouse, control, cfg.workers) if rank == 0 else None
    start_together(log, rank, delay, link_clock)
    try:
        lossf, recorded = _loop(_Replica(rank, cfg, data, model, opt, manager, ar, control, log, timeline, delay,
                                         batches, progress))
    finally:
        if watcher is not None:
            watcher.stop()
        manager.shutdown(wait=False)
    for step in range(recorded + 1, cfg.steps + 1):  # steps a late worker never reached: its last loss
        log.record(cfg, FT, step, lossf, ar.meter, None, data)
    log.extra["param_sha256"] = param_digest(model)
    log.finish(ar.meter, model if rank == 0 else None, data, timeline)
    dist.barrier()  # rank 0's control store serves until every worker has left the loop
    if rank == 0:
        log.final = log.evals[-1]
    return log


def _loop(r: "_Replica") -> tuple[float, int]:
    """Train until every worker is past ``cfg.steps`` steps (see the module docstring);
    returns the last computed loss and the last step recorded.

    A worker past the last step stays in the quorums, contributing zeros and
    stepping no optimizer, until every worker is past it: a worker left behind
    heals from it (a quorum needs ``workers - 1`` members), so all end on the
    parameters of the last step."""
    recorded, lossf, params, finished = 0, float("nan"), list(r.model.parameters()), False
    meter = r.ar.meter  # the run's bytes; the zeros a worker past the last step exchanges go to a meter of their own
    idle = TrafficMeter()
    while int(r.control.add("finished", 0)) < r.cfg.workers:
        step = r.manager.current_step()
        if step >= r.cfg.steps and not finished:
            r.control.add("finished", 1)
            finished = True
            continue
        active = step < r.cfg.steps
        r.ar.meter = meter if active else idle
        if active:
            t0 = now()
            r.timeline.begin_step(t0)
            with r.timeline.span("compute"):
                idx = r.batches[step]
                loss = batch_loss(r.model, r.data.x_train[idx], r.data.y_train[idx])
                slept = r.delay.sleep(step + 1, now() - t0)
                r.opt.zero_grad(set_to_none=True)
                loss.backward()
                lossf = loss.item()
            r.delay.observe(now() - t0 - slept)
        else:
            time.sleep(PASSIVE_PAUSE_S)  # no batch to compute: do not spin the others' cores
            for p in params:
                p.grad = torch.zeros_like(p)
        try:
            with r.timeline.span("wait"):  # for the quorum: the others, the join timeout, a heal
                # past the last step, bounded: the last workers may leave without joining (ends the run)
                r.manager.start_quorum(timeout=None if active else datetime.timedelta(seconds=PASSIVE_QUORUM_S))
                r.manager.wait_quorum()
        except Exception as e:  # the lighthouse stopped, or no worker behind came: every worker is past the end
            if int(r.control.add("finished", 0)) >= r.cfg.workers:
                if active:
                    r.timeline.end_step()
                break
            raise RuntimeError(f"ft mode: worker {r.rank} got no quorum at step {step} ({e}) while "
                               f"{r.cfg.workers - int(r.control.add('finished', 0))} worker(s) are behind") from e
        with r.timeline.span("communicate"):  # one flat buffer, as one DDP bucket: one collective per step
            grads = [p.grad for p in params]
            flat = r.ar.allreduce(torch.cat([g.reshape(-1) for g in grads]), key="grads")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        with r.timeline.span("apply"):
            if r.ar.commit() and r.manager.current_step() <= r.cfg.steps:  # past the last step: no update
                r.opt.step()
        if active:
            r.timeline.end_step()
        reached = min(r.manager.current_step(), r.cfg.steps)
        for s in range(recorded + 1, reached + 1):  # steps committed or healed over
            r.log.record(r.cfg, FT, s, lossf, meter, r.model if r.rank == 0 else None, r.data,
                         r.progress if r.rank == 0 else None)
        recorded = max(recorded, reached)
    r.ar.meter = meter
    return lossf, recorded
