"""The server role: holds a parameter shard and applies workers' gradients to it."""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.compressors import Compressor, ErrorFeedback, NoCompression
from gradcomp.errors import PayloadError
from gradcomp.meter import TrafficMeter
from gradcomp.wire import decode
from gradcomp.ps import checkpoint as ckpt
from gradcomp.ps import protocol as P
from gradcomp.ps.errors import PeerError, ProtocolError, WorkerFailedError
from gradcomp.ps.sharding import layout_checksum, named_tensors, param_specs, shard_parameters

__all__ = ["ParameterServer", "MODES", "FAILURE_POLICIES"]

log = logging.getLogger("gradcomp.ps")

MODES = ("sync", "async")
FAILURE_POLICIES = ("continue", "fail")
_REJECT_REASONS = ("payload", "shape", "nonfinite", "layout", "version", "duplicate", "protocol")


@dataclass
class _Peer:
    """What the server knows about one worker."""

    rank: int
    status: str = "active"  # active | done | dead | aborted
    reason: str = ""
    pushes: int = 0
    accepted: int = 0
    dropped: int = 0
    rejected: int = 0
    pulls: int = 0
    meter: TrafficMeter = field(default_factory=TrafficMeter)
    mirror: dict | None = None  # compress_pull: the worker's replica as the server knows it
    deferred: P.Header | None = None  # sync: a pull waiting for the step to complete
    may_receive: threading.Event = field(default_factory=threading.Event)
    stop: bool = False


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

    Failures: each worker is served by a receiving thread that waits at most
    ``worker_timeout`` seconds for the worker's next request after the last
    reply (a worker blocked on a reply the server is holding back is not on
    the clock). A connection error or that timeout declares the worker dead;
    the run then continues without it (``on_worker_failure="continue"``) or
    every live worker is told to abort and :meth:`serve` raises
    :class:`~gradcomp.ps.WorkerFailedError` naming the rank (``"fail"``). A
    push whose bundle is malformed (:class:`gradcomp.PayloadError`), whose
    shapes, placement or version do not match, or which decodes to non-finite
    values is rejected, counted and answered with ``REJECTED``; the server
    keeps serving. A malformed control header cuts that worker off (its byte
    stream cannot be resynchronised) and counts as a protocol rejection.

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
        checkpoint_dir: directory of the checkpoint files (None: no checkpoints).
        checkpoint_every: also checkpoint every this many versions (0: only at the end).
        resume: load ``checkpoint_dir``'s checkpoint of this server if it exists.
        group: the process group (default: the world); ranks are group ranks.
        meter: a :class:`~gradcomp.TrafficMeter` for phases ``"push"`` and
            ``"pull"`` (default: a new one, :attr:`meter`).
        device: device of the shard and of the update arithmetic.

    Raises:
        ValueError / TypeError: an invalid argument (the message names it);
            this rank is not a server rank.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, params, *, mode: str = "sync", num_servers: int = 1, optimizer=None,
                 max_staleness: int | None = None, staleness_lr: bool = False,
                 clip_grad_norm: float | None = None, compress_pull: bool = False,
                 pull_compressor: Compressor | None = None, on_worker_failure: str = "continue",
                 worker_timeout: float = 60.0, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 0, resume: bool = False, group=None,
                 meter: TrafficMeter | None = None, device: str | torch.device = "cpu"):
        self.mode = v.choice("mode", mode, MODES)
        self.on_worker_failure = v.choice("on_worker_failure", on_worker_failure, FAILURE_POLICIES)
        self.group = group
        self.rank, world, self.num_servers = P.join_layout(group, num_servers)
        if self.rank >= self.num_servers:
            raise ValueError(f"rank {self.rank} is a worker rank (servers are ranks 0..{self.num_servers - 1}); "
                             "build a gradcomp.ps.Worker there")
        self.global_rank = _global(group, self.rank)
        self.max_staleness = None if max_staleness is None else v.integer("max_staleness", max_staleness, 0)
        self.staleness_lr = _flag("staleness_lr", staleness_lr)
        if clip_grad_norm is not None:
            clip_grad_norm = v.real("clip_grad_norm", clip_grad_norm)
            if not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
                raise ValueError(f"clip_grad_norm must be a finite number > 0 or None, got {clip_grad_norm}")
        self.clip_grad_norm = clip_grad_norm
        self.compress_pull = _flag("compress_pull", compress_pull)
        self.pull_compressor = _pull_compressor(pull_compressor, self.compress_pull)
        self.worker_timeout = v.timeout("worker_timeout", worker_timeout)
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
        self.params = {s.name: torch.nn.Parameter(tensors[s.name].detach().to(self.device, torch.float32).clone())
                       for s in self.shard}
        factory = optimizer if optimizer is not None else functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
        if not callable(factory):
            raise TypeError(f"optimizer must be a callable returning a torch.optim.Optimizer, "
                            f"got {type(factory).__name__}")
        self.optimizer = factory(list(self.params.values()))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory must return a torch.optim.Optimizer, "
                            f"got {type(self.optimizer).__name__}")

        self._raw_bundle = P.raw_bundle_nbytes(s.shape for s in self.shard)
        self._max_message = 2 * self._raw_bundle + (1 << 16)
        self._raw = NoCompression()
        self.version = 0
        self.resumed_from: int | None = None
        self.updates = 0
        self.clipped = 0
        self.checkpoints = 0
        self.staleness_histogram: Counter = Counter()
        self.dropped_staleness_histogram: Counter = Counter()
        self.rejected_reasons: Counter = Counter()
        self.peers = {r: _Peer(r) for r in (_global(group, i) for i in range(self.num_servers, world))}
        self._sum: dict[str, torch.Tensor] = {}
        self._contributors: set[int] = set()
        self._failure: tuple[int, str] | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._served = False
        if resume:
            self._resume()

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
        threads = [threading.Thread(target=self._receive_loop, args=(p,), daemon=True,
                                    name=f"gradcomp-ps-recv-{p.rank}") for p in self.peers.values()]
        for t in threads:
            t.start()
        try:
            while any(p.status == "active" for p in self.peers.values()):
                try:
                    item = self._inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._handle(item)
        finally:
            for p in self.peers.values():
                p.stop = True
                p.may_receive.set()
            deadline = time.monotonic() + 2.0
            for t in threads:  # all have returned unless serve() is failing
                t.join(timeout=max(0.0, deadline - time.monotonic()))
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
        ``resumed_from``, ``pushes``, ``accepted``, ``dropped`` (too stale),
        ``rejected`` (malformed), ``rejected_reasons`` (reason -> count),
        ``staleness_histogram`` (staleness -> accepted pushes),
        ``dropped_staleness_histogram``, ``pulls``, ``clipped`` (steps whose
        gradient norm was clipped), ``checkpoints`` (written), ``workers``
        (rank -> per-worker counters, status, reason and push/pull bytes with
        their uncompressed float32 equivalents), ``dead_workers`` (rank ->
        reason), ``done_workers``, ``traffic`` (:meth:`TrafficMeter.as_dict`).
        """
        workers = {}
        for r, p in self.peers.items():
            ph = p.meter.as_dict()["phases"]
            workers[r] = {
                "status": p.status, "reason": p.reason, "pushes": p.pushes, "accepted": p.accepted,
                "dropped": p.dropped, "rejected": p.rejected, "pulls": p.pulls,
                "push_bytes": ph.get("push", {}).get("bytes_received", 0),
                "push_raw_bytes": ph.get("push", {}).get("raw_bytes_received", 0),
                "pull_bytes": ph.get("pull", {}).get("bytes_sent", 0),
                "pull_raw_bytes": ph.get("pull", {}).get("raw_bytes_sent", 0),
            }
        return {
            "rank": self.global_rank, "mode": self.mode, "version": self.version,
            "updates": self.updates, "resumed_from": self.resumed_from,
            "pushes": sum(p.pushes for p in self.peers.values()),
            "accepted": sum(p.accepted for p in self.peers.values()),
            "dropped": sum(p.dropped for p in self.peers.values()),
            "rejected": sum(p.rejected for p in self.peers.values()),
            "rejected_reasons": dict(self.rejected_reasons),
            "staleness_histogram": dict(sorted(self.staleness_histogram.items())),
            "dropped_staleness_histogram": dict(sorted(self.dropped_staleness_histogram.items())),
            "pulls": sum(p.pulls for p in self.peers.values()),
            "clipped": self.clipped, "checkpoints": self.checkpoints,
            "workers": workers,
            "dead_workers": {r: p.reason for r, p in self.peers.items() if p.status == "dead"},
            "done_workers": sorted(r for r, p in self.peers.items() if p.status == "done"),
            "traffic": self.meter.as_dict(),
        }

    def save_checkpoint(self) -> str:
        """Write parameters, optimizer state and version atomically; returns the path.

        Raises:
            ValueError: no ``checkpoint_dir`` was given.
        """
        if self.checkpoint_dir is None:
            raise ValueError("save_checkpoint needs the server's checkpoint_dir")
        path = ckpt.checkpoint_path(self.checkpoint_dir, self.rank)
        ckpt.save_atomic({
            "format": ckpt.FORMAT,
            "server_index": self.rank,
            "num_servers": self.num_servers,
            "mode": self.mode,
            "layout": [[s.name, list(s.shape)] for s in self.shard],
            "version": self.version,
            "params": {n: p.detach().cpu().clone() for n, p in self.params.items()},
            "optimizer": self.optimizer.state_dict(),
        }, path)
        self.checkpoints += 1
        return path

    # ---- receiving (one thread per worker) -----------------------------------------
    def _receive_loop(self, peer: _Peer) -> None:
        """Receive ``peer``'s requests one at a time and queue them for the main
        thread; after each request wait (without a transport timeout) until the
        main thread has replied."""
        while not peer.stop:
            try:
                header, data = P.recv_message(
                    peer.rank, kinds=P.REQUESTS, header_tag=P.TAG_REQUEST, data_tag=P.TAG_PUSH_DATA,
                    timeout=self.worker_timeout, max_nbytes=self._max_message, group=self.group,
                    what="worker")
                if header.sender != peer.rank:
                    raise ProtocolError(f"header names sender {header.sender}, received from {peer.rank}")
            except PeerError as e:
                reason = (f"silent for more than worker_timeout={self.worker_timeout:g} s"
                          if "timed out" in e.reason.lower() else f"connection lost: {e.reason}")
                self._inbox.put(("failed", peer, reason))
                return
            except ProtocolError as e:
                self._inbox.put(("protocol", peer, str(e)))
                return
            except Exception as e:  # never let a receiving thread die silently
                self._inbox.put(("failed", peer, f"{type(e).__name__}: {e}"))
                return
            self._inbox.put(("request", peer, header, data))
            if header.kind == P.DONE:
                return
            while not peer.may_receive.wait(0.5):
                pass
            peer.may_receive.clear()

    # ---- main thread ----------------------------------------------------------------
    def _handle(self, item) -> None:
        what, peer = item[0], item[1]
        if peer.status != "active":
            return
        if what == "failed":
            self._on_failure(peer, item[2])
            return
        if what == "protocol":
            self._count_reject(peer, "protocol")
            self._on_failure(peer, f"protocol error: {item[2]}")
            return
        header, data = item[2], item[3]
        if self._failure is not None and header.kind != P.DONE:
            self._abort(peer, "push" if header.kind == P.PUSH else "pull")
        elif header.kind == P.PUSH:
            self._on_push(peer, header, data)
        elif header.kind == P.PULL:
            self._on_pull(peer, header)
        else:
            self._on_done(peer)

    def _on_push(self, peer: _Peer, h: P.Header, data) -> None:
        peer.pushes += 1
        self._record_recv(peer, P.HEADER_NBYTES + h.nbytes, P.HEADER_NBYTES + self._raw_bundle, "push")
        if h.layout != self.layout:
            return self._reject(peer, "layout")
        if not 0 <= h.version <= self.version:
            return self._reject(peer, "version")
        staleness = self.version - h.version
        if self.mode == "sync" and staleness == 0 and peer.rank in self._contributors:
            return self._reject(peer, "duplicate")
        too_stale = staleness > 0 if self.mode == "sync" else (
            self.max_staleness is not None and staleness > self.max_staleness)
        if too_stale:
            peer.dropped += 1
            self.dropped_staleness_histogram[staleness] += 1
            return self._reply(peer, P.Header(P.PUSH_REPLY, self.global_rank, self.version,
                                              status=P.DROPPED, aux=staleness), None, "push")
        try:
            grads = self._decode_push(data)
        except _Rejected as e:
            return self._reject(peer, e.reason)
        peer.accepted += 1
        self.staleness_histogram[staleness] += 1
        if self.mode == "async":
            self._apply(grads, staleness)
            self._reply(peer, P.Header(P.PUSH_REPLY, self.global_rank, self.version,
                                       status=P.ACCEPTED, aux=staleness), None, "push")
        else:
            for name, g in grads.items():
                if name in self._sum:
                    self._sum[name].add_(g)
                else:
                    self._sum[name] = g
            self._contributors.add(peer.rank)
            self._reply(peer, P.Header(P.PUSH_REPLY, self.global_rank, self.version,
                                       status=P.ACCEPTED, aux=0), None, "push")
            self._maybe_complete_step()

    def _decode_push(self, data) -> dict[str, torch.Tensor]:
        """Bundle bytes -> ``{name: float32 gradient on device}``, validating all
        payloads before any is used."""
        if data is None:
            raise _Rejected("payload")
        try:
            payloads = [decode(w) for w in P.unpack_bundle(data, len(self.shard))]
        except PayloadError:
            raise _Rejected("payload") from None
        for spec, p in zip(self.shard, payloads):
            if tuple(p.shape) != spec.shape:
                raise _Rejected("shape")
        grads = {}
        for spec, p in zip(self.shard, payloads):
            g = torch.zeros(spec.shape, dtype=torch.float32, device=self.device)
            if p.device != self.device:
                p = decode(p.wire.to(self.device))
            try:
                P.decoder_for(p.codec).decompress_add_(p, g)
            except (PayloadError, ValueError):
                raise _Rejected("payload") from None
            if not bool(torch.isfinite(g).all()):
                raise _Rejected("nonfinite")
            grads[spec.name] = g
        return grads

    def _apply(self, grads: dict[str, torch.Tensor], staleness: int) -> None:
        """One optimizer step with ``grads`` (consumed); the version advances."""
        for name, p in self.params.items():
            p.grad = grads[name]
        if self.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip_grad_norm)
            self.clipped += int(float(norm) > self.clip_grad_norm)
        saved = None
        if self.staleness_lr and staleness > 0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] / (1 + staleness)
        try:
            self.optimizer.step()
        finally:
            if saved is not None:
                for g, lr in zip(self.optimizer.param_groups, saved):
                    g["lr"] = lr
            for p in self.params.values():
                p.grad = None
        self.version += 1
        self.updates += 1
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _maybe_complete_step(self) -> None:
        """Sync: apply the averaged step once every live worker has pushed."""
        if self.mode != "sync" or not self._contributors:
            return
        live = {r for r, p in self.peers.items() if p.status == "active"}
        if not live <= self._contributors:
            return
        n = len(self._contributors)
        grads = {name: s.div_(n) for name, s in self._sum.items()}
        self._sum = {}
        self._contributors.clear()
        self._apply(grads, 0)
        for p in self.peers.values():  # every deferred pull was waiting for this step
            if p.status == "active" and p.deferred is not None:
                self._answer_pull(p, p.deferred)

    def _on_pull(self, peer: _Peer, h: P.Header) -> None:
        peer.pulls += 1
        self._record_recv(peer, P.HEADER_NBYTES, P.HEADER_NBYTES, "pull")
        if h.layout != self.layout:
            self._count_reject(peer, "layout")
            return self._reply(peer, P.Header(P.PULL_REPLY, self.global_rank, self.version,
                                              status=P.REJECTED), None, "pull")
        if self.mode == "sync" and h.aux > self.version and peer.rank in self._contributors:
            peer.deferred = h  # answered when the step completes
            return
        self._answer_pull(peer, h)

    def _answer_pull(self, peer: _Peer, h: P.Header) -> None:
        peer.deferred = None
        params = [(n, p.detach()) for n, p in self.params.items()]
        if not self.compress_pull or (h.status & P.WANT_FULL) or peer.mirror is None:
            wires = [self._raw.compress(p).wire for _, p in params]
            if self.compress_pull:
                peer.mirror = {n: p.clone() for n, p in params}
            status = P.FULL
        else:
            wires = []
            for n, p in params:
                mirror = peer.mirror[n]
                payload = self.pull_compressor.compress(p - mirror)
                self.pull_compressor.decompress_add_(payload, mirror)
                wires.append(payload.wire)
            status = P.DELTA
        blob = P.pack_bundle(wires)
        self._reply(peer, P.Header(P.PULL_REPLY, self.global_rank, self.version, nbytes=blob.numel(),
                                   status=status), blob, "pull",
                    raw_nbytes=P.HEADER_NBYTES + self._raw_bundle)

    def _on_done(self, peer: _Peer) -> None:
        peer.status = "done"
        peer.mirror = None
        self._stop(peer)
        self._maybe_complete_step()

    def _on_failure(self, peer: _Peer, reason: str) -> None:
        if peer.status != "active":
            return
        log.warning("parameter server rank %d: worker rank %d failed: %s", self.global_rank, peer.rank, reason)
        peer.status, peer.reason = "dead", reason
        peer.mirror = peer.deferred = None
        self._stop(peer)
        if self.on_worker_failure == "fail":
            if self._failure is None:
                self._failure = (peer.rank, reason)
                self._sum, self._contributors = {}, set()
                for p in self.peers.values():
                    if p.status == "active" and p.deferred is not None:
                        self._abort(p)
        else:
            self._maybe_complete_step()

    def _abort(self, peer: _Peer, phase: str = "pull") -> None:
        """Tell ``peer`` the run is aborted (answers its pending request)."""
        peer.deferred = None
        rank = self._failure[0]
        self._reply(peer, P.Header(P.ABORT, self.global_rank, self.version, aux=rank), None, phase)
        if peer.status == "active":
            peer.status, peer.reason = "aborted", f"told to abort after worker rank {rank} failed"
            self._stop(peer)

    def _reject(self, peer: _Peer, reason: str) -> None:
        self._count_reject(peer, reason)
        log.warning("parameter server rank %d: rejected a push from worker rank %d (%s)",
                    self.global_rank, peer.rank, reason)
        self._reply(peer, P.Header(P.PUSH_REPLY, self.global_rank, self.version, status=P.REJECTED),
                    None, "push")

    def _count_reject(self, peer: _Peer, reason: str) -> None:
        peer.rejected += 1
        self.rejected_reasons[reason] += 1

    def _reply(self, peer: _Peer, h: P.Header, data, phase: str, raw_nbytes: int | None = None) -> None:
        try:
            n = P.send_message(h, data, peer.rank, header_tag=P.TAG_REPLY, data_tag=P.TAG_PULL_DATA,
                               timeout=self.worker_timeout, group=self.group, what="worker")
        except PeerError as e:
            self._on_failure(peer, f"connection lost: {e.reason}")
            return
        raw = n if raw_nbytes is None else raw_nbytes
        self.meter.record_send(n, raw, phase)
        peer.meter.record_send(n, raw, phase)
        peer.may_receive.set()

    def _record_recv(self, peer: _Peer, n: int, raw: int, phase: str) -> None:
        self.meter.record_recv(n, raw, phase)
        peer.meter.record_recv(n, raw, phase)

    def _stop(self, peer: _Peer) -> None:
        peer.stop = True
        peer.may_receive.set()

    def _resume(self) -> None:
        path = ckpt.checkpoint_path(self.checkpoint_dir, self.rank)
        if not os.path.exists(path):
            return
        state = ckpt.load(path)
        layout = [[s.name, list(s.shape)] for s in self.shard]
        if state["layout"] != layout or state["num_servers"] != self.num_servers:
            raise ValueError(f"checkpoint {path} holds another parameter placement "
                             f"({state['num_servers']} servers, {len(state['layout'])} parameters); "
                             "resume needs the same model and num_servers")
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state["params"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.resumed_from = self.version


class _Rejected(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _flag(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def _pull_compressor(c, compress_pull: bool) -> Compressor:
    from gradcomp.compressors import Int8Quantizer

    if c is None:
        return Int8Quantizer() if compress_pull else NoCompression()
    if not isinstance(c, Compressor):
        raise TypeError(f"pull_compressor must be a gradcomp compressor or None, got {type(c).__name__}")
    return c.wraps if isinstance(c, ErrorFeedback) else c

