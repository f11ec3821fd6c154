"""Disagreement envelopes: how a rank that changed its call reaches ranks that did not check.

A rank whose call equals the one its group last agreed on skips the agreement
and posts that call's messages at once. A rank that changed its call must not
leave it waiting for payloads that never come, nor send it a message longer
than the receive it posted (gloo aborts on that). So it *replays* the
remembered message pattern of the last agreed call (:data:`PATTERN_PHASES`,
deterministic given the agreed signature): every
receive at its remembered size, and every send, piece by piece (the payload's
peers, tags and cuts), as a *disagreement envelope*: the first ``min(8, piece)``
bytes of :data:`ENVELOPE` (on NCCL, which matches only equal sizes, the whole
piece, zero-padded). A rank that skipped the check finds an envelope where it
expected a payload header (:class:`Disagreement`), replays the rest of the
pattern and agrees too; the ring's ``N - 1`` hops, halving's ``log2 p`` and its
fold messages carry it to every rank. Every
receive is matched by one send no longer than it, so no process aborts.
Traffic (meter phase ``"agreement"``): the envelopes, and what the receives
really got (8 bytes per piece from a rank that replays, the payload from one
that did not check).
"""

from __future__ import annotations

import torch

from gradcomp.comm.p2p import Comm, Transfer, cuts

__all__ = ["ENVELOPE", "PATTERN_PHASES", "Disagreement", "replay", "is_envelope", "raise_if_envelope",
           "rest_of", "Replay"]

#: first 8 bytes of a disagreement envelope (a payload starts with b"GCMP")
ENVELOPE = b"GCDISAGR"
#: the phases of a call that a pattern keeps: a rank that did not check finds an
#: envelope in them before it posts anything else (halving-doubling's ``"fold"``
#: messages included: a folded rank receives nothing else)
PATTERN_PHASES = ("reduce_scatter", "sizes", "fold")


class Disagreement(Exception):
    """A peer sent a disagreement envelope where this rank expected a payload
    (internal: the collective replays and agrees, then raises ValueError)."""


def is_envelope(buf: torch.Tensor) -> bool:
    """``buf`` (uint8, at least 8 bytes) starts with :data:`ENVELOPE`."""
    return buf.numel() >= len(ENVELOPE) and bytes(buf[:len(ENVELOPE)].cpu().numpy().tobytes()) == ENVELOPE


def raise_if_envelope(buf: torch.Tensor) -> None:
    """Raise :class:`Disagreement` if ``buf`` is a disagreement envelope."""
    if is_envelope(buf):
        raise Disagreement()


def rest_of(pattern: list, trace: list) -> list:
    """The entries of ``pattern`` that a call whose messages so far are
    ``trace`` (:attr:`gradcomp.comm.p2p.Comm.trace`) has not posted: its
    pattern-phase entries are a prefix of the pattern."""
    done = sum(1 for entry in trace if entry[2] in PATTERN_PHASES)
    return pattern[done:]


def replay(comm: Comm, entries, device="cpu") -> "Replay":
    """Post the envelopes and receives of ``entries`` (trace entries
    ``(sends, recvs, phase, tag, split)``); :meth:`Replay.wait` completes them.

    Every entry is posted before any is waited for, in the entries' order: an
    entry may hold only receives whose sends come in a later entry of the
    peer (the pipelined ring posts its receives ahead). Messages of one peer
    and tag match in posting order, on both sides.
    """
    ops, sent, inboxes = [], 0, []
    full = not comm.gloo  # NCCL matches a receive only with a send of its size
    for sends, recvs, _, tag, split in entries:
        for peer, nbytes in recvs:
            buf = comm.buffer(nbytes, device)
            for i, (a, b) in enumerate(cuts(nbytes, split)):
                piece = buf[a:b]
                piece[:len(ENVELOPE)].zero_()  # so that a stale envelope in a pooled buffer is not counted
                inboxes.append(piece)
                ops.append(("irecv", piece, tag + i, peer))
        for peer, nbytes in sends:
            for i, (a, b) in enumerate(cuts(nbytes, split)):
                env = _envelope(b - a, device, full)
                sent += env.numel()
                ops.append(("isend", env, tag + i, peer))
    return Replay(comm, comm.post(ops), sent, [] if full else inboxes,
                  sum(p.numel() for p in inboxes) if full else 0)


class Replay:
    """Posted envelopes and receives of :func:`replay`."""

    def __init__(self, comm: Comm, works: list, sent: int, inboxes: list[torch.Tensor], received: int = 0):
        self.comm, self.sent, self.inboxes, self.received = comm, sent, inboxes, received
        self.transfer = Transfer(comm, [], [], "agreement", works, timed=False)

    def wait(self) -> None:
        """Complete every envelope and receive (within the comm's timeout) and
        record the bytes really moved in the meter's ``"agreement"`` phase.

        Raises:
            TimeoutError / RuntimeError: as :meth:`gradcomp.comm.p2p.Transfer.wait`.
        """
        self.transfer.wait()
        meter = self.comm.meter
        if meter is None:
            return
        got = self.received + sum(min(len(ENVELOPE), p.numel()) if _starts_envelope(p) else p.numel()
                                  for p in self.inboxes)
        tier = self.comm.tier
        if self.sent:
            meter.record_send(self.sent, 0, phase="agreement", messages=0, tier=tier)
        if got:
            meter.record_recv(got, 0, phase="agreement", messages=0, tier=tier)


def _starts_envelope(piece: torch.Tensor) -> bool:
    k = min(len(ENVELOPE), piece.numel())
    return bytes(piece[:k].cpu().numpy().tobytes()) == ENVELOPE[:k]


def _envelope(nbytes: int, device, full: bool = False) -> torch.Tensor:
    """The envelope for a piece of ``nbytes``: never longer than the receive it
    meets (``full``: exactly as long, zero-padded)."""
    k = min(len(ENVELOPE), nbytes)
    head = bytearray(ENVELOPE[:k]) + (bytearray(nbytes - k) if full else bytearray())
    return torch.frombuffer(head, dtype=torch.uint8).to(device)
