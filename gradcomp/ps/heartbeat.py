"""A worker's heartbeat thread: it tells a dead server from a slow step, and hears of a lost rank.

Every ``interval`` seconds the thread sends a HEARTBEAT to each server's
heartbeat port, on sockets of its own (authenticated like the worker's
request sockets), and notes when each server last answered: a worker waiting
for a reply gives up once a server has been silent for ``heartbeat_timeout``
(:mod:`gradcomp.ps.worker`). A server answers the heartbeats of a process
whose rank a newer one took over with EVICTED and the reason, which the
worker raises at its next call (:mod:`gradcomp.ps.membership`).
"""

from __future__ import annotations

import threading
import time

import zmq

from gradcomp.meter import TrafficMeter
from gradcomp.ps import protocol as P
from gradcomp.ps import transport as T
from gradcomp.ps.errors import ProtocolError

__all__ = ["Heartbeat"]


class Heartbeat:
    """Background thread sending a heartbeat to every server's heartbeat port
    each ``interval`` seconds and noting the replies, and a server's word
    that this process lost its rank.

    Args:
        ctx: the worker's ``zmq.Context``.
        rank: the worker's global rank; ``session``: its session id.
        interval: seconds between heartbeats.
        meter: where the heartbeats' bytes are counted.
        security: socket options per server (:meth:`gradcomp.ps.auth.Credential.client_options`).
    """

    def __init__(self, ctx, rank: int, session: int, interval: float, meter: TrafficMeter, security: list[dict]):
        self._ctx, self._addresses, self._rank, self._session = ctx, [], rank, session
        self._interval, self._meter, self._security = interval, meter, security
        self._last: list[float] | None = None
        self._evicted: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"gradcomp-ps-heartbeat-{rank}")

    def start(self, addresses) -> None:
        self._addresses = list(addresses)
        self._last = [time.monotonic()] * len(self._addresses)
        self._thread.start()

    def silent_for(self, s: int) -> float:
        """Seconds since server ``s`` last answered (0 before the thread starts)."""
        return 0.0 if self._last is None else time.monotonic() - self._last[s]

    def evicted(self, s: int) -> tuple[int, str] | None:
        """``(EVICTED status, reason)`` when server ``s`` answered a heartbeat so, else None."""
        return self._evicted.get(s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        socks = [T.connect_dealer(self._ctx, a, security=sec, max_message=1024, hwm=4)
                 for a, sec in zip(self._addresses, self._security)]
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        index = {sock: i for i, sock in enumerate(socks)}
        n, seq, next_beat = P.message_nbytes(), 0, 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    seq += 1
                    beat = P.Header(P.HEARTBEAT, self._rank, seq=seq, session=self._session).pack()
                    for sock in socks:
                        try:
                            sock.send(beat, zmq.NOBLOCK)
                            self._meter.record_send(n, n, "heartbeat")
                        except zmq.Again:
                            pass  # the server is not reading: its silence is noticed below
                    next_beat = now + self._interval
                for sock, _ in poller.poll(int(1000 * min(max(next_beat - now, 0.0), 0.1)) + 1):
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_reply(index[sock], frames, n)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def _on_reply(self, s: int, frames: list[bytes], n: int) -> None:
        """A heartbeat reply, or EVICTED (with the reason) when this process lost its rank."""
        try:
            data = frames[1] if len(frames) == 2 else None
            h = P.Header.unpack(frames[0], (P.HEARTBEAT, P.EVICTED), None if data is None else len(data)) \
                if len(frames) <= 2 else None
        except ProtocolError:
            h = None
        if h is None or h.session != self._session:
            return
        if h.kind == P.EVICTED:
            self._evicted[s] = (h.status, data.decode(errors="replace") if data else "no reason given")
            self._meter.record_recv(P.message_nbytes(h.nbytes), P.message_nbytes(h.nbytes), "heartbeat")
            return
        self._last[s] = time.monotonic()
        self._meter.record_recv(n, n, "heartbeat")
