"""``algorithm="auto"``: per bucket, the allreduce algorithm measured fastest, the cost model as prior.

Per bucket (a ``key`` of :func:`gradcomp.allreduce`, a DDP bucket, a local-SGD fragment) the
candidates are the algorithms that take its compressor (dense: ring, two-phase,
halving-doubling, and hierarchical where more than one host of more than one rank is known;
sparse: the allgather and, for an exact ``TopK`` with a ratio, the sparse reduce-scatter). The
link cost model (:mod:`gradcomp.comm.cost`) orders them and prunes those it predicts clearly
slower; the rest are timed in rounds, every timed call right after an untimed call of the same
algorithm (a steady call, not a switch; a change of load hits every candidate alike); the ranks
agree on the timings (the element-wise ``MAX`` of each rank's medians, one float64 allreduce)
and take the fastest; every ``interval`` calls each is timed again, and the choice moves only
for a gain beyond ``margin`` (selection by measurement at run time, as STAR-MPI does: Faraj,
Yuan and Lowenthal, ICS 2006). Invariant: every rank decides from the same agreed numbers at
the same call, so every rank runs the same algorithm on every call and results stay
bit-identical. Error feedback keeps one flat residual per bucket, which every algorithm reads
and writes alike (:mod:`gradcomp.comm.local`): a switch loses nothing. docs/collectives.md#auto.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm import cost
from gradcomp.comm._args import DENSE_ALGORITHMS, SPARSE_ALGORITHMS, check_algorithm
from gradcomp.comm.consensus import agree_max
from gradcomp.comm.settings import agree_settings, compressor_text
from gradcomp.comm.topology import Topology, layout
from gradcomp.compressors import split

__all__ = ["AutoAlgorithm", "default_for", "residual_key"]


def residual_key(key: Hashable) -> tuple:
    """The key under which an :class:`~gradcomp.ErrorFeedback` passed with
    ``algorithm="auto"`` keeps ``key``'s one flat residual."""
    return ("auto", key)


def _link(name: str, value, default: cost.Link) -> cost.Link:
    if value is None:
        return default
    if isinstance(value, cost.Link):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"{name} must be None, a gradcomp.comm.cost.Link or a pair (latency_s, bytes_per_s), "
                        f"got {value!r}")
    return cost.Link(*value)


class _Track:
    """The chooser's state for one bucket."""

    def __init__(self, sig: tuple, candidates: list[str], predicted: dict[str, float], pruned: list[str],
                 explore: int):
        self.sig, self.candidates, self.predicted, self.pruned = sig, candidates, predicted, pruned
        self.samples: dict[str, list[float]] = {c: [] for c in candidates}
        self.current = candidates[0] if len(candidates) == 1 else None
        # (algorithm, timed) of the next exploring calls: `explore` rounds, in each every candidate
        # once untimed (it pays the switch: the ranks' agreement on a changed call, buffers of
        # another size), then once timed
        self.queue: list[tuple[str, bool]] = [] if self.current is not None else self.rounds(explore)
        self.last: str | None = None  # the algorithm of the last call
        self.since = 0  # calls since the last decision
        self.calls = 0

    def rounds(self, count: int) -> list[tuple[str, bool]]:
        """The exploring calls of ``count`` rounds: in each, every candidate untimed, then timed."""
        return [(c, timed) for _ in range(count) for c in self.candidates for timed in (False, True)]


