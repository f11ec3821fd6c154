"""Parameter-server messages over torch.distributed point-to-point (gloo).

Every exchange is a request from a worker answered by one reply from a
server, so each worker has at most one request outstanding per server.
A message is two point-to-point transfers:

1. a fixed-size control header, ``HEADER_NUMEL`` int64 values
   (:data:`HEADER_NBYTES` bytes)::

       0 magic     0x53504347 ("GCPS" little-endian)
       1 kind      PUSH, PULL, DONE (requests); PUSH_REPLY, PULL_REPLY, ABORT (replies)
       2 sender    global rank of the sender
       3 version   parameter version (see below)
       4 nbytes    length of the data message that follows (0: none)
       5 status    push reply: ACCEPTED / DROPPED / REJECTED; pull request:
                   WANT_FULL flag; pull reply: FULL / DELTA
       6 layout    CRC-32 of the shard's names and shapes (requests)
       7 aux       pull request: minimum version wanted; push reply: staleness;
                   ABORT: the failed worker's rank

2. when ``nbytes > 0``, a ``torch.uint8`` data message of exactly ``nbytes``
   bytes: a *bundle* of gradcomp wire payloads, one per parameter of the
   shard in shard order::

       int64 count, int64 size[count], payload bytes[size[0]], ..., payload bytes[size[count-1]]

Tags separate the message kinds (gloo matches a receive to a send by peer and
tag): request headers travel with :data:`TAG_REQUEST`, push bundles with
:data:`TAG_PUSH_DATA`, reply headers with :data:`TAG_REPLY` and pull bundles
with :data:`TAG_PULL_DATA`.

Version semantics: a push carries the server version of the parameters its
gradient was computed from; a push reply and a pull reply carry the server's
version after handling the request.

Every wait has a timeout. Gloo's point-to-point work objects neither report
completion before ``wait()`` nor survive a timed-out ``wait()`` (the
connection to that peer is closed), so a receiver waits with the full
timeout it is prepared to allow and treats a timeout as the peer's failure.
"""

from __future__ import annotations

import datetime
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import wire as W
from gradcomp.errors import PayloadError
from gradcomp.ps.errors import PeerError, ProtocolError

__all__ = [
    "HEADER_NUMEL", "HEADER_NBYTES", "MAGIC",
    "PUSH", "PULL", "DONE", "PUSH_REPLY", "PULL_REPLY", "ABORT",
    "ACCEPTED", "DROPPED", "REJECTED", "WANT_FULL", "FULL", "DELTA",
    "TAG_REQUEST", "TAG_PUSH_DATA", "TAG_REPLY", "TAG_PULL_DATA",
    "Header", "send_message", "recv_message", "pack_bundle", "unpack_bundle",
    "raw_bundle_nbytes", "decoder_for",
]

MAGIC = 0x53504347
HEADER_NUMEL = 8
HEADER_NBYTES = 8 * HEADER_NUMEL

# message kinds
PUSH, PULL, DONE, PUSH_REPLY, PULL_REPLY, ABORT = 1, 2, 3, 4, 5, 6
KIND_NAMES = {PUSH: "PUSH", PULL: "PULL", DONE: "DONE", PUSH_REPLY: "PUSH_REPLY",
              PULL_REPLY: "PULL_REPLY", ABORT: "ABORT"}
REQUESTS = (PUSH, PULL, DONE)
REPLIES = (PUSH_REPLY, PULL_REPLY, ABORT)

# status field
ACCEPTED, DROPPED, REJECTED = 0, 1, 2  # push replies
WANT_FULL = 1  # pull request flag: the worker holds no replica yet
FULL, DELTA = 1, 2  # pull replies: full float32 parameters or a compressed delta
STATUS_NAMES = {ACCEPTED: "accepted", DROPPED: "dropped", REJECTED: "rejected"}

# tags (one per message kind of the byte stream)
TAG_REQUEST, TAG_PUSH_DATA, TAG_REPLY, TAG_PULL_DATA = 101, 102, 103, 104


@dataclass
class Header:
    """A control header (see the module docstring for the fields)."""

    kind: int
    sender: int
    version: int = 0
    nbytes: int = 0
    status: int = 0
    layout: int = 0
    aux: int = 0

    def to_tensor(self) -> torch.Tensor:
        """int64 CPU tensor of ``HEADER_NUMEL`` values."""
        return torch.tensor([MAGIC, self.kind, self.sender, self.version, self.nbytes,
                             self.status, self.layout, self.aux], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, kinds: tuple[int, ...], max_nbytes: int) -> "Header":
        """Parse and validate a received header.

        Raises:
            ProtocolError: bad magic, a kind not in ``kinds``, or ``nbytes``
                outside ``[0, max_nbytes]``.
        """
        magic, kind, sender, version, nbytes, status, layout, aux = (int(x) for x in t.tolist())
        if magic != MAGIC:
            raise ProtocolError(f"bad header magic {magic:#x}, expected {MAGIC:#x}")
        if kind not in kinds:
            raise ProtocolError(f"unexpected message kind {kind}, expected one of "
                                f"{[KIND_NAMES[k] for k in kinds]}")
        if not 0 <= nbytes <= max_nbytes:
            raise ProtocolError(f"data length {nbytes} bytes outside [0, {max_nbytes}]")
        return cls(kind, sender, version, nbytes, status, layout, aux)


