"""Compressed ring reduce-scatter (the first half of the ``ring`` algorithm).

The bandwidth-optimal ring allreduce (Patarasuk and Yuan 2009; used by
Horovod and NCCL) with compressed messages, as in CGX (Markov et al. 2022)
and the ring variants of SparCML (Renggli et al. 2019): in step
``s = 0 .. N-2`` rank ``r`` sends its partial sum of chunk ``(r - s - 1) mod N``
to the next rank and receives the partial sum of chunk ``(r - s - 2) mod N``
from the previous one. Each hop decompresses the received partial, adds the
local chunk in float32 and recompresses, so a chunk is quantized once per hop
(``N - 1`` times before its owner's final compression). After ``N - 1`` steps
rank ``r`` holds the float32 sum of chunk ``r``; the allgather phase is
:func:`gradcomp.comm.dense.share_owned`.

Details: docs/collectives.md#the-rings-error-bound.
"""

from __future__ import annotations

import torch

from gradcomp import timeline as _timeline
from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm, Message

__all__ = ["reduce_scatter"]


def reduce_scatter(comm: Comm, local: Local, plan: Plan, work: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter with a requantization per hop.

    Args:
        work: float32 ``[numel]`` workspace (may be the input's own memory):
            partial sums are accumulated in the received chunk's slice.

    Returns:
        The last payload received (wire bytes of chunk ``rank``), not yet added:
        ``work[chunk rank]`` holds this rank's own contribution to chunk
        ``rank`` and, with that payload added
        (:func:`gradcomp.comm.dense.share_owned` does it, fused with the final
        compression), the sum over all ranks, in which every other rank's data
        went through one or more compressions. Other slices hold intermediate values.
    """
    n, r = comm.world_size, comm.rank
    dev = work.device
    first = (r - 1) % n
    wire = plan.expect(local.compress(*plan.bounds[first], chunk=first,
                                      out=plan.wire_buffer(comm, first, dev)), first)
    for s in range(n - 1):
        out_j, in_j = (r - s - 1) % n, (r - s - 2) % n
        inbox = comm.buffer(plan.wire_nbytes[in_j], dev)
        transfer = comm.start([Message(comm.next, wire, plan.raw_nbytes[out_j])],
                              [Message(comm.prev, inbox, plan.raw_nbytes[in_j])], "reduce_scatter")
        lo, hi = plan.bounds[in_j]
        acc = local.exact_into(lo, hi, work[lo:hi])  # while the partial sum travels
        transfer.wait()
        if s == n - 2:
            return inbox  # in_j == r
        # decompress, add and recompress in one pass
        with _timeline.span("compress"):
            wire = plan.expect(plan.compressor.reduce_compress_(
                plan.received(inbox), acc, out=plan.wire_buffer(comm, in_j, dev)), in_j)
    raise AssertionError("unreachable: world_size >= 2")  # pragma: no cover
