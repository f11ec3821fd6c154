"""Parameter-server push throughput and push/pull round-trip latency.

One server and ``--workers`` workers (gradcomp.launch, local processes,
loopback) in async mode, uncompressed float32 (so the transport, not the
codec, is measured); the server applies every push with plain SGD.

* ``pushes/s`` for each size in ``--sizes`` (float32 parameters in one
  tensor): every worker pulls once, pushes ``--warmup`` times, then pushes
  ``--pushes`` times as fast as it can; pushes per second = all timed pushes
  / the slowest worker's wall time.
* round-trip latency of a 4 KiB model (1024 float32) with one worker alone
  and with all ``--workers`` at once: each worker times ``--rounds`` calls of
  ``push()`` (4 KiB out, a reply header back) and of ``pull()`` (a request
  header out, 4 KiB back); median and 90th percentile in microseconds, the
  median over the workers of their medians.

    python benchmarks/ps_latency.py [--workers 4] [--sizes 100000,10000000] [--json out.json]

Only the public API is used (``ParameterServer``, ``Worker.push``,
``Worker.pull``), so the same script measures any version of the transport.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradcomp import ps
from gradcomp.launch import launch

LATENCY_NUMEL = 1024  # 4 KiB of float32


def _rank(rank: int, world_size: int, numel: int, warmup: int, pushes: int, timed: str):
    dist.barrier()
    params = {"w": torch.zeros(numel)}
    if rank == 0:
        server = ps.ParameterServer(params, mode="async", worker_timeout=300.0,
                                    optimizer=functools.partial(torch.optim.SGD, lr=1e-6))
        return {"role": "server", "updates": server.serve()["updates"]}
    worker = ps.Worker(params, timeout=300.0)
    g = {"w": torch.full((numel,), 1e-3)}
    push_s, pull_s = [], []
    with worker:
        worker.pull()
        for _ in range(warmup):
            worker.push(g)
            worker.pull()
        dist.barrier(_workers_group(world_size))
        t0 = time.perf_counter()
        for _ in range(pushes):
            t = time.perf_counter()
            worker.push(g)
            push_s.append(time.perf_counter() - t)
            if timed == "push+pull":
                t = time.perf_counter()
                worker.pull()
                pull_s.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
    return {"role": "worker", "wall": wall, "push_s": push_s, "pull_s": pull_s}


_GROUPS: dict = {}


def _workers_group(world_size: int):
    # created by every rank in the same order at first use (new_group is collective)
    if world_size not in _GROUPS:
        _GROUPS[world_size] = dist.new_group(list(range(1, world_size)))
    return _GROUPS[world_size]


def _rank_entry(rank, world_size, *args):
    _workers_group(world_size)  # every rank, servers included, creates the group
    return _rank(rank, world_size, *args)


def throughput(numel: int, workers: int, warmup: int, pushes: int) -> dict:
    out = launch(_rank_entry, 1 + workers, args=(numel, warmup, pushes, "push"), timeout=600)
    ws = [o for o in out if o["role"] == "worker"]
    wall = max(w["wall"] for w in ws)
    return {"numel": numel, "workers": workers, "pushes": pushes * workers,
            "pushes_per_s": pushes * workers / wall,
            "push_ms_median": 1e3 * statistics.median(s for w in ws for s in w["push_s"])}


def latency(workers: int, rounds: int) -> dict:
    out = launch(_rank_entry, 1 + workers, args=(LATENCY_NUMEL, 20, rounds, "push+pull"), timeout=600)
    ws = [o for o in out if o["role"] == "worker"]

    def stat(key, q):
        per = []
        for w in ws:
            xs = sorted(w[key])
            per.append(statistics.median(xs) if q == 50 else xs[int(0.9 * (len(xs) - 1))])
        return 1e6 * statistics.median(per)

    return {"workers": workers, "rounds": rounds, "bytes": 4 * LATENCY_NUMEL,
            "push_us_p50": stat("push_s", 50), "push_us_p90": stat("push_s", 90),
            "pull_us_p50": stat("pull_s", 50), "pull_us_p90": stat("pull_s", 90)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Parameter-server pushes/s and 4 KiB round-trip latency.")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sizes", default="100000,10000000", help="parameters per push, comma-separated")
    p.add_argument("--pushes", default="300,8", help="timed pushes per worker for each size")
    p.add_argument("--rounds", type=int, default=500, help="timed round trips per worker (latency)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(s) for s in args.pushes.split(",")]
    if len(counts) != len(sizes):
        p.error("--pushes needs one count per size")
    rows = [throughput(n, args.workers, max(2, c // 10), c) for n, c in zip(sizes, counts)]
    lat = [latency(1, args.rounds), latency(args.workers, args.rounds)]
    print(f"1 server, {args.workers} workers, async, float32 pushes (loopback)")
    print(f"{'parameters':>12} {'pushes':>7} {'pushes/s':>10} {'push ms p50':>12}")
    for r in rows:
        print(f"{r['numel']:12,d} {r['pushes']:7d} {r['pushes_per_s']:10.1f} {r['push_ms_median']:12.3f}")
    print(f"4 KiB round trip (us): {'workers':>7} {'push p50':>9} {'push p90':>9} {'pull p50':>9} {'pull p90':>9}")
    for r in lat:
        print(f"{'':23}{r['workers']:7d} {r['push_us_p50']:9.0f} {r['push_us_p90']:9.0f} "
              f"{r['pull_us_p50']:9.0f} {r['pull_us_p90']:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"throughput": rows, "latency": lat}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
