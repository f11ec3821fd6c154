"""PyTorch Lightning DDP with gradcomp's int8 allreduce hook, on 2 CPU processes (gloo).

``gradcomp.integrations.lightning.GradCompDDPStrategy(state)`` registers gradcomp's
hook on any device: Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers
hooks on CUDA only, so on CPU it would train uncompressed (the meter reading 0).

Run: python examples/lightning_ddp.py [--steps N]   (needs: pip install "gradcomp[integrations]")
"""

import argparse

import lightning as L
import torch
import torch.nn as nn

import gradcomp as gc
from gradcomp.integrations.lightning import GradCompDDPStrategy


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 256), torch.randint(0, 10, (512,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    meter = gc.TrafficMeter()
    # compress from the first step and every bucket (the defaults warm up with 2 plain steps)
    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer(), error_feedback=True, algorithm="ring",
                                 meter=meter, start_iter=0, min_compress_numel=0)
    strategy = GradCompDDPStrategy(state, process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), loader)
    state.close()
    # every process (Lightning starts rank 1 by re-running this script) prints its own meter
    print(f"rank {trainer.global_rank}: {args.steps} steps, sent {meter.bytes_sent:,} bytes, "
          f"float32 ring would send {meter.raw_bytes_sent:,}: {meter.compression_ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
