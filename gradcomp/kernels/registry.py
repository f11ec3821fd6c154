"""Kernel backend registry: one schema per op, one implementation per backend.

A backend is a module that exposes ``unavailable_reason() -> str | None``,
``devices()`` (the device types it serves) and some of the ops in :data:`OPS`
as functions with the reference signatures (see ``reference.py``). Backend
modules are imported on first use only, so ``import gradcomp`` stays light.

Selection, per op and device type:

* explicit (``backend=`` argument, else the ``GRADCOMP_BACKEND`` environment
  variable): that backend or :class:`~gradcomp.BackendUnavailable` with the
  recorded reason;
* automatic: the first usable backend in :data:`PREFERENCE` for the device
  that implements the op; ``reference`` always is.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType
from typing import Callable

from gradcomp.errors import BackendUnavailable

__all__ = ["OPS", "BACKENDS", "PREFERENCE", "available_backends", "resolve", "reset"]

OPS = (
    "quantize_int8",
    "dequantize_int8",
    "dequantize_int8_add_",
    "quantize_int8_ef",
    "topk",
    "threshold",
    "approx_topk",
    "scatter_add_",
)

#: backend name -> module path
BACKENDS = {
    "reference": "gradcomp.kernels.reference_backend",
    "cpu": "gradcomp.kernels.cpu",
    "triton": "gradcomp.kernels.triton",
    "cuda": "gradcomp.kernels.cuda",
}

#: automatic order per device type; for CUDA tensors the order follows the
#: kernel benchmark (benchmarks/kernels.py), per op where they differ.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu", "reference"),
    "cuda": ("cuda", "triton", "reference"),
}
#: per-op overrides of PREFERENCE["cuda"], from the benchmark
CUDA_OP_PREFERENCE: dict[str, tuple[str, ...]] = {}

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_reasons: dict[str, str | None] = {}


def _load(name: str) -> str | None:
    """Import backend ``name`` once; return None when usable, else the reason."""
    with _lock:
        if name in _reasons:
            return _reasons[name]
        try:
            mod = importlib.import_module(BACKENDS[name])
            reason = mod.unavailable_reason()
        except Exception as e:  # an import failure is a reason, not a crash
            mod, reason = None, f"{type(e).__name__}: {e}"
        if reason is None and mod is not None:
            _modules[name] = mod
        _reasons[name] = reason
        return reason


def reset() -> None:
    """Forget the probed state (used by tests that change the environment)."""
    with _lock:
        _modules.clear()
        _reasons.clear()


def available_backends() -> dict[str, str | None]:
    """Map each backend name to None when usable here, else the reason it is not."""
    return {name: _load(name) for name in BACKENDS}


def _serves(name: str, device_type: str) -> bool:
    return device_type in _modules[name].devices()


def resolve(op: str, device_type: str, backend: str | None = None) -> Callable:
    """Return the implementation of ``op`` for tensors on ``device_type``.

    Raises:
        ValueError: unknown backend name.
        BackendUnavailable: an explicitly chosen backend cannot run this op here.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    name = backend if backend is not None else (os.environ.get("GRADCOMP_BACKEND") or None)
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
        reason = _load(name)
        if reason is not None:
            raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")
        if not _serves(name, device_type):
            raise BackendUnavailable(
                f"backend {name!r} does not run on {device_type!r} tensors "
                f"(it runs on {sorted(_modules[name].devices())})"
            )
        fn = getattr(_modules[name], op, None)
        if fn is None:
            raise BackendUnavailable(f"backend {name!r} does not implement {op!r}")
        return fn
    order = PREFERENCE.get(device_type, ("reference",))
    if device_type == "cuda":
        order = CUDA_OP_PREFERENCE.get(op, order)
    for cand in order + ("reference",):
        if _load(cand) is None and _serves(cand, device_type):
            fn = getattr(_modules[cand], op, None)
            if fn is not None:
                return fn
    raise BackendUnavailable(f"no backend implements {op!r} on {device_type!r}")  # pragma: no cover
