"""Compressed recursive halving-doubling allreduce (the ``halving_doubling`` algorithm).

Rabenseifner's allreduce as MPICH runs it (Thakur, Rabenseifner and Gropp 2005):
with ``p`` the largest power of two <= N, a reduce-scatter by recursive halving
(at distances ``d = p/2, ..., 1`` a rank sends its partner ``i xor d`` the
compressed half of its range that the partner keeps, and adds the partner's
payload to the half it keeps) leaves rank ``i`` the float32 sum of chunk ``i``
of ``p``; the owner compresses it once and an allgather by recursive doubling
(distances ``1, ..., p/2``) forwards the owners' bytes unchanged. That is
``2 log2 p`` messages per rank against the ring's ``2 (N - 1)``: for
latency-bound (small) buckets. The ``N - p`` extra ranks are folded in as MPICH
does: even rank ``r < 2 (N - p)`` sends its compressed tensor to ``r + 1``,
sits out, and receives every owner's bytes at the end (meter phase ``"fold"``).
Every rank decodes each chunk from its owner's bytes: results are bit-identical.

Error feedback applies where a rank compresses its own data alone (its first
half, or a folded rank's whole tensor; :mod:`gradcomp.comm.local`). A step
quantizes partial sums of disjoint rank sets: with int8 an element of the sum
errs by at most ``(log2 p + 1 + [N > p]) 0.52 A / 127`` (``A``: the sum over
ranks of each rank's absolute maximum).
"""

from __future__ import annotations

import torch

from gradcomp import timeline as _timeline
from gradcomp.comm.chunks import FLOAT32_BYTES
from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm, Message

__all__ = ["allreduce", "fold_layout", "gathered_offsets", "FOLD_PHASE", "ALIGN"]

#: the owners' payloads start at multiples of this many bytes in the doubling messages
ALIGN = 8
#: meter phase of the messages that fold the extra ranks of a non-power-of-two group in and out
FOLD_PHASE = "fold"


def fold_layout(world: int, rank: int) -> tuple[int, int, int]:
    """Where ``rank`` sits in the halving-doubling schedule of ``world`` ranks.

    Returns:
        ``(p, new_rank, partner)``: ``p`` the largest power of two <= ``world``;
        ``new_rank`` in ``[0, p)`` for a rank that takes part in the halving
        and doubling, -1 for an extra rank; ``partner`` the rank an extra rank
        folds into (or that folds into this rank), -1 when none.
    """
    p = 1 << (world.bit_length() - 1)
    rem = world - p
    if rank < 2 * rem:
        if rank % 2 == 0:
            return p, -1, rank + 1
        return p, rank // 2, rank - 1
    return p, rank - rem, -1


def _real_rank(new_rank: int, world: int, p: int) -> int:
    rem = world - p
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def allreduce(comm: Comm, local: Local, plan: Plan, work: torch.Tensor, op: str) -> None:
    """Halving-doubling allreduce into ``work`` (see the module docstring).

    Args:
        comm: the group (world size >= 2).
        local: this rank's data and error feedback.
        plan: the chunk plan over ``p`` chunks (``Plan(numel, p, compressor)``).
        work: float32 ``[numel]`` (may be the input's own memory); on return it
            holds every chunk decoded from its owner's bytes.
        op: ``"sum"`` or ``"avg"``.
    """
    world = comm.world_size
    p, me, partner = fold_layout(world, comm.rank)
    dev = work.device
    offsets = gathered_offsets(plan.wire_nbytes)
    gathered = comm.buffer(offsets[-1], dev)  # every owner's bytes, in chunk order
    if me < 0:  # an extra rank: fold in, wait for the result
        n = work.numel()
        wire = local.compress(0, n, chunk=("halving_doubling", 0, n),
                              out=_range_buffer(comm, plan, 0, n, dev)).wire
        _check_size(plan, wire, 0, n)
        comm.exchange([Message(partner, wire, FLOAT32_BYTES * n)], [], FOLD_PHASE)
        comm.exchange([], [Message(partner, gathered, FLOAT32_BYTES * n)], FOLD_PHASE)
        _decode_chunks(plan, gathered, offsets, range(p), work)
        return
    pending = _halve(comm, local, plan, work, me, partner)
    lo, hi = plan.bounds[me]
    with _timeline.span("compress"):
        slot = gathered[offsets[me]:offsets[me + 1]]
        q = plan.compressor.reduce_compress_(
            pending, work[lo:hi], divisor=world if op == "avg" else 1,
            out=slot[:plan.wire_nbytes[me]] if plan.reuse else None, decode=True)
        wire = plan.expect(q, me)
        if wire.data_ptr() != slot.data_ptr():
            slot[:wire.numel()].copy_(wire)
        slot[wire.numel():].zero_()  # the padding travels too
    _double(comm, plan, work, gathered, offsets, me)
    if partner >= 0:  # fold out: the extra rank gets every owner's bytes
        comm.exchange([Message(partner, gathered, FLOAT32_BYTES * work.numel())], [], FOLD_PHASE)


