"""The compressed ring allreduce, pipelined in segments.

The ring of :mod:`gradcomp.comm.ring` and :func:`gradcomp.comm.dense.share_owned`
moves one chunk per step and computes between steps: each hop waits for a
whole chunk, then decompresses, adds and recompresses it before sending
anything, so the link idles while the CPU works. Here every chunk is cut into
*segments* (block-aligned element ranges; a segment of an int8 payload is two
byte ranges of it, its scales and its codes) and each segment moves on as
soon as it is ready, as NCCL pipelines its rings in slices: while segment
``k`` of a step is on the link, segment ``k + 1`` is being computed. The
compute left exposed falls from a chunk per step to a segment per step.

The ``2 N - 2`` steps are those of the ring: in step ``T < N - 1`` (the
reduce-scatter) rank ``r`` sends chunk ``(r - T - 1) mod N`` and receives chunk
``(r - T - 2) mod N``; step 0 sends this rank's own data compressed (with
error feedback), later steps the received partial sum plus the local chunk,
requantized; step ``N - 1`` sends the owner's final sum of chunk ``r``
(divided for ``avg``, and decoded in place so the owner keeps what the others
decode); in steps ``T >= N`` the received bytes travel on unchanged and are
decoded into the result while the next segment is on the link.

Payloads, bytes, results and residuals equal the unsegmented ring's bit for
bit; only when the bytes leave changes. Each segment's two ranges travel as
two point-to-point exchanges (one send to the next rank and one receive from
the previous, under their own tags), so a disagreement replay
(:mod:`gradcomp.comm.agreement`) pairs them as it pairs the ring's hops. The
meter counts each payload once (its first range) and its raw bytes over its
segments.

Used by :func:`gradcomp.allreduce` with ``algorithm="ring"`` when the
compressor writes payloads in parts (:meth:`~gradcomp.Compressor.part_align`:
:class:`~gradcomp.Int8Quantizer` with nearest rounding) and the longest chunk
holds more than :data:`MIN_SEGMENT_NUMEL` elements.
"""

from __future__ import annotations

import time

import torch

from gradcomp import timeline as _timeline
from gradcomp.comm.agreement import Disagreement
from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import PIECES, Comm, Message, Transfer

__all__ = ["MIN_SEGMENT_NUMEL", "MAX_SEGMENTS", "TAG_BASE", "applies", "segment_count", "segments",
           "allreduce"]

#: fewest elements per segment: below about 2**17 (a 129 KiB int8 segment,
#: 1 ms at 1 Gbit/s) gloo's per-message cost outweighs what overlap saves
MIN_SEGMENT_NUMEL = 2**17
#: most segments per chunk. The compute left exposed is one segment per step,
#: but each segment costs two messages per step and, with more ranks than
#: cores, wake-ups; how 2, 3 and 4 compared: docs/results/transport-choices.md
MAX_SEGMENTS = 4
#: tag of the first segment exchange (below it: the ring's pieces, the
#: agreement and size exchanges); each exchange takes :data:`PIECES` tags
TAG_BASE = 4 * PIECES


