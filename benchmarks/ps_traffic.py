"""Parameter-server traffic per step, measured from the TrafficMeter's real byte counts.

Runs one server and ``--workers`` workers (gradcomp.launch; the parameter
server's messages travel over ZeroMQ on loopback) in sync mode
on a two-layer model of 107,200 float32 parameters. Each worker pulls the full
model once (not counted: it happens once per run), then for ``--steps`` steps
pushes a random gradient and pulls. Counted per step and worker: every byte
of the push and pull messages (control headers, bundle tables, payload
headers and data, ZMTP frame headers) and what the same messages weigh uncompressed (float32).

    python benchmarks/ps_traffic.py [--workers 2] [--steps 5] [--servers 1] [--json out.json]
                                    [--link none|100mbit|1gbit|...] [--link-jitter F]

With ``--link RATE`` every rank runs in its own network namespace of a
:class:`gradcomp.lab.cluster.LocalCluster` (links shaped to RATE both ways; the
achieved rate is measured first and printed); ``ms/step`` is then the time
on that link.

Cases: ``none`` (float32 both ways), ``int8`` (int8 push with error feedback,
int8 compressed pull), ``topk`` (top-k 1% with int8 values and error feedback,
both directions).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp import ps
from gradcomp.lab.cluster import jitter_type, launch_on, link_type, requirements_missing
from gradcomp.lab.units import format_rate

SHAPES = {"w1": (300, 256), "b1": (300,), "w2": (100, 300), "b2": (100,)}
KEYS = ("bytes_sent", "bytes_received", "raw_bytes_sent", "raw_bytes_received")


def cases() -> dict:
    return {
        "none": (None, False),
        "int8": (gc.Int8Quantizer(), True),
        "topk": (gc.TopK(ratio=0.01, values=gc.Int8Quantizer()), True),
    }


def _rank(rank: int, world_size: int, compressor, compress_pull: bool, steps: int, servers: int):
    dist.barrier()
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    if rank < servers:
        server = ps.ParameterServer(params, mode="sync", num_servers=servers, compress_pull=compress_pull,
                                    pull_compressor=None if compressor is None else compressor.clone(),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
        return {"role": "server", "traffic": server.serve()["traffic"]}
    worker = ps.Worker(params, num_servers=servers,
                       compressor=None if compressor is None else compressor.clone())
    gen = torch.Generator().manual_seed(rank)
    with worker:
        worker.pull()
        start = worker.meter.as_dict()
        t0 = time.perf_counter()
        for _ in range(steps):
            worker.push({n: torch.randn(s, generator=gen) for n, s in SHAPES.items()})
            worker.pull()
        seconds = time.perf_counter() - t0
        end = worker.meter.as_dict()
    phases = {ph: {k: end["phases"][ph][k] - start["phases"].get(ph, {}).get(k, 0) for k in KEYS}
              for ph in ("push", "pull")}
    return {"role": "worker", "phases": phases, "seconds": seconds}


def measure(name: str, workers: int, steps: int, servers: int, link: str = "none",
            link_jitter: float = 0.0) -> dict:
    compressor, compress_pull = cases()[name]
    out, info = launch_on(link, _rank, servers + workers, (compressor, compress_pull, steps, servers),
                          timeout=600, rate_jitter=link_jitter)
    ws = [o for o in out if o["role"] == "worker"]
    per = workers * steps

    def total(ph, raw):
        k_out, k_in = ("raw_bytes_sent", "raw_bytes_received") if raw else ("bytes_sent", "bytes_received")
        return sum(w["phases"][ph][k_out] + w["phases"][ph][k_in] for w in ws) / per

    push, pull = total("push", False), total("pull", False)
    raw_push, raw_pull = total("push", True), total("pull", True)
    return {
        "case": name,
        "parameters": sum(math.prod(s) for s in SHAPES.values()),
        "workers": workers, "servers": servers, "steps": steps,
        "push_bytes_per_step": push, "pull_bytes_per_step": pull,
        "raw_push_bytes_per_step": raw_push, "raw_pull_bytes_per_step": raw_pull,
        "push_ratio": raw_push / push, "pull_ratio": raw_pull / pull,
        "ratio": (raw_push + raw_pull) / (push + pull),
        "ms_per_step": 1e3 * max(w["seconds"] for w in ws) / steps,
        "link": info,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Parameter-server traffic per step (bytes, from the TrafficMeter).")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--link", type=link_type, default="none",
                   help="none (loopback, default) or a rate such as 100mbit: every rank in its own "
                        "network namespace of an emulated cluster (needs root and iproute2)")
    p.add_argument("--link-jitter", type=jitter_type, default=0.0, help="the cluster's rate_jitter (default 0)")
    args = p.parse_args(argv)
    if args.link != "none" and requirements_missing() is not None:
        p.error(f"--link {args.link} needs the emulated cluster: {requirements_missing()}")
    rows = [measure(name, args.workers, args.steps, args.servers, args.link, args.link_jitter)
            for name in cases()]
    info = rows[0]["link"]
    where = ("loopback" if not info["configured_bps"] else
             f"link {format_rate(info['configured_bps'])} (achieved {format_rate(info['achieved_bps'])})")
    print(f"{rows[0]['parameters']} parameters, {args.servers} server(s), {args.workers} workers, "
          f"{args.steps} steps, {where}; bytes per worker per step")
    print(f"{'case':6} {'push':>10} {'pull':>10} {'raw push':>10} {'raw pull':>10} "
          f"{'push x':>7} {'pull x':>7} {'total x':>8} {'ms/step':>8}")
    for r in rows:
        print(f"{r['case']:6} {r['push_bytes_per_step']:10.0f} {r['pull_bytes_per_step']:10.0f} "
              f"{r['raw_push_bytes_per_step']:10.0f} {r['raw_pull_bytes_per_step']:10.0f} "
              f"{r['push_ratio']:7.2f} {r['pull_ratio']:7.2f} {r['ratio']:8.2f} {r['ms_per_step']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
