"""The kernel benchmark's peers: what a user would run instead of gradcomp's kernels.

Details: docs/kernels.md#the-kernel-benchmarks-peers.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .cases import DTYPES, TOPK_OPS, Case, itemsize, op_bytes
from .timing import Timed

__all__ = [
    "COMPILED_OPS", "BNB_OPS", "fused_quantize_int8", "fused_quantize_int8_ef", "fused_dequantize_int8",
    "fused_dequantize_int8_add_", "fused_quantize_packed", "fused_quantize_sign", "fused_quantize_fp8",
    "compiled_peer", "bitsandbytes", "bitsandbytes_peer", "peers",
]

#: ops with a fused torch.compile peer
COMPILED_OPS = ("quantize_int8", "dequantize_int8", "dequantize_int8_add_", "quantize_int8_ef", "quantize_packed",
                "quantize_packed_2bit", "quantize_sign", "quantize_fp8")
BNB_OPS = ("quantize_int8", "dequantize_int8")


# ---------------------------------------------------------------------------
# the fused int8 functions written for torch.compile


def fused_quantize_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                        stochastic: bool = False) -> None:
    """Blockwise absmax int8 quantization of flat ``x`` into ``q`` (int8, x's numel) and
    ``scales`` (float32, ``ceil(n / block)``), in place; see the module docstring."""
    _by_blocks(_quantize_rows, block, (x, q), (scales,), stochastic)


def fused_quantize_int8_ef(x: torch.Tensor, res: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                           block: int, stochastic: bool = False) -> None:
    """Error-feedback quantization: ``p = x + res``, quantize ``p`` into ``q`` / ``scales``,
    ``res = p - code * scale`` (res: float32, x's numel, updated in place)."""
    _by_blocks(_quantize_ef_rows, block, (x, res, q), (scales,), stochastic)


def fused_dequantize_int8(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """``out = code * scale`` per element (float32 product, cast to out's dtype)."""
    _by_blocks(_dequantize_rows, block, (q, out), (scales,))


def fused_dequantize_int8_add_(acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """``acc += code * scale`` per element (acc: float32, in place)."""
    _by_blocks(_dequantize_add_rows, block, (acc, q), (scales,))


def _by_blocks(rows_fn, block: int, elementwise: tuple, per_block: tuple, *extra) -> None:
    """``rows_fn`` on ``(blocks, block)`` views of the whole blocks, then on the last,
    shorter block if any (static shapes: both are known when compiling)."""
    n = elementwise[0].numel()
    full = n - n % block
    nb = full // block
    if full:
        rows_fn(*(t[:full].view(nb, block) for t in elementwise), *(t[:nb] for t in per_block), *extra)
    if full < n:
        rows_fn(*(t[full:].view(1, n - full) for t in elementwise), *(t[nb:] for t in per_block), *extra)


def _codes(p: torch.Tensor, stochastic: bool):
    m = p.abs().amax(dim=1, keepdim=True)
    inv = torch.where(m > 0, 127.0 / m, 0.0)
    y = p * inv
    c = torch.floor(y + torch.rand_like(y)) if stochastic else torch.round(y)
    return c.clamp(-127.0, 127.0), m / 127.0


def _quantize_rows(x, q, scales, stochastic):
    c, s = _codes(x.float(), stochastic)
    q.copy_(c)
    scales.copy_(s.squeeze(1))


def _quantize_ef_rows(x, res, q, scales, stochastic):
    p = x.float() + res
    c, s = _codes(p, stochastic)
    q.copy_(c)
    scales.copy_(s.squeeze(1))
    res.copy_(p - c * s)


def fused_quantize_packed(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
                          bits: int) -> None:
    """Blockwise absmax quantization to ``bits``-bit codes (4 or 2; ``qmax = 2**(bits-1) - 1``,
    nearest rounding) packed ``8 // bits`` to a uint8 of ``codes``, element ``j`` of a byte in bits
    ``j * bits``; ``x``'s numel a multiple of ``block`` and of ``8 // bits``."""
    q = (1 << (bits - 1)) - 1
    p = x.float().view(-1, block)
    m = p.abs().amax(dim=1, keepdim=True)
    c = torch.round(p * torch.where(m > 0, q / m, 0.0)).clamp(-q, q).to(torch.int32) & ((1 << bits) - 1)
    c = c.view(-1, 8 // bits) << torch.arange(0, 8, bits, dtype=torch.int32, device=x.device)
    codes.copy_(c.sum(dim=1).to(torch.uint8))
    scales.copy_((m / q).squeeze(1))


def fused_quantize_sign(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Scaled sign: bit ``x < 0`` per element, 8 to a byte, and the mean ``|x|`` per block."""
    p = x.float().view(-1, block)
    scales.copy_(p.abs().mean(dim=1))
    bits = (p < 0).view(-1, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32, device=x.device)
    codes.copy_(bits.sum(dim=1).to(torch.uint8))


def fused_quantize_fp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Blockwise-scaled float8_e4m3fn: ``fp8(x * 448 / absmax)`` and ``absmax / 448`` per block."""
    p = x.float().view(-1, block)
    m = p.abs().amax(dim=1, keepdim=True)
    codes.view(-1, block).copy_((p * torch.where(m > 0, 448.0 / m, 0.0)).to(torch.float8_e4m3fn).view(torch.uint8))
    scales.copy_((m / 448.0).squeeze(1))


def _dequantize_rows(q, out, scales):
    out.copy_(q.float() * scales.unsqueeze(1))


def _dequantize_add_rows(acc, q, scales):
    acc.add_(q.float() * scales.unsqueeze(1))


def compiled_peer(case: Case, d: dict, block: int, rounding: str):
    """A zero-argument call of the case's fused function under ``torch.compile``
    (``fullgraph=True``, ``dynamic=False``), or None when the op has none.

    Dynamo's caches are reset first: each case compiles afresh at its own shapes and
    thread count (and never meets dynamo's recompile limit, past which it would
    silently run eagerly). The compilation happens on the first call.
    """
    if case.op not in COMPILED_OPS:
        return None
    torch._dynamo.reset()
    stoch = rounding == "stochastic"
    lowbit = _lowbit_peer(case, d, block)
    if lowbit is not None:
        return lowbit
    if case.op == "quantize_int8":
        f = torch.compile(fused_quantize_int8, fullgraph=True, dynamic=False)
        return lambda: f(d["x"], d["q"], d["s"], block, stoch)
    if case.op == "quantize_int8_ef":
        f = torch.compile(fused_quantize_int8_ef, fullgraph=True, dynamic=False)
        return lambda: f(d["x"], d["res"], d["q"], d["s"], block, stoch)
    if case.op == "dequantize_int8":
        f = torch.compile(fused_dequantize_int8, fullgraph=True, dynamic=False)
        return lambda: f(d["q"], d["s"], d["out"], block)
    f = torch.compile(fused_dequantize_int8_add_, fullgraph=True, dynamic=False)
    return lambda: f(d["acc"], d["q"], d["s"], block)


def _lowbit_peer(case: Case, d: dict, block: int):
    """The compiled peer of a sub-byte / fp8 quantizer (nearest rounding; whole blocks and
    bytes only: the case's size must be a multiple of the block size), else None."""
    if not case.op.startswith(("quantize_packed", "quantize_sign", "quantize_fp8")) or case.n % block:
        return None
    x, codes, s = d["x"], d["codes"], d["s"]
    if case.op == "quantize_sign":
        f = torch.compile(fused_quantize_sign, fullgraph=True, dynamic=False)
        return lambda: f(x, codes, s, block)
    if case.op == "quantize_fp8":
        f = torch.compile(fused_quantize_fp8, fullgraph=True, dynamic=False)
        return lambda: f(x, codes, s, block)
    bits = 2 if case.op == "quantize_packed_2bit" else 4
    f = torch.compile(fused_quantize_packed, fullgraph=True, dynamic=False)
    return lambda: f(x, codes, s, block, bits)


# ---------------------------------------------------------------------------
# bitsandbytes


@functools.cache
def bitsandbytes() -> tuple[object | None, str | None]:
    """``(bitsandbytes.functional, None)`` when it imports and its ``quantize_blockwise``
    runs here, else ``(None, reason)``."""
    try:
        import bitsandbytes.functional as F

        F.quantize_blockwise(torch.randn(512), blocksize=256)
    except Exception as e:  # not installed, or no kernel for this machine
        return None, f"{type(e).__name__}: {e}"
    return F, None


def bitsandbytes_peer(case: Case, d: dict, block: int) -> Timed | None:
    """bitsandbytes' blockwise 8-bit quantize or dequantize of the case into preallocated
    ``out`` (uint8 codes / x's dtype) and ``absmax`` (float32 per block) buffers."""
    F, _ = bitsandbytes()
    if F is None or case.op not in BNB_OPS or DTYPES[case.dtype] == torch.float64:
        return None
    x, n = d["x"], case.n
    code = F.create_dynamic_map().to(x.device)  # its default signed 8-bit dynamic code
    absmax = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    nbytes = op_bytes(case, block, None)
    if case.op == "quantize_int8":
        return Timed(lambda: F.quantize_blockwise(x, code=code, absmax=absmax, out=codes, blocksize=block),
                     "baseline", nbytes)
    F.quantize_blockwise(x, code=code, absmax=absmax, out=codes, blocksize=block)
    out = torch.empty_like(x)
    return Timed(lambda: F.dequantize_blockwise(codes, absmax=absmax, code=code, out=out, blocksize=block),
                 "baseline", nbytes)


# ---------------------------------------------------------------------------
# all peers of a case


def peers(case: Case, d: dict, block: int, rounding: str, compile_ops, notes: list) -> dict[str, Timed]:
    """The peers of ``case`` by name (see the module docstring); ``compile_ops``: the ops
    given a torch.compile peer."""
    out: dict[str, Timed] = {}
    n, isz = case.n, itemsize(DTYPES[case.dtype])
    if case.device == "cpu":
        src = d["x"].view(torch.uint8).numpy() if n else np.empty(0, np.uint8)
        dst = np.empty_like(src)
        out["copy"] = Timed(lambda: np.copyto(dst, src), "baseline", 2 * n * isz)
    else:
        xs = d["x"]
        xd = torch.empty_like(xs)
        out["copy"] = Timed(lambda: xd.copy_(xs), "baseline", 2 * n * isz)
    if case.op in compile_ops:
        fn = compiled_peer(case, d, block, rounding)
        if fn is not None:
            out["compiled"] = Timed(fn, "baseline", op_bytes(case, block, None))
    if case.op in TOPK_OPS:
        x, k = d["x"], case.k
        try:
            torch.topk(x[:16].abs(), 1)
            out["torch.topk"] = Timed(lambda: torch.topk(x.abs(), k), "baseline")
        except RuntimeError as e:  # e.g. a dtype topk does not support here
            notes.append(f"torch.topk skipped for {case.dtype}: {e}")
    if case.op == "dgc":
        out.update(_dgc_peers(case, d))
    bnb = bitsandbytes_peer(case, d, block)
    if bnb is not None:
        out["bitsandbytes"] = bnb
    return out


def _dgc_peers(case: Case, d: dict) -> dict[str, Timed]:
    from gradcomp import kernels as K

    x, r, k = d["x"], d["r"], case.k

    def topk_ef():
        r.add_(x)
        idx, vals = K.topk(r, k)
        r.index_fill_(0, idx.long(), 0.0)
        return idx, vals

    return {"topk": Timed(lambda: K.topk(x, k), "baseline"), "topk+ef": Timed(topk_ef, "baseline")}
