"""Every rank checks, before any payload moves, that all ranks called the same collective.

A collective is only well defined when every rank passes the same number of
elements, ``op``, algorithm and compressor. When they do not, the transports
misbehave badly: a receive posted for one size that gets another makes gloo
abort the process ("Received data size doesn't match expected size"), and a
mismatched ``op`` silently returns different values on different ranks. So a
call can start with an *agreement*: every rank sends a small descriptor
(:data:`FIELDS`, little-endian int64) to every other rank, and every rank
compares all of them. On a mismatch every rank raises the same
``ValueError`` naming the field and the ranks, before anything is compressed
or sent, so nothing aborts, hangs or corrupts, no error-feedback residual
changes, and the group stays usable.

A call agrees only when its descriptor differs from the last one every rank
of the group agreed on (:func:`needs_check`), so a training loop that reduces
the same tensors every step pays for one agreement, not one per step. This is
sound because agreements are collective: as long as no call failed, every
rank remembers the same last descriptor, so when all ranks skip the check
they all pass that descriptor. If only some ranks changed theirs, those ranks
check and the others do not; agreements travel under their own tags
(:data:`TAG`), so on gloo they never match a payload message, and both sides
end with a ``TimeoutError`` (or a ``RuntimeError`` on a rank whose peer timed
out first and closed its connections) instead of an abort. (NCCL ignores
point-to-point tags: there this case is undefined, as any mismatched
collective is.) Only the last descriptor is remembered (remembering several
would let ranks skip with different ones), so a loop that alternates between
two different calls on one group agrees on every call: give each its own
group (the DDP hook has its own). A failed call forgets
the group's descriptor (:func:`forget`); the memory goes with the group
object, so a group created later never inherits it.

The sparse ``allgather`` algorithm agrees in the same way (its
``wire_nbytes`` is the compressor's fixed payload size, or -1 when the size
depends on the data) and then exchanges its payload sizes on every call,
under tag ``TAG + 1``.

One rank alone changing its call after the group agreed (it checks, the
others skip) must not leave the others waiting for payloads that never come.
So a group also remembers the message pattern of the reduce-scatter phase
(the exchanges of :data:`PATTERN_PHASES`) of its last agreed call
(:func:`remember_pattern`): deterministic given the descriptor, the same on
every rank. A rank whose call differs first *replays* that pattern
(:func:`replay`), every message replaced by a *disagreement envelope* of the
same size (it starts with :data:`ENVELOPE`), then agrees. A rank that
skipped the check finds an envelope where it expected a payload (its decode
fails on the magic, :func:`raise_if_envelope`; or an 8-byte size reads
:data:`ENVELOPE`), replays the rest of the pattern in the same way, and
agrees too. The pattern reaches every rank (the ring in ``N - 1`` hops, halving
in ``log2 p`` and its fold messages; the others direct), so every rank
ends in the same agreement and raises the same ``ValueError`` naming the
field, every message posted is matched, and the group stays usable. A rank
that skipped the check has by then compressed its first chunks (their error
feedback residuals changed); the ranks that checked have not.

Traffic: ``8 * len(FIELDS) * (N - 1)`` bytes sent per rank per agreement,
plus, when a call differs from a remembered one, that call's reduce-scatter
message sizes; recorded in meter phase ``"agreement"`` with no raw (float32
ring) equivalent.
"""

from __future__ import annotations

import threading
import weakref

import torch

from gradcomp.comm.p2p import PIECES, Comm, Message

__all__ = ["FIELDS", "AGREEMENT_NBYTES", "TAG", "ENVELOPE", "PATTERN_PHASES", "agree", "needs_check",
           "forget", "Disagreement", "remember_pattern", "pattern", "replay", "raise_if_envelope",
           "is_envelope"]

#: descriptor fields, in wire order
FIELDS = ("numel", "op", "algorithm", "codec", "wire_nbytes")
#: bytes of one descriptor on the wire
AGREEMENT_NBYTES = 8 * len(FIELDS)
#: point-to-point tag of agreement messages (payload pieces use 0 .. PIECES - 1;
#: the allgather's size exchange uses TAG + 1)
TAG = 2 * PIECES

_WHAT = {
    "numel": "numbers of elements",
    "op": "ops",
    "algorithm": "algorithms",
    "codec": "compressor types",
    "wire_nbytes": "compressor settings (payload sizes)",
}

#: meter phases of the messages a remembered pattern keeps: those that carry a
#: disagreement envelope to every rank (halving-doubling's ``"fold"`` messages
#: included: a folded rank receives nothing else)
PATTERN_PHASES = ("reduce_scatter", "sizes", "fold")

#: first 8 bytes of a disagreement envelope (not a payload's b"GCMP" magic)
ENVELOPE = b"GCDISAGR"

# group -> the descriptor every rank of that group last agreed on; an entry
# goes with its group (a new group never inherits one, even at the same address)
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# group -> (descriptor, reduce-scatter message pattern of a call with it)
_PATTERNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_AGREED_LOCK = threading.Lock()


class Disagreement(Exception):
    """A peer sent a disagreement envelope where this rank expected a payload
    (internal: the collective replays and agrees, then raises ValueError)."""


