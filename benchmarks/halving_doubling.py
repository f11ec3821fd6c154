"""Halving-doubling against the ring: int8 allreduce of small buckets on loopback.

    python benchmarks/halving_doubling.py [--world 8] [--sizes 4096,8192,16384,32768,65536]
                                          [--repeat 21] [--json FILE]

``--world`` ranks (gradcomp.launch, gloo over loopback) each hold ``randn(n)``
(seed = rank) and average it with each method, each on its own process group
(agreed once, in the warm-up): ``torch all_reduce f32`` (``dist.all_reduce``),
``int8 ring``, ``int8 two_phase`` and ``int8 halving_doubling``. The calls
run in interleaved rounds (every method once per round, the order reversed
every other round), after two warm-up calls each, so a change of the host's
load hits every method alike. Reported per size and method: the median over
the rounds of the slowest rank's wall time per call; ``ring/x``: the ring's
median over the method's, and the median over rounds of the paired ratio
(the ring's call and the method's in the same round); messages and bytes the
busiest rank sent per call (gradcomp's meter; torch's: not metered); and
whether every rank returned the same bytes (on every timed call).
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

METHODS = ("torch all_reduce f32", "int8 ring", "int8 two_phase", "int8 halving_doubling")
RING = "int8 ring"


def _call(name: str, buf: torch.Tensor, group, meter, world: int):
    import gradcomp as gc

    if name == METHODS[0]:
        buf.div_(world)
        dist.all_reduce(buf, group=group)
        return
    meter.reset()
    gc.allreduce(buf, gc.Int8Quantizer(), algorithm=name.split(" ", 1)[1], group=group, meter=meter, out=buf)


def _same_everywhere(buf: torch.Tensor, world: int) -> bool:
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return all(torch.equal(out[0], t) for t in out)


def _worker(rank: int, world: int, sizes: list[int], repeat: int) -> list[dict] | None:
    import gradcomp as gc

    groups = {m: dist.new_group(list(range(world))) for m in METHODS}
    meters = {m: gc.TrafficMeter() for m in METHODS}
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        buf = torch.empty_like(x)
        for m in METHODS:
            for _ in range(2):
                buf.copy_(x)
                _call(m, buf, groups[m], meters[m], world)
        times = {m: [] for m in METHODS}
        same = {m: True for m in METHODS}
        for i in range(repeat):
            for m in (METHODS if i % 2 == 0 else METHODS[::-1]):
                buf.copy_(x)
                dist.barrier()
                t0 = time.perf_counter()
                _call(m, buf, groups[m], meters[m], world)
                times[m].append(time.perf_counter() - t0)
                same[m] = same[m] and _same_everywhere(buf, world)
        sent = {m: (meters[m].bytes_sent, sum(c.messages_sent for c in meters[m].phases.values()))
                for m in METHODS}
        every = [None] * world
        dist.all_gather_object(every, (times, same, sent))
        if rank == 0:
            rows.append(_row(n, world, repeat, every))
    return rows if rank == 0 else None


def _row(n: int, world: int, repeat: int, every) -> dict:
    slowest = {m: [max(t[m][i] for t, _, _ in every) for i in range(repeat)] for m in METHODS}
    out = {"numel": n, "world": world, "methods": {}}
    for m in METHODS:
        paired = statistics.median(slowest[RING][i] / slowest[m][i] for i in range(repeat))
        out["methods"][m] = {
            "median_ms": 1e3 * statistics.median(slowest[m]),
            "ring_over_method": statistics.median(slowest[RING]) / statistics.median(slowest[m]),
            "ring_over_method_paired": paired,
            "bytes_sent_max": None if m == METHODS[0] else max(s[m][0] for _, _, s in every),
            "messages_sent_max": None if m == METHODS[0] else max(s[m][1] for _, _, s in every),
            "bit_identical": all(same[m] for _, same, _ in every),
        }
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _table(rows: list[dict]) -> str:
    head = (f"{'numel':>7} {'method':<24} {'ms':>8} {'ring/x':>7} {'paired':>7} {'msgs':>5} {'bytes':>8} "
            f"{'same':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        for m, v in r["methods"].items():
            msgs = "-" if v["messages_sent_max"] is None else str(v["messages_sent_max"])
            nbytes = "-" if v["bytes_sent_max"] is None else str(v["bytes_sent_max"])
            lines.append(f"{r['numel']:>7} {m:<24} {v['median_ms']:>8.2f} {v['ring_over_method']:>7.2f} "
                         f"{v['ring_over_method_paired']:>7.2f} {msgs:>5} {nbytes:>8} "
                         f"{'yes' if v['bit_identical'] else 'NO':>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=8, help="ranks (default 8)")
    p.add_argument("--sizes", default="4096,8192,16384,32768,65536",
                   help="comma-separated float32 element counts (default 2**12 .. 2**16)")
    p.add_argument("--repeat", type=int, default=21, help="timed rounds (default 21)")
    p.add_argument("--json", default=None, help="write the results and settings to this file")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if args.world < 2 or args.repeat < 1 or min(sizes) < 1:
        p.error("--world must be >= 2, --repeat >= 1 and every size >= 1")
    from gradcomp.launch import launch

    config = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "world": args.world, "sizes": sizes,
              "repeat": args.repeat, "torch": torch.__version__, "transport": "gloo over loopback",
              "command": " ".join(["python", "benchmarks/halving_doubling.py"] + sys.argv[1:])}
    rows = launch(_worker, args.world, (sizes, args.repeat), timeout=3600)[0]
    config["loadavg_after"] = os.getloadavg()
    print(f"{config['date']}, commit {config['commit']}, {config['cpus']} CPUs, load "
          f"{config['loadavg_before'][0]:.1f} -> {config['loadavg_after'][0]:.1f}, world {args.world}, "
          f"{args.repeat} interleaved rounds (medians of the slowest rank)")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
