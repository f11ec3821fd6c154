"""Direct compressed reduce-scatter (the first half of the ``two_phase`` algorithm).

The scatter-reduce-allgather scheme of SparCML (Renggli et al. 2019) and CGX
(Markov et al. 2022): every rank compresses each chunk ``j != rank`` of its
own data once and sends it straight to the chunk's owner ``j``. The owner
keeps its own chunk uncompressed (it never travels, so it is never
quantized) and sums in float32: its own chunk, then every other rank's
decompressed payload in rank order (only the owner computes this sum; every
rank then uses the owner's compressed bytes of it). The allgather phase (:func:`gradcomp.comm.dense.share_owned`) compresses that sum
once more, so every element goes through at most two quantizations (the
ring's ``N``), for the same bytes as the ring: each rank sends ``N - 1`` chunk
payloads in each phase.

Error feedback applies to each chunk ``j != rank`` (residual key ``(key, j)``;
:mod:`gradcomp.comm.local`), and if asked to the owner's compression of its
sum (the server residual, :func:`gradcomp.comm.dense.compress_owned`).

Error: each rank's data is quantized once on its own and the sum once more,
so with int8 ``|error| <= 2 * 0.52 * A_b / 127`` per element of the sum (see
:mod:`gradcomp.comm.ring` for ``A_b``), against the ring's ``N * ...``.
"""

from __future__ import annotations

import torch

from gradcomp import timeline as _timeline

from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm, Message

__all__ = ["reduce_scatter"]


def reduce_scatter(comm: Comm, local: Local, plan: Plan, work: torch.Tensor | None,
                   own: torch.Tensor | None = None) -> torch.Tensor:
    """Direct-exchange reduce-scatter: one compression per chunk per rank.

    Args:
        work: float32 ``[numel]`` workspace (may be the input's own memory);
            only its chunk ``rank`` is written. None when ``own`` is given.
        own: float32 tensor of chunk ``rank``'s length to accumulate in
            instead of ``work[chunk rank]`` (a reduce-scatter's output).

    Returns:
        The payload from the highest other rank, not yet added: with it added
        (:func:`gradcomp.comm.dense.share_owned` does it, fused with the final
        compression) ``work[chunk rank]`` holds the sum over all ranks of chunk
        ``rank`` (this rank's own data exact, the others' payloads added in rank order).
    """
    n, r = comm.world_size, comm.rank
    dev = (work if own is None else own).device
    sends, recvs = [], []
    for j in range(n):
        if j == r:
            continue
        wire = plan.expect(local.compress(*plan.bounds[j], chunk=j, out=plan.wire_buffer(comm, j, dev)), j)
        sends.append(Message(j, wire, plan.raw_nbytes[j]))
        recvs.append(Message(j, comm.buffer(plan.wire_nbytes[r], dev), plan.raw_nbytes[r]))
    transfer = comm.start(sends, recvs, "reduce_scatter")
    lo, hi = plan.bounds[r]
    acc = local.exact_into(lo, hi, work[lo:hi] if own is None else own)  # while the payloads travel
    transfer.wait()
    for m in recvs[:-1]:  # in rank order; the last one is added by share_owned
        with _timeline.span("decompress"):
            plan.compressor.decompress_add_(plan.received(m.buf), acc)
    return recvs[-1].buf
