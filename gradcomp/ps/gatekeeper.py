"""The server's gatekeeper: it admits or refuses every connection at the ZeroMQ handshake.

libzmq asks the ZAP handler of a socket's context (RFC 27, at
``inproc://zeromq.zap.01``) whether a connection's PLAIN or CURVE credentials
may in, once per connection and before any of its messages reaches the
socket; a refused connection is closed there. :class:`Gatekeeper` is that
handler for a server's request and heartbeat sockets: it admits exactly the
worker ranks of the job (:class:`gradcomp.ps.auth.Verifier`), names each
admitted connection's user (``w<rank>``, read by the server from every
message's ``User-Id`` property) and counts what it refused, with the
handshake failures the sockets' monitors report (a peer without credentials,
of another mechanism, or not speaking ZMTP at all).
:func:`open_guarded_sockets` opens a server's sockets behind it. See
``docs/parameter-server.md#who-may-connect``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from gradcomp.ps import transport as T
from gradcomp.ps.auth import Credential, Verifier, handshake_failures

__all__ = ["Gatekeeper", "GuardedSockets", "open_guarded_sockets", "ZAP_ENDPOINT"]

log = logging.getLogger("gradcomp.ps")

#: where libzmq sends the ZAP requests of a context's sockets (RFC 27)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"
_FAILURES = handshake_failures()


class Gatekeeper:
    """A thread answering the ZAP requests of ``ctx``'s sockets and counting refusals.

    Build it before the sockets it guards bind (a secured socket with no ZAP
    handler would admit anyone), :meth:`watch` each of them, then :meth:`start`.

    Args:
        ctx: the server's ``zmq.Context``.
        verifier: decides each request (:meth:`gradcomp.ps.auth.Credential.verifier`).
        name: the thread's name.
    """

    def __init__(self, ctx: zmq.Context, verifier: Verifier, name: str):
        self._verifier = verifier
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._monitors: list[zmq.Socket] = []
        #: refused handshakes by reason (ZAP's verdict, or the monitors' failure class)
        self.refused: Counter = Counter()
        #: connections refused at the handshake (every failure the monitors report)
        self.refused_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def watch(self, sock: zmq.Socket) -> None:
        """Count the handshake failures of ``sock`` (before :meth:`start`)."""
        self._monitors.append(sock.get_monitor_socket(_FAILURES))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread and close its sockets (waits at most 5 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        elif not self._thread.ident:  # never started
            self._close()

    def _close(self) -> None:
        for sock in (self._zap, *self._monitors):
            sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._zap, *self._monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    else:
                        self._count(recv_monitor_message(sock))
        finally:
            self._close()

    def _answer(self, msg: list[bytes]) -> None:
        """One ZAP request -> one reply (RFC 27): 200 with the user id, or 400 with the reason."""
        if len(msg) < 6 or msg[0] != _ZAP_VERSION:
            rid = msg[1] if len(msg) > 1 else b""
            self._zap.send_multipart([_ZAP_VERSION, rid, b"400", b"malformed ZAP request", b"", b""])
            return
        _, request_id, _, address, _, mechanism = msg[:6]
        user, reason = self._verifier.check(mechanism, msg[6:])
        if user is not None:
            self._zap.send_multipart([_ZAP_VERSION, request_id, b"200", b"OK", user, b""])
            return
        self.refused[reason] += 1
        (log.warning if self.refused[reason] == 1 else log.debug)(
            "parameter server: refused a connection from %s at the handshake (%s)",
            address.decode("ascii", "replace"), reason)
        self._zap.send_multipart([_ZAP_VERSION, request_id, b"400", reason.encode(), b"", b""])

    def _count(self, event: dict) -> None:
        kind = event["event"]
        if not kind & _FAILURES:
            return  # MONITOR_STOPPED when the watched socket closes
        self.refused_connections += 1
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self.refused["no credential or another mechanism"] += 1
            else:
                self.refused["not the ZMTP protocol"] += 1
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.refused["handshake not completed"] += 1


@dataclass
class GuardedSockets:
    """A server's context, its gatekeeper (started), its bound request ROUTER
    (``address``: the endpoint workers connect to) and heartbeat ROUTER."""

    ctx: zmq.Context
    gatekeeper: Gatekeeper
    requests: zmq.Socket
    address: str
    heartbeats: zmq.Socket
    heartbeat_port: int


def open_guarded_sockets(credential: Credential, server_index: int, ranks, bind_address: str, *,
                         max_message: int, send_hwm: int, name: str) -> GuardedSockets:
    """The gatekeeper admitting worker ``ranks``, then the request ROUTER bound
    to ``bind_address`` and the heartbeat ROUTER (same host, any port) it guards.

    Raises:
        ValueError: the address cannot be bound (nothing is left open).
    """
    ctx = zmq.Context()
    security = credential.server_options(server_index)
    # the ZAP handler exists before any secured socket binds: without one, libzmq would admit anyone
    gatekeeper = Gatekeeper(ctx, credential.verifier(ranks), name=name)
    opened = []
    try:
        requests, address = T.bind_router(ctx, bind_address, security=security, max_message=max_message,
                                          send_hwm=send_hwm, recv_hwm=max(16, 4 * send_hwm))
        opened.append(requests)
        host = bind_address.rsplit(":", 1)[0]
        heartbeats, hb_endpoint = T.bind_router(ctx, f"{host}:0", security=security, max_message=1024,
                                                send_hwm=4, recv_hwm=16)
        opened.append(heartbeats)
        for sock in opened:
            gatekeeper.watch(sock)
    except BaseException:
        for sock in opened:
            sock.close(0)
        gatekeeper.stop()
        ctx.term()
        raise
    gatekeeper.start()
    return GuardedSockets(ctx, gatekeeper, requests, address, heartbeats, int(hb_endpoint.rsplit(":", 1)[1]))
