"""Triton kernels for blockwise absmax int8 quantization and dequantization.

Numerics follow :mod:`gradcomp.kernels.reference` bit for bit:

* ``m = max |p|`` per block; a block with NaN/Inf gets scale NaN (bits
  ``0x7FC00000``) and codes 0; ``m == 0`` gives scale 0 and codes 0.
* ``y = (p / m) * 127`` as an IEEE division (``div_rn``; Triton's ``/`` is an
  approximate division on NVIDIA GPUs) and a separately rounded multiply:
  every launch passes ``enable_fp_fusion=False`` so nothing becomes an FMA.
* nearest: round half to even by adding and subtracting ``1.5 * 2**23`` in
  float32 (exact for ``|y| < 2**22``; here ``|y| <= 128``);
  stochastic: ``floor(y + u)`` with ``u`` from the lowbias32 counter hash,
  the floor built from the same rounding (no libdevice call, whose
  flush-to-zero variants would change results for subnormal inputs).
* codes clamped to [-127, 127]; ``scale = m / 127``.

bfloat16 data travels as int16 bit patterns and is widened/narrowed with
integer operations, which the Triton interpreter (``TRITON_INTERPRET=1``)
executes exactly like the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradcomp.kernels import reference
from gradcomp.kernels.ops import kernel
from gradcomp.kernels.triton._common import counter_uniform, device_guard, kernel_view, round_half_even, widen

__all__ = ["quantize_int8", "quantize_int8_ef", "dequantize_int8", "dequantize_int8_add_"]

# elements per program: large tiles on the GPU, small ones in the interpreter
# so that tests exercise many programs and the chunk loop of big blocks
_TILE_GPU, _TILE_CPU = 4096, 512
_NAN_BITS = tl.constexpr(0x7FC00000)  # canonical NaN scale of a non-finite block


@triton.jit
def _load_p(x_ptr, r_ptr, offs, mask, KIND: tl.constexpr, EF: tl.constexpr):
    """The float32 values to quantize: x, or x + residual for error feedback."""
    p = widen(tl.load(x_ptr + offs, mask=mask, other=0), KIND)
    if EF:
        p = p + tl.load(r_ptr + offs, mask=mask, other=0.0)
    return p


@triton.jit(do_not_specialize=["n", "nblocks", "key"])
def _quantize_kernel(
    x_ptr, r_ptr, q_ptr, s_ptr, n, nblocks, key,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    KIND: tl.constexpr, EF: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    # one program: ROWS quantization blocks, each read in BLOCK_SIZE // CHUNK chunks
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nblocks
    cols = tl.arange(0, CHUNK)
    m = tl.zeros([ROWS], tl.float32)
    bad = tl.zeros([ROWS], tl.int32)
    for c0 in range(0, BLOCK_SIZE, CHUNK):
        offs = rows[:, None] * BLOCK_SIZE + (c0 + cols)[None, :]
        mask = row_ok[:, None] & (offs < n)
        p = _load_p(x_ptr, r_ptr, offs, mask, KIND, EF)
        a = tl.abs(p)
        finite = (a.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=1))
        m = tl.maximum(m, tl.max(tl.where(finite, a, 0.0), axis=1))
    live = (bad == 0) & (m > 0.0)
    nan = tl.full([ROWS], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(bad == 0, tl.math.div_rn(m, tl.full([ROWS], 127.0, tl.float32)), nan)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    divisor = tl.broadcast_to(tl.where(live, m, 1.0)[:, None], [ROWS, CHUNK])
    for c0 in range(0, BLOCK_SIZE, CHUNK):
        offs = rows[:, None] * BLOCK_SIZE + (c0 + cols)[None, :]
        mask = row_ok[:, None] & (offs < n)
        p = _load_p(x_ptr, r_ptr, offs, mask, KIND, EF)
        y = tl.math.div_rn(p, divisor) * 127.0
        if STOCHASTIC:
            z = y + counter_uniform(offs, key)
            r = round_half_even(z)
            c = tl.where(r > z, r - 1.0, r)  # floor(z)
        else:
            c = round_half_even(y)
        c = tl.minimum(tl.maximum(c, -127.0), 127.0)
        code = tl.where(live[:, None], c, 0.0).to(tl.int8)
        tl.store(q_ptr + offs, code, mask=mask)
        if EF:
            tl.store(r_ptr + offs, p - code.to(tl.float32) * scale[:, None], mask=mask)


@triton.jit(do_not_specialize=["n"])
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, n,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, ADD: tl.constexpr, OUT_BF16: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < n
    c = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + offs // BLOCK_SIZE, mask=mask, other=0.0)
    v = c * s
    if ADD:
        tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=mask, other=0.0) + v, mask=mask)
    elif OUT_BF16:
        # float32 -> bfloat16 round half to even on the bit pattern (NaN -> 0x7FC0)
        b = v.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(out_ptr + offs, r.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(t: torch.Tensor) -> int:
    return _TILE_GPU if t.device.type == "cuda" else _TILE_CPU


def _as_kernel_input(x: torch.Tensor):
    """(tensor to pass, kind): float64 rounds to float32 first, as the reference does."""
    if x.dtype == torch.float64:
        x = x.to(torch.float32)
    return kernel_view(x)


def _quantize(x, residual, block_size, stochastic, key, q, s):
    n = x.numel()
    nblocks = -(-n // block_size)
    if n == 0:
        return
    xin, kind = _as_kernel_input(x)
    tile = _tile(x)
    chunk = min(block_size, tile)
    rows = tile // chunk
    ef = residual is not None
    with device_guard(x):
        _quantize_kernel[(triton.cdiv(nblocks, rows),)](
            xin, residual.view(-1) if ef else xin, q, s, n, nblocks, key,
            BLOCK_SIZE=block_size, ROWS=rows, CHUNK=chunk, KIND=kind, EF=ef,
            STOCHASTIC=stochastic, num_warps=8, enable_fp_fusion=False,
        )


@kernel("triton")
def quantize_int8(x, block_size, stochastic, key, q, scales):
    """Blockwise absmax int8 quantization of a contiguous 1-D tensor.

    Args:
        x: contiguous 1-D float32/float16/bfloat16/float64 tensor of n elements
            (float64 is rounded to float32 first).
        block_size: elements per block (power of two, 32..65536).
        stochastic, key: stochastic rounding and its stream key (else half to even).
        q, scales: contiguous int8 ``[n]`` / float32 ``[ceil(n/block_size)]`` outputs.
    """
    _quantize(x, None, block_size, stochastic, key, q, scales)


@kernel("triton")
def quantize_int8_ef(x, residual, block_size, stochastic, key, q, scales):
    """Fused error feedback in one kernel: ``p = x + residual; (q, s) = Q(p);
    residual <- p - q * s`` (residual: contiguous float32, n elements, updated in place)."""
    _quantize(x, residual, block_size, stochastic, key, q, scales)


def _dequantize(q, scales, block_size, out, add):
    n = q.numel()
    if n == 0:
        return
    tile = _tile(q)
    bf16 = (not add) and out.dtype == torch.bfloat16
    dst = out.view(-1).view(torch.int16) if bf16 else out.view(-1)
    with device_guard(q):
        _dequantize_kernel[(triton.cdiv(n, tile),)](
            q, scales, dst, n, BLOCK_SIZE=block_size, TILE=tile, ADD=add, OUT_BF16=bf16,
            num_warps=8, enable_fp_fusion=False,
        )


@kernel("triton")
def dequantize_int8(q, scales, block_size, check_int8, out):
    """``out = code * scale`` per element (float32 product, rounded to out's
    dtype, half to even); q: contiguous int8 ``[n]``, scales: float32
    ``[ceil(n / block_size)]``, out: contiguous float32/float16/bfloat16/float64
    of n elements. ``check_int8``: one checking pass before any write."""
    if check_int8:
        reference.check_int8_values(q, scales)
    _dequantize(q, scales, block_size, out, add=False)


@kernel("triton")
def dequantize_int8_add_(acc, q, scales, block_size, check_int8):
    """``acc += code * scale`` in place (product rounded, then the add);
    acc: contiguous float32 with ``q.numel()`` elements."""
    if check_int8:
        reference.check_int8_values(q, scales)
    _dequantize(q, scales, block_size, acc, add=True)
