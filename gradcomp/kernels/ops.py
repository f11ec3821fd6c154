"""The kernel ops as ``torch.library`` custom ops: one schema each, in one place.

Every op of :mod:`gradcomp.kernels` is declared here once, in the ``gradcomp``
namespace (``torch.ops.gradcomp.<op>``), with a fake (meta) implementation so
that it traces under ``torch.compile`` and runs on meta tensors. Outputs are
preallocated by the caller and passed as mutable arguments (``Tensor(a!)``);
only the selections, whose size the data decides, return new tensors.

A backend is one file that implements some of the ops with exactly the schema's
arguments and marks each with :func:`kernel`. The reference
(``reference_backend.py``) is registered as the default kernel of every op
(``CompositeExplicitAutograd``: any device); under each device key (``CPU``,
``CUDA``) :mod:`gradcomp.kernels.registry` registers the kernel of the backend
it chooses for that device, per op (:func:`register_router`). A kernel
whose parameters differ from its schema is refused when it is declared
(TypeError), so backends cannot drift apart.

Arguments common to several ops: ``stochastic`` (rounding: False is round
half to even, True is stochastic rounding with the 32-bit stream key ``key``
of :func:`gradcomp.kernels.reference.stream_key`), ``check_int8`` (raise
:class:`~gradcomp.PayloadError` on codes of -128 or negative / infinite
scales), ``q`` / ``scales`` (int8 codes, float32 absmax scales per block).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

__all__ = ["SCHEMAS", "OPS", "FUSED", "op", "kernel", "kernels", "register_router"]

#: op name -> schema (arguments and returns); the fused ops come last
SCHEMAS: dict[str, str] = {
    "quantize_int8": "(Tensor x, int block_size, bool stochastic, int key, Tensor(a!) q, Tensor(b!) scales) -> ()",
    "dequantize_int8": "(Tensor q, Tensor scales, int block_size, bool check_int8, Tensor(a!) out) -> ()",
    "dequantize_int8_add_": "(Tensor(a!) acc, Tensor q, Tensor scales, int block_size, bool check_int8) -> ()",
    "quantize_int8_ef": ("(Tensor x, Tensor(a!) residual, int block_size, bool stochastic, int key, "
                         "Tensor(b!) q, Tensor(c!) scales) -> ()"),
    "topk": "(Tensor x, int k) -> (Tensor indices, Tensor values)",
    "threshold": "(Tensor x, float tau) -> (Tensor indices, Tensor values)",
    "approx_topk": "(Tensor x, int k) -> (Tensor indices, Tensor values)",
    "scatter_add_": "(Tensor(a!) acc, Tensor indices, Tensor values) -> ()",
    "reduce_quantize_int8": ("(Tensor(a!) acc, Tensor q, Tensor scales, int block_size, int divisor, "
                             "bool stochastic, int key, bool decode, bool check_int8, "
                             "Tensor(b!) out_q, Tensor(c!) out_scales) -> ()"),
    "dgc_accumulate_": "(Tensor g, Tensor(a!) u, Tensor(b!) v, float momentum, float scale) -> ()",
    "dgc_topk_": ("(Tensor g, Tensor(a!) u, Tensor(b!) v, float momentum, float scale, int k) "
                  "-> (Tensor indices, Tensor values)"),
    # the sub-byte and fp8 block codecs (reference_lowbit.py): codes are uint8 (packed for
    # int4/int2/sign); the element count is x's, out's or acc's
    "quantize_packed": ("(Tensor x, int bits, int block_size, bool stochastic, int key, Tensor(a!) codes, "
                        "Tensor(b!) scales) -> ()"),
    "quantize_packed_ef": ("(Tensor x, Tensor(a!) residual, int bits, int block_size, bool stochastic, int key, "
                           "Tensor(b!) codes, Tensor(c!) scales) -> ()"),
    "dequantize_packed": "(Tensor codes, Tensor scales, int bits, int block_size, Tensor(a!) out) -> ()",
    "dequantize_packed_add_": "(Tensor(a!) acc, Tensor codes, Tensor scales, int bits, int block_size) -> ()",
    "quantize_sign": "(Tensor x, int block_size, Tensor(a!) codes, Tensor(b!) scales) -> ()",
    "quantize_sign_ef": ("(Tensor x, Tensor(a!) residual, int block_size, Tensor(b!) codes, "
                         "Tensor(c!) scales) -> ()"),
    "dequantize_sign": "(Tensor codes, Tensor scales, int block_size, Tensor(a!) out) -> ()",
    "dequantize_sign_add_": "(Tensor(a!) acc, Tensor codes, Tensor scales, int block_size) -> ()",
    "quantize_fp8": "(Tensor x, str fmt, int block_size, Tensor(a!) codes, Tensor(b!) scales) -> ()",
    "quantize_fp8_ef": ("(Tensor x, Tensor(a!) residual, str fmt, int block_size, Tensor(b!) codes, "
                        "Tensor(c!) scales) -> ()"),
    "dequantize_fp8": "(Tensor codes, Tensor scales, str fmt, int block_size, Tensor(a!) out) -> ()",
    "dequantize_fp8_add_": "(Tensor(a!) acc, Tensor codes, Tensor scales, str fmt, int block_size) -> ()",
    "reduce_quantize_packed": ("(Tensor(a!) acc, Tensor codes, Tensor scales, int bits, int block_size, "
                               "int divisor, bool stochastic, int key, bool decode, Tensor(b!) out_codes, "
                               "Tensor(c!) out_scales) -> ()"),
}
#: ops a backend may leave out: their default kernel composes the other ops
#: through the dispatcher (the reduce_quantize ops, dgc_topk_) or is plain torch
#: (dgc_accumulate_); the native CPU backend fuses each into one pass
FUSED = ("reduce_quantize_int8", "dgc_accumulate_", "dgc_topk_", "reduce_quantize_packed")
#: the ops every backend implements
OPS = tuple(name for name in SCHEMAS if name not in FUSED)

_LIB = torch.library.Library("gradcomp", "DEF")  # the ops live as long as the process
#: op name -> its OpOverload, ``torch.ops.gradcomp.<op>.default``
op: dict[str, torch._ops.OpOverload] = {}
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)
    op[_name] = getattr(torch.ops.gradcomp, _name).default

_kernels: dict[str, dict[str, Callable]] = {}


def kernel(backend: str, name: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` implements op ``name`` (default: ``fn.__name__``) in ``backend``.

    The reference backend's kernels become the ops' default kernels.

    Raises:
        ValueError: unknown op. TypeError: ``fn``'s parameters are not the schema's.
    """

    def declare(fn: Callable) -> Callable:
        opname = name or fn.__name__
        if opname not in SCHEMAS:
            raise ValueError(f"op must be one of {tuple(SCHEMAS)}, got {opname!r}")
        want = tuple(a.name for a in op[opname]._schema.arguments)
        got = tuple(inspect.signature(fn).parameters)
        if got != want:
            raise TypeError(f"{backend} kernel {opname} takes {got}; the schema's arguments are {want}")
        _kernels.setdefault(backend, {})[opname] = fn
        if backend == "reference":
            _LIB.impl(opname, fn, "CompositeExplicitAutograd")
        return fn

    return declare


