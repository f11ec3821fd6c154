"""Every rank checks, before any payload moves, that all ranks made the same call.

A mismatched collective makes gloo abort a process (a message longer than the
receive posted for it) or silently returns different values. So a call starts
with an *agreement*: every rank sends its :class:`Signature`, a fixed-size row
of little-endian int64 (:data:`FIELDS`: the message pattern, the op and a
digest of the call's details such as its tag or calling thread, or a
component's settings), to every other rank (tag :data:`TAG`). When the digests
differ the ranks also exchange the details (lengths first, so every receive
has its exact size). Every rank then raises the same ``ValueError`` naming the
first difference and each rank's value, before any payload is compressed or
sent; the group stays usable. A call agrees only when its signature differs
from the last one its group agreed on (:func:`needs_check`), so a loop that
repeats a call pays once; a rank alone changing its call reaches the ranks
that skip their check through disagreement envelopes (:mod:`gradcomp.comm.replay`;
on gloo: NCCL ignores tags, so there that case is as undefined as any
mismatched NCCL collective). The memory goes with the group object and a
failed call forgets it (:func:`forget`). More: docs/collectives.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import weakref
from dataclasses import dataclass, field

import torch

from gradcomp.comm.p2p import PIECES, Comm, Message, Transfer
from gradcomp.comm.replay import PATTERN_PHASES, replay

__all__ = ["FIELDS", "SIGNATURE_NBYTES", "TAG", "SIZES_TAG", "MAX_DETAILS_NBYTES", "Signature", "signature",
           "call_identity", "digest", "agree", "needs_check", "forget", "remember_pattern", "pattern"]

#: signature fields, in wire order (``details``: a digest of the details)
FIELDS = ("numel", "op", "algorithm", "codec", "wire_nbytes", "pattern", "details")
#: bytes of one signature on the wire
SIGNATURE_NBYTES = 8 * len(FIELDS)
#: point-to-point tag of signatures (payload pieces use 0 .. PIECES - 1); the
#: details' lengths and texts use TAG + 2 and TAG + 3
TAG = 2 * PIECES
#: tag of the sparse allgather's payload sizes (:mod:`gradcomp.comm.allgather`)
SIZES_TAG = TAG + 1
#: longest details text a rank accepts from a peer (a longer announced length is a broken peer)
MAX_DETAILS_NBYTES = 1 << 26

_WHAT = {
    "numel": "numbers of elements",
    "op": "ops",
    "algorithm": "algorithms",
    "codec": "compressor types",
    "wire_nbytes": "compressor settings (payload sizes)",
    "pattern": "compressor settings (message pattern: chunk payload sizes, block size or rounding)",
}
_SHORT = {_WHAT["wire_nbytes"]: "payload sizes", _WHAT["pattern"]: "message pattern"}
_HINT = ("every rank of a group must make the same gradcomp calls with the same settings, in the same "
         "order (see gradcomp.comm.agreement)")


@dataclass(frozen=True)
class Signature:
    """What a call agrees on: a row of ints (:data:`FIELDS`) and named details.

    Attributes:
        row: the int64 values sent, ``details`` last (its :func:`digest`).
        details: name -> text of everything else the ranks must share (the
            call's name, tag or thread, a component's settings); sent only
            when the digests differ, to name the difference.
        labels: per field, how to print its codes (``{"op": {0: "avg"}}``).
    """

    row: tuple[int, ...]
    details: dict[str, str] = field(compare=False)
    labels: dict[str, dict[int, str]] = field(compare=False, default_factory=dict)


def signature(*, details: dict[str, str], labels: dict[str, dict[int, str]] | None = None,
              **values: int) -> Signature:
    """A :class:`Signature` from the int fields given (the others 0) and ``details``.

    Raises:
        ValueError: a name in ``values`` is not one of :data:`FIELDS`.
    """
    unknown = set(values) - set(FIELDS[:-1])
    if unknown:
        raise ValueError(f"signature: unknown fields {sorted(unknown)}; allowed: {FIELDS[:-1]}")
    row = tuple(int(values.get(f, 0)) for f in FIELDS[:-1]) + (digest(tuple(details.items())),)
    return Signature(row, details, labels or {})


@functools.lru_cache(maxsize=4096)
def digest(items: tuple) -> int:
    """A signed 64-bit digest (BLAKE2b) of a tuple of strings and ints, the same in every process."""
    text = json.dumps(items, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def call_identity(tag) -> str:
    """What tells one call apart from another on a group: ``tag`` if given,
    else the calling thread's name.

    Raises:
        TypeError: ``tag`` is not None, a str or an int.
    """
    if tag is None:
        return f"thread {threading.current_thread().name!r}"
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"tag must be None, a str or an int, got {type(tag).__name__}")
    return f"tag {tag!r}"


# group -> (row every rank of it last agreed on, that call's message pattern or None);
# an entry goes with its group (a new group never inherits one, even at the same address)
_MEMORY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def needs_check(group, sig: Signature) -> bool:
    """Whether a call on ``group`` with ``sig`` must agree first: it differs
    from the signature the group's ranks last agreed on (or there is none)."""
    with _LOCK:
        try:
            kept = _MEMORY.get(group)
        except TypeError:  # a group object without weak references: always check
            return True
        return kept is None or kept[0] != sig.row


