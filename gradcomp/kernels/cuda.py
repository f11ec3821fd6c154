"""CUDA kernel backend (registry entry ``"cuda"``): csrc/cuda/*.cu through CuPy.

Its kernels take the arguments of the ops' schemas (:mod:`gradcomp.kernels.ops`)
and are registered under the ``CUDA`` dispatch key when chosen for CUDA tensors.

The sources (``quantize.cu``, ``select.cu``, ``scatter.cu`` and their shared
``common.cuh``) are compiled with NVRTC by :class:`cupy.RawModule` the first
time an op of their family runs, once per process (CuPy also keeps the binary
in its on-disk kernel cache). They are looked up in ``gradcomp/_cuda_src/``
(where ``setup.py`` copies them into an installed package) and then in
``<repo>/csrc/cuda/`` (a source checkout). Kernels are ``extern "C"`` and are
launched on the current PyTorch CUDA stream of the tensor's device
(``cupy.cuda.ExternalStream``) with raw ``data_ptr()`` arguments, so no data
is copied or converted between the libraries. Compilation and launch errors
are Python exceptions (:class:`RuntimeError` or CuPy's CUDA errors).

Numerics match :mod:`gradcomp.kernels.reference` bit for bit: divisions use
``__fdiv_rn``, products and sums ``__fmul_rn`` / ``__fadd_rn`` (and
``--fmad=false``) so nothing fuses into an FMA, ``rintf`` rounds half to even,
denormals are kept (``--ftz=false``). Selection is a radix select over
order-preserving integer keys of ``|x|`` followed by one stream compaction
(see ``select.cu``).

Backend order for CUDA tensors: ``registry.PREFERENCE["cuda"]`` tries
``cuda`` before ``triton``. ``benchmarks/gpu_check.sh`` (and
``benchmarks/kernels.py``) time both on the same tensors, median of repeated
runs after warm-up, as effective bandwidth against a device-to-device copy
measured in the same run; when one backend is faster on an op beyond the
run-to-run spread, that order goes into ``registry.CUDA_OP_PREFERENCE`` for
the op. Without such a measurement the default order stays.
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import numpy as np
import torch

from gradcomp.kernels import reference
from gradcomp.kernels.ops import kernel

__all__ = [
    "SOURCES", "KERNEL_MODULES", "NVRTC_OPTIONS", "source_dirs", "source_dir", "source",
    "unavailable_reason", "devices", "launch_kernel", "pointer", "grid_size", "quantize_int8",
    "quantize_int8_ef", "dequantize_int8", "dequantize_int8_add_", "topk", "threshold", "approx_topk",
    "scatter_add_",
]

#: op family -> source file
SOURCES = {"quantize": "quantize.cu", "lowbit": "lowbit.cu", "select": "select.cu", "scatter": "scatter.cu"}
#: the modules declaring more of this backend's kernels (imported once it is usable)
KERNEL_MODULES = ("gradcomp.kernels.cuda_lowbit",)
#: NVRTC options: C++17, IEEE division, no FMA contraction, no flush-to-zero
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true")

# launch geometry; the _SELECT_* values must match the #defines in select.cu
_THREADS = 256
_MAX_GRID = 4096  # grid-stride kernels
_SELECT_TILE = 2048  # GC_S_TILE = GC_S_THREADS * GC_S_ITEMS
_DIGIT = 8
_SFX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}

_lock = threading.Lock()
_modules: dict[str, object] = {}
_functions: dict[tuple[str, str], object] = {}

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([A-Za-z0-9_.]+)"[ \t]*$', re.MULTILINE)


def source_dirs() -> list[Path]:
    """Where the .cu files are looked for, in order: the source checkout (so an
    edited csrc/cuda/ always wins over a stale copy), then the installed package copy."""
    here = Path(__file__).resolve()
    return [here.parents[2] / "csrc" / "cuda", here.parent.parent / "_cuda_src"]


def source_dir() -> Path | None:
    """The first directory of :func:`source_dirs` holding every source, else None."""
    for d in source_dirs():
        if all((d / f).is_file() for f in SOURCES.values()):
            return d
    return None


def source(family: str) -> str:
    """The CUDA source of an op family with local ``#include "x.cuh"`` lines
    replaced by the file's text (NVRTC gets one self-contained string).

    Raises:
        RuntimeError: the sources are not found.
    """
    d = source_dir()
    if d is None:
        raise RuntimeError(f"gradcomp CUDA sources not found in {[str(p) for p in source_dirs()]}")

    def inline(m):
        return (d / m.group(1)).read_text()

    return _INCLUDE.sub(inline, (d / SOURCES[family]).read_text())


def unavailable_reason() -> str | None:
    """None when usable: CuPy imports, a CUDA device is visible and the sources exist."""
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return (f"cupy is not importable ({type(e).__name__}: {e}); "
                "install cupy-cuda12x or cupy-cuda13x to match your CUDA driver")
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if source_dir() is None:
        return f"CUDA sources not found in {[str(p) for p in source_dirs()]}"
    return None


def devices() -> frozenset[str]:
    """``{"cuda"}``."""
    return frozenset({"cuda"})


def _function(family: str, kernel: str):
    key = (family, kernel)
    fn = _functions.get(key)
    if fn is None:
        import cupy

        with _lock:
            mod = _modules.get(family)
            if mod is None:
                mod = cupy.RawModule(code=source(family), options=NVRTC_OPTIONS)
                _modules[family] = mod
            try:
                fn = mod.get_function(kernel)  # compiles the module on first use
            except Exception as e:
                raise RuntimeError(
                    f"loading CUDA kernel {kernel} from {SOURCES[family]} failed "
                    f"(NVRTC compile or module load): {type(e).__name__}: {e}"
                ) from e
            _functions[key] = fn
    return fn


def _launch(family: str, kernel: str, grid: int, block: int, args: tuple, device: torch.device) -> None:
    """Launch ``kernel`` of ``family`` with ``grid`` x ``block`` threads on the
    current torch stream of ``device``; ``args`` are numpy scalars of the
    kernel's parameter types (pointers as uint64)."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream, index):
        _function(family, kernel)((int(grid),), (int(block),), args)


