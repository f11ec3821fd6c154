"""Error feedback: the compression error is remembered and added back next time."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from gradcomp import _validate as v
from gradcomp.compressors.base import Compressor, _check_wire_out, _flat
from gradcomp.compressors.int8 import Int8Quantizer

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Compressor):
    """Wraps any compressor with a residual (error-feedback memory) per key.

    For each call with key ``k`` (Seide et al. 2014, 1-bit SGD; Karimireddy et
    al. 2019, EF-SGD)::

        p = x + residual[k];  wire = C(p);  residual[k] = p - D(wire)

    so the sum of everything decompressed plus the final residual equals the sum
    of the inputs (nothing is lost, only delayed). With :class:`Int8Quantizer`
    the three steps run fused in one kernel pass (``quantize_int8_ef``).
    Residuals are float32, on the tensor's device, flat (the tensor's numel).

    A residual that turns non-finite (NaN/Inf input) is dropped: that key starts
    again from zero and :attr:`nonfinite_resets` counts the event; the payload
    itself still decodes non-finite, so AMP's GradScaler skips the step.

    Args:
        compressor: the wrapped compressor (not another ErrorFeedback).

    Raises:
        TypeError / ValueError: bad compressor; a key reused for a tensor with
            another number of elements (keys keep residuals of different tensors apart).
    """

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a gradcomp compressor, got {type(compressor).__name__}")
        if isinstance(compressor, ErrorFeedback):
            raise ValueError("compressor is already an ErrorFeedback; wrap the inner compressor once")
        self.wraps = compressor
        self.codec = compressor.codec
        self.sparse = compressor.sparse
        self.lossy = compressor.lossy
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.nonfinite_resets = 0

    def _codecs(self):
        return self.wraps._codecs()

    def compress(self, t: torch.Tensor, key: Hashable = None, *, out: torch.Tensor | None = None):
        """Compress ``t + residual[key]`` and update ``residual[key]``.

        Args:
            t: floating tensor of any shape and device.
            key: identifies the tensor across calls (e.g. a parameter name);
                ``None`` is a key like any other.
            out: optional wire buffer, as for :meth:`Compressor.compress`.
        """
        v.data_tensor("t", t)
        t = t.detach()  # a residual must not hold (and chain) autograd graphs across steps
        if out is not None:
            _check_wire_out(self, out, t)
        x = _flat(t)
        r = self.residual_for(key, x.numel(), x.device)
        if isinstance(self.wraps, Int8Quantizer):
            p = self.wraps._encode_ef(x, r, t.dtype, t.shape, out=out)
        else:
            px = x.to(torch.float32) + r
            p = self.wraps._encode(px, t.dtype, t.shape, out=out)
            r = px - self.wraps._decode_flat(p).to(torch.float32)
        self.keep(key, r)
        return p

    def residual_for(self, key: Hashable, numel: int, device) -> torch.Tensor:
        """The residual to compress ``key``'s next tensor with: the one held (moved
        to ``device``) or a new zero one (flat float32, ``numel`` elements). Not
        stored until :meth:`keep`.

        Raises:
            ValueError: ``key`` holds the residual of a tensor with another numel.
        """
        r = self.residuals.get(key)
        if r is None:
            return torch.zeros(numel, dtype=torch.float32, device=device)
        if r.numel() != numel:
            raise ValueError(
                f"key {key!r} holds the residual of a tensor with {r.numel()} elements, "
                f"got a tensor with {numel}: use one key per tensor"
            )
        return r if r.device == torch.device(device) else r.to(device)

    def keep(self, key: Hashable, r: torch.Tensor) -> None:
        """Store ``r`` as ``key``'s residual, or drop it (and count a reset) if it
        holds NaN/Inf."""
        if not bool(torch.isfinite(r).all()):
            self.residuals.pop(key, None)
            self.nonfinite_resets += 1
        else:
            self.residuals[key] = r

    def _encode(self, x, dtype, shape, out=None):
        return self.wraps._encode(x, dtype, shape, out=out)

    def _decode_flat(self, p):
        return self.wraps._decode_flat(p)

    def _decode_into(self, p, out):
        self.wraps._decode_into(p, out)

    def decompress_add_(self, p, acc):
        return self.wraps.decompress_add_(p, acc)

    def reduce_compress_(self, p, acc, *, divisor=1, out=None, decode=False):
        """The wrapped compressor's :meth:`~Compressor.reduce_compress_`: a sum
        of several ranks' data is compressed without error feedback (no residual
        is read or written)."""
        return self.wraps.reduce_compress_(p, acc, divisor=divisor, out=out, decode=decode)

    def wire_nbytes(self, shape, dtype=torch.float32):
        return self.wraps.wire_nbytes(shape, dtype)

    def residual(self, key: Hashable = None) -> torch.Tensor | None:
        """The float32 residual held for ``key`` (flat), or None."""
        return self.residuals.get(key)

    def reset(self, key: Hashable = None, *, all: bool = False) -> None:
        """Forget the residual of ``key`` (or every residual with ``all=True``)."""
        if all:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    def residual_nbytes(self) -> int:
        """Memory held by residuals, in bytes."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def state_dict(self):
        """Residuals (on CPU), the reset count and the wrapped compressor's state."""
        return {
            "residuals": {k: r.detach().cpu().clone() for k, r in self.residuals.items()},
            "nonfinite_resets": self.nonfinite_resets,
            "compressor": self.wraps.state_dict(),
        }

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (validated before anything changes).

        Raises:
            TypeError: ``state`` or its ``"residuals"`` is not a mapping, or a
                residual is not a floating tensor.
            ValueError: a residual holds NaN/Inf (a valid state never does).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        res = state.get("residuals")
        if not isinstance(res, Mapping):
            raise TypeError(f"state['residuals'] must be a mapping of key -> tensor, got {type(res).__name__}")
        residuals = {}
        for k, r in res.items():
            if (not isinstance(r, torch.Tensor) or r.layout != torch.strided
                    or not torch.is_floating_point(r)):
                what = f"{r.dtype} tensor" if isinstance(r, torch.Tensor) else type(r).__name__
                raise TypeError(f"state['residuals'][{k!r}] must be a floating tensor, got a {what}")
            # residuals are flat (one per key, compared by numel): a shaped one must
            # not broadcast against the flat input
            r = r.detach().to(torch.float32).reshape(-1).clone()
            if not bool(torch.isfinite(r).all()):
                raise ValueError(f"state['residuals'][{k!r}] holds NaN or Inf")
            residuals[k] = r
        resets = v.integer("state['nonfinite_resets']", state.get("nonfinite_resets", 0), 0)
        self.wraps.load_state_dict(state.get("compressor", {}))
        self.residuals = residuals
        self.nonfinite_resets = resets

    def __repr__(self):
        return f"ErrorFeedback({self.wraps!r})"
