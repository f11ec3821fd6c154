"""Hand-driven parameter-server peers for the tests: raw ZeroMQ connections
that send whatever frames a test wants (hostile or malformed), and a helper
that pushes raw bundle bytes through a real Worker's session."""

from __future__ import annotations

import os
import time

import torch
import zmq

from gradcomp.ps import protocol as P
from gradcomp.ps import transport as T
from gradcomp.ps.auth import Credential, agree_credential, handshake_failures


def server_addresses(num_servers: int = 1) -> tuple[list[str], str]:
    """Take part in the exchanges a group's roles do at construction (for a
    rank that builds no Worker): ``(the servers' addresses, the job's credential)``."""
    credential = agree_credential(None, num_servers, None, None)
    return T.exchange_addresses(None, None, num_servers), credential.text


class RawPeer:
    """A DEALER towards one server, authenticated as worker ``rank`` with
    ``credential`` (None: none, the NULL mechanism), with routing id ``ident``
    (None: the server's choice)."""

    def __init__(self, address: str, rank: int, layout: int, *, credential: str | None,
                 ident: bytes | None = None, rcvhwm: int = 1000, rcvbuf: int = -1, server_index: int = 0):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        if credential is not None:
            for option, value in Credential(credential).client_options(rank, server_index).items():
                self.sock.setsockopt(option, value)
        if ident is not None:
            self.sock.setsockopt(zmq.IDENTITY, ident)
        self.monitor = self.sock.get_monitor_socket(handshake_failures() | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf > 0:
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(address)
        self.rank, self.layout = rank, layout
        self.session = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        self.seq = 0

    def header(self, kind: int, version: int = 0, nbytes: int = 0, **fields) -> P.Header:
        self.seq += 1
        fields.setdefault("layout", self.layout)
        return P.Header(kind, self.rank, version, nbytes=nbytes, seq=self.seq, session=self.session, **fields)

    def send(self, *frames, more: bool = False) -> None:
        self.sock.send_multipart([bytes(f) if isinstance(f, (bytearray, memoryview)) else f for f in frames],
                                 zmq.SNDMORE if more else 0)

    def request(self, kind: int, data: bytes | None = None, version: int = 0, **fields) -> P.Header:
        h = self.header(kind, version, 0 if data is None else len(data), **fields)
        self.send(h.pack(), *(() if data is None else (data,)))
        return h

    def recv(self, timeout: float = 20.0):
        """``(header, data bytes or None)`` of the next reply; None after ``timeout`` s."""
        if not self.sock.poll(int(1000 * timeout)):
            return None
        frames = self.sock.recv_multipart()
        data = frames[1] if len(frames) > 1 else None
        return P.Header.unpack(frames[0], P.REPLIES, None if data is None else len(data)), data

    def hello(self, incarnation: int = 0) -> P.Header:
        self.request(P.HELLO, aux=incarnation)
        h, _ = self.recv()
        assert h.kind == P.WELCOME, P.KIND_NAMES[h.kind]
        return h

    def handshake(self, timeout: float = 20.0) -> str:
        """``"succeeded"`` or the failure event's name, once the handshake is decided
        (AssertionError after ``timeout`` s)."""
        from zmq.utils.monitor import recv_monitor_message

        if not self.monitor.poll(int(1000 * timeout)):
            raise AssertionError(f"no handshake within {timeout} s")
        event = recv_monitor_message(self.monitor)["event"]
        return "succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else zmq.Event(event).name

    def close(self) -> None:
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def raw_push(worker, blob: torch.Tensor, version: int, s: int = 0) -> str:
    """Push ``blob`` (any bytes) as a bundle through ``worker``'s session; the server's status."""
    h = worker._request(P.PUSH, s, version, nbytes=blob.numel())
    worker._send(h, blob, s, "push")
    reply, _ = worker._recv(s, h, "push")
    return P.STATUS_NAMES[reply.status]


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 20 ms; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """The process ``pid`` has exited (or is a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def restarted_worker_main(address: str, rank: int, numel: int, pad: int, pushes: int, out_path: str) -> None:
    """A worker process started again with the rank of one that was killed:
    outside the process group, with the server's address given and the job's
    credential in ``$GRADCOMP_PS_CREDENTIAL``."""
    import json

    from gradcomp import ps

    params = {"x": torch.zeros(numel), "pad": torch.zeros(pad)}
    g = {"x": torch.zeros(numel)}
    g["x"][rank] = 1.0
    worker = ps.Worker(params, rank=rank, num_servers=1, server_addresses=[address], timeout=30.0)
    before = worker.accepted_before[0]
    with worker:
        worker.pull()
        accepted = sum(worker.push(g).accepted for _ in range(pushes))
        worker.pull()
    with open(out_path, "w") as f:
        json.dump({"accepted_before": before, "accepted": accepted}, f)


class Tap:
    """A TCP relay on loopback that records every byte between the peers it
    joins (an on-path observer): connect to :attr:`address` instead of ``target``."""

    def __init__(self, target: str):
        import socket
        import threading

        host, _, port = target[len("tcp://"):].rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            server = socket.create_connection(self._target, timeout=5.0)
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst) -> None:
        import socket

        src.settimeout(0.1)
        try:
            while not self._stop.is_set():
                try:
                    chunk = src.recv(1 << 16)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                with self._lock:
                    self.captured += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self._listener.close()
