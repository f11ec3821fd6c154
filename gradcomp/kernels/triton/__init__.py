"""Triton kernel backend (registry entry ``"triton"``).

Kernels live one file per op family: :mod:`.quantize` (quantize, dequantize,
fused error feedback), :mod:`.select` (top-k, threshold, approximate top-k)
and :mod:`.scatter` (sparse accumulate). Each holds private ``_kernel``
functions and their host launchers, declared as the ops' kernels
(:func:`gradcomp.kernels.ops.kernel`). The registry imports them
(:data:`KERNEL_MODULES`) once the backend is usable; ``import gradcomp``
never imports Triton.

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

__all__ = ["KERNEL_MODULES", "unavailable_reason", "devices"]


#: the modules declaring this backend's kernels
KERNEL_MODULES = tuple(f"gradcomp.kernels.triton.{m}" for m in ("quantize", "lowbit", "select", "scatter"))


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
