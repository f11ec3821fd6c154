"""Hugging Face Accelerate with gradcomp's int8 allreduce hook, on 2 CPU processes (gloo).

``accelerator.prepare`` wraps the model in DistributedDataParallel; register
gradcomp's hook on that prepared model.

Run: python examples/accelerate_ddp.py [--steps N]   (starts 2 processes through torchrun)
 or: accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py
(needs: pip install "gradcomp[integrations]")
"""

import argparse
import os
import subprocess
import sys

import torch
import torch.nn as nn


def main(steps: int) -> None:
    from accelerate import Accelerator

    import gradcomp as gc

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(512, 256), torch.randint(0, 10, (512,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    meter = gc.TrafficMeter()
    # compress from the first step and every bucket (the defaults warm up with 2 plain steps)
    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer(), error_feedback=True, algorithm="ring",
                                 meter=meter, start_iter=0, min_compress_numel=0)
    model.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
    state.close()
    print(f"rank {accelerator.process_index}: {steps} steps, sent {meter.bytes_sent:,} bytes, "
          f"float32 ring would send {meter.raw_bytes_sent:,}: {meter.compression_ratio:.2f}x", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun / accelerate launch: one rank
        main(args.steps)
    else:  # start 2 local ranks of this script (a free port, gloo on CPU)
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", __file__, "--steps", str(args.steps)]))
