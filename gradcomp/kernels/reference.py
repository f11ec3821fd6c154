"""Pure-PyTorch reference kernels: the oracle for every other backend.

These functions run on any device PyTorch supports. They define the exact
numerics that the ``cpu``, ``triton`` and ``cuda`` backends must reproduce bit
for bit (int8 codes and scales, top-k and threshold index sets).

Numerics of blockwise int8 quantization (symmetric absmax, as in
Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"):

* The input is read as float32 (float16/bfloat16 widen exactly; float64 rounds
  to nearest float32, values beyond float32 range become +-inf).
* Elements are split into blocks of ``block_size``; the last block may be
  short and its scale comes from its own elements only.
* Per block, ``m = max |x|`` (float32). A block holding any NaN or Inf is
  *non-finite*: its scale is NaN (bits ``0x7FC00000``) and its codes are 0, so
  it decodes to NaN everywhere. A block with ``m == 0`` has scale 0 and codes 0.
* Otherwise ``y = (x / m) * 127`` (two float32 operations, each rounded, no
  fused multiply-add), and

  - ``rounding="nearest"``: ``code = rint(y)`` (round half to even);
  - ``rounding="stochastic"``: ``code = floor(y + u)`` where ``u`` in [0, 1)
    comes from the counter-based hash below (unbiased as in QSGD,
    Alistarh et al. 2017);

  codes are clamped to [-127, 127]; ``scale = m / 127`` (float32 division).
* Dequantization is ``code * scale`` in float32; ``dequantize_int8_add_``
  computes ``acc + (code * scale)`` with the product rounded first.

Counter-based randomness (stochastic rounding; Salmon et al. 2011 describe
the counter-based idea): ``mix32`` is the "lowbias32" integer hash
(C. Wellons)::

    x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16

(all modulo 2**32). For a call with ``seed`` and ``counter`` the host computes
``key = stream_key(seed, counter)``; element ``i`` draws
``r = mix32((i mod 2**32) ^ key)`` and ``u = (r >> 8) * 2**-24``.

Selection ops return ``(indices, values)`` with indices in ascending order,
int32 when ``n < 2**31`` else int64, and values in the input dtype:

* ``topk``: the k largest ``|x|``, ties broken by the lower index; NaN counts as
  larger than any number (so a non-finite gradient is never silently dropped).
* ``threshold``: every element with ``|x| >= tau`` or ``x`` NaN; the comparison
  is made in float64 for float64 input and in float32 otherwise.
* ``approx_topk``: the sampled-threshold selection of Deep Gradient
  Compression (Lin et al. 2018): estimate the threshold from a strided sample,
  select ``|x| >= t``, and correct so the kept count lands in
  ``[ceil(0.9 k), floor(1.1 k)]``; the result is always a top set (every kept
  ``|x|`` is >= every dropped ``|x|``).
"""

from __future__ import annotations

import math

import torch

from gradcomp.errors import PayloadError

__all__ = [
    "mix32",
    "stream_key",
    "uniform",
    "index_dtype",
    "quantize_int8",
    "dequantize_int8",
    "dequantize_int8_add_",
    "quantize_int8_ef",
    "topk",
    "threshold",
    "approx_topk",
    "approx_topk_sample_size",
    "scatter_add_",
    "BAD_INT8",
    "int8_values_ok",
    "check_int8_values",
    "check_indices",
    "uniform_key",
    "quantize_outputs",
    "all_or_none",
    "quantize_key",
    "dgc_accumulate_",
]

#: the error for malformed int8 values: codes are in [-127, 127] (symmetric
#: absmax quantization never writes -128) and scales are >= 0 and finite, or
#: NaN (a non-finite block)
BAD_INT8 = ("int8 payload holds a code of -128 or a negative or infinite scale (codes are in "
            "[-127, 127]; scales >= 0 and finite, or NaN for a non-finite block)")


