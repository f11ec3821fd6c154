"""Sparse allreduce by a sparse reduce-scatter and an allgather (``sparse_reduce_scatter``).

Ok-Topk's scheme (Li and Hoefler, PPoPP 2022) on gradcomp's chunks: rank ``j``
owns region ``j`` (:func:`gradcomp.comm.chunks.chunk_bounds`). Each rank keeps
the top-k of every other region of its data (the compressor's density, per
region) and sends it to that region's owner (direct exchange, phase
``"reduce_scatter"``: :func:`gradcomp.comm.two_phase.reduce_scatter`); the owner
adds its own region exactly and the ``N - 1`` payloads in rank order,
re-selects the top-k of that sum, and the owners' bytes travel unchanged
around the ring (phase ``"allgather"``). Every rank decodes each region from
its owner's bytes: results are bit-identical. Bytes sent per rank: ``N - 1``
region payloads in each phase, about ``2 (N - 1) / N`` times one whole-tensor
payload, where the sparse ``allgather`` sends ``N - 1`` whole payloads.

Error feedback (:mod:`gradcomp.comm.local`): a rank's own regions ``j != rank``
keep their selection error (residual ``(key, j)``, or the flat ``residual``
there); what the owner's re-selection drops, with the kept values'
compression error, stays in the owner's residual for its region (``(key,
rank)``, or the flat ``residual`` there, whose old content was delivered in
the sum), so nothing is lost, only delayed. Without error feedback it is lost.
"""

from __future__ import annotations

import torch

from gradcomp import timeline as _timeline
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm

__all__ = ["allreduce"]


def allreduce(comm: Comm, local: Local, plan: Plan, work: torch.Tensor, op: str) -> None:
    """Sparse reduce-scatter, re-selection and allgather into ``work``.

    Args:
        comm: the group (world size >= 2).
        local: this rank's data and error feedback; its compressor an exact
            :class:`~gradcomp.TopK` with a ``ratio`` (fixed payload sizes).
        plan: the region plan ``Plan(numel, N, compressor)``.
        work: float32 ``[numel]`` (may be the input's own memory); on return
            it holds every region decoded from its owner's bytes (divided by
            ``N`` for ``op="avg"``).
        op: ``"sum"`` or ``"avg"``.
    """
    r = comm.rank
    pending = _two_phase.reduce_scatter(comm, local, plan, work)
    lo, hi = plan.bounds[r]
    with _timeline.span("decompress"):
        plan.compressor.decompress_add_(plan.received(pending), work[lo:hi])
    # the owner's re-selection: the same compressor and residual, over the region's sum
    mine = plan.expect(local.over(work).compress(lo, hi, chunk=r), r)

    def decompress(j: int, blob: torch.Tensor) -> None:
        a, b = plan.bounds[j]
        with _timeline.span("decompress"):
            plan.compressor.decompress(plan.received(blob), out=work[a:b])

    comm.ring_allgather(mine, plan.wire_nbytes, plan.raw_nbytes, phase="allgather", consume=decompress)
    if op == "avg":
        work.div_(comm.world_size)
