"""What the kernel benchmark measures: its cases, their inputs and the backend calls timed.

A :class:`Case` is one (device, thread setting, op, size, dtype, density); its
inputs come from :func:`make_inputs` (seeded, outputs preallocated),
:func:`op_call` turns it into a zero-argument call and :func:`op_bytes` counts
the bytes that call reads and writes (for the effective bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradcomp.kernels.registry import OPS

#: ops of this benchmark: the registry's and ``dgc`` (a DGC step, see the package docstring)
BENCH_OPS = (*OPS, "dgc")
SPARSE_OPS = ("topk", "approx_topk", "threshold", "scatter_add_", "dgc")
TOPK_OPS = ("topk", "approx_topk")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DEFAULT_SIZES = (2**16, 2**20, 2**24)
QUICK_SIZES = (2**16, 2**20)


@dataclass
class Case:
    """One benchmark case; ``k`` is the selection size of the sparse ops (0 for the others)."""

    device: str
    threads: str
    op: str
    n: int
    dtype: str
    density: float | None = None

    @property
    def k(self) -> int:
        return max(1, round(self.density * self.n)) if self.density is not None else 0


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_inputs(case: Case, block: int, seed: int) -> dict:
    """The case's tensors on its device: input ``x`` (standard normal, ``seed``), int8
    codes ``q`` and float32 scales ``s`` (outputs, or the codes of ``x`` for the
    dequantize ops), and per op its state (``out``, ``acc``, ``res``, ``tau``, ...)."""
    dev = case.device
    dtype = DTYPES[case.dtype]
    g = torch.Generator().manual_seed(seed)
    n = case.n
    x = torch.randn(n, generator=g).to(dtype).to(dev)
    d: dict = {"x": x}
    nb = -(-n // block)
    d["q"] = torch.empty(n, dtype=torch.int8, device=dev)
    d["s"] = torch.empty(nb, dtype=torch.float32, device=dev)
    if case.op in ("dequantize_int8", "dequantize_int8_add_"):
        from gradcomp.kernels import reference as R

        q, s = R.quantize_int8(x.float(), block)
        d["q"], d["s"] = q, s
        d["out"] = torch.empty(n, dtype=dtype, device=dev)
        d["acc"] = torch.zeros(n, dtype=torch.float32, device=dev)
    if case.op == "quantize_int8_ef":
        d["res"] = (torch.randn(n, generator=g) * 0.01).to(dev)
    if case.op == "threshold":
        a = x.abs().to(torch.float64 if dtype == torch.float64 else torch.float32)
        d["tau"] = float(torch.topk(a, case.k).values[-1])
    if case.op == "dgc":
        d["u"] = torch.zeros(n, dtype=torch.float32, device=dev)
        d["v"] = torch.zeros(n, dtype=torch.float32, device=dev)
        d["r"] = torch.zeros(n, dtype=torch.float32, device=dev)
    if case.op == "scatter_add_":
        idx = torch.randperm(n, generator=g)[: case.k].sort().values.to(torch.int32)
        d["idx"] = idx.to(dev)
        d["vals"] = torch.randn(case.k, generator=g).to(dtype).to(dev)
        d["acc"] = torch.zeros(n, dtype=torch.float32, device=dev)
    return d


def op_call(case: Case, fn_for: Callable[[str], Callable], d: dict, block: int, rounding: str):
    """A zero-argument call of ``case.op`` through ``fn_for(op)`` (reference signature)."""
    op, k = case.op, case.k
    f = fn_for(op)
    if op == "quantize_int8":
        return lambda: f(d["x"], block, rounding, 0, 0, d["q"], d["s"])
    if op == "dequantize_int8":
        return lambda: f(d["q"], d["s"], block, d["out"])
    if op == "dequantize_int8_add_":
        return lambda: f(d["acc"], d["q"], d["s"], block)
    if op == "quantize_int8_ef":
        return lambda: f(d["x"], d["res"], block, rounding, 0, 0, d["q"], d["s"])
    if op in TOPK_OPS:
        return lambda: f(d["x"], k)
    if op == "threshold":
        return lambda: f(d["x"], d["tau"])
    if op == "scatter_add_":
        return lambda: f(d["acc"], d["idx"], d["vals"])
    if op == "dgc":
        return lambda: f(d["x"], d["u"], d["v"], k)
    raise ValueError(f"unknown op {op!r}")


def op_bytes(case: Case, block: int, result) -> int:
    """Bytes the op reads + writes (outputs of selections from the result)."""
    n, isz = case.n, itemsize(DTYPES[case.dtype])
    nb = -(-n // block)
    op = case.op
    if op == "quantize_int8":
        return n * isz + n + 4 * nb
    if op == "dequantize_int8":
        return n + 4 * nb + n * isz
    if op == "dequantize_int8_add_":
        return n + 4 * nb + 8 * n
    if op == "quantize_int8_ef":
        return n * isz + 8 * n + n + 4 * nb
    if op == "dgc":  # g, u, v read, u, v written: a fused step's floor (unfused, v is read again)
        idx, val = result
        return 20 * n + idx.numel() * (idx.element_size() + val.element_size())
    if op in ("topk", "approx_topk", "threshold"):
        idx, val = result
        return n * isz + idx.numel() * (idx.element_size() + val.element_size())
    if op == "scatter_add_":
        m = case.k
        return m * (4 + isz) + 8 * m
    raise ValueError(op)


def backends_for(op: str, device: str) -> list[str]:
    """The registry backends usable here that run ``op`` on ``device`` (``dgc``: its top-k's)."""
    from gradcomp.errors import BackendUnavailable
    from gradcomp.kernels import registry

    names = []
    for name, reason in registry.available_backends().items():
        if reason is not None:
            continue
        try:
            registry.resolve("topk" if op == "dgc" else op, device, name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def backend_call(case: Case, backend: str, d: dict, block: int, rounding: str):
    """A zero-argument call of ``case.op`` on ``backend`` through the public wrappers."""
    from gradcomp import kernels as K

    def fn_for(op):
        return lambda *a: _public(K, op, backend, *a)

    return op_call(case, fn_for, d, block, rounding)


def _dgc_step(K, backend: str, g, u, v, k: int):
    """The kernel work of one DGC step (:meth:`gradcomp.DGC.step_` without the payload)."""
    idx, vals = K.dgc_topk_(g, u, v, 0.9, 1.0, k, backend=backend)
    sent = idx.long()
    v.index_fill_(0, sent, 0.0)
    u.index_fill_(0, sent, 0.0)
    return idx, vals


def _public(K, op: str, backend: str, *a):
    """Call op through the public wrapper with the reference's positional arguments."""
    if op == "dgc":
        return _dgc_step(K, backend, *a)
    if op == "quantize_int8":
        x, bs, rnd, seed, ctr, q, s = a
        return K.quantize_int8(x, bs, rnd, seed, ctr, out_q=q, out_scales=s, backend=backend)
    if op == "quantize_int8_ef":
        x, res, bs, rnd, seed, ctr, q, s = a
        return K.quantize_int8_ef(x, res, bs, rnd, seed, ctr, out_q=q, out_scales=s, backend=backend)
    if op == "dequantize_int8":
        q, s, bs, out = a
        return K.dequantize_int8(q, s, bs, out=out, backend=backend)
    return getattr(K, op)(*a, backend=backend)
