"""The worker role: pushes compressed gradients and pulls parameters."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.compressors import Compressor, ErrorFeedback, NoCompression
from gradcomp.errors import PayloadError
from gradcomp.meter import TrafficMeter
from gradcomp.ps import protocol as P
from gradcomp.ps.errors import PeerError, ProtocolError, PSAbortedError
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
    compressed there and only the payload bytes move to the host for the
    gloo transport; pulled payloads are decoded on the replica's device.

    Every request waits at most ``timeout`` seconds per transfer; in sync mode
    a pull waits for the slowest worker's push, so ``timeout`` must exceed
    the servers' ``worker_timeout``.

    Args:
        params: the model (an ``nn.Module``, its ``named_parameters()``) or a
            mapping of names to float32 tensors: the replica, updated in place
            by :meth:`pull`. Names, shapes and order must match the servers'.
        num_servers: number of server ranks (ranks ``[0, num_servers)``).
        compressor: push compressor (default :class:`~gradcomp.NoCompression`);
            an :class:`~gradcomp.ErrorFeedback` is used as given.
        error_feedback: wrap a lossy ``compressor`` in ``ErrorFeedback``.
        timeout: seconds to wait for each transfer (> 0).
        group: the process group (default: the world); ranks are group ranks.
        meter: :class:`~gradcomp.TrafficMeter` for phases ``"push"`` and ``"pull"``.

    Raises:
        ValueError / TypeError: an invalid argument (the message names it), a
            non-float32 or non-contiguous parameter, or this rank is a server rank.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, params, *, num_servers: int = 1, compressor: Compressor | None = None,
                 error_feedback: bool = True, timeout: float = 120.0, group=None,
                 meter: TrafficMeter | None = None):
        self.group = group
        self.rank, world, self.num_servers = P.join_layout(group, num_servers)
        if self.rank < self.num_servers:
            raise ValueError(f"rank {self.rank} is a server rank (servers are ranks 0..{self.num_servers - 1}); "
                             "build a gradcomp.ps.ParameterServer there")
        self.global_rank = self.rank if group is None else dist.get_global_rank(group, self.rank)
        self.timeout = v.timeout("timeout", timeout)
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        compressor = NoCompression() if compressor is None else compressor
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a gradcomp compressor or None, got {type(compressor).__name__}")
        if error_feedback and compressor.lossy and not isinstance(compressor, ErrorFeedback):
            compressor = ErrorFeedback(compressor)
        self.compressor = compressor
        self.meter = meter if meter is not None else TrafficMeter()

        self._module = params if isinstance(params, torch.nn.Module) else None
        tensors = named_tensors(params)
        for name, t in tensors.items():
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise TypeError(f"parameter {name!r} must be a contiguous float32 tensor (the replica of the "
                                f"servers' float32 parameters), got {t.dtype}"
                                f"{'' if t.is_contiguous() else ', non-contiguous'}")
        self.replica: dict[str, torch.Tensor] = {n: t.detach() for n, t in tensors.items()}
        self.shards = shard_parameters(param_specs(tensors), self.num_servers)
        self.servers = [i if group is None else dist.get_global_rank(group, i) for i in range(self.num_servers)]
        self._layouts = [layout_checksum(sh) for sh in self.shards]
        self._raw_bundle = [P.raw_bundle_nbytes(s.shape for s in sh) for sh in self.shards]
        self.versions = [-1] * self.num_servers
        self._min_version = [0] * self.num_servers
        self._has_replica = False
        self._closed = False
        self._broken = False
        self.pushes = self.accepted = self.dropped = self.rejected = self.pulls = 0

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
        for s, dst in enumerate(self.servers):
            h = P.Header(P.PULL, self.global_rank, self.versions[s],
                         status=0 if self._has_replica else P.WANT_FULL,
                         layout=self._layouts[s], aux=self._min_version[s])
            self._send(h, None, s, "pull")
        for s, src in enumerate(self.servers):
            h, data = self._recv(s, "pull")
            if h.kind != P.PULL_REPLY or h.status not in (P.FULL, P.DELTA) or data is None:
                raise ProtocolError(f"server rank {src} answered a pull with kind "
                                    f"{P.KIND_NAMES.get(h.kind)} status {h.status} "
                                    "(a placement mismatch is answered with REJECTED)")
            if h.status == P.DELTA and not self._has_replica:
                raise ProtocolError(f"server rank {src} sent a delta to a worker without a replica")
            wires = P.unpack_bundle(data, len(self.shards[s]))
            with torch.no_grad():
                for spec, wire in zip(self.shards[s], wires):
                    dst_t = self.replica[spec.name]
                    p = decode(wire.to(dst_t.device))
                    if tuple(p.shape) != spec.shape:
                        raise PayloadError(f"server rank {src} sent shape {tuple(p.shape)} for "
                                           f"{spec.name!r}, expected {spec.shape}")
                    dec = P.decoder_for(p.codec)
                    if h.status == P.FULL:
                        dst_t.copy_(dec.decompress(p).view(spec.shape))
                    else:
                        dec.decompress_add_(p, dst_t)
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
        for s in range(self.num_servers):
            wires = [self._compress(grads[spec.name], spec.name).wire for spec in self.shards[s]]
            blob = P.pack_bundle(wires)
            h = P.Header(P.PUSH, self.global_rank, stamped[s], nbytes=blob.numel(), layout=self._layouts[s])
            self._send(h, blob, s, "push", raw=P.HEADER_NBYTES + self._raw_bundle[s])
        statuses, staleness, versions = [], [], []
        for s, src in enumerate(self.servers):
            h, _ = self._recv(s, "push")
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
        """Tell every server this worker has finished (idempotent). Nothing is
        sent after a failed exchange (the servers detect this worker's exit)
        or to a server that is already gone."""
        if self._closed:
            return
        self._closed = True
        if self._broken:
            return
        for s in range(self.num_servers):
            try:
                self._send(P.Header(P.DONE, self.global_rank, self.versions[s]), None, s, "pull")
            except PeerError:
                pass

    close = done

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.done()

    def stats(self) -> dict:
        """Counters: ``pushes``, ``accepted``, ``dropped``, ``rejected``, ``pulls``,
        ``version``, ``versions`` and ``traffic`` (:meth:`TrafficMeter.as_dict`,
        phases ``"push"`` and ``"pull"``)."""
        return {"rank": self.global_rank, "pushes": self.pushes, "accepted": self.accepted,
                "dropped": self.dropped, "rejected": self.rejected, "pulls": self.pulls,
                "version": self.version, "versions": list(self.versions),
                "traffic": self.meter.as_dict()}

    # ---- internals ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Worker has sent DONE; build a new one to rejoin")
        if self._broken:
            raise RuntimeError("an earlier exchange of this Worker failed; its servers no longer expect it")

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
        if isinstance(self.compressor, ErrorFeedback):
            return self.compressor.compress(g, key=name)
        return self.compressor.compress(g)

    def _send(self, h: P.Header, data, s: int, phase: str, raw: int | None = None) -> None:
        n = P.send_message(h, data, self.servers[s], header_tag=P.TAG_REQUEST, data_tag=P.TAG_PUSH_DATA,
                           timeout=self.timeout, group=self.group, what="server")
        self.meter.record_send(n, n if raw is None else raw, phase)

    def _recv(self, s: int, phase: str):
        h, data = P.recv_message(self.servers[s], kinds=P.REPLIES, header_tag=P.TAG_REPLY,
                                 data_tag=P.TAG_PULL_DATA, timeout=self.timeout,
                                 max_nbytes=2 * self._raw_bundle[s] + (1 << 16), group=self.group,
                                 what="server")
        n = P.HEADER_NBYTES + h.nbytes
        # a pull's data is the shard: uncompressed, it is the float32 bundle
        self.meter.record_recv(n, P.HEADER_NBYTES + self._raw_bundle[s] if data is not None else n, phase)
        if h.kind == P.ABORT:
            raise PSAbortedError(self.servers[s], h.aux)
        return h, data