def launch_kernel(family: str, kernel: str, grid: int, block: int, args: tuple, device: torch.device) -> None:
    """Launch ``kernel`` of source ``family`` (see :data:`SOURCES`) on the current torch stream of
    ``device`` with ``grid`` x ``block`` threads; ``args`` are numpy scalars of the kernel's
    parameter types (pointers as :func:`pointer`)."""
    _launch(family, kernel, grid, block, args, device)  # looked up per call: the CPU emulation replaces it


def pointer(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0 for None)."""
    return _ptr(t)


def grid_size(work: int, per_block: int) -> int:
    """CTAs for ``work`` items at ``per_block`` per CTA, capped for grid-stride kernels."""
    return _grid(work, per_block)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _grid(work: int, per_block: int) -> int:
    return max(1, min(-(-work // per_block), _MAX_GRID))


# ---------------------------------------------------------------- quantization


def _quantize(x, residual, block_size, stochastic, key, q, s):
    n = x.numel()
    nblocks = -(-n // block_size)
    if n == 0:
        return
    if x.dtype == torch.float64:
        x = x.to(torch.float32)  # as the reference does
    blocks_per_cta = _THREADS // min(block_size, _THREADS)
    name = ("gc_quantize_ef_" if residual is not None else "gc_quantize_") + _SFX[x.dtype]
    r = residual.view(-1) if residual is not None else None
    _launch("quantize", name, -(-nblocks // blocks_per_cta), _THREADS,
            (_ptr(x), _ptr(r), _ptr(q), _ptr(s), np.int64(n), np.int32(block_size),
             np.int32(stochastic), np.uint32(key)), x.device)


@kernel("cuda")
def quantize_int8(x, block_size, stochastic, key, q, scales):
    """Blockwise absmax int8 quantization (reference numerics).

    Args:
        x: contiguous 1-D CUDA float32/float16/bfloat16/float64 tensor, n elements
            (float64 is rounded to float32 first).
        block_size: power of two in [32, 65536].
        stochastic, key: stochastic rounding and its stream key (else half to even).
        q, scales: contiguous int8 ``[n]`` / float32 ``[ceil(n/block_size)]`` outputs.
    """
    _quantize(x, None, block_size, stochastic, key, q, scales)


@kernel("cuda")
def quantize_int8_ef(x, residual, block_size, stochastic, key, q, scales):
    """Fused error feedback in one kernel: ``p = x + residual; (q, s) = Q(p);
    residual <- p - q * s`` (residual: contiguous float32, n elements)."""
    _quantize(x, residual, block_size, stochastic, key, q, scales)


def _dequantize(q, scales, block_size, out, add):
    n = q.numel()
    if n > 0:
        name = "gc_dequantize_add" if add else "gc_dequantize_" + _SFX[out.dtype]
        _launch("quantize", name, _grid(n, _THREADS), _THREADS,
                (_ptr(q), _ptr(scales), _ptr(out), np.int64(n), np.int32(block_size.bit_length() - 1)),
                q.device)


@kernel("cuda")
def dequantize_int8(q, scales, block_size, check_int8, out):
    """``out = code * scale`` per element (rounded to out's dtype, half to
    even); q: contiguous int8 ``[n]``, scales: float32 ``[ceil(n / block_size)]``,
    out: contiguous float32/float16/bfloat16/float64 of n elements.
    ``check_int8``: one checking pass before any write."""
    if check_int8:
        reference.check_int8_values(q, scales)
    _dequantize(q, scales, block_size, out, add=False)


@kernel("cuda")
def dequantize_int8_add_(acc, q, scales, block_size, check_int8):
    """``acc += code * scale`` in place; acc: contiguous float32 with ``q.numel()`` elements."""
    if check_int8:
        reference.check_int8_values(q, scales)
    _dequantize(q, scales, block_size, acc, add=True)


# ------------------------------------------------------------------- selection


def _radix_select(x, count, stride, k, nan_as_inf):
    """Device state ``int64[2] = [T, k_rem]`` for the k-th largest key of
    ``x[i * stride]``, ``i < count`` (see select.cu)."""
    sfx = _SFX[x.dtype]
    bits = 64 if x.dtype == torch.float64 else 32
    state = torch.zeros(2, dtype=torch.int64, device=x.device)
    state[1].fill_(k)
    hist = torch.zeros(256, dtype=torch.int64, device=x.device)
    grid = _grid(count, _THREADS)
    for shift in range(bits - _DIGIT, -1, -_DIGIT):
        _launch("select", "gc_radix_hist_" + sfx, grid, _THREADS,
                (_ptr(x), np.int64(count), np.int64(stride), _ptr(state), np.int32(shift),
                 np.int32(nan_as_inf), _ptr(hist)), x.device)
        _launch("select", "gc_radix_pick", 1, _THREADS, (_ptr(hist), _ptr(state), np.int32(shift)), x.device)
    return state


def _counts(x, state, nan_as_inf):
    n = x.numel()
    ntiles = -(-n // _SELECT_TILE)
    gt = torch.empty(ntiles, dtype=torch.int64, device=x.device)
    eq = torch.empty(ntiles, dtype=torch.int64, device=x.device)
    _launch("select", "gc_select_count_" + _SFX[x.dtype], ntiles, _THREADS,
            (_ptr(x), np.int64(n), _ptr(state), np.int32(nan_as_inf), _ptr(gt), _ptr(eq)), x.device)
    return gt, eq


def _compact(x, state, gt, eq, size, nan_as_inf):
    n = x.numel()
    idx = torch.empty(size, dtype=reference.index_dtype(n), device=x.device)
    val = torch.empty(size, dtype=x.dtype, device=x.device)
    gt_base = torch.cumsum(gt, 0) - gt
    eq_base = torch.cumsum(eq, 0) - eq
    _launch("select", "gc_select_write_" + _SFX[x.dtype], gt.numel(), _THREADS,
            (_ptr(x), np.int64(n), _ptr(state), np.int32(nan_as_inf), _ptr(gt_base), _ptr(eq_base),
             _ptr(idx), np.int32(idx.dtype == torch.int64), _ptr(val)), x.device)
    return idx, val


def _topk(x, k, nan_as_inf):
    n = x.numel()
    if k <= 0 or k >= n:
        return reference.all_or_none(x, k >= n)
    state = _radix_select(x, n, 1, k, nan_as_inf)
    gt, eq = _counts(x, state, nan_as_inf)
    return _compact(x, state, gt, eq, k, nan_as_inf)


@kernel("cuda")
def topk(x, k):
    """Exact top-k by magnitude (ties: lower index; NaN above +Inf) by radix select.

    Args:
        x: contiguous 1-D CUDA float32/float16/bfloat16/float64 tensor, n elements; 0 <= k <= n.

    Returns:
        ``(indices, values)``: ascending int32 indices (int64 when n >= 2**31), ``x[indices]``.
    """
    return _topk(x, k, False)


def _key_of(tau: float, x: torch.Tensor) -> int:
    if x.dtype == torch.float64:
        return torch.tensor(abs(tau), dtype=torch.float64).view(torch.int64).item()
    return torch.tensor(abs(tau), dtype=torch.float32).view(torch.int32).item()


@kernel("cuda")
def threshold(x, tau):
    """Every element with ``|x| >= tau`` or NaN (stream compaction; one host sync
    for the output size).

    Args:
        x: contiguous 1-D CUDA floating tensor. tau: finite, >= 0; compared in
            float32 (float64 for float64 x).

    Returns:
        ``(indices, values)`` as :func:`topk`.
    """
    n = x.numel()
    if n == 0:
        return reference.all_or_none(x, False)
    state = torch.tensor([_key_of(tau, x), n], dtype=torch.int64, device=x.device)
    gt, eq = _counts(x, state, False)
    size = int((gt.sum() + eq.sum()).item())
    return _compact(x, state, gt, eq, size, False)


@kernel("cuda")
def approx_topk(x, k):
    """Sampled-threshold top-k of Deep Gradient Compression (Lin et al. 2018),
    with the reference's sample, threshold and correction (exact top-k when the
    survivor count misses ``[ceil(0.9 k), floor(1.1 k)]``).

    Returns:
        ``(indices, values)`` as :func:`topk`; always a top set.
    """
    n = x.numel()
    if k >= n or k <= 0:
        return reference.all_or_none(x, k >= n)
    s = reference.approx_topk_sample_size(n, k)
    stride = n // s
    ks = max(1, min(s, math.ceil(s * k / n)))
    state = _radix_select(x, s, stride, ks, True)
    state[1].fill_(n)  # keep every element at the threshold
    gt, eq = _counts(x, state, True)
    c = int((gt.sum() + eq.sum()).item())
    lo, hi = math.ceil(0.9 * k), math.floor(1.1 * k)
    if lo <= c <= hi:
        return _compact(x, state, gt, eq, c, True)
    return _topk(x, k, c > hi)


# --------------------------------------------------------------------- scatter


@kernel("cuda")
def scatter_add_(acc, indices, values):
    """``acc.view(-1)[indices] += values`` with float32 atomics (values rounded
    to float32 first; indices are checked first: ValueError, nothing written).

    Args:
        acc: contiguous float32 CUDA tensor, n elements. indices: int32/int64 ``[m]``.
        values: float32/float16/bfloat16/float64 ``[m]``.
    """
    m = indices.numel()
    if m > 0:
        reference.check_indices(indices, acc.numel())
        name = "gc_scatter_add_{}_{}".format("i64" if indices.dtype == torch.int64 else "i32",
                                             _SFX[values.dtype])
        _launch("scatter", name, _grid(m, _THREADS), _THREADS,
                (_ptr(acc), np.int64(acc.numel()), _ptr(indices), _ptr(values), np.int64(m)), acc.device)
