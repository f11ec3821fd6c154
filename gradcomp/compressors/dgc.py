"""Deep Gradient Compression (Lin et al. 2018): top-k sparsification that keeps
accuracy at 0.1% density.

Details: docs/dgc.md#the-four-fixes-of-dgc.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Hashable, Mapping

import torch

from gradcomp import _validate as v
from gradcomp import kernels
from gradcomp import wire as W
from gradcomp.compressors._common import flat
from gradcomp.compressors.base import Compressor
from gradcomp.compressors.error_feedback import ErrorFeedback, checked_residuals
from gradcomp.compressors.sparse import TopK

__all__ = ["DGC", "check_optimizer"]

#: added to a norm before dividing by it (as torch.nn.utils.clip_grad_norm_ does)
_CLIP_EPS = 1e-6


class DGC(ErrorFeedback):
    """Deep Gradient Compression around a :class:`~gradcomp.TopK` (Lin et al.
    2018, "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training"; see the module docstring for the algorithm).

    Per key it keeps two float32 tensors of the input's numel, the velocity
    ``u`` (:attr:`momenta`) and the accumulated velocity ``v`` (the residual,
    :attr:`residuals`, as for :class:`~gradcomp.ErrorFeedback`), and a step
    count for the warm-up. The payload is a top-k payload of ``v``: decode it
    with the wrapped TopK (``dgc.decompress``). Values compressed by the
    top-k's ``values`` codec (e.g. int8) leave their quantization error in
    ``v``.

    Args:
        compressor: the :class:`~gradcomp.TopK` whose density is the final one
            (exact or sampled threshold; its ``values`` codec is used).
        momentum: momentum factor m in [0, 1).
        clip_norm: global L2 clipping threshold per tensor (> 0), or None for
            no clipping; the local threshold is ``clip_norm / sqrt(world_size)``.
        world_size: number of workers whose updates are averaged (>= 1);
            None: the DDP hook state's group size there, 1 elsewhere.
        warmup_steps: steps of warm-up (0: the final density from the start).
        warmup_start: density of the first warm-up stage, in (0, 1].
        warmup_stages: number of warm-up stages (>= 1).
        momentum_masking: zero the velocity where a value was sent.

    Raises:
        TypeError / ValueError: a bad argument (the message names it).
    """

    def __init__(self, compressor: TopK, momentum: float = 0.9, *, clip_norm: float | None = None,
                 world_size: int | None = None, warmup_steps: int = 0, warmup_start: float = 0.25,
                 warmup_stages: int = 4, momentum_masking: bool = True):
        if not isinstance(compressor, TopK):
            raise TypeError(f"compressor must be a gradcomp.TopK (DGC selects the top-k of the accumulated "
                            f"velocity), got {type(compressor).__name__}")
        super().__init__(compressor)
        momentum = v.real("momentum", momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None:
            clip_norm = v.real("clip_norm", clip_norm)
            if not (clip_norm > 0 and math.isfinite(clip_norm)):
                raise ValueError(f"clip_norm must be a finite number > 0 or None, got {clip_norm}")
        warmup_start = v.real("warmup_start", warmup_start)
        if not 0.0 < warmup_start <= 1.0:
            raise ValueError(f"warmup_start must be in (0, 1], got {warmup_start}")
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.world_size = None if world_size is None else v.integer("world_size", world_size, 1)
        self.warmup_steps = v.integer("warmup_steps", warmup_steps, 0)
        self.warmup_start = warmup_start
        self.warmup_stages = v.integer("warmup_stages", warmup_stages, 1)
        self.momentum_masking = v.flag("momentum_masking", momentum_masking)
        self.momenta: dict[Hashable, torch.Tensor] = {}
        self.steps: dict[Hashable, int] = {}

    # ---- the schedule and the clipping threshold --------------------------------
    def density(self, step: int, n: int) -> float:
        """Density (k / n) used at ``step`` (0-based) for a tensor of ``n`` elements.

        During warm-up, stage ``j = step * warmup_stages // warmup_steps`` has
        density ``warmup_start * (d / warmup_start) ** (j / warmup_stages)``,
        ``d`` the top-k's own density for ``n`` (never below ``d``); afterwards ``d``.
        """
        return self.k_at(step, n) / n if n else 0.0

    def k_at(self, step: int, n: int) -> int:
        """Elements sent at ``step`` from a tensor of ``n`` elements."""
        final = self.wraps.k_for(n)
        if step >= self.warmup_steps or n == 0:
            return final
        d = final / n
        if self.warmup_start <= d:
            return final
        stage = step * self.warmup_stages // self.warmup_steps
        dens = self.warmup_start * (d / self.warmup_start) ** (stage / self.warmup_stages)
        return min(n, max(final, math.ceil(dens * n)))

    @property
    def local_clip_norm(self) -> float | None:
        """``clip_norm / sqrt(world_size)`` (world_size None counts as 1), or None
        without clipping."""
        return None if self.clip_norm is None else self.clip_norm / math.sqrt(self.world_size or 1)

    # ---- one step -----------------------------------------------------------------
    def compress(self, t: torch.Tensor, key: Hashable = None, *, out: torch.Tensor | None = None):
        """One DGC step for the tensor ``key``: clip, accumulate, select, mask.

        Args:
            t: floating tensor of any shape and device (the local gradient; not modified).
            key: identifies the tensor across calls (e.g. a parameter name).
            out: not supported (a sparse payload has no fixed size); must be None.

        Returns:
            A top-k :class:`~gradcomp.Payload` of the accumulated velocity.

        Raises:
            ValueError: ``key`` holds the state of a tensor with another numel; ``out`` given.
            TypeError: an unhashable ``key``.
        """
        v.data_tensor("t", t)
        v.key(key)
        if out is not None:
            raise ValueError(f"out= needs a dense compressor (fixed wire size), got {self!r}")
        x = flat(t.detach())
        n = x.numel()
        u, r = self.momenta.get(key), self.residuals.get(key)
        if u is None or r is None:
            u = torch.zeros(n, dtype=torch.float32, device=x.device)
            r = torch.zeros(n, dtype=torch.float32, device=x.device)
        elif u.numel() != n:
            raise ValueError(f"key {key!r} holds the DGC state of a tensor with {u.numel()} elements, "
                             f"got a tensor with {n}: use one key per tensor")
        elif u.device != x.device:
            u, r = u.to(x.device), r.to(x.device)
        self.momenta[key], self.residuals[key] = u, r
        step = self.steps.get(key, 0)
        p = self.step_(x, u, r, step, t.dtype, t.shape)
        self.steps[key] = step + 1
        return p

    def step_(self, g: torch.Tensor, u: torch.Tensor, r: torch.Tensor, step: int, dtype: torch.dtype,
              shape, segments=None) -> W.Payload:
        """One DGC step on explicit state, updating ``u`` and ``r`` in place.

        Args:
            g: flat gradient (any floating dtype), n elements.
            u, r: flat contiguous float32 velocity and accumulated velocity of n
                elements on g's device.
            step: the step number (0-based) for the warm-up schedule.
            dtype, shape: recorded in the payload header.
            segments: ``(offset, numel)`` ranges, each clipped and its top-k
                selected separately, as the paper does per layer (the
                parameters of a DDP bucket: one payload, indices ascending
                across them); None: the whole tensor is one.

        Returns:
            The payload. A non-finite value in the state (NaN/Inf gradient)
            is always among those sent (they rank above every finite value):
            the state is then reset to zero and :attr:`nonfinite_resets` counted.
        """
        n = g.numel()
        g = g if g.dtype == torch.float32 else g.to(torch.float32)
        top = self.wraps
        segments = segments if segments is not None else ((0, n),)
        picks = [self._accumulate_select(g[off:off + m], u[off:off + m], r[off:off + m], self.k_at(step, m))
                 for off, m in segments]
        if len(picks) == 1:
            idx, vals = picks[0]
        else:
            idx = torch.cat([i.to(torch.int64) + off for (i, _), (off, _) in zip(picks, segments)])
            vals = torch.cat([val for _, val in picks])
        p = top._pack(n, idx, vals, dtype, shape)
        sent = idx.long()
        if not v.all_finite(vals):
            u.zero_()
            r.zero_()
            self.nonfinite_resets += 1
            return p
        if top.values is None:
            r.index_fill_(0, sent, 0.0)  # delivered exactly
        else:
            r.index_add_(0, sent, top._values_f32(p).neg())  # the values codec's error stays
        if self.momentum_masking:
            u.index_fill_(0, sent, 0.0)
        return p

    def clip_scale(self, g: torch.Tensor) -> float:
        """The local clipping factor of gradient ``g``:
        ``min(1, local_clip_norm / (||g||_2 + 1e-6))`` (1 without clipping or
        for a non-finite norm)."""
        limit = self.local_clip_norm
        if limit is None:
            return 1.0
        norm = float(torch.linalg.vector_norm(g))
        return limit / (norm + _CLIP_EPS) if math.isfinite(norm) and norm + _CLIP_EPS > limit else 1.0

    def accumulate_(self, g: torch.Tensor, u: torch.Tensor, r: torch.Tensor, segments=None) -> None:
        """Momentum correction with local clipping, in place: per segment,
        ``u = m u + clip_scale(g) g``, ``r += u`` (arguments as for :meth:`step_`)."""
        g = g if g.dtype == torch.float32 else g.to(torch.float32)
        for off, m in (segments if segments is not None else ((0, g.numel()),)):
            gs = g[off:off + m]
            kernels.dgc_accumulate_(gs, u[off:off + m], r[off:off + m], self.momentum, self.clip_scale(gs),
                                    backend=self.wraps.backend)

    def _accumulate_select(self, g, u, r, k: int):
        """Accumulate one segment and select its top ``k`` (fused for exact top-k)."""
        top = self.wraps
        if top.exact:
            return kernels.dgc_topk_(g, u, r, self.momentum, self.clip_scale(g), k, backend=top.backend)
        kernels.dgc_accumulate_(g, u, r, self.momentum, self.clip_scale(g), backend=top.backend)
        return top._select(r, k)

    def bind(self, momenta: torch.Tensor, residual: torch.Tensor, step: int, segments=None) -> Compressor:
        """A compressor whose :meth:`~Compressor.compress` runs :meth:`step_` on
        the given flat state (the DDP hook keeps that state per parameter)."""
        return _Bound(self, momenta, residual, step, segments)

    # ---- state ----------------------------------------------------------------------
    def reset(self, key: Hashable = None, *, all: bool = False) -> None:
        """Forget the state of ``key`` (or of every key with ``all=True``)."""
        for d in (self.residuals, self.momenta, self.steps):
            if all:
                d.clear()
            else:
                d.pop(key, None)

    def residual_nbytes(self) -> int:
        """Memory held by the velocities and accumulated velocities, in bytes."""
        return super().residual_nbytes() + sum(u.numel() * u.element_size() for u in self.momenta.values())

    def state_dict(self):
        """Accumulated velocities, velocities, steps (all on CPU) and counters."""
        d = super().state_dict()
        d["momenta"] = {k: u.detach().cpu().clone() for k, u in self.momenta.items()}
        d["steps"] = dict(self.steps)
        return d

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (validated before anything changes).

        Raises:
            TypeError / ValueError: a malformed state, or velocities that do not
                match the accumulated velocities key for key and in size.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        mom, steps = state.get("momenta"), state.get("steps")
        if not isinstance(mom, Mapping) or not isinstance(steps, Mapping):
            raise TypeError("state['momenta'] and state['steps'] must be mappings (from DGC.state_dict())")
        momenta = checked_residuals(mom, "state['momenta']")
        probe = ErrorFeedback(self.wraps)
        probe.load_state_dict(state)
        if set(momenta) != set(probe.residuals) or any(
                momenta[k].numel() != probe.residuals[k].numel() for k in momenta):
            raise ValueError("state['momenta'] must hold one velocity per accumulated velocity, of its size")
        steps = {k: v.integer(f"state['steps'][{k!r}]", s, 0) for k, s in steps.items()}
        self.residuals, self.nonfinite_resets = probe.residuals, probe.nonfinite_resets
        self.momenta, self.steps = momenta, steps

    def __repr__(self):
        return (f"DGC({self.wraps!r}, momentum={self.momentum}, clip_norm={self.clip_norm}, "
                f"world_size={self.world_size}, warmup_steps={self.warmup_steps}, "
                f"warmup_start={self.warmup_start}, warmup_stages={self.warmup_stages}, "
                f"momentum_masking={self.momentum_masking})")


class _Bound(Compressor):
    """:meth:`DGC.bind`: compresses with one DGC step on given flat state and
    decodes as the wrapped TopK."""

    def __init__(self, dgc: DGC, momenta, residual, step, segments):
        self.dgc, self.codec = dgc, dgc.wraps.codec
        self._state = (momenta, residual, step, segments)

    def _encode(self, x, dtype, shape, out=None):
        u, r, step, segments = self._state
        return self.dgc.step_(x, u, r, step, dtype, shape, segments)

    def _decode_flat(self, p):
        return self.dgc.wraps._decode_flat(p)

    def decompress_add_(self, p, acc):
        return self.dgc.wraps.decompress_add_(p, acc)


def check_optimizer(optimizer) -> None:
    """Check that ``optimizer`` keeps to DGC's contract: plain SGD, since DGC
    applies the momentum itself before compressing.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a factory
            ``f(list[nn.Parameter]) -> Optimizer`` (called once on a dummy parameter).

    Raises:
        ValueError: an SGD (or any optimizer with a ``momentum`` setting) with
            momentum > 0 or ``nesterov=True`` in a parameter group.
        TypeError: ``optimizer`` is neither.

    Warns:
        UserWarning: an optimizer with its own moment estimates (``betas``:
            Adam, AdamW, ...), which DGC's momentum correction does not model.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory of one, "
                            f"got {type(optimizer).__name__}")
        optimizer = optimizer([torch.nn.Parameter(torch.zeros(1))])
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned a {type(optimizer).__name__}, not an Optimizer")
    for i, group in enumerate(optimizer.param_groups):
        m = group.get("momentum", 0)
        if isinstance(m, numbers.Real) and m > 0 or group.get("nesterov", False):
            raise ValueError(
                f"with DGC the momentum is applied before compression (momentum correction); the optimizer "
                f"must be plain SGD, got {type(optimizer).__name__} with momentum={m} in param group {i}: "
                f"pass momentum={m} to gc.DGC and momentum=0 to the optimizer")
        if "betas" in group:
            warnings.warn(f"DGC's momentum correction assumes a plain SGD optimizer; "
                          f"{type(optimizer).__name__} keeps its own moment estimates", stacklevel=2)
            return
