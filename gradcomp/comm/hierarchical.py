"""Hierarchical compressed allreduce: exact inside a host, compressed between hosts.

For each segment of the bucket (:func:`segment_bounds`), with ``H`` hosts of ``R`` ranks
(:mod:`gradcomp.comm.topology`): (1) an exact float32 reduce-scatter inside each host by direct
exchange (local rank ``l`` adds the others' shard ``l`` to its own, in local-rank order); (2)
every local rank runs the compressed ring or two-phase allreduce of its shard across hosts, the
``R`` of a host in parallel, error feedback on this leg only; (3) an allgather inside the host
of the owners' bytes of each shard's chunks, which every rank decodes (float32 with one host).
Steps 1 and 3 are transfers posted ahead, so they overlap step 2 of another segment. Every
rank ends bit-identical: each chunk is the decoding of one owner's bytes everywhere. Per host
the links between hosts carry ``2 (H - 1) / H`` times the compressed bucket. The meter
records tier ``"inter_host"`` (step 2) and ``"intra_host"`` (phases ``"host_reduce_scatter"``
and ``"host_allgather"``, their seconds the calling thread's wait, sum and decode). Sources
(Horovod, BlueConnect, CGX) and the full text: docs/collectives.md#hierarchical.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from gradcomp.comm import pipelined as _pipelined
from gradcomp.comm import ring as _ring
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm._args import HIERARCHICAL
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.dense import Plan, share_owned
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import PIECES, Comm, Message, Transfer
from gradcomp.comm.topology import INTER_ALGORITHMS, MAX_SEGMENTS, Layout
from gradcomp.compressors import split

__all__ = ["Call", "allreduce", "agreement_code", "segment_bounds", "AGREEMENT_CODE", "PHASES",
           "MIN_SEGMENT_NUMEL", "MAX_AUTO_SEGMENTS"]

#: agreement ``algorithm`` code of a hierarchical call: this plus the index of
#: its inter-host algorithm in :data:`~gradcomp.comm.topology.INTER_ALGORITHMS`
AGREEMENT_CODE = HIERARCHICAL
#: meter phases of the intra-host steps
PHASES = ("host_reduce_scatter", "host_allgather")
#: fewest elements per segment when the count is chosen by size (4 MiB of float32)
MIN_SEGMENT_NUMEL = 2**20
#: most segments chosen by size
MAX_AUTO_SEGMENTS = 4
_REDUCE_SCATTER = {"ring": _ring.reduce_scatter, "two_phase": _two_phase.reduce_scatter}


@dataclass
class Call:
    """The settings of one hierarchical call (checked by :func:`gradcomp.allreduce`).

    Attributes:
        compressor: the user's compressor or ErrorFeedback (the inter-host leg's).
        op: ``"avg"`` or ``"sum"``. meter: a TrafficMeter or None.
        timeout: seconds each exchange may take. key: residual key prefix.
        residual: flat float32 memory of ``n`` elements, or None.
    """

    compressor: object
    op: str
    meter: object
    timeout: float
    key: Hashable
    residual: torch.Tensor | None


def segment_bounds(numel: int, segments: int | None = None) -> list[tuple[int, int]]:
    """The element ranges a bucket of ``numel`` elements is reduced in, one after the
    other: ``segments`` of them, or by size ``ceil(numel / MIN_SEGMENT_NUMEL)``
    (1 to :data:`MAX_AUTO_SEGMENTS`); cut as :func:`~gradcomp.comm.chunks.chunk_bounds`."""
    if segments is None:
        segments = max(1, min(MAX_AUTO_SEGMENTS, -(-numel // MIN_SEGMENT_NUMEL)))
    return chunk_bounds(numel, segments)


def agreement_code(lay: Layout) -> int:
    """The agreement's ``algorithm`` code of a call with this layout."""
    return AGREEMENT_CODE + INTER_ALGORITHMS.index(lay.inter_algorithm)


