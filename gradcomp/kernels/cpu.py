"""Registry backend ``cpu``: native OpenMP kernels (C++17, module ``gradcomp._C``).

The kernels take CPU tensors and the arguments of the ops' schemas
(:mod:`gradcomp.kernels.ops`; registered under the ``CPU`` dispatch key when
``gradcomp._C`` is built), with the reference's results bit for bit: int8
codes, scales, residuals, dequantized values and accumulations (NaN bit
patterns included, as PyTorch's CPU kernels produce them: a non-finite block
leaves the residual 0x7FC00000; float32 -> bfloat16 writes NaN as 0xFFFF), and
the index sets of ``topk`` / ``threshold``. ``approx_topk`` draws the
reference's strided sample (capped at 65536 elements) and always meets its
contract: a top set with a kept count in ``[ceil(0.9 k), floor(1.1 k)]``, or
exactly k. One exception to bit-exactness: PyTorch widens a float16 NaN
with or without its payload depending on the element's position, so
``scatter_add_`` of float16 NaN values matches it only up to the NaN payload.

Tensors cross into C++ as numpy views without copies: float32/float64 as
themselves, float16/bfloat16 as int16 views decoded in C++. The kernels run
with the GIL released, in parallel over blocks or chunks with OpenMP. Their
thread count is :func:`set_num_threads` when set, else ``omp_get_max_threads()``
(``OMP_NUM_THREADS``, all cores, or what ``torch.set_num_threads`` chose when
PyTorch and this module share one OpenMP runtime, as with the Linux wheels).

``gradcomp._C`` is imported on first use, never by ``import gradcomp``. Build
it with ``python setup.py build_ext --inplace`` (``GRADCOMP_NO_NATIVE=1``
skips it; the registry then falls back to the reference).
"""

from __future__ import annotations

import math

import torch

from gradcomp.errors import PayloadError
from gradcomp.kernels import reference as _ref
from gradcomp.kernels.ops import kernel

__all__ = [
    "native",
    "flat_cpu",
    "as_numpy",
    "out_numpy",
    "dtype_name",
    "unavailable_reason",
    "devices",
    "set_num_threads",
    "get_num_threads",
    "isa",
    "isas",
    "ISA_ENV",
    "quantize_int8",
    "dequantize_int8",
    "dequantize_int8_add_",
    "quantize_int8_ef",
    "reduce_quantize_int8",
    "topk",
    "threshold",
    "approx_topk",
    "scatter_add_",
    "dgc_accumulate_",
    "dgc_topk_",
    "ef_encode",
    "ef_decode",
]

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}

_native_module = None

#: the modules declaring more of this backend's kernels (imported once it is usable)
KERNEL_MODULES = ("gradcomp.kernels.cpu_lowbit",)

#: largest strided sample approx_topk draws to estimate its threshold
_APPROX_MAX_SAMPLE = 65536


def native():
    """The module ``gradcomp._C``, imported on first use (ImportError when it is not built)."""
    global _native_module
    if _native_module is None:
        import gradcomp._C as mod

        _native_module = mod
    return _native_module


def unavailable_reason() -> str | None:
    """None when ``gradcomp._C`` imports, else why it does not."""
    try:
        native()
    except ImportError as e:
        return (
            "gradcomp._C is not built (build it with `python setup.py build_ext --inplace`; "
            f"was GRADCOMP_NO_NATIVE=1 set?): {e}"
        )
    return None


def devices() -> frozenset[str]:
    """Device types served: CPU tensors only."""
    return frozenset({"cpu"})


#: the environment variable that forces a kernel variant (read once, when gradcomp._C loads)
ISA_ENV = "GRADCOMP_CPU_ISA"


def isa() -> str:
    """The instruction set the native kernels run: ``"baseline"``, ``"avx2"`` or ``"avx512"``,
    chosen once per process from :data:`ISA_ENV` or, unset, the best this CPU supports.

    Raises:
        ValueError: :data:`ISA_ENV` names no variant or one this CPU cannot run (the reason).
    """
    return str(native().cpu_isa())


def isas() -> tuple[str, ...]:
    """The kernel variants this CPU and build can run, best last."""
    return tuple(native().cpu_isas().split(", "))


