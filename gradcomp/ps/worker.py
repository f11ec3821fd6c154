"""The worker role: pushes compressed gradients and pulls parameters."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from gradcomp import timeline as _timeline
from gradcomp import _validate as v
from gradcomp.compressors import (Compressor, ErrorFeedback, NoCompression, decompress, decompress_add_,
                                  split)
from gradcomp.errors import PayloadError
from gradcomp.meter import TrafficMeter
from gradcomp.ps import protocol as P
from gradcomp.ps import transport as T
from gradcomp.ps.auth import (agree_credential, credential_from, describe_handshake_failure,
                              handshake_failures)
from gradcomp.ps.errors import PeerError, ProtocolError, PSAbortedError, RankConflictError
from gradcomp.ps.heartbeat import Heartbeat
from gradcomp.ps.sharding import layout_checksum, named_tensors, param_specs, shard_parameters
from gradcomp.wire import decode

__all__ = ["Worker", "PushResult"]


@dataclass(frozen=True)
class PushResult:
    """What the servers did with one push (one entry per server, in server order).

    Attributes:
        statuses: ``"accepted"``, ``"dropped"`` (too stale: pull before the
            next push) or ``"rejected"`` (malformed) per server.
        staleness: the push's staleness on each server (versions).
        versions: each server's version after handling the push.
    """

    statuses: tuple[str, ...]
    staleness: tuple[int, ...]
    versions: tuple[int, ...]

    @property
    def accepted(self) -> bool:
        """Every server accepted the gradient."""
        return all(s == "accepted" for s in self.statuses)

    @property
    def dropped(self) -> bool:
        """Some server dropped it as too stale."""
        return "dropped" in self.statuses

    @property
    def rejected(self) -> bool:
        """Some server rejected it as malformed."""
        return "rejected" in self.statuses


class Worker:
    """Worker role of the parameter server (Li et al. 2014).

    The worker holds a float32 replica of the parameters (the tensors it was
    given, updated in place), pushes gradients compressed by ``compressor``
    with error feedback keyed by parameter name (Seide et al. 2014;
    Karimireddy et al. 2019), and pulls parameters: full float32 values, or
    the compressed deltas a server sends with ``compress_pull`` (added to the
    replica in place). Gradients may live on any device (e.g. CUDA): they are
    compressed there and only the payload bytes move to the host; pulled
    payloads are decoded on the replica's device.

    Transport: a ZeroMQ DEALER socket per server for requests and, on a
    background thread, one per server for heartbeats every
    ``heartbeat_interval`` seconds (see :mod:`gradcomp.ps.transport`). On
    construction the worker says HELLO to every server (a restarted process
    of the same rank takes over from the dead one; :attr:`accepted_before`
    tells how many of that rank's pushes the servers had already accepted).
    Every connection authenticates as this rank with the job's credential
    (:mod:`gradcomp.ps.auth`). A process whose rank is held by a live one
    joins only as a newer ``incarnation``; the one it displaces raises
    :class:`~gradcomp.ps.RankConflictError` at its next call (see
    :mod:`gradcomp.ps.membership`).
    A reply is awaited at most ``timeout`` seconds, and no longer than
    ``heartbeat_timeout`` seconds once a server stops answering heartbeats;
    in sync mode a pull waits for the slowest worker's push, so ``timeout``
    must exceed the servers' ``worker_timeout``.

    Args:
        params: the model (an ``nn.Module``, its ``named_parameters()``) or a
            mapping of names to float32 tensors: the replica, updated in place
            by :meth:`pull`. Names, shapes and order must match the servers'.
        num_servers: number of server ranks (ranks ``[0, num_servers)``).
        compressor: push compressor (default :class:`~gradcomp.NoCompression`);
            an :class:`~gradcomp.ErrorFeedback` is used as given (with
            ``error_feedback=True``).
        error_feedback: wrap a lossy ``compressor`` in ``ErrorFeedback``.
        timeout: seconds to wait for each reply (> 0).
        heartbeat_interval: seconds between heartbeats (> 0); must be well
            under the servers' ``heartbeat_timeout``.
        heartbeat_timeout: seconds without a heartbeat reply after which a
            server counts as gone (> 0).
        group: the process group (default: the world); ranks are group ranks.
            Construction is then collective (see :class:`ParameterServer`).
        meter: :class:`~gradcomp.TrafficMeter` for phases ``"connect"``,
            ``"push"`` and ``"pull"`` (heartbeats go to :attr:`heartbeat_meter`).
        server_addresses: the servers' endpoints (``"tcp://host:port"``, in
            server order) for a worker outside the group's start-up, e.g. a
            restarted process; no collective then. Needs ``rank``.
        rank: this worker's global rank (with ``server_addresses``; default:
            its rank in the initialised group).
        credential: the job's credential (a server's ``.credential``), with
            ``server_addresses`` only; None: ``$GRADCOMP_PS_CREDENTIAL``. In
            the group the job's credential arrives over ``group``.
        incarnation: this process's incarnation of its rank (>= 0): a
            restart that must displace a process that still looks alive
            passes a higher one than it (e.g. the number of restarts).

    Raises:
        ValueError / TypeError: an invalid argument (the message names it), a
            non-float32 or non-contiguous parameter, or this rank is a server rank.
        RuntimeError: torch.distributed is not initialised and no
            ``server_addresses`` were given.
        PeerError: a server did not answer the HELLO within ``timeout``, or
            refused this process's credential at the handshake (named).
        RankConflictError: a live process of the same or a newer incarnation
            holds this rank.
    """

    def __init__(self, params, *, num_servers: int = 1, compressor: Compressor | ErrorFeedback | None = None,
                 error_feedback: bool = True, timeout: float = 120.0, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 10.0, group=None, meter: TrafficMeter | None = None,
                 server_addresses=None, rank: int | None = None, credential: str | None = None,
                 incarnation: int = 0):
        self.group = group
        self.incarnation = v.integer("incarnation", incarnation, 0, 1 << 62)
        if server_addresses is None:
            if rank is not None:
                raise ValueError("rank is given with server_addresses only (in a group the rank is the group's)")
            if credential is not None:
                raise ValueError("credential is given with server_addresses only (in a group the job's "
                                 "credential arrives over it)")
            self.rank, world, self.num_servers = P.join_layout(group, num_servers)
            self.global_rank = self.rank if group is None else dist.get_global_rank(group, self.rank)
        else:
            self.num_servers = v.integer("num_servers", num_servers, 1)
            if isinstance(server_addresses, str) or not all(isinstance(a, str) for a in server_addresses):
                raise TypeError("server_addresses must be a list of strings like 'tcp://10.0.0.1:5555'")
            server_addresses = [T.normalize_address(a, "server_addresses") for a in server_addresses]
            if len(server_addresses) != self.num_servers:
                raise ValueError(f"server_addresses must hold num_servers={self.num_servers} endpoints, "
                                 f"got {len(server_addresses)}")
            if rank is None:
                if not dist.is_initialized():
                    raise ValueError("rank must be given with server_addresses outside a process group")
                rank = dist.get_rank()
            self.rank = self.global_rank = v.integer("rank", rank, 0)
        if self.rank < self.num_servers:
            raise ValueError(f"rank {self.rank} is a server rank (servers are ranks 0..{self.num_servers - 1}); "
                             "build a gradcomp.ps.ParameterServer there")
        self.timeout = v.timeout("timeout", timeout)
        self.heartbeat_interval = v.timeout("heartbeat_interval", heartbeat_interval)
        self.heartbeat_timeout = v.timeout("heartbeat_timeout", heartbeat_timeout)
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        compressor = NoCompression() if compressor is None else compressor
        codec, self._ef = split(compressor, "compressor", " or None")
        if self._ef is not None and not error_feedback:
            raise ValueError(f"error_feedback=False contradicts compressor {compressor!r}, an error "
                             "feedback: pass its wrapped compressor, or error_feedback=True")
        if error_feedback and self._ef is None and codec.lossy:
            compressor = self._ef = ErrorFeedback(codec)
        self.compressor = compressor
        self.meter = meter if meter is not None else TrafficMeter()
        #: heartbeats sent and answered (kept apart from :attr:`meter`)
        self.heartbeat_meter = TrafficMeter()

        self._module = params if isinstance(params, torch.nn.Module) else None
        tensors = named_tensors(params)
        for name, t in tensors.items():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise TypeError(f"parameter {name!r} must be a contiguous float32 tensor (the replica of the "
                                f"servers' float32 parameters), got {t.dtype}"
                                f"{'' if t.is_contiguous() else ', non-contiguous'}")
        self.replica: dict[str, torch.Tensor] = {n: t.detach() for n, t in tensors.items()}
        self.shards = shard_parameters(param_specs(tensors), self.num_servers)
        self.servers = list(range(self.num_servers)) if group is None or server_addresses is not None \
            else [dist.get_global_rank(group, i) for i in range(self.num_servers)]
        self._layouts = [layout_checksum(sh) for sh in self.shards]
        self._raw_bundle = [P.raw_bundle_nbytes(s.shape for s in sh) for sh in self.shards]
        self.versions = [-1] * self.num_servers
        self._min_version = [0] * self.num_servers
        self._has_replica = False
        self._closed = False
        self._broken = False
        self.pushes = self.accepted = self.dropped = self.rejected = self.pulls = 0
        self.session = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        self._seq = 0

        if server_addresses is None:
            self._credential = agree_credential(group, self.num_servers, None, None)
            server_addresses = T.exchange_addresses(group, None, self.num_servers)
        else:
            self._credential = credential_from(credential)
        #: the servers' endpoints, in server order
        self.server_addresses = list(server_addresses)
        self._ctx = zmq.Context()
        self._socks, self._monitors = [], []
        for s, address in enumerate(self.server_addresses):
            security = self._credential.client_options(self.global_rank, s)
            sock = T.connect_dealer(self._ctx, address, security=security,
                                    max_message=2 * self._raw_bundle[s] + (1 << 16), hwm=4)
            sock.setsockopt(zmq.SNDTIMEO, int(1000 * min(self.timeout, 1e6)))
            self._socks.append(sock)
            # watched until the HELLO is answered, so that a refused handshake is named, not timed out
            self._monitors.append(sock.get_monitor_socket(handshake_failures()))
        self._heartbeat = Heartbeat(self._ctx, self.global_rank, self.session, self.heartbeat_interval,
                                     self.heartbeat_meter,
                                     [self._credential.client_options(self.global_rank, s)
                                      for s in range(self.num_servers)])
        self._finalizer = weakref.finalize(self, _close_transport, self._ctx, self._socks, self._heartbeat, 0,
                                           self._monitors)
        try:
            self.accepted_before, ports = self._hello()
        except BaseException:
            self._broken = True
            self._finalizer()
            raise
        self._stop_monitors()
        self._heartbeat.start([f"{a.rsplit(':', 1)[0]}:{port}" for a, port in zip(self.server_addresses, ports)])

    @property
    def credential(self) -> str:
        """The job's credential (a secret): what a worker restarted outside the group is given."""
        return self._credential.text

    # ---- public ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The oldest server version in the replica (-1 before the first pull)."""
        return min(self.versions)

    def pull(self) -> dict[str, torch.Tensor]:
        """Bring the replica up to the servers' parameters.

        In sync mode, after an accepted push this waits until the servers have
        applied that step (version + 1); otherwise it returns the current
        parameters.

        Returns:
            The replica, ``{name: float32 tensor}`` (the tensors given at
            construction, updated in place).

        Raises:
            PSAbortedError: a server aborted the run (another worker failed).
            PeerError: a server is unreachable or silent past ``timeout``.
            ProtocolError / PayloadError: a server answered malformed bytes.
        """
        self._check_open()
        t0 = time.perf_counter()
        try:
            return self._pull()
        except BaseException:
            self._broken = True
            raise
        finally:
            self.meter.record_time(time.perf_counter() - t0, "pull")

    def _pull(self) -> dict[str, torch.Tensor]:
        requests = []
        with _timeline.span("communicate"):
            for s in range(self.num_servers):
                h = self._request(P.PULL, s, self.versions[s],
                                  status=0 if self._has_replica else P.WANT_FULL, aux=self._min_version[s])
                self._send(h, None, s, "pull")
                requests.append(h)
        for s, src in enumerate(self.servers):
            with _timeline.span("communicate"):
                h, data = self._recv(s, requests[s], "pull")
            if h.kind != P.PULL_REPLY or h.status not in (P.FULL, P.DELTA) or data is None:
                raise ProtocolError(f"server rank {src} answered a pull with kind "
                                    f"{P.KIND_NAMES.get(h.kind)} status {h.status} "
                                    "(a placement mismatch is answered with REJECTED)")
            if h.status == P.DELTA and not self._has_replica:
                raise ProtocolError(f"server rank {src} sent a delta to a worker without a replica")
            wires = P.unpack_bundle(data, len(self.shards[s]))
            with torch.no_grad(), _timeline.span("decompress"):
                for spec, wire in zip(self.shards[s], wires):
                    dst_t = self.replica[spec.name]
                    p = decode(wire.to(dst_t.device))
                    if tuple(p.shape) != spec.shape:
                        raise PayloadError(f"server rank {src} sent shape {tuple(p.shape)} for "
                                           f"{spec.name!r}, expected {spec.shape}")
                    if h.status == P.FULL:  # by the payload's own codec (the server's choice)
                        dst_t.copy_(decompress(p).view(spec.shape))
                    else:
                        decompress_add_(p, dst_t)
            self.versions[s] = h.version
            self._min_version[s] = 0
        self._has_replica = True
        self.pulls += 1
        return self.replica

    def push(self, gradients: Mapping[str, torch.Tensor] | None = None) -> PushResult:
        """Push one gradient, stamped with the version it was computed from.

        Args:
            gradients: ``{name: gradient}`` shaped like the parameters (any
                floating dtype, any device); missing names count as zero.
                None: the ``.grad`` of the module given at construction.

        Returns:
            A :class:`PushResult`. A ``dropped`` push was too stale: the next
            :meth:`pull` returns fresh parameters.

        Raises:
            RuntimeError: no :meth:`pull` yet (a gradient needs a version).
            ValueError / TypeError: unknown names, wrong shapes or non-tensors.
            PSAbortedError / PeerError / ProtocolError: as for :meth:`pull`.
        """
        self._check_open()
        if not self._has_replica:
            raise RuntimeError("call pull() before the first push(): a gradient is stamped with the "
                               "version of the parameters it was computed from")
        grads = self._gradients(gradients)
        t0 = time.perf_counter()
        try:
            return self._push(grads)
        except BaseException:
            self._broken = True
            raise
        finally:
            self.meter.record_time(time.perf_counter() - t0, "push")

    def _push(self, grads: dict[str, torch.Tensor]) -> PushResult:
        stamped = list(self.versions)
        requests = []
        for s in range(self.num_servers):
            with _timeline.span("compress"):
                wires = [self._compress(grads[spec.name], spec.name).wire for spec in self.shards[s]]
                blob = P.pack_bundle(wires)
            with _timeline.span("communicate"):
                h = self._request(P.PUSH, s, stamped[s], nbytes=blob.numel())
                self._send(h, blob, s, "push", raw=P.message_nbytes(self._raw_bundle[s]))
            requests.append(h)
        statuses, staleness, versions = [], [], []
        for s, src in enumerate(self.servers):
            with _timeline.span("communicate"):
                h, _ = self._recv(s, requests[s], "push")
            if h.kind != P.PUSH_REPLY or h.status not in P.STATUS_NAMES:
                raise ProtocolError(f"server rank {src} answered a push with kind "
                                    f"{P.KIND_NAMES.get(h.kind)} status {h.status}")
            status = P.STATUS_NAMES[h.status]
            statuses.append(status)
            staleness.append(h.aux if h.status != P.REJECTED else -1)
            versions.append(h.version)
            self._min_version[s] = stamped[s] + 1 if status == "accepted" else 0
        self.pushes += 1
        result = PushResult(tuple(statuses), tuple(staleness), tuple(versions))
        self.accepted += result.accepted
        self.dropped += result.dropped
        self.rejected += result.rejected
        return result

    def done(self) -> None:
        """Tell every server this worker has finished, then close the sockets
        (idempotent; waits at most 2 s for DONE to leave). Nothing is sent
        after a failed exchange (the servers detect this worker's silence)."""
        if self._closed:
            return
        self._closed = True
        if not self._broken:
            for s in range(self.num_servers):
                try:
                    self._send(self._request(P.DONE, s, self.versions[s]), None, s, "pull")
                except PeerError:
                    pass
        self._finalizer.detach()
        _close_transport(self._ctx, self._socks, self._heartbeat, 0 if self._broken else 2000, self._monitors)

    close = done

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.done()

    def stats(self) -> dict:
        """Counters: ``pushes``, ``accepted``, ``dropped``, ``rejected``, ``pulls``,
        ``version``, ``versions``, ``accepted_before``, ``traffic``
        (:meth:`TrafficMeter.as_dict`, phases ``"connect"``, ``"push"`` and
        ``"pull"``) and ``heartbeat_traffic``."""
        return {"rank": self.global_rank, "pushes": self.pushes, "accepted": self.accepted,
                "dropped": self.dropped, "rejected": self.rejected, "pulls": self.pulls,
                "version": self.version, "versions": list(self.versions),
                "accepted_before": list(self.accepted_before),
                "traffic": self.meter.as_dict(), "heartbeat_traffic": self.heartbeat_meter.as_dict()}

    # ---- internals ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Worker has sent DONE; build a new one to rejoin")
        if self._broken:
            raise RuntimeError("an earlier exchange of this Worker failed; its servers no longer expect it")
        for s in range(self.num_servers):  # a server told the heartbeat thread this process lost its rank
            self._raise_if_evicted(s)

    def _raise_if_evicted(self, s: int) -> None:
        note = self._heartbeat.evicted(s)
        if note is not None:
            self._broken = True
            _raise_evicted(self.servers[s], *note)

    def _stop_monitors(self) -> None:
        for sock, monitor in zip(self._socks, self._monitors):
            sock.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()

    def _gradients(self, gradients) -> dict[str, torch.Tensor]:
        if gradients is None:
            if self._module is None:
                raise ValueError("gradients must be given when the Worker was built from a mapping "
                                 "(None reads .grad of an nn.Module)")
            gradients = {n: p.grad for n, p in self._module.named_parameters() if p.grad is not None}
        if not isinstance(gradients, Mapping):
            raise TypeError(f"gradients must be a mapping of names to tensors or None, "
                            f"got {type(gradients).__name__}")
        unknown = sorted(set(gradients) - set(self.replica))
        if unknown:
            raise ValueError(f"gradients holds unknown parameter names {unknown[:5]}")
        out = {}
        for name, ref in self.replica.items():
            g = gradients.get(name)
            if g is None:
                out[name] = torch.zeros_like(ref)
                continue
            v.tensor(f"gradients[{name!r}]", g)
            if g.shape != ref.shape:
                raise ValueError(f"gradients[{name!r}] must have shape {tuple(ref.shape)}, got {tuple(g.shape)}")
            out[name] = g.detach()
        return out

    def _compress(self, g: torch.Tensor, name: str):
        if self._ef is not None:
            return self._ef.compress(g, key=name)
        return self.compressor.compress(g)

    def _request(self, kind: int, s: int, version: int, **fields) -> P.Header:
        self._seq += 1
        return P.Header(kind, self.global_rank, version, layout=self._layouts[s], seq=self._seq,
                        session=self.session, **fields)

    def _hello(self) -> tuple[tuple[int, ...], list[int]]:
        """HELLO to every server (this process's incarnation, host and pid);
        returns each one's count of this rank's accepted pushes and its heartbeat port."""
        requests, about = [], P.process_description()
        for s in range(self.num_servers):
            requests.append(self._request(P.HELLO, s, 0, aux=self.incarnation, nbytes=len(about)))
            self._send(requests[-1], about, s, "connect")
        out, ports = [], []
        for s, src in enumerate(self.servers):
            h, _ = self._recv(s, requests[s], "connect")
            if h.kind != P.WELCOME or h.aux < 0 or not 0 < h.status < 65536:
                raise ProtocolError(f"server rank {src} answered HELLO with {P.KIND_NAMES.get(h.kind)}")
            out.append(h.aux)
            ports.append(h.status)
        return tuple(out), ports

    def _send(self, h: P.Header, data, s: int, phase: str, raw: int | None = None) -> None:
        if isinstance(data, torch.Tensor):
            data = memoryview(data.numpy())
        frames = [h.pack()] if data is None else [h.pack(), data]
        try:
            self._socks[s].send_multipart(frames, copy=False)
        except zmq.Again:
            raise PeerError(self.servers[s], "send to server",
                            f"its queue stayed full for timeout={self.timeout:g} s") from None
        n = P.message_nbytes(h.nbytes)
        self.meter.record_send(n, n if raw is None else raw, phase)

    def _recv(self, s: int, request: P.Header, phase: str):
        """The reply to ``request`` from server ``s`` (a late reply to an earlier
        request is skipped); waits at most ``timeout``, or ``heartbeat_timeout``
        after the server's heartbeats stopped."""
        sock, src = self._socks[s], self.servers[s]
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerError(src, "receive from server", f"no reply within timeout={self.timeout:g} s")
            if not sock.poll(int(1000 * min(remaining, 0.1)) + 1):
                self._raise_if_evicted(s)
                self._raise_if_refused(s)
                silent = self._heartbeat.silent_for(s)
                if silent > self.heartbeat_timeout:
                    raise PeerError(src, "receive from server",
                                    f"no heartbeat reply for {silent:.1f} s > heartbeat_timeout="
                                    f"{self.heartbeat_timeout:g} s (server process or link down)")
                continue
            frames = sock.recv_multipart(copy=False)
            if len(frames) > 2:
                raise ProtocolError(f"server rank {src} sent a message of {len(frames)} frames")
            data = frames[1] if len(frames) == 2 else None
            h = P.Header.unpack(frames[0].buffer, P.REPLIES, None if data is None else len(data))
            if h.seq != request.seq or h.session != self.session:
                continue  # the reply to a request given up on earlier
            n = P.message_nbytes(h.nbytes)
            # a pull's data is the shard: uncompressed, it is the float32 bundle
            raw = P.message_nbytes(self._raw_bundle[s]) if h.kind == P.PULL_REPLY and data is not None else n
            self.meter.record_recv(n, raw, phase)
            if h.kind == P.ABORT:
                raise PSAbortedError(src, h.aux)
            if h.kind == P.EVICTED:
                reason = bytes(data.buffer).decode(errors="replace") if data is not None else "no reason given"
                _raise_evicted(src, h.status, reason)
            return h, None if data is None else torch.frombuffer(data.buffer, dtype=torch.uint8)

    def _raise_if_refused(self, s: int) -> None:
        """Raise PeerError naming the cause when server ``s`` refused the handshake."""
        if not self._monitors:
            return
        from zmq.utils.monitor import recv_monitor_message  # only while the HELLO waits

        monitor = self._monitors[s]
        while monitor.poll(0):
            why = describe_handshake_failure(recv_monitor_message(monitor), self._credential)
            if why is not None:
                raise PeerError(self.servers[s], "connect to server", why)


def _raise_evicted(server: int, status: int, reason: str) -> None:
    """The error of an EVICTED reply: RankConflictError when another process
    holds the rank, else PeerError (declared dead, or never joined)."""
    if status in (P.TAKEN_OVER, P.RANK_IN_USE):
        raise RankConflictError(server, "request to server", reason)
    if status == P.UNKNOWN_SESSION:
        raise PeerError(server, "request to server", reason)
    raise PeerError(server, "request to server", f"this worker was declared dead: {reason}")


def _close_transport(ctx, socks, heartbeat: Heartbeat, linger_ms: int, monitors=()) -> None:
    heartbeat.stop()
    for sock in (*monitors, *socks):
        sock.close(linger=linger_ms)
    ctx.term()
