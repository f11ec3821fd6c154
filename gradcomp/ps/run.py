"""One call per rank: "num_servers servers + W workers" training with a model,
a compressor, a mode and a step budget."""

from __future__ import annotations

import contextlib

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gradcomp import _validate as v
from gradcomp.compressors import DGC, Compressor, ErrorFeedback, Int8Quantizer, check_optimizer, split
from gradcomp.ps.checkpoint import resume_mode
from gradcomp.ps.auth import Credential
from gradcomp.ps.protocol import FAILURE_POLICIES, MODES
from gradcomp.ps.transport import normalize_address

__all__ = ["PSConfig", "run", "role"]


@dataclass
class PSConfig:
    """Settings of a parameter-server run (see :class:`ParameterServer` and
    :class:`Worker` for the meaning of each).

    Attributes:
        mode: ``"sync"`` or ``"async"``.
        steps: gradient pushes per worker (>= 0).
        num_servers: server ranks ``[0, num_servers)``; the others are workers.
        compressor: push compressor (None: uncompressed float32).
        error_feedback: workers wrap a lossy ``compressor`` in ``ErrorFeedback``.
        compress_pull: servers answer pulls with compressed deltas.
        pull_compressor: compressor of those deltas; None: a fresh copy of
            ``compressor`` (its inner compressor when it is an ErrorFeedback),
            or ``Int8Quantizer()`` when ``compressor`` is None.
        optimizer: server optimizer factory ``f(list[nn.Parameter]) -> Optimizer``
            (picklable, e.g. ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``);
            None: SGD with lr 0.01 and momentum 0.9. With a :class:`~gradcomp.DGC`
            compressor the workers apply the momentum: it must be given, and
            be plain SGD (:func:`~gradcomp.compressors.check_optimizer`).
        max_staleness, staleness_lr, clip_grad_norm, on_worker_failure,
        worker_timeout, heartbeat_timeout, checkpoint_dir, checkpoint_every:
            server settings.
        resume: True: every server loads its checkpoint from ``checkpoint_dir``
            (a server without one raises CheckpointError instead of starting
            afresh); ``"if-exists"``: those that have one load it; False: none.
        address: where servers bind (``"host"``, ``"host:port"``,
            ``"tcp://host:port"``; with several servers on one host give no
            fixed port); None: ``$GRADCOMP_PS_HOST``, else the interface that
            routes to ``$MASTER_ADDR``, else loopback (see
            :mod:`gradcomp.ps.transport`).
        timeout: workers' per-reply timeout in seconds.
        heartbeat_interval: seconds between a worker's heartbeats.
        device: workers' compute device (None: where ``model_fn`` puts the model).
        encrypt: CURVE instead of PLAIN on every connection: authenticated
            and encrypted (see :mod:`gradcomp.ps.auth`); the default
            authenticates each connection but does not encrypt.
        credential: the job's credential (:func:`gradcomp.ps.new_credential`,
            its mechanism matching ``encrypt``; a secret, not shown by
            ``repr``); None: the servers create one when the roles are built.
    """

    mode: str = "sync"
    steps: int = 100
    num_servers: int = 1
    compressor: Compressor | ErrorFeedback | None = None
    error_feedback: bool = True
    compress_pull: bool = False
    pull_compressor: Compressor | None = None
    optimizer: Callable[..., torch.optim.Optimizer] | None = None
    max_staleness: int | None = None
    staleness_lr: bool = False
    clip_grad_norm: float | None = None
    on_worker_failure: str = "continue"
    worker_timeout: float = 60.0
    heartbeat_timeout: float = 10.0
    address: str | None = None
    timeout: float = 120.0
    heartbeat_interval: float = 1.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool | str = False
    device: str | None = None
    encrypt: bool = False
    credential: str | None = field(default=None, repr=False)

    def __post_init__(self):
        v.choice("mode", self.mode, MODES)
        v.choice("on_worker_failure", self.on_worker_failure, FAILURE_POLICIES)
        v.integer("steps", self.steps, 0)
        v.integer("num_servers", self.num_servers, 1)
        for name in ("compressor", "pull_compressor"):
            c = getattr(self, name)
            if c is not None:
                split(c, name, " or None")
        if self.compressor is not None and split(self.compressor)[1] is not None and not self.error_feedback:
            raise ValueError(f"error_feedback=False contradicts compressor {self.compressor!r}, an error "
                             "feedback: pass its wrapped compressor, or error_feedback=True")
        for name in ("worker_timeout", "timeout", "heartbeat_timeout", "heartbeat_interval"):
            v.timeout(name, getattr(self, name))
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval:g} s) must be < "
                             f"heartbeat_timeout ({self.heartbeat_timeout:g} s)")
        if self.address is not None:
            normalize_address(self.address)
        if resume_mode(self.resume) and self.checkpoint_dir is None:
            raise ValueError(f"resume={self.resume!r} needs a checkpoint_dir")
        if not isinstance(self.encrypt, bool):
            raise TypeError(f"encrypt must be a bool, got {type(self.encrypt).__name__}")
        if self.credential is not None and Credential(self.credential).encrypt != self.encrypt:
            raise ValueError(f"credential is for {Credential(self.credential).mechanism.upper()}, which "
                             f"contradicts encrypt={self.encrypt}: make it with "
                             f"new_credential(encrypt={self.encrypt})")
        if isinstance(self.compressor, DGC):
            if self.optimizer is None:
                raise ValueError("a DGC compressor needs an explicit plain-SGD optimizer (the default has "
                                 "momentum 0.9, which DGC already applies on the workers)")
            check_optimizer(self.optimizer)

    def server_pull_compressor(self) -> Compressor | None:
        """The compressor servers use for pull deltas (None without ``compress_pull``)."""
        if not self.compress_pull:
            return None
        if self.pull_compressor is not None:
            return self.pull_compressor
        if self.compressor is None:
            return Int8Quantizer()
        return split(self.compressor)[0].clone()