def allreduce(x: torch.Tensor, lay: Layout, call: Call, work: torch.Tensor) -> torch.Tensor:
    """Hierarchical allreduce of the flat float32 ``x`` (``n`` elements) into ``work``.

    Args:
        x: float32 ``[n]``, this rank's data (read only, unless it is ``work``).
        lay: the resolved layout (:func:`gradcomp.comm.topology.layout`).
        call: the call's settings.
        work: contiguous float32 ``[n]`` for the result (may be ``x``).

    Returns:
        ``work``, bit-identical on every rank.

    Raises:
        TimeoutError / RuntimeError / gradcomp.PayloadError: as :func:`gradcomp.allreduce`
        (after every transfer this call posted completed or failed).
    """
    n = x.numel()
    segs = segment_bounds(n, lay.segments)
    intra = Comm(lay.intra, call.timeout, call.meter, tier="intra_host") if lay.intra is not None else None
    inter = Comm(lay.inter, call.timeout, call.meter, tier="inter_host") if lay.inter is not None else None
    posted: list[Transfer] = []
    gathers: list = []
    try:
        x = _delivered(intra or inter, x, call.residual, lay, segs)
        pending = _post_reduce_scatter(intra, x, work, lay, segs, 0)
        posted += pending[0]
        for k, (a, b) in enumerate(segs):
            ahead = _post_reduce_scatter(intra, x, work, lay, segs, k + 1) if k + 1 < len(segs) else None
            if ahead is not None:
                posted += ahead[0]
            lo, hi = _own(a, b, lay)
            _host_sum(intra, x, work, lo, hi, pending, call)
            # hosts hold equal shards: all of a shard's inter-host group skip an empty one
            wires = _inter_leg(inter, work[lo:hi], lay, call, k, lo, hi) if inter is not None and hi > lo else None
            if call.op == "avg":
                work[lo:hi].div_(lay.host_count * lay.ranks_per_host)
            gather = _post_allgather(intra, work, lay, (a, b), k, wires, call)
            posted += [t for t, _ in gather]
            gathers.append(gather)
            pending = ahead
        _finish_allgather(intra, gathers, work, call, lay)
    except BaseException:
        _drain(posted)
        raise
    finally:
        for c in (intra, inter):
            if c is not None:
                c.release()
    return work


def _own(a: int, b: int, lay: Layout) -> tuple[int, int]:
    """This rank's shard of segment ``[a, b)``."""
    lo, hi = chunk_bounds(b - a, lay.ranks_per_host)[lay.local_rank]
    return a + lo, a + hi


def _delivered(comm: Comm, x: torch.Tensor, residual, lay: Layout, segs) -> torch.Tensor:
    """``x`` with the residual outside this rank's inter-host shards added (they are
    not this rank's to compress: delivered exactly, their residual resets); ``x``
    itself when there is none (the usual case)."""
    if residual is None:
        return x
    keep = [_own(a, b, lay) for a, b in segs] if lay.inter is not None else []
    spill, at = [], 0
    for lo, hi in keep + [(x.numel(), x.numel())]:
        if lo > at and bool(residual[at:lo].any()):
            spill.append((at, lo))
        at = hi
    if not spill:
        return x
    out = comm.buffer(4 * x.numel(), x.device).view(torch.float32).copy_(x)
    for lo, hi in spill:
        out[lo:hi].add_(residual[lo:hi])
        residual[lo:hi].zero_()
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _post_reduce_scatter(comm, x, work, lay: Layout, segs, k: int):
    """Post segment ``k``'s intra-host reduce-scatter: ``([transfer], [(peer, buffer)])``."""
    if comm is None:
        return [], []
    a, b = segs[k]
    chunks = chunk_bounds(b - a, lay.ranks_per_host)
    mine = chunks[lay.local_rank]
    sends = [Message(j, _bytes(x[a + lo:a + hi]), 4 * (hi - lo)) for j, (lo, hi) in enumerate(chunks)
             if j != lay.local_rank]
    recvs = [Message(j, comm.buffer(4 * (mine[1] - mine[0]), x.device), 4 * (mine[1] - mine[0]))
             for j in range(lay.ranks_per_host) if j != lay.local_rank]
    transfer = comm.start(sends, recvs, PHASES[0], tag=2 * k * PIECES, timed=False)
    return [transfer], [(m.peer, m.buf) for m in recvs]


def _host_sum(comm, x, work, lo: int, hi: int, pending, call: Call) -> None:
    """``work[lo:hi]``: this host's float32 sum of the shard (own data, then the
    other local ranks' in local-rank order)."""
    if work.data_ptr() != x.data_ptr():
        work[lo:hi].copy_(x[lo:hi])
    if comm is None:
        return
    began = time.perf_counter()
    transfers, received = pending
    for t in transfers:
        t.wait()
    acc = work[lo:hi]
    for _, buf in sorted(received, key=lambda r: r[0]):
        acc.add_(buf.view(torch.float32))
    if call.meter is not None:
        call.meter.record_time(time.perf_counter() - began, phase=PHASES[0], tier="intra_host")


