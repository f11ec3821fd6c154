"""Sparsifiers: TopK (exact or sampled-threshold) and Threshold."""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Mapping

import torch

from gradcomp import _validate as v
from gradcomp import index_codec, kernels
from gradcomp import wire as W
from gradcomp.compressors._common import check_acc
from gradcomp.compressors.base import Compressor, Decoder, decoder
from gradcomp.compressors.dense import NoCompression

__all__ = ["TopK", "Threshold"]


class _Sparse(Compressor):
    """Shared encoding of (indices, values) payloads.

    Kept values travel as a nested dense payload: raw in the original dtype, or
    compressed by ``values`` (any dense compressor, e.g. ``Int8Quantizer()``).
    """

    def __init__(self, values: Compressor | None, backend: str | None, compact_indices: bool = True):
        if values is not None:
            if getattr(values, "wraps", None) is not None:  # an ErrorFeedback
                raise ValueError(f"values must be a dense compressor (e.g. Int8Quantizer()), got {values!r}")
            if not isinstance(values, Compressor):
                raise TypeError(f"values must be a gradcomp compressor or None, got {type(values).__name__}")
            if values.sparse:
                raise ValueError(f"values must be a dense compressor (e.g. Int8Quantizer()), got {values!r}")
        self.values = values
        self.backend = v.backend(backend)
        self.compact_indices = v.flag("compact_indices", compact_indices)
        self._raw = NoCompression()

    @abc.abstractmethod
    def _select(self, x: torch.Tensor):
        """``(indices, values)`` of the kept elements of flat ``x``, ascending."""

    def _encode(self, x, dtype, shape, out=None):  # out: never given (no fixed wire size)
        idx, vals = self._select(x)
        return self._pack(x.numel(), idx, vals, dtype, shape)

    def _pack(self, n: int, idx: torch.Tensor, vals: torch.Tensor, dtype, shape) -> W.Payload:
        """The payload of a selection: ascending ``idx`` of ``n`` elements and the values there."""
        nnz = idx.numel()
        device = vals.device
        inner = self.values if self.values is not None else self._raw
        vp = inner._encode(vals, dtype, (nnz,))
        compact, section = W.index_section(n, nnz, self.compact_indices)
        flags = (W.FLAG_INDEX64 if n >= 2**31 else 0) | (W.FLAG_COMPACT if compact else 0)
        idx = idx.to(torch.int64 if n >= 2**31 else torch.int32)
        if nnz == 0:  # an empty selection may have stride 0, which cannot be viewed as bytes
            idx = idx.new_empty(0)
        param = index_codec.low_bits(n, nnz) if compact else 0
        h = W.build_header(self.codec, dtype, shape, nnz=nnz, flags=flags, param=param)
        ib = index_codec.encode(idx, n) if compact else idx.view(torch.uint8)
        parts = [W.header_tensor(h, device), ib]
        if section > ib.numel():
            parts.append(torch.zeros(section - ib.numel(), dtype=torch.uint8, device=device))
        parts.append(vp.wire)
        w = torch.cat(parts)
        off = len(h) + section
        vp.wire = w[off:]
        indices = idx if compact else w[len(h): len(h) + ib.numel()].view(idx.dtype)
        return W.Payload(wire=w, codec=self.codec, dtype=dtype, shape=torch.Size(shape), nnz=nnz,
                         indices=indices, values=vp)

    def _values_f32(self, p):
        """The kept values of ``p`` in float32 (by ``values`` when it wrote them)."""
        return _values_f32(p, self.values)

    def _decode_flat(self, p):
        return _SPARSE.values(p, self.backend, self.values)

    def _residual(self, p, px):
        """``px`` less the decoded payload, in place: only the kept indices change
        (the payload holds copies of the values, never a view of ``px``). The
        same bits as ``px - decoded``: a decoded value is ``0.0 + v``."""
        if type(self)._decode_flat is not _Sparse._decode_flat:  # a subclass decoding its own way
            return super()._residual(p, px)
        if not p.nnz:
            return px
        idx = p.indices.to(torch.int64)
        px[idx] = px[idx] - (self._values_f32(p) + 0.0)
        return px

    def decompress_add_(self, p, acc):
        """``acc[indices] += values`` in place (float32)."""
        p = self._payload(p)
        check_acc(acc, p)
        if p.nnz:
            _SPARSE.add_(p, acc.view(-1), self.backend, self.values)
        return acc

    def state_dict(self):
        return {"values": self.values.state_dict()} if self.values is not None else {}

    def load_state_dict(self, state):
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        if self.values is not None and "values" in state:
            self.values.load_state_dict(state["values"])


