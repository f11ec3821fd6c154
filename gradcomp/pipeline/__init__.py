"""Pipeline parallelism with compressed stage boundaries.

- :mod:`~gradcomp.pipeline.split`: cut an ``nn.Sequential`` into stages;
- :mod:`~gradcomp.pipeline.boundary`: compress and meter what crosses a boundary;
- :mod:`~gradcomp.pipeline.stage`: a ``torch.distributed.pipelining`` stage
  with compressed, metered, timed boundaries, for the engine's schedules
  (:mod:`~gradcomp.pipeline.engine`: GPipe, 1F1B, interleaved 1F1B, zero bubble);
- :mod:`~gradcomp.pipeline.pipedream`: PipeDream's asynchronous 1F1B with
  weight stashing (the engine has no asynchronous schedule);
- :mod:`~gradcomp.pipeline.bubble`, :mod:`~gradcomp.pipeline.memory`: the
  bubble (its formula and its measurement) and the activation memory.

Importing this package does not import ``torch.distributed.pipelining``;
the submodules that need it do.
"""

from gradcomp.pipeline.boundary import BoundaryCodec, boundary_phase
from gradcomp.pipeline.split import layer_blocks, split_sequential
from gradcomp.pipeline.bubble import StageTimeline, analyze, bubble_fraction

__all__ = ["BoundaryCodec", "boundary_phase", "layer_blocks", "split_sequential", "StageTimeline",
           "analyze", "bubble_fraction"]
