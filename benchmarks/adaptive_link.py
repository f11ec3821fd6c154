"""Adaptive compression against fixed codecs on an emulated link (loopback + a delay per byte).

The study's sync setting (scikit-learn digits, MLP 64-384-256-10, DDP with
gradcomp's hook, SGD lr 0.1 momentum 0.9, batch 64 per worker) on ``--workers``
local gloo processes, once per codec, on each emulated link. The link: after
each bucket's collective, the communication thread sleeps ``wire bytes this
rank sent x 8 / rate`` (the serialization time of those bytes on a link of
that rate, on top of the real loopback transfer), inside the adaptive policy's
``timing`` hook, so the policy measures it and the step waits for it like
for a slower link. Every codec runs through the same hook: a fixed codec is
an :class:`gradcomp.Adaptive` with one candidate (error feedback on for every
lossy codec).

Reported per link and codec: time to target (training seconds on rank 0 until
the first snapshot whose test accuracy reaches ``--target``; parameters are
snapshotted every ``--snap-every`` steps and evaluated after training, so
evaluation costs no training time), seconds per step, final accuracy, the
codec ``auto`` settled on (the last one of its bucket) and its switches.

    python benchmarks/adaptive_link.py [--links 10gbit,100mbit] [--steps 300] [--seeds 0,1]
                                       [--target 0.95] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradcomp as gc
from gradcomp.adaptive import DEFAULT_CANDIDATES, Timing
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.launch import launch
from gradcomp.lab.study.data import load_digits_split, worker_batches
from gradcomp.lab.study.model import evaluate, make_model

RATES = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9}
CODECS = ("none", "fp16", "int8", "topk-int8", "auto")
LABELS = {"none": "none", "fp16": "fp16+ef", "int8": "int8+ef", "topk-int8": "topk1%+int8+ef", "auto": "auto"}
BATCH, LR, MOMENTUM = 64, 0.1, 0.9


class EmulatedLink:
    """``timing`` hook: sleep the serialization time of the bytes sent at
    ``bits_per_s`` and add it to the measured communication time."""

    def __init__(self, bits_per_s: float):
        self.bits_per_s = bits_per_s

    def __call__(self, s: Timing) -> Timing:
        delay = s.wire_bytes * 8 / self.bits_per_s
        time.sleep(delay)
        return dataclasses.replace(s, comm_s=s.comm_s + delay)


def _run(rank, world, codec, bits_per_s, steps, seed, snap_every, interval):
    data = load_digits_split(0.25, seed)
    model = make_model(seed, in_features=data.num_features, num_classes=data.num_classes)
    ddp = DistributedDataParallel(model)
    meter = gc.TrafficMeter()
    policy = gc.Adaptive(DEFAULT_CANDIDATES if codec == "auto" else [codec], interval=interval,
                         timing=EmulatedLink(bits_per_s))
    state = GradCompState(compressor=policy, min_compress_numel=0, start_iter=0, meter=meter, timeout=120)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    snaps, times, codecs = [], [], []
    dist.barrier()
    t0 = time.perf_counter()
    for step, idx in enumerate(worker_batches(len(data.y_train), world, rank, BATCH, seed, steps), 1):
        loss = nn.functional.cross_entropy(ddp(data.x_train[idx]), data.y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        codecs.append(policy.codec(0))
        if rank == 0 and (step % snap_every == 0 or step == steps):
            times.append(time.perf_counter() - t0)  # before the copy: snapshots cost no training time
            snaps.append((step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    wall = time.perf_counter() - t0
    state.close()
    return {"snaps": snaps, "times": times, "wall_s": wall, "codecs": codecs,
            "switches": meter.as_dict()["switches"], "bytes_per_step": meter.bytes_sent / steps}


def _all(rank, world, links, codecs, steps, seeds, snap_every, interval):
    out = []
    for link in links:
        for seed in seeds:
            for codec in codecs:
                out.append((link, seed, codec, _run(rank, world, codec, RATES[link], steps, seed, snap_every,
                                                     interval)))
    return out


def _time_to_target(run, seed, target):
    data = load_digits_split(0.25, seed)
    model = make_model(seed, in_features=data.num_features, num_classes=data.num_classes)
    acc = None
    for (step, sd), t in zip(run["snaps"], run["times"]):
        model.load_state_dict(sd)
        acc = evaluate(model, data.x_test, data.y_test)[1]
        if acc >= target:
            return t, step, acc
    return None, None, acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="10gbit,100mbit")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--snap-every", type=int, default=5)
    p.add_argument("--interval", type=int, default=10, help="steps between the policy's decisions")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    links = [s for s in a.links.split(",") if s]
    bad = [s for s in links if s not in RATES]
    if bad:
        print(f"adaptive_link: --links: unknown {bad}; allowed: {','.join(RATES)}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.perf_counter()
    results = launch(_all, a.workers, (links, a.codecs.split(","), a.steps, seeds, a.snap_every, a.interval), timeout=3600)[0]
    rows = []
    for link, seed, codec, run in results:
        ttt, step, acc = _time_to_target(run, seed, a.target)
        settled = run["codecs"][-1]
        rows.append({"link": link, "seed": seed, "codec": codec, "time_to_target_s": ttt, "target_step": step,
                     "final_acc": _time_to_target(run, seed, 2.0)[2], "wall_s": run["wall_s"],
                     "ms_per_step": 1e3 * run["wall_s"] / a.steps, "bytes_per_step": run["bytes_per_step"],
                     "settled": settled, "switches": run["switches"]})
    print(f"{a.workers} workers, {a.steps} steps, seeds {seeds}, target accuracy {a.target}, "
          f"decision interval {a.interval} steps; loopback + emulated serialization delay")
    print(f"{'link':8} {'seed':>4} {'codec':16} {'to target (s)':>13} {'step':>5} {'ms/step':>8} "
          f"{'final acc':>9} {'bytes/step':>11}  settled / switches")
    for r in rows:
        ttt = f"{r['time_to_target_s']:.2f}" if r["time_to_target_s"] is not None else "not reached"
        sw = ", ".join(f"{s['step']}:{s['from']}->{s['to']}" for s in r["switches"])
        print(f"{r['link']:8} {r['seed']:>4} {LABELS[r['codec']]:16} {ttt:>13} {str(r['target_step']):>5} "
              f"{r['ms_per_step']:8.1f} {r['final_acc']:9.4f} {r['bytes_per_step']:11,.0f}  "
              + (f"{r['settled']} ({sw})" if r["codec"] == "auto" else ""))
    for link in links:
        for seed in seeds:
            fixed = [r for r in rows if r["link"] == link and r["seed"] == seed and r["codec"] != "auto"
                     and r["time_to_target_s"] is not None]
            auto = next(r for r in rows if r["link"] == link and r["seed"] == seed and r["codec"] == "auto")
            if fixed and auto["time_to_target_s"] is not None:
                best = min(fixed, key=lambda r: r["time_to_target_s"])
                print(f"{link} seed {seed}: auto / best fixed ({LABELS[best['codec']]}) time to target = "
                      f"{auto['time_to_target_s'] / best['time_to_target_s']:.3f}")
    ratios = {}
    for link in links:
        per_seed = []
        for seed in seeds:
            sel = [r for r in rows if r["link"] == link and r["seed"] == seed]
            fixed = [r["time_to_target_s"] for r in sel if r["codec"] != "auto" and r["time_to_target_s"]]
            auto = [r["time_to_target_s"] for r in sel if r["codec"] == "auto" and r["time_to_target_s"]]
            if fixed and auto:
                per_seed.append(auto[0] / min(fixed))
        if per_seed:
            ratios[link] = statistics.median(per_seed)
            print(f"{link}: median over seeds of auto / best fixed = {ratios[link]:.3f}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workers": a.workers, "steps": a.steps, "target": a.target, "interval": a.interval,
                       "rows": rows, "median_ratio": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
