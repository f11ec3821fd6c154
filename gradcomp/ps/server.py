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
from gradcomp.ps.errors import ProtocolError, WorkerFailedError
from gradcomp.ps.membership import HeartbeatResponder, Peer, expired, peer_table
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
    with a real ``torch.optim`` optimizer.

    Modes:
        ``"sync"``: for step ``t`` the server waits for one gradient from every
            live worker (stamped with version ``t``), averages them, applies one
            optimizer step and answers the pulls waiting for version ``t + 1``:
            data-parallel SGD with a central optimizer.
        ``"async"``: each gradient is applied on arrival (asynchronous SGD
            as in Downpour SGD, Dean et al. 2012). Staleness = server version -
            the version stamped on the push. With ``max_staleness`` a push older
            than that is dropped and counted (bounded staleness, after the
            stale synchronous parallel model of Ho et al. 2013, NeurIPS); with
            ``staleness_lr`` the learning rate of that step is
            ``lr / (1 + staleness)`` (Zhang et al. 2016, IJCAI,
            "Staleness-aware Async-SGD").

    Pulls return full float32 parameters. With ``compress_pull`` a worker that
    already holds a replica gets ``pull_compressor(params - mirror)`` instead,
    where ``mirror`` is the server's copy of that worker's replica, advanced by
    exactly the decompressed delta. ``params - mirror`` is the error-feedback
    residual of the pull direction (one per worker), so every compression
    error is resent with the next pull and the replica never drifts: after
    any pull it differs from the server's parameters by that pull's
    compression error only. The mirrors cost one float32 copy of the shard
    per worker.

    Transport: one ZeroMQ ROUTER socket (see :mod:`gradcomp.ps.transport`),
    served by one thread that polls it: every message arrives whole, framed
    by the library; each worker has its own queues, bounded by ``send_hwm``
    messages towards it, and a reply is sent without blocking, so no worker
    can stall the server or another worker.

    Failures: a worker is declared dead, alone, when its process or link is
    gone (no heartbeat for ``heartbeat_timeout`` seconds), when it makes no
    request for ``worker_timeout`` seconds after the last reply (alive but
    silent; a worker waiting for a reply the server holds back is not on
    that clock), when it does not read its replies (its queue of
    ``send_hwm`` messages is full) or when it breaks the protocol (a
    malformed header or frames: counted as a ``"protocol"`` rejection). The
    run then continues without it (``on_worker_failure="continue"``), and a
    request it sends later is answered ``EVICTED`` (the worker raises
    :class:`~gradcomp.ps.PeerError` with the reason); or every live worker
    is told to abort and :meth:`serve` raises
    :class:`~gradcomp.ps.WorkerFailedError` naming the rank (``"fail"``). A
    worker process that restarts with the same rank (a new session, its
    first message a HELLO) takes its place again, learning how many of its
    pushes were accepted before. A push whose bundle is malformed
    (:class:`gradcomp.PayloadError`), whose shapes, placement or version do
    not match, which repeats a request number, or which decodes to
    non-finite values is rejected, counted and answered with ``REJECTED``;
    the server keeps serving.

    Checkpoints (parameters, optimizer state, version) are written atomically
    every ``checkpoint_every`` versions and when :meth:`serve` returns; a
    server built with ``resume=True`` continues from its checkpoint.

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
        resume: load ``checkpoint_dir``'s checkpoint of this server if it exists.
        group: the process group (default: the world); ranks are group ranks.
        meter: a :class:`~gradcomp.TrafficMeter` for phases ``"push"`` and
            ``"pull"`` (default: a new one, :attr:`meter`).
        device: device of the shard and of the update arithmetic.
        backup_workers: sync: apply a step with the first ``live - b`` pushes
            (Chen et al. 2016); later ones are dropped. In ``[0, workers)``; 0 in async.

    Construction is collective: every rank of ``group`` builds its role
    (a server or a :class:`~gradcomp.ps.Worker`) so the servers' addresses
    reach the workers.

    Raises:
        ValueError / TypeError: an invalid argument (the message names it);
            this rank is not a server rank; ``address`` cannot be bound.
        CheckpointError: ``resume=True`` and the checkpoint is truncated,
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
                 backup_workers: int = 0):
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
        if (self.checkpoint_every or resume) and checkpoint_dir is None:
            raise ValueError("checkpoint_every > 0 and resume=True need a checkpoint_dir")
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.device = torch.device(device)
        self.meter = meter if meter is not None else TrafficMeter()

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
        self.peers, self._by_ident = peer_table(_global(group, i) for i in range(self.num_servers, world))
        self._failure: tuple[int, str] | None = None
        self._served = False
        #: heartbeats received and answered (kept apart from :attr:`meter`, which counts the data exchange)
        self.heartbeat_meter = TrafficMeter()
        if resume:
            self._resume()
        self._ctx = zmq.Context()
        try:
            self._sock, self.address = T.bind_router(
                self._ctx, bind_address, max_message=self._max_message, send_hwm=self.send_hwm,
                recv_hwm=max(16, 4 * self.send_hwm))
            # heartbeats on a socket and thread of their own: answered while a step computes
            host = bind_address.rsplit(":", 1)[0]
            hb_sock, hb_endpoint = T.bind_router(self._ctx, f"{host}:0", max_message=1024, send_hwm=4,
                                                 recv_hwm=16)
        except BaseException:
            if hasattr(self, "_sock"):
                self._sock.close(0)
            self._ctx.term()
            raise
        self._heartbeats = HeartbeatResponder(self, hb_sock)
        self.heartbeat_port = int(hb_endpoint.rsplit(":", 1)[1])
        T.exchange_addresses(group, self.address, self.num_servers)

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
        """Counters of this server (JSON-ready except for int dictionary keys).

        Keys: ``rank``, ``mode``, ``version``, ``updates`` (applied this run),
        ``backup_workers``, ``resumed_from``, ``pushes``, ``accepted``, ``dropped`` (too stale, or late),
        ``rejected`` (malformed messages, all peers), ``rejected_reasons``
        (reason -> count: ``payload``, ``shape``, ``nonfinite``, ``layout``,
        ``version``, ``duplicate``, ``protocol``, ``session`` (from an earlier
        process of the rank), ``unknown_peer``),
        ``staleness_histogram`` (staleness -> accepted pushes),
        ``dropped_staleness_histogram``, ``pulls``, ``clipped`` (steps whose
        gradient norm was clipped), ``checkpoints`` (written), ``workers``
        (rank -> per-worker counters, status, reason, ``sessions`` (1 +
        restarts) and push/pull bytes with their uncompressed float32
        equivalents), ``dead_workers`` (rank -> reason), ``done_workers``,
        ``traffic`` (:meth:`TrafficMeter.as_dict` of :attr:`meter`: phases
        ``"connect"``, ``"push"``, ``"pull"``), ``heartbeat_traffic`` (the
        heartbeats, counted apart), ``address`` (the bound endpoint),
        ``busy_s`` (seconds spent handling requests) and ``busy_intervals``
        (``(worker rank, start, end)`` per request handled, on the
        :mod:`gradcomp.timeline` clock: with the workers' timelines they tell
        how long each request queued behind other workers').
        """
        workers = {}
        for r, p in self.peers.items():
            ph = p.meter.as_dict()["phases"]
            workers[r] = {
                "status": p.status, "reason": p.reason, "pushes": p.pushes, "accepted": p.accepted,
                "dropped": p.dropped, "rejected": p.rejected, "pulls": p.pulls,
                "sessions": p.sessions,
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
        """Handle one request; returns the sender's rank (None: unknown peer)."""
        ident = frames[0].bytes
        entry = self._by_ident.get(ident)
        if entry is None:
            self.rejected_reasons["unknown_peer"] += 1
            return None
        self._handle(entry, frames)
        return entry.rank

    def _handle(self, peer: Peer, frames) -> None:
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
            return self._on_protocol_error(peer, str(e))
        now = time.monotonic()
        if h.kind == P.HELLO:
            return self._on_hello(peer, h, now)
        if h.session != peer.session:
            self._count_reject(peer, "session")  # a message of an earlier process of this rank
            return
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

    def _on_hello(self, peer: Peer, h: P.Header, now: float) -> None:
        """A worker process connects (first time, or restarted with a new session)."""
        self._record_recv(peer, P.message_nbytes(), P.message_nbytes(), "connect")
        if h.layout != self.layout:
            self._count_reject(peer, "layout")
            return self._evict(peer, h, "its parameters' names and shapes differ from the server's")
        if h.session == peer.session:
            return  # a repeated HELLO of the current session
        if peer.session is not None and peer.status == "active":
            log.warning("parameter server rank %d: worker rank %d restarted", self.global_rank, peer.rank)
        # an accepted gradient of the current sync step stays in the sum
        peer.join(h, now, run_failed=self._failure is not None)
        if self._failure is not None:
            return self._abort(peer, h, "connect")
        self._reply(peer, self._header(P.WELCOME, h, aux=peer.accepted, status=self.heartbeat_port),
                    None, "connect")

    def _on_protocol_error(self, peer: Peer, reason: str) -> None:
        """A malformed message: counted; the peer is cut off (it does not speak the protocol)."""
        self._count_reject(peer, "protocol")
        log.warning("parameter server rank %d: protocol error from worker rank %d: %s",
                    self.global_rank, peer.rank, reason)
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
            return self._reply(peer, self._header(P.PUSH_REPLY, h, status=P.DROPPED, aux=staleness),
                               None, "push")
        try:
            grads = self._updater.decode_push(data)
        except Rejected as e:
            return self._reject(peer, h, e.reason)
        peer.accepted += 1
        self.staleness_histogram[staleness] += 1
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

    def _evict(self, peer: Peer, h: P.Header, reason: str) -> None:
        """Answer a request of a worker the server no longer serves, with the reason."""
        text = reason.encode()
        self._reply(peer, self._header(P.EVICTED, h, nbytes=len(text)), text, "pull", declare=False)

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
               declare: bool = True) -> None:
        """Queue a reply without blocking; a worker whose queue is full (it does
        not read) or whose connection is gone is declared dead (``declare``)."""
        frames = [peer.ident, h.pack()]
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

    def _resume(self) -> None:
        """Load this server's checkpoint, if any: validated whole before
        anything changes (:class:`~gradcomp.ps.CheckpointError` otherwise)."""
        version = ckpt.resume_shard(self.checkpoint_dir, self.rank, self.num_servers, self._updater)
        if version is not None:
            self.version = self.resumed_from = version


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)

