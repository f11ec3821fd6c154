"""Per-call cost of the public kernel ops, this tree against a baseline revision.

Times every public op of :mod:`gradcomp.kernels` (auto-selected backend, CPU
tensors, preallocated outputs where the op takes them) at 2**10 elements,
where the call overhead dominates, and 2**16 elements. The baseline is the
``gradcomp/`` package of a git revision (default: the merge base with
``main``), extracted to a temporary directory with this tree's built
``gradcomp/_C`` copied in (so both sides run the same native kernels; the
native module's interface must be the same). Each side runs in its own
interpreter; each case is timed on both sides back to back (in alternating
order), round after round, so that load from other processes hits both
alike. Kernels run on ``--threads`` threads (default 1: on a shared machine a
single thread keeps the figures steady), timed by the calling thread's CPU
time (``--clock cpu``, default: time spent descheduled by other processes
does not count) or elapsed time (``--clock wall``). Every round times
``--calls`` calls of each case one by one on each side; the figure is the
median over the ``--rounds`` x ``--calls`` call times.

Run from the repository root, after ``python setup.py build_ext --inplace``::

    nice -n 5 python benchmarks/op_overhead.py [--baseline REV] [--rounds 40] [--calls 50] [--threads 1] [--clock cpu]

Prints one row per (op, n): median microseconds per call before and after,
and after / before (>1: slower now).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = (1 << 10, 1 << 16)
#: ``cpu``: the calling thread's CPU time (kernels run on it with one thread),
#: which time spent descheduled by other processes does not inflate; ``wall``
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases(n: int):
    """``{op name: zero-argument callable}`` for tensors of n elements."""
    import torch

    import gradcomp.kernels as K

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    bs = 256
    nb = -(-n // bs)
    q = torch.empty(n, dtype=torch.int8)
    s = torch.empty(nb)
    K.quantize_int8(x, bs, out_q=q, out_scales=s)
    out = torch.empty(n)
    acc = torch.zeros(n)
    res = torch.zeros(n)
    q2 = torch.empty(n, dtype=torch.int8)
    s2 = torch.empty(nb)
    k = max(1, n // 100)
    tau = float(K.topk(x, k)[1].abs().min())
    idx = torch.randperm(n, generator=g).to(torch.int32)  # n (index, value) pairs
    u, w = torch.zeros(n), torch.zeros(n)
    return {
        "quantize_int8": lambda: K.quantize_int8(x, bs, out_q=q2, out_scales=s2),
        "quantize_int8(stochastic)": lambda: K.quantize_int8(x, bs, "stochastic", 1, 2, out_q=q2, out_scales=s2),
        "dequantize_int8": lambda: K.dequantize_int8(q, s, bs, out),
        "dequantize_int8(check)": lambda: K.dequantize_int8(q, s, bs, out, check_int8=True),
        "dequantize_int8_add_": lambda: K.dequantize_int8_add_(acc, q, s, bs),
        "quantize_int8_ef": lambda: K.quantize_int8_ef(x, res, bs, out_q=q2, out_scales=s2),
        "reduce_quantize_int8": lambda: K.reduce_quantize_int8(acc, q, s, bs, 2, out_q=q2, out_scales=s2),
        "topk": lambda: K.topk(x, k),
        "approx_topk": lambda: K.approx_topk(x, k),
        "threshold": lambda: K.threshold(x, tau),
        "scatter_add_": lambda: K.scatter_add_(acc, idx, x),
        "dgc_accumulate_": lambda: K.dgc_accumulate_(x, u, w, 0.9),
        "dgc_topk_": lambda: K.dgc_topk_(x, u, w, 0.9, 1.0, k),
    }


def _worker(calls: int, threads: int, clock_name: str) -> None:
    """Per stdin line, time every case: answer one JSON line of
    ``{"op n": [seconds of each call]}``."""
    import torch

    from gradcomp.kernels import cpu

    torch.set_num_threads(threads)
    if cpu.unavailable_reason() is None:
        cpu.set_num_threads(threads)
    cases = {f"{name} {n}": fn for n in SIZES for name, fn in _cases(n).items()}
    for fn in cases.values():
        fn()  # warm-up: loads backends, allocators
    clock = CLOCKS[clock_name]
    for line in sys.stdin:
        key = line.strip()
        if key == "list":
            print(json.dumps(list(cases)), flush=True)
            continue
        fn = cases[key]
        ts = []
        for _ in range(calls):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        print(json.dumps(ts), flush=True)


def _baseline_tree(rev: str, tmp: str) -> str:
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "gradcomp"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    natives = glob.glob(os.path.join(ROOT, "gradcomp", "_C*.so"))
    if not natives:
        sys.exit("gradcomp/_C is not built here: run `python setup.py build_ext --inplace` first")
    for so in natives:
        shutil.copy(so, os.path.join(tmp, "gradcomp"))
    return tmp


def _spawn(tree: str, a: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("GRADCOMP_BACKEND", None)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(a.calls),
                             "--threads", str(a.threads), "--clock", a.clock],
                            env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(p: subprocess.Popen, what: str):
    p.stdin.write(what + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        sys.exit(f"worker {p.args} exited with {p.wait()}")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="git revision to compare with (default: merge base with main)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: calling thread's CPU time (default; robust to other load); wall: elapsed time")
    ap.add_argument("--threads", type=int, default=1, help="torch and native kernel threads (default 1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        if a.threads != 1 and a.clock == "cpu":
            sys.exit("--clock cpu counts the calling thread only: use --threads 1 or --clock wall")
        _worker(a.calls, a.threads, a.clock)
        return
    rev = a.baseline or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"], check=True,
                                       capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": _spawn(_baseline_tree(rev, tmp), a),
                 "after": _spawn(ROOT, a)}
        keys = _ask(sides["after"], "list")
        times: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in sides}
        try:
            for r in range(a.rounds):
                for i, key in enumerate(keys):  # both sides time each case back to back
                    order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]
                    for side in order:
                        times[side][key].extend(_ask(sides[side], key))
        finally:
            for p in sides.values():
                p.stdin.close()
                p.wait(timeout=60)
    print(f"baseline {rev[:12]}; {a.rounds} rounds x {a.calls} calls; {a.threads} thread(s); "
          f"{a.clock} time; median us per call")
    print(f"{'op':<28} {'n':>7} {'before':>9} {'after':>9} {'after/before':>13}")
    ratios: dict[str, list[float]] = {}
    for key in times["after"]:
        name, n = key.rsplit(" ", 1)
        b = statistics.median(times["before"][key]) * 1e6
        t = statistics.median(times["after"][key]) * 1e6
        ratios.setdefault(n, []).append(t / b)
        print(f"{name:<28} {n:>7} {b:>9.2f} {t:>9.2f} {t / b:>13.3f}")
    for n, rs in ratios.items():
        print(f"n={n}: after/before geometric mean {statistics.geometric_mean(rs):.3f}, worst {max(rs):.3f}")


if __name__ == "__main__":
    main()
