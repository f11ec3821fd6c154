"""A stage of fixed compute time, to check bubble measurements against theory.

Its forward takes ``fwd_s`` seconds and its backward ``bwd_s`` seconds
(``time.sleep``: no CPU is used, so stages sharing cores do not slow each
other down), whatever the micro-batch size: the setting of GPipe's bubble
formula (equal stages, compute-bound, free communication).
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["FixedTimeStage", "run_fixed_time"]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g * 1.0, None, None


class FixedTimeStage(nn.Module):
    """``y = w * x`` (one scalar parameter) whose forward lasts ``fwd_s`` and
    backward ``bwd_s`` seconds.

    Raises:
        ValueError: a negative or non-finite time.
    """

    def __init__(self, fwd_s: float, bwd_s: float):
        super().__init__()
        for name, v in (("fwd_s", fwd_s), ("bwd_s", bwd_s)):
            if not 0 <= float(v) < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        self.w = nn.Parameter(torch.ones(1))
        self.fwd_s, self.bwd_s = float(fwd_s), float(bwd_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.w, self.fwd_s, self.bwd_s)


def run_fixed_time(rank: int, world_size: int, schedule: str, microbatches: int, steps: int,
                   fwd_s: float, bwd_s: float, group=None):
    """Run ``steps`` steps of an engine ``schedule`` over fixed-time stages as
    ``rank`` of an initialised group (one pipeline rank per process; each
    step starts after a barrier) and return this rank's
    :class:`~gradcomp.pipeline.bubble.StageTimeline` (for
    :func:`~gradcomp.pipeline.bubble.analyze`).

    Micro-batches are 2 x 8 float32 tensors; the loss is a mean square.
    """
    import torch.distributed as dist

    from gradcomp.pipeline.boundary import BoundaryCodec
    from gradcomp.pipeline.engine import build_schedule, rank_stages, stages_per_rank
    from gradcomp.pipeline.stage import GradcompStage
    from gradcomp.pipeline.bubble import StageTimeline

    n = world_size * stages_per_rank(schedule)
    tl = StageTimeline(rank)
    codec = BoundaryCodec(None)
    stages = [GradcompStage(FixedTimeStage(fwd_s, bwd_s), s, n, torch.device("cpu"), codec=codec,
                            timeline=tl, input_args=torch.zeros(2, 8, requires_grad=s > 0),
                            output_args=torch.zeros(2, 8, requires_grad=True), group=group)
              for s in rank_stages(schedule, rank, world_size)]
    sched = build_schedule(schedule, stages, microbatches, nn.functional.mse_loss)
    x, y = torch.randn(2 * microbatches, 8), torch.zeros(2 * microbatches, 8)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    for _ in range(steps):
        dist.barrier(group=group)
        kwargs = {"target": y} if last else {}
        with tl.step_window():
            sched.step(x, **kwargs) if first else sched.step(**kwargs)
    return tl
