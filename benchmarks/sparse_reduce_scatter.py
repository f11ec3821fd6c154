"""Sparse reduce-scatter against the sparse allgather: bytes per rank and time, world 2..8.

    python benchmarks/sparse_reduce_scatter.py [--worlds 2,3,4,5,6,7,8] [--size 1048576]
                                               [--repeat 7] [--json FILE]

One launch of ``max(--worlds)`` ranks (gradcomp.launch, gloo over loopback);
for each world size ``N`` the first ``N`` ranks form the group (the others
wait) and each holds ``randn(--size)`` (seed = rank). Both methods reduce it
with top-k 1% and int8 values (``gc.TopK(ratio=0.01, values=gc.Int8Quantizer())``),
each on its own process group: ``allgather`` (every rank's payload to every
rank) and ``sparse_reduce_scatter``. Reported per world and method: the bytes
each rank sent per call (gradcomp's meter: the mean and the largest over
ranks), over ``P``, one rank's compressed selection of the whole tensor (its
payload's size, measured), and over ``2 (N - 1) / N P``; the median over
interleaved rounds of the slowest rank's time, the allgather's over the
method's (medians, and the median of per-round paired ratios); whether every
rank returned the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

METHODS = ("allgather", "sparse_reduce_scatter")


def _make():
    import gradcomp as gc

    return gc.TopK(ratio=0.01, values=gc.Int8Quantizer())


def _same_everywhere(buf, group, world) -> bool:
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return all(torch.equal(out[0], t) for t in out)


def _measure(rank: int, world: int, groups: dict, size: int, repeat: int):
    import gradcomp as gc

    x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    whole = _make().compress(x).nbytes  # P: this rank's compressed selection
    buf = torch.empty_like(x)
    meters = {m: gc.TrafficMeter() for m in METHODS}
    comps = {m: _make() for m in METHODS}
    for m in METHODS:  # warm-up: the group's agreement
        buf.copy_(x)
        gc.allreduce(buf, comps[m], algorithm=m, group=groups[m], out=buf)
    times = {m: [] for m in METHODS}
    same = {m: True for m in METHODS}
    sent = {}
    for i in range(repeat):
        for m in (METHODS if i % 2 == 0 else METHODS[::-1]):
            buf.copy_(x)
            meters[m].reset()
            dist.barrier(group=groups[m])
            t0 = time.perf_counter()
            gc.allreduce(buf, comps[m], algorithm=m, group=groups[m], meter=meters[m], out=buf)
            times[m].append(time.perf_counter() - t0)
            same[m] = same[m] and _same_everywhere(buf, groups[m], world)
            sent[m] = meters[m].bytes_sent
    return {"times": times, "same": same, "sent": sent, "whole": whole}


def _worker(rank: int, size_all: int, worlds: list[int], size: int, repeat: int):
    rows = []
    for world in worlds:
        groups = {m: dist.new_group(list(range(world))) for m in METHODS}
        if rank < world:
            got = _measure(rank, world, groups, size, repeat)
            every = [None] * world
            dist.all_gather_object(every, got, group=groups[METHODS[0]])
            if rank == 0:
                rows.append(_row(world, repeat, every))
        dist.barrier()
    return rows if rank == 0 else None


def _row(world: int, repeat: int, every: list[dict]) -> dict:
    whole = statistics.mean(e["whole"] for e in every)
    slowest = {m: [max(e["times"][m][i] for e in every) for i in range(repeat)] for m in METHODS}
    out = {"world": world, "whole_payload_bytes": whole, "methods": {}}
    for m in METHODS:
        sent = [e["sent"][m] for e in every]
        mean = statistics.mean(sent)
        out["methods"][m] = {
            "bytes_sent_mean": mean, "bytes_sent_max": max(sent),
            "over_payload": mean / whole, "max_over_payload": max(sent) / whole,
            "over_2(N-1)/N_payload": mean / (2 * (world - 1) / world * whole),
            "median_ms": 1e3 * statistics.median(slowest[m]),
            "allgather_over_method": statistics.median(slowest["allgather"]) / statistics.median(slowest[m]),
            "allgather_over_method_paired": statistics.median(
                slowest["allgather"][i] / slowest[m][i] for i in range(repeat)),
            "bit_identical": all(e["same"][m] for e in every),
        }
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _table(rows: list[dict]) -> str:
    head = (f"{'N':>2} {'method':<22} {'bytes/rank':>10} {'/P':>5} {'max/P':>6} {'/(2(N-1)/N P)':>13} "
            f"{'ms':>7} {'AG/x':>5} {'paired':>6} {'same':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        for m, v in r["methods"].items():
            lines.append(f"{r['world']:>2} {m:<22} {v['bytes_sent_mean']:>10.0f} {v['over_payload']:>5.2f} "
                         f"{v['max_over_payload']:>6.2f} {v['over_2(N-1)/N_payload']:>13.3f} "
                         f"{v['median_ms']:>7.1f} {v['allgather_over_method']:>5.2f} "
                         f"{v['allgather_over_method_paired']:>6.2f} {'yes' if v['bit_identical'] else 'NO':>4}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,3,4,5,6,7,8", help="comma-separated world sizes >= 2")
    p.add_argument("--size", type=int, default=2**20, help="float32 elements (default 2**20)")
    p.add_argument("--repeat", type=int, default=7, help="timed rounds per world (default 7)")
    p.add_argument("--json", default=None, help="write the results and settings to this file")
    args = p.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds must be comma-separated integers, got {args.worlds!r}")
    if min(worlds) < 2 or args.size < 1 or args.repeat < 1:
        p.error("--worlds must be >= 2, --size >= 1 and --repeat >= 1")
    from gradcomp.launch import launch

    config = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "worlds": worlds, "size": args.size,
              "repeat": args.repeat, "torch": torch.__version__, "transport": "gloo over loopback",
              "compressor": "TopK(ratio=0.01, values=Int8Quantizer())",
              "command": " ".join(["python", "benchmarks/sparse_reduce_scatter.py"] + sys.argv[1:])}
    rows = launch(_worker, max(worlds), (worlds, args.size, args.repeat), timeout=3600)[0]
    config["loadavg_after"] = os.getloadavg()
    print(f"{config['date']}, commit {config['commit']}, {config['cpus']} CPUs, load "
          f"{config['loadavg_before'][0]:.1f} -> {config['loadavg_after'][0]:.1f}, {args.size} elements, "
          f"top-k 1% + int8, {args.repeat} interleaved rounds (medians of the slowest rank)")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
