"""PyTorch's own ``powerSGD_hook`` as a DDP communication hook whose bytes a TrafficMeter counts.

PyTorch's hook (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, Vogels et al.
2019) reduces a bucket with three float32 allreduces of the backend: the tensors it sends whole,
all P's, all Q's (before ``start_powerSGD_iter``: one allreduce of the bucket). It counts no
bytes itself; :class:`TorchPowerSGD` counts each allreduce at a ring allreduce's volume, as
:mod:`gradcomp.comm.native` counts the backend's allreduce, deciding which tensors are matrices
by the rule PyTorch's hook applies (``gradcomp.PowerSGD.matrix``: the same shape test). Used by
the study's ``torch-powersgd4`` row and ``benchmarks/powersgd.py``. Docs: docs/powersgd.md.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from gradcomp.comm import native
from gradcomp.compressors import NoCompression
from gradcomp.meter import TrafficMeter
from gradcomp.powersgd import PowerSGD

__all__ = ["TorchPowerSGD"]

#: the meter's phase of the hook's bytes
PHASE = "powerSGD_hook"


class TorchPowerSGD:
    """PyTorch's ``PowerSGDState`` with its defaults (error feedback, warm start, float32) and
    its hook, counted.

    Register with ``ddp.register_comm_hook(None, TorchPowerSGD(...).hook)``.

    Args:
        rank: ``matrix_approximation_rank`` (>= 1).
        start_iter: ``start_powerSGD_iter`` (>= 2: PyTorch's hook needs DDP's first two steps
            uncompressed when error feedback or warm start is on).
        min_compression_rate: PyTorch's ``min_compression_rate`` (> 0).
        meter: optional :class:`~gradcomp.TrafficMeter`: bytes sent per allreduce, one
            ``step()`` per DDP step.
        timeline: optional :class:`~gradcomp.timeline.StepTimeline`: ``"handoff"`` marked
            at each step's last bucket, as gradcomp's hook does.

    Raises:
        ValueError: a bad argument (PyTorch's own message for ``start_iter``).
    """

    def __init__(self, rank: int = 4, *, start_iter: int = 2, min_compression_rate: float = 2.0,
                 meter: TrafficMeter | None = None, timeline=None):
        self.state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                              start_powerSGD_iter=start_iter,
                                              min_compression_rate=min_compression_rate)
        # the rule PyTorch's _should_compress applies: rows * cols > rate * (rows + cols) * r
        self._shapes = PowerSGD(rank=rank, min_compression_rate=min_compression_rate, compressor=NoCompression())
        self.meter, self.timeline = meter, timeline
        #: backend allreduces issued so far
        self.allreduces = 0

    def hook(self, _, bucket):  # unannotated: DDP rejects the string annotations of this module
        """PyTorch's ``powerSGD_hook`` on ``bucket`` (a ``dist.GradBucket``), its allreduces
        counted first; returns its future."""
        if self.state.iter >= self.state.start_powerSGD_iter:
            shapes = [g.shape for g in bucket.gradients()]
            first, second = self._shapes.wire_numel(shapes)
            n_p = sum(m[0] * m[2] for m in map(self._shapes.matrix, shapes) if m is not None)
            sizes = (first - n_p, n_p, second)  # the tensors sent whole, the P's, the Q's
        else:
            sizes = (bucket.buffer().numel(),)
        self.allreduces += len(sizes)
        if self.meter is not None:
            world, rank = dist.get_world_size(), dist.get_rank()
            for n in sizes:
                sent = native.sent_bytes(n, world, rank)
                self.meter.record_send(sent, sent, phase=PHASE)
        fut = torch_psgd.powerSGD_hook(self.state, bucket)
        if bucket.is_last():
            if self.timeline is not None:
                self.timeline.mark("handoff")
            if self.meter is not None:
                self.meter.step()
        return fut