def gathered_offsets(wire_nbytes) -> list[int]:
    """Byte offsets of the owners' payloads in the doubling messages, in chunk
    order, each padded to a multiple of :data:`ALIGN` bytes (a payload's
    float32 sections must start aligned where it is decoded); the last entry
    is the total size."""
    offsets = [0]
    for w in wire_nbytes:
        offsets.append(offsets[-1] + -(-w // ALIGN) * ALIGN)
    return offsets


def _halve(comm: Comm, local: Local, plan: Plan, work: torch.Tensor, me: int, partner: int):
    """Recursive halving: returns the last payload received for chunk ``me``, not
    yet added (``work[chunk me]`` plus it is the sum over all ranks)."""
    world, dev = comm.world_size, work.device
    p = len(plan.bounds)
    n = work.numel()
    alone = partner < 0  # this rank's range holds its own data only (nothing folded in)
    if not alone:
        inbox = comm.buffer(plan.compressor.wire_nbytes((n,), torch.float32), dev)
        comm.exchange([], [Message(partner, inbox, FLOAT32_BYTES * n)], FOLD_PHASE)
        local.exact_into(0, n, work)
        with _timeline.span("decompress"):
            plan.compressor.decompress_add_(plan.received(inbox), work)
    a, b = 0, p  # the chunks this rank's range covers
    pending, held = None, (0, n)
    d = p // 2
    while d >= 1:
        peer = _real_rank(me ^ d, world, p)
        keep = (a + d, b) if me & d else (a, a + d)
        give = (a, a + d) if me & d else (a + d, b)
        glo, ghi = plan.bounds[give[0]][0], plan.bounds[give[1] - 1][1]
        klo, khi = plan.bounds[keep[0]][0], plan.bounds[keep[1] - 1][1]
        if pending is not None:  # the last step's payload, into the range this rank still holds
            with _timeline.span("decompress"):
                plan.compressor.decompress_add_(plan.received(pending), work[held[0]:held[1]])
        out = _range_buffer(comm, plan, glo, ghi, dev)
        if alone:
            wire = local.compress(glo, ghi, chunk=("halving_doubling", glo, ghi), out=out).wire
        else:
            with _timeline.span("compress"):
                wire = plan.compressor.compress(work[glo:ghi], **({} if out is None else {"out": out})).wire
        _check_size(plan, wire, glo, ghi)
        pending = comm.buffer(plan.compressor.wire_nbytes((khi - klo,), torch.float32), dev)
        transfer = comm.start([Message(peer, wire, FLOAT32_BYTES * (ghi - glo))],
                              [Message(peer, pending, FLOAT32_BYTES * (khi - klo))], "reduce_scatter")
        if alone:
            local.exact_into(klo, khi, work[klo:khi])  # while the payloads travel
            alone = False
        transfer.wait()
        a, b = keep
        held = (klo, khi)
        d //= 2
    return plan.received(pending)


def _double(comm: Comm, plan: Plan, work: torch.Tensor, gathered: torch.Tensor, offsets, me: int) -> None:
    """Recursive doubling: exchange blocks of owners' bytes with partners at
    distances 1, 2, ..., p/2, decoding each block while the next one travels."""
    world, p = comm.world_size, len(plan.bounds)
    received = range(0)
    d = 1
    while d < p:
        peer = _real_rank(me ^ d, world, p)
        mine, theirs = (me // d) * d, ((me ^ d) // d) * d
        out = gathered[offsets[mine]:offsets[mine + d]]
        into = gathered[offsets[theirs]:offsets[theirs + d]]
        raw_out = FLOAT32_BYTES * (plan.bounds[mine + d - 1][1] - plan.bounds[mine][0])
        raw_in = FLOAT32_BYTES * (plan.bounds[theirs + d - 1][1] - plan.bounds[theirs][0])
        transfer = comm.start([Message(peer, out, raw_out)], [Message(peer, into, raw_in)], "allgather")
        _decode_chunks(plan, gathered, offsets, received, work)  # only read while it is being sent
        transfer.wait()
        received = range(theirs, theirs + d)
        d *= 2
    _decode_chunks(plan, gathered, offsets, received, work)


def _decode_chunks(plan: Plan, gathered: torch.Tensor, offsets, chunks, work: torch.Tensor) -> None:
    for j in chunks:
        lo, hi = plan.bounds[j]
        with _timeline.span("decompress"):
            blob = gathered[offsets[j]:offsets[j] + plan.wire_nbytes[j]]
            plan.compressor.decompress(plan.received(blob), out=work[lo:hi])


def _range_buffer(comm: Comm, plan: Plan, lo: int, hi: int, device) -> torch.Tensor | None:
    """A pooled wire buffer for elements ``[lo, hi)`` (None: the compressor allocates)."""
    if not plan.reuse:
        return None
    return comm.buffer(plan.compressor.wire_nbytes((hi - lo,), torch.float32), device)


def _check_size(plan: Plan, wire: torch.Tensor, lo: int, hi: int) -> None:
    expected = plan.compressor.wire_nbytes((hi - lo,), torch.float32)
    if wire.numel() != expected:
        raise RuntimeError(f"{plan.compressor!r} wrote {wire.numel()} bytes for {hi - lo} elements but its "
                           f"wire_nbytes() says {expected}: dense collectives need exact, data-independent sizes")
