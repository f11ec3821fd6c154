"""FSDP2 (fully_shard) with gradcomp's int8 reduce-scatter, on 2 local CPU processes.

Trains the same small MLP twice from the same start on the same data: with
plain FSDP2 and with gc.fsdp.apply (int8 gradient reduce-scatter with error
feedback, and with --allgather also 8-bit parameter all-gather in forward),
then prints both loss curves and the bytes each rank sent per step next to
what uncompressed FSDP2 sends for the same collectives.

Run: python examples/fsdp2.py [--steps 60] [--allgather]
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp as gc
from gradcomp.lab.cluster import launch_on, link_argument

DIM, HIDDEN, CLASSES, BATCH = 64, 512, 10, 64


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def batch(rank, step):
    """A fixed random teacher labels Gaussian inputs; each rank draws its own batches."""
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(DIM, CLASSES, generator=teacher)
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, (x @ w).argmax(dim=1)


def train(rank, world_size, steps, compress, allgather):
    model = make_model()
    mesh = init_device_mesh("cpu", (world_size,))  # fully_shard's default is CUDA wherever it exists
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    meter = gc.TrafficMeter()
    rs = None
    if compress:
        rs = gc.fsdp.apply(model, compressor=gc.Int8Quantizer(), error_feedback=True, meter=meter,
                           allgather=gc.Int8Quantizer() if allgather else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world_size)
    err = rs.allgather.max_relative_error if rs is not None and rs.allgather is not None else None
    return {"losses": losses, "phases": meter.as_dict()["phases"], "allgather_error": err,
            "seconds_per_step": (time.perf_counter() - t0) / steps}


def worker(rank, world_size, steps, allgather):
    # launch() has already joined the gloo process group; under torchrun call
    # torch.distributed.init_process_group("gloo") (or gc.launch.init_from_env()) first
    return train(rank, world_size, steps, False, False), train(rank, world_size, steps, True, allgather)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--allgather", action="store_true", help="also all-gather parameters in 8 bits (forward)")
    ap.add_argument("--link", default="none",
                    help="none (loopback) or a rate such as 100mbit: the two ranks in an emulated "
                         "cluster (gradcomp.lab.cluster; needs root and iproute2)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        link = link_argument(args.link)
    except ValueError as e:
        ap.error(f"--link: {e}")
    out, info = launch_on(link, worker, 2, (args.steps, args.allgather), timeout=1200)
    plain, ours = out[0]
    where = ("loopback" if not info["configured_bps"] else
             f"link {info['name']} (achieved {info['achieved_bps'] / 1e6:.1f} Mbit/s)")
    print(f"2 ranks, {where}: {1e3 * plain['seconds_per_step']:.1f} ms per step with FSDP2's own "
          f"collectives, {1e3 * ours['seconds_per_step']:.1f} ms with gradcomp's "
          f"({plain['seconds_per_step'] / ours['seconds_per_step']:.2f}x)")
    print("step  loss FSDP2  loss gradcomp")
    for s in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{s:4d}  {plain['losses'][s]:10.4f}  {ours['losses'][s]:13.4f}")
    print(f"{args.steps - 1:4d}  {plain['losses'][-1]:10.4f}  {ours['losses'][-1]:13.4f}")
    ph = ours["phases"]
    rsc = ph["reduce_scatter"]
    print(f"gradient reduce-scatter, bytes sent per rank per step: {rsc['bytes_sent'] / args.steps:,.0f} "
          f"(uncompressed FSDP2: {rsc['raw_bytes_sent'] / args.steps:,.0f}): "
          f"{rsc['raw_bytes_sent'] / rsc['bytes_sent']:.2f}x fewer")
    if args.allgather:
        ag, ex = ph["allgather"], ph.get("allgather_exact", {"bytes_sent": 0, "raw_bytes_sent": 0})
        sent, raw = ag["bytes_sent"] + ex["bytes_sent"], ag["raw_bytes_sent"] + ex["raw_bytes_sent"]
        print(f"parameter all-gather (8-bit forward, exact backward), bytes per rank per step: "
              f"{sent / args.steps:,.0f} (uncompressed FSDP2: {raw / args.steps:,.0f}): {raw / sent:.2f}x fewer; "
              f"largest relative error of a gathered shard: {ours['allgather_error']:.2e}")


if __name__ == "__main__":
    main()