def set_num_threads(n: int) -> None:
    """Threads used by every native kernel; ``0`` restores the default
    (``omp_get_max_threads()`` of the calling thread)."""
    native().set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the native kernels use now."""
    return int(native().get_num_threads())


# ---------------------------------------------------------------------------
# tensor <-> numpy views (kept to a few cheap tensor calls: they are the
# whole per-call overhead on small inputs)

_TWO_BYTE = (torch.float16, torch.bfloat16)


def flat_cpu(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat contiguous CPU tensor without autograd history."""
    if not t.is_cpu:
        raise ValueError(f"the cpu backend needs CPU tensors, got {name} on {t.device}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.dim() == 1 else t.reshape(-1)


def dtype_name(name: str, t: torch.Tensor) -> str:
    try:
        return _DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(
            f"{name} must have dtype in (float32, float16, bfloat16, float64), got {t.dtype}"
        ) from None


def as_numpy(t: torch.Tensor):
    """numpy view of a flat contiguous CPU tensor (2-byte floats as int16)."""
    if t.dtype in _TWO_BYTE:
        t = t.view(torch.int16)
    return t.numpy()


def out_numpy(name: str, t: torch.Tensor, dtype: torch.dtype | None, numel: int):
    """numpy view of an output tensor written in place (dtype None: any float dtype)."""
    if (
        (dtype is not None and t.dtype != dtype)
        or t.numel() != numel
        or not t.is_cpu
        or not t.is_contiguous()
    ):
        want = "" if dtype is None else f"{dtype} "
        raise ValueError(
            f"{name} must be a contiguous CPU {want}tensor of {numel} elements, "
            f"got {t.dtype} with {t.numel()} elements on {t.device}"
        )
    if t.requires_grad:
        t = t.detach()
    return as_numpy(t if t.dim() == 1 else t.view(-1))


def _selection(idx, val, dtype: torch.dtype):
    i = torch.from_numpy(idx)
    v = torch.from_numpy(val)
    if dtype in _TWO_BYTE:
        v = v.view(dtype)
    return i, v


# ---------------------------------------------------------------------------
# ops (arguments: the schemas of gradcomp.kernels.ops)


@kernel("cpu")
def quantize_int8(x, block_size, stochastic, key, q, scales):
    """Blockwise absmax int8 quantization (Dettmers et al. 2022) of CPU
    float32/float16/bfloat16/float64 ``x`` into int8 ``q [n]`` and float32
    ``scales [ceil(n / block_size)]`` (contiguous, written in place).

    Raises:
        ValueError: bad block_size or outputs. TypeError: bad dtype.
    """
    _quantize(x, None, block_size, stochastic, key, q, scales)


@kernel("cpu")
def quantize_int8_ef(x, residual, block_size, stochastic, key, q, scales):
    """Fused error-feedback quantization in one pass per block (Seide et al.
    2014): ``p = float(x) + residual; (q, s) = Q(p); residual <- p - q * s``;
    residual: contiguous CPU float32 with ``x.numel()`` elements."""
    res = out_numpy("residual", residual, torch.float32, x.numel())
    _quantize(x, res, block_size, stochastic, key, q, scales)


def _quantize(x, residual, block_size, stochastic, key, q, s):
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    xf = flat_cpu("x", x)
    n = xf.numel()
    nb = -(-n // block_size)
    native().quantize_int8(
        as_numpy(xf), dtype_name("x", xf), block_size, stochastic, key,
        out_numpy("q", q, torch.int8, n), out_numpy("scales", s, torch.float32, nb), residual,
    )


@kernel("cpu")
def dequantize_int8(q, scales, block_size, check_int8, out):
    """``out = code * scale`` per element (float32 product, rounded to out's
    dtype: float32/float16/bfloat16/float64). ``check_int8`` checks each block
    as it is read (see :func:`gradcomp.kernels.dequantize_int8`).

    Raises:
        gradcomp.PayloadError: ``check_int8`` and a code or scale is out of range.
    """
    qf, sf = flat_cpu("q", q), flat_cpu("scales", scales)
    n = qf.numel()
    _codes_ok(native().dequantize_int8(qf.numpy(), sf.numpy(), block_size, out_numpy("out", out, None, n),
                                        dtype_name("out", out), bool(check_int8)))


def _codes_ok(ok: bool) -> None:
    if not ok:
        raise PayloadError(_ref.BAD_INT8)


@kernel("cpu")
def dequantize_int8_add_(acc, q, scales, block_size, check_int8):
    """``acc += code * scale`` in place (float32; the product is rounded first);
    acc: contiguous CPU float32 with ``q.numel()`` elements."""
    qf, sf = flat_cpu("q", q), flat_cpu("scales", scales)
    av = out_numpy("acc", acc, torch.float32, qf.numel())
    _codes_ok(native().dequantize_int8_add(av, qf.numpy(), sf.numpy(), block_size, bool(check_int8)))


@kernel("cpu")
def reduce_quantize_int8(acc, q, scales, block_size, divisor, stochastic, key, decode, check_int8, out_q,
                         out_scales):
    """:func:`gradcomp.kernels.reduce_quantize_int8` in one native pass per
    block (acc: contiguous CPU float32, n elements, read and written once)."""
    n = acc.numel()
    nb = -(-n // block_size)
    av = out_numpy("acc", acc, torch.float32, n)
    qf, sf = flat_cpu("q", q), flat_cpu("scales", scales)
    _codes_ok(native().reduce_quantize_int8(
        av, qf.numpy(), sf.numpy(), block_size, float(divisor), stochastic, key,
        out_numpy("out_q", out_q, torch.int8, n), out_numpy("out_scales", out_scales, torch.float32, nb),
        bool(decode), bool(check_int8),
    ))


@kernel("cpu")
def topk(x, k):
    """Exact top-k by ``|x|`` (NaN largest; ties to the lower index) by radix
    select: one histogram pass, one compaction pass, no sort.

    Returns:
        ``(indices, values)``: ascending int32 indices (int64 when n >= 2**31)
        and the values there in x's dtype; ``min(k, n)`` of them.
    """
    xf = flat_cpu("x", x)
    idx, val = native().topk(as_numpy(xf), dtype_name("x", xf), int(k))
    return _selection(idx, val, xf.dtype)


@kernel("cpu")
def threshold(x, tau):
    """Every element with ``|x| >= tau`` or NaN (compared in float32, float64
    for float64 x), by a parallel count / prefix-sum / write compaction."""
    xf = flat_cpu("x", x)
    idx, val = native().threshold(as_numpy(xf), dtype_name("x", xf), float(tau))
    return _selection(idx, val, xf.dtype)


@kernel("cpu")
def approx_topk(x, k):
    """Sampled-threshold top-k (Deep Gradient Compression, Lin et al. 2018).

    The threshold is the ``ceil(s k / n)``-th largest ``|x|`` of a strided
    sample of ``s = min(approx_topk_sample_size(n, k), 65536)`` elements (the
    reference's sample, capped: a larger sample costs more than the exact
    selection it is meant to avoid). The kept set is a top set (every kept
    ``|x|`` >= every dropped one, NaN largest) of size in
    ``[ceil(0.9 k), floor(1.1 k)]``; when the estimate keeps too many the
    exact top k of them is returned, when too few the exact :func:`topk`.
    """
    xf = flat_cpu("x", x)
    n = xf.numel()
    k = max(0, min(int(k), n))
    s = min(_ref.approx_topk_sample_size(n, k), _APPROX_MAX_SAMPLE)
    ks = max(1, min(s, math.ceil(s * k / n))) if n else 0
    lo, hi = math.ceil(0.9 * k), math.floor(1.1 * k)
    idx, val = native().approx_topk(as_numpy(xf), dtype_name("x", xf), k, s, ks, lo, hi)
    return _selection(idx, val, xf.dtype)


@kernel("cpu")
def scatter_add_(acc, indices, values):
    """``acc.view(-1)[indices] += values`` in index order (duplicates
    accumulate; values converted to float32 first).

    Raises:
        ValueError: an index outside ``[0, acc.numel())`` (acc is left unchanged).
    """
    av = out_numpy("acc", acc, torch.float32, acc.numel())
    ix, vf = flat_cpu("indices", indices), flat_cpu("values", values)
    if ix.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must have dtype in (int32, int64), got {ix.dtype}")
    native().scatter_add(av, ix.numpy(), as_numpy(vf), dtype_name("values", vf))


@kernel("cpu")
def dgc_accumulate_(g, u, v, momentum, scale):
    """``u = u * momentum + g * scale; v += u`` in one pass (float32 CPU tensors
    of one numel; bit for bit :func:`gradcomp.kernels.reference.dgc_accumulate_`)."""
    n = g.numel()
    native().dgc_accumulate(flat_cpu("g", g).numpy(), out_numpy("u", u, torch.float32, n),
                             out_numpy("v", v, torch.float32, n), float(momentum), float(scale))


@kernel("cpu")
def dgc_topk_(g, u, v, momentum, scale, k):
    """:func:`dgc_accumulate_` then :func:`topk` of ``v``, fused in one pass
    (bit for bit the two ops). Returns ``(indices, values)`` as :func:`topk`."""
    n = g.numel()
    idx, val = native().dgc_topk(flat_cpu("g", g).numpy(), out_numpy("u", u, torch.float32, n),
                                  out_numpy("v", v, torch.float32, n), float(momentum), float(scale), int(k))
    return _selection(idx, val, torch.float32)


# ---------------------------------------------------------------------------
# extras outside the ops (used where the registry picks this backend for
# CPU tensors): Elias-Fano index coding


def ef_encode(idx: torch.Tensor, L: int, lo_nbytes: int, hi_nbytes: int) -> torch.Tensor:
    """The Elias-Fano bytes of ascending int32/int64 CPU indices
    (:func:`gradcomp.index_codec.encode`): ``lo_nbytes`` low-bit bytes, then
    ``hi_nbytes`` high-bit bytes."""
    out = torch.zeros(lo_nbytes + hi_nbytes, dtype=torch.uint8)
    ix = flat_cpu("idx", idx)
    native().ef_encode(ix.numpy(), int(L), out[:lo_nbytes].numpy(), out[lo_nbytes:].numpy())
    return out


def ef_decode(lo: torch.Tensor, hi: torch.Tensor, n: int, k: int, L: int, dtype: torch.dtype):
    """``(indices, status)``: ``k`` decoded indices of ``dtype`` (int32/int64)
    and 0, or 1 (set-bit count), 2 (index >= n), 3 (not strictly ascending)."""
    out = torch.empty(k, dtype=dtype)
    status = native().ef_decode(flat_cpu("lo", lo).numpy(), flat_cpu("hi", hi).numpy(), int(n), int(L), out.numpy())
    return out, int(status)

