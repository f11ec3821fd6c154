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
(:data:`TAG`), so they never match a payload message, and both sides end
with a ``TimeoutError`` (or a ``RuntimeError`` on a rank whose peer timed out
first and closed its connections) instead of an abort. A failed call forgets
the group's descriptor (:func:`forget`); the memory goes with the group
object, so a group created later never inherits it.

The sparse ``allgather`` algorithm agrees in the same way (its
``wire_nbytes`` is the compressor's fixed payload size, or -1 when the size
depends on the data) and then exchanges its payload sizes on every call,
under tag ``TAG + 1``.

Traffic: ``8 * len(FIELDS) * (N - 1)`` bytes sent per rank per agreement,
recorded in meter phase ``"agreement"`` with no raw (float32 ring) equivalent.
"""

from __future__ import annotations

import threading
import weakref

import torch

from gradcomp.comm.p2p import PIECES, Comm, Message, Transfer

__all__ = ["FIELDS", "AGREEMENT_NBYTES", "TAG", "Agreement", "needs_check", "forget"]

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

# group -> the descriptor every rank of that group last agreed on; an entry
# goes with its group (a new group never inherits one, even at the same address)
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_AGREED_LOCK = threading.Lock()


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
        except TypeError:
            pass


def _row(values: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(values[f]) for f in FIELDS)


class Agreement:
    """One posted descriptor exchange; :meth:`wait` completes and checks it.

    Args:
        comm: the group (world size >= 2).
        values: this rank's value of every field in :data:`FIELDS` (ints).
        names: how to print codes in errors, per field: ``{"op": {0: "avg",
            1: "sum"}, ...}``.
        device: where the descriptor tensors live (the group's device).
        tag: point-to-point tag of the messages.
    """

    def __init__(self, comm: Comm, values: dict[str, int], names: dict[str, dict[int, str]],
                 device="cpu", tag: int = TAG):
        missing = set(FIELDS) - set(values)
        if missing:
            raise ValueError(f"agreement needs fields {sorted(missing)}")
        self.comm, self.names = comm, names
        n, r = comm.world_size, comm.rank
        self.mine = _row(values)
        wire = torch.tensor(self.mine, dtype=torch.int64, device=device).view(torch.uint8)
        self.recvs = [Message(p, torch.empty(AGREEMENT_NBYTES, dtype=torch.uint8, device=device))
                      for p in range(n) if p != r]
        self.transfer: Transfer | None = comm.start(
            [Message(p, wire) for p in range(n) if p != r], self.recvs, "agreement", tag=tag)
        self.table: list[list[int]] | None = None

    def wait(self) -> list[list[int]]:
        """Complete the exchange and check it (idempotent).

        Returns:
            Every rank's descriptor, indexed by group rank (a list of
            ``len(FIELDS)`` ints each).

        Raises:
            ValueError: ranks disagree on a field (every rank raises it,
                naming the field and each rank's value).
            TimeoutError / RuntimeError: as :meth:`~gradcomp.comm.p2p.Transfer.wait`.
        """
        if self.table is None:
            transfer, self.transfer = self.transfer, None
            transfer.wait()
            table: list[list[int]] = [[]] * self.comm.world_size
            table[self.comm.rank] = list(self.mine)
            for m in self.recvs:
                table[m.peer] = m.buf.view(torch.int64).tolist()
            self.table = table
        self._check(self.table)
        with _AGREED_LOCK:
            try:
                _AGREED[self.comm.group] = self.mine
            except TypeError:
                pass
        return self.table

    def _check(self, table: list[list[int]]) -> None:
        for i, field in enumerate(FIELDS):
            seen = [row[i] for row in table]
            if len(set(seen)) > 1:
                labels = self.names.get(field, {})
                shown = [labels.get(v, v) for v in seen]
                per_rank = ", ".join(f"rank {j}: {s!r}" for j, s in enumerate(shown))
                raise ValueError(
                    f"gradcomp collective: the ranks of the group passed different {_WHAT[field]} "
                    f"({per_rank}); every rank must call it with the same tensor size, op, algorithm "
                    "and compressor settings, in the same order")