def int8_values_ok(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether int8 codes and scales are in the format's range (see :data:`BAD_INT8`)."""
    if q.numel() and int(q.min()) == -128:
        return False
    return not (scales.numel() and bool(((scales < 0) | torch.isinf(scales)).any()))


def check_int8_values(q: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise :class:`~gradcomp.PayloadError` (:data:`BAD_INT8`) unless
    :func:`int8_values_ok` (the ``check_int8`` of backends that check in one
    pass before writing)."""
    if not int8_values_ok(q, scales):
        raise PayloadError(BAD_INT8)


def check_indices(indices: torch.Tensor, n: int) -> None:
    """Raise ValueError unless every index is in ``[0, n)`` (the bounds check
    of ``scatter_add_`` for backends whose kernels do not check)."""
    if indices.numel():
        lo, hi = (int(b) for b in torch.aminmax(indices))
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"indices must be in [0, {n}) (acc's numel), got {bad}")

_M32 = 0xFFFFFFFF
_CANONICAL_NAN_BITS = 0x7FC00000


def mix32(x: int) -> int:
    """lowbias32 integer hash of a Python int, modulo 2**32."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def stream_key(seed: int, counter: int) -> int:
    """32-bit key of the random stream for ``(seed, counter)``; both are taken
    modulo 2**64. Computed on the host and passed to every backend."""
    seed &= (1 << 64) - 1
    counter &= (1 << 64) - 1
    k = mix32((counter >> 32) ^ 0x9E3779B9)
    k = mix32((counter & _M32) ^ k)
    k = mix32((seed >> 32) ^ k)
    return mix32((seed & _M32) ^ k)


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow.
    lo = x & 0xFFFF
    hi = x >> 16
    return ((lo * c) + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(n: int, seed: int, counter: int, device=None, start: int = 0) -> torch.Tensor:
    """The stochastic-rounding draws ``u[i]`` in [0, 1) (float32) for element
    indices ``start .. start + n - 1`` of the stream ``(seed, counter)``."""
    return uniform_key(n, stream_key(seed, counter), device, start)


def uniform_key(n: int, key: int, device=None, start: int = 0) -> torch.Tensor:
    """:func:`uniform` of the stream whose :func:`stream_key` is ``key``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device) & _M32
    r = _mix32_tensor(idx ^ key)
    return (r >> 8).to(torch.float32) * (2.0**-24)


def index_dtype(n: int) -> torch.dtype:
    """Index dtype for a tensor of ``n`` elements: int32 below 2**31, else int64."""
    return torch.int32 if n < 2**31 else torch.int64


def quantize_outputs(x: torch.Tensor, block_size: int, out_q=None, out_scales=None):
    """The ``(q, scales)`` output tensors of a quantize call: the given ones, or
    new int8 ``[n]`` / float32 ``[ceil(n / block_size)]`` on x's device
    (shared by every backend)."""
    n = x.numel()
    q = out_q if out_q is not None else torch.empty(n, dtype=torch.int8, device=x.device)
    s = out_scales if out_scales is not None else torch.empty(
        -(-n // block_size), dtype=torch.float32, device=x.device)
    return q, s


def all_or_none(x: torch.Tensor, keep_all: bool):
    """The trivial selections (every element, or none) as ``(indices, values)``
    (shared by every backend for k >= n and k == 0)."""
    n = x.numel()
    if keep_all:
        return torch.arange(n, dtype=index_dtype(n), device=x.device), x.clone()
    return torch.empty(0, dtype=index_dtype(n), device=x.device), x[:0].clone()


def _blocks(xf: torch.Tensor, block_size: int) -> torch.Tensor:
    n = xf.numel()
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        xf = torch.cat([xf, xf.new_zeros(pad)])
    return xf.view(nb, block_size)


def quantize_int8(
    x: torch.Tensor,
    block_size: int = 256,
    rounding: str = "nearest",
    seed: int = 0,
    counter: int = 0,
    out_q: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
):
    """Blockwise absmax int8 quantization (see the module docstring).

    Args:
        x: floating tensor, any shape, read in flat (row-major) order.
        block_size: elements per block.
        rounding: ``"nearest"`` or ``"stochastic"``.
        seed, counter: select the random stream for stochastic rounding.
        out_q, out_scales: optional preallocated outputs.

    Returns:
        ``(q, scales)``: int8 ``[n]`` and float32 ``[ceil(n / block_size)]`` on x's device.
    """
    stochastic = rounding == "stochastic"
    q, s = quantize_key(x, block_size, stochastic, stream_key(seed, counter) if stochastic else 0)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    if out_scales is not None:
        out_scales.copy_(s)
        s = out_scales
    return q, s


def quantize_key(x: torch.Tensor, block_size: int, stochastic: bool, key: int):
    """:func:`quantize_int8` into new tensors, the random stream given by its
    :func:`stream_key` ``key`` (the form the backends' kernels take)."""
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    nb = -(-n // block_size)
    if n == 0:
        q = torch.empty(0, dtype=torch.int8, device=x.device)
        s = torch.empty(0, dtype=torch.float32, device=x.device)
    else:
        b = _blocks(xf, block_size)
        m = b.abs().amax(dim=1)
        finite = torch.isfinite(b).all(dim=1)
        live = finite & (m > 0)
        safe_m = torch.where(live, m, torch.ones_like(m))
        y = (b / safe_m[:, None]) * 127.0
        if not stochastic:
            c = torch.round(y)
        else:
            u = uniform_key(nb * block_size, key, device=x.device).view(nb, block_size)
            c = torch.floor(y + u)
        c = c.clamp_(-127.0, 127.0)
        c = torch.where(live[:, None], c, torch.zeros_like(c))
        q = c.reshape(-1)[:n].to(torch.int8)
        nan = torch.tensor(_CANONICAL_NAN_BITS, dtype=torch.int32).view(torch.float32).to(x.device)
        s = torch.where(finite, m / 127.0, nan)
    return q, s


def _expand_scales(scales: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[:n]


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 256,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``code * scale`` per element. Returns float32 ``[n]`` (or writes ``out``,
    cast to its dtype)."""
    n = q.numel()
    r = q.to(torch.float32) * _expand_scales(scales, n, block_size)
    if out is not None:
        out.view(-1).copy_(r)
        return out
    return r


def dequantize_int8_add_(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = 256
) -> torch.Tensor:
    """``acc += code * scale`` in place; acc is float32 with ``q.numel()`` elements."""
    n = q.numel()
    acc.view(-1).add_(q.to(torch.float32) * _expand_scales(scales, n, block_size))
    return acc


def quantize_int8_ef(
    x: torch.Tensor,
    residual: torch.Tensor,
    block_size: int = 256,
    rounding: str = "nearest",
    seed: int = 0,
    counter: int = 0,
    out_q: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
):
    """Fused error-feedback quantization: ``p = x + residual; (q, s) = Q(p);
    residual <- p - D(q, s)`` (residual: float32, same numel as x, updated in place).

    Returns ``(q, scales)`` as :func:`quantize_int8`.
    """
    p = x.reshape(-1).to(torch.float32) + residual.view(-1)
    q, s = quantize_int8(p, block_size, rounding, seed, counter, out_q, out_scales)
    residual.view(-1).copy_(p - dequantize_int8(q, s, block_size))
    return q, s


def _select(x: torch.Tensor, idx: torch.Tensor):
    n = x.numel()
    idx = idx.sort().values
    flat = x.reshape(-1)
    return idx.to(index_dtype(n)), flat[idx.long()]


def topk(x: torch.Tensor, k: int):
    """Exact top-k by ``|x|`` (ties: lower index first). Returns ascending
    ``(indices, values)``."""
    flat = x.reshape(-1)
    k = min(k, flat.numel())
    order = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
    return _select(x, order)


def _cmp_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def threshold(x: torch.Tensor, tau: float):
    """All elements with ``|x| >= tau`` (or NaN). Returns ascending ``(indices, values)``."""
    a = x.reshape(-1).to(_cmp_dtype(x)).abs()
    t = torch.tensor(tau, dtype=a.dtype).item()
    idx = torch.nonzero((a >= t) | torch.isnan(a), as_tuple=False).view(-1)
    return _select(x, idx)


def approx_topk_sample_size(n: int, k: int) -> int:
    """Sample size used to estimate the top-k threshold: enough draws that about
    400 of them land above the threshold, at least 4096, at most n."""
    if k <= 0:
        return 0
    return min(n, max(4096, math.ceil(400 * n / k)))


def approx_topk(x: torch.Tensor, k: int):
    """Sampled-threshold top-k (DGC). Returns ascending ``(indices, values)`` with
    a kept count in ``[ceil(0.9 k), floor(1.1 k)]`` (exactly k when the
    estimate misses or ties prevent it)."""
    flat = x.reshape(-1)
    n = flat.numel()
    if k >= n:
        return _select(x, torch.arange(n, device=x.device))
    if k <= 0:
        return _select(x, torch.empty(0, dtype=torch.int64, device=x.device))
    a = flat.to(_cmp_dtype(x)).abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    s = approx_topk_sample_size(n, k)
    stride = n // s
    sample = a[: s * stride : stride]
    ks = max(1, min(s, math.ceil(s * k / n)))
    t = torch.topk(sample, ks).values[-1]
    mask = a >= t
    c = int(mask.sum())
    lo, hi = math.ceil(0.9 * k), math.floor(1.1 * k)
    if lo <= c <= hi:
        return _select(x, torch.nonzero(mask).view(-1))
    if c > hi:
        cand = torch.nonzero(mask).view(-1)
        order = torch.sort(a[cand], descending=True, stable=True).indices[:k]
        return _select(x, cand[order])
    return topk(x, k)


def scatter_add_(acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``acc.view(-1)[indices] += values`` (duplicates accumulate); acc float32."""
    acc.view(-1).index_add_(0, indices.long(), values.to(acc.dtype))
    return acc


def dgc_accumulate_(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float, scale: float) -> None:
    """Deep Gradient Compression's momentum correction (Lin et al. 2018):
    ``u = u * momentum + g * scale`` (each product rounded to float32, then
    the sum), ``v += u``; float32 tensors of one numel, updated in place."""
    u.mul_(momentum)
    u.add_(g if scale == 1.0 else g * scale)
    v.add_(u)
