"""PyTorch Lightning DDP with gradcomp's int8 allreduce hook, on 2 CPU processes (gloo).

Pass gradcomp's state and hook to ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``. Lightning registers them on CUDA only (its
``_register_ddp_hooks`` skips other devices, a limit from PyTorch 1.8 that
gloo no longer has), so on CPU this example's ``CPUHookDDPStrategy`` registers
them on every device; on GPUs the plain ``DDPStrategy`` does.

Run: python examples/lightning_ddp.py [--steps N]   (needs: pip install "gradcomp[integrations]")
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

import gradcomp as gc


class CPUHookDDPStrategy(DDPStrategy):
    """DDPStrategy that registers ``ddp_comm_hook`` on CPU (gloo) too."""

    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


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
    strategy = CPUHookDDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                                  ddp_comm_hook=gc.ddp.compressed_allreduce_hook)
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