def forget(group) -> None:
    """Drop what ``group`` agreed on (after a failed call): its next call checks."""
    with _LOCK:
        try:
            _MEMORY.pop(group, None)
        except TypeError:
            pass


def remember_pattern(group, sig: Signature, trace) -> None:
    """After a successful call with the group's agreed signature ``sig``: keep
    the pattern phases of its message trace (:attr:`gradcomp.comm.p2p.Comm.trace`;
    :data:`gradcomp.comm.replay.PATTERN_PHASES`) unless one is kept."""
    with _LOCK:
        try:
            kept = _MEMORY.get(group)
            if kept is not None and kept[0] == sig.row and kept[1] is None:
                _MEMORY[group] = (sig.row, [t for t in trace if t[2] in PATTERN_PHASES])
        except TypeError:
            pass


def pattern(group) -> list:
    """The message pattern of the group's last agreed call ([] when none is kept)."""
    with _LOCK:
        try:
            kept = _MEMORY.get(group)
        except TypeError:
            return []
        return [] if kept is None or kept[1] is None else kept[1]


def agree(comm: Comm, sig: Signature, *, device="cpu", replaying=()) -> None:
    """Exchange ``sig`` with every other rank (and post the envelopes of
    ``replaying``, :func:`gradcomp.comm.replay.replay`, at the same time),
    check every rank's, and remember it as what ``comm``'s group agreed on.

    Args:
        comm: the group (world size >= 2).
        sig: this rank's signature.
        device: where the message tensors live (the group's device).
        replaying: trace entries to replay as envelopes first (the pattern
            of the group's last agreed call, or what is left of it).

    Raises:
        ValueError: the ranks' signatures differ (every rank raises the same
            one, naming the first difference and each rank's value).
        TimeoutError / RuntimeError: as :meth:`~gradcomp.comm.p2p.Transfer.wait`.
        gradcomp.PayloadError: a peer announced details longer than
            :data:`MAX_DETAILS_NBYTES`.
    """
    n, r = comm.world_size, comm.rank
    pending = replay(comm, list(replaying), device) if replaying else None
    wire = torch.tensor(sig.row, dtype=torch.int64).view(torch.uint8).to(device)
    recvs = [Message(p, torch.empty(SIGNATURE_NBYTES, dtype=torch.uint8, device=device))
             for p in range(n) if p != r]
    rows = comm.start([Message(p, wire) for p in range(n) if p != r], recvs, "agreement", tag=TAG)
    _wait_both(rows, pending)
    table: list[tuple[int, ...]] = [sig.row] * n
    for m in recvs:
        table[m.peer] = tuple(m.buf.cpu().view(torch.int64).tolist())
    details = None
    if len({row[-1] for row in table}) > 1:
        details = _exchange_details(comm, sig.details, device)
    problem = _difference(table, details, sig)
    if problem is not None:
        raise ValueError(problem)
    with _LOCK:
        try:
            _MEMORY[comm.group] = (sig.row, None)
        except TypeError:  # a group object without weak references: nothing remembered
            pass


