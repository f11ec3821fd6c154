"""Triton kernel for sparse accumulation ``acc[indices] += values``.

One program per tile of (index, value) pairs; each pair is added with a
float32 atomic add, so duplicate indices accumulate. Indices outside
``[0, acc.numel())`` are masked out: the kernel never writes out of bounds
(and the host launcher checks them first, raising ValueError). With duplicate
indices the float32 sums follow the order of the atomics, which on a GPU is
unspecified; without duplicates the result matches the reference bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gradcomp.kernels import reference
from gradcomp.kernels.ops import kernel
from gradcomp.kernels.triton._common import device_guard, kernel_view, widen

__all__ = ["scatter_add_"]

_TILE_GPU, _TILE_CPU = 1024, 256


@triton.jit(do_not_specialize=["n", "m"])
def _scatter_add_kernel(acc_ptr, n, idx_ptr, val_ptr, m, KIND: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    live = i < m
    j = tl.load(idx_ptr + i, mask=live, other=0).to(tl.int64)
    v = tl.load(val_ptr + i, mask=live, other=0)
    if KIND == 3:
        v = v.to(tl.float32)  # float64 -> float32, round to nearest even
    else:
        v = widen(v, KIND)
    tl.atomic_add(acc_ptr + j, v, mask=live & (j >= 0) & (j < n), sem="relaxed")


@kernel("triton")
def scatter_add_(acc, indices, values):
    """``acc.view(-1)[indices] += values`` in place, values rounded to float32 first.

    Args:
        acc: contiguous float32 tensor (any shape), n elements.
        indices: contiguous 1-D int32/int64, m elements, in ``[0, n)`` (checked
            first: ValueError, nothing written).
        values: contiguous 1-D float32/float16/bfloat16/float64, m elements.
    """
    m = indices.numel()
    if m == 0:
        return
    reference.check_indices(indices, acc.numel())
    tile = _TILE_GPU if acc.device.type == "cuda" else _TILE_CPU
    vv, kind = kernel_view(values)
    with device_guard(acc):
        _scatter_add_kernel[(triton.cdiv(m, tile),)](
            acc.view(-1), acc.numel(), indices, vv, m, KIND=kind, TILE=tile,
            num_warps=4, enable_fp_fusion=False,
        )
