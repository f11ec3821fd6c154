"""Per-call cost of the adaptive policy's ``none`` against DDP's plain bucket.

On ``--world`` gloo ranks of this machine (loopback), one float32 bucket of
``--numel`` elements, reduced (average) three ways, interleaved call by call
(round-robin, a barrier before each call, so that load from other processes
hits all three alike):

* ``plain``: what a plain DDP bucket does (``GradCompState._reduce_plain``):
  ``buf.div_(world)`` then :func:`gradcomp.comm.native.allreduce_`;
* ``native``: :func:`gradcomp.comm.native.allreduce` with a residual (the
  error-feedback memory: added, then zeroed) and no agreement check;
* ``adaptive``: ``gc.allreduce(buf, gc.Adaptive(candidates=("none",)),
  key=..., residual=..., out=buf, check=False)``: the same collective through the
  policy's bookkeeping (timing, window, one agreement allreduce every
  ``interval`` calls; a flat bucket reduced in place takes
  :func:`gradcomp.comm.native.reduce_`, and a residual it delivered is not
  added again while it stays zero).

Run from the repository root::

    python benchmarks/adaptive_overhead.py [--world 4] [--numel 126090] [--calls 300]

Prints the median milliseconds per call of the slowest rank (the first 20
calls of each are warm-up) and each variant over ``plain``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import native
from gradcomp.launch import launch

VARIANTS = ("plain", "native", "adaptive")
WARMUP = 20


def _rank(rank: int, world: int, numel: int, calls: int) -> dict[str, float]:
    buf = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    residual = torch.zeros(numel)
    policy = gc.Adaptive(candidates=("none",))
    group = dist.group.WORLD
    times = {v: [] for v in VARIANTS}
    for _ in range(calls):
        for variant in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            if variant == "plain":
                buf.div_(world)
                native.allreduce_(buf, group=group, timeout=60)
            elif variant == "native":
                native.allreduce(buf, op="avg", group=group, timeout=60, residual=residual, out=buf, check=False)
            else:
                gc.allreduce(buf, policy, key="bucket", residual=residual, out=buf, check=False)
            times[variant].append(time.perf_counter() - t0)
    return {v: statistics.median(t[WARMUP:]) for v, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--numel", type=int, default=126090, help="bucket elements (default 126090: the digits MLP)")
    p.add_argument("--calls", type=int, default=300, help="calls of each variant (default 300)")
    args = p.parse_args()
    if args.world < 2 or args.numel < 1 or args.calls <= WARMUP:
        p.error(f"--world must be >= 2, --numel >= 1, --calls > {WARMUP}")
    per_rank = launch(_rank, args.world, (args.numel, args.calls), timeout=600)
    slowest = {v: max(r[v] for r in per_rank) for v in VARIANTS}
    print(f"world {args.world}, {args.numel} float32 elements, {args.calls} calls each "
          f"(median of the slowest rank, ms per call)")
    for v in VARIANTS:
        print(f"  {v:9s} {slowest[v] * 1e3:8.3f} ms   x{slowest[v] / slowest['plain']:.2f}")


if __name__ == "__main__":
    main()