def _wait_both(first: Transfer, second) -> None:
    """Wait for both (the second may be None), even when the first fails, so
    that no posted receive is left to catch a later call's bytes."""
    try:
        first.wait()
    finally:
        if second is not None:
            second.wait()


def _exchange_details(comm: Comm, details: dict[str, str], device) -> list[dict[str, str]]:
    """Every rank's details (lengths, then texts), indexed by group rank."""
    from gradcomp.errors import PayloadError

    n, r = comm.world_size, comm.rank
    mine = json.dumps(list(details.items())).encode()
    size = torch.tensor([len(mine)], dtype=torch.int64).view(torch.uint8).to(device)
    lens = [Message(p, torch.empty(8, dtype=torch.uint8, device=device)) for p in range(n) if p != r]
    comm.exchange([Message(p, size) for p in range(n) if p != r], lens, "agreement", tag=TAG + 2)
    sizes = {m.peer: int(m.buf.cpu().view(torch.int64).item()) for m in lens}
    for p, s in sizes.items():
        if not 0 <= s <= MAX_DETAILS_NBYTES:
            raise PayloadError(f"gradcomp agreement: rank {p} announced {s} bytes of call details "
                               f"(at most {MAX_DETAILS_NBYTES})")
    text = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device) if mine else \
        torch.empty(0, dtype=torch.uint8, device=device)
    texts = [Message(p, torch.empty(sizes[p], dtype=torch.uint8, device=device)) for p in range(n) if p != r]
    comm.start([Message(p, text) for p in range(n) if p != r], texts, "agreement", tag=TAG + 3,
               split=False).wait()
    out: list[dict[str, str]] = [dict(details)] * n
    for m in texts:
        try:
            out[m.peer] = dict(json.loads(bytes(m.buf.cpu().numpy().tobytes()).decode()))
        except (ValueError, TypeError) as e:
            raise PayloadError(f"gradcomp agreement: rank {m.peer} sent malformed call details: {e}") from e
    return out


class _Text(str):
    """A details text, printed as it is (a setting's text is already a ``repr``)."""

    def __repr__(self) -> str:
        return str(self)


def _difference(table, details, sig: Signature) -> str | None:
    """The message naming the first field the ranks differ on (None: they agree);
    the same text on every rank (built from every rank's values alone)."""
    labels, found = sig.labels, []
    if details is not None and len({d.get("call") for d in details}) > 1:
        found.append(("calls", [_Text(d.get("call")) for d in details]))
    if details is not None:  # the settings a call's sizes follow from come first
        keys = list(dict.fromkeys(k for d in details for k in d if k != "call"))
        for k in keys:
            seen = [_Text(d.get(k, "(not given)")) for d in details]
            if len(set(seen)) > 1:
                found.append((k, seen))
    for i, name in enumerate(FIELDS[:-1]):
        seen = [row[i] for row in table]
        if len(set(seen)) > 1:
            names = labels.get(name, {})
            found.append((_WHAT[name], [names.get(s, s) for s in seen]))
    if not found:
        return None
    what, seen = found[0]
    sep = "; " if any(isinstance(v, _Text) and ", " in v for v in seen) else ", "  # texts hold commas
    per_rank = sep.join(f"rank {j}: {v!r}" for j, v in enumerate(seen))
    # equal digests: every rank's details are this rank's
    calls = {d.get("call") for d in details} if details is not None else {sig.details.get("call")}
    prefix = calls.pop() if len(calls) == 1 and None not in calls else "gradcomp"
    also = list(dict.fromkeys(_SHORT.get(w, w) for w, _ in found[1:]))
    more = f"; they also differ in {', '.join(also)}" if also else ""
    return f"{prefix}: the ranks of the group passed different {what} ({per_rank}){more}; {_HINT}"
