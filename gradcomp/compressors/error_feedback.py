"""Error feedback: the compression error is remembered and added back next time.

:class:`ErrorFeedback` is the memory of GRACE's compressor / memory /
communicator split: it wraps a :class:`~gradcomp.Compressor` (the codec) and
is not one itself. What a user passes where a compressor is expected may be
either; :func:`split` is the one place that tells them apart.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping

import torch

from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.compressors._common import check_wire_out, flat
from gradcomp.compressors.base import Compressor

__all__ = ["ErrorFeedback", "checked_residuals", "split", "unwrapped"]


class ErrorFeedback:
    """Wraps any compressor with a residual (error-feedback memory) per key.

    For each call with key ``k`` (Seide et al. 2014, 1-bit SGD; Karimireddy et
    al. 2019, EF-SGD)::

        p = x + residual[k];  wire = C(p);  residual[k] = p - D(wire)

    so the sum of everything decompressed plus the final residual equals the sum
    of the inputs (nothing is lost, only delayed). With the blockwise codecs
    (:class:`IntQuantizer`, :class:`SignQuantizer`, :class:`FP8`) the three steps run
    fused in one kernel pass (``quantize_int8_ef``, ``quantize_packed_ef``, ...).
    Residuals are float32, on the tensor's device, flat (the tensor's numel).

    A residual that turns non-finite (NaN/Inf input) is dropped: that key starts
    again from zero and :attr:`nonfinite_resets` counts the event; the payload
    itself still decodes non-finite, so AMP's GradScaler skips the step.

    It is not a :class:`~gradcomp.Compressor`: its :meth:`compress` takes the
    residual's key. Payloads are the wrapped compressor's (same codec and wire
    size): :meth:`decompress`, :meth:`decompress_add_` and :meth:`wire_nbytes`
    are the wrapped compressor's, as are :attr:`codec`, :attr:`sparse` and
    :attr:`lossy`.

    Args:
        compressor: the wrapped compressor (not another ErrorFeedback).

    Attributes:
        wraps: the wrapped compressor.
        residuals: key -> flat float32 residual.
        nonfinite_resets: residuals dropped because they held NaN/Inf.

    Raises:
        TypeError / ValueError: bad compressor; a key reused for a tensor with
            another number of elements (keys keep residuals of different tensors apart).
    """

    summable = False  # as every compressor's

    def __init__(self, compressor: Compressor):
        if isinstance(compressor, ErrorFeedback):
            raise ValueError("compressor is already an ErrorFeedback; wrap the inner compressor once")
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a gradcomp compressor, got {type(compressor).__name__}")
        self.wraps = compressor
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.nonfinite_resets = 0

    @property
    def codec(self) -> str:
        """The wrapped compressor's codec."""
        return self.wraps.codec

    @property
    def sparse(self) -> bool:
        return self.wraps.sparse

    @property
    def lossy(self) -> bool:
        return self.wraps.lossy

    def compress(self, t: torch.Tensor, key: Hashable = None, *, out: torch.Tensor | None = None):
        """Compress ``t + residual[key]`` and update ``residual[key]``.

        Args:
            t: floating tensor of any shape and device.
            key: identifies the tensor across calls (e.g. a parameter name);
                ``None`` is a key like any other.
            out: optional wire buffer, as for :meth:`Compressor.compress`.

        Raises:
            TypeError: a bad ``t``; an unhashable ``key``. ValueError: ``key``
                holds the residual of a tensor with another numel; a bad ``out``.
        """
        v.data_tensor("t", t)
        v.key(key)
        t = t.detach()  # a residual must not hold (and chain) autograd graphs across steps
        if out is not None:
            check_wire_out(self.wraps, out, t)
        x = flat(t)
        r = self.residual_for(key, x.numel(), x.device)
        p = self.wraps._encode_ef(x, r, t.dtype, t.shape, out=out)
        if p is None:  # no fused kernel: compress the sum, then the residual from the decoded payload
            px = x.to(torch.float32) + r
            p = self.wraps._encode(px, t.dtype, t.shape, out=out)
            r = self.wraps._residual(p, px)
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
        if not v.all_finite(r):
            self.residuals.pop(key, None)
            self.nonfinite_resets += 1
        else:
            self.residuals[key] = r

    def decompress(self, p: "W.Payload | torch.Tensor", *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The wrapped compressor's :meth:`~gradcomp.Compressor.decompress` (no residual is read)."""
        return self.wraps.decompress(p, out=out)

    def decompress_add_(self, p: "W.Payload | torch.Tensor", acc: torch.Tensor) -> torch.Tensor:
        """The wrapped compressor's :meth:`~gradcomp.Compressor.decompress_add_`."""
        return self.wraps.decompress_add_(p, acc)

    def wire_nbytes(self, shape, dtype: torch.dtype = torch.float32) -> int | None:
        """The wrapped compressor's :meth:`~gradcomp.Compressor.wire_nbytes`."""
        return self.wraps.wire_nbytes(shape, dtype)

    def clone(self) -> "ErrorFeedback":
        """A copy with the same settings and state (residuals included)."""
        return copy.deepcopy(self)

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
                residual is not a floating tensor holding data.
            ValueError: a residual holds NaN/Inf in float32 (a valid state never does).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        residuals = checked_residuals(state.get("residuals"), "state['residuals']")
        resets = v.integer("state['nonfinite_resets']", state.get("nonfinite_resets", 0), 0)
        self.wraps.load_state_dict(state.get("compressor", {}))
        self.residuals = residuals
        self.nonfinite_resets = resets

    def __repr__(self):
        return f"ErrorFeedback({self.wraps!r})"


def checked_residuals(res, name: str) -> dict:
    """Flat float32 copies of a ``key -> tensor`` mapping of residuals (or
    velocities) from a state dict, validated.

    Raises:
        TypeError: ``res`` is not a mapping, or a value is not a floating
            tensor holding data. ValueError: a value holds NaN/Inf (or
            values beyond float32's range).
    """
    if not isinstance(res, Mapping):
        raise TypeError(f"{name} must be a mapping of key -> tensor, got {type(res).__name__}")
    out = {}
    for k, r in res.items():
        if (not isinstance(r, torch.Tensor) or r.layout != torch.strided or r.is_meta
                or not torch.is_floating_point(r)):
            what = (("meta " if r.is_meta else "") + f"{r.dtype} tensor" if isinstance(r, torch.Tensor)
                    else type(r).__name__)
            raise TypeError(f"{name}[{k!r}] must be a floating tensor holding data, got a {what}")
        # residuals are flat (one per key, compared by numel): a shaped one must
        # not broadcast against the flat input
        r = r.detach().to(torch.float32).reshape(-1).clone()
        if not v.all_finite(r):
            raise ValueError(f"{name}[{k!r}] holds NaN or Inf (in float32)")
        out[k] = r
    return out


def split(compressor, name: str = "compressor", allowed: str = "") -> tuple[Compressor, ErrorFeedback | None]:
    """The codec and the error feedback of what was passed as a compressor.

    Transports ask this one question instead of testing types: the codec
    compresses sums and decodes; the error feedback, when there is one,
    compresses this rank's own data with its residual.

    Args:
        compressor: a :class:`~gradcomp.Compressor` or an :class:`ErrorFeedback`
            (:class:`~gradcomp.DGC` included).
        name, allowed: the argument's name and what else it may be (e.g.
            ``" or None"``), for the error message.

    Returns:
        ``(compressor, None)`` for a compressor, ``(ef.wraps, ef)`` for an error feedback.

    Raises:
        TypeError: neither.
    """
    if isinstance(compressor, ErrorFeedback):
        return compressor.wraps, compressor
    if isinstance(compressor, Compressor):
        return compressor, None
    raise TypeError(f"{name} must be a gradcomp compressor{allowed} (e.g. gc.Int8Quantizer()), "
                    f"got {type(compressor).__name__}")


def unwrapped(compressor, name: str, why: str, allowed: str = "") -> Compressor:
    """``compressor`` itself, where the caller keeps the residuals (an
    :class:`ErrorFeedback` is refused).

    Raises:
        TypeError: not a compressor. ValueError: an ErrorFeedback (the message
            names ``name`` and ends with ``why``).
    """
    codec, ef = split(compressor, name, allowed)
    if ef is not None:
        raise ValueError(f"{name} must not be an ErrorFeedback: pass the compressor itself; {why}")
    return codec
