"""Which backend runs an op: the kernels registered per device key, and forced choices.

A backend is one module (:data:`BACKENDS`) with ``unavailable_reason() -> str
| None``, ``devices()`` (the device types it serves), optionally
``KERNEL_MODULES`` (the modules holding its kernels, imported once it is
usable), and kernels declared with :func:`gradcomp.kernels.ops.kernel`. Backend
modules are imported on first use only, so ``import gradcomp`` stays light.

Selection, per op and device type:

* automatic: the op runs through the dispatcher (``torch.ops.gradcomp.<op>``).
  Under each device's dispatch key (:data:`DISPATCH_KEYS`) runs the kernel of
  the first usable backend of :data:`PREFERENCE` (per op
  :data:`CUDA_OP_PREFERENCE` on CUDA) that implements the op, chosen on the
  op's first call on that device (:func:`auto_kernel`); with none, the
  reference (the default kernel, as on every other device).
* explicit (``backend=`` argument, else the ``GRADCOMP_BACKEND`` environment
  variable): that backend's kernel, called directly, or
  :class:`~gradcomp.BackendUnavailable` with the reason. An op the backend
  leaves out (:data:`gradcomp.kernels.ops.FUSED`) runs as the composition of
  its ops, or by the reference when it is no composition.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from types import ModuleType
from typing import Callable

from gradcomp.errors import BackendUnavailable
from gradcomp.kernels import ops as _ops
from gradcomp.kernels import reference_backend as _reference

__all__ = ["OPS", "BACKENDS", "PREFERENCE", "CUDA_OP_PREFERENCE", "available_backends", "auto_kernel",
           "backend_name", "resolve", "select", "reset"]

#: the ops every backend implements (:data:`gradcomp.kernels.ops.OPS`)
OPS = _ops.OPS

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
#: device type -> dispatch key the automatic choice is registered under
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_reasons: dict[str, str | None] = {}
#: device type -> {op: the automatically chosen kernel}
_auto_kernels: dict[str, dict[str, Callable]] = {device_type: {} for device_type in DISPATCH_KEYS}
_resolved: dict[tuple[str, str, str | None], Callable] = {}


def _load(name: str) -> str | None:
    """Import backend ``name`` once; return None when usable, else the reason."""
    with _lock:
        if name in _reasons:
            return _reasons[name]
        try:
            mod = importlib.import_module(BACKENDS[name])
            reason = mod.unavailable_reason()
            if reason is None:
                for sub in getattr(mod, "KERNEL_MODULES", ()):
                    importlib.import_module(sub)
        except Exception as e:  # an import failure is a reason, not a crash
            mod, reason = None, f"{type(e).__name__}: {e}"
        if reason is None and mod is not None:
            _modules[name] = mod
        _reasons[name] = reason
        return reason


def reset() -> None:
    """Forget the probed state and the choices made (used by tests that change
    the environment); the next call chooses again."""
    with _lock:
        _modules.clear()
        _reasons.clear()
        _resolved.clear()
        for chosen in _auto_kernels.values():
            chosen.clear()  # in place: the routers hold these dicts


def available_backends() -> dict[str, str | None]:
    """Map each backend name to None when usable here, else the reason it is not."""
    return {name: _load(name) for name in BACKENDS}


def _serves(name: str, device_type: str) -> bool:
    return device_type in _modules[name].devices()


def _auto(op: str, device_type: str) -> str:
    order = PREFERENCE.get(device_type, ("reference",))
    if device_type == "cuda":
        order = CUDA_OP_PREFERENCE.get(op, order)
    for cand in order:
        if _load(cand) is None and _serves(cand, device_type) and op in _ops.kernels(cand):
            return cand
    return "reference"


def _forced(backend: str | None) -> str | None:
    name = backend if backend is not None else (os.environ.get("GRADCOMP_BACKEND") or None)
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return name


def _check_op(op: str) -> None:
    if op not in _ops.SCHEMAS:
        raise ValueError(f"op must be one of {tuple(_ops.SCHEMAS)}, got {op!r}")


def backend_name(op: str, device_type: str, backend: str | None = None) -> str:
    """The backend that runs ``op`` on ``device_type`` tensors: the one given
    (``backend``, else ``GRADCOMP_BACKEND``) once checked, else the automatic choice.

    Raises:
        ValueError: unknown op or backend name.
        BackendUnavailable: an explicitly chosen backend cannot run on this device.
    """
    _check_op(op)
    name = _forced(backend)
    if name is None:
        return _auto(op, device_type)
    reason = _load(name)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")
    if not _serves(name, device_type):
        raise BackendUnavailable(
            f"backend {name!r} does not run on {device_type!r} tensors "
            f"(it runs on {sorted(_modules[name].devices())})"
        )
    if op not in _ops.kernels(name) and op not in _ops.FUSED:
        raise BackendUnavailable(f"backend {name!r} does not implement {op!r}")
    return name


def resolve(op: str, device_type: str, backend: str | None = None) -> Callable:
    """The kernel (schema arguments, see :mod:`gradcomp.kernels.ops`) of the
    backend :func:`backend_name` picks, to call directly.

    Raises:
        As :func:`backend_name`.
    """
    key = (op, device_type, _forced(backend))
    fn = _resolved.get(key)
    if fn is None:
        name = backend_name(op, device_type, backend)
        fn = _ops.kernels(name).get(op)
        if fn is None:
            compose = _reference.COMPOSITIONS.get(op)
            if compose is None:
                fn = _ops.kernels("reference")[op]
            else:
                parts = {o: resolve(o, device_type, name) for o in _ops.SCHEMAS if o not in _reference.COMPOSITIONS}
                fn = functools.partial(compose, parts)
        _resolved[key] = fn
    return fn


def auto_kernel(op: str, device_type: str) -> Callable:
    """The kernel the op's dispatcher entry runs for ``device_type`` tensors:
    the automatically chosen backend's (:func:`backend_name` without a forced
    name; the reference when none usable implements the op). Loads backends on
    first use; cached until :func:`reset`."""
    chosen = _auto_kernels.setdefault(device_type, {})
    fn = chosen.get(op)
    if fn is None:
        fn = chosen[op] = _ops.kernels(_auto(op, device_type))[op]
    return fn


def select(op: str, device_type: str, backend: str | None = None) -> Callable:
    """What the public function of ``op`` calls for tensors on ``device_type``:
    the op's dispatcher entry, ``torch.ops.gradcomp.<op>`` (automatic choice),
    or the forced backend's kernel (:func:`resolve`)."""
    if backend is None and not os.environ.get("GRADCOMP_BACKEND"):
        return _ops.op[op]
    return resolve(op, device_type, backend)


def _chooser(device_type: str) -> Callable[[str], Callable]:
    def choose(op: str) -> Callable:
        return auto_kernel(op, device_type)

    return choose


for _device_type, _key in DISPATCH_KEYS.items():
    _ops.register_router(_key, _auto_kernels[_device_type], _chooser(_device_type))