def _inter_leg(comm: Comm, shard: torch.Tensor, lay: Layout, call: Call, k: int, lo: int,
               hi: int) -> list[torch.Tensor]:
    """Compressed allreduce (sum) of ``shard`` across hosts, in place; returns the
    owners' bytes of its ``H`` chunks (pooled buffers of ``comm``)."""
    residual = None if call.residual is None else call.residual[lo:hi]
    local = Local(shard, call.compressor, ("hierarchical", call.key, k), residual)
    plan = Plan(hi - lo, lay.host_count, local.inner)
    if lay.inter_algorithm == "ring" and _pipelined.applies(local, plan):
        return _pipelined.allreduce(comm, local, plan, shard, "sum")
    pending = _REDUCE_SCATTER[lay.inter_algorithm](comm, local, plan, shard)
    return share_owned(comm, plan, shard, "sum", pending)


def _chunk_wire_sizes(call: Call, length: int, hosts: int) -> list[int]:
    """Wire sizes of the ``hosts`` inter-host chunks of a shard of ``length`` elements."""
    inner, _ = split(call.compressor)
    return Plan(length, hosts, inner).wire_nbytes


def _post_allgather(comm, work, lay: Layout, seg: tuple[int, int], k: int, wires, call: Call) -> list:
    """Post segment ``k``'s intra-host allgather; returns ``[(transfer, where)]``,
    ``where`` saying what to decode into ``work`` (None: the float32 shards
    land in place). With an inter-host leg every message is one chunk's owner
    bytes (``wires``: this rank's, None for an empty shard), else the float32 shard."""
    if comm is None:
        return []
    a, b = seg
    shards = [(a + c, a + d) for c, d in chunk_bounds(b - a, lay.ranks_per_host)]
    me = lay.local_rank
    peers = [j for j in range(lay.ranks_per_host) if j != me]
    tag = PIECES * (2 * MAX_SEGMENTS + k * (lay.host_count + 1))
    if lay.inter is None:
        lo, hi = shards[me]
        sends = [Message(j, _bytes(work[lo:hi]), 4 * (hi - lo)) for j in peers]
        recvs = [Message(j, _bytes(work[shards[j][0]:shards[j][1]]), 4 * (shards[j][1] - shards[j][0]))
                 for j in peers]
        return [(comm.start(sends, recvs, PHASES[1], tag=tag, timed=False), None)]
    out = []
    sizes = {j: _chunk_wire_sizes(call, shards[j][1] - shards[j][0], lay.host_count) for j in range(len(shards))}
    raw = {j: [4 * (d - c) for c, d in chunk_bounds(shards[j][1] - shards[j][0], lay.host_count)]
           for j in range(len(shards))}
    for i in range(lay.host_count):  # chunk i of every shard, under a tag of its own
        sends = [Message(j, wires[i], raw[me][i]) for j in peers if wires is not None]
        recvs = [Message(j, comm.buffer(sizes[j][i], work.device), raw[j][i]) for j in peers
                 if shards[j][1] > shards[j][0]]
        out.append((comm.start(sends, recvs, PHASES[1], tag=tag + (i + 1) * PIECES, timed=False), (i, shards)))
    return out


def _finish_allgather(comm, gathers: list, work: torch.Tensor, call: Call, lay: Layout) -> None:
    """Wait for every segment's allgather and decode what it brought into ``work``."""
    if comm is None:
        return
    began = time.perf_counter()
    inner, _ = split(call.compressor)
    divisor = lay.host_count * lay.ranks_per_host
    for gather in gathers:
        for transfer, where in gather:
            transfer.wait()
            if where is None:  # float32, already in place
                continue
            i, shards = where
            for m in transfer.recvs:
                lo, hi = shards[m.peer]
                c, d = chunk_bounds(hi - lo, lay.host_count)[i]
                dst = work[lo + c:lo + d]
                inner.decompress(Plan.received(m.buf), out=dst)
                if call.op == "avg":  # as the shard's owner did
                    dst.div_(divisor)
    if call.meter is not None:
        call.meter.record_time(time.perf_counter() - began, phase=PHASES[1], tier="intra_host")


def _drain(posted: list[Transfer]) -> None:
    """Wait (each within its deadline) for every transfer a failed call posted, so
    that none is left to write into a buffer given back or catch a later call's bytes."""
    for t in posted:
        try:
            t.wait()
        except Exception:  # the original error is the one raised
            pass
