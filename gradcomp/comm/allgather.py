"""Sparse allreduce by allgather (the ``allgather`` algorithm).

Top-k and threshold payloads of different ranks keep different index sets and
have different sizes, so they cannot be summed hop by hop without growing
(SparCML, Renggli et al. 2019, discusses the fill-in). Here each rank
compresses its whole tensor once (with error feedback under residual key
``key``; see :mod:`gradcomp.comm.local`), the ranks exchange payload sizes
(8 bytes each, phase ``"sizes"``), the payloads travel unchanged around the
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

from gradcomp import timeline as _timeline
from gradcomp.comm.agreement import SIZES_TAG
from gradcomp.comm.replay import raise_if_envelope
from gradcomp.comm.chunks import ring_raw_bytes
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm, Message

__all__ = ["allreduce", "exchange_sizes", "SIZE_NBYTES"]

#: bytes of one payload size on the wire (little-endian int64)
SIZE_NBYTES = 8

#: bound on a sparse payload's bytes beyond 16 per element (headers, padding)
_MAX_OVERHEAD = 512


def exchange_sizes(comm: Comm, nbytes: int, device) -> list[int]:
    """Every rank's payload size in bytes (direct exchange, phase ``"sizes"``).

    Each rank sends its size as one little-endian int64 to every other rank
    (``8 (N - 1)`` bytes sent per rank, tag ``SIZES_TAG`` of
    :mod:`gradcomp.comm.agreement`; a float32 ring needs none, so their raw
    equivalent is 0).
    """
    n, r = comm.world_size, comm.rank
    mine = torch.tensor([nbytes], dtype=torch.int64, device=device).view(torch.uint8)
    recvs = [Message(p, torch.empty(SIZE_NBYTES, dtype=torch.uint8, device=device), 0)
             for p in range(n) if p != r]
    comm.exchange([Message(p, mine, 0) for p in range(n) if p != r], recvs, "sizes", tag=SIZES_TAG)
    sizes = [0] * n
    sizes[r] = nbytes
    for m in recvs:
        raise_if_envelope(m.buf)  # a peer changed its call since the group's agreement
        sizes[m.peer] = int(m.buf.view(torch.int64).item())
    return sizes


def allreduce(comm: Comm, local: Local, work: torch.Tensor, op: str) -> None:
    """Allgather-based allreduce of sparse payloads, into ``work``.

    Args:
        work: float32 ``[numel]`` (may be the input's own memory: the input is
            compressed before ``work`` is written). On return it holds the
            union of every rank's decompressed payload, summed in rank order
            (divided by ``N`` for ``op="avg"``).
    """
    n, r = comm.world_size, comm.rank
    numel = work.numel()
    wire = local.compress(0, numel, chunk=None).wire
    sizes = exchange_sizes(comm, wire.numel(), wire.device)
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
    with _timeline.span("decompress"):
        work.zero_()
        for blob in blobs:
            local.inner.decompress_add_(blob, work)
        if op == "avg":
            work.div_(n)
