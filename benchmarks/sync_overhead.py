"""What the adaptive strategy adds to a synchronisation: local SGD's sync step, auto against fixed.

On the emulated cluster (one host per rank, tbf-shaped links; needs root and iproute2), every
rank trains a 215k-parameter MLP (the size of the study's mnist-cnn) for ``--steps`` inner
steps with a fixed compute of ``--compute-ms`` per step (a sleep: the same on every rank), and
times ``LocalSGD.step()`` at each synchronisation, for

- ``auto``: ``LocalSGD(sync_every="auto", compressor="auto")`` (the period and the codec
  chosen online, with their agreements and the divergence), and
- ``fixed``: ``LocalSGD(sync_every=H, compressor=Int8Quantizer())`` with ``H`` the period the
  auto run ended on (the same exchange, no decisions).

It prints, per mode, the median sync step (over rank 0's synchronisations after the first
five) and the ratio auto / fixed, and the median seconds of one agreement (the four-value
``MAX`` allreduce of ``gradcomp.comm.consensus.agree_max``) right after an int8 exchange.

    python benchmarks/sync_overhead.py --link 100mbit [--steps 120] [--compute-ms 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import gradcomp as gc
from gradcomp.comm.consensus import agree_max
from gradcomp.lab.cluster import LocalCluster

#: synchronisations left out of the medians (the warm-up, the first decisions, kernel timing)
SKIP = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 55), nn.ReLU(), nn.Linear(55, 10))


def _train(rank: int, world: int, sync_every, steps: int, compute_s: float) -> dict:
    model = _model()
    compressor = "auto" if sync_every == "auto" else gc.Int8Quantizer()
    ls = gc.LocalSGD(model, sync_every=sync_every, compressor=compressor, timeout=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    sync_s = []
    for _ in range(steps):
        x, y = torch.randn(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(compute_s)
        began, syncs = time.perf_counter(), ls.syncs
        ls.step(loss=loss)
        if ls.syncs != syncs:
            sync_s.append(time.perf_counter() - began)
    ls.close()
    return {"sync_s": sync_s, "sync_every": ls.sync_every}


def _agreement(rank: int, world: int, rounds: int) -> float:
    x = torch.randn(215_370)
    residual = torch.zeros_like(x)
    seconds = []
    for _ in range(rounds):
        y = x.clone()
        gc.allreduce(y, gc.Int8Quantizer(), op="avg", residual=residual, out=y, key="x")
        began = time.perf_counter()
        agree_max([1.0, 2.0, 3.0, 4.0], dist.group.WORLD, 30, torch.device("cpu"))
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[SKIP:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="100mbit", help="the emulated link (gradcomp.cluster.LINKS or a rate)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--compute-ms", type=float, default=30.0)
    args = p.parse_args(argv)
    with LocalCluster(args.workers, rate=args.link) as cluster:
        auto = cluster.run(_train, "auto", args.steps, args.compute_ms / 1e3)[0]
        h = auto["sync_every"]
        fixed = cluster.run(_train, h, args.steps, args.compute_ms / 1e3)[0]
        agreement = cluster.run(_agreement, 40)
    a, f = (statistics.median(r["sync_s"][SKIP:]) for r in (auto, fixed))
    print(f"link {args.link}, {args.workers} hosts x 1 rank, {args.steps} steps, compute {args.compute_ms:g} ms/step")
    print(f"auto:  {len(auto['sync_s'])} synchronisations, ended at H={h}, median sync step {1e3 * a:.2f} ms")
    print(f"fixed: {len(fixed['sync_s'])} synchronisations at H={h} (int8), median sync step {1e3 * f:.2f} ms")
    print(f"auto / fixed: {a / f:.3f}")
    print("one agreement after an int8 exchange, median per rank: "
          + ", ".join(f"{1e3 * s:.2f}" for s in agreement) + " ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
