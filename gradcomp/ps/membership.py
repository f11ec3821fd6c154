"""Who a parameter server serves and whether each worker is alive.

A :class:`Peer` per worker rank (status, session, counters, its replica's
mirror), :func:`claim` (which process holds a rank), :func:`expired` (the
two failure detectors: no heartbeat, or no request since the last reply) and
:class:`HeartbeatResponder`, the thread that answers heartbeats on their own
socket so a long step never looks like a dead server. What a failure *does*
(continue without the worker, or abort the run) is the message loop's
policy (:mod:`gradcomp.ps.server`).

One process holds a rank at a time: its session (the random id in its
HELLO) on one connection authenticated as that rank. A newer process of the
rank takes over only when the holder is gone (declared dead, done, or its
connection closed) or when it names a higher incarnation than the holder's:
a restart passes ``incarnation=`` (the holder's + 1) to displace a holder
that still looks alive; a duplicate (the same or a lower incarnation) is
refused and the holder keeps training. A displaced process is told why at
its next request or heartbeat (``docs/parameter-server.md#who-holds-a-rank``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import zmq

from gradcomp.meter import TrafficMeter
from gradcomp.ps import protocol as P
from gradcomp.ps.errors import ProtocolError

__all__ = ["Peer", "peer_table", "claim", "admit", "expired", "HeartbeatResponder", "JOIN", "TAKE_OVER",
           "REFUSE"]

log = logging.getLogger("gradcomp.ps")

#: verdicts of :func:`claim`
JOIN, TAKE_OVER, REFUSE = "join", "take over", "refuse"
_DISPLACED_KEPT = 8  # sessions of a rank remembered after they were displaced


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
    sessions: int = 0  # processes that joined as this rank: 1 + restarts and takeovers
    taken_over: int = 0  # live processes displaced by a newer incarnation
    session: int | None = None  # id of the current process's session (None before its HELLO)
    route: bytes | None = None  # routing id of that session's request connection
    incarnation: int = 0  # the current process's incarnation of this rank
    origin: str = ""  # the current process: pid, host and address
    #: displaced sessions -> (EVICTED status, reason), the last few
    displaced: OrderedDict = field(default_factory=OrderedDict)
    last_seq: int = 0  # last request number handled in this session
    heard: float = 0.0  # time.monotonic() of its last message (request or heartbeat)
    clock: float = 0.0  # start of its worker_timeout: the last reply, or serve()'s start
    meter: TrafficMeter = field(default_factory=TrafficMeter)
    mirror: dict | None = None  # compress_pull: the worker's replica as the server knows it
    deferred: P.Header | None = None  # sync: a pull waiting for the step to complete

    @property
    def user(self) -> str:
        """The user id its connections authenticate as (ZAP ``User-Id``)."""
        return f"w{self.rank}"

    def join(self, h: P.Header, now: float, run_failed: bool, route: bytes = b"", origin: str = "") -> None:
        """A new session (the HELLO ``h`` of a first or restarted process, on
        connection ``route``): a dead or finished worker is active again
        unless the run has failed; its replica and any waiting pull are forgotten."""
        if self.status in ("dead", "done") and not run_failed:
            self.status, self.reason = "active", ""
        self.session, self.sessions, self.last_seq = h.session, self.sessions + 1, h.seq
        self.route, self.incarnation, self.origin = route, h.aux, origin
        self.mirror = self.deferred = None
        self.heard = self.clock = now

    def refusal(self, session: int) -> tuple[int, str]:
        """``(EVICTED status, reason)`` for a message of ``session``, which is
        not the rank's current one: displaced, or never joined."""
        return self.displaced.get(session, (P.UNKNOWN_SESSION, (
            f"worker rank {self.rank}: the server serves another process of this rank "
            f"({self.origin or 'none yet'}), and this one never joined")))

    def displace(self, status: int, reason: str) -> None:
        """Remember the current session as displaced (its later messages are
        answered EVICTED with ``status`` and ``reason``)."""
        if self.session is not None:
            self.displaced[self.session] = (status, reason)
            while len(self.displaced) > _DISPLACED_KEPT:
                self.displaced.popitem(last=False)

    def declare_dead(self, reason: str) -> None:
        """Mark it dead for ``reason``; its replica and any waiting pull are forgotten."""
        self.status, self.reason = "dead", reason
        self.mirror = self.deferred = None


