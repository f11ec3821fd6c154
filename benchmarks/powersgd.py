"""gradcomp's PowerSGD against PyTorch's powerSGD_hook: bytes, collectives and time per DDP step.

On ``--world`` gloo ranks of this machine (loopback), the study's wide MLP (64 -> 1024 -> 1024 ->
10, 1.13 M parameters, the digits workload's shapes) is trained with SGD under DDP three times in
the same processes, from the same initial parameters on the same batches, step by step
interleaved (a barrier before each step, so that load from other processes hits all alike):

* ``torch``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=R,
  start_powerSGD_iter=2, min_compression_rate=2)`` (error feedback, warm start: its defaults);
* ``gradcomp``: ``GradCompState(compressor=gc.PowerSGD(rank=R), start_iter=2)`` (its defaults:
  FP16 factors summed by the backend's allreduce, the vectors riding with P: two collectives);
* ``gradcomp-f32``: the same with ``gc.PowerSGD(rank=R, compressor=gc.NoCompression())`` (float32
  factors on the backend's allreduce: PyTorch's bytes in two collectives instead of three);
* ``gradcomp-ring``: ``gc.PowerSGD(rank=R, exchange="gradcomp")`` (the FP16 codec on gradcomp's
  own ring);
* ``gradcomp-alt``: ``gc.PowerSGD(rank=R, alternating=True)`` (FP16 factors on the backend's
  allreduce, half a power iteration per step: the P's, then the Q's on the next step, the
  vectors riding with either: one collective).

``--profile`` then times, on the same ranks and link, the parts of a step: the local
forward, backward and optimizer step without DDP; each collective of each variant alone
(``dist.all_reduce`` of PyTorch's three float32 buffers and of gradcomp's two float16 ones, and
gradcomp's ring of the FP16 payloads); and the orthonormalization of the P's (PyTorch's
``_orthogonalize`` per matrix, gradcomp's QR per shape).

Bytes per step: as the meter counts them (bytes this rank sent): a backend allreduce at the
nominal ring volume ``2 (N - 1) / N * s n`` (``s`` bytes per element: gloo picks its own
algorithm), gradcomp's ring at its wire bytes, headers included; torch's hook counted per bucket
by :class:`gradcomp.lab.study.torch_powersgd.TorchPowerSGD` from the bucket's gradient shapes. Collectives per step: torch's hook waits on three
per bucket, gradcomp's on two (``gradcomp-alt`` on one). Step time: the median over the steps after ``--warmup`` of the
slowest rank. Final loss: each variant's training loss at the last step (the same data). Every
variant runs DDP with one bucket (``bucket_cap_mb=64``: see :data:`BUCKET_MB`).

Run from the repository root::

    python benchmarks/powersgd.py [--world 4] [--rank 4] [--batch 64] [--steps 60] [--warmup 10]
        [--link 100mbit] [--profile] [--json FILE]

``--link RATE`` runs every rank as its own host of the emulated cluster
(:class:`gradcomp.lab.cluster.LocalCluster`, shaped links at RATE).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.lab.study.torch_powersgd import TorchPowerSGD
from gradcomp.launch import launch

VARIANTS = ("torch", "gradcomp", "gradcomp-f32", "gradcomp-ring", "gradcomp-alt")
HIDDEN = (1024, 1024)
BATCH = 64
#: one bucket for every variant: powerSGD_hook waits on its next allreduce inside a future's
#: callback, and on gloo with two buckets in flight the ranks then issue their collectives in
#: different orders and hang (as seen here with DDP's default 1 MiB first bucket)
BUCKET_MB = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    dims = (64, *HIDDEN, 10)
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _rank(rank: int, world: int, r: int, steps: int, warmup: int, batch: int, profile: bool) -> dict:
    ddps, meters, counted = {}, {}, None
    for variant in VARIANTS:
        ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
        meters[variant] = gc.TrafficMeter()
        if variant == "torch":  # its defaults: error feedback, warm start, float32
            counted = TorchPowerSGD(rank=r, start_iter=2, min_compression_rate=2, meter=meters[variant])
            ddp.register_comm_hook(None, counted.hook)
        else:
            comp = gc.PowerSGD(rank=r, compressor=gc.NoCompression() if variant == "gradcomp-f32" else None,
                               exchange="gradcomp" if variant == "gradcomp-ring" else "auto",
                               alternating=variant == "gradcomp-alt")
            ddp.register_comm_hook(GradCompState(compressor=comp, start_iter=2, meter=meters[variant], timeout=300),
                                   compressed_allreduce_hook)
        ddps[variant] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))  # a linear teacher: the same on every rank
    times = {v: [] for v in VARIANTS}
    phases = {v: [] for v in VARIANTS}  # (forward, backward with the hook's wait, optimizer) seconds
    losses = {}
    sent0 = {}
    for step in range(steps):
        x = torch.randn(batch, 64, generator=gen)
        y = (x @ w).argmax(1)
        if step == warmup:
            sent0 = {v: m.as_dict()["bytes_sent"] for v, m in meters.items()}
            torch_calls0 = counted.allreduces
        for variant in VARIANTS:
            ddp, opt = ddps[variant]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            times[variant].append(time.perf_counter() - t0)
            phases[variant].append((t1 - t0, t2 - t1, t0 + times[variant][-1] - t2))
            losses[variant] = loss.item()
    n = steps - warmup
    per_step = {v: (m.as_dict()["bytes_sent"] - sent0[v]) / n for v, m in meters.items()}
    return {"step_s": {v: statistics.median(t[warmup:]) for v, t in times.items()}, "bytes": per_step,
            "torch_allreduces": (counted.allreduces - torch_calls0) / n, "loss": losses,
            "phases": {v: [statistics.median(p[i] for p in ph[warmup:]) for i in range(3)] for v, ph in phases.items()},
            "profile": _profile(r, batch, w, gen) if profile else {}}


def _no_exchange(_, bucket):  # unannotated: DDP rejects a string annotation
    """A DDP hook that leaves each rank's own gradients: DDP's cost without communication."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _timed(fn, reps: int = 15) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, each after a barrier."""
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _profile(r: int, batch: int, w: torch.Tensor, gen: torch.Generator) -> dict:
    """Seconds of a step's parts, each alone (see the module docstring)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(batch, 64, generator=gen)
    y = (x @ w).argmax(1)

    def compute():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    shapes = [p.shape for p in model.parameters()]
    psgd = gc.PowerSGD(rank=r)
    mats = [m for m in map(psgd.matrix, shapes) if m is not None]
    n_p, n_q = sum(m[0] * m[2] for m in mats), sum(m[1] * m[2] for m in mats)
    n_vec = psgd.wire_numel(shapes)[0] - n_p
    out = {"compute (fwd+bwd+SGD, no DDP)": _timed(compute)}
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(None, _no_exchange)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def ddp_step():
        opt_ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt_ddp.step()

    out["DDP step, a hook that sends nothing"] = _timed(ddp_step)
    one = torch.zeros(1)
    out["allreduce of 1 float (a round's fixed cost)"] = _timed(lambda: dist.all_reduce(one))
    for name, n, dtype in (("torch: allreduce f32 vectors", n_vec, torch.float32),
                           ("torch: allreduce f32 P's", n_p, torch.float32),
                           ("torch: allreduce f32 Q's", n_q, torch.float32),
                           ("gradcomp: allreduce f16 P's+vectors", n_p + n_vec, torch.float16),
                           ("gradcomp: allreduce f16 Q's", n_q, torch.float16),
                           ("gradcomp-alt: allreduce f16 Q's+vectors", n_q + n_vec, torch.float16)):
        t = torch.randn(n).to(dtype)
        out[name] = _timed(lambda t=t: dist.all_reduce(t))
    for name, n in (("gradcomp-ring: FP16 ring P's+vectors", n_p + n_vec), ("gradcomp-ring: FP16 ring Q's", n_q)):
        t = torch.randn(n)
        out[name] = _timed(lambda t=t: gc.allreduce(t, gc.FP16(), timeout=300, check=False))
    ps = [torch.randn(m[0], m[2]) for m in mats]
    # each its own batch of one: the shapes differ (torch: QR above rank 2, else Gram-Schmidt)
    out["torch: orthogonalize the P's"] = _timed(lambda: [torch_psgd._orthogonalize(p.unsqueeze(0).clone()) for p in ps])
    out["gradcomp: orthonormalize the P's"] = _timed(lambda: [gc.powersgd.orthonormalize(p.unsqueeze(0)) for p in ps])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"samples per rank and step (default {BATCH})")
    p.add_argument("--profile", action="store_true", help="also time each part of a step alone")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--link", default="none", help="none (loopback) or a rate between hosts, e.g. 100mbit")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.world < 2 or args.steps <= args.warmup or args.warmup < 3:
        p.error("--world must be >= 2, --warmup >= 3 (after the plain steps), --steps > --warmup")
    link = "loopback"
    if args.link == "none":
        res = launch(_rank, args.world, (args.rank, args.steps, args.warmup, args.batch, args.profile),
                     timeout=3000)
    else:  # one host (network namespace) per rank, shaped links between them
        from gradcomp.lab.cluster import LocalCluster
        from gradcomp.lab.units import format_rate

        with LocalCluster(args.world, rate=args.link) as c:
            res = c.run(_rank, args.rank, args.steps, args.warmup, args.batch, args.profile, timeout=3000)
            link = f"{args.link}, achieved {format_rate(c.achieved_bps)}"
    step = {v: max(r["step_s"][v] for r in res) for v in VARIANTS}
    nbytes = {v: res[0]["bytes"][v] for v in VARIANTS}
    print(f"wide MLP 64-1024-1024-10, world {args.world} ({link}, gloo), PowerSGD rank {args.rank}, "
          f"batch {args.batch} per rank, {args.steps - args.warmup} steps after {args.warmup} "
          f"(median step of the slowest rank)")
    print(f"  torch powerSGD_hook: {res[0]['torch_allreduces']:.0f} allreduces per step")
    for v in VARIANTS:
        print(f"  {v:13s} {nbytes[v]:12,.0f} B/step  x{nbytes['torch'] / nbytes[v]:.2f} fewer   "
              f"{step[v] * 1e3:8.2f} ms/step  torch/this x{step['torch'] / step[v]:.2f}   "
              f"loss {res[0]['loss'][v]:.4f}")
    if args.profile:
        print("  phases of a step (median, slowest rank): forward / backward with the hook's wait / optimizer")
        for v in VARIANTS:
            ph = [max(r["phases"][v][i] for r in res) * 1e3 for i in range(3)]
            print(f"    {v:13s} {ph[0]:8.2f} / {ph[1]:8.2f} / {ph[2]:8.2f} ms")
        print("  parts of a step, each alone (median, slowest rank):")
        for part in res[0]["profile"]:
            print(f"    {part:40s} {max(r['profile'][part] for r in res) * 1e3:8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": res}, f, indent=1)


if __name__ == "__main__":
    main()
