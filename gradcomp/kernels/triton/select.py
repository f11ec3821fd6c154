"""Triton kernels for magnitude selection: exact top-k, threshold and the
sampled-threshold approximate top-k of Deep Gradient Compression (Lin et al. 2018).

Every element gets an integer *key* that orders ``|x|`` exactly: the bit
pattern of ``|x|`` with the sign cleared (float32 bits for float32/16/bf16
input, which widen exactly; float64 bits for float64), and every NaN mapped to
one key above +Inf (or to the +Inf key for the DGC threshold, which treats NaN
as Inf). Keys of non-negative floats sort like the floats, so selection needs
no float comparisons at all (and is immune to flush-to-zero).

* **top-k** is a radix select (as in Alabi et al. 2012, "Fast k-selection
  algorithms for graphics processing units"): four 8-bit digit passes for
  32-bit keys (eight for 64-bit). Each pass histograms the digit of the
  elements whose higher digits equal the prefix found so far; a one-program
  kernel picks the digit holding the k-th largest key and updates the device
  state ``[prefix, k_rem]``. The final prefix is the k-th largest key ``T``
  and ``k_rem`` the number of elements with key ``T`` to keep (lowest
  indices first). No host synchronisation happens.
* **compaction** keeps ``key > T`` plus the first ``k_rem`` elements with
  ``key == T``: one kernel counts both per tile, ``torch.cumsum`` turns the
  counts into tile offsets, a second kernel writes indices (ascending) and
  values at ``gt_before + min(eq_before, k_rem)``. **threshold** is the same
  compaction with ``T = key(tau)`` and ``k_rem = n``.
* **approx_topk** radix-selects the threshold on the strided sample, counts
  the survivors and, exactly like the reference, either keeps them or falls
  back to an exact top-k.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gradcomp.kernels import reference
from gradcomp.kernels.ops import kernel
from gradcomp.kernels.triton._common import F64, device_guard, kernel_view, widen

__all__ = ["topk", "threshold", "approx_topk"]

_TILE_GPU, _TILE_CPU = 2048, 256
_PROGRAMS_GPU, _PROGRAMS_CPU = 1024, 4  # histogram programs (grid-stride)
_DIGIT = 8


@triton.jit
def _key(v, KIND: tl.constexpr, NAN_AS_INF: tl.constexpr):
    """Order-preserving integer key of |v| (int64 for float64, else int32)."""
    if KIND == 3:
        b = v.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
        if NAN_AS_INF:
            nan_key = 0x7FF0000000000000
        else:
            nan_key = 0x7FFFFFFFFFFFFFFF
        return tl.where(b > 0x7FF0000000000000, nan_key, b)
    else:
        b = widen(v, KIND).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if NAN_AS_INF:
            nan_key = 0x7F800000
        else:
            nan_key = 0x7FFFFFFF
        return tl.where(b > 0x7F800000, nan_key, b)


@triton.jit(do_not_specialize=["count", "stride", "shift", "hi_mask", "ntiles", "nprog"])
def _radix_hist_kernel(
    x_ptr, count, stride, state_ptr, hist_ptr, shift, hi_mask, ntiles, nprog,
    KIND: tl.constexpr, NAN_AS_INF: tl.constexpr, TILE: tl.constexpr,
):
    # histogram of digit (key >> shift) & 255 over x[i * stride], i < count, for
    # the elements whose key agrees with the prefix on the bits in hi_mask
    prefix = tl.load(state_ptr)
    acc = tl.zeros([512], tl.int32)
    for t in range(tl.program_id(0), ntiles, nprog):
        i = tl.cast(t, tl.int64) * TILE + tl.arange(0, TILE)
        m = i < count
        k = _key(tl.load(x_ptr + i * stride, mask=m, other=0), KIND, NAN_AS_INF)
        match = m & ((k & hi_mask) == (prefix & hi_mask))
        digit = tl.where(match, ((k >> shift) & 255).to(tl.int32), 256)  # 256: not counted
        acc += tl.histogram(digit, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + bins, acc.to(tl.int64), mask=(bins < 256) & (acc > 0), sem="relaxed")


@triton.jit(do_not_specialize=["shift"])
def _radix_pick_kernel(hist_ptr, state_ptr, shift):
    # pick the digit holding the k_rem-th largest key; zero the histogram
    b = tl.arange(0, 256)
    h = tl.load(hist_ptr + b)
    prefix = tl.load(state_ptr)
    k_rem = tl.load(state_ptr + 1)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # elements with digit >= b
    digit = tl.max(tl.where(at_or_above >= k_rem, b, -1), 0)
    above = tl.sum(tl.where(b > digit, h, 0), 0)
    tl.store(state_ptr, prefix | (digit.to(tl.int64) << shift))
    tl.store(state_ptr + 1, k_rem - above)
    tl.store(hist_ptr + b, tl.zeros([256], tl.int64))


@triton.jit(do_not_specialize=["n"])
def _count_kernel(
    x_ptr, n, state_ptr, gt_ptr, eq_ptr,
    KIND: tl.constexpr, NAN_AS_INF: tl.constexpr, TILE: tl.constexpr,
):
    # per tile: how many keys are > T and == T
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    m = i < n
    k = _key(tl.load(x_ptr + i, mask=m, other=0), KIND, NAN_AS_INF)
    t = tl.load(state_ptr).to(k.dtype)
    tl.store(gt_ptr + pid, tl.sum((m & (k > t)).to(tl.int32), 0))
    tl.store(eq_ptr + pid, tl.sum((m & (k == t)).to(tl.int32), 0))


@triton.jit(do_not_specialize=["n"])
def _compact_kernel(
    x_ptr, n, state_ptr, gt_base_ptr, eq_base_ptr, idx_ptr, val_ptr,
    KIND: tl.constexpr, NAN_AS_INF: tl.constexpr, TILE: tl.constexpr,
):
    # keep key > T and the first k_rem elements with key == T, in index order
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    m = i < n
    v = tl.load(x_ptr + i, mask=m, other=0)
    k = _key(v, KIND, NAN_AS_INF)
    t = tl.load(state_ptr).to(k.dtype)
    k_rem = tl.load(state_ptr + 1)
    gt = (m & (k > t)).to(tl.int32)
    eq = (m & (k == t)).to(tl.int32)
    gt_before = tl.load(gt_base_ptr + pid) + (tl.cumsum(gt, 0) - gt)
    eq_before = tl.load(eq_base_ptr + pid) + (tl.cumsum(eq, 0) - eq)
    take = (gt == 1) | ((eq == 1) & (eq_before < k_rem))
    pos = gt_before + tl.minimum(eq_before, k_rem)
    tl.store(idx_ptr + pos, i.to(idx_ptr.dtype.element_ty), mask=take)
    tl.store(val_ptr + pos, v, mask=take)


def _tile(x: torch.Tensor) -> int:
    return _TILE_GPU if x.device.type == "cuda" else _TILE_CPU


def _radix_select(xv, kind, count, stride, k, nan_as_inf):
    """Device state ``int64[2] = [T, k_rem]``: ``T`` is the k-th largest key of
    ``x[i * stride]``, ``i < count`` (1 <= k <= count), and ``k_rem`` how many
    elements with key ``T`` belong to the top k."""
    dev = xv.device
    bits = 64 if kind == F64 else 32
    tile = _tile(xv)
    ntiles = triton.cdiv(count, tile)
    nprog = min(ntiles, _PROGRAMS_GPU if dev.type == "cuda" else _PROGRAMS_CPU)
    state = torch.zeros(2, dtype=torch.int64, device=dev)
    state[1].fill_(k)
    hist = torch.zeros(256, dtype=torch.int64, device=dev)
    for shift in range(bits - _DIGIT, -1, -_DIGIT):
        hi = shift + _DIGIT
        hi_mask = 0 if hi >= bits else -(1 << hi)  # bits above the digit, as a signed int
        _radix_hist_kernel[(nprog,)](
            xv, count, stride, state, hist, shift, hi_mask, ntiles, nprog,
            KIND=kind, NAN_AS_INF=nan_as_inf, TILE=tile, num_warps=8, enable_fp_fusion=False,
        )
        _radix_pick_kernel[(1,)](hist, state, shift, num_warps=4, enable_fp_fusion=False)
    return state


def _counts(xv, kind, n, state, nan_as_inf):
    tile = _tile(xv)
    ntiles = triton.cdiv(n, tile)
    gt = torch.empty(ntiles, dtype=torch.int64, device=xv.device)
    eq = torch.empty(ntiles, dtype=torch.int64, device=xv.device)
    _count_kernel[(ntiles,)](
        xv, n, state, gt, eq, KIND=kind, NAN_AS_INF=nan_as_inf, TILE=tile,
        num_warps=8, enable_fp_fusion=False,
    )
    return gt, eq


def _compact(x, xv, kind, state, gt, eq, size, nan_as_inf):
    n = x.numel()
    tile = _tile(xv)
    idx = torch.empty(size, dtype=reference.index_dtype(n), device=x.device)
    val = torch.empty(size, dtype=x.dtype, device=x.device)
    gt_base = torch.cumsum(gt, 0) - gt
    eq_base = torch.cumsum(eq, 0) - eq
    _compact_kernel[(triton.cdiv(n, tile),)](
        xv, n, state, gt_base, eq_base, idx, kernel_view(val)[0],
        KIND=kind, NAN_AS_INF=nan_as_inf, TILE=tile, num_warps=8, enable_fp_fusion=False,
    )
    return idx, val


def _topk(x, k, nan_as_inf):
    n = x.numel()
    if k <= 0 or k >= n:
        return reference.all_or_none(x, k >= n)
    xv, kind = kernel_view(x)
    state = _radix_select(xv, kind, n, 1, k, nan_as_inf)
    gt, eq = _counts(xv, kind, n, state, nan_as_inf)
    return _compact(x, xv, kind, state, gt, eq, k, nan_as_inf)


@kernel("triton")
def topk(x, k):
    """Exact top-k by magnitude (ties: lower index; NaN above +Inf).

    Args:
        x: contiguous 1-D float32/float16/bfloat16/float64 tensor, n elements.
        k: 0 <= k <= n.

    Returns:
        ``(indices, values)``: ascending int32 indices (int64 when n >= 2**31)
        and ``x[indices]`` in x's dtype.
    """
    with device_guard(x):
        return _topk(x, k, nan_as_inf=False)


def _key_of(tau: float, x: torch.Tensor) -> int:
    if x.dtype == torch.float64:
        return torch.tensor(abs(tau), dtype=torch.float64).view(torch.int64).item()
    return torch.tensor(abs(tau), dtype=torch.float32).view(torch.int32).item()


@kernel("triton")
def threshold(x, tau):
    """Every element with ``|x| >= tau`` or NaN, by stream compaction.

    Args:
        x: contiguous 1-D floating tensor, n elements.
        tau: finite threshold >= 0, compared in float32 (float64 for float64 x).

    Returns:
        ``(indices, values)`` as :func:`topk`.
    """
    n = x.numel()
    if n == 0:
        return reference.all_or_none(x, False)
    with device_guard(x):
        xv, kind = kernel_view(x)
        state = torch.tensor([_key_of(tau, x), n], dtype=torch.int64, device=x.device)
        gt, eq = _counts(xv, kind, n, state, False)
        size = int((gt.sum() + eq.sum()).item())
        return _compact(x, xv, kind, state, gt, eq, size, False)


@kernel("triton")
def approx_topk(x, k):
    """Sampled-threshold top-k (DGC): the threshold is the ``ceil(s k / n)``-th
    largest ``|x|`` (NaN as Inf) of the strided sample of
    :func:`reference.approx_topk_sample_size` elements; elements at or above it
    are kept when their count lies in ``[ceil(0.9 k), floor(1.1 k)]``, else the
    exact top-k is returned (NaN ranked as Inf when too many survived, as the
    reference does).

    Returns:
        ``(indices, values)`` as :func:`topk`; always a top set.
    """
    n = x.numel()
    if k >= n or k <= 0:
        return reference.all_or_none(x, k >= n)
    with device_guard(x):
        xv, kind = kernel_view(x)
        s = reference.approx_topk_sample_size(n, k)
        stride = n // s
        ks = max(1, min(s, math.ceil(s * k / n)))
        state = _radix_select(xv, kind, s, stride, ks, True)
        state[1].fill_(n)  # keep every element at the threshold
        gt, eq = _counts(xv, kind, n, state, True)
        c = int((gt.sum() + eq.sum()).item())
        lo, hi = math.ceil(0.9 * k), math.floor(1.1 * k)
        if lo <= c <= hi:
            return _compact(x, xv, kind, state, gt, eq, c, True)
        return _topk(x, k, nan_as_inf=c > hi)
