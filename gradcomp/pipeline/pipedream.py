"""PipeDream: asynchronous 1F1B with weight stashing (Narayanan et al., SOSP 2019).

Details: docs/pipeline.md#pipedream-and-weight-stashing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from gradcomp.comm.p2p import Comm, Message
from gradcomp.pipeline.boundary import BoundaryCodec, boundary_phase
from gradcomp.pipeline.memory import ActivationMeter
from gradcomp.pipeline.bubble import Span, StageTimeline

__all__ = ["PipeDreamStage", "PipeDreamStats", "one_f_one_b_order", "TAG_FWD", "TAG_BWD"]

TAG_FWD, TAG_BWD = 100, 200
_STAMP = 16  # bytes: int64 minibatch index, int64 version


def one_f_one_b_order(stage: int, stages: int, n: int) -> list[tuple[str, int]]:
    """PipeDream's operation order on ``stage``: ``p - 1 - stage`` warm-up
    forwards, then forward/backward pairs, then the remaining backwards
    (a single drain at the end of training)."""
    warm = min(stages - 1 - stage, n)
    order = [("F", i) for i in range(warm)]
    for j in range(n - warm):
        order += [("F", warm + j), ("B", j)]
    order += [("B", j) for j in range(n - warm, n)]
    return order


@dataclass
class PipeDreamStats:
    """What a stage measured (picklable).

    Attributes:
        staleness: per minibatch (in update order), versions between its
            forward's weights and the weights its update landed on.
        forward_versions: per minibatch, the weight version its forward used.
        update_times: ``time.perf_counter()`` of each update (seconds).
        losses: training loss per minibatch (last stage only).
        stash_peak_bytes: most bytes of stashed weight versions alive at once.
        activation_peak_bytes: peak bytes saved for backward.
        records: with ``record=True``, per minibatch: input, output gradient,
            forward version and computed parameter gradients; plus
            ``versions``: the weights of every version (for checks).
    """

    staleness: list[int] = field(default_factory=list)
    forward_versions: list[int] = field(default_factory=list)
    update_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    stash_peak_bytes: int = 0
    activation_peak_bytes: int = 0
    records: list[dict] = field(default_factory=list)
    versions: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def update_rate(self, skip: float = 0.1) -> float:
        """Updates per second after the first ``skip`` share of updates (steady state)."""
        t = self.update_times[int(len(self.update_times) * skip):]
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0


@dataclass
class _InFlight:
    version: int
    x: torch.Tensor | None
    out: torch.Tensor
    weights: list[torch.Tensor]


class PipeDreamStage:
    """One stage of PipeDream's asynchronous 1F1B on a process group.

    Args:
        module: this stage's layers (its parameters are the live weights).
        stage: this stage's index; ``comm`` group rank ``stage`` holds it.
        comm: point-to-point layer over the pipeline's group (one rank per stage).
        codec: boundary codec (compressor, meter) for activations and gradients.
        optimizer: optimizer over ``module``'s parameters, stepped after every backward.
        act_shape: shape of the activation this stage sends (``None`` for the last stage).
        in_shape: shape of the activation it receives (``None`` for the first stage).
        loss_fn: ``loss_fn(output, target)`` (last stage).
        vertical_sync: run every minibatch on the input stage's version.
        timeline, memory: optional recorders.
        record: keep per-minibatch inputs, gradients and every weight version (tests).

    Raises:
        ValueError: the group does not hold one rank per stage, or a shape is missing.
    """

    def __init__(self, module: nn.Module, stage: int, comm: Comm, codec: BoundaryCodec,
                 optimizer: torch.optim.Optimizer, *, act_shape=None, in_shape=None,
                 loss_fn: Callable | None = None, vertical_sync: bool = False,
                 timeline: StageTimeline | None = None, memory: ActivationMeter | None = None,
                 record: bool = False):
        self.module, self.stage, self.comm, self.codec, self.opt = module, stage, comm, codec, optimizer
        self.stages = comm.world_size
        if comm.rank != stage:
            raise ValueError(f"stage {stage} must run on group rank {stage}, this is rank {comm.rank}")
        self.first, self.last = stage == 0, stage == self.stages - 1
        if (not self.last and act_shape is None) or (not self.first and in_shape is None):
            raise ValueError("act_shape (all but the last stage) and in_shape (all but the first) "
                             "are required")
        if self.last and loss_fn is None:
            raise ValueError("the last stage needs loss_fn")
        self.act_shape, self.in_shape, self.loss_fn = act_shape, in_shape, loss_fn
        self.vertical_sync = vertical_sync
        self.timeline = timeline if timeline is not None else StageTimeline(stage)
        self.memory, self.record = memory, record
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.version = 0
        self.stats = PipeDreamStats()
        self._snapshots: dict[int, list[torch.Tensor]] = {}
        self._sends: list = []

    # ---- weights ---------------------------------------------------------
    def _weights(self, version: int) -> list[torch.Tensor]:
        """The (stashed) weights of ``version``: detached leaves, requiring grad."""
        snap = self._snapshots.get(version)
        if snap is None:
            if version != self.version:
                raise RuntimeError(f"stage {self.stage}: weight version {version} is not stashed "
                                   f"(current {self.version})")
            snap = [p.detach().clone().requires_grad_(True) for p in self.params]
            self._snapshots[version] = snap
            if self.memory is not None:
                self.memory.exclude(snap)
            if self.record:
                self.stats.versions[version] = [t.detach().clone() for t in snap]
        return snap

    def _prune(self, keep_from: int) -> None:
        # stashes still referenced by in-flight minibatches live on in their records
        for v in [v for v in self._snapshots if v < keep_from]:
            snap = self._snapshots.pop(v)
            if self.memory is not None:
                self.memory.forget(snap)

    def _stash_bytes(self, inflight: dict[int, _InFlight]) -> int:
        seen = {id(w[0]): w for w in [f.weights for f in inflight.values()] + list(self._snapshots.values())}
        return sum(t.numel() * t.element_size() for w in seen.values() for t in w)

    # ---- messages --------------------------------------------------------
    def _send(self, peer: int, direction: str, tensor: torch.Tensor, mb: int, version: int, tag: int) -> None:
        phase = boundary_phase(direction, self.stage, peer)
        t0 = time.perf_counter()
        wire = self.codec.encode(tensor, phase, key=direction)
        stamp = torch.tensor([mb, version], dtype=torch.int64).view(torch.uint8)
        blob = torch.cat([stamp, wire.reshape(-1).view(torch.uint8)])
        self.codec.meter.record_send(_STAMP, _STAMP, phase)
        self.timeline.spans.append(Span("codec", self.stage, mb, t0, time.perf_counter()))
        self.timeline.mark(direction, self.stage, mb)
        self._sends.append(self.comm.start([Message(peer, blob)], [], phase, tag=tag))
        if len(self._sends) > 2 * self.stages:
            self._sends.pop(0).wait()  # long since received: the peer consumed later messages

    def _recv(self, peer: int, direction: str, shape, tag: int) -> tuple[int, int, torch.Tensor]:
        phase = boundary_phase(direction, peer, self.stage)
        out = torch.empty(shape)
        buf = torch.empty(_STAMP + self.codec.wire_nbytes(shape, out.dtype), dtype=torch.uint8)
        self.comm.start([], [Message(peer, buf)], phase, tag=tag).wait()
        mb, version = (int(v) for v in buf[:_STAMP].view(torch.int64))
        self.codec.meter.record_recv(_STAMP, _STAMP, phase)
        return mb, version, buf[_STAMP:]

    def _decode(self, wire: torch.Tensor, shape, direction: str, peer: int) -> torch.Tensor:
        out = torch.empty(shape)
        phase = boundary_phase(direction, peer, self.stage)
        wire = wire if not self.codec.plain else wire.view(out.dtype).reshape(shape)
        return self.codec.decode_into(wire, out, phase)

    # ---- the schedule ----------------------------------------------------
    def run(self, n: int, inputs: Iterable[torch.Tensor] | None = None,
            targets: Iterable[torch.Tensor] | None = None) -> PipeDreamStats:
        """Train on ``n`` minibatches (the input stage reads ``inputs``, the last ``targets``).

        Returns:
            This stage's :class:`PipeDreamStats`.

        Raises:
            RuntimeError: a message out of order (a lying or confused peer);
            TimeoutError: a peer did not answer within the comm's timeout.
        """
        x_iter: Iterator | None = iter(inputs) if inputs is not None else None
        y_iter: Iterator | None = iter(targets) if targets is not None else None
        inflight: dict[int, _InFlight] = {}
        if self.vertical_sync:
            self._weights(self.version)
        for op, i in one_f_one_b_order(self.stage, self.stages, n):
            if op == "F":
                self._forward(i, inflight, x_iter, y_iter)
            else:
                self._backward(i, inflight)
            self.stats.stash_peak_bytes = max(self.stats.stash_peak_bytes, self._stash_bytes(inflight))
        for t in self._sends:
            t.wait()
        self._sends = []
        if self.memory is not None:
            self.stats.activation_peak_bytes = self.memory.peak
        return self.stats

    def _forward(self, i, inflight, x_iter, y_iter) -> None:
        if self.first:
            x, version = next(x_iter), self.version
            stamp, wire = version, None
        else:
            mb, stamp, wire = self._recv(self.stage - 1, "fwd", self.in_shape, TAG_FWD)
            if mb != i:
                raise RuntimeError(f"stage {self.stage}: expected the activation of minibatch {i}, got {mb}")
            version = stamp if self.vertical_sync else self.version
        needs = None if self.first else ("fwd", self.stage - 1, i)
        with self.timeline.span("forward", self.stage, i, needs) as s:
            if wire is not None:
                before = self.codec.seconds
                x = self._decode(wire, self.in_shape, "fwd", self.stage - 1).requires_grad_(True)
                s.inner_codec = self.codec.seconds - before
            weights = self._weights(version)
            ctx = self.memory.hooks() if self.memory is not None else contextlib.nullcontext()
            with ctx:
                out = functional_call(self.module, dict(zip(self.names, weights)), (x,))
                if self.last:
                    y = next(y_iter)
                    out = self.loss_fn(out, y)
                    self.stats.losses.append(float(out.detach()))
        self.stats.forward_versions.append(version)
        inflight[i] = _InFlight(version, None if self.first else x, out, weights)
        if self.vertical_sync:
            self._prune(min([version] + [f.version for f in inflight.values()]))
        if not self.last:  # the input stage's version travels on unchanged
            self._send(self.stage + 1, "fwd", out, i, stamp, TAG_FWD)

    def _backward(self, j, inflight) -> None:
        f = inflight.pop(j)
        grad_out = None
        wire = None
        if not self.last:
            mb, _, wire = self._recv(self.stage + 1, "bwd", self.act_shape, TAG_BWD)
            if mb != j:
                raise RuntimeError(f"stage {self.stage}: expected the gradient of minibatch {j}, got {mb}")
        needs = None if self.last else ("bwd", self.stage + 1, j)
        with self.timeline.span("backward", self.stage, j, needs) as s:
            if wire is not None:
                before = self.codec.seconds
                grad_out = self._decode(wire, self.act_shape, "bwd", self.stage + 1)
                s.inner_codec = self.codec.seconds - before
            wrt = list(f.weights) + ([f.x] if f.x is not None else [])
            grads = torch.autograd.grad(f.out, wrt, grad_outputs=grad_out)
            param_grads, grad_x = grads[:len(self.params)], (grads[-1] if f.x is not None else None)
        if grad_x is not None:
            self._send(self.stage - 1, "bwd", grad_x, j, f.version, TAG_BWD)
        if self.record:
            self.stats.records.append({"mb": j, "forward_version": f.version,
                                       "update_version": self.version,
                                       "x": None if f.x is None else f.x.detach().clone(),
                                       "grad_out": None if grad_out is None else grad_out.clone(),
                                       "param_grads": [g.clone() for g in param_grads]})
        for p, g in zip(self.params, param_grads):
            p.grad = g
        self.opt.step()
        self.stats.staleness.append(self.version - f.version)
        self.version += 1
        self.stats.update_times.append(time.perf_counter())
        if self.record:
            self.stats.versions.setdefault(self.version, [p.detach().clone() for p in self.params])
        if not self.vertical_sync:
            self._prune(self.version)
        else:
            # a later minibatch may still arrive stamped with this version: stash it now
            self._weights(self.version)