def role(rank: int, num_servers: int) -> str:
    """``"server"`` for ranks ``[0, num_servers)``, else ``"worker"``."""
    return "server" if rank < num_servers else "worker"


class _NoTimeline:
    """Stands in for a :class:`gradcomp.timeline.StepTimeline` when none is given."""

    def begin_step(self):
        pass

    def end_step(self):
        pass

    @contextlib.contextmanager
    def span(self, phase):
        yield

    @contextlib.contextmanager
    def active(self):
        yield


def run(rank: int, world_size: int, model_fn: Callable[[], torch.nn.Module],
        loss_fn: Callable[[torch.nn.Module, int, int], torch.Tensor], config: PSConfig, *,
        on_step: Callable[[int, float, "Worker", "PushResult"], Any] | None = None,
        group=None, timeline=None) -> dict:
    """Run this rank's role of a parameter-server training job.

    Call it on every rank of an initialised process group: under torchrun
    (``gradcomp.launch.init_from_env()`` first) or directly as
    ``gradcomp.launch.launch(gradcomp.ps.run, world_size, args=(model_fn, loss_fn, config))``.

    A server builds ``model_fn()`` (its initial parameters are the run's) and
    serves until every worker is done or dead. A worker builds
    ``model_fn()`` on ``config.device`` and for ``config.steps`` steps: pulls,
    computes ``loss_fn(model, step, worker_index)`` (a scalar),
    backpropagates, pushes the gradients; then pulls once more and sends DONE.

    Args:
        rank, world_size: this rank and the group size (``world_size > num_servers``).
        model_fn: builds the model (same names and shapes on every rank;
            float32 parameters on the workers).
        loss_fn: ``(model, step, worker_index) -> loss``; ``worker_index`` is
            ``rank - num_servers``, so each worker can read its own data.
        config: a :class:`PSConfig`.
        on_step: optional ``(step, loss, worker, push_result)`` callback after
            each push (workers only), e.g. for logging or evaluation.
        group: the process group (default: the world).
        timeline: optional :class:`gradcomp.timeline.StepTimeline` (workers): one
            step per pull + compute + push, with the spans ``compute``,
            ``compress``, ``communicate`` and ``decompress`` (see
            :func:`gradcomp.timeline.async_step_phases`).

    Returns:
        On a server: ``{"role": "server", "rank", "stats", "params"}`` (its
        shard, CPU tensors). On a worker: ``{"role": "worker", "rank",
        "losses", "stats", "params"}`` (the final replica, CPU tensors).
        To hand the result back through ``gradcomp.launch.launch``, convert
        the tensors first (e.g. ``t.numpy()``): its result queue passes
        tensors as shared-memory handles, which close when the rank's
        process exits.

    Raises:
        ValueError: ``world_size <= config.num_servers``.
        WorkerFailedError (server) / PSAbortedError (worker): a worker died
            with ``on_worker_failure="fail"``.
    """
    from gradcomp.ps.server import ParameterServer
    from gradcomp.ps.worker import Worker

    if not isinstance(config, PSConfig):
        raise TypeError(f"config must be a gradcomp.ps.PSConfig, got {type(config).__name__}")
    if world_size <= config.num_servers:
        raise ValueError(f"world_size must be > num_servers={config.num_servers} (at least one worker), "
                         f"got {world_size}")
    if role(rank, config.num_servers) == "server":
        server = ParameterServer(
            model_fn(), mode=config.mode, num_servers=config.num_servers, optimizer=config.optimizer,
            max_staleness=config.max_staleness, staleness_lr=config.staleness_lr,
            clip_grad_norm=config.clip_grad_norm, compress_pull=config.compress_pull,
            pull_compressor=config.server_pull_compressor(), on_worker_failure=config.on_worker_failure,
            worker_timeout=config.worker_timeout, heartbeat_timeout=config.heartbeat_timeout,
            address=config.address,
            checkpoint_dir=None if config.checkpoint_dir is None else os.fspath(config.checkpoint_dir),
            checkpoint_every=config.checkpoint_every, resume=config.resume, group=group,
            credential=config.credential, encrypt=config.encrypt)
        stats = server.serve()
        return {"role": "server", "rank": rank, "stats": stats,
                "params": {n: t.cpu().clone() for n, t in server.parameters().items()}}

    model = model_fn()
    if config.device is not None:
        model = model.to(config.device)
    worker = Worker(model, num_servers=config.num_servers,
                    compressor=None if config.compressor is None else config.compressor.clone(),
                    error_feedback=config.error_feedback, timeout=config.timeout,
                    heartbeat_interval=config.heartbeat_interval,
                    heartbeat_timeout=config.heartbeat_timeout, group=group)
    index = rank - config.num_servers
    losses: list[float] = []
    tl = timeline if timeline is not None else _NoTimeline()
    with worker, tl.active():
        for step in range(config.steps):
            tl.begin_step()
            worker.pull()
            with tl.span("compute"):
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model, step, index)
                loss.backward()
            result = worker.push()
            worker.meter.step()
            losses.append(float(loss.detach()))
            tl.end_step()
            if on_step is not None:
                on_step(step, losses[-1], worker, result)
        worker.pull()
    return {"role": "worker", "rank": rank, "losses": losses, "stats": worker.stats(),
            "params": {n: t.detach().cpu().clone() for n, t in worker.replica.items()}}
