"""Two builds of the native CPU module side by side, in one process, rounds interleaved.

Loads the installed ``gradcomp._C`` and a second build of it (``--other``: the path of its
``_C*.so``, e.g. one built with ``GRADCOMP_NATIVE_ARCH=1`` in another checkout) and times the
same kernel calls on the same buffers alternately, round by round, so that a load change on a
shared machine hits both alike. Prints per kernel the median time of each and the median of
the per-round ratios (other / installed: above 1, the installed build is faster), in wall time
and in the calling thread's CPU time (which leaves out the time other jobs hold the core). One
thread each (``set_num_threads(1)``), float32, ``--numel`` elements, block 256 (sign: 1024;
``--block`` sets one block size for every quantizer).

    python benchmarks/isa_compare.py --other /path/to/gradcomp/_C.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import numpy as np

import gradcomp._C as installed


def load(path: str):
    spec = importlib.util.spec_from_file_location("other_build._C", path)  # its init symbol is PyInit__C
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def buffers(n: int, seed: int, kind: str = "numpy") -> dict:
    """The input and output buffers of ``n`` elements that both modules' calls share (so that
    neither gets the better pages): numpy's (which numpy backs with transparent huge pages when
    the kernel allows them) or torch tensors' (4 KiB pages, as a model's gradients)."""
    if kind == "torch":
        import torch

        def empty(k, dtype):
            return torch.empty(k, dtype=getattr(torch, np.dtype(dtype).name)).numpy()

        x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).numpy()
    else:
        empty = np.empty
        x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    return {"x": x, "q": empty(n, np.int8), "s": empty(n // 256, np.float32), "c4": empty(n // 2, np.uint8),
            "c2": empty(n // 4, np.uint8), "c1": empty(n // 8, np.uint8), "c8": empty(n, np.uint8),
            "out": empty(n, np.float32)}


def calls(mod, b: dict, block: int | None = None) -> dict:
    """Zero-argument calls of the hot kernels of ``mod`` on the buffers ``b`` (:func:`buffers`),
    at block 256 (sign: 1024), or at ``block`` (a multiple of 256) for every quantizer."""
    x, q, out, n = b["x"], b["q"], b["out"], b["x"].size
    bs, bs_sign = block or 256, block or 1024
    s, s_sign = b["s"][: n // bs], b["s"][: n // bs_sign]
    mod.quantize_int8(x, "float32", bs, False, 0, q, s)
    return {
        "quantize_int8": lambda: mod.quantize_int8(x, "float32", bs, False, 0, q, s),
        "dequantize_int8": lambda: mod.dequantize_int8(q, s, bs, out, "float32", False),
        "quantize int4": lambda: mod.quantize_packed(x, "float32", 4, bs, False, 0, b["c4"], s),
        "quantize int2": lambda: mod.quantize_packed(x, "float32", 2, bs, False, 0, b["c2"], s),
        "quantize sign": lambda: mod.quantize_sign(x, "float32", bs_sign, b["c1"], s_sign),
        "quantize fp8 e4m3": lambda: mod.quantize_fp8(x, "float32", "e4m3", bs, b["c8"], s),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="path of the other build's _C*.so")
    ap.add_argument("--numel", type=int, default=2**24)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=None,
                    help="one block size (a multiple of 256) for every quantizer; default 256, sign 1024")
    ap.add_argument("--buffers", choices=("numpy", "torch"), default="numpy",
                    help="numpy arrays (huge pages where the kernel gives them) or torch tensors (4 KiB pages)")
    args = ap.parse_args(argv)
    if args.block is not None and (args.block <= 0 or args.block % 256 or args.numel % args.block):
        ap.error(f"--block must be a positive multiple of 256 that divides --numel, got {args.block}")
    other = load(args.other)
    for m in (installed, other):
        m.set_num_threads(1)
    print(f"installed: {installed.build_info()}\nother:     {other.build_info()}")
    shared = buffers(args.numel, 0, args.buffers)
    a, b = calls(installed, shared, args.block), calls(other, shared, args.block)
    print(f"{'kernel':<20}{'installed ms':>14}{'other ms':>10}{'other/installed':>17}"
          f"{'cpu: installed ms':>19}{'other ms':>10}{'other/installed':>17}")
    for name in a:
        ta, tb, ca, cb = [], [], [], []
        for r in range(args.rounds):
            pair = ((a[name], ta, ca), (b[name], tb, cb))
            for fn, ts, cs in pair if r % 2 == 0 else pair[::-1]:  # either goes first in turn
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                ts.append(time.perf_counter() - t0)
                cs.append(time.thread_time() - c0)
        med = [1e3 * statistics.median(v) for v in (ta, tb, ca, cb)]
        ratio = statistics.median(y / x for x, y in zip(ta, tb))
        cpu_ratio = statistics.median(y / x for x, y in zip(ca, cb) if x > 0)
        print(f"{name:<20}{med[0]:>14.2f}{med[1]:>10.2f}{ratio:>17.2f}"
              f"{med[2]:>19.2f}{med[3]:>10.2f}{cpu_ratio:>17.2f}")


if __name__ == "__main__":
    main()