def needs_check(group, values: dict[str, int]) -> bool:
    """Whether a call on ``group`` with this descriptor must agree first: it
    differs from the one the group's ranks last agreed on (or none yet)."""
    with _AGREED_LOCK:
        try:
            return _AGREED.get(group) != _row(values)
        except TypeError:  # a group object without weak references: always check
            return True


def forget(group) -> None:
    """Drop what ``group`` agreed on (after a failed call): its next call checks."""
    with _AGREED_LOCK:
        try:
            _AGREED.pop(group, None)
            _PATTERNS.pop(group, None)
        except TypeError:
            pass


def remember_pattern(group, values: dict[str, int], trace) -> None:
    """After a successful call with the group's agreed descriptor ``values``:
    keep the reduce-scatter part of its message trace (see
    :attr:`gradcomp.comm.p2p.Comm.trace`) unless already kept."""
    row = _row(values)
    with _AGREED_LOCK:
        try:
            if _AGREED.get(group) != row or (_PATTERNS.get(group) or (None,))[0] == row:
                return
            _PATTERNS[group] = (row, [t for t in trace if t[2] in PATTERN_PHASES])
        except TypeError:
            pass


def pattern(group) -> list | None:
    """The reduce-scatter message pattern of the group's last agreed call (None: none kept)."""
    with _AGREED_LOCK:
        try:
            kept = _PATTERNS.get(group)
            return kept[1] if kept is not None and kept[0] == _AGREED.get(group) else None
        except TypeError:
            return None


def replay(comm: Comm, entries, device="cpu") -> None:
    """Exchange disagreement envelopes with the sizes, peers and tags of ``entries``
    (``(sends, recvs, phase, tag)``, sends and recvs as ``(peer, nbytes)``).

    Every entry is posted before any is waited for, in the entries' order: an
    entry may hold only receives whose sends come in a later entry of the
    peer (the pipelined ring posts its receives ahead). Messages of one peer
    and tag match in posting order, on both sides."""
    transfers = []
    for sends, recvs, _, tag in entries:
        out = [Message(p, _envelope(nbytes, device)) for p, nbytes in sends]
        into = [Message(p, torch.empty(nbytes, dtype=torch.uint8, device=device)) for p, nbytes in recvs]
        transfers.append(comm.start(out, into, "agreement", tag=tag))
    for t in transfers:
        t.wait()


def _envelope(nbytes: int, device) -> torch.Tensor:
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    buf[:len(ENVELOPE)] = torch.frombuffer(bytearray(ENVELOPE), dtype=torch.uint8)[:nbytes].to(device)
    return buf


def is_envelope(buf: torch.Tensor) -> bool:
    """``buf`` (uint8) starts with :data:`ENVELOPE`."""
    return buf.numel() >= len(ENVELOPE) and bytes(buf[:len(ENVELOPE)].cpu().numpy().tobytes()) == ENVELOPE


def raise_if_envelope(buf: torch.Tensor) -> None:
    """Raise :class:`Disagreement` if ``buf`` is a disagreement envelope."""
    if is_envelope(buf):
        raise Disagreement()


def _row(values: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(values[f]) for f in FIELDS)


def agree(comm: Comm, values: dict[str, int], names: dict[str, dict[int, str]], device="cpu") -> None:
    """Exchange this rank's descriptor with every other rank, check them all,
    and remember it as what ``comm``'s group agreed on.

    Args:
        comm: the group (world size >= 2).
        values: this rank's value of every field in :data:`FIELDS` (ints).
        names: how to print codes in errors, per field: ``{"op": {0: "avg",
            1: "sum"}, ...}``.
        device: where the descriptor tensors live (the group's device).

    Raises:
        ValueError: ranks disagree on a field (every rank raises it, naming
            the field and each rank's value).
        TimeoutError / RuntimeError: as :meth:`~gradcomp.comm.p2p.Transfer.wait`.
    """
    n, r = comm.world_size, comm.rank
    mine = _row(values)
    wire = torch.tensor(mine, dtype=torch.int64, device=device).view(torch.uint8)
    recvs = [Message(p, torch.empty(AGREEMENT_NBYTES, dtype=torch.uint8, device=device))
             for p in range(n) if p != r]
    comm.exchange([Message(p, wire) for p in range(n) if p != r], recvs, "agreement", tag=TAG)
    table: list[tuple[int, ...]] = [mine] * n
    for m in recvs:
        table[m.peer] = tuple(m.buf.view(torch.int64).tolist())
    for i, field in enumerate(FIELDS):
        seen = [row[i] for row in table]
        if len(set(seen)) > 1:
            labels = names.get(field, {})
            per_rank = ", ".join(f"rank {j}: {labels.get(v, v)!r}" for j, v in enumerate(seen))
            raise ValueError(
                f"gradcomp collective: the ranks of the group passed different {_WHAT[field]} "
                f"({per_rank}); every rank must call it with the same tensor size, op, algorithm "
                "and compressor settings, in the same order")
    with _AGREED_LOCK:
        try:
            _AGREED[comm.group] = mine
        except TypeError:  # a group object without weak references: nothing remembered
            pass
