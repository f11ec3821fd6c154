"""The kernel benchmark's run: every case of the command line, its backends and peers timed.

:func:`run` walks devices, thread settings, ops, dtypes, sizes and densities
(in that order), times each case (:mod:`.timing`) and returns the rows with
their ratios, the targets check, notes and the machine's description.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import numpy as np
import torch

from .cases import (BENCH_OPS, DEFAULT_SIZES, DTYPES, FLOAT32_ONLY, QUICK_SIZES, SPARSE_OPS, Case, backend_call,
                    backends_for, make_inputs)
from .peers import COMPILED_OPS, bitsandbytes, peers
from .report import add_ratios, check_targets
from .timing import Timed, all_threads, measure, restore_threads, set_threads, stats, sync_for, warm

__all__ = ["compile_ops_of", "run"]


def compile_ops_of(args) -> list[str]:
    """The ops given a torch.compile peer by ``--compile-ops`` / ``--no-compile``."""
    if args.no_compile:
        return []
    if args.compile_ops == ["all"]:
        return list(COMPILED_OPS)
    return [o for o in args.compile_ops if o != "none"]


def run(args) -> dict:
    """Time every case of ``args`` (the parsed command line); returns the result
    (``meta``, ``notes``, ``rows``, ``targets``) that the report prints and the JSON holds."""
    from gradcomp import kernels as K

    quick = args.quick
    sizes = [args.size] if args.size is not None else (args.sizes or list(QUICK_SIZES if quick else DEFAULT_SIZES))
    repeat = args.repeat or (3 if quick else 7)
    for dt in args.dtypes:
        if dt not in DTYPES:
            raise SystemExit(f"--dtypes: unknown dtype {dt!r} (choose from {', '.join(DTYPES)})")
    for op in args.ops:
        if op not in BENCH_OPS:
            raise SystemExit(f"--ops: unknown op {op!r} (choose from {', '.join(BENCH_OPS)})")
    compile_ops = compile_ops_of(args)
    devices = args.devices or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    notes: list[str] = []
    rows: list[dict] = []
    compiles: list[float] = []  # first-call seconds of the torch.compile peers
    no_peer = [o for o in compile_ops if o in args.ops and o not in COMPILED_OPS]
    if no_peer:
        notes.append(f"no torch.compile peer for {', '.join(no_peer)} (only for {', '.join(COMPILED_OPS)})")
    threads_before = torch.get_num_threads()
    backends = K.available_backends()
    bnb, reason = bitsandbytes()
    if bnb is None:
        notes.append(f"bitsandbytes baseline skipped: {reason}")
    try:
        for device in devices:
            done = len(rows)
            try:
                _run_device(device, args, sizes, compile_ops, repeat, notes, compiles, rows)
            except RuntimeError as e:  # a device that fails mid-run: the others' rows are kept
                if device == "cpu":
                    raise
                del rows[done:]
                notes.append(f"{device} skipped: it failed mid-run ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); its rows are left out")
        if compile_ops:
            torch._dynamo.reset()
    finally:
        restore_threads(threads_before)
    if compiles:
        notes.append(f"torch.compile of the peers: {len(compiles)} compilations (one per case), "
                     f"{sum(compiles):.1f} s in all, untimed (first calls)")
    add_ratios(rows)
    targets = check_targets(rows, quick)
    return {
        "meta": _meta(args, sizes, repeat, backends),
        "notes": notes,
        "rows": rows,
        "targets": targets,
    }


def _run_device(device: str, args, sizes, compile_ops, repeat: int, notes, compiles, rows: list[dict]) -> None:
    """Every case of ``device``, its rows appended to ``rows``."""
    sync = sync_for(device)
    for setting in args.threads:
        set_threads(setting)
        for op in args.ops:
            op_backends = backends_for(op, device)
            for dtype in args.dtypes:
                if op in FLOAT32_ONLY and dtype != "float32":
                    continue  # acc, out or the DGC state are float32 whatever the dtype
                for n in sizes:
                    for density in (args.densities if op in SPARSE_OPS else [None]):
                        case = Case(device, setting, op, n, dtype, density)
                        rows.extend(_run_case(case, op_backends, compile_ops, args, repeat, sync, notes,
                                              compiles))
                        _progress(rows)


def _progress(rows: list[dict]) -> None:
    if rows and sys.stderr.isatty():
        r = rows[-1]
        print(f"\r  {r['op']:<22} n={r['n']:<10} {r['dtype']:<9} threads={r['threads']:<4}",
              end="", file=sys.stderr, flush=True)


def _run_case(case: Case, backends: list[str], compile_ops, args, repeat: int, sync, notes,
              compiles: list[float]) -> list[dict]:
    block = args.block_size
    d = make_inputs(case, block, args.seed)
    timed: dict[str, Timed] = {b: Timed(backend_call(case, b, d, block, args.rounding), "backend")
                               for b in backends}
    timed.update(peers(case, d, block, args.rounding, compile_ops, notes))
    first = warm(case, timed, block, notes)
    if "compiled" in first:
        compiles.append(first["compiled"])
    measure(timed, repeat, args.budget, sync)
    rows = []
    for name, t in timed.items():
        st = stats(t.times)
        row = {
            "device": case.device, "threads": case.threads, "op": case.op, "n": case.n,
            "dtype": case.dtype, "density": case.density, "k": case.k or None,
            "name": name, "kind": t.kind, "bytes": t.bytes, **st,
        }
        row["gbps"] = t.bytes / st["median_s"] / 1e9 if t.bytes and st["median_s"] > 0 else None
        rows.append(row)
    return rows


def _meta(args, sizes, repeat, backends) -> dict:
    info = {}
    try:
        from gradcomp.kernels import cpu

        if cpu.unavailable_reason() is None:
            info = dict(cpu.native().build_info())
    except ImportError:
        pass
    bnb_version = None
    if bitsandbytes()[0] is not None:
        import bitsandbytes as bnb

        bnb_version = bnb.__version__
    return {
        "command": (" ".join(sys.argv) if getattr(args, "argv", None) is None
                    else "gradcomp bench kernels " + " ".join(args.argv)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cores": all_threads(),
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