class AutoAlgorithm:
    """Chooses the allreduce algorithm of each bucket (see the module docstring).

    ``gc.allreduce(t, c, algorithm="auto")`` uses one instance per process
    group (:func:`default_for`); pass ``algorithm=gc.AutoAlgorithm(...)`` for a
    calibrated link or other settings. The DDP hook and ``gc.LocalSGD`` with
    ``algorithm="auto"`` hold one of their own. Every rank of a group must use
    equal settings (checked once per group) and call with the same keys in the
    same order.

    Args:
        link: the link between hosts (all links when no topology is known): a
            :class:`~gradcomp.comm.cost.Link` or ``(latency_s, bytes_per_s)``,
            e.g. the ``alpha_s`` and ``beta_bytes_per_s`` of ``gradcomp plan
            calibrate``; None: :data:`~gradcomp.comm.cost.DEFAULT_LINK`.
        intra_link: the link inside a host (hierarchical's first and last
            steps); None: :data:`~gradcomp.comm.cost.DEFAULT_INTRA_LINK`.
        explore: rounds of timed calls before the first decision (each
            candidate once per round, after an untimed call of it), and the
            window of each one's median (>= 1).
        interval: calls between re-checks, each re-timing every candidate
            once, after an untimed call (>= 1).
        margin: a re-check switches only when the measured best beats the
            current choice by more than this fraction (in [0, 1)).
        prune: candidates predicted slower than ``prune`` x the best
            prediction are never timed (> 1; ``inf``: time all).
        timing: optional ``(key, algorithm, seconds) -> seconds`` applied to
            every local timing (tests inject skew with it).
        clock: zero-argument callable returning seconds (default ``time.perf_counter``).

    Attributes:
        switches: every switch, oldest first (JSON-ready dicts: ``kind``
            ``"algorithm"``, ``key``, ``numel``, ``call``, ``from`` (None at the
            first decision), ``to``, ``measured_s`` (agreed median seconds per
            candidate), ``predicted_s``, ``pruned``); also recorded in the
            call's meter (:meth:`gradcomp.TrafficMeter.record_switch`).

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
    """

    def __init__(self, link=None, intra_link=None, *, explore: int = 5, interval: int = 100,
                 margin: float = 0.05, prune: float = 4.0,
                 timing: Callable[[Hashable, str, float], float] | None = None,
                 clock: Callable[[], float] | None = None):
        self.link = _link("link", link, cost.DEFAULT_LINK)
        self.intra_link = _link("intra_link", intra_link, cost.DEFAULT_INTRA_LINK)
        self.explore = v.integer("explore", explore, 1, 1000)
        self.interval = v.integer("interval", interval, 1)
        self.margin = v.real("margin", margin)
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        self.prune = v.real("prune", prune)
        if not self.prune > 1:
            raise ValueError(f"prune must be a number > 1 (inf: time every candidate), got {prune!r}")
        for name, fn in (("timing", timing), ("clock", clock)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
        self.timing = timing
        self.clock = clock if clock is not None else time.perf_counter
        self.switches: list[dict] = []
        self._tracks: dict[Hashable, _Track] = {}
        # group -> {topology key: (hosts, ranks per host) or None}; it goes with its group
        self._hosts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._agreed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def settings(self) -> dict:
        """What decides the choices: every rank's instance must share it."""
        return {"link": self.link, "intra_link": self.intra_link, "explore": self.explore,
                "interval": self.interval, "margin": self.margin, "prune": self.prune}

    def prepare(self, group, topology: Topology | None = None, *, timeout: float = 300.0, device="cpu") -> None:
        """Resolve, now, whether ``group`` (under ``topology``; None: the
        environment) has the hosts the hierarchical algorithm needs: a
        collective every rank of ``group`` must reach, done otherwise at the
        first call (the DDP hook and ``gc.LocalSGD`` call it when they make
        their group).

        Raises:
            ValueError: an explicit ``topology`` that does not fit ``group``
                (on every rank, see :func:`gradcomp.comm.topology.layout`).
        """
        if dist.get_world_size(group) > 1:
            self._host_shape(group, topology, timeout, device)

    def algorithm(self, key: Hashable) -> str | None:
        """The algorithm ``key``'s calls use now (None: still timing the candidates, or unknown)."""
        t = self._tracks.get(key)
        return None if t is None else t.current

    def reduce(self, run: Callable[..., torch.Tensor], tensor: torch.Tensor, compressor, *, op: str, group,
               meter, timeout: float, key: Hashable, residual, out, check: bool, topology, tag) -> torch.Tensor:
        """One call of ``run`` (:func:`gradcomp.allreduce` with a concrete
        algorithm; arguments checked, ``group`` of size >= 2) with the
        algorithm this bucket's track picks; times it and decides when due.

        An :class:`~gradcomp.ErrorFeedback` ``compressor`` keeps the bucket's
        one flat residual under :func:`residual_key` ``(key)``.
        """
        self._agree_settings(group, timeout, tensor.device, meter)
        n = tensor.numel()
        key = ("numel", n) if key is None else key
        inner, ef = split(compressor)
        track = self._track(key, inner, tensor, op, group, timeout, topology)
        exploring = bool(track.queue)
        alg, timed = track.queue.pop(0) if exploring else (track.current, False)
        changed = alg != track.last
        r = residual
        if ef is not None:
            r = ef.residual_for(residual_key(key), n, tensor.device)
        t0 = self.clock()
        result = run(tensor, inner if ef is not None else compressor, op=op, algorithm=alg, group=group,
                     meter=meter, timeout=timeout, key=key, residual=r, out=out, check=check or changed,
                     topology=topology if alg == "hierarchical" else None, tag=tag)
        seconds = self.clock() - t0
        if ef is not None:
            ef.keep(residual_key(key), r)
        if self.timing is not None:
            seconds = float(self.timing(key, alg, seconds))
        track.last, track.calls = alg, track.calls + 1
        if exploring:
            if timed:
                track.samples[alg] = (track.samples[alg] + [seconds])[-self.explore:]
            if not track.queue:
                self._decide(track, key, n, group, timeout, tensor.device, meter)
        else:
            track.since += 1
            if track.since >= self.interval and len(track.candidates) > 1:
                track.queue = track.rounds(1)  # re-check: each candidate timed once more
        return result

    # ---- internals ---------------------------------------------------------------
    def _agree_settings(self, group, timeout: float, device, meter) -> None:
        ref = self._agreed.get(group)
        if ref is None:
            agree_settings(group, "gradcomp.AutoAlgorithm", self.settings(), timeout=timeout, device=device,
                           meter=meter)
            self._agreed[group] = True

    def _track(self, key: Hashable, inner, tensor: torch.Tensor, op: str, group, timeout: float,
               topology) -> _Track:
        world = dist.get_world_size(group)
        sig = (tensor.numel(), tensor.dtype, op, world, compressor_text(inner),
               None if topology is None else topology.key())
        with self._lock:
            t = self._tracks.get(key)
        if t is not None and t.sig == sig:
            return t
        hosts = None if inner.sparse else self._host_shape(group, topology, timeout, tensor.device)
        names = [a for a in (SPARSE_ALGORITHMS if inner.sparse else DENSE_ALGORITHMS)
                 if (a != "hierarchical" or hosts is not None) and _takes(a, inner)]
        predicted = self._predict(names, inner, tensor.numel(), world, hosts)
        best = min(predicted.values(), default=math.nan)
        pruned = [a for a in names if predicted[a] > self.prune * best]
        kept = sorted((a for a in names if a not in pruned), key=lambda a: (predicted[a], names.index(a)))
        t = _Track(sig, kept, predicted, pruned, self.explore)
        with self._lock:
            self._tracks[key] = t
        return t

    def _predict(self, names: list[str], inner, numel: int, world: int, hosts) -> dict[str, float]:
        """Each candidate's predicted seconds (NaN where the model cannot price it:
        a compressor without a fixed wire size, then nothing is pruned)."""
        h, r = hosts if hosts is not None else (1, world)
        out = {}
        for a in names:
            try:
                out[a] = cost.transfer_seconds(a, inner, numel, world, self.link, intra=self.intra_link,
                                                hosts=h, per_host=r)
            except ValueError:
                out[a] = math.nan
        return out

    def _host_shape(self, group, topology, timeout: float, device) -> tuple[int, int] | None:
        """``(hosts, ranks per host)`` when the hierarchical algorithm applies
        (more than one of each), else None; the same on every rank (collective
        on the first call per group and spec, cached)."""
        ck = None if topology is None else topology.key()
        known_shapes = self._hosts.setdefault(group, {})
        if ck in known_shapes:
            return known_shapes[ck]
        if topology is None:
            # hosts from the environment: only when every rank has a host id (agreed)
            has = Topology().own_host(dist.get_rank(group))[0] is not None
            known = -agree_max([-float(has)], group, timeout, device, "gradcomp.AutoAlgorithm")[0] > 0
            shape = None
            if known:
                try:
                    lay = layout(group, None, timeout, device)
                    shape = (lay.host_count, lay.ranks_per_host)
                except ValueError:  # the same on every rank: the hosts are unequal
                    shape = None
        else:
            lay = layout(group, topology, timeout, device)  # an explicit bad topology raises everywhere
            shape = (lay.host_count, lay.ranks_per_host)
        if shape is not None and (shape[0] < 2 or shape[1] < 2):
            shape = None
        known_shapes[ck] = shape
        return shape

    def _decide(self, t: _Track, key: Hashable, numel: int, group, timeout: float, device, meter) -> None:
        """Agree on the candidates' medians and move ``t`` if due."""
        local = [statistics.median(t.samples[c]) for c in t.candidates]
        agreed = agree_max(local, group, timeout, device, "gradcomp.AutoAlgorithm")
        measured = dict(zip(t.candidates, agreed))
        order = {c: i for i, c in enumerate(t.candidates)}  # the model's order breaks exact ties
        best = min(t.candidates, key=lambda c: (measured[c], order[c]))
        t.since = 0
        if t.current is not None and (best == t.current or measured[best] >= (1 - self.margin) * measured[t.current]):
            return
        entry = {"kind": "algorithm", "key": key if isinstance(key, (int, str)) else repr(key), "numel": numel,
                 "call": t.calls, "from": t.current, "to": best, "measured_s": measured,
                 "predicted_s": {c: t.predicted[c] for c in t.predicted}, "pruned": list(t.pruned)}
        t.current = best
        self.switches.append(entry)
        if meter is not None:
            meter.record_switch(entry)

    def __getstate__(self) -> dict:
        """Settings, switches and tracks; not the hooks (the restored chooser uses
        ``time.perf_counter`` and no timing hook) or what a group resolved."""
        state = self.__dict__.copy()
        state.update(timing=None, clock=time.perf_counter, _hosts=None, _agreed=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._agreed = weakref.WeakKeyDictionary()
        self._hosts = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"AutoAlgorithm(link={self.link!r}, intra_link={self.intra_link!r}, explore={self.explore}, "
                f"interval={self.interval}, margin={self.margin:g}, prune={self.prune:g})")


def _takes(algorithm: str, compressor) -> bool:
    try:
        check_algorithm(algorithm, compressor)
    except ValueError:
        return False
    return True


_DEFAULTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DEFAULTS_LOCK = threading.Lock()


def default_for(group) -> AutoAlgorithm:
    """The :class:`AutoAlgorithm` that ``algorithm="auto"`` uses on ``group``
    (made on first use, default settings; it goes with its group)."""
    with _DEFAULTS_LOCK:
        found = _DEFAULTS.get(group)
        if found is None:
            found = _DEFAULTS[group] = AutoAlgorithm()
        return found
