"""Adaptive compression: each bucket moves to the codec predicted to train fastest.

``gc.ddp.GradCompState(compressor="auto")`` (or ``compressor=gc.Adaptive(...)``) and
``gc.allreduce(tensor, gc.Adaptive(...), key=...)`` pick, per bucket (per ``key`` for the
collective), the candidate with the least predicted time per unit of training progress: its
predicted step time (the compute, the wait for the last rank, and the communication the
compute does not hide: the codec's kernel cost plus a per-collective and a per-byte cost
fitted to measured collectives) times its convergence factor (:data:`CONVERGENCE`: steps to a
target accuracy relative to ``none``). It moves to heavier compression when the link slows,
back when it recovers; a link prior (``link=``) chooses the start.

Invariant: every rank decides from the same agreed numbers (one tiny allreduce per decision),
so every rank switches at the same step and the results stay bit-identical across ranks.
Residuals (error feedback; Seide et al. 2014, Karimireddy et al. 2019) are kept per parameter
or key whatever codec made them. Every switch is logged with the predictions it compared
(:attr:`Adaptive.switches`, :attr:`gradcomp.TrafficMeter.switches`).

The rule in full (what is measured, the agreement, the prediction and its cautions, the start
under a link prior, the model's limits): docs/adaptive.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp import catalog
from gradcomp.comm import DEFAULT_TIMEOUT, FLAT_DENSE_ALGORITHMS, allreduce, chunk_bounds, native
from gradcomp.comm.consensus import agree_max
from gradcomp.comm.policy import CodecPolicy
from gradcomp.compressors import Compressor, ErrorFeedback, NoCompression
from gradcomp.meter import TrafficMeter

__all__ = ["Adaptive", "Timing", "CANDIDATES", "CONVERGENCE", "DEFAULT_CANDIDATES",
           "choose", "fit_link", "start"]


#: candidate names (names of :mod:`gradcomp.catalog`) and the codec each one builds; the
#: policy keeps the residuals itself (``error_feedback``), whatever codec runs
CANDIDATES: dict[str, Callable[[], Compressor]] = {name: catalog.entry(name).build for name in (
    "none", "fp16", "bf16", "fp8", "fp8-e5m2", "int8", "int4", "int2", "sign", "topk", "topk-int8")}
#: the default ladder (fp8 and the sub-8-bit codecs only when named: no measured convergence factor)
DEFAULT_CANDIDATES = ("none", "fp16", "int8", "topk-int8")
#: steps to a target accuracy relative to uncompressed training, per named candidate (the
#: default ``convergence``); how they were measured: docs/results/adaptive.md#the-convergence-factors
CONVERGENCE: dict[str, float] = {"none": 1.0, "fp16": 1.0, "bf16": 1.0, "int8": 1.0, "topk": 1.47,
                                 "topk-int8": 1.47}
#: largest convergence factor accepted (and the inverse of the smallest): a step time
#: times a factor beyond it can overflow to inf (or flush to 0), which makes every
#: candidate's cost equal and the choice meaningless
MAX_CONVERGENCE = 1e6
#: the choice is the lightest candidate whose predicted cost (step time x convergence
#: factor) is within this fraction of the least one's (less compression for a small
#: loss of speed)
NEAR = 0.1
#: kernel timings per candidate when a bucket's kernels are timed (after one warm-up; the least)
KERNEL_REPEATS = 3
#: largest number of elements a kernel is timed on: a larger bucket's cost is scaled from it
#: (linear in the elements; top-k's sampled threshold makes its cost grow a little slower, so
#: its scaled cost errs high)
KERNEL_NUMEL = 1 << 18
#: a kernel cost timed on n elements is reused, scaled to the size, for a bucket of
#: n / KERNEL_REUSE to n x KERNEL_REUSE elements (e.g. after DDP rebuilds its buckets)
KERNEL_REUSE = 2.0
#: a codec's communication time changing by more than this factor since its last
#: measurement means the link changed: the other codecs' measurements are forgotten
CHANGE = 2.0
#: largest wait (decisions) before a lighter move after repeated reverts
MAX_PATIENCE = 64


@dataclass(frozen=True)
class Timing:
    """One measurement of one bucket (or key), as the ``timing`` hook sees it.

    Attributes:
        step: the step it belongs to (DDP: the state's step; collective: the
            number of earlier calls with this key).
        bucket: DDP bucket index, or the collective's ``key``.
        codec: the candidate's name.
        numel: elements reduced.
        wire_bytes: bytes this rank sent (its meter's count).
        comm_s: seconds of the collective.
        compute_s: seconds of compute it can hide behind (None when unknown:
            the first call, and for kernel timings).
        kind: ``"comm"`` for a collective; ``"kernel"`` for the local timing
            of the candidate's byte-independent cost at the bucket's first
            decision (``comm_s`` holds one compress + decompress of the
            bucket, ``wire_bytes`` is 0: nothing was sent).
    """

    step: int
    bucket: Hashable
    codec: str
    numel: int
    wire_bytes: int
    comm_s: float
    compute_s: float | None
    kind: str = "comm"


def fit_link(points: Sequence[tuple[float, float]], prior: tuple[float, float] | None = None
             ) -> tuple[float, float]:
    """The link's ``(alpha, beta)``: seconds per collective and per wire byte,
    from ``(wire bytes, seconds)`` measurements of codecs on that link.

    Least squares with both parts >= 0 (a negative slope means the bytes do
    not show in the times: all latency, the mean; a negative intercept: all
    bytes, the slope through the origin). With a single byte count, two
    parts cannot be fitted: the time is split as the ``prior`` ``(alpha0,
    beta0)`` splits it at that count (both scaled by the measured time over
    ``alpha0 + beta0 x bytes``), or, without a prior, taken as all per-byte
    (``alpha = 0``: the cautious reading for a move to a lighter codec).
    Counts of 0 bytes (nothing sent) are left out.
    """
    pts = [(b, max(0.0, t)) for b, t in points if b > 0]
    if not pts:
        return 0.0, 0.0
    xs = [b for b, _ in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(t for _, t in pts)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        if prior is not None and prior[0] + prior[1] * mx > 0:
            scale = my / (prior[0] + prior[1] * mx)
            return scale * prior[0], scale * prior[1]
        return 0.0, my / mx
    beta = sum((x - mx) * (t - my) for x, t in pts) / var
    if beta <= 0:
        return my, 0.0
    alpha = my - beta * mx
    if alpha < 0:
        return 0.0, sum(x * t for x, t in pts) / sum(x * x for x in xs)
    return alpha, beta


def choose(level: int, comm_s: float, compute_s: float, kernel_s: Sequence[float], nbytes: Sequence[float],
           seen: dict[int, float], convergence: Sequence[float], *, upper: float, lower: float,
           lighter_allowed: bool = True, sparse: Sequence[bool] | None = None,
           native: Sequence[bool] | None = None,
           link: tuple[float, float] | None = None, messages: Sequence[int] | None = None,
           wait_s: float = 0.0, after_start: bool = False
           ) -> tuple[int, list[dict[str, float]], tuple[float, float]]:
    """The ladder position the policy moves to, and the predictions behind it
    (see the module docstring for the rule).

    Args:
        level: current position (0 = lightest).
        comm_s: agreed communication seconds of the current codec (the smallest over the ranks).
        compute_s: agreed seconds of compute that can hide it.
        kernel_s: each position's byte-independent cost (seconds).
        nbytes: wire bytes per rank of each position (descending).
        seen: position -> its recently measured communication seconds (other positions).
        convergence: each position's steps to a target relative to uncompressed.
        upper, lower: the hiding bound and the caution of lighter moves (``lower < upper``).
        lighter_allowed: False while the policy waits after a heavier move:
            lighter positions are then chosen only when measured (in ``seen``).
        sparse: per position, whether it runs the sparse allgather (None: all
            alike). An unmeasured position is predicted from the link fitted
            to the measured positions of its own kind (the ring's and the
            allgather's per-collective costs differ), or to all measured
            positions when none of its kind is measured.
        native: per position, whether it runs the backend's allreduce (None:
            none does): a kind of its own, and, while not measured, predicted
            from the link prior alone when there is one (``messages x
            latency_s + bytes / bytes_per_s``, times ``upper / lower`` when
            lighter than ``level``).
        link, messages: optional link prior ``(latency_s, bytes_per_s)`` and
            each position's messages in sequence: where the measured
            positions of a kind share one byte count, the fit splits their
            time as ``messages x latency_s + bytes / bytes_per_s`` does
            (:func:`fit_link`'s ``prior``) instead of taking it all as per-byte.
        wait_s: agreed seconds an early rank waits for the last one in the
            collective (>= 0): part of every position's step, which no codec
            shortens, and which a codec that needs more steps pays more often.
        after_start: the current position was taken by the start under the
            link prior and nothing has been decided since: an unmeasured
            native position lighter than it is predicted without the
            caution factor (the caution keeps a heavier move that
            measurements made; the start's was the prior's alone).

    Returns:
        ``(position, predictions, (alpha, beta))``: the new position (``level``
        when nothing moves); per position, ``comm_s``, ``step_s`` and
        ``cost_s`` (predicted step seconds x convergence factor); the link's
        seconds per collective and per wire byte fitted to the measured
        codecs of the current position's kind (:func:`fit_link`).
    """
    measured = {**seen, level: comm_s}
    sparse = list(sparse) if sparse is not None else [False] * len(nbytes)
    native = list(native) if native is not None else [False] * len(nbytes)
    kind = ["native" if n else "sparse" if sp else "dense" for n, sp in zip(native, sparse)]

    def prior(j) -> tuple[float, float] | None:  # the link prior's (alpha, beta) for position j
        return None if link is None or messages is None else (messages[j] * link[0], 1 / link[1])

    def fit(positions) -> tuple[float, float]:
        positions = list(positions)
        points = [(nbytes[j], measured[j] - kernel_s[j]) for j in positions]
        return fit_link(points, prior(positions[0]) if positions else None)

    overall = fit(measured)
    fits = {k: fit([j for j in measured if kind[j] == k]) for k in {kind[j] for j in measured}}
    preds = []
    for j in range(len(nbytes)):
        if j in measured:
            comm = measured[j]
        else:
            if kind[j] in fits:
                alpha, beta = fits[kind[j]]
            elif native[j] and prior(j) is not None:  # the backend's allreduce, not measured yet
                alpha, beta = prior(j)
            else:
                alpha, beta = overall
            per_byte = nbytes[j] * beta
            cautious = j < level and not (after_start and native[j])
            comm = kernel_s[j] + alpha + (per_byte * upper / lower if cautious else per_byte)
        step = compute_s + wait_s + max(0.0, comm - upper * compute_s)
        preds.append({"comm_s": comm, "step_s": step, "cost_s": step * convergence[j]})
    # a lighter codec is a candidate while it is predicted only (and lighter moves are
    # allowed), or measured at no more than the current codec's cost: two measured codecs
    # within the noise of each other do not trade places at every decision
    allowed = [j for j in range(len(nbytes))
               if j >= level or (j in measured and preds[j]["cost_s"] <= preds[level]["cost_s"])
               or (j not in measured and lighter_allowed)]
    if native[level]:
        # off the backend's allreduce to a kind nothing of which is measured: predicted from
        # the backend's allreduce (or the prior), which describes neither gradcomp's hops
        # nor their kernels, so such a move needs a gain beyond the predictions' caution
        allowed = [j for j in allowed if j <= level or kind[j] in fits
                   or preds[j]["cost_s"] * upper / lower <= preds[level]["cost_s"]]
    best = min(preds[j]["cost_s"] for j in allowed)
    new = next(j for j in allowed if preds[j]["cost_s"] <= (1 + NEAR) * best)
    if new > level and new not in measured:
        # a heavier move on predictions alone to a codec that converges slower stops at
        # the first unmeasured codec on the way that converges faster and whose predicted
        # cost is within the predictions' uncertainty (upper / lower) of the best: it is
        # measured before the slower-converging codec's predicted speed is trusted
        new = next(j for j in range(level + 1, new + 1)
                   if j == new or (j in allowed and j not in measured and convergence[j] < convergence[new]
                                   and preds[j]["cost_s"] <= upper / lower * best))
    return new, preds, fits[kind[level]]


def start(kernel_s: Sequence[float], nbytes: Sequence[float], messages: Sequence[int],
          convergence: Sequence[float], latency_s: float, bytes_per_s: float, *,
          native: Sequence[bool] | None = None, caution: float = 1.0) -> tuple[int, list[dict[str, float]]]:
    """The ladder position a bucket starts on under a link prior (see
    :class:`Adaptive`'s ``link``), before anything of it is measured.

    Predicted communication of position ``j``: ``T_j = kernel_s[j] +
    messages[j] x latency_s + nbytes[j] / bytes_per_s``. The compute that could
    hide it is not known yet, and it weighs against a codec that needs more
    steps (a longer step times a larger factor), so only the positions with the
    least convergence factor compete; the start is the lightest of them whose
    ``T`` is within :data:`NEAR` of the least ``T`` (the first decision, with
    the compute measured, then weighs the slower-converging codecs). A position
    on the backend's allreduce (``native``) is within ``max(1 + NEAR,
    caution)`` of the least ``T``: the prior, a ping-pong of gradcomp's
    point-to-point messages, describes neither the backend's collective nor the
    ring's per-hop kernels, so the start leaves the backend's collective only
    for a predicted gain beyond the predictions' caution.

    The choice does not decrease in any non-native ``kernel_s``: where it is a
    native position with those costs taken as 0, it is that position whatever
    they are.

    Args:
        kernel_s: each position's byte-independent cost (seconds).
        nbytes: wire bytes per rank of each position (descending).
        messages: point-to-point messages in sequence per collective of each position.
        convergence: each position's steps to a target relative to uncompressed.
        latency_s: the prior's seconds per message (>= 0).
        bytes_per_s: the prior's bytes per second (> 0).
        native: per position, whether it runs the backend's allreduce (None: none does).
        caution: the factor (>= 1) by which a native position's ``T`` may
            exceed the least (``Adaptive`` passes ``upper / lower``).

    Returns:
        ``(position, predictions)``: per position ``comm_s`` (``T_j``).
    """
    preds = [{"comm_s": k + m * latency_s + b / bytes_per_s}
             for k, b, m in zip(kernel_s, nbytes, messages)]
    native = list(native) if native is not None else [False] * len(nbytes)
    fastest = min(convergence)
    eligible = [j for j, f in enumerate(convergence) if f == fastest]
    best = min(preds[j]["comm_s"] for j in eligible)
    within = [max(1 + NEAR, caution) if native[j] else 1 + NEAR for j in range(len(nbytes))]
    return next(j for j in eligible if preds[j]["comm_s"] <= within[j] * best), preds


class _Track:
    """The policy's state for one bucket (or key)."""

    # decision number of the last heavier move, and the wait before it; the bucket's dtype
    # (class defaults, so that a track pickled before these fields existed has them too)
    last_heavier = (-2, 0)
    from_start = False  # the current position is the start's, and nothing was decided since
    dtype = torch.float32
    native: list[bool] | None = None  # per position: on the backend's allreduce (set by the policy)

    def __init__(self, bucket: Hashable, numel: int, ladder: list[int], nbytes: list[int], messages: list[int],
                 patience: int, window: int):
        self.bucket, self.numel, self.ladder, self.nbytes, self.messages = bucket, numel, ladder, nbytes, messages
        self.level = 0
        self.started = False  # the start under a link prior was taken
        self.window = window  # samples before the next decision
        self.changed = True  # the next call checks the ranks' arguments (a new codec)
        self.samples: list[tuple[float, float, float]] = []  # (comm_s, compute_s, exposed_s)
        self.seen: dict[int, tuple[float, int]] = {}  # position -> (comm_s, decision number)
        self.kernel: list[float] | None = None  # agreed byte-independent cost per position (seconds)
        self.hold = 0
        self.patience = patience
        self.last_lighter = -2  # decision number of the last lighter move

    def hysteresis(self, new: int, number: int, base: int) -> bool:
        """Update the wait before lighter moves for a decision (number
        ``number``) that moves to ``new``; returns whether it moves."""
        after_lighter = number - self.last_lighter == 1  # the first decision after a lighter move
        if new > self.level:
            if after_lighter:  # it is undone at once: wait longer before the next one
                self.patience = min(MAX_PATIENCE, max(1, 2 * self.patience))
            self.last_heavier = (number, self.hold)
            self.hold = self.patience
            return True
        if after_lighter:
            self.patience = base  # it held
        if new == self.level:
            self.hold = max(0, self.hold - 1)
            return False
        if number - self.last_heavier[0] == 1:
            # a heavier move its own measurement refuted at once said nothing of the link:
            # it leaves no wait (the wait is what it was before it)
            self.hold = self.last_heavier[1]
        self.last_lighter = number
        return True

    @property
    def candidate(self) -> int:
        return self.ladder[self.level]


@dataclass
class _Ticket:
    """A DDP bucket handed over to the communication thread."""

    step: int
    bucket: int
    numel: int
    handed: float


class Adaptive(CodecPolicy):
    """Adaptive codec policy: per bucket, the codec with the least predicted
    time per unit of progress (step time x convergence factor; see the module
    docstring for what is measured, the rule, and how every rank reaches the
    same decision).

    Use it as ``GradCompState(compressor="auto")`` /
    ``GradCompState(compressor=gc.Adaptive(...), algorithm="ring")`` (the
    state's ``algorithm`` carries the dense candidates, sparse ones use
    ``"allgather"``; the state's ``error_feedback`` decides on residuals), or
    as the compressor of :func:`gradcomp.allreduce` (see :meth:`allreduce`).
    One instance per state or per group of keys: it counts steps per bucket.

    Args:
        candidates: names from :data:`CANDIDATES` (``"none"``, ``"fp16"``, ``"bf16"``,
            ``"fp8"``, ``"fp8-e5m2"``, ``"int8"``, ``"int4"``, ``"int2"``, ``"sign"``,
            ``"topk"``, ``"topk-int8"``: top-k 1%, float32 or int8 values) and/or gradcomp compressors with a fixed
            wire size (not ErrorFeedback); at least one, no repeats. Their
            order does not matter: each bucket ranks them by wire bytes.
        convergence: optional mapping candidate name -> steps to a target
            accuracy relative to uncompressed training (in [1e-6, 1e6]), overriding
            :data:`CONVERGENCE` (whose factors it keeps for the names it does not
            give; a compressor instance, named by its ``repr``, defaults to 1).
        interval: steps (calls per key) between decisions (>= 1).
        probe: steps (calls per key) measured at the start and after a switch
            before the next decision (>= 1).
        upper: communication up to ``upper`` x the compute counts as hidden (> 0).
        lower: caution of lighter moves: an unmeasured lighter codec's
            predicted link time is multiplied by ``upper / lower``
            (0 < lower < upper).
        patience: decisions to wait before a lighter move after a heavier one (>= 0).
        memory: decisions for which a codec's measured communication time is
            trusted over the prediction (>= 0).
        link: optional prior for the link, ``(latency_s, bytes_per_s)``:
            seconds per point-to-point message and bytes per second, e.g. the
            ``alpha_s`` and ``beta_bytes_per_s`` of a ``gradcomp plan
            calibrate`` profile of this link. With it, a bucket does not start
            on the lightest codec: before its first collective it starts on
            the codec :func:`start` predicts fastest among those that converge
            fastest (timing its kernels unless that is ``none`` whatever they
            cost; logged as a switch with ``"start": True``); the measurements
            take over from the first decision. None: start on the lightest.
        error_feedback: the collective keeps a residual per key for lossy
            codecs when no ``residual`` is given (a GradCompState follows its
            own ``error_feedback``).
        clock: zero-argument callable returning seconds (default ``time.perf_counter``).
        timing: optional ``Timing -> Timing`` hook applied to every measurement.
        objective: ``"step"`` (the rule above) or ``"exchange"``: the candidates of the least
            convergence factor ranked by their exchange seconds alone, for a caller that sets how
            often the exchange runs (``gradcomp.LocalSGD`` with an adaptive period; docs/local-sgd.md);
            without a ``link`` prior a new bucket then starts on the candidate of the fewest wire
            bytes among those of the least convergence factor.

    Attributes:
        candidates: the compressors; names: their names (``repr`` for instances).
        convergence: the convergence factor of each candidate (tuple, in
            the order of ``candidates``).
        switches: every switch made, oldest first (JSON-ready dicts: ``step``,
            ``bucket``, ``numel``, ``from``, ``to``, ``comm_s`` (the
            smallest over the ranks), ``wait_s`` (the largest minus it),
            ``compute_s``, ``exposed_s``, all agreed across ranks, ``rho =
            comm_s / compute_s``,
            ``latency_s`` and ``s_per_byte`` (the fitted link) and
            ``predicted``: per candidate name, ``wire_bytes``, ``kernel_s``,
            ``comm_s``, ``step_s``, ``cost_s`` and ``convergence``, the
            numbers the decision compared).
        decisions: decisions taken so far.

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
    """

    def __init__(
        self,
        candidates: Sequence[str | Compressor] = DEFAULT_CANDIDATES,
        *,
        convergence: Mapping[str, float] | None = None,
        interval: int = 10,
        probe: int = 3,
        upper: float = 1.0,
        lower: float = 0.5,
        patience: int = 2,
        memory: int = 10,
        link: tuple[float, float] | None = None,
        error_feedback: bool = True,
        clock: Callable[[], float] | None = None,
        timing: Callable[[Timing], Timing] | None = None,
        objective: str = "step",
    ):
        self.candidates, self.names = _candidates(candidates)
        self.convergence = _convergence(convergence, self.names)
        self.link = _link_prior(link)
        self.interval, self.probe = v.integer("interval", interval, 1), v.integer("probe", probe, 1)
        self.upper, self.lower = v.real("upper", upper), v.real("lower", lower)
        if not (math.isfinite(self.upper) and self.upper > 0):
            raise ValueError(f"upper must be a finite number > 0, got {upper!r}")
        if not 0 < self.lower < self.upper:
            raise ValueError(f"lower must be > 0 and < upper ({self.upper:g}), got {lower!r}")
        self.patience, self.memory = v.integer("patience", patience, 0, MAX_PATIENCE), v.integer("memory", memory, 0)
        self.error_feedback = v.flag("error_feedback", error_feedback)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds or None, got {type(clock).__name__}")
        if timing is not None and not callable(timing):
            raise TypeError(f"timing must be a callable Timing -> Timing or None, got {type(timing).__name__}")
        self.clock = clock if clock is not None else time.perf_counter
        self.timing, self.objective = timing, v.choice("objective", objective, ("step", "exchange"))
        self.switches, self.decisions = [], 0  # every switch made; decisions taken so far
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self._cleared: dict[Hashable, tuple[torch.Tensor, int]] = {}  # bucket -> (residual, version) zeroed natively
        self._tracks: dict[Hashable, _Track] = {}
        self._kernel_times: dict[int, dict[int, float]] = {}  # candidate -> {numel: agreed s} timed
        self._step: int | None = None  # DDP step bookkeeping (communication thread)
        self._free: float | None = None  # when the training thread last handed over / was released
        self._in_step: list[tuple[_Track, Timing, float]] = []  # (track, sample, end) of the open step
        # collective bookkeeping: key -> (calls, end of the last call)
        self._calls: dict[Hashable, tuple[int, float]] = {}

    # ---- public ----------------------------------------------------------------
    @property
    def lossy(self) -> bool:
        """Some candidate is lossy (error feedback has something to remember)."""
        return any(c.lossy for c in self.candidates)

    def codec(self, bucket: Hashable) -> str | None:
        """The name of the codec ``bucket`` (DDP bucket index or key) uses now, or None."""
        t = self._tracks.get(bucket)
        return None if t is None else self.names[t.candidate]

    def allreduce(self, tensor: torch.Tensor, *, op: str = "avg", algorithm: str = "ring", group=None,
                  meter: TrafficMeter | None = None, timeout: float = DEFAULT_TIMEOUT,
                  key: Hashable = None, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, check: bool = True, tag=None) -> torch.Tensor:
        """:func:`gradcomp.allreduce` with the codec this policy picks for ``key``.

        ``gc.allreduce(tensor, policy, key=k, ...)`` calls this. Every rank of
        ``group`` must call it with the same keys in the same order (like any
        collective); every ``interval`` calls of a key, that call first agrees
        on the key's timings (one float64 allreduce of 4 values; at the first
        decision that needs them, a second one of the kernel costs, timed then).
        Between two calls of a key, the caller's time counts as the compute
        the communication could hide behind.

        Args:
            tensor, op, group, meter, timeout, out, check, tag: as for :func:`gradcomp.allreduce`.
            algorithm: for the dense candidates, ``"ring"`` or ``"two_phase"``
                (sparse candidates always use ``"allgather"``).
            key: the tensor's identity across calls (statistics, codec and residual).
            residual: optional flat float32 memory as for
                :func:`gradcomp.allreduce`; without it and with
                ``error_feedback``, the policy keeps one per key.

        Returns:
            The reduced tensor (bit-identical on every rank).

        Raises:
            ValueError: ``algorithm`` is not a dense algorithm; anything
                :func:`gradcomp.allreduce` raises.
        """
        v.choice("algorithm", algorithm, FLAT_DENSE_ALGORITHMS)
        v.key(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a dense torch.Tensor, got {type(tensor).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("gradcomp.allreduce needs torch.distributed initialised "
                               "(dist.init_process_group or gradcomp.launch)")
        group = dist.group.WORLD if group is None else group
        self.agree(group, timeout=timeout, device=tensor.device, meter=meter)  # once per group
        began = self.clock()
        calls, last_end = self._calls.get(key, (0, None))
        track = self._track(key, tensor.numel(), dist.get_world_size(group), algorithm, tensor.dtype)
        if self.link is not None and not track.started:
            self._start(track, group, timeout, tensor.device, calls, meter)
        if len(track.samples) >= track.window:
            self._decide([track], group, timeout, tensor.device, calls, meter)
        if residual is None and self.error_feedback and self.lossy:
            residual = self._residual(key, tensor)
        compute = began - last_end if last_end is not None else None
        result, sample = self._run(track, tensor, calls, compute, op=op, algorithm=algorithm, group=group, tag=tag,
                                   meter=meter, timeout=timeout, residual=residual, out=out, check=check)
        if sample.compute_s is not None:
            track.samples.append((sample.comm_s, sample.compute_s, sample.comm_s))
        self._calls[key] = (calls + 1, self.clock())
        return result

    def settings(self) -> dict:  # what decides the codecs (CodecPolicy.settings)
        return {("candidates" if n == "names" else n): getattr(self, n) for n in (
            "names", "link", "interval", "probe", "upper", "lower", "patience", "memory", "convergence")}

    # ---- DDP hook side (gradcomp.ddp) ---------------------------------------------
    def ticket(self, step: int, bucket: int, numel: int) -> _Ticket:
        """Note a bucket's handover (training thread)."""
        return _Ticket(step, bucket, numel, self.clock())

    def reduce_bucket(self, ticket: _Ticket, buf: torch.Tensor, residual: torch.Tensor | None, *,
                      algorithm: str, group, meter: TrafficMeter | None, timeout: float, tag=None) -> None:
        """Average ``buf`` in place with the bucket's codec (communication thread,
        buckets in DDP's order, the same on every rank; ``tag`` as for :func:`gradcomp.allreduce`)."""
        if ticket.step != self._step:
            self._close_step()
            self._step = ticket.step
            # due once a bucket holds its window of measurements (a step without a compute
            # time, the first, holds none); buckets gone after a rebuild hold no samples
            if any(len(t.samples) >= t.window for t in self._tracks.values()):
                self._decide(list(self._tracks.values()), group, timeout, buf.device, ticket.step, meter)
        track = self._track(ticket.bucket, ticket.numel, dist.get_world_size(group), algorithm, buf.dtype)
        if self.link is not None and not track.started:
            self._start(track, group, timeout, buf.device, ticket.step, meter)
        compute = ticket.handed - self._free if self._free is not None else None
        self._free = ticket.handed
        _, sample = self._run(track, buf, ticket.step, compute, op="avg", algorithm=algorithm, group=group, tag=tag,
                              meter=meter, timeout=timeout, residual=residual, out=buf, check=track.changed)
        self._in_step.append((track, sample, self.clock()))

    def _close_step(self) -> None:
        """File the open step's samples with the exposed time of each bucket."""
        if not self._in_step:
            return
        last_handed = self._free
        prev_end = -math.inf
        for track, sample, end in self._in_step:
            exposed = max(0.0, end - max(last_handed, prev_end))
            prev_end = end
            if sample.compute_s is not None:
                track.samples.append((sample.comm_s, sample.compute_s, exposed))
        self._free = max(last_handed, prev_end)  # DDP's wait for the step returned
        self._in_step = []

    # ---- shared -----------------------------------------------------------------
    def _track(self, bucket: Hashable, numel: int, world: int, algorithm: str,
               dtype: torch.dtype = torch.float32) -> _Track:
        t = self._tracks.get(bucket)
        if t is None or t.numel != numel or t.dtype != dtype:  # new, or DDP rebuilt its buckets
            sizes = [_wire_bytes(c, numel, world, dtype) for c in self.candidates]
            ladder = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
            # messages in sequence: ring / two-phase 2 (N - 1), the sparse allgather N - 1
            messages = [(world - 1) * (1 if self.candidates[i].sparse else 2) for i in ladder]
            t = self._tracks[bucket] = _Track(bucket, numel, ladder, [sizes[i] for i in ladder], messages,
                                              self.patience, self.probe)
            t.dtype = dtype
            if self.objective == "exchange" and self.link is None:  # the fewest bytes of the least factor
                least = min(self.convergence[i] for i in ladder)
                t.level = max(j for j, i in enumerate(ladder) if self.convergence[i] == least)
        return t

    def _residual(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(key)
        if r is None or r.numel() != tensor.numel() or r.device != tensor.device:
            r = self.residuals[key] = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
        return r

    def _run(self, track: _Track, tensor, step, compute, *, op, algorithm, group, meter, timeout, residual,
             out, check, tag):
        comp = self.candidates[track.candidate]
        alg = "allgather" if comp.sparse else algorithm
        own = TrafficMeter()
        t0 = self.clock()
        if self._natives(track)[track.level]:
            # a residual this codec zeroed last time, unwritten since, adds nothing: skip its add and zero
            cleared = self._cleared.get(track.bucket)
            known_zero = residual is not None and cleared is not None and cleared[0] is residual \
                and cleared[1] == residual._version
            due = None if known_zero else residual
            if not check and out is tensor and tensor.dim() == 1 and tensor.is_contiguous():
                # a DDP bucket (flat, in place, checked at its last switch): the unchecked core
                result = native.reduce_(tensor, due, op=op, group=group, timeout=timeout, meter=meter)
                own = None
            else:
                result = native.allreduce(tensor, op=op, group=group, meter=own, timeout=timeout,
                                          residual=due, out=out, check=check, tag=tag)
            if residual is not None:
                self._cleared[track.bucket] = (residual, residual._version)
        else:
            # a lossy codec's kernels write the residual without bumping its version counter
            self._cleared.pop(track.bucket, None)
            result = allreduce(tensor, comp, op=op, algorithm=alg, group=group, meter=own, timeout=timeout,
                               residual=residual, out=out, check=check, tag=tag)
        comm_s = self.clock() - t0
        wire = (own.bytes_sent if own is not None
                else native.sent_bytes(track.numel, dist.get_world_size(group), dist.get_rank(group)))
        sample = Timing(step=step, bucket=track.bucket, codec=self.names[track.candidate],
                        numel=track.numel, wire_bytes=wire, comm_s=comm_s, compute_s=compute)
        track.changed = False
        sample = self._hooked(sample)
        if meter is not None and own is not None:
            meter.merge(own)
        return result, sample

    def _decide(self, tracks: list[_Track], group, timeout: float, device, step: int,
                meter: TrafficMeter | None) -> None:
        """Agree on the window's timings over ``group`` and move each track.

        A track whose kernels are not timed yet is decided with every kernel
        cost taken as 0 first: on the backend's allreduce (no kernel), with
        nothing lighter, a stay with those costs is a stay whatever they are
        (a heavier codec's predicted cost only grows with its kernels). Only
        otherwise are its kernels timed, and agreed in a second allreduce."""
        tracks = [t for t in tracks if t.samples]
        if not tracks:
            return
        local = []
        for t in tracks:
            comm, compute, exposed = (statistics.median(col) for col in zip(*t.samples))
            local += [-comm, comm, -compute, exposed]
        agreed = _agree(local, group, timeout, device)
        number = self.decisions
        self.decisions += 1
        decided, untimed = [], []
        for at, t in zip(range(0, len(agreed), 4), tracks):
            # the last rank to arrive measures the collective without a wait for a late peer
            comm, wait = -agreed[at], agreed[at + 1] + agreed[at]
            wait = wait if math.isfinite(wait) and wait > 0 else 0.0  # inf - inf: a hook's infinite times
            compute, exposed = -agreed[at + 2], agreed[at + 3]
            t.samples = []
            t.window = self.interval
            before = t.seen.get(t.level)
            if before is not None and not before[0] / CHANGE <= comm <= before[0] * CHANGE:
                t.seen = {}  # the link (or the load) changed: older measurements of other codecs mislead
            t.seen[t.level] = (comm, number)
            seen = {j: c for j, (c, at_) in t.seen.items() if j != t.level and number - at_ <= self.memory}
            window = (t, comm, compute, exposed, wait, seen)
            if t.kernel is not None:
                decided.append((window, t.kernel, None))
                continue
            zero = [0.0] * len(t.ladder)
            bound = (self._choose(t, comm, compute, wait, seen, zero) if t.level == 0 and self._natives(t)[0]
                     else None)
            if bound is not None and bound[0] == 0:  # a stay whatever the kernels cost
                decided.append((window, zero, bound))
            else:
                untimed.append(window)
        if untimed:
            local = [k for t, *_ in untimed for k in self._kernels(t, step, device)]
            kernels, at = _agree(local, group, timeout, device), 0
            for window in untimed:
                t = window[0]
                t.kernel = self._kept_kernels(t, kernels[at:at + len(t.ladder)])
                at += len(t.ladder)
                decided.append((window, t.kernel, None))
        for (t, comm, compute, exposed, wait, seen), kernel, chosen in decided:
            new, preds, (alpha, beta) = chosen or self._choose(t, comm, compute, wait, seen, kernel)
            t.from_start = False
            if not t.hysteresis(new, number, self.patience):
                continue
            rho = comm / compute if compute > 0 else math.inf
            self._switch(t, new, step, preds, meter, kernel, rho=rho, comm_s=comm, compute_s=compute, exposed_s=exposed,
                         wait_s=wait, latency_s=alpha, s_per_byte=beta, objective=self.objective)

    def _choose(self, t: _Track, comm: float, compute: float, wait: float, seen: dict[int, float],
                kernel: list[float]):
        """:func:`choose` for ``t``'s agreed window with these kernel costs (and the objective)."""
        conv = [self.convergence[i] for i in t.ladder]
        if self.objective == "exchange":  # step = the exchange; a slower-converging candidate is left out
            compute, wait, conv = 0.0, 0.0, [1.0 if c == min(conv) else MAX_CONVERGENCE ** 2 for c in conv]
        return choose(t.level, comm, compute, kernel, t.nbytes, seen, conv,
                      upper=self.upper, lower=self.lower, lighter_allowed=t.hold == 0,
                      sparse=[self.candidates[i].sparse for i in t.ladder], native=self._natives(t),
                      link=self.link, messages=t.messages, wait_s=wait, after_start=t.from_start)

    def _start(self, t: _Track, group, timeout: float, device, step: int, meter: TrafficMeter | None) -> None:
        """Under a link prior, move ``t`` to the position :func:`start` predicts,
        before its first collective. Its kernels are timed (agreed with ``MAX``)
        unless the start is the backend's allreduce with every kernel cost
        taken as 0 (then it is whatever they cost: they are timed when a
        decision needs them)."""
        t.started = True
        latency_s, bytes_per_s = self.link
        native = self._natives(t)

        def predict(kernel):
            return start(kernel, t.nbytes, t.messages, [self.convergence[i] for i in t.ladder],
                         latency_s, bytes_per_s, native=native, caution=self.upper / self.lower)

        new, preds = predict([0.0] * len(t.ladder))
        if not native[new]:
            t.kernel = self._kept_kernels(t, _agree(self._kernels(t, step, device), group, timeout, device))
            new, preds = predict(t.kernel)
        kernel = t.kernel if t.kernel is not None else [0.0] * len(t.ladder)
        if new != t.level:
            self._switch(t, new, step, preds, meter, kernel, start=True, prior_latency_s=latency_s,
                         prior_bytes_per_s=bytes_per_s)
            t.from_start = True

    def _natives(self, t: _Track) -> list[bool]:
        """Per ladder position of ``t``, whether it runs the backend's allreduce
        (computed once per track)."""
        if t.native is None:
            t.native = [_native(self.candidates[i], t.dtype) for i in t.ladder]
        return t.native

    def _switch(self, t: _Track, new: int, step: int, preds: list[dict], meter: TrafficMeter | None,
                kernel: list[float], **fields) -> None:
        """Move ``t`` to ladder position ``new`` and log the switch (``fields``
        and the predictions of every candidate, made with ``kernel``) here and
        in ``meter``."""
        predicted = {self.names[i]: {"wire_bytes": t.nbytes[j], "kernel_s": kernel[j], **preds[j],
                                     "convergence": self.convergence[i]}
                     for j, i in enumerate(t.ladder)}
        entry = {"step": step, "bucket": t.bucket if isinstance(t.bucket, (int, str)) else repr(t.bucket),
                 "numel": t.numel, "from": self.names[t.candidate], "to": self.names[t.ladder[new]],
                 **fields, "predicted": predicted}
        t.level = new
        t.changed = True
        t.window = self.probe
        self.switches.append(entry)
        if meter is not None:
            meter.record_switch(entry)

    def _reused(self, t: _Track, i: int) -> float | None:
        """Candidate ``i``'s agreed kernel cost scaled to ``t``'s size from a
        bucket timed within :data:`KERNEL_REUSE` x that size (None: time it)."""
        near = [(abs(math.log(n / t.numel)), n, k) for n, k in self._kernel_times.get(i, {}).items()
                 if t.numel and n / KERNEL_REUSE <= t.numel <= n * KERNEL_REUSE]
        if not near:
            return None
        _, n, k = min(near)
        return k * t.numel / n

    def _kept_kernels(self, t: _Track, agreed: list[float]) -> list[float]:
        """Keep the agreed kernel costs timed for ``t`` (not the reused ones) for reuse."""
        for i, k in zip(t.ladder, agreed):
            if t.numel and self._reused(t, i) is None:
                self._kernel_times.setdefault(i, {})[t.numel] = k
        return agreed

    def _kernels(self, t: _Track, step: int, device) -> list[float]:
        """This rank's byte-independent cost of each ladder position for
        ``t``'s size: reused (:meth:`_reused`, identical on every rank) or
        timed through the ``timing`` hook (``kind="kernel"``)."""
        out = []
        bucket = None  # one input shared by the candidates timed
        timed = min(t.numel, KERNEL_NUMEL)
        for i, native_ in zip(t.ladder, self._natives(t)):
            if native_:  # the backend's allreduce runs no codec kernel
                out.append(0.0)
                continue
            reused = self._reused(t, i)
            if reused is not None:
                out.append(reused)
                continue
            if bucket is None:
                bucket = _kernel_input(timed, device)
            seconds = _kernel_seconds(self.candidates[i], *bucket, self.clock) * (t.numel / timed if timed else 1)
            sample = Timing(step=step, bucket=t.bucket, codec=self.names[i], numel=t.numel, wire_bytes=0,
                            comm_s=seconds, compute_s=None, kind="kernel")
            out.append(self._hooked(sample).comm_s)
        return out

    def _hooked(self, sample: Timing) -> Timing:
        if self.timing is None:
            return sample
        sample = self.timing(sample)
        if not isinstance(sample, Timing):
            raise TypeError(f"timing must return a gradcomp.adaptive.Timing, got {type(sample).__name__}")
        return sample

    def __getstate__(self) -> dict:
        """Everything but the ``clock`` and ``timing`` hooks (runtime, like a
        process group: the restored policy uses ``time.perf_counter`` and no
        hook) and the timings of an open step."""
        state = self.__dict__.copy()
        state["clock"] = time.perf_counter
        state["timing"] = None
        state["residuals"] = {k: r.detach().cpu().clone() for k, r in self.residuals.items()}
        state["_in_step"] = []  # an open step's timings mean nothing in another process
        state["_step"] = state["_free"] = None
        state["_calls"] = {}
        state["_cleared"] = {}  # the restored residuals are other tensors
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_cleared", {})  # a policy pickled before this field existed

    def __repr__(self) -> str:
        conv = dict(zip(self.names, self.convergence))
        return (f"Adaptive(candidates={self.names!r}, convergence={conv!r}, interval={self.interval}, "
                f"probe={self.probe}, upper={self.upper:g}, lower={self.lower:g}, patience={self.patience}, "
                f"link={self.link!r})")


def _agree(local: list[float], group, timeout: float, device) -> list[float]:
    """The element-wise ``MAX`` of ``local`` over ``group``'s ranks (one float64 allreduce)."""
    return agree_max(local, group, timeout, device, "gradcomp.Adaptive")


def _link_prior(link) -> tuple[float, float] | None:
    if link is None:
        return None
    if isinstance(link, (str, bytes)) or not isinstance(link, Sequence) or len(link) != 2:
        raise TypeError(f"link must be None or a pair (latency_s, bytes_per_s), got {link!r}")
    latency_s, bytes_per_s = v.real("link[0] (latency_s)", link[0]), v.real("link[1] (bytes_per_s)", link[1])
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise ValueError(f"link[0] (latency_s, seconds per message) must be a finite number >= 0, got {latency_s!r}")
    if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
        raise ValueError(f"link[1] (bytes_per_s) must be a finite number > 0, got {bytes_per_s!r}")
    return latency_s, bytes_per_s


def _candidates(candidates) -> tuple[tuple[Compressor, ...], tuple[str, ...]]:
    if isinstance(candidates, (str, Compressor)) or not isinstance(candidates, Sequence):
        raise TypeError(f"candidates must be a sequence of names {tuple(CANDIDATES)} and/or gradcomp "
                        f"compressors, got {type(candidates).__name__}")
    if not candidates:
        raise ValueError(f"candidates must not be empty; names: {tuple(CANDIDATES)}")
    comps, names = [], []
    for c in candidates:
        if isinstance(c, str):
            if c not in CANDIDATES:
                raise ValueError(f"candidates: unknown name {c!r}; allowed: {tuple(CANDIDATES)}")
            comps.append(CANDIDATES[c]())
            names.append(c)
        elif isinstance(c, ErrorFeedback):
            raise ValueError("candidates must not hold an ErrorFeedback: residuals are kept per "
                             "parameter or key across codecs; pass the compressor itself")
        elif isinstance(c, Compressor):
            if _wire_bytes(c, 1 << 20, 2) is None:
                raise ValueError(f"candidates need a fixed wire size (to rank them by bytes), got {c!r}")
            comps.append(c)
            names.append(repr(c))
        else:
            raise TypeError(f"candidates must hold names {tuple(CANDIDATES)} or gradcomp compressors, "
                            f"got {type(c).__name__}")
    if len(set(names)) != len(names):
        raise ValueError(f"candidates must not repeat, got {names}")
    return tuple(comps), tuple(names)


def _convergence(convergence, names: tuple[str, ...]) -> tuple[float, ...]:
    if convergence is None:
        convergence = {}
    if not isinstance(convergence, Mapping):
        raise TypeError(f"convergence must be a mapping candidate name -> steps to a target relative to "
                        f"uncompressed, or None, got {type(convergence).__name__}")
    unknown = [k for k in convergence if k not in names]
    if unknown:
        raise ValueError(f"convergence: unknown candidate {unknown[0]!r}; allowed: {names}")
    out = []
    for name in names:
        f = v.real(f"convergence[{name!r}]", convergence.get(name, CONVERGENCE.get(name, 1.0)))
        if not 1 / MAX_CONVERGENCE <= f <= MAX_CONVERGENCE:
            raise ValueError(f"convergence[{name!r}] must be a finite number > 0, in "
                             f"[{1 / MAX_CONVERGENCE:g}, {MAX_CONVERGENCE:g}] (steps to a target "
                             f"relative to uncompressed), got {f!r}")
        out.append(f)
    return tuple(out)


def _kernel_input(numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded standard-normal float32 bucket of ``numel`` elements on
    ``device`` and a zero accumulator of its shape."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
    return x, torch.zeros_like(x)


def _kernel_seconds(comp: Compressor, x: torch.Tensor, acc: torch.Tensor, clock: Callable[[], float]) -> float:
    """Least seconds of one ``comp.compress(x)`` + ``decompress_add_`` into
    ``acc`` over :data:`KERNEL_REPEATS` runs after one warm-up (a run that
    another process preempts only takes longer)."""
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.is_cuda else (lambda: None)
    times = []
    for _ in range(KERNEL_REPEATS + 1):
        sync()
        t0 = clock()
        comp.decompress_add_(comp.compress(x), acc)
        sync()
        times.append(clock() - t0)
    return min(times[1:])


def _native(comp: Compressor, dtype: torch.dtype = torch.float32) -> bool:
    """``comp`` runs on the backend's own allreduce (:mod:`gradcomp.comm.native`)
    for a bucket of ``dtype``: uncompressed float32 gains nothing from
    gradcomp's ring (a float16 / bfloat16 bucket's ``none`` runs the ring)."""
    return type(comp) is NoCompression and dtype == torch.float32


def _wire_bytes(comp: Compressor, numel: int, world: int, dtype: torch.dtype = torch.float32) -> int | None:
    """Bytes one rank sends to reduce ``numel`` elements of ``dtype`` over
    ``world`` ranks with ``comp``."""
    if world < 2:
        return 0
    if _native(comp, dtype):  # the float32 ring's, without payload headers
        return 2 * (world - 1) * 4 * numel // world
    if comp.sparse:
        one = comp.wire_nbytes((numel,))
        return None if one is None else (world - 1) * one
    chunks = [comp.wire_nbytes((hi - lo,)) for lo, hi in chunk_bounds(numel, world)]
    if any(c is None for c in chunks):
        return None
    return 2 * (world - 1) * sum(chunks) // world
