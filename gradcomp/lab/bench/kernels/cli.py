"""The ``gradcomp bench kernels`` command line: options, their checks and :func:`main`."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from gradcomp.kernels.registry import OPS
from gradcomp.lab.args import OneLineParser

from .cases import BENCH_OPS, DTYPES
from .report import print_report
from .runner import run

__all__ = [
    "DEFAULT_COMPILE_OPS", "parse_size", "SIZE_FORMS", "build_parser", "available_memory_bytes",
    "case_bytes", "main",
]

#: ops given a torch.compile peer unless --compile-ops says otherwise
DEFAULT_COMPILE_OPS = ("quantize_int8", "dequantize_int8", "quantize_packed", "quantize_packed_2bit", "quantize_sign",
                       "quantize_fp8")


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
    p = OneLineParser(
        prog=prog,
        description="Time the compression kernels of every backend usable here against "
                    "memory copy, the PyTorch reference, a fused int8 quantizer under torch.compile, "
                    "torch.topk and bitsandbytes; print a table and write JSON.",
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
                   help="ops also timed against a fused function under torch.compile (fullgraph, "
                        "static shapes; the int8 ops and the int4 / int2 / sign / fp8 quantizers), 'all' or 'none' "
                        f"(default: {','.join(DEFAULT_COMPILE_OPS)})")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--devices", type=_list, default=None,
                   help="cpu and/or cuda (default: cpu, and cuda when a GPU is present)")
    p.add_argument("--out", default="bench-results",
                   help="directory for kernels.json (default: bench-results)")
    p.add_argument("--quick", action="store_true", help="sizes 2**16 and 2**20, 3 rounds")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    return p



def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Reject settings that cannot run (``p.error``: exit status 2, no traceback)."""
    from gradcomp import _validate as v

    for name, vals, allowed in (("--dtypes", args.dtypes, DTYPES), ("--ops", args.ops, BENCH_OPS),
                                ("--compile-ops", args.compile_ops, (*BENCH_OPS, "all", "none")),
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
    _check_machine(p, args)


def available_memory_bytes() -> int | None:
    """Memory the kernel may still allocate here (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def case_bytes(n: int, dtype: str) -> int:
    """An upper bound on the buffers of the widest case of ``n`` elements: the input and an
    output of ``dtype``, int8 codes, and four float32 states (accumulator, residual, DGC's u, v)."""
    import torch

    return n * (2 * torch.empty((), dtype=DTYPES[dtype]).element_size() + 1 + 4 * 4)


def _check_machine(p: argparse.ArgumentParser, args) -> None:
    """The options against this machine, before anything runs: ``--devices cuda`` without CUDA
    (exit 2; with cpu too, cuda is dropped with a note) and sizes beyond the memory."""
    import torch

    args.skipped = []
    if args.devices and "cuda" in args.devices and not torch.cuda.is_available():
        if args.devices == ["cuda"]:
            p.error("--devices cuda: no CUDA device here (torch.cuda.is_available() is False; "
                    f"torch {torch.__version__}); use --devices cpu")
        args.devices = [d for d in args.devices if d != "cuda"]
        args.skipped.append("cuda skipped: no CUDA device here (torch.cuda.is_available() is False)")
        print(f"gradcomp bench kernels: {args.skipped[-1]}; running {','.join(args.devices)}", file=sys.stderr)
    sizes = [args.size] if args.size is not None else (args.sizes or [])
    free = available_memory_bytes()
    for n in sizes:
        need = max(case_bytes(n, dt) for dt in args.dtypes)
        if free is not None and need > free:
            opt = "--size" if args.size is not None else "--sizes"
            p.error(f"{opt}: {n} elements need about {need / 2**30:,.1f} GiB for a case's buffers; "
                    f"this machine has {free / 2**30:,.1f} GiB available")


def main(argv: list[str] | None = None) -> int:
    """Run the kernel benchmark with command-line arguments ``argv``
    (default ``sys.argv[1:]``); prints the table, writes ``--out/kernels.json``
    and returns 0."""
    p = build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    args.argv = argv
    result = run(args)
    result["notes"][:0] = args.skipped
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)  # clear the progress line before the table
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