def peer_table(ranks: Iterable[int]) -> tuple[dict[int, Peer], dict[str, Peer]]:
    """A :class:`Peer` per worker rank: ``(by rank, by user id)``."""
    peers = {r: Peer(r) for r in ranks}
    return peers, {p.user: p for p in peers.values()}


def claim(peer: Peer, incarnation: int, holder_connected: bool) -> str:
    """The verdict on a new session asking for ``peer``'s rank with ``incarnation``.

    Args:
        peer: the rank's record (its current session is the holder).
        incarnation: the newcomer's incarnation (>= 0).
        holder_connected: the holder's request connection is still open.

    Returns:
        :data:`JOIN` when no live process holds the rank (none yet, or it is
        dead, done, aborted or its connection closed), :data:`TAKE_OVER` when
        a live one does and ``incarnation`` is higher than its, else :data:`REFUSE`.
    """
    if peer.session is None or peer.status != "active" or not holder_connected:
        return JOIN
    return TAKE_OVER if incarnation > peer.incarnation else REFUSE


def admit(peer: Peer, incarnation: int, origin: str, holder_connected: bool) -> str | None:
    """Decide the HELLO of a new process (``origin``: its incarnation, pid,
    host and address) for ``peer``'s rank, by :func:`claim`.

    Returns:
        None when it may join: a live holder it displaces is remembered
        (told why at its next message). Else the refusal's text, naming the holder.
    """
    verdict = claim(peer, incarnation, holder_connected)
    if verdict == REFUSE:
        return (f"worker rank {peer.rank} is held by a live process ({peer.origin}); this process "
                f"(incarnation {incarnation}) may take it over only as a newer incarnation: stop that "
                f"process, or restart this one with incarnation={peer.incarnation + 1}")
    if peer.session is not None and peer.status == "active":
        how = "" if verdict == TAKE_OVER else ", after this process's connection had closed"
        peer.displace(P.TAKEN_OVER, f"worker rank {peer.rank} was taken over by a newer process ({origin}){how}")
        peer.taken_over += verdict == TAKE_OVER
        log.warning("parameter server: worker rank %d (%s) replaced by %s", peer.rank, peer.origin, origin)
    return None


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
    and noting when each worker was last heard (a worker is known by the user
    its connection authenticated as). A heartbeat of a displaced session is
    answered EVICTED with the reason, so a process that lost its rank learns
    it even while it waits for a reply.

    Args:
        server: the :class:`~gradcomp.ps.ParameterServer` (its ``peers``,
            ``global_rank``, ``version`` and ``heartbeat_meter`` are read).
        sock: the bound heartbeat ROUTER socket (closed by :meth:`stop`).
    """

    def __init__(self, server, sock):
        self._server, self._sock = server, sock
        self._peers = {p.user: p for p in server.peers.values()}
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
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._answer(frames)

    def _answer(self, frames) -> None:
        server, n = self._server, P.message_nbytes()
        peer = self._peers.get(frames[-1].get("User-Id"))
        try:
            if peer is None or len(frames) != 2:
                raise ProtocolError("not a heartbeat")
            h = P.Header.unpack(frames[1].buffer, (P.HEARTBEAT,), None)
        except ProtocolError:
            self.malformed += 1
            return
        server.heartbeat_meter.record_recv(n, n, "heartbeat")
        route = frames[0].bytes
        displaced = peer.displaced.get(h.session)
        if displaced is not None:
            text = displaced[1].encode()
            reply = P.Header(P.EVICTED, server.global_rank, server.version, nbytes=len(text),
                             status=displaced[0], seq=h.seq, session=h.session)
            self._send([route, reply.pack(), text], P.message_nbytes(len(text)))
            return
        if h.session != peer.session:
            return  # before its HELLO was handled, or a process the server never served
        if peer.status == "active":
            peer.heard = time.monotonic()
        reply = P.Header(P.HEARTBEAT, server.global_rank, server.version, seq=h.seq, session=h.session)
        self._send([route, reply.pack()], n)

    def _send(self, frames, nbytes: int) -> None:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
            self._server.heartbeat_meter.record_send(nbytes, nbytes, "heartbeat")
        except zmq.ZMQError:
            pass  # a worker not reading its heartbeat replies finds the server silent
