"""Kernel microbenchmark: every backend usable here against common baselines.

Usage::

    gradcomp bench kernels [--sizes 2**16,2**20,2**24] [--size N] [--dtypes float32,bfloat16]
                           [--ops quantize_int8,topk,...] [--threads 1,all] [--repeat 7]
                           [--densities 0.01,0.001] [--out DIR] [--quick]
    python benchmarks/kernels.py ...

For each device (CPU; CUDA too when a GPU is present), thread setting, op,
size ``n`` (elements), dtype and, for the sparse ops, density (k / n), it
times every backend that runs the op on that device (``cpu``, ``reference``,
``triton``, ``cuda``; see :func:`gradcomp.kernels.available_backends`) and
these baselines, all in the same run and interleaved round by round (so a
load change on the machine hits every candidate alike):

* ``copy``: ``numpy.copyto`` of the n-element input (n * itemsize bytes;
  ``Tensor.copy_`` on CUDA): read + written bytes per second is the
  memory-bandwidth ceiling (numpy copies with one thread);
* ``reference``: the pure-PyTorch reference (:mod:`gradcomp.kernels.reference`);
* ``compiled``: the same reference under ``torch.compile`` (``--compile-ops``,
  by default the quantize / dequantize ops, with one thread only: inductor
  fixes the thread count when it compiles; skipped with a note on failure);
* ``torch.topk``: ``torch.topk(x.abs(), k)`` for ``topk`` and ``approx_topk``;
* ``bitsandbytes``: ``quantize_blockwise`` / ``dequantize_blockwise`` (its
  8-bit dynamic blockwise code, same block size) when bitsandbytes imports.

Besides the registry's ops, ``dgc`` times one Deep Gradient Compression step
per backend (:class:`gradcomp.DGC`'s kernel work on float32: the
momentum-correction pass ``u = m u + g; v += u`` with the exact top-k of ``v``,
fused by the native backend (``kernels.dgc_topk_``), and the masking of the
sent coordinates in ``u`` and ``v``) against two
baselines on the automatically chosen backend: ``topk`` (the plain top-k
kernel on the gradient) and ``topk+ef`` (the best plain error-feedback top-k
a user would write: ``r += g``, top-k of ``r``, ``r[sent] = 0``); ``/topk`` and
``/topk+ef`` are its time over theirs.

Outputs are preallocated where the op accepts them (``out_q``/``out_scales``,
``out``) for backends and reference alike. Reported per row: median, p10 and
p90 seconds over the rounds, effective bandwidth (bytes read + written by the
op / median time, GB/s = 1e9 bytes/s), and per backend the ratios against the
baselines (``x ref`` = reference time / backend time, etc.; ``%copy`` =
bandwidth / copy bandwidth; for ``quantize_int8_ef``, ``ef/q`` = its time over
the same backend's plain ``quantize_int8``). The table is printed as plain
text within 100 columns, one heading line per case, and everything is written to ``DIR/kernels.json`` together with the
machine, versions, the command line and the targets check.

Threads: ``1`` runs with ``torch.set_num_threads(1)`` and one native thread
(``gradcomp.kernels.cpu.set_num_threads``); ``all`` with every core for both.

The default (three sizes up to 2**24, float32, all ops, 1 and all threads)
takes a few minutes on two cores, plus the first ``torch.compile`` (cached on
disk afterwards); ``--quick`` runs sizes 2**16 and 2**20 with fewer rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from gradcomp.kernels.registry import OPS

__all__ = ["main", "build_parser", "parse_size", "TARGETS"]

#: ops of this benchmark: the registry's and ``dgc`` (a DGC step, see above)
BENCH_OPS = (*OPS, "dgc")
SPARSE_OPS = ("topk", "approx_topk", "threshold", "scatter_add_", "dgc")
TOPK_OPS = ("topk", "approx_topk")
DEFAULT_COMPILE_OPS = ("quantize_int8", "dequantize_int8")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DEFAULT_SIZES = (2**16, 2**20, 2**24)
QUICK_SIZES = (2**16, 2**20)
TARGET_SIZE = 2**24

#: (op, density, metric, comparison, bound): checked on the CPU backend, float32,
#: one thread, n = 2**24 (or the largest size measured).
TARGETS = (
    ("quantize_int8", None, "vs_copy_bw", ">=", 0.60),
    ("quantize_int8", None, "speedup_vs_reference", ">=", 5.0),
    ("quantize_int8", None, "speedup_vs_compiled", ">=", 2.0),
    ("quantize_int8", None, "speedup_vs_bitsandbytes", ">=", 3.0),
    ("dequantize_int8", None, "vs_copy_bw", ">=", 0.60),
    ("dequantize_int8", None, "speedup_vs_reference", ">=", 5.0),
    ("dequantize_int8", None, "speedup_vs_compiled", ">=", 2.0),
    ("dequantize_int8", None, "speedup_vs_bitsandbytes", ">=", 3.0),
    ("quantize_int8_ef", None, "time_vs_quantize", "<=", 1.5),
    ("topk", 0.01, "speedup_vs_torch_topk", ">=", 10.0),
    ("topk", 0.001, "speedup_vs_torch_topk", ">=", 10.0),
    ("approx_topk", 0.01, "speedup_vs_torch_topk", ">=", 20.0),
    ("approx_topk", 0.001, "speedup_vs_torch_topk", ">=", 20.0),
    ("threshold", 0.01, "vs_copy_bw", ">=", 0.40),
    ("threshold", 0.001, "vs_copy_bw", ">=", 0.40),
    ("dgc", 0.001, "time_vs_topk", "<=", 1.5),
    ("dgc", 0.01, "time_vs_topk", "<=", 1.5),
)


# ---------------------------------------------------------------------------
# command line


def parse_size(text: str) -> int:
    """An element count: ``1048576``, ``2**20``, ``2^20``, ``1e6``, ``64K``, ``16M``."""
    t = text.strip().replace("_", "")
    v = None
    for sep in ("**", "^"):
        if sep in t:
            base, exp = (int(s) for s in t.split(sep, 1))
            if not (0 <= exp <= 62 and 0 <= base and (base - 1).bit_length() * exp <= 62):  # no huge int
                raise ValueError(f"not an element count: {text!r}")
            v = base ** exp
            break
    if v is None:
        mult = {"k": 2**10, "m": 2**20, "g": 2**30}.get(t[-1:].lower())
        f = float(t[:-1]) * mult if mult else float(t)
        if not math.isfinite(f) or f != int(f):
            raise ValueError(f"not an element count: {text!r}")
        v = int(f)
    if not 1 <= v <= 2**62:
        raise ValueError(f"not an element count (>= 1): {text!r}")
    return v


SIZE_FORMS = "an integer >= 1: 1048576, 2**20, 2^20, 1e6, 64K, 16M or 1G (at most 2**62)"


def _size_arg(text: str) -> int:
    """:func:`parse_size` for argparse: a wrong size says which forms are allowed."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {SIZE_FORMS}, got {text!r}") from None