def join_layout(group, num_servers) -> tuple[int, int, int]:
    """``(rank, world_size, num_servers)`` of this process in ``group``, where
    ranks ``0 .. num_servers - 1`` are servers and the rest workers.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError / TypeError: num_servers not an int in [1, world_size).
    """
    from gradcomp import _validate as v

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group "
                           "(or run under torchrun / gradcomp.launch) first")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    num_servers = v.integer("num_servers", num_servers, 1)
    if num_servers >= world:
        raise ValueError(f"num_servers must be < the world size {world} (at least one worker), "
                         f"got {num_servers}")
    return rank, world, num_servers


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def send_message(header: Header, data: torch.Tensor | None, dst: int, *, header_tag: int,
                 data_tag: int, timeout: float, group=None, what: str = "peer") -> int:
    """Send ``header`` (and ``data``, a CPU uint8 tensor of ``header.nbytes`` bytes)
    to global rank ``dst``; waits at most ``timeout`` seconds per transfer.

    Returns:
        Bytes put on the transport (header + data).

    Raises:
        PeerError: the peer is gone or did not take the message in time.
    """
    works = [dist.isend(header.to_tensor(), dst, group=group, tag=header_tag)]
    if data is not None and data.numel():
        works.append(dist.isend(data, dst, group=group, tag=data_tag))
    try:
        for w in works:
            w.wait(_timedelta(timeout))
    except RuntimeError as e:
        raise PeerError(dst, f"send to {what}", _short(e)) from None
    return HEADER_NBYTES + (0 if data is None else data.numel())


def recv_message(src: int, *, kinds: tuple[int, ...], header_tag: int, data_tag: int,
                 timeout: float, max_nbytes: int, group=None, what: str = "peer"
                 ) -> tuple[Header, torch.Tensor | None]:
    """Receive one header from global rank ``src`` and the data message it announces.

    Returns:
        ``(header, data)``; ``data`` is a CPU uint8 tensor or None when
        ``header.nbytes == 0``.

    Raises:
        PeerError: the peer is gone or sent nothing within ``timeout`` seconds.
        ProtocolError: the header is malformed (see :meth:`Header.from_tensor`).
    """
    buf = torch.empty(HEADER_NUMEL, dtype=torch.int64)
    try:
        dist.irecv(buf, src, group=group, tag=header_tag).wait(_timedelta(timeout))
    except RuntimeError as e:
        raise PeerError(src, f"receive from {what}", _short(e)) from None
    header = Header.from_tensor(buf, kinds, max_nbytes)
    if header.nbytes == 0:
        return header, None
    data = torch.empty(header.nbytes, dtype=torch.uint8)
    try:
        dist.irecv(data, src, group=group, tag=data_tag).wait(_timedelta(timeout))
    except RuntimeError as e:
        raise PeerError(src, f"receive from {what}", _short(e)) from None
    return header, data


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in text and text.startswith("["):  # drop gloo's source-file prefix
        text = text.split("] ", 1)[1]
    return text


# ---- bundles --------------------------------------------------------------------
def pack_bundle(wires: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate wire payloads (1-D uint8 tensors, any device) into one CPU
    uint8 bundle: ``int64 count, int64 sizes[count]`` then the bytes."""
    table = struct.pack(f"<{1 + len(wires)}q", len(wires), *(w.numel() for w in wires))
    parts = [torch.frombuffer(bytearray(table), dtype=torch.uint8)]
    parts += [w.reshape(-1).cpu() for w in wires]
    return torch.cat(parts)


def unpack_bundle(blob: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Split a bundle into ``count`` wire tensors (views into ``blob``).

    Raises:
        PayloadError: wrong count, or sizes that do not add up to the bundle's length.
    """
    n = blob.numel()
    if n < 8:
        raise PayloadError(f"bundle of {n} bytes is shorter than its 8-byte count")
    (got,) = struct.unpack("<q", blob[:8].numpy().tobytes())
    if got != count:
        raise PayloadError(f"bundle holds {got} payloads, expected {count} (one per parameter of the shard)")
    table_end = 8 * (1 + count)
    if n < table_end:
        raise PayloadError(f"bundle of {n} bytes is shorter than its size table ({table_end} bytes)")
    sizes = struct.unpack(f"<{count}q", blob[8:table_end].numpy().tobytes())
    if any(s < 0 for s in sizes) or table_end + sum(sizes) != n:
        raise PayloadError(f"bundle sizes {list(sizes)} do not add up to its {n - table_end} payload bytes")
    out, off = [], table_end
    for s in sizes:
        out.append(blob[off: off + s])
        off += s
    return out


def raw_bundle_nbytes(shapes) -> int:
    """Bytes of the bundle carrying these shapes as uncompressed float32
    (the uncompressed equivalent used in traffic accounting)."""
    shapes = list(shapes)
    return 8 * (1 + len(shapes)) + sum(W.dense_nbytes("raw", s, torch.float32) for s in shapes)


_DECODERS: dict = {}


def decoder_for(codec: str):
    """A compressor able to ``decompress_add_`` any payload of ``codec``
    (payloads are self-describing; settings come from the wire)."""
    dec = _DECODERS.get(codec)
    if dec is None:
        from gradcomp.compressors import Threshold, TopK, compressor_for_codec

        if codec == "topk":
            dec = TopK(k=1)
        elif codec == "threshold":
            dec = Threshold(0.0)
        else:
            dec = compressor_for_codec(codec)
        _DECODERS[codec] = dec
    return dec
