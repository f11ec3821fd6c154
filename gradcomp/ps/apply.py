"""A server's update rule: decode pushes, average a sync round, step the optimizer, encode pulls.

:class:`ShardUpdater` holds one server's shard (float32 ``nn.Parameter``
tensors on one device) and the ``torch.optim`` optimizer that updates it. It
knows nothing of sockets, peers' liveness or checkpoints: the message loop
(:mod:`gradcomp.ps.server`) hands it decoded requests and counts versions.
"""

from __future__ import annotations

import functools
import math

import torch

from gradcomp import _validate as v
from gradcomp.compressors import Compressor, Int8Quantizer, NoCompression, decompress_add_, split
from gradcomp.errors import PayloadError
from gradcomp.ps import protocol as P
from gradcomp.ps.sharding import ParamSpec
from gradcomp.wire import decode

__all__ = ["Rejected", "ShardUpdater", "check_clip_norm", "check_pull_compressor"]


class Rejected(Exception):
    """A push that cannot be applied; :attr:`reason` is its key in the
    server's ``rejected_reasons`` (``"payload"``, ``"shape"``, ``"nonfinite"``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ShardUpdater:
    """One server's parameters and optimizer.

    Args:
        shard: this server's parameters (:class:`~gradcomp.ps.ParamSpec`), in shard order.
        tensors: name -> initial floating tensor for every name of ``shard``
            (copied to float32 on ``device``).
        device: device of the shard and of the update arithmetic.
        optimizer: factory ``f(params: list[nn.Parameter]) -> torch.optim.Optimizer``;
            None: SGD with ``lr=0.01, momentum=0.9``.
        clip_grad_norm: clip each step's gradient of the shard to this L2 norm
            (``torch.nn.utils.clip_grad_norm_``; finite, > 0) or None.
        staleness_lr: scale a step's learning rate by ``1 / (1 + staleness)``
            (Zhang et al. 2016, IJCAI, "Staleness-aware Async-SGD").
        compress_pull: answer pulls with compressed deltas against each
            worker's replica (:meth:`encode_pull`).
        pull_compressor: the codec of those deltas (without error feedback:
            the replica is the residual).

    Raises:
        TypeError: ``optimizer`` is not callable or does not return a
            ``torch.optim.Optimizer``.
    """

    def __init__(self, shard: list[ParamSpec], tensors: dict[str, torch.Tensor], device: torch.device,
                 optimizer=None, clip_grad_norm: float | None = None, staleness_lr: bool = False,
                 compress_pull: bool = False, pull_compressor: Compressor | None = None):
        self.shard, self.device = shard, device
        self.clip_grad_norm, self.staleness_lr = clip_grad_norm, staleness_lr
        self.compress_pull, self.pull_compressor = compress_pull, pull_compressor
        self.params = {s.name: torch.nn.Parameter(tensors[s.name].detach().to(device, torch.float32).clone())
                       for s in shard}
        factory = optimizer if optimizer is not None else functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
        if not callable(factory):
            raise TypeError(f"optimizer must be a callable returning a torch.optim.Optimizer, "
                            f"got {type(factory).__name__}")
        self.optimizer = factory(list(self.params.values()))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory must return a torch.optim.Optimizer, "
                            f"got {type(self.optimizer).__name__}")
        #: bytes of the shard's bundle as raw float32 payloads (a push's or pull's uncompressed size)
        self.raw_bundle_nbytes = P.raw_bundle_nbytes(s.shape for s in shard)
        self._raw = NoCompression()
        self._sum: dict[str, torch.Tensor] = {}
        #: sync: global ranks of the workers whose gradient is in the current round
        self.contributors: set[int] = set()

    def decode_push(self, data: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A push's bundle (uint8 tensor) -> ``{name: float32 gradient on device}``,
        every payload validated before any is used.

        Raises:
            Rejected: no data or a malformed bundle or payload (``"payload"``),
                a payload of another shape (``"shape"``), a non-finite
                gradient (``"nonfinite"``).
        """
        if data is None:
            raise Rejected("payload")
        try:
            payloads = [decode(w, max_numel=spec.numel)
                        for spec, w in zip(self.shard, P.unpack_bundle(data, len(self.shard)))]
        except PayloadError:
            raise Rejected("payload") from None
        for spec, p in zip(self.shard, payloads):
            if tuple(p.shape) != spec.shape:
                raise Rejected("shape")
        grads = {}
        for spec, p in zip(self.shard, payloads):
            g = torch.zeros(spec.shape, dtype=torch.float32, device=self.device)
            if p.device != self.device:
                p = decode(p.wire.to(self.device))
            try:
                decompress_add_(p, g)  # by the payload's own codec
            except (PayloadError, ValueError):
                raise Rejected("payload") from None
            if not v.all_finite(g):
                raise Rejected("nonfinite")
            grads[spec.name] = g
        return grads

    def step(self, grads: dict[str, torch.Tensor], staleness: int) -> bool:
        """One optimizer step with ``grads`` (consumed); with ``staleness_lr``
        at ``lr / (1 + staleness)`` (the optimizer's own learning rates are
        restored after it). Returns whether the gradient's norm was clipped."""
        for name, p in self.params.items():
            p.grad = grads[name]
        clipped = False
        if self.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip_grad_norm)
            clipped = float(norm) > self.clip_grad_norm
        saved = None
        if self.staleness_lr and staleness > 0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] / (1 + staleness)
        try:
            self.optimizer.step()
        finally:
            if saved is not None:
                for g, lr in zip(self.optimizer.param_groups, saved):
                    g["lr"] = lr
            for p in self.params.values():
                p.grad = None
        return clipped

    # ---- sync rounds: one averaged step per round of pushes ---------------------------
    def add_to_round(self, rank: int, grads: dict[str, torch.Tensor]) -> None:
        """Sync: add worker ``rank``'s gradient (consumed) to the current round's sum."""
        for name, g in grads.items():
            if name in self._sum:
                self._sum[name].add_(g)
            else:
                self._sum[name] = g
        self.contributors.add(rank)

    def round_complete(self, live: set[int], backup_workers: int = 0) -> bool:
        """Whether every rank of ``live`` (and at least one) has pushed in this round or,
        with backup workers, ``len(live) - backup_workers`` of them (Chen et al. 2016,
        "Revisiting Distributed Synchronous SGD"; a gradient of a rank that died since counts)."""
        if backup_workers and len(self.contributors) >= max(1, len(live) - backup_workers):
            return True
        return bool(self.contributors) and live <= self.contributors

    def take_round_average(self) -> dict[str, torch.Tensor]:
        """The round's mean gradient; a new round starts."""
        n = len(self.contributors)
        grads = {name: s.div_(n) for name, s in self._sum.items()}
        self.discard_round()
        return grads

    def discard_round(self) -> None:
        """Forget the current round's gradients."""
        self._sum, self.contributors = {}, set()

    # ---- pulls ------------------------------------------------------------------------
    def encode_pull(self, mirror: dict[str, torch.Tensor] | None,
                    want_full: bool) -> tuple[list[torch.Tensor], int, dict[str, torch.Tensor] | None]:
        """The payloads of a pull reply, its status and the worker's replica after it.

        Full float32 parameters (:data:`~gradcomp.ps.protocol.FULL`) without
        ``compress_pull``, when ``want_full`` or when the worker has no
        ``mirror`` yet; else ``pull_compressor(params - mirror)`` per
        parameter (:data:`~gradcomp.ps.protocol.DELTA`), the mirror advanced
        in place by exactly the decompressed delta: ``params - mirror`` is the
        pull direction's error-feedback residual, so the replica never drifts.

        Returns:
            ``(wires, status, mirror)``: one uint8 wire per parameter in shard
            order; the mirror to keep (None without ``compress_pull``).
        """
        params = [(n, p.detach()) for n, p in self.params.items()]
        if not self.compress_pull or want_full or mirror is None:
            wires = [self._raw.compress(p).wire for _, p in params]
            return wires, P.FULL, ({n: p.clone() for n, p in params} if self.compress_pull else mirror)
        wires = []
        for n, p in params:
            payload = self.pull_compressor.compress(p - mirror[n])
            self.pull_compressor.decompress_add_(payload, mirror[n])
            wires.append(payload.wire)
        return wires, P.DELTA, mirror


def check_clip_norm(clip_grad_norm) -> float | None:
    """``clip_grad_norm`` as a float, or None.

    Raises:
        TypeError: not a real number or None; ValueError: not finite and > 0.
    """
    if clip_grad_norm is None:
        return None
    clip_grad_norm = v.real("clip_grad_norm", clip_grad_norm)
    if not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
        raise ValueError(f"clip_grad_norm must be a finite number > 0 or None, got {clip_grad_norm}")
    return clip_grad_norm


def check_pull_compressor(c, compress_pull: bool) -> Compressor:
    """The codec of pull deltas: ``c`` (an ``ErrorFeedback`` unwrapped: the
    mirror is the residual), or by default ``Int8Quantizer()`` with
    ``compress_pull`` and ``NoCompression()`` without.

    Raises:
        TypeError: ``c`` is neither a gradcomp compressor nor None.
    """
    if c is None:
        return Int8Quantizer() if compress_pull else NoCompression()
    return split(c, "pull_compressor", " or None")[0]
