"""Triton kernel backend (registry entry ``"triton"``).

Kernels live one file per op family: :mod:`.quantize` (quantize, dequantize,
fused error feedback), :mod:`.select` (top-k, threshold, approximate top-k)
and :mod:`.scatter` (sparse accumulate). Each holds private ``_kernel``
functions and their host launchers. Triton itself is imported only when an
op first runs (``import gradcomp`` never imports it).

The backend serves CUDA tensors. With ``TRITON_INTERPRET=1`` set before the
first use, Triton's interpreter runs the same kernels on CPU tensors (slow:
for tests only), so every kernel is checked against the reference without a
GPU.

For CUDA tensors ``registry.PREFERENCE["cuda"]`` tries ``cuda`` before
``triton``; how a benchmark measurement may change that per op
(``registry.CUDA_OP_PREFERENCE``) is described in :mod:`gradcomp.kernels.cuda`.
"""

from __future__ import annotations

import importlib.util
import os


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason() -> str | None:
    """None when usable: triton imports and a CUDA device is present (or
    ``TRITON_INTERPRET=1`` is set); otherwise the reason."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install is a reason, not a crash
        return f"triton failed to import: {type(e).__name__}: {e}"
    if _interpret():
        return None
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is available (set TRITON_INTERPRET=1 to run the kernels on CPU tensors)"
    return None


def devices() -> frozenset[str]:
    """``{"cuda"}``, plus ``"cpu"`` under ``TRITON_INTERPRET=1``."""
    return frozenset({"cuda", "cpu"}) if _interpret() else frozenset({"cuda"})


def quantize_int8(x, block_size=256, rounding="nearest", seed=0, counter=0, out_q=None, out_scales=None):
    """Blockwise absmax int8 quantization; see :func:`.quantize.quantize_int8`."""
    from gradcomp.kernels.triton import quantize

    return quantize.quantize_int8(x, block_size, rounding, seed, counter, out_q, out_scales)


def dequantize_int8(q, scales, block_size=256, out=None):
    """``code * scale``; see :func:`.quantize.dequantize_int8`."""
    from gradcomp.kernels.triton import quantize

    return quantize.dequantize_int8(q, scales, block_size, out)


def dequantize_int8_add_(acc, q, scales, block_size=256):
    """``acc += code * scale``; see :func:`.quantize.dequantize_int8_add_`."""
    from gradcomp.kernels.triton import quantize

    return quantize.dequantize_int8_add_(acc, q, scales, block_size)


def quantize_int8_ef(x, residual, block_size=256, rounding="nearest", seed=0, counter=0,
                     out_q=None, out_scales=None):
    """Fused error-feedback quantization; see :func:`.quantize.quantize_int8_ef`."""
    from gradcomp.kernels.triton import quantize

    return quantize.quantize_int8_ef(x, residual, block_size, rounding, seed, counter, out_q, out_scales)


def topk(x, k):
    """Exact top-k by radix select; see :func:`.select.topk`."""
    from gradcomp.kernels.triton import select

    return select.topk(x, k)


def threshold(x, tau):
    """Stream compaction of ``|x| >= tau``; see :func:`.select.threshold`."""
    from gradcomp.kernels.triton import select

    return select.threshold(x, tau)


def approx_topk(x, k):
    """DGC sampled-threshold top-k; see :func:`.select.approx_topk`."""
    from gradcomp.kernels.triton import select

    return select.approx_topk(x, k)


def scatter_add_(acc, indices, values):
    """``acc[indices] += values``; see :func:`.scatter.scatter_add_`."""
    from gradcomp.kernels.triton import scatter

    return scatter.scatter_add_(acc, indices, values)