def _list(text: str, conv=str) -> list:
    return [conv(s) for s in text.split(",") if s.strip()]


def build_parser(prog: str = "gradcomp bench kernels") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Time the compression kernels of every backend usable here against "
                    "memory copy, the PyTorch reference (eager and torch.compile), torch.topk "
                    "and bitsandbytes; print a table and write JSON.",
    )
    p.add_argument("--size", type=_size_arg, default=None,
                   help="a single size in elements (overrides --sizes)")
    p.add_argument("--sizes", type=lambda s: _list(s, _size_arg), default=None,
                   help="comma-separated sizes in elements, e.g. 2**16,2**20,2**24 "
                        "(default: 2**16,2**20,2**24; with --quick: 2**16,2**20)")
    p.add_argument("--dtypes", type=_list, default="float32",
                   help=f"comma-separated input dtypes from {', '.join(DTYPES)} (default: float32)")
    p.add_argument("--ops", type=_list, default=",".join(BENCH_OPS),
                   help="comma-separated ops (default: all)")
    p.add_argument("--threads", type=_list, default="1,all",
                   help="comma-separated thread settings, a number or 'all' (default: 1,all)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed rounds per case (default: 7; with --quick: 3); a case stops "
                        "early once 3 rounds are done and --budget seconds have passed")
    p.add_argument("--budget", type=float, default=2.0,
                   help="seconds per case after which no new round starts once 3 rounds are "
                        "done (default: 2)")
    p.add_argument("--densities", type=lambda s: _list(s, float), default="0.01,0.001",
                   help="k / n for topk, approx_topk, threshold and scatter_add_ (default: 0.01,0.001)")
    p.add_argument("--block-size", type=int, default=256, help="quantization block size (default: 256)")
    p.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                   help="rounding of the quantize ops (default: nearest)")
    p.add_argument("--compile-ops", type=_list, default=",".join(DEFAULT_COMPILE_OPS),
                   help="ops whose reference is also timed under torch.compile, 'all' or 'none' "
                        f"(default: {','.join(DEFAULT_COMPILE_OPS)})")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--devices", type=_list, default=None,
                   help="cpu and/or cuda (default: cpu, and cuda when a GPU is present)")
    p.add_argument("--out", default="bench-results",
                   help="directory for kernels.json (default: bench-results)")
    p.add_argument("--quick", action="store_true", help="sizes 2**16 and 2**20, 3 rounds")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    return p