def kernels(backend: str) -> dict[str, Callable]:
    """``{op: kernel}`` declared so far by ``backend`` (after its module is imported)."""
    return dict(_kernels.get(backend, {}))


def register_router(dispatch_key: str, chosen: dict[str, Callable], choose: Callable[[str], Callable]) -> None:
    """Register under ``dispatch_key`` (``"CPU"``, ``"CUDA"``), for every op,
    a kernel that runs the kernel of the backend chosen for that device:
    ``chosen[op]``, else ``choose(op)`` (which loads backends on first use and
    fills ``chosen``)."""
    for name in SCHEMAS:
        _LIB.impl(name, _router(name, chosen, choose), dispatch_key)


def _router(name: str, chosen: dict[str, Callable], choose: Callable[[str], Callable]) -> Callable:
    def run(*args):
        fn = chosen.get(name)
        return (fn or choose(name))(*args)

    run.__name__ = run.__qualname__ = name
    return run


# ------------------------------------------------------------------ fake kernels
# (the outputs' metadata only; an op returning nothing needs none beyond its schema)


def _index_dtype(n) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _selection(x: torch.Tensor, size):
    return x.new_empty(size, dtype=_index_dtype(x.numel())), x.new_empty(size)


def _dynamic_selection(x: torch.Tensor):
    n = x.numel()
    size = torch.library.get_ctx().new_dynamic_size(max=n if isinstance(n, int) else None)
    return _selection(x, size)


def _nothing(*args) -> None:
    return None


for _name, _schema in SCHEMAS.items():  # ops that only write their mutable arguments
    if _schema.endswith("-> ()"):
        torch.library.register_fake("gradcomp::" + _name, _nothing, lib=_LIB)
torch.library.register_fake("gradcomp::topk", lambda x, k: _selection(x, min(k, x.numel())), lib=_LIB)
torch.library.register_fake("gradcomp::dgc_topk_",
                            lambda g, u, v, momentum, scale, k: _selection(v, min(k, v.numel())), lib=_LIB)
torch.library.register_fake("gradcomp::threshold", lambda x, tau: _dynamic_selection(x), lib=_LIB)
torch.library.register_fake("gradcomp::approx_topk", lambda x, k: _dynamic_selection(x), lib=_LIB)