def segment_count(plan: Plan) -> int:
    """Segments per chunk, the same on every rank: ``ceil(longest chunk /
    MIN_SEGMENT_NUMEL)``, at most :data:`MAX_SEGMENTS`."""
    longest = max(hi - lo for lo, hi in plan.bounds)
    return min(MAX_SEGMENTS, -(-longest // MIN_SEGMENT_NUMEL))


def applies(local: Local, plan: Plan) -> bool:
    """Whether :func:`allreduce` runs this call: the compressor has parts and a
    chunk holds at least two segments."""
    return local.has_parts() and segment_count(plan) >= 2


def segments(length: int, count: int, align: int) -> list[tuple[int, int]]:
    """``count`` element ranges covering ``[0, length)`` in order: equal lengths
    rounded up to a multiple of ``align`` (the last ones shorter or empty)."""
    size = -(-max(1, -(-length // count)) // align) * align
    return [(min(length, k * size), min(length, (k + 1) * size)) for k in range(count)]


def allreduce(comm: Comm, local: Local, plan: Plan, work: torch.Tensor, op: str) -> list[torch.Tensor]:
    """Segment-pipelined compressed ring allreduce of ``local``'s data into ``work``.

    Receives are posted ahead (the reduce-scatter's all at the start, the
    allgather's once the last reduce-scatter payload's header checked out),
    so that a sender never waits for gloo's receive-ready notice; a rank
    waits only for the segment it needs next, and for its sends at the end.

    Args:
        comm: the group (world size >= 2).
        local: this rank's flat float32 data and error feedback (:func:`applies`).
        plan: the chunk plan (its compressor has parts).
        work: float32 ``[numel]``: on return every chunk decoded from its
            owner's bytes (bit-identical on every rank, and to the unsegmented ring's).
        op: ``"sum"`` or ``"avg"``.

    Returns:
        Every chunk's owner bytes, indexed by chunk (valid until ``comm.release()``).

    Raises:
        TimeoutError / RuntimeError / gradcomp.PayloadError: as :func:`gradcomp.allreduce`
        (after the receives already posted completed or timed out, so none
        is left to catch a later call's bytes);
        :class:`~gradcomp.comm.agreement.Disagreement` when a peer sent a
        disagreement envelope (the caller replays and agrees).
    """
    n, r = comm.world_size, comm.rank
    comp, dev = plan.compressor, work.device
    count = segment_count(plan)
    segs = [segments(hi - lo, count, comp.part_align()) for lo, hi in plan.bounds]
    steps = 2 * n - 2

    def chunks(t: int) -> tuple[int, int]:  # (sent, received) in step t
        if t < n - 1:
            return (r - t - 1) % n, (r - t - 2) % n
        return (r - t + n - 1) % n, (r - t + n - 2) % n

    def exchanges(t: int, k: int, j: int):  # (tag, byte range, raw bytes, counted) per part
        lo, hi = segs[j][k]
        for part, (a, b) in enumerate(comp.part_ranges(plan.bounds[j][1] - plan.bounds[j][0], lo, hi)):
            yield (TAG_BASE + ((t * count + k) * 2 + part) * PIECES, a, b,
                   4 * (hi - lo) if part else 0, int(k == 0 and part == 0))

    def phase(t: int) -> str:
        return "reduce_scatter" if t < n - 1 else "allgather"

    inboxes = [comm.buffer(plan.wire_nbytes[chunks(t)[1]], dev) for t in range(steps)]
    recvs: list[list[list[Transfer]]] = [[] for _ in range(steps)]
    sends: list[Transfer] = []

    def post_recvs(t: int) -> None:
        for k in range(count):
            recvs[t].append([comm.start([], [Message(comm.prev, inboxes[t][a:b], raw, first)], phase(t),
                                        tag=tag, timed=False, split=False)
                             for tag, a, b, raw, first in exchanges(t, k, chunks(t)[1])])

    def post_send(t: int, k: int, wire: torch.Tensor) -> None:
        for tag, a, b, raw, first in exchanges(t, k, chunks(t)[0]):
            sends.append(comm.start([Message(comm.next, wire[a:b], raw, first)], [], phase(t),
                                    tag=tag, timed=False, split=False))

    def arrived(t: int, k: int) -> None:
        for tr in recvs[t][k]:
            tr.wait()

    t0 = time.perf_counter()
    try:
        for t in range(n - 1):
            post_recvs(t)
        received = None  # the previous step's payload, decoded
        for t in range(steps):
            out_j = chunks(t)[0]
            olo, ohi = plan.bounds[out_j]
            if t < n:  # a new payload: this rank's data (t == 0) or a sum
                q = comp.open_wire(ohi - olo, out=plan.wire_buffer(comm, out_j, dev), device=dev)
            if t == 0:
                own = local.compress_parts(olo, ohi, out_j, q, segs[out_j])
            for k, (a, b) in enumerate(segs[out_j]):
                if t > 0:
                    arrived(t - 1, k)
                    if k == 0:
                        received = _decoded(plan, inboxes[t - 1])
                        if t == n - 1:  # every reduce-scatter header checked: the allgather follows
                            for u in range(n - 1, steps):
                                post_recvs(u)
                        if t >= n:
                            q = received  # forwarded unchanged
                if t == 0:
                    next(own)
                elif t < n:
                    acc = local.exact_into(olo + a, olo + b, work[olo + a: olo + b])
                    with _timeline.span("compress"):
                        comp.reduce_compress_part_(received, acc, q, a, b,
                                                   divisor=n if (t == n - 1 and op == "avg") else 1,
                                                   decode=t == n - 1)
                post_send(t, k, q.wire)
                if t >= n:  # decode the forwarded chunk while it travels on
                    with _timeline.span("decompress"):
                        comp.decompress_part_(received, a, b, work[olo + a: olo + b])
            if t == 0:
                for _ in own:  # the residual is kept at the generator's end
                    pass
            if t == n - 1:
                final = q.wire  # this rank's chunk, as every rank decodes it
            if t == n - 1 and comm.meter is not None:  # the reduce-scatter's payloads all arrived
                comm.meter.record_time(time.perf_counter() - t0, phase="reduce_scatter", tier=comm.tier)
                t0 = time.perf_counter()
        last_j = chunks(steps - 1)[1]
        llo = plan.bounds[last_j][0]
        for k, (a, b) in enumerate(segs[last_j]):
            arrived(steps - 1, k)
            if k == 0:
                received = _decoded(plan, inboxes[steps - 1])
            with _timeline.span("decompress"):
                comp.decompress_part_(received, a, b, work[llo + a: llo + b])
        for tr in sends:
            tr.wait()
    except Disagreement:
        raise  # the posted receives are matched by the peers' replays
    except BaseException:
        _drain(recvs, sends)
        raise
    if comm.meter is not None:
        comm.meter.record_time(time.perf_counter() - t0, phase="allgather", tier=comm.tier)
    wires = [None] * n
    for t in range(n - 1, steps):  # the allgather's receives: the owners' bytes
        wires[chunks(t)[1]] = inboxes[t]
    wires[r] = final
    return wires


def _drain(recvs, sends) -> None:
    """Wait (each within the comm's deadline) for every transfer a failed call
    posted, so that no receive is left to catch a later call's bytes; a
    transfer that fails or times out closes its connection (gloo), which makes
    later calls fail instead."""
    for tr in [tr for step in recvs for seg in step for tr in seg] + sends:
        try:
            tr.wait()
        except Exception:  # the original error is the one raised
            pass


def _decoded(plan: Plan, inbox: torch.Tensor):
    """The payload in ``inbox`` once its header has arrived; its sections must be
    views of ``inbox`` (the later segments land there)."""
    p = plan.received(inbox)
    lo, hi = inbox.data_ptr(), inbox.data_ptr() + inbox.numel()
    if not (lo <= p.scales.data_ptr() < hi or p.scales.numel() == 0):
        raise RuntimeError("pipelined ring: a receive buffer is misaligned for its float32 scales")
    return p
