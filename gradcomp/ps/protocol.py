"""Parameter-server messages over ZeroMQ (a ROUTER socket per server, DEALERs on the workers).

Every exchange is a request from a worker answered by one reply from a
server. A message is one ZeroMQ multipart message of one or two frames,
each frame's length set and checked by the library (never by a peer's
header):

1. a control header of :data:`HEADER_NBYTES` bytes, ten little-endian int64::

       0 magic     0x53504347 ("GCPS" little-endian)
       1 kind      requests: PUSH, PULL, DONE, HELLO, HEARTBEAT;
                   replies: PUSH_REPLY, PULL_REPLY, ABORT, WELCOME, EVICTED, HEARTBEAT
       2 sender    global rank of the sender
       3 version   parameter version (see below)
       4 nbytes    length of the data frame (0: no data frame); must equal
                   the length ZeroMQ delivered, or the message is rejected
       5 status    push reply: ACCEPTED / DROPPED / REJECTED; pull request:
                   WANT_FULL flag; pull reply: FULL / DELTA; WELCOME: the
                   server's heartbeat port; EVICTED: why (DECLARED_DEAD, ...)
       6 layout    CRC-32 of the shard's names and shapes (requests)
       7 aux       pull request: minimum version wanted; push reply: staleness;
                   ABORT: the failed worker's rank; WELCOME: pushes of this
                   worker rank the server accepted before (earlier processes);
                   HELLO: the process's incarnation of its rank (>= 0)
       8 seq       request number within the worker's session (1, 2, ...);
                   a reply carries the number of the request it answers
       9 session   random 63-bit id of the worker process's connection

2. when ``nbytes > 0``, the data frame: a *bundle* of gradcomp wire payloads,
   one per parameter of the shard in shard order::

       int64 count, int64 size[count], payload bytes[size[0]], ..., payload bytes[size[count-1]]

   (EVICTED: the reason as UTF-8 text; HELLO: the process's host and pid as JSON).

A worker holds one DEALER per server for requests and, on a background
thread, one per server for heartbeats to the server's heartbeat port, where
a thread of the server answers them even while a step computes. The server
knows a message's sender by the worker rank its connection authenticated as
(:mod:`gradcomp.ps.auth`), never by a routing id the peer chose.

Version semantics: a push carries the server version of the parameters its
gradient was computed from; a push reply and a pull reply carry the server's
version after handling the request.

Accounting: :func:`message_nbytes` is what ZeroMQ puts on the connection for
one message: our frames plus the ZMTP/3.1 frame headers (RFC 37: one flags
byte and a 1-byte length up to 255 bytes, else an 8-byte length). The
routing-id frame a ROUTER sees is local: it never travels.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import wire as W
from gradcomp.errors import PayloadError
from gradcomp.ps.errors import ProtocolError

__all__ = [
    "HEADER_NUMEL", "HEADER_NBYTES", "MAGIC",
    "PUSH", "PULL", "DONE", "HELLO", "HEARTBEAT", "PUSH_REPLY", "PULL_REPLY", "ABORT", "WELCOME",
    "EVICTED", "ACCEPTED", "DROPPED", "REJECTED", "WANT_FULL", "FULL", "DELTA",
    "DECLARED_DEAD", "TAKEN_OVER", "RANK_IN_USE", "UNKNOWN_SESSION", "MAX_HELLO_NBYTES",
    "process_description", "read_process_description",
    "REQUESTS", "REPLIES", "Header", "frame_overhead", "message_nbytes", "pack_bundle",
    "unpack_bundle", "raw_bundle_nbytes", "join_layout", "MODES", "FAILURE_POLICIES",
]

#: server modes and worker-failure policies (validated by every role)
MODES = ("sync", "async")
FAILURE_POLICIES = ("continue", "fail")

MAGIC = 0x53504347
HEADER_NUMEL = 10
HEADER_NBYTES = 8 * HEADER_NUMEL
_HEADER = struct.Struct(f"<{HEADER_NUMEL}q")

# message kinds
PUSH, PULL, DONE, PUSH_REPLY, PULL_REPLY, ABORT, HELLO, WELCOME, HEARTBEAT, EVICTED = range(1, 11)
KIND_NAMES = {PUSH: "PUSH", PULL: "PULL", DONE: "DONE", PUSH_REPLY: "PUSH_REPLY",
              PULL_REPLY: "PULL_REPLY", ABORT: "ABORT", HELLO: "HELLO", WELCOME: "WELCOME",
              HEARTBEAT: "HEARTBEAT", EVICTED: "EVICTED"}
REQUESTS = (PUSH, PULL, DONE, HELLO, HEARTBEAT)
REPLIES = (PUSH_REPLY, PULL_REPLY, ABORT, WELCOME, EVICTED, HEARTBEAT)

# status field
ACCEPTED, DROPPED, REJECTED = 0, 1, 2  # push replies
WANT_FULL = 1  # pull request flag: the worker holds no replica yet
FULL, DELTA = 1, 2  # pull replies: full float32 parameters or a compressed delta
STATUS_NAMES = {ACCEPTED: "accepted", DROPPED: "dropped", REJECTED: "rejected"}
# EVICTED replies: why the server no longer serves that session
DECLARED_DEAD, TAKEN_OVER, RANK_IN_USE, UNKNOWN_SESSION = 0, 1, 2, 3
#: largest HELLO data frame (the process description)
MAX_HELLO_NBYTES = 512


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
    seq: int = 0
    session: int = 0

    def pack(self) -> bytes:
        """The :data:`HEADER_NBYTES` bytes of the header frame."""
        return _HEADER.pack(MAGIC, self.kind, self.sender, self.version, self.nbytes,
                            self.status, self.layout, self.aux, self.seq, self.session)

    @classmethod
    def unpack(cls, frame, kinds: tuple[int, ...], data_nbytes: int | None) -> "Header":
        """Parse and validate a received header frame.

        Args:
            frame: the frame's bytes (any buffer).
            kinds: the message kinds expected here.
            data_nbytes: length of the data frame ZeroMQ delivered (None: none).

        Raises:
            ProtocolError: wrong frame length, bad magic, a kind not in
                ``kinds``, or ``nbytes`` different from the data frame's length.
        """
        n = memoryview(frame).nbytes
        if n != HEADER_NBYTES:
            raise ProtocolError(f"header frame of {n} bytes, expected {HEADER_NBYTES}")
        magic, kind, sender, version, nbytes, status, layout, aux, seq, session = _HEADER.unpack(frame)
        if magic != MAGIC:
            raise ProtocolError(f"bad header magic {magic:#x}, expected {MAGIC:#x}")
        if kind not in kinds:
            raise ProtocolError(f"unexpected message kind {kind}, expected one of "
                                f"{[KIND_NAMES[k] for k in kinds]}")
        got = 0 if data_nbytes is None else data_nbytes
        if nbytes != got or (data_nbytes is not None and got == 0):
            raise ProtocolError(f"header announces {nbytes} data bytes, the message carries {got}")
        return cls(kind, sender, version, nbytes, status, layout, aux, seq, session)


def frame_overhead(nbytes: int) -> int:
    """Bytes ZMTP/3.1 adds to a frame of ``nbytes``: flags + 1-byte size up to
    255 bytes, flags + 8-byte size above (RFC 37)."""
    return 2 if nbytes <= 255 else 9


def message_nbytes(data_nbytes: int = 0) -> int:
    """Bytes one message with a data frame of ``data_nbytes`` (0: none) puts on
    the connection: header frame + data frame, each with its ZMTP frame header."""
    n = HEADER_NBYTES + frame_overhead(HEADER_NBYTES)
    return n + (data_nbytes + frame_overhead(data_nbytes) if data_nbytes else 0)


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
                           "(or run under torchrun / gradcomp.launch) first, or give the worker "
                           "its rank and server_addresses")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    num_servers = v.integer("num_servers", num_servers, 1)
    if num_servers >= world:
        raise ValueError(f"num_servers must be < the world size {world} (at least one worker), "
                         f"got {num_servers}")
    return rank, world, num_servers


def process_description() -> bytes:
    """This process's host name and pid, the data of its HELLO (JSON, UTF-8)."""
    text = json.dumps({"host": socket.gethostname()[:100], "pid": os.getpid()})
    return text.encode()[:MAX_HELLO_NBYTES]


def read_process_description(data, peer_address: str | None) -> str:
    """``"pid P on host 'H', from ADDRESS"`` from a HELLO's data (peer-supplied:
    parsed defensively, printable characters only) and the connection's
    address as the server sees it."""
    host, pid = "?", "?"
    try:
        doc = json.loads(bytes(data)) if data is not None else {}
        host = "".join(c for c in str(doc.get("host", "?"))[:100] if c.isprintable())
        pid = int(doc.get("pid"))
    except (ValueError, TypeError, AttributeError):
        pass
    return f"pid {pid} on host {host!r}, from {peer_address or '?'}"


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

