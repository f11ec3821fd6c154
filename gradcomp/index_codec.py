"""Compact sparse indices: Elias-Fano coding of a strictly ascending index set.

Details: docs/wire-format.md#the-index-codec.
"""

from __future__ import annotations

import torch

from gradcomp import kernels
from gradcomp.errors import PayloadError

__all__ = ["low_bits", "section_nbytes", "encode", "decode"]


def low_bits(n: int, k: int) -> int:
    """``L = floor(log2(n / k))`` for ``1 <= k <= n`` (0 when k > n / 2)."""
    return max(0, (n // k).bit_length() - 1)


def _high_nbits(n: int, k: int, L: int) -> int:
    return k + ((n - 1) >> L)


def section_nbytes(n: int, k: int) -> int:
    """Bytes of the Elias-Fano section for ``k >= 1`` indices in ``[0, n)``
    (without padding)."""
    L = low_bits(n, k)
    return -(-k * L // 8) + -(-_high_nbits(n, k, L) // 8)


def _pack(values: torch.Tensor, offsets: torch.Tensor, nbits: int, nbytes: int) -> torch.Tensor:
    """Bytes of a bit stream with ``values[i]`` (< 2**nbits) written at bit
    ``offsets[i]``, LSB first; the fields must not overlap, so adding them
    into 64-bit words is the same as OR-ing them."""
    nwords = -(-nbytes // 8) + 1
    words = torch.zeros(nwords, dtype=torch.int64, device=values.device)
    w, s = offsets >> 6, offsets & 63
    words.index_add_(0, w, values << s)
    spill = s + nbits > 64  # a field that crosses into the next word
    if bool(spill.any()):
        words.index_add_(0, w[spill] + 1, values[spill] >> (64 - s[spill]))
    return words.view(torch.uint8)[:nbytes]


def _unpack(data: torch.Tensor, count: int, nbits: int) -> torch.Tensor:
    """``count`` fields of ``nbits`` bits (1 <= nbits <= 62) read LSB first
    from the bytes ``data``."""
    nwords = -(-data.numel() // 8) + 1
    buf = torch.zeros(nwords * 8, dtype=torch.uint8, device=data.device)
    buf[: data.numel()] = data
    words = buf.view(torch.int64)
    off = torch.arange(count, dtype=torch.int64, device=data.device) * nbits
    w, s = off >> 6, off & 63
    mask = (1 << nbits) - 1
    out = (words[w] >> s) & mask  # an arithmetic shift: bits above 63 - s copy the sign bit
    spill = s + nbits > 64  # a field that continues in the next word
    if bool(spill.any()):
        ss = s[spill]
        out[spill] = (out[spill] & ((1 << (64 - ss)) - 1)) | ((words[w[spill] + 1] << (64 - ss)) & mask)
    return out


def encode(idx: torch.Tensor, n: int) -> torch.Tensor:
    """The Elias-Fano bytes of ``k >= 1`` strictly ascending indices in ``[0, n)``.

    Args:
        idx: int32/int64 ``[k]`` on any device, strictly ascending in
            ``[0, n)`` (as the selection kernels produce them; the native
            path raises ValueError otherwise, the torch path trusts them).
        n: the tensor's number of elements.

    Returns:
        uint8 ``[section_nbytes(n, k)]`` on ``idx``'s device.
    """
    k = idx.numel()
    L = low_bits(n, k)
    lo_nbytes = -(-k * L // 8)
    hi_nbits = _high_nbits(n, k, L)
    native = kernels.native_cpu(idx.device)
    if native is not None:
        return native.ef_encode(idx, L, lo_nbytes, -(-hi_nbits // 8))
    idx = idx.to(torch.int64)
    parts = []
    ar = torch.arange(k, dtype=torch.int64, device=idx.device)
    if L:
        parts.append(_pack(idx & ((1 << L) - 1), ar * L, L, lo_nbytes))
    parts.append(_pack(torch.ones_like(idx), (idx >> L) + ar, 1, -(-hi_nbits // 8)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _fail(msg: str):
    raise PayloadError(f"compact indices: {msg}")


def decode(data: torch.Tensor, n: int, k: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Indices (``dtype`` ``[k]``, int32 or int64) from the Elias-Fano bytes
    written by :func:`encode`.

    Args:
        data: uint8 ``[section_nbytes(n, k)]`` (the caller checked the length).

    Raises:
        PayloadError: a nonzero padding bit, a set-bit count other than ``k``,
            an index outside ``[0, n)`` or indices not strictly ascending.
    """
    L = low_bits(n, k)
    lo_nbytes = -(-k * L // 8)
    hi_nbits = _high_nbits(n, k, L)
    lo, hi = data[:lo_nbytes], data[lo_nbytes:]
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    for sec, used in ((lo, k * L), (hi, hi_nbits)):
        spare = sec.numel() * 8 - used
        if spare and int(sec[-1]) >> (8 - spare):
            _fail("nonzero padding bits")
    native = kernels.native_cpu(data.device)
    if native is not None:
        out, status = native.ef_decode(lo, hi, n, k, L, dtype)
        if status:
            _fail(_PROBLEMS[status])
        return out
    bits = ((hi.view(-1, 1) >> shifts) & 1).view(-1)[:hi_nbits]
    pos = torch.nonzero(bits).view(-1)
    if pos.numel() != k:
        _fail(_PROBLEMS[1])
    out = (pos - torch.arange(k, dtype=torch.int64, device=data.device)) << L
    if L:
        out |= _unpack(lo, k, L)
    if int(out[-1]) >= n:
        _fail(_PROBLEMS[2])
    if k > 1 and not bool((out[1:] > out[:-1]).all()):
        _fail(_PROBLEMS[3])
    return out.to(dtype)


_PROBLEMS = {1: "the high-bit vector does not hold exactly nnz set bits",
             2: "an index is out of range [0, numel)",
             3: "indices are not strictly ascending"}
