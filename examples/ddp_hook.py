"""DDP with gradcomp's compressed allreduce hook, on 2 local processes.

Run: python examples/ddp_hook.py
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.launch import launch


def worker(rank, world_size):
    # launch() has already joined the gloo process group; under torchrun call
    # torch.distributed.init_process_group("gloo") (or gc.launch.init_from_env()) first
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)))
    meter = gc.TrafficMeter()
    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer(), error_feedback=True,
                                 algorithm="ring", meter=meter)
    model.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for step in range(20):
        x = torch.randn(64, 256, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    state.close()
    return meter.as_dict()


if __name__ == "__main__":
    stats = launch(worker, 2)
    for rank, d in enumerate(stats):
        # the hook's first start_iter=2 steps are plain float32 allreduces (DDP
        # rebuilds its buckets after step 1): they pull the overall ratio down
        compressed = {k: p for k, p in d["phases"].items() if k != "plain_allreduce"}
        sent = sum(p["bytes_sent"] for p in compressed.values())
        raw = sum(p["raw_bytes_sent"] for p in compressed.values())
        print(f"rank {rank}: sent {d['bytes_sent']:,} bytes, "
              f"float32 ring would send {d['raw_bytes_sent']:,}: {d['compression_ratio']:.2f}x overall; "
              f"{raw / sent:.2f}x on the compressed steps (the first 2 steps are uncompressed warm-up)")
