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

__all__ = [
    "LOWBIT_OPS", "FLOAT32_ONLY", "BENCH_OPS", "PACKED_BITS", "SPARSE_OPS", "TOPK_OPS", "DTYPES",
    "DEFAULT_SIZES", "QUICK_SIZES", "Case", "itemsize", "make_inputs", "op_call", "op_bytes",
    "backends_for", "backend_call",
]

#: ops of the sub-byte and fp8 codecs: the packed ones run at 4 bits (``quantize_packed_2bit``:
#: the quantizer at 2 bits), the fp8 ones in e4m3; their outputs are float32 (``FLOAT32_ONLY``)
LOWBIT_OPS = ("quantize_packed", "quantize_packed_2bit", "quantize_packed_ef", "dequantize_packed",
              "dequantize_packed_add_", "quantize_sign", "quantize_sign_ef", "dequantize_sign",
              "dequantize_sign_add_", "quantize_fp8", "quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_")
#: ops whose accumulator or output is float32 whatever the input dtype: timed in float32 only
FLOAT32_ONLY = ("dequantize_int8_add_", "dgc", "dequantize_packed", "dequantize_packed_add_", "dequantize_sign",
                "dequantize_sign_add_", "dequantize_fp8", "dequantize_fp8_add_")
#: ops of this benchmark: the registry's, the 2-bit quantizer and ``dgc`` (a DGC step, see the
#: package docstring)
BENCH_OPS = (*OPS[:OPS.index("quantize_packed") + 1], "quantize_packed_2bit",
             *OPS[OPS.index("quantize_packed") + 1:], "dgc")
#: bits of the packed codes per op (4 unless named)
PACKED_BITS = {"quantize_packed_2bit": 2}
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
    if case.op in ("quantize_int8_ef", "quantize_packed_ef", "quantize_sign_ef", "quantize_fp8_ef"):
        d["res"] = (torch.randn(n, generator=g) * 0.01).to(dev)
    if case.op in LOWBIT_OPS:
        d.update(_lowbit_inputs(case.op, x, block))
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


def _lowbit_inputs(op: str, x: torch.Tensor, block: int) -> dict:
    """Codes of ``x`` in the op's codec (``codes``, ``s``; uint8 / float32), the float32 ``out``
    and ``acc`` of its decoders."""
    from gradcomp.kernels import reference_lowbit as L

    n, xf = x.numel(), x.float().cpu()
    if "packed" in op:
        codes, s = L.quantize_packed(xf, PACKED_BITS.get(op, 4), block, False, 0)
    elif "sign" in op:
        codes, s = L.quantize_sign(xf, block)
    else:
        codes, s = L.quantize_fp8(xf, "e4m3", block)
    zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
    return {"codes": codes.to(x.device), "s": s.to(x.device), "out": torch.empty_like(zeros), "acc": zeros}


def _lowbit_call(op: str, f: Callable, d: dict, block: int, rounding: str):
    """A zero-argument call of a sub-byte / fp8 op through ``f`` (the public function's
    positional arguments, outputs last)."""
    x, codes, s, n = d["x"], d["codes"], d["s"], d["x"].numel()
    bits = PACKED_BITS.get(op, 4)
    calls = {
        "quantize_packed": lambda: f(x, bits, block, rounding, 0, 0, codes, s),
        "quantize_packed_ef": lambda: f(x, d["res"], bits, block, rounding, 0, 0, codes, s),
        "dequantize_packed": lambda: f(codes, s, n, bits, block, d["out"]),
        "dequantize_packed_add_": lambda: f(d["acc"], codes, s, bits, block),
        "quantize_sign": lambda: f(x, block, codes, s),
        "quantize_sign_ef": lambda: f(x, d["res"], block, codes, s),
        "dequantize_sign": lambda: f(codes, s, n, block, d["out"]),
        "dequantize_sign_add_": lambda: f(d["acc"], codes, s, block),
        "quantize_fp8": lambda: f(x, "e4m3", block, codes, s),
        "quantize_fp8_ef": lambda: f(x, d["res"], "e4m3", block, codes, s),
        "dequantize_fp8": lambda: f(codes, s, "e4m3", block, d["out"]),
        "dequantize_fp8_add_": lambda: f(d["acc"], codes, s, "e4m3", block),
    }
    return calls["quantize_packed" if op == "quantize_packed_2bit" else op]


def op_call(case: Case, fn_for: Callable[[str], Callable], d: dict, block: int, rounding: str):
    """A zero-argument call of ``case.op`` through ``fn_for(op)`` (reference signature)."""
    op, k = case.op, case.k
    f = fn_for(op)
    if op in LOWBIT_OPS:
        return _lowbit_call(op, f, d, block, rounding)
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
    if op in LOWBIT_OPS:
        return _lowbit_bytes(op, n, isz, nb)
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


def _lowbit_bytes(op: str, n: int, isz: int, nb: int) -> int:
    """Bytes a sub-byte / fp8 op reads + writes: input, codes, scales (and residual, out, acc)."""
    codes = -(-n * PACKED_BITS.get(op, 4) // 8) if "packed" in op else (-(-n // 8) if "sign" in op else n)
    if op.startswith("quantize"):
        return n * isz + codes + 4 * nb + (8 * n if op.endswith("_ef") else 0)
    return codes + 4 * nb + (8 * n if op.endswith("_add_") else 4 * n)


def backends_for(op: str, device: str) -> list[str]:
    """The registry backends usable here that run ``op`` on ``device`` (``dgc``: its top-k's)."""
    from gradcomp.errors import BackendUnavailable
    from gradcomp.kernels import registry

    names = []
    for name, reason in registry.available_backends().items():
        if reason is not None:
            continue
        try:
            registry.resolve({"dgc": "topk", "quantize_packed_2bit": "quantize_packed"}.get(op, op), device, name)
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
    if op in LOWBIT_OPS:
        return _public_lowbit(K, op, backend, *a)
    return getattr(K, op)(*a, backend=backend)


def _public_lowbit(K, op: str, backend: str, *a):
    """A sub-byte / fp8 op through its public function: the outputs of :func:`_lowbit_call`'s
    arguments go by keyword (``out_codes`` / ``out_scales``, ``out``)."""
    name = "quantize_packed" if op == "quantize_packed_2bit" else op
    fn = getattr(K, name)
    if name.startswith("quantize"):
        *args, codes, s = a
        return fn(*args, out_codes=codes, out_scales=s, backend=backend)
    if name in ("dequantize_packed", "dequantize_sign", "dequantize_fp8"):
        *args, out = a
        return fn(*args, out=out, backend=backend)
    return fn(*a, backend=backend)
