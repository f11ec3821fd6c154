"""FSDP2 HSDP on a 2x2 mesh: torch's own replicate all-reduce against gradcomp's int8 ones, on loopback.

    python benchmarks/hsdp.py [--link none|RATE] [--width 1024] [--layers 4] [--batch 32]
                              [--repeat 11] [--json FILE]

4 ranks (gloo) form a ``(replicate 2, shard 2)`` mesh, ranks ``{0, 1}`` and
``{2, 3}`` on two hosts (``gc.Topology(ranks_per_host=2)``): with ``--link
none`` (the default) all on loopback (one tier: the hosts are labels for the
meter), with ``--link 100mbit`` (any ``tc`` rate) on the emulated two-tier
cluster (``LocalCluster(hosts=2, ranks_per_host=2)``: the hosts' loopback
unshaped, the link between them shaped to the rate). Each method trains its own copy of
the same MLP (``--layers`` Linear(width, width) + Tanh, each its own FSDP
module) with SGD on the same batches (``randn``, seed = step and rank):
``torch HSDP f32`` (plain ``fully_shard``: gloo reduce-scatter and all-reduce),
and ``gc.fsdp.apply`` with ``Int8Quantizer`` across the replicate dimension by
``ring``, ``two_phase`` and ``hierarchical`` (FSDP's exact reduce-scatter inside
the shard group). Steps run in interleaved rounds (every method once per round,
the order reversed every other round) after two warm-up steps each. Reported per
method: the median over rounds of the slowest rank's step time (forward,
backward, optimizer step), ``f32/x``: torch's median over the method's and the
median of the paired ratio; the bytes a rank sent per step on each tier
(gradcomp's meter; torch's: the nominal bytes of gloo's float32 ring, which is
not metered) and whether the parameters ended bit-identical on all 4 ranks.
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
import torch.nn as nn

METHODS = ("torch HSDP f32", "int8 ring", "int8 two_phase", "int8 hierarchical")
BASE = METHODS[0]


def _model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def _build(method: str, width: int, layers: int, mesh):
    import gradcomp as gc
    from torch.distributed.fsdp import fully_shard

    model = _model(width, layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    meter = None
    if method != BASE:
        meter = gc.TrafficMeter()
        gc.fsdp.apply(model, gc.Int8Quantizer(), meter=meter, algorithm=method.split(" ", 1)[1],
                      topology=gc.Topology(ranks_per_host=2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), meter


def _step(model, opt, rank: int, step: int, batch: int, width: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, width, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _nominal_f32(width: int, layers: int) -> dict:
    """Bytes a rank of torch's HSDP sends per step: gloo's float32 ring reduce-scatter over the
    shard group of 2 (one output's worth) and ring all-reduce over the replicate group of 2 (the same)."""
    m = layers * (width // 2) * width + layers * (width // 2)  # dim 0 split in 2: weight and bias rows
    return {"intra_host": 4 * m, "inter_host": 4 * m}


def _identical(model) -> bool:
    flat = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], t) for t in out)


def _worker(rank: int, world: int, width: int, layers: int, batch: int, repeat: int) -> list | None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    runs = {m: _build(m, width, layers, mesh) for m in METHODS}
    step = 0
    for m in METHODS:
        for k in range(2):
            _step(*runs[m][:2], rank, k, batch, width)
    for m in METHODS:
        if runs[m][2] is not None:
            runs[m][2].reset()
    times = {m: [] for m in METHODS}
    for i in range(repeat):
        step = 2 + i
        for m in (METHODS if i % 2 == 0 else METHODS[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            _step(*runs[m][:2], rank, step, batch, width)
            times[m].append(time.perf_counter() - t0)
    tiers = {m: ({t: c["bytes_sent"] / repeat for t, c in runs[m][2].as_dict()["tiers"].items()}
                 if runs[m][2] is not None else _nominal_f32(width, layers)) for m in METHODS}
    same = {m: _identical(runs[m][0]) for m in METHODS}
    every = [None] * world
    dist.all_gather_object(every, (times, tiers))
    if rank:
        return None
    slowest = {m: [max(t[m][i] for t, _ in every) for i in range(repeat)] for m in METHODS}
    rows = []
    for m in METHODS:
        rows.append({"method": m, "median_ms": 1e3 * statistics.median(slowest[m]),
                     "base_over_method": statistics.median(slowest[BASE]) / statistics.median(slowest[m]),
                     "base_over_method_paired": statistics.median(slowest[BASE][i] / slowest[m][i]
                                                                  for i in range(repeat)),
                     "intra_bytes_per_step": max(tr[m].get("intra_host", 0) for _, tr in every),
                     "inter_bytes_per_step": max(tr[m].get("inter_host", 0) for _, tr in every),
                     "metered": m != BASE, "bit_identical": same[m]})
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _table(rows: list[dict]) -> str:
    head = f"{'method':<20} {'ms':>9} {'f32/x':>6} {'paired':>7} {'intra B/step':>13} {'inter B/step':>13} {'same':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "" if r["metered"] else "*"
        lines.append(f"{r['method']:<20} {r['median_ms']:>9.1f} {r['base_over_method']:>6.2f} "
                     f"{r['base_over_method_paired']:>7.2f} {int(r['intra_bytes_per_step']):>12}{mark:1} "
                     f"{int(r['inter_bytes_per_step']):>12}{mark:1} {'yes' if r['bit_identical'] else 'NO':>5}")
    lines.append("* nominal bytes of gloo's float32 rings (not metered)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="none", help="'none' (loopback) or the inter-host rate, e.g. 100mbit")
    p.add_argument("--width", type=int, default=1024, help="features of each Linear (even; default 1024)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    p.add_argument("--repeat", type=int, default=11, help="timed rounds (default 11)")
    p.add_argument("--json", default=None, help="write the results and settings to this file")
    args = p.parse_args(argv)
    if args.width < 2 or args.width % 2 or args.layers < 1 or args.batch < 1 or args.repeat < 1:
        p.error("--width must be even and >= 2; --layers, --batch and --repeat >= 1")
    config = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(), "host": platform.node(),
              "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "mesh": "2x2 (replicate, shard)",
              "width": args.width, "layers": args.layers, "batch": args.batch, "repeat": args.repeat,
              "torch": torch.__version__, "transport": "gloo over loopback (one tier, unshaped)",
              "command": " ".join(["python", "benchmarks/hsdp.py"] + sys.argv[1:])}
    work = (args.width, args.layers, args.batch, args.repeat)
    if args.link == "none":
        from gradcomp.launch import launch

        rows = launch(_worker, 4, work, timeout=3600)[0]
    else:
        from gradcomp.lab.cluster import LocalCluster
        from gradcomp.lab.units import format_rate

        with LocalCluster(hosts=2, ranks_per_host=2, rate=args.link) as c:
            rows = c.run(_worker, *work, timeout=3600)[0]
            config["transport"] = (f"gloo on LocalCluster(hosts=2, ranks_per_host=2): inter-host {args.link} "
                                   f"(achieved {format_rate(c.achieved_bps)}), intra-host unshaped (achieved "
                                   f"{format_rate(c.intra_achieved_bps)})")
    config["loadavg_after"] = os.getloadavg()
    print(f"{config['date']}, commit {config['commit']}, {config['cpus']} CPUs, load "
          f"{config['loadavg_before'][0]:.1f} -> {config['loadavg_after'][0]:.1f}, 2x2 mesh, {config['transport']}, "
          f"{args.repeat} interleaved rounds (medians of the slowest rank)")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
