"""The server role: its construction, the message loop and its replies, its statistics.

One thread polls the request socket and handles each worker's message in
turn (:meth:`ParameterServer.serve`). The parts with a job of their own live
apart: the update rule (decode, average, optimizer step, pull encoding) in
:mod:`gradcomp.ps.apply`, the workers' records and failure detection (and
the heartbeat thread) in :mod:`gradcomp.ps.membership`, the checkpoint files
in :mod:`gradcomp.ps.checkpoint`.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections import Counter

import torch
import torch.distributed as dist
import zmq

from gradcomp import _validate as v
from gradcomp.compressors import Compressor
from gradcomp.meter import TrafficMeter
from gradcomp.ps import checkpoint as ckpt
from gradcomp.ps import protocol as P
from gradcomp.ps import transport as T
from gradcomp.ps.apply import Rejected, ShardUpdater, check_clip_norm, check_pull_compressor
from gradcomp.ps.auth import Credential, agree_credential
from gradcomp.ps.errors import ProtocolError, WorkerFailedError
from gradcomp.ps.gatekeeper import open_guarded_sockets
from gradcomp.ps.membership import HeartbeatResponder, Peer, admit, expired, peer_table
from gradcomp.ps.sharding import layout_checksum, named_tensors, param_specs, shard_parameters

__all__ = ["ParameterServer", "MODES", "FAILURE_POLICIES"]

log = logging.getLogger("gradcomp.ps")

MODES, FAILURE_POLICIES = P.MODES, P.FAILURE_POLICIES
#: most messages handled per poll before the deadlines are checked again
_BATCH = 64


class ParameterServer:
    """Server role of the parameter server (Li et al. 2014, OSDI, "Scaling
    Distributed Machine Learning with the Parameter Server").

    Ranks ``[0, num_servers)`` of the process group are servers, the others
    workers. Parameters are placed whole on servers, balanced by bytes
    (:func:`~gradcomp.ps.sharding.shard_parameters`); this server holds its
    shard as float32 ``nn.Parameter`` tensors on ``device`` and updates them
    with a real ``torch.optim`` optimizer: ``"sync"``, one averaged step per
    round of pushes from every live worker; ``"async"``, each push applied on
    arrival (Dean et al. 2012), ``max_staleness`` dropping older ones (Ho et
    al. 2013), ``staleness_lr`` scaling the learning rate by ``1 / (1 +
    staleness)`` (Zhang et al. 2016). With ``compress_pull`` a pull returns
    ``pull_compressor(params - mirror)``, the mirror being the server's copy
    of that worker's replica (the pull direction's error-feedback residual).

    One thread serves one ZeroMQ ROUTER socket (:mod:`gradcomp.ps.transport`)
    and never blocks on a worker. Every connection proves one worker rank of
    the job at the handshake (:attr:`credential`; PLAIN, or CURVE with
    ``encrypt=True``), the others are refused there and counted; a process
    displaces the live one holding its rank only as a newer incarnation
    (:mod:`gradcomp.ps.membership`). A worker is declared dead alone (no
    heartbeat, silent, not reading, or breaking the protocol); the run goes
    on without it (``on_worker_failure="continue"``) or :meth:`serve` raises
    :class:`~gradcomp.ps.WorkerFailedError` (``"fail"``). Malformed pushes
    are rejected and counted; checkpoints are written atomically. The whole
    story: ``docs/parameter-server.md``.

    Args:
        params: the initial parameters: an ``nn.Module`` (its
            ``named_parameters()``) or a mapping of names to floating tensors.
            Every rank must pass the same names and shapes in the same order.
        mode: ``"sync"`` or ``"async"``.
        num_servers: number of server ranks (>= 1, < world size).
        optimizer: factory ``f(params: list[nn.Parameter]) -> torch.optim.Optimizer``
            (e.g. ``functools.partial(torch.optim.Adam, lr=1e-3)``); default
            SGD with ``lr=0.01, momentum=0.9``.
        max_staleness: async: drop pushes with a larger staleness (versions,
            >= 0); None keeps all.
        staleness_lr: async: scale the learning rate by ``1 / (1 + staleness)``.
        clip_grad_norm: clip the gradient of this server's shard to this L2
            norm before each step (``torch.nn.utils.clip_grad_norm_``); None: off.
        compress_pull: answer pulls with compressed deltas (see above).
        pull_compressor: compressor of pull deltas (an ``ErrorFeedback`` is
            unwrapped: the server keeps its own residuals); default
            ``Int8Quantizer()`` when ``compress_pull``.
        on_worker_failure: ``"continue"`` or ``"fail"``.
        worker_timeout: seconds a worker may stay silent (> 0), counted from
            the server's last reply to it (or from :meth:`serve`'s start for
            its first request). It must exceed a worker's compute time per step.
        heartbeat_timeout: seconds without any message from a worker (its
            heartbeats come every second by default) before it is declared dead (> 0).
        address: where to bind: ``"host"``, ``"host:port"`` or
            ``"tcp://host:port"`` (port 0 or none: a free port); None: see
            :func:`~gradcomp.ps.transport.default_host`. The bound endpoint is
            :attr:`address`; workers learn it over ``group``.
        send_hwm: messages queued towards one worker before it counts as not
            reading (>= 1).
        checkpoint_dir: directory of the checkpoint files (None: no checkpoints).
        checkpoint_every: also checkpoint every this many versions (0: only at the end).
        resume: True: load ``checkpoint_dir``'s checkpoint of this server (none there:
            CheckpointError); ``"if-exists"``: load it when there is one; False: start afresh.
        group: the process group (default: the world); ranks are group ranks.
        meter: a :class:`~gradcomp.TrafficMeter` for phases ``"push"`` and
            ``"pull"`` and events ``"push_dropped"``, ``"push_stale"`` (default: a new one, :attr:`meter`).
        device: device of the shard and of the update arithmetic.
        credential: the job's credential (:func:`gradcomp.ps.new_credential`),
            the same on every server; None: server 0 creates one and it
            reaches every rank over ``group`` (:attr:`credential` gives it to
            a worker restarted outside the group).
        encrypt: CURVE instead of PLAIN: every message authenticated and
            encrypted (the same on every server).
        backup_workers: sync: apply a step with the first ``live - b`` pushes
            (Chen et al. 2016); later ones are dropped. In ``[0, workers)``; 0 in async.

    Construction is collective: every rank of ``group`` builds its role
    (a server or a :class:`~gradcomp.ps.Worker`) so the servers' addresses
    reach the workers.

    Raises:
        ValueError / TypeError: an invalid argument (the message names it);
            this rank is not a server rank; ``address`` cannot be bound; the
            servers were given different credentials or ``encrypt`` settings.
        CheckpointError: ``resume=True`` and no checkpoint, or one truncated,
            random or foreign bytes, or of another placement (nothing is
            loaded then).
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, params, *, mode: str = "sync", num_servers: int = 1, optimizer=None,
                 max_staleness: int | None = None, staleness_lr: bool = False,
                 clip_grad_norm: float | None = None, compress_pull: bool = False,
                 pull_compressor: Compressor | None = None, on_worker_failure: str = "continue",
                 worker_timeout: float = 60.0, heartbeat_timeout: float = 10.0,
                 address: str | None = None, send_hwm: int = 4, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, resume: bool = False, group=None,
                 meter: TrafficMeter | None = None, device: str | torch.device = "cpu",
                 credential: str | None = None, encrypt: bool = False, backup_workers: int = 0):
        self.mode = v.choice("mode", mode, MODES)
        self.on_worker_failure = v.choice("on_worker_failure", on_worker_failure, FAILURE_POLICIES)
        self.group = group
        self.rank, world, self.num_servers = P.join_layout(group, num_servers)
        if self.rank >= self.num_servers:
            raise ValueError(f"rank {self.rank} is a worker rank (servers are ranks 0..{self.num_servers - 1}); "
                             "build a gradcomp.ps.Worker there")
        self.global_rank = _global(group, self.rank)
        self.max_staleness = None if max_staleness is None else v.integer("max_staleness", max_staleness, 0)
        self.backup_workers = P.check_backup_workers(backup_workers, self.mode, world - self.num_servers)
        self.staleness_lr = v.flag("staleness_lr", staleness_lr)
        self.clip_grad_norm = check_clip_norm(clip_grad_norm)
        self.compress_pull = v.flag("compress_pull", compress_pull)
        self.pull_compressor = check_pull_compressor(pull_compressor, self.compress_pull)
        self.worker_timeout = v.timeout("worker_timeout", worker_timeout)
        self.heartbeat_timeout = v.timeout("heartbeat_timeout", heartbeat_timeout)
        self.send_hwm = v.integer("send_hwm", send_hwm, 1)
        bind_address = T.normalize_address(address)
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        self.checkpoint_every = v.integer("checkpoint_every", checkpoint_every, 0)
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(f"checkpoint_dir must be a path or None, got {type(checkpoint_dir).__name__}")
        if (self.checkpoint_every or ckpt.resume_mode(resume)) and checkpoint_dir is None:
            raise ValueError("checkpoint_every > 0 and resume=True need a checkpoint_dir")
        self.checkpoint_dir = None if checkpoint_dir is None else ckpt.usable_dir(os.fspath(checkpoint_dir))
        self.device = torch.device(device)
        self.meter = meter if meter is not None else TrafficMeter()
        own, encrypt = None if credential is None else Credential(credential), v.flag("encrypt", encrypt)

        tensors = named_tensors(params)
        self.shard = shard_parameters(param_specs(tensors), self.num_servers)[self.rank]
        self.layout = layout_checksum(self.shard)
        self._updater = ShardUpdater(self.shard, tensors, self.device, optimizer, self.clip_grad_norm,
                                     self.staleness_lr, self.compress_pull, self.pull_compressor)
        #: the shard: ``{name: float32 nn.Parameter}`` on ``device``, and the optimizer updating it
        self.params, self.optimizer = self._updater.params, self._updater.optimizer

        self._raw_bundle = self._updater.raw_bundle_nbytes
        self._max_message = 2 * self._raw_bundle + (1 << 16)
        self.version = 0
        self.resumed_from: int | None = None
        self.updates = 0
        self.clipped = 0
        self.checkpoints = 0
        self.staleness_histogram: Counter = Counter()
        #: ``(worker rank, start, end)`` of every request handled, on the
        #: timeline clock (:func:`time.perf_counter`), the last 2**17 kept
        self._busy: collections.deque = collections.deque(maxlen=1 << 17)
        self.dropped_staleness_histogram: Counter = Counter()
        self.rejected_reasons: Counter = Counter()
        self.peers, self._by_user = peer_table(_global(group, i) for i in range(self.num_servers, world))
        self._failure: tuple[int, str] | None = None
        self._served = False
        #: heartbeats received and answered (kept apart from :attr:`meter`, which counts the data exchange)
        self.heartbeat_meter = TrafficMeter()
        if resume:
            self._resume(missing_ok=resume == "if-exists")
        # a collective before binding: the sockets' keys derive from the job's credential
        self._credential = agree_credential(group, self.num_servers, own, encrypt)
        guarded = open_guarded_sockets(self._credential, self.rank, self.peers, bind_address,
                                       max_message=self._max_message, send_hwm=self.send_hwm,
                                       name=f"gradcomp-ps-gatekeeper-{self.global_rank}")
        self._ctx, self._gatekeeper, self._sock = guarded.ctx, guarded.gatekeeper, guarded.requests
        self.address, self.heartbeat_port = guarded.address, guarded.heartbeat_port
        # heartbeats on a socket and thread of their own: answered while a step computes
        self._heartbeats = HeartbeatResponder(self, guarded.heartbeats)
        T.exchange_addresses(group, self.address, self.num_servers)

    @property
    def credential(self) -> str:
        """The job's credential (a secret): what a worker restarted outside
        the process group is given (``Worker(credential=...)`` or ``$GRADCOMP_PS_CREDENTIAL``)."""
        return self._credential.text

    # ---- public ---------------------------------------------------------------------
    def serve(self) -> dict:
        """Serve workers until every one has sent DONE, died or been told to abort.

        Returns:
            :meth:`stats` at the end (a checkpoint is written first when
            ``checkpoint_dir`` is set).

        Raises:
            WorkerFailedError: a worker failed and ``on_worker_failure="fail"``.
            RuntimeError: called twice.
        """
        if self._served:
            raise RuntimeError("serve() runs once per ParameterServer")
        self._served = True
        start = time.monotonic()
        for p in self.peers.values():
            p.clock = p.heard = start
        self._heartbeats.start()
        try:
            while any(p.status == "active" for p in self.peers.values()):
                if self._sock.poll(50):
                    for _ in range(_BATCH):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        t0 = time.perf_counter()
                        rank = self._on_message(frames)
                        if rank is not None:
                            self._busy.append((rank, t0, time.perf_counter()))
                self._check_deadlines()
        finally:
            self._heartbeats.stop()
            self._sock.close(linger=2000)
            self._gatekeeper.stop()
            self._ctx.term()
            if self.checkpoint_dir is not None:
                self.save_checkpoint()
        if self._failure is not None:
            raise WorkerFailedError(*self._failure)
        return self.stats()

    def parameters(self) -> dict[str, torch.Tensor]:
        """This server's shard: ``{name: float32 tensor}`` on ``device`` (detached views)."""
        return {n: p.detach() for n, p in self.params.items()}

    def stats(self) -> dict:
        """Counters of this server (JSON-ready except for int dictionary keys):
        versions, pushes and their fates, rejections and refused connections
        by reason, per-worker counters and bytes, traffic, busy intervals.
        Every key is described in ``docs/parameter-server.md#statistics``."""
        workers = {}
        for r, p in self.peers.items():
            ph = p.meter.as_dict()["phases"]
            workers[r] = {
                "status": p.status, "reason": p.reason, "pushes": p.pushes, "accepted": p.accepted,
                "dropped": p.dropped, "rejected": p.rejected, "pulls": p.pulls,
                "sessions": p.sessions, "incarnation": p.incarnation, "taken_over": p.taken_over,
                "push_bytes": ph.get("push", {}).get("bytes_received", 0),
                "push_raw_bytes": ph.get("push", {}).get("raw_bytes_received", 0),
                "pull_bytes": ph.get("pull", {}).get("bytes_sent", 0),
                "pull_raw_bytes": ph.get("pull", {}).get("raw_bytes_sent", 0),
            }
        return {
            "rank": self.global_rank, "mode": self.mode, "version": self.version, "backup_workers": self.backup_workers,
            "updates": self.updates, "resumed_from": self.resumed_from,
            "pushes": sum(p.pushes for p in self.peers.values()),
            "accepted": sum(p.accepted for p in self.peers.values()),
            "dropped": sum(p.dropped for p in self.peers.values()),
            "rejected": sum(self.rejected_reasons.values()),
            "rejected_reasons": dict(self.rejected_reasons),
            "staleness_histogram": dict(sorted(self.staleness_histogram.items())),
            "dropped_staleness_histogram": dict(sorted(self.dropped_staleness_histogram.items())),
            "pulls": sum(p.pulls for p in self.peers.values()),
            "clipped": self.clipped, "checkpoints": self.checkpoints,
            "workers": workers,
            "dead_workers": {r: p.reason for r, p in self.peers.items() if p.status == "dead"},
            "done_workers": sorted(r for r, p in self.peers.items() if p.status == "done"),
            "traffic": self.meter.as_dict(),
            "heartbeat_traffic": self.heartbeat_meter.as_dict(),
            "malformed_heartbeats": self._heartbeats.malformed,
            "refused_connections": self._gatekeeper.refused_connections,
            "refused_reasons": dict(self._gatekeeper.refused),
            "security": self._credential.mechanism,
            "address": self.address,
            "busy_s": sum(t1 - t0 for _, t0, t1 in self._busy),
            "busy_intervals": list(self._busy),
        }

    def save_checkpoint(self) -> str:
        """Write parameters, optimizer state and version atomically; returns the path.

        Raises:
            ValueError: no ``checkpoint_dir`` was given.
        """
        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs the server's checkpoint_dir")
        path = ckpt.save_shard(self.checkpoint_dir, self.rank, self.num_servers, self.mode, self._updater,
                               self.version)
        self.checkpoints += 1
        return path

    # ---- messages ---------------------------------------------------------------------
    def _on_message(self, frames) -> int | None:
        """Handle one request; returns the sender's rank (None: not a worker's user)."""
        # the sender is the user its connection authenticated as, never a routing id it chose
        peer = self._by_user.get(frames[-1].get("User-Id"))
        if peer is None:  # the gatekeeper admits worker ranks only: not reached past the handshake
            self.rejected_reasons["unknown_peer"] += 1
            return None
        self._handle(peer, frames[0].bytes, frames)
        return peer.rank

    def _handle(self, peer: Peer, route: bytes, frames) -> None:
        data = frames[2] if len(frames) == 3 else None
        try:
            if len(frames) not in (2, 3):
                raise ProtocolError(f"message of {len(frames) - 1} frames, expected 1 or 2")
            h = P.Header.unpack(frames[1].buffer, P.REQUESTS, None if data is None else len(data))
            if h.sender != peer.rank:
                raise ProtocolError(f"header names sender {h.sender}, received from rank {peer.rank}")
            if h.kind == P.HEARTBEAT:
                raise ProtocolError("HEARTBEAT on the request connection (heartbeats have their own port)")
        except ProtocolError as e:
            return self._on_protocol_error(peer, route, str(e))
        now = time.monotonic()
        if h.kind == P.HELLO:
            return self._on_hello(peer, route, h, data, frames[1].get("Peer-Address"), now)
        if peer.session is None or h.session != peer.session:  # displaced, or never joined: told why
            self._count_reject(peer, "session")
            status, text = peer.refusal(h.session)
            return self._evict(peer, h, text, route=route, status=status)
        peer.route = route  # the session's own connection, or its DEALER reconnected (a new routing id)
        if peer.status == "dead":
            return self._evict(peer, h, peer.reason)
        if peer.status != "active":
            return
        if h.seq <= peer.last_seq:
            self._count_reject(peer, "duplicate")
            if h.kind == P.PUSH:
                peer.pushes += 1
                self._record_recv(peer, P.message_nbytes(h.nbytes), P.message_nbytes(self._raw_bundle), "push")
                self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.REJECTED), None, "push")
            return
        peer.last_seq, peer.heard = h.seq, now
        data = None if data is None else torch.frombuffer(data.buffer, dtype=torch.uint8)
        if self._failure is not None and h.kind != P.DONE:
            self._abort(peer, h, "push" if h.kind == P.PUSH else "pull")
        elif h.kind == P.PUSH:
            self._on_push(peer, h, data)
        elif h.kind == P.PULL:
            self._on_pull(peer, h)
        else:
            self._on_done(peer)

    def _on_hello(self, peer: Peer, route: bytes, h: P.Header, data, address: str | None, now: float) -> None:
        """A worker process asks for its rank (first time, restarted, or a second process)."""
        self._record_recv(peer, P.message_nbytes(h.nbytes), P.message_nbytes(h.nbytes), "connect")
        if h.layout != self.layout:
            self._count_reject(peer, "layout")
            return self._evict(peer, h, "its parameters' names and shapes differ from the server's", route=route)
        if h.session == peer.session:
            peer.route = route
            return  # a repeated HELLO of the current session
        if h.aux < 0 or h.nbytes > P.MAX_HELLO_NBYTES:
            return self._on_protocol_error(peer, route, f"HELLO with incarnation {h.aux} and {h.nbytes} data "
                                                        f"bytes (at most {P.MAX_HELLO_NBYTES})")
        origin = f"incarnation {h.aux}, {P.read_process_description(data, address)}"
        refusal = admit(peer, h.aux, origin, self._holder_connected(peer))
        if refusal is not None:  # a second live process of the rank
            self._count_reject(peer, "rank_in_use")
            log.warning("parameter server rank %d: refused %s as worker rank %d", self.global_rank, origin,
                        peer.rank)
            return self._evict(peer, h, refusal, route=route, status=P.RANK_IN_USE)
        # an accepted gradient of the current sync step stays in the sum
        peer.join(h, now, run_failed=self._failure is not None, route=route, origin=origin)
        if self._failure is not None:
            return self._abort(peer, h, "connect")
        self._reply(peer, self._header(P.WELCOME, h, aux=peer.accepted, status=self.heartbeat_port),
                    None, "connect")

    def _holder_connected(self, peer: Peer) -> bool:
        """Whether the request connection of the process holding ``peer``'s rank
        is open: a probe it ignores (a reply to request number 0) is sent to it."""
        if peer.route is None or peer.status != "active":
            return False
        probe = P.Header(P.HEARTBEAT, self.global_rank, self.version, session=peer.session or 0)
        try:
            self._sock.send_multipart([peer.route, probe.pack()], zmq.NOBLOCK)
        except zmq.Again:
            return True  # connected; its queue is full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: the connection closed (the process exited)
        self._record(self.meter, peer.meter, P.message_nbytes(), "connect")
        return True

    def _on_protocol_error(self, peer: Peer, route: bytes, reason: str) -> None:
        """A malformed message: counted; the sending connection is cut off (it
        does not speak the protocol), the rank with it only when it is the
        connection of the rank's current process."""
        self._count_reject(peer, "protocol")
        log.warning("parameter server rank %d: protocol error from worker rank %d: %s",
                    self.global_rank, peer.rank, reason)
        if route != peer.route:
            return self._evict(peer, P.Header(P.HELLO, peer.rank), f"protocol error: {reason}", route=route)
        if peer.status == "active":
            self._on_failure(peer, f"protocol error: {reason}")
        if peer.status == "dead":
            self._evict(peer, P.Header(P.HELLO, peer.rank, session=peer.session or 0), peer.reason)

    def _check_deadlines(self) -> None:
        for p, reason in expired(self.peers.values(), time.monotonic(), self.heartbeat_timeout,
                                 self.worker_timeout):
            self._on_failure(p, reason)

    def _on_push(self, peer: Peer, h: P.Header, data) -> None:
        peer.pushes += 1
        self._record_recv(peer, P.message_nbytes(h.nbytes), P.message_nbytes(self._raw_bundle), "push")
        if h.layout != self.layout:
            return self._reject(peer, h, "layout")
        if not 0 <= h.version <= self.version:
            return self._reject(peer, h, "version")
        staleness = self.version - h.version
        if self.mode == "sync" and staleness == 0 and peer.rank in self._updater.contributors:
            return self._reject(peer, h, "duplicate")
        too_stale = staleness > 0 if self.mode == "sync" else (
            self.max_staleness is not None and staleness > self.max_staleness)
        if too_stale:
            peer.dropped += 1
            self.dropped_staleness_histogram[staleness] += 1
            self.meter.record_event("push_dropped")
            return self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.DROPPED, aux=staleness),
                               None, "push")
        try:
            grads = self._updater.decode_push(data)
        except Rejected as e:
            return self._reject(peer, h, e.reason)
        peer.accepted += 1
        self.staleness_histogram[staleness] += 1
        if staleness > 0:  # applied on parameters that moved since the worker pulled them
            self.meter.record_event("push_stale")
        if self.mode == "async":
            self._apply(grads, staleness)
            self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.ACCEPTED, aux=staleness), None, "push")
        else:
            self._updater.add_to_round(peer.rank, grads)
            self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.ACCEPTED), None, "push")
            self._maybe_complete_step()

    def _apply(self, grads: dict[str, torch.Tensor], staleness: int) -> None:
        """One optimizer step with ``grads`` (consumed); the version advances."""
        self.clipped += int(self._updater.step(grads, staleness))
        self.version += 1
        self.updates += 1
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _maybe_complete_step(self) -> None:
        """Sync: apply the averaged step once every live worker (but ``backup_workers``) has pushed."""
        if self.mode != "sync":
            return
        if not self._updater.round_complete({r for r, p in self.peers.items() if p.status == "active"},
                                            self.backup_workers):
            return
        self._apply(self._updater.take_round_average(), 0)
        for p in self.peers.values():  # every deferred pull was waiting for this step
            if p.status == "active" and p.deferred is not None:
                self._answer_pull(p, p.deferred)

    def _on_pull(self, peer: Peer, h: P.Header) -> None:
        peer.pulls += 1
        self._record_recv(peer, P.message_nbytes(), P.message_nbytes(), "pull")
        if h.layout != self.layout:
            self._count_reject(peer, "layout")
            return self._reply(peer, self._header(P.PULL_REPLY, h, status=P.REJECTED), None, "pull")
        if self.mode == "sync" and h.aux > self.version and peer.rank in self._updater.contributors:
            peer.deferred = h  # answered when the step completes
            return
        self._answer_pull(peer, h)

    def _answer_pull(self, peer: Peer, h: P.Header) -> None:
        peer.deferred = None
        wires, status, peer.mirror = self._updater.encode_pull(peer.mirror, bool(h.status & P.WANT_FULL))
        blob = P.pack_bundle(wires)
        self._reply(peer, self._header(P.PULL_REPLY, h, nbytes=blob.numel(), status=status), blob, "pull",
                    raw_nbytes=P.message_nbytes(self._raw_bundle))

    def _on_done(self, peer: Peer) -> None:
        self._record_recv(peer, P.message_nbytes(), P.message_nbytes(), "pull")
        peer.status = "done"
        peer.mirror = None
        self._maybe_complete_step()

    def _on_failure(self, peer: Peer, reason: str) -> None:
        if peer.status != "active":
            return
        log.warning("parameter server rank %d: worker rank %d failed: %s", self.global_rank, peer.rank, reason)
        peer.declare_dead(reason)
        if self.on_worker_failure == "fail":
            if self._failure is None:
                self._failure = (peer.rank, reason)
                self._updater.discard_round()
                for p in self.peers.values():
                    if p.status == "active" and p.deferred is not None:
                        self._abort(p, p.deferred)
        else:
            self._maybe_complete_step()

    def _abort(self, peer: Peer, h: P.Header, phase: str = "pull") -> None:
        """Tell ``peer`` the run is aborted (answers its request ``h``)."""
        peer.deferred = None
        rank = self._failure[0]
        self._reply(peer, self._header(P.ABORT, h, aux=rank), None, phase)
        if peer.status == "active":
            peer.status, peer.reason = "aborted", f"told to abort after worker rank {rank} failed"

    def _evict(self, peer: Peer, h: P.Header, reason: str, route: bytes | None = None,
               status: int = P.DECLARED_DEAD) -> None:
        """Answer a request of a process the server does not serve (on connection
        ``route``; None: the rank's current one), with the reason."""
        text = reason.encode()
        self._reply(peer, self._header(P.EVICTED, h, nbytes=len(text), status=status), text, "pull",
                    declare=False, route=route)

    def _reject(self, peer: Peer, h: P.Header, reason: str) -> None:
        self._count_reject(peer, reason)
        log.warning("parameter server rank %d: rejected a push from worker rank %d (%s)",
                    self.global_rank, peer.rank, reason)
        self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.REJECTED), None, "push")

    def _count_reject(self, peer: Peer, reason: str) -> None:
        peer.rejected += 1
        self.rejected_reasons[reason] += 1

    def _header(self, kind: int, request: P.Header, **fields) -> P.Header:
        """A reply to ``request``: this server's version, the request's number and session."""
        return P.Header(kind, self.global_rank, self.version, seq=request.seq, session=request.session, **fields)

    def _reply(self, peer: Peer, h: P.Header, data, phase: str, raw_nbytes: int | None = None,
               declare: bool = True, route: bytes | None = None) -> None:
        """Queue a reply to ``peer`` on connection ``route`` (None: its current
        one) without blocking; a worker whose queue is full (it does not read)
        or whose connection is gone is declared dead (``declare``)."""
        frames = [peer.route if route is None else route, h.pack()]
        if data is not None:
            frames.append(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if declare:
                self._on_failure(peer, f"not reading its replies (its queue of send_hwm={self.send_hwm} "
                                       "messages is full)")
            return
        except zmq.ZMQError as e:  # EHOSTUNREACH: no connection with that routing id
            if declare:
                self._on_failure(peer, f"connection lost: {e}")
            return
        n = P.message_nbytes(h.nbytes)
        raw = n if raw_nbytes is None else raw_nbytes
        self._record(self.meter, peer.meter, n, phase, raw=raw)
        peer.clock = time.monotonic()

    def _record(self, meter: TrafficMeter, peer_meter: TrafficMeter | None, n: int, phase: str,
                raw: int | None = None, recv: bool = False) -> None:
        for m in (meter, peer_meter):
            if m is not None:
                (m.record_recv if recv else m.record_send)(n, n if raw is None else raw, phase)

    def _record_recv(self, peer: Peer, n: int, raw: int, phase: str) -> None:
        self._record(self.meter, peer.meter, n, phase, raw=raw, recv=True)

    def _resume(self, missing_ok: bool) -> None:
        """Load this server's checkpoint, validated whole before anything changes (or CheckpointError)."""
        version = ckpt.resume_shard(self.checkpoint_dir, self.rank, self.num_servers, self._updater, missing_ok)
        if version is not None:
            self.version = self.resumed_from = version


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)