# ---------------------------------------------------------------------------
# cases, inputs and the functions timed


@dataclass
class Case:
    device: str
    threads: str
    op: str
    n: int
    dtype: str
    density: float | None = None

    @property
    def k(self) -> int:
        return max(1, round(self.density * self.n)) if self.density is not None else 0


@dataclass
class Timed:
    fn: Callable[[], object]
    kind: str  # "backend" | "baseline"
    bytes: int | None = None  # bytes read + written (None: computed after a call)
    note: str = ""
    times: list[float] = field(default_factory=list)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _inputs(case: Case, block: int, seed: int) -> dict:
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


def _op_call(case: Case, fn_for: Callable[[str], Callable], d: dict, block: int, rounding: str):
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


def _op_bytes(case: Case, block: int, result) -> int:
    """Bytes the op reads + writes (outputs of selections from the result)."""
    n, isz = case.n, _itemsize(DTYPES[case.dtype])
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
    if op == "dgc":  # g, u, v read; u, v written; v read by the selection
        idx, val = result
        return 24 * n + idx.numel() * (idx.element_size() + val.element_size())
    if op in ("topk", "approx_topk", "threshold"):
        idx, val = result
        return n * isz + idx.numel() * (idx.element_size() + val.element_size())
    if op == "scatter_add_":
        m = case.k
        return m * (4 + isz) + 8 * m
    raise ValueError(op)


