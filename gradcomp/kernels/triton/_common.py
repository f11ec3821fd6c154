"""Helpers shared by the Triton kernel files: dtype kinds, rounding, the counter hash, device guards."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

#: element kinds passed to kernels as constexpr
F32, F16, BF16, F64 = 0, 1, 2, 3


@triton.jit
def widen(v, KIND: tl.constexpr):
    """Values of kind KIND -> float32, exactly (bf16 arrives as int16 bit patterns:
    the interpreter's own bf16 conversion mishandles subnormals)."""
    if KIND == 2:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


def kernel_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(tensor to pass to a kernel, kind)``: bfloat16 is passed as its int16 bits."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), BF16
    return x, {torch.float32: F32, torch.float16: F16, torch.float64: F64}[x.dtype]


def device_guard(t: torch.Tensor):
    """Make t's GPU the current device for a launch (no-op for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def round_half_even(y):
    """Round half to even for float32 ``|y| < 2**22``."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def counter_uniform(offs, key):
    """u in [0, 1): ``(mix32((i mod 2**32) ^ key) >> 8) * 2**-24`` (lowbias32)."""
    r = offs.to(tl.uint32) ^ key.to(tl.uint32)
    r = r ^ (r >> 16)
    r = r * 0x7FEB352D
    r = r ^ (r >> 15)
    r = r * 0x846CA68B
    r = r ^ (r >> 16)
    return (r >> 8).to(tl.float32) * 5.9604644775390625e-08
