"""Sparse allreduce by allgather (the ``allgather`` algorithm).

Top-k and threshold payloads of different ranks keep different index sets and
have different sizes, so they cannot be summed hop by hop without growing
(SparCML, Renggli et al. 2019, discusses the fill-in). Here each rank
compresses its whole tensor once (with error feedback under residual key
``key``; see :mod:`gradcomp.comm.local`), the ranks exchange payload sizes
(a descriptor message like the agreement's, :mod:`gradcomp.comm.agreement`,
phase ``"agreement"``), the payloads travel unchanged around the
point-to-point ring (phase ``"allgather"``), and every rank sums the union in
float32 in rank order: ``acc = 0; for src in 0..N-1: acc[idx_src] += val_src``,
then divides by ``N`` for ``avg``. Every rank applies the same operations to
the same bytes in the same order, so results are bit-identical.

Traffic: the meter records the real payload bytes per message and, once per
call in phase ``"allgather"``, the raw bytes of a float32 ring allreduce of the
same tensor (:func:`gradcomp.comm.chunks.ring_raw_bytes`); the size
exchange has no raw equivalent.

The point-to-point ring is used rather than ``dist.all_gather`` because gloo's
uint8 all_gather measured slower at world 4 than a float32 all_reduce of four
times the bytes.
"""

from __future__ import annotations

import torch

from gradcomp.comm.agreement import FIELDS, TAG, Agreement
from gradcomp.comm.chunks import ring_raw_bytes
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm

__all__ = ["allreduce"]

#: bound on a sparse payload's bytes beyond 16 per element (headers, padding)
_MAX_OVERHEAD = 512


def allreduce(comm: Comm, local: Local, work: torch.Tensor, op: str,
              descriptor: dict[str, int], names: dict) -> None:
    """Allgather-based allreduce of sparse payloads, into ``work``.

    Args:
        work: float32 ``[numel]`` (may be the input's own memory: the input is
            compressed before ``work`` is written). On return it holds the
            union of every rank's decompressed payload, summed in rank order
            (divided by ``N`` for ``op="avg"``).
        descriptor, names: this call's agreement fields
            (:class:`~gradcomp.comm.agreement.Agreement`); the size exchange
            sends them with ``wire_nbytes`` set to this rank's payload size.
    """
    n, r = comm.world_size, comm.rank
    numel = work.numel()
    wire = local.compress(0, numel, chunk=None).wire
    table = Agreement(comm, {**descriptor, "wire_nbytes": wire.numel()}, names,
                      varying=("wire_nbytes",), device=wire.device, tag=TAG + 1).wait()
    sizes = [row[FIELDS.index("wire_nbytes")] for row in table]
    limit = _MAX_OVERHEAD + 16 * numel
    for src, size in enumerate(sizes):
        if not 0 < size <= limit:
            raise RuntimeError(f"gradcomp allgather: rank {src} announced a {size}-byte payload, "
                               f"impossible for a tensor of {numel} elements (do all ranks pass "
                               "tensors of the same shape?)")
    if comm.meter is not None:
        rs_sent, ag_sent, rs_recv, ag_recv = ring_raw_bytes(numel, n, r)
        comm.meter.record_raw(sent=rs_sent + ag_sent, received=rs_recv + ag_recv, phase="allgather")
    blobs = comm.ring_allgather(wire, sizes, [0] * n, phase="allgather")
    work.zero_()
    for blob in blobs:
        local.inner.decompress_add_(blob, work)
    if op == "avg":
        work.div_(n)