def _baselines(case: Case, d: dict, block: int, rounding: str, compiled: dict, notes: list) -> dict:
    out: dict[str, Timed] = {}
    dtype = DTYPES[case.dtype]
    n, isz = case.n, _itemsize(dtype)
    if case.device == "cpu":
        src = d["x"].view(torch.uint8).numpy() if n else np.empty(0, np.uint8)
        dst = np.empty_like(src)
        out["copy"] = Timed(lambda: np.copyto(dst, src), "baseline", 2 * n * isz)
    else:
        xs = d["x"]
        xd = torch.empty_like(xs)
        out["copy"] = Timed(lambda: xd.copy_(xs), "baseline", 2 * n * isz)
    if case.op in compiled and compiled[case.op] is not None:
        out["compiled"] = Timed(_op_call(case, lambda op: compiled[op], d, block, rounding), "baseline")
    if case.op in TOPK_OPS:
        x, k = d["x"], case.k
        try:
            torch.topk(x[:16].abs(), 1)
            out["torch.topk"] = Timed(lambda: torch.topk(x.abs(), k), "baseline")
        except RuntimeError as e:  # e.g. a dtype topk does not support here
            notes.append(f"torch.topk skipped for {case.dtype}: {e}")
    if case.op == "dgc":
        from gradcomp import kernels as K

        x, r, k = d["x"], d["r"], case.k
        out["topk"] = Timed(lambda: K.topk(x, k), "baseline")

        def topk_ef():
            r.add_(x)
            idx, vals = K.topk(r, k)
            r.index_fill_(0, idx.long(), 0.0)
            return idx, vals

        out["topk+ef"] = Timed(topk_ef, "baseline")
    if case.op in ("quantize_int8", "dequantize_int8") and dtype != torch.float64:
        bnb = _bitsandbytes()
        if bnb is not None:
            x = d["x"]
            if case.op == "quantize_int8":
                out["bitsandbytes"] = Timed(lambda: bnb.quantize_blockwise(x, blocksize=block), "baseline",
                                            n * isz + n + 4 * (-(-n // block)))
            else:
                qb, st = bnb.quantize_blockwise(x, blocksize=block)
                out["bitsandbytes"] = Timed(lambda: bnb.dequantize_blockwise(qb, st), "baseline",
                                            n + 4 * (-(-n // block)) + n * isz)
    return out


_BNB: list = []


def _bitsandbytes():
    """bitsandbytes.functional when it imports and its quantize_blockwise runs here, else None."""
    if not _BNB:
        try:
            import bitsandbytes.functional as F

            F.quantize_blockwise(torch.randn(512), blocksize=256)
            _BNB.append(F)
        except Exception as e:  # not installed, or no kernel for this machine
            _BNB.append(None)
            _BNB.append(f"{type(e).__name__}: {e}")
    return _BNB[0]


# ---------------------------------------------------------------------------
# timing


def _sync(device: str) -> Callable[[], None]:
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _measure(timed: dict[str, Timed], repeat: int, budget: float, sync) -> None:
    """Interleaved rounds: each round times every function once."""
    start = time.perf_counter()
    for r in range(repeat):
        for t in timed.values():
            t0 = time.perf_counter()
            t.fn()
            sync()
            t.times.append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget:
            break


def _stats(times: list[float]) -> dict:
    a = np.asarray(times)
    return {
        "median_s": float(np.median(a)),
        "p10_s": float(np.percentile(a, 10)),
        "p90_s": float(np.percentile(a, 90)),
        "rounds": len(times),
    }


# ---------------------------------------------------------------------------
# threads


def _all_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _set_threads(setting: str) -> int:
    t = _all_threads() if setting == "all" else int(setting)
    torch.set_num_threads(t)
    try:
        from gradcomp.kernels import cpu

        if cpu.unavailable_reason() is None:
            cpu.set_num_threads(t)
    except ImportError:
        pass
    return t


# ---------------------------------------------------------------------------
# the run


def _backends_for(op: str, device: str) -> list[str]:
    from gradcomp.errors import BackendUnavailable
    from gradcomp.kernels import registry

    names = []
    for name, reason in registry.available_backends().items():
        if reason is not None:
            continue
        try:
            registry.resolve("topk" if op == "dgc" else op, device, name)  # dgc: its selection's backend
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def _compile_reference(ops: list[str], notes: list) -> dict:
    from gradcomp.kernels import reference as R

    compiled = {}
    for op in ops:
        try:
            compiled[op] = torch.compile(getattr(R, op), dynamic=True)
        except Exception as e:  # torch.compile unavailable here
            compiled[op] = None
            notes.append(f"torch.compile({op}) failed: {type(e).__name__}: {e}")
    return compiled


def _warm(case: Case, timed: dict[str, Timed], block: int, notes: list) -> None:
    """One untimed call each (compiles the compiled baseline); selection byte
    counts come from the result. A failing function is dropped with a note."""
    for name in list(timed):
        t = timed[name]
        t0 = time.perf_counter()
        try:
            result = t.fn()
        except Exception as e:
            notes.append(f"{case.op} n={case.n} {case.dtype} threads={case.threads}: {name} failed: "
                         f"{type(e).__name__}: {e}")
            del timed[name]
            continue
        dt = time.perf_counter() - t0
        if name == "compiled" and dt > 1.0:
            notes.append(f"torch.compile of the {case.op} reference took {dt:.1f} s (first call)")
        if t.bytes is None:
            if t.kind == "backend" or name == "compiled":
                t.bytes = _op_bytes(case, block, result)


def run(args) -> dict:
    from gradcomp import kernels as K
    from gradcomp.kernels import registry

    quick = args.quick
    sizes = [args.size] if args.size is not None else (args.sizes or list(QUICK_SIZES if quick else DEFAULT_SIZES))
    repeat = args.repeat or (3 if quick else 7)
    for dt in args.dtypes:
        if dt not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {dt!r} (choose from {', '.join(DTYPES)})")
    for op in args.ops:
        if op not in BENCH_OPS:
            raise SystemExit(f"--ops: unknown op {op!r} (choose from {', '.join(BENCH_OPS)})")
    compile_ops = [] if args.no_compile else (
        list(OPS) if args.compile_ops == ["all"] else [o for o in args.compile_ops if o != "none"])
    devices = args.devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    notes: list[str] = []
    rows: list[dict] = []
    threads_before = torch.get_num_threads()
    backends = K.available_backends()
    bnb = _bitsandbytes()
    if bnb is None and len(_BNB) > 1:
        notes.append(f"bitsandbytes baseline skipped: {_BNB[1]}")
    try:
        for device in devices:
            sync = _sync(device)
            for setting in args.threads:
                nthreads = _set_threads(setting)
                # inductor fixes the thread count when it compiles: compiled baseline with one thread only
                use_compile = [o for o in compile_ops if nthreads == 1 or device != "cpu"]
                if device == "cpu" and compile_ops and nthreads != 1:
                    notes.append(f"torch.compile baseline not run with threads={setting} (compiled for one thread)")
                compiled = _compile_reference(use_compile, notes) if use_compile else {}
                for op in args.ops:
                    op_backends = _backends_for(op, device)
                    for dtype in args.dtypes:
                        if op in ("dequantize_int8_add_", "dgc") and dtype != "float32":
                            continue  # acc / the DGC state are float32 whatever the dtype
                        for n in sizes:
                            dens = args.densities if op in SPARSE_OPS else [None]
                            for density in dens:
                                case = Case(device, setting, op, n, dtype, density)
                                rows.extend(_run_case(case, op_backends, compiled, args, repeat, sync, notes))
                                _progress(rows)
                if compiled:
                    torch._dynamo.reset()
    finally:
        torch.set_num_threads(threads_before)
        try:
            from gradcomp.kernels import cpu

            if cpu.unavailable_reason() is None:
                cpu.set_num_threads(0)
        except ImportError:
            pass
    _ratios(rows)
    targets = _check_targets(rows, quick)
    return {
        "meta": _meta(args, sizes, repeat, backends, registry),
        "notes": notes,
        "rows": rows,
        "targets": targets,
    }


def _progress(rows: list[dict]) -> None:
    if rows and sys.stderr.isatty():
        r = rows[-1]
        print(f"\r  {r['op']:<22} n={r['n']:<10} {r['dtype']:<9} threads={r['threads']:<4}",
              end="", file=sys.stderr, flush=True)


def _run_case(case: Case, backends: list[str], compiled: dict, args, repeat: int, sync, notes) -> list[dict]:
    from gradcomp import kernels as K

    block = args.block_size
    d = _inputs(case, block, args.seed)
    timed: dict[str, Timed] = {}
    for b in backends:
        def fn_for(op, b=b):
            return lambda *a: _public(K, op, b, *a)

        timed[b] = Timed(_op_call(case, fn_for, d, block, args.rounding), "backend")
    timed.update(_baselines(case, d, block, args.rounding, compiled, notes))
    _warm(case, timed, block, notes)
    _measure(timed, repeat, args.budget, sync)
    rows = []
    for name, t in timed.items():
        st = _stats(t.times)
        row = {
            "device": case.device, "threads": case.threads, "op": case.op, "n": case.n,
            "dtype": case.dtype, "density": case.density, "k": case.k or None,
            "name": name, "kind": t.kind, "bytes": t.bytes, **st,
        }
        row["gbps"] = t.bytes / st["median_s"] / 1e9 if t.bytes and st["median_s"] > 0 else None
        rows.append(row)
    return rows


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


def _ratios(rows: list[dict]) -> None:
    """Per backend row: ratios against the baselines of the same case."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["device"], r["threads"], r["op"], r["n"], r["dtype"], r["density"])
        cases.setdefault(key, {})[r["name"]] = r
    for key, by_name in cases.items():
        copy = by_name.get("copy")
        for r in by_name.values():
            if r["kind"] != "backend":
                continue
            t = r["median_s"]
            if copy and copy.get("gbps") and r.get("gbps"):
                r["vs_copy_bw"] = r["gbps"] / copy["gbps"]
            for base, metric in (("reference", "speedup_vs_reference"), ("compiled", "speedup_vs_compiled"),
                                 ("torch.topk", "speedup_vs_torch_topk"),
                                 ("bitsandbytes", "speedup_vs_bitsandbytes")):
                if base in by_name and base != r["name"] and t > 0:
                    r[metric] = by_name[base]["median_s"] / t
            for base, metric in (("topk", "time_vs_topk"), ("topk+ef", "time_vs_topk_ef")):
                if r["op"] == "dgc" and base in by_name and by_name[base]["median_s"] > 0:
                    r[metric] = t / by_name[base]["median_s"]
            if r["op"] == "quantize_int8_ef":
                qkey = key[:2] + ("quantize_int8",) + key[3:]
                plain = cases.get(qkey, {}).get(r["name"])
                if plain:
                    r["time_vs_quantize"] = t / plain["median_s"]


def _check_targets(rows: list[dict], quick: bool = False) -> list[dict]:
    """The TARGETS against the CPU backend's rows (float32, 1 thread) at n = TARGET_SIZE.

    Without that size (``--quick``, ``--size``) the largest measured size is shown
    with ``judged`` False and ``met`` None: the bounds hold at full size only.
    """
    cpu_rows = [r for r in rows if r["device"] == "cpu" and r["name"] == "cpu" and r["dtype"] == "float32"
                and r["threads"] == "1"]
    if not cpu_rows:
        return []
    sizes = sorted({r["n"] for r in cpu_rows})
    n = TARGET_SIZE if TARGET_SIZE in sizes else sizes[-1]
    out = []
    for op, density, metric, cmp, bound in TARGETS:
        match = [r for r in cpu_rows if r["op"] == op and r["n"] == n
                 and (density is None or r["density"] == density)]
        if not match:
            continue
        v = match[0].get(metric)
        judged = n == TARGET_SIZE
        ok = None if v is None or not judged else (v >= bound if cmp == ">=" else v <= bound)
        out.append({"op": op, "density": density, "n": n, "metric": metric, "target": f"{cmp} {bound}",
                    "value": v, "met": ok, "judged": judged, "quick": quick})
    return out


def _meta(args, sizes, repeat, backends, registry) -> dict:
    info = {}
    try:
        from gradcomp.kernels import cpu

        if cpu.unavailable_reason() is None:
            info = dict(cpu._native().build_info())
    except ImportError:
        pass
    bnb_version = None
    if _BNB and _BNB[0] is not None:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    return {
        "command": (" ".join(sys.argv) if getattr(args, "argv", None) is None
                    else "gradcomp bench kernels " + " ".join(args.argv)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cores": _all_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "bitsandbytes": bnb_version,
        "native_build": info,
        "backends": backends,
        "sizes": sizes,
        "repeat": repeat,
        "budget_s": args.budget,
        "block_size": args.block_size,
        "rounding": args.rounding,
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---------------------------------------------------------------------------
# report


def _size(n: int) -> str:
    if n and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    return str(n)


#: (header, row key, format) of the report's value columns; a case's device, threads, op,
#: dtype, size and density head its group of rows instead of repeating on each row.
COLUMNS = (
    ("median ms", "median_s", "ms"), ("p10", "p10_s", "ms"), ("p90", "p90_s", "ms"),
    ("GB/s", "gbps", ".2f"), ("%copy", "vs_copy_bw", "%"),
    ("x ref", "speedup_vs_reference", ".1f"), ("x comp", "speedup_vs_compiled", ".1f"),
    ("x topk", "speedup_vs_torch_topk", ".1f"), ("x bnb", "speedup_vs_bitsandbytes", ".1f"),
    ("ef/q", "time_vs_quantize", ".2f"), ("/topk", "time_vs_topk", ".2f"),
    ("/topk+ef", "time_vs_topk_ef", ".2f"),
)
LEGEND = ("x ref / x comp / x topk / x bnb: time of the reference / torch.compile'd reference / "
          "torch.topk / bitsandbytes over the backend's; %copy: bandwidth over numpy copy's; "
          "ef/q: time over the same backend's quantize_int8; /topk, /topk+ef (dgc): time over "
          "top-k's, and over top-k with error feedback's")


def _cell(v, spec: str) -> str:
    if v is None:
        return ""
    if spec == "ms":  # milliseconds: 4 significant digits from 1 ms up, 0.001 ms below
        ms = v * 1e3
        decimals = 3 if ms < 1 else max(0, 3 - int(math.log10(ms)))
        return f"{ms:.{decimals}f}"
    if spec == "%":
        return f"{100 * v:.0f}%"
    return format(v, spec)


def _case_title(r: dict) -> str:
    dens = "" if r["density"] is None else f"  density {r['density']:g} (k={r['k']})"
    return f"{r['device']}  threads={r['threads']}  {r['op']}  {r['dtype']}  n={_size(r['n'])}{dens}"


def report_lines(rows: list[dict]) -> list[str]:
    """The result table as plain text lines, every number in full (no truncation).

    One heading line per case (device, threads, op, dtype, size, density), then one
    line per backend or baseline; columns empty in every row are left out. With the
    benchmark's names and figures up to 5 integer digits, lines fit 100 columns.
    """
    cols = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    body, titles, prev = [], [], None
    for r in rows:
        title = _case_title(r)
        titles.append(title if title != prev else None)
        prev = title
        body.append([r["name"], *(_cell(r.get(key), spec) for _, key, spec in cols)])
    head = ["name", *(h for h, _, _ in cols)]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join([cells[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    out = ["gradcomp kernels (median of interleaved rounds)", "  " + line(head)]
    for title, cells in zip(titles, body):
        if title is not None:
            out.append(title)
        out.append("  " + line(cells).rstrip())
    return out


def _target_status(t: dict) -> str:
    if not t.get("judged", True):
        return "not judged at quick sizes" if t.get("quick") else "not judged at this size"
    return {True: "met", False: "MISSED", None: "not measured"}[t["met"]]


def print_report(result: dict, file=None) -> None:
    """Print the table (:func:`report_lines`), the legend, the targets check and the notes,
    all within 100 columns (long notes wrap)."""
    file = file or sys.stdout
    for text in report_lines(result["rows"]):
        print(text, file=file)
    print(textwrap.fill(LEGEND, width=100), file=file)
    if result["targets"]:  # one size for all: _check_targets measures at one n
        n = result["targets"][0]["n"]
        at = "" if n == TARGET_SIZE else f", measured at n={_size(n)}"
        print(f"targets (cpu backend, float32, 1 thread; defined at n={_size(TARGET_SIZE)}{at}):", file=file)
    for t in result["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        dens = f" density {t['density']}" if t["density"] is not None else ""
        print(f"  {t['op']}{dens} {t['metric']} {t['target']}: {v} -> {_target_status(t)}", file=file)
    for note in result["notes"]:
        print(textwrap.fill(f"note: {note}", width=100, subsequent_indent="  "), file=file)


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Reject settings that cannot run (``p.error``: exit status 2, no traceback)."""
    from gradcomp import _validate as v

    for name, vals, allowed in (("--dtypes", args.dtypes, DTYPES), ("--ops", args.ops, BENCH_OPS),
                                ("--compile-ops", args.compile_ops, (*OPS, "all", "none")),
                                ("--devices", args.devices or [], ("cpu", "cuda"))):
        bad = [x for x in vals if x not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad} (choose from {', '.join(allowed)})")
    for s in args.threads:
        if s != "all" and not (s.isdigit() and int(s) >= 1):
            p.error(f"--threads: expected 'all' or an integer >= 1, got {s!r}")
    if any(not 0 < d <= 1 for d in args.densities):
        p.error(f"--densities: expected numbers in (0, 1], got {args.densities}")
    try:
        v.block_size(args.block_size)
    except ValueError as e:
        p.error(f"--block-size: {e}")
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat: expected an integer >= 1, got {args.repeat}")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        p.error(f"--budget: expected a finite number of seconds > 0, got {args.budget}")
    from gradcomp._validate import writable_dir

    try:
        writable_dir("--out", args.out)
    except ValueError as e:
        p.error(str(e).replace("--out ", "--out: ", 1))


def main(argv: list[str] | None = None) -> int:
    """Run the kernel benchmark with command-line arguments ``argv``
    (default ``sys.argv[1:]``); prints the table, writes ``--out/kernels.json``
    and returns 0."""
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    args.argv = argv
    result = run(args)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print_report(result)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernels.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    print(f"wrote {path}")
    return 0


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
