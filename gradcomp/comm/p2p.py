"""Pipelined point-to-point byte transfers on a torch.distributed process group.

Every gradcomp collective is built from :meth:`Comm.exchange`: a set of
messages (1-D ``torch.uint8`` tensors) sent to and received from peers of the
group at the same time, each cut into up to :data:`PIECES` contiguous pieces
that travel as concurrent ``isend`` / ``irecv`` pairs (one tag per piece).
One large send/recv pair leaves a bandwidth-limited link half idle on gloo;
several pieces in flight keep it busy (docs/results/transport-choices.md).

Receivers must know each message's size in advance (wire sizes are
deterministic for dense compressors; sparse payload sizes are exchanged
first). Every wait has a deadline (``Work.wait(timeout=...)``); a late or
failed transfer raises instead of hanging.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from gradcomp import timeline as _timeline
from gradcomp.comm.buffers import POOL

__all__ = ["PIECES", "MIN_PIECE_BYTES", "Message", "Comm", "Transfer", "pieces"]

#: most concurrent pieces per message
PIECES = 4
#: smallest piece worth its own isend/irecv pair, in bytes
MIN_PIECE_BYTES = 64 * 1024


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[(start, end), ...]`` a message of ``nbytes`` is cut into.

    Deterministic in ``nbytes`` alone, so sender and receiver agree: up to
    :data:`PIECES` near-equal pieces of at least :data:`MIN_PIECE_BYTES`
    (one piece for smaller messages; none for an empty one).
    """
    if nbytes <= 0:
        return []
    count = max(1, min(PIECES, nbytes // MIN_PIECE_BYTES))
    base, extra = divmod(nbytes, count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass
class Message:
    """One point-to-point message.

    Attributes:
        peer: the other side's rank in the group (not the global rank).
        buf: 1-D contiguous ``torch.uint8`` tensor: the bytes to send, or the
            buffer to receive into (its size is the expected message size).
        raw_nbytes: bytes the uncompressed float32 exchange would move for this
            message (for the meter only).
        count: messages the meter counts for it: 1, or 0 for a later part of
            a payload sent in parts (:mod:`gradcomp.comm.pipelined`).
    """

    peer: int
    buf: torch.Tensor
    raw_nbytes: int = 0
    count: int = 1


class Comm:
    """A process group, this rank's place in it, a deadline per wait and a meter.

    Args:
        group: the torch.distributed process group (gloo, NCCL, ...).
        timeout: seconds any single :meth:`exchange` may take.
        meter: optional :class:`~gradcomp.TrafficMeter` to record into.
        tier: the network tier every message of this group crosses
            (:data:`gradcomp.meter.TIERS`), recorded with its bytes; None: none.
    """

    def __init__(self, group, timeout: float, meter=None, tier: str | None = None):
        self.group = group
        self.tier = tier
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = float(timeout)
        self.meter = meter
        self._taken: list[torch.Tensor] = []
        self.gloo = dist.get_backend(group) == "gloo"
        #: every :meth:`start` of this call: ``(sends, recvs, phase, tag)`` with
        #: sends and recvs as ``((peer, nbytes), ...)`` (see gradcomp.comm.agreement)
        self.trace: list[tuple] = []

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        """An uninitialised uint8 buffer of ``nbytes`` (reused across calls, see
        :mod:`gradcomp.comm.buffers`) that stays valid until :meth:`release`: a
        message to receive, or a wire to compress into and send."""
        buf = POOL.take(nbytes, device)
        self._taken.append(buf)
        return buf

    def release(self) -> None:
        """Give the buffers back for reuse. Call only after every transfer
        completed (a failed transfer may still write into its buffer)."""
        POOL.give(self._taken)
        self._taken = []

    @property
    def next(self) -> int:
        """Group rank of the next rank on the ring."""
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        """Group rank of the previous rank on the ring."""
        return (self.rank - 1) % self.world_size

    def exchange(self, sends: Sequence[Message], recvs: Sequence[Message], phase: str,
                 tag: int = 0) -> None:
        """Send and receive all messages concurrently; return when all are done.

        Same as ``self.start(sends, recvs, phase, tag).wait()``; see :meth:`start`.
        """
        self.start(sends, recvs, phase, tag).wait()

    def start(self, sends: Sequence[Message], recvs: Sequence[Message], phase: str,
              tag: int = 0, timed: bool = True, split: bool = True) -> "Transfer":
        """Post all sends and receives (non-blocking); :meth:`Transfer.wait` completes them.

        At most one send and one receive per peer. Every message is cut into
        :func:`pieces` that travel as concurrent pairs with tags ``tag``,
        ``tag + 1``, ... (payloads use 0 .. PIECES - 1; agreements their own
        tags, so their messages never match a payload's).
        The caller may compute while the transfer is in flight, but must not
        touch the message buffers until it has waited.

        Args:
            sends: messages to send (their ``buf`` is read).
            recvs: messages to receive (their ``buf`` is filled; its size must
                equal the sender's message size).
            phase: meter phase name (``"reduce_scatter"``, ``"allgather"``, ``"agreement"``,
                ``"sizes"``).
            tag: tag of the first piece.
            timed: add the time from posting to completion to the meter's
                phase time (False when the caller times overlapping transfers itself).
            split: cut messages into :func:`pieces` (False: one pair per
                message, for callers that already keep several in flight).

        Raises:
            ValueError: two messages to (or from) one peer, or a bad buffer.
        """
        self.trace.append((tuple((m.peer, m.buf.numel()) for m in sends),
                           tuple((m.peer, m.buf.numel()) for m in recvs), phase, tag))
        ops = []
        for kind, msgs in (("irecv", recvs), ("isend", sends)):
            seen = set()
            for m in msgs:
                if m.peer in seen:
                    raise ValueError(f"exchange: two {kind} messages with group rank {m.peer}")
                seen.add(m.peer)
                if m.buf.dtype != torch.uint8 or m.buf.dim() != 1 or not m.buf.is_contiguous():
                    raise ValueError("exchange: message buffers must be contiguous 1-D uint8 tensors, "
                                     f"got {m.buf.dtype} of shape {tuple(m.buf.shape)}")
                cuts = pieces(m.buf.numel()) if split else [(0, m.buf.numel())] * bool(m.buf.numel())
                ops.extend((kind, m.buf[a:b], tag + i, m.peer) for i, (a, b) in enumerate(cuts))
        if not ops:
            works = []
        elif self.gloo:  # gloo posts each op on its own, without a group call's cost
            works = [dist.irecv(buf, group=self.group, tag=t, group_src=peer) if kind == "irecv"
                     else dist.isend(buf, group=self.group, tag=t, group_dst=peer) for kind, buf, t, peer in ops]
        else:  # NCCL: one group call, so that sends and receives cannot deadlock
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv if kind == "irecv" else dist.isend, buf,
                                                       group=self.group, tag=t, group_peer=peer)
                                            for kind, buf, t, peer in ops])
        return Transfer(self, list(sends), list(recvs), phase, works, timed)

    def ring_allgather(self, mine: torch.Tensor, sizes: Sequence[int], raw_nbytes: Sequence[int],
                       phase: str = "allgather",
                       consume: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Gather every rank's byte blob over the ring, forwarding bytes unchanged.

        In step ``s = 0 .. N-2`` rank ``r`` sends blob ``(r - s) mod N`` to the
        next rank and receives blob ``(r - s - 1) mod N`` from the previous one
        (the allgather half of a ring allreduce; each rank sends ``N - 1`` blobs).

        Args:
            mine: this rank's blob, 1-D uint8 (``sizes[rank]`` bytes).
            sizes: every rank's blob size in bytes, indexed by group rank.
            raw_nbytes: uncompressed float32 bytes each blob stands for (meter).
            phase: meter phase name.
            consume: optional ``consume(j, blob)`` called once per blob, in
                arrival order (which differs between ranks), while the next
                transfer is in flight: work on blob ``j`` overlaps the network.

        Returns:
            The ``N`` blobs indexed by group rank; entry ``rank`` is ``mine``.

        Raises:
            ValueError: ``mine`` has not ``sizes[rank]`` bytes.
            TimeoutError / RuntimeError: as :meth:`Transfer.wait`.
        """
        n, r = self.world_size, self.rank
        if mine.numel() != sizes[r]:
            raise ValueError(f"ring_allgather: this rank's blob has {mine.numel()} bytes, "
                             f"expected {sizes[r]}")
        blobs: list[torch.Tensor | None] = [None] * n
        blobs[r] = mine
        for s in range(n - 1):
            out_j, in_j = (r - s) % n, (r - s - 1) % n
            blobs[in_j] = self.buffer(sizes[in_j], mine.device)
            transfer = self.start([Message(self.next, blobs[out_j], raw_nbytes[out_j])],
                                  [Message(self.prev, blobs[in_j], raw_nbytes[in_j])], phase)
            if consume is not None:
                consume(out_j, blobs[out_j])  # only read while it is being sent
            transfer.wait()
        if consume is not None:
            consume((r + 1) % n, blobs[(r + 1) % n])  # the last one received
        return blobs  # type: ignore[return-value]


class Transfer:
    """Posted sends and receives of one :meth:`Comm.start`; :meth:`wait` completes them."""

    def __init__(self, comm: Comm, sends: list[Message], recvs: list[Message], phase: str, works: list,
                 timed: bool = True):
        self.comm, self.sends, self.recvs, self.phase, self.works = comm, sends, recvs, phase, works
        self.timed = timed
        self.done = False
        self.t0 = time.perf_counter()

    def wait(self) -> None:
        """Block until every message is sent and received, then record them in the meter.

        Raises:
            TimeoutError: not done within the comm's ``timeout`` seconds.
            RuntimeError: the transport failed (e.g. a peer died).
        """
        if self.done:  # waited before
            return
        comm = self.comm
        deadline = time.monotonic() + comm.timeout
        with _timeline.span("communicate"):
            self._wait_all(deadline)
        meter = comm.meter
        if meter is not None:
            tier = comm.tier
            for m in self.sends:
                meter.record_send(m.buf.numel(), m.raw_nbytes, phase=self.phase, messages=m.count, tier=tier)
            for m in self.recvs:
                meter.record_recv(m.buf.numel(), m.raw_nbytes, phase=self.phase, messages=m.count, tier=tier)
            if self.timed:
                meter.record_time(time.perf_counter() - self.t0, phase=self.phase, tier=tier)
        self.done = True

    def _wait_all(self, deadline: float) -> None:
        comm = self.comm
        for w in self.works:
            left = max(0.001, deadline - time.monotonic())
            try:
                w.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError as e:
                what = (f"gradcomp {self.phase}: rank {comm.rank} of {comm.world_size} exchanging with "
                        f"ranks {sorted({m.peer for m in self.sends + self.recvs})}")
                if "timed out" in str(e).lower() or time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} did not finish within {comm.timeout} s: {e}") from e
                raise RuntimeError(f"{what} failed: {e}") from e
