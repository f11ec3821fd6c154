"""Who a parameter server serves and whether each worker is alive.

A :class:`Peer` per worker rank (status, session, counters, its replica's
mirror), :func:`expired` (the two failure detectors: no heartbeat, or no
request since the last reply) and :class:`HeartbeatResponder`, the thread
that answers heartbeats on their own socket so a long step never looks like
a dead server. What a failure *does* (continue without the worker, or abort
the run) is the message loop's policy (:mod:`gradcomp.ps.server`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import zmq

from gradcomp.meter import TrafficMeter
from gradcomp.ps import protocol as P
from gradcomp.ps.errors import ProtocolError

__all__ = ["Peer", "peer_table", "expired", "HeartbeatResponder"]


@dataclass
class Peer:
    """What the server knows about one worker."""

    rank: int
    status: str = "active"  # active | done | dead | aborted
    reason: str = ""
    pushes: int = 0
    accepted: int = 0
    dropped: int = 0
    rejected: int = 0
    pulls: int = 0
    sessions: int = 0  # connections (HELLOs) seen: 1 + restarts
    session: int | None = None  # id of the current connection (None before its HELLO)
    last_seq: int = 0  # last request number handled in this session
    heard: float = 0.0  # time.monotonic() of its last message (request or heartbeat)
    clock: float = 0.0  # start of its worker_timeout: the last reply, or serve()'s start
    meter: TrafficMeter = field(default_factory=TrafficMeter)
    mirror: dict | None = None  # compress_pull: the worker's replica as the server knows it
    deferred: P.Header | None = None  # sync: a pull waiting for the step to complete

    @property
    def ident(self) -> bytes:
        """Routing id of its request socket."""
        return b"w%d" % self.rank

    def join(self, h: P.Header, now: float, run_failed: bool) -> None:
        """A new session (the HELLO ``h`` of a first or restarted process): a
        dead or finished worker is active again unless the run has failed;
        its replica and any waiting pull are forgotten."""
        if self.status in ("dead", "done") and not run_failed:
            self.status, self.reason = "active", ""
        self.session, self.sessions, self.last_seq = h.session, self.sessions + 1, h.seq
        self.mirror = self.deferred = None
        self.heard = self.clock = now

    def declare_dead(self, reason: str) -> None:
        """Mark it dead for ``reason``; its replica and any waiting pull are forgotten."""
        self.status, self.reason = "dead", reason
        self.mirror = self.deferred = None


def peer_table(ranks: Iterable[int]) -> tuple[dict[int, Peer], dict[bytes, Peer]]:
    """A :class:`Peer` per worker rank: ``(by rank, by routing id)``."""
    peers = {r: Peer(r) for r in ranks}
    return peers, {p.ident: p for p in peers.values()}


def expired(peers: Iterable[Peer], now: float, heartbeat_timeout: float,
            worker_timeout: float) -> Iterator[tuple[Peer, str]]:
    """The active peers past a deadline, with the reason, one at a time (a
    peer's status is read when it is reached, so acting on one failure
    before the next is checked is safe).

    A peer is past its deadline when it has connected and sent nothing
    (requests or heartbeats) for ``heartbeat_timeout`` seconds (process or
    link down), or when, with no pull held back by the server, it has made no
    request for ``worker_timeout`` seconds since its clock (the last reply).
    """
    for p in peers:
        if p.status != "active":
            continue
        if p.session is not None and now - p.heard > heartbeat_timeout:
            yield p, (f"no heartbeat for more than heartbeat_timeout={heartbeat_timeout:g} s "
                      "(process or link down)")
        elif p.deferred is None and now - p.clock > worker_timeout:
            yield p, f"silent for more than worker_timeout={worker_timeout:g} s"


class HeartbeatResponder:
    """A thread answering workers' heartbeats on the server's heartbeat socket
    (routing ids ``h<rank>``) and noting when each worker was last heard.

    Args:
        server: the :class:`~gradcomp.ps.ParameterServer` (its ``peers``,
            ``global_rank``, ``version`` and ``heartbeat_meter`` are read).
        sock: the bound heartbeat ROUTER socket (closed by :meth:`stop`).
    """

    def __init__(self, server, sock):
        self._server, self._sock = server, sock
        self._peers = {b"h%d" % p.rank: p for p in server.peers.values()}
        #: messages on the heartbeat socket that were not a heartbeat of a known worker
        self.malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gradcomp-ps-heartbeats-{server.global_rank}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._sock.close(linger=0)

    def _run(self) -> None:
        server, n = self._server, P.message_nbytes()
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                peer = self._peers.get(frames[0])
                try:
                    if peer is None or len(frames) != 2:
                        raise ProtocolError("not a heartbeat")
                    h = P.Header.unpack(frames[1], (P.HEARTBEAT,), None)
                except ProtocolError:
                    self.malformed += 1
                    continue
                server.heartbeat_meter.record_recv(n, n, "heartbeat")
                if h.session != peer.session:
                    continue  # an earlier process of that rank, or before its HELLO
                if peer.status == "active":
                    peer.heard = time.monotonic()
                reply = P.Header(P.HEARTBEAT, server.global_rank, server.version, seq=h.seq, session=h.session)
                try:
                    self._sock.send_multipart([frames[0], reply.pack()], zmq.NOBLOCK)
                    server.heartbeat_meter.record_send(n, n, "heartbeat")
                except zmq.ZMQError:
                    pass  # a worker not reading its heartbeat replies finds the server silent