class TopK(_Sparse):
    """Keeps the k elements of largest magnitude (a large negative beats a small
    positive): Aji & Heafield 2017, Stich et al. 2018 (with error feedback).

    ``k = max(1, ceil(ratio * n))`` for ``ratio`` in (0, 1], or the given ``k``
    (``k <= n`` required). ``exact=True`` uses an exact radix select (ties: lower
    index first); ``exact=False`` the sampled threshold of Deep Gradient
    Compression (Lin et al. 2018), which keeps between 0.9 k and 1.1 k elements.

    Wire: header, ascending indices padded to 8 bytes, then the values as a
    nested payload (raw, or ``values``-compressed). The indices are Elias-Fano
    coded (:mod:`gradcomp.index_codec`, wire version 2) where that is smaller
    than int32 (int64 when n >= 2**31), which depends on n and k alone: about
    1.5 bytes per index at density 0.1%, 1.1 at 1%. Size
    ``header + index section + values_payload`` bytes
    (:func:`gradcomp.wire.sparse_nbytes`).

    Args:
        ratio: density k / n in (0, 1]. k: number of kept elements (>= 1).
            Exactly one of ``ratio`` and ``k`` must be given.
        values: optional dense compressor for the kept values, e.g. ``Int8Quantizer()``.
        exact: exact select (True) or sampled threshold (False).
        backend: force a kernel backend.
        compact_indices: code indices compactly where smaller (False: always
            fixed-width, version-1 payloads that older gradcomp releases read).
    """

    codec = "topk"

    def __init__(self, ratio: float | None = None, k: int | None = None,
                 values: Compressor | None = None, exact: bool = True, backend: str | None = None,
                 compact_indices: bool = True):
        if (ratio is None) == (k is None):
            raise ValueError("exactly one of ratio and k must be given")
        if ratio is not None:
            ratio = v.real("ratio", ratio)
            if not 0.0 < ratio <= 1.0:
                raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        if k is not None:
            k = v.integer("k", k, 1)
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
        self.ratio, self.k, self.exact = ratio, k, exact
        super().__init__(values, backend, compact_indices)

    def k_for(self, n: int) -> int:
        """Elements kept from a tensor of n elements.

        Raises:
            ValueError: a fixed ``k`` larger than ``n``.
        """
        if n == 0:
            return 0
        if self.ratio is not None:
            return max(1, math.ceil(self.ratio * n))
        if self.k > n:
            raise ValueError(f"k must be <= the tensor's numel {n}, got {self.k}")
        return self.k

    def _select(self, x, k: int | None = None):
        """The top ``k`` (default :meth:`k_for`) of flat ``x`` by magnitude."""
        k = self.k_for(x.numel()) if k is None else k
        if self.exact:
            return kernels.topk(x, k, backend=self.backend)
        return kernels.approx_topk(x, k, backend=self.backend)

    def wire_nbytes(self, shape, dtype=torch.float32):
        if not self.exact:
            return None
        k = self.k_for(math.prod(shape))
        inner = self.values if self.values is not None else self._raw
        return W.sparse_nbytes(shape, k, inner.wire_nbytes((k,), dtype), self.compact_indices)

    def __repr__(self):
        sel = f"ratio={self.ratio}" if self.ratio is not None else f"k={self.k}"
        return f"TopK({sel}, values={self.values!r}, exact={self.exact})"


class Threshold(_Sparse):
    """Keeps every element with ``|x| >= threshold`` (Strom 2015); NaN is always
    kept so a non-finite gradient is never silently dropped. Zero kept elements
    is a valid payload.

    Args:
        threshold: finite number >= 0 (compared in float32; float64 for float64 input).
        values: optional dense compressor for the kept values.
        backend: force a kernel backend.
        compact_indices: as for :class:`TopK`.
    """

    codec = "threshold"

    def __init__(self, threshold: float, values: Compressor | None = None, backend: str | None = None,
                 compact_indices: bool = True):
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(f"threshold must be a real number, got {type(threshold).__name__}")
        threshold = float(threshold)
        if not (threshold >= 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be a finite number >= 0, got {threshold}")
        self.threshold = threshold
        super().__init__(values, backend, compact_indices)

    def _select(self, x):
        return kernels.threshold(x, self.threshold, backend=self.backend)

    def __repr__(self):
        return f"Threshold({self.threshold}, values={self.values!r})"


def _values_f32(p: W.Payload, values: Compressor | None = None) -> torch.Tensor:
    """The kept values of sparse payload ``p`` in float32: decoded by ``values``
    when it wrote them (its codec), else by their codec's decoder."""
    vp = p.values
    if values is not None and vp.codec == values.codec:
        return values._decode_flat(vp).to(torch.float32)
    return decoder(vp.codec).values(vp).to(torch.float32)


class _SparseDecoder(Decoder):
    """Top-k / threshold payloads: the nested values scattered to their
    indices (float32); ``values`` is the compressor that wrote them, if known."""

    def values(self, p, backend=None, values=None):
        out = torch.zeros(p.numel, dtype=torch.float32, device=p.device)
        if p.nnz:
            kernels.scatter_add_(out, p.indices, _values_f32(p, values), backend=backend)
        return out

    def add_(self, p, acc, backend=None, values=None):
        if p.nnz:
            kernels.scatter_add_(acc, p.indices, _values_f32(p, values), backend=backend)


_SPARSE = _SparseDecoder()
W.register_decoder("topk", _SPARSE)
W.register_decoder("threshold", _SPARSE)
