"""The local SGD period ``H``, chosen online from what each round measured.

``gc.LocalSGD(model, sync_every="auto")`` (or ``sync_every=gc.SyncPeriod(...)``) starts
synchronous (``H = min_sync_every``) and, at a synchronisation every window of inner steps,
sets the period: the one of the least modelled time to a target, ``sqrt((1 - a) comm / (a x
compute))`` for a period cost ``a`` (or, given ``comm_share``, the period that holds the
exchange at that share of a round), so a slow link raises ``H``, a fast one lowers it
(``H = 1``: synchronous training), times AdaComm's loss factor (Wang and Joshi 2019: ``H``
shrinks with the square root of the loss) where the workers' models measurably diverge
(:func:`loss_factor`, :func:`choose_period`). Invariant: every rank decides from the same
agreed numbers (one float64 allreduce per decision, four values per round), so every rank
moves at the same step and the parameters stay bit-identical. Every move is logged with its
reason (:attr:`SyncPeriod.switches`, :attr:`gradcomp.TrafficMeter.switches`). The rule in
full, with the adaptive codec beside it: docs/local-sgd.md.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm.consensus import agree_max
from gradcomp.meter import TrafficMeter

__all__ = ["SyncPeriod", "SyncRound", "choose_period", "loss_factor", "period_argument", "time_aware_period",
           "DIVERGENCE_THRESHOLD", "DWELL_STEPS", "HYSTERESIS", "MAX_DWELL_STEPS", "MAX_SYNC_EVERY",
           "PERIOD_COST", "REASONS",
           "WARMUP_ROUNDS", "WINDOW_STEPS"]

#: default period cost ``a``: the fraction of the steps to a target that each inner step of
#: period adds, ``steps(H) = steps(1) (1 + a (H - 1))``. Wang and Joshi 2019's error-runtime
#: bound grows the same way with ``H`` (its local-update term); the value is the least-squares
#: line through the study's mnist-cnn rows (steps to 96% at H = 1, 4, 16, 64: 0.018):
#: docs/local-sgd.md#the-period-chosen-online
PERIOD_COST = 0.02
#: default upper bound of the period (inner steps)
MAX_SYNC_EVERY = 64
#: the period moves only when the new one is at least this fraction above or below it, and
#: at least one step (or beyond a bound): one round's timings are noisy, and a period that
#: flips by one step each round would log a switch per round for no gain
HYSTERESIS = 0.25
#: why the period moved: the time-aware period rose / fell (the exchange grew / shrank against
#: the compute: the link slowed / sped up, or the codec or the step changed); the loss fell
#: (AdaComm's factor, no divergence measured or the rule without it); the loss factor applies
#: because the models diverge above :data:`DIVERGENCE_THRESHOLD` (down), or no longer does
#: because they agree (up)
REASONS = ("comm_share_high", "comm_share_low", "loss_fell", "divergence_high", "divergence_low")
#: the relative divergence (:class:`SyncRound`) at or under which the loss factor does not
#: apply. Deviations of the ranks' moves that are independent of one another (sampling noise,
#: of any size, and the drift it causes) give a divergence of at most about 1: averaging
#: removes them as a larger batch would. Above 1 the deviations are systematic (they cancel in
#: the average: the ranks' models drift apart, e.g. on data that differs between ranks), the
#: local-update error a longer period grows; the margin above 1 covers the spread of the
#: largest of the ranks' estimates (the agreement takes the maximum)
DIVERGENCE_THRESHOLD = 1.5
#: rounds whose measurements are dropped before the first decision: the first exchange on a new
#: group carries one-time costs (connections, the first call's agreement), the first steps
#: lazy initialisation, and a period chosen from them would be off for a whole round
WARMUP_ROUNDS = 1
#: inner steps of measurements a decision reads at least: the latest rounds that hold them (at
#: least one round), so that short rounds (a small period) do not decide from one noisy round
WINDOW_STEPS = 16
#: inner steps after a move before a move the other way (a reversal) may follow; each
#: reversal taken doubles it (up to :data:`MAX_DWELL_STEPS`), a move in the same direction as
#: the last one resets it. Measurements that depend on the period itself (a shorter round
#: times its exchange differently) would otherwise move it back and forth at every
#: synchronisation; the base is one window, so a reversal reads rounds of the new period only
DWELL_STEPS = WINDOW_STEPS
#: the longest dwell before a reversal (inner steps)
MAX_DWELL_STEPS = 16 * WINDOW_STEPS
# a period computed as an exact integer must not become the next one by rounding error
_ROUNDING = 1e-9


@dataclass(frozen=True)
class SyncRound:
    """One rank's measurements of one round (the inner steps between two decisions),
    as the ``timing`` hook sees them before the ranks agree.

    Attributes:
        step: the inner step after which the round's synchronisation ran (1-based).
        steps: inner steps in the round.
        comm_s: seconds of the round's scheduled exchange (the collective, as this rank timed it).
        compute_s: seconds per inner step outside the exchanges: the time between the end of
            one exchange and the start of the next, over the round, divided by ``steps``.
        loss: the mean of the losses reported in the round, or None (none reported).
        divergence: the models' relative divergence at the round's synchronisation (>= 0), or
            None (not measured): ``||d_i - d||^2 / ((n - 1) ||d||^2)`` with ``d_i`` this
            rank's pseudo-gradient over the round, ``d`` the averaged one (``d_i - d`` is
            this rank's model minus the averaged model) and ``n`` the ranks: 0 when every
            rank moved alike; at most about 1 when the ranks' deviations from a common move
            are independent of one another, 1 without a common move (one of ``n``
            independent moves lies, in expectation, ``n - 1`` times as far from their mean
            as that mean's own noise, in squares); ``inf`` when nothing moved on average
            but the models did. The local-update error term of local SGD's bounds (Wang and
            Joshi 2019, their Theorem 1; the workers' model variance that Jiang and Agrawal
            2020, Adaptive Periodic Averaging, track), relative to the progress.
    """

    step: int
    steps: int
    comm_s: float
    compute_s: float
    loss: float | None
    divergence: float | None = None


def loss_factor(loss_ratio: float | None, divergence: float | None = None,
                threshold: float = DIVERGENCE_THRESHOLD) -> float:
    """The factor in (0, 1] on the time-aware period: AdaComm's where the models diverge.

    AdaComm (Wang and Joshi 2019, ``H_k = ceil(sqrt(F_k / F_0) H_0)``) shrinks the period as
    the loss falls because the local-update error term of its bound grows with ``H`` and
    dominates once the loss approaches its floor. That term is the workers' model divergence,
    which is measured here (:attr:`SyncRound.divergence`): the factor is ``sqrt(min(1,
    loss_ratio))`` (a loss above the first does not raise it) when ``divergence`` is None (not
    measured: AdaComm as published); 1 when ``divergence <= threshold`` (the models moved
    alike: a longer period costs no progress); above it, ``max(sqrt(min(1, loss_ratio)),
    threshold / divergence)``: AdaComm's factor reached in proportion to the excess
    divergence, fully at ``threshold / divergence <= sqrt(...)``.

    Args:
        loss_ratio: the loss now over the loss at the first decision (>= 0), or None (no loss: 1).
        divergence: the agreed relative divergence (>= 0, ``inf`` allowed), or None.
        threshold: the divergence at or under which the factor is 1 (> 0).

    Returns:
        The factor (float, 0 only for a loss ratio of 0 with divergent models).
    """
    adacomm = math.sqrt(min(1.0, loss_ratio)) if loss_ratio is not None else 1.0
    if divergence is None:
        return adacomm
    if divergence <= threshold:
        return 1.0
    return max(adacomm, threshold / divergence)


def time_aware_period(comm_s: float, compute_s: float, *, comm_share: float | None = None,
                      period_cost: float = PERIOD_COST) -> float:
    """The unrounded, unbounded time-aware period (``inf`` when ``compute_s`` is 0 and ``comm_s`` is not).

    The cost rule (``comm_share`` None): a round of ``H`` steps lasts ``H x compute_s +
    comm_s`` and a target takes ``steps(1) (1 + a (H - 1))`` steps (``a = period_cost``), so
    the time to the target is proportional to ``(1 - a + a H) (compute_s + comm_s / H)``,
    least at ``H = sqrt((1 - a) comm_s / (a x compute_s))``: the square-root form of Wang and
    Joshi 2019's error-runtime optimum (their ``tau*`` grows as the square root of the
    communication-to-computation ratio). The share rule: the least ``H`` with ``comm_s /
    (comm_s + H x compute_s) <= comm_share``, ``comm_s (1 - comm_share) / (comm_share x compute_s)``.
    """
    if compute_s <= 0:
        return math.inf if comm_s > 0 else 0.0
    if comm_share is not None:
        return comm_s * (1 - comm_share) / (comm_share * compute_s)
    return math.sqrt((1 - period_cost) * comm_s / (period_cost * compute_s))


def choose_period(current: int, comm_s: float, compute_s: float, *, loss_ratio: float | None = None,
                  divergence: float | None = None, divergence_threshold: float = DIVERGENCE_THRESHOLD,
                  comm_share: float | None = None, period_cost: float = PERIOD_COST, min_sync_every: int = 1,
                  max_sync_every: int = MAX_SYNC_EVERY) -> tuple[int, str | None, float]:
    """The next period from agreed measurements (pure; the rule of :class:`SyncPeriod`).

    The time-aware period ``H_time`` is :func:`time_aware_period`'s (the cost rule, or the
    share rule when ``comm_share`` is given). It is scaled by :func:`loss_factor` (AdaComm's
    ``sqrt(min(1, loss_ratio))`` where the models diverge, or always without a divergence)
    and made whole: under the cost rule the whole period of the least modelled time next to
    ``h = factor x H_time`` (``floor(h)`` while ``h^2 < floor(h) (floor(h) + 1)``, else one
    more: the modelled time of ``n`` and ``n + 1`` is equal at ``h = sqrt(n (n + 1))``), under
    the share rule ``ceil(h)`` (the least period that holds the share); clamped to the bounds:
    one target from both factors. It replaces
    ``current`` only when the unrounded target ``factor x H_time`` is at least ``max(1,
    HYSTERESIS x current)`` away from it (:data:`HYSTERESIS`; at least one whole step, so that
    a small period does not move between neighbours on noise) or beyond a bound.

    Args:
        current: the period of the round just ended (inner steps).
        comm_s: seconds of one exchange (>= 0).
        compute_s: seconds of one inner step (>= 0; 0 with ``comm_s > 0`` asks for the upper bound).
        loss_ratio: the loss now over the loss at the first decision (>= 0), or None: time only.
        divergence: the models' agreed relative divergence (>= 0), or None: AdaComm's factor
            whenever a loss ratio is given.
        divergence_threshold: see :func:`loss_factor` (> 0).
        comm_share: the target share, in (0, 1), or None: the cost rule.
        period_cost: the cost rule's ``a``, in (0, 1).
        min_sync_every, max_sync_every: the bounds (1 <= min <= max).

    Returns:
        ``(period, reason, ideal)``: the next period, the reason (one of :data:`REASONS`) or
        None when it stays, and the unrounded, unbounded ``H`` (``inf`` when ``compute_s`` is 0).
    """
    base = time_aware_period(comm_s, compute_s, comm_share=comm_share, period_cost=period_cost)

    def scaled(factor: float) -> float:
        return factor * base if base < math.inf or factor > 0 else 0.0

    ideal = scaled(loss_factor(loss_ratio, divergence, divergence_threshold))

    def bounded(h: float) -> int:
        if h == math.inf:
            return max_sync_every
        if comm_share is not None:  # the least period within the share
            whole = math.ceil(h * (1 - _ROUNDING))
        else:  # the whole period of the least modelled time: n beats n + 1 while h^2 < n (n + 1)
            n = math.floor(h)
            whole = n if h * h < n * (n + 1) else n + 1
        return min(max_sync_every, max(min_sync_every, whole))

    band = max(1.0, HYSTERESIS * current)

    def moves(h: float) -> bool:
        # the unrounded period decides (rounding up would turn any excess over H into H + 1)
        return bounded(h) != current and (h >= current + band or h <= current - band
                                          or h >= max_sync_every or h <= min_sync_every)

    if not moves(ideal):
        return current, None, ideal
    new = bounded(ideal)
    if new > current:
        # up only because agreeing models lift AdaComm's factor, or because of the link?
        adacomm = scaled(loss_factor(loss_ratio))
        lifted = divergence is not None and not (moves(adacomm) and bounded(adacomm) > current)
        return new, ("divergence_low" if lifted else "comm_share_high"), ideal
    # the time-aware period alone: did the link, or the loss, lower it?
    if moves(base) and bounded(base) < current:
        return new, "comm_share_low", ideal
    return new, ("loss_fell" if divergence is None else "divergence_high"), ideal


class SyncPeriod:
    """The adaptive period of :class:`gradcomp.LocalSGD` (see the module docstring).

    Pass it as ``LocalSGD(sync_every=SyncPeriod(...))``; ``sync_every="auto"`` builds one
    from ``min_sync_every``, ``max_sync_every``, ``period_cost`` and ``comm_share``. Each rank
    measures every round (:class:`SyncRound`); at a decision (:meth:`due`), once the exchange
    returned, the ranks agree on the rounds since the last decision by one ``MAX`` allreduce
    of ``(-comm_s, compute_s, loss, divergence)`` per round: the exchange as the last rank to
    arrive timed it (no wait for a late peer), the slowest rank's compute per step, the
    largest mean loss and the largest divergence (``-inf`` for none). :func:`choose_period`
    then gives the next period on every rank alike, from the agreed rounds that hold the
    latest :data:`WINDOW_STEPS` inner steps (the median exchange of those on the current
    codec, the compute per step, the loss and the divergence over their steps) and the loss
    ratio (that loss over the first decision's). The first :data:`WARMUP_ROUNDS` rounds
    decide nothing. A move the other way than the last one (a reversal) waits until
    ``dwell`` inner steps have passed since that move (:data:`DWELL_STEPS`, doubled by each
    reversal taken up to :data:`MAX_DWELL_STEPS`, reset by a move in the same direction):
    a period whose own length biases its measurements then moves back and forth a number of
    times logarithmic in the run's steps instead of at every synchronisation, and a change
    after a quiet spell is followed at once. One instance per ``LocalSGD``.

    Args:
        min_sync_every: the least period, and the start unless ``start`` is given (>= 1).
        max_sync_every: the largest period (>= ``min_sync_every``).
        period_cost: the cost rule's ``a``, in (0, 1) (:data:`PERIOD_COST`; :func:`time_aware_period`).
        comm_share: None (the cost rule), or the share rule's target share of a round's
            seconds spent in the exchange, in (0, 1); not with ``period_cost``.
        start: the first round's period (within the bounds; default ``min_sync_every``).
        divergence_threshold: the agreed divergence at or under which the loss factor does
            not apply (> 0, default :data:`DIVERGENCE_THRESHOLD`); None: AdaComm's factor
            whenever losses are reported (the divergence is measured and logged, not used).
        clock: zero-argument callable returning seconds (default ``time.perf_counter``).
        timing: optional ``SyncRound -> SyncRound`` hook applied to this rank's
            measurements before the agreement (to inject timings in tests).

    Attributes:
        switches: every move, oldest first (JSON-ready dicts: ``kind`` ``"sync_every"``,
            ``step``, ``from``, ``to``, ``reason`` (:data:`REASONS`), the agreed ``comm_s``,
            ``compute_s``, ``loss`` and ``divergence`` (None: not measured or infinite) over
            the window of ``rounds`` rounds, ``loss0``, ``divergence_threshold``,
            ``comm_share`` (the exchange's share at the old period), ``target_share`` and
            ``period_cost`` (the rule's; the other None), ``ideal`` (None when infinite) and
            ``codec`` (the adaptive codec's choice for the exchange, or None)).
        decisions: decisions taken so far; loss0: the first agreed loss, or None.
        held: decisions whose reversal the dwell held back (the period stayed).
        dwell: inner steps a reversal must wait after the last move, now.

    Raises:
        TypeError / ValueError: a bad argument (named in the message, with the allowed values).
    """

    def __init__(self, min_sync_every: int = 1, max_sync_every: int = MAX_SYNC_EVERY, *,
                 period_cost: float | None = None, comm_share: float | None = None, start: int | None = None,
                 divergence_threshold: float | None = DIVERGENCE_THRESHOLD,
                 clock: Callable[[], float] | None = None,
                 timing: Callable[[SyncRound], SyncRound] | None = None):
        self.min_sync_every = v.integer("min_sync_every", min_sync_every, 1)
        self.max_sync_every = v.integer("max_sync_every", max_sync_every, self.min_sync_every)
        if period_cost is not None and comm_share is not None:
            raise ValueError(f"give period_cost (the cost rule) or comm_share (the share rule), not both: "
                             f"got period_cost={period_cost!r}, comm_share={comm_share!r}")
        rule, given = (("comm_share", comm_share) if comm_share is not None
                       else ("period_cost", PERIOD_COST if period_cost is None else period_cost))
        if not 0 < v.real(rule, given) < 1:
            what = "a share of a round's seconds" if rule == "comm_share" else "steps added per step of period"
            raise ValueError(f"{rule} must be in (0, 1) ({what}), got {given!r}")
        self.comm_share, self.period_cost = (float(given), None) if rule == "comm_share" else (None, float(given))
        self.start = self.min_sync_every if start is None else v.integer(
            "start", start, self.min_sync_every, self.max_sync_every)
        if divergence_threshold is not None:
            divergence_threshold = v.real("divergence_threshold", divergence_threshold)
            if not (math.isfinite(divergence_threshold) and divergence_threshold > 0):
                raise ValueError(f"divergence_threshold must be a finite number > 0 or None, "
                                 f"got {divergence_threshold!r}")
        self.divergence_threshold = divergence_threshold
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds or None, got {type(clock).__name__}")
        if timing is not None and not callable(timing):
            raise TypeError(f"timing must be a callable SyncRound -> SyncRound or None, got {type(timing).__name__}")
        self.clock = clock if clock is not None else time.perf_counter
        self.timing = timing
        self.switches: list[dict] = []
        self.decisions = 0
        self.loss0: float | None = None
        self.held = 0
        self.dwell = DWELL_STEPS
        self._last_move: tuple[int, bool] | None = None  # (step, upward)
        self._warmup = WARMUP_ROUNDS
        self._decided_at: int | None = None  # the step of the last decision (None: decide at the next call)
        self._local: list[tuple[SyncRound, int, str | None]] = []  # this rank's rounds since then
        # agreed rounds: (comm, compute, steps, codec, loss, divergence)
        self._rounds: list[tuple[float, float, int, str | None, float | None, float | None]] = []
        self.begin()

    def settings(self) -> dict[str, object]:
        """What every rank must share (it decides the schedule)."""
        return {"min_sync_every": self.min_sync_every, "max_sync_every": self.max_sync_every,
                "period_cost": self.period_cost, "comm_share": self.comm_share, "start": self.start,
                "divergence_threshold": self.divergence_threshold}

    # ---- measurements (LocalSGD calls these) ---------------------------------------------
    def begin(self) -> None:
        """Start a round's measurements now (forgetting the open round's)."""
        self._mark = self.clock()
        self._busy_s = 0.0
        self._comm_s = 0.0
        self._loss_sum, self._loss_count = 0.0, 0
        self._spread = None  # (spread_sq, progress_sq) of the round's exchange, or None

    def report_loss(self, loss) -> None:
        """Add one inner step's training loss (a finite number >= 0, or a one-element tensor) to the round.

        Raises:
            TypeError / ValueError: ``loss`` is not a finite real number >= 0.
        """
        if hasattr(loss, "item") and getattr(loss, "numel", lambda: 1)() == 1:
            loss = loss.item()  # a 0-d tensor: one host sync, once per step
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise TypeError(f"loss must be a real number or a one-element tensor, got {type(loss).__name__}")
        if not (math.isfinite(loss) and loss >= 0):
            raise ValueError(f"loss must be a finite number >= 0, got {loss!r}")
        self._loss_sum += float(loss)
        self._loss_count += 1

    def report_divergence(self, spread_sq: float, progress_sq: float) -> None:
        """Note the round's exchange: ``spread_sq = ||d_i - d||^2`` (this rank's pseudo-gradient
        minus the averaged one) and ``progress_sq = ||d||^2`` (:class:`SyncRound`), both >= 0."""
        self._spread = (float(spread_sq), float(progress_sq))

    @contextlib.contextmanager
    def timed(self):
        """Time one exchange: the seconds before it since the last mark count as compute."""
        began = self.clock()
        self._busy_s += max(0.0, began - self._mark)
        try:
            yield
        finally:
            self._mark = self.clock()
            self._comm_s = max(0.0, self._mark - began)

    # ---- the decision ---------------------------------------------------------------------
    def decide(self, step: int, steps: int, current: int, group, timeout: float, device,
               meter: TrafficMeter | None = None, codec: str | None = None) -> int:
        """Note the round's measurements; when :meth:`due`, agree on those of the rounds since
        the last decision over ``group`` and return the next period (else ``current``).

        Every rank of ``group`` must call it at the same synchronisation. The first
        :data:`WARMUP_ROUNDS` calls only drop their round's measurements (and return ``current``).

        Args:
            step: the inner step just synchronised; steps: inner steps in the round (>= 1).
            current: the round's period.
            group, timeout, device: the agreement's group, seconds and buffer device.
            meter: optional :class:`~gradcomp.TrafficMeter` to log a move in.
            codec: the codec the exchange used (logged with a move), or None.

        Raises:
            TypeError / ValueError: the ``timing`` hook returned something else than a
                :class:`SyncRound` of finite times (and loss, or None) >= 0, or a
                divergence < 0.
            TimeoutError / RuntimeError: a peer did not join within ``timeout`` seconds.
        """
        if self._warmup > 0:  # the same on every rank: no agreement needed
            self._warmup -= 1
            self.begin()
            return current
        mine = self._measured(step, steps, dist.get_world_size(group))
        self._local.append((mine, max(1, steps), codec))
        if not self.due(step):  # fewer than a window's steps since the last decision: no agreement
            self.begin()
            return current
        agreed = agree_max([x for r, _, _ in self._local for x in (
            -r.comm_s, r.compute_s, -math.inf if r.loss is None else float(r.loss),
            -math.inf if r.divergence is None else float(r.divergence))], group, timeout, device, "gradcomp.SyncPeriod")
        for at, (_, n, used_codec) in zip(range(0, len(agreed), 4), self._local):
            neg_comm, compute, loss, divergence = agreed[at:at + 4]
            self._rounds.append((-neg_comm, compute, n, used_codec, loss if math.isfinite(loss) else None,
                                 divergence if divergence >= 0 else None))  # -inf: no rank measured one
        self._local, self._decided_at = [], step
        comm, compute, loss, divergence, window = self._window()
        if loss is not None and self.loss0 is None:
            self.loss0 = loss
        ratio = None if loss is None or not self.loss0 else loss / self.loss0
        used = divergence if self.divergence_threshold is not None else None
        new, reason, ideal = choose_period(current, comm, compute, loss_ratio=ratio, divergence=used,
                                           divergence_threshold=self.divergence_threshold or DIVERGENCE_THRESHOLD,
                                           comm_share=self.comm_share, period_cost=self.period_cost or PERIOD_COST,
                                           min_sync_every=self.min_sync_every,
                                           max_sync_every=self.max_sync_every)
        self.decisions += 1
        if reason is not None:
            new, reason = self._dwelt(step, current, new, reason)
        if reason is not None:
            round_s = comm + current * compute
            entry = {"kind": "sync_every", "step": step, "from": current, "to": new, "reason": reason,
                     "comm_s": comm, "compute_s": compute, "loss": loss, "loss0": self.loss0,
                     "divergence": divergence if divergence is not None and math.isfinite(divergence) else None,
                     "divergence_threshold": self.divergence_threshold,
                     "comm_share": comm / round_s if round_s > 0 else 0.0, "target_share": self.comm_share,
                     "period_cost": self.period_cost,
                     "ideal": ideal if math.isfinite(ideal) else None, "codec": codec, "rounds": window}
            self.switches.append(entry)
            if meter is not None:
                meter.record_switch(entry)
        self.begin()  # the agreement's own seconds are neither compute nor exchange
        return new

    def due(self, step: int) -> bool:
        """Whether the :meth:`decide` call at ``step`` agrees and decides: after the warm-up, the
        first call, then the first call at least :data:`WINDOW_STEPS` inner steps after the last
        decision (a decision reads a window of that many steps; the rounds in between are agreed
        with it, in the same allreduce). The same on every rank."""
        return self._warmup == 0 and (self._decided_at is None or step - self._decided_at >= WINDOW_STEPS)

    def _measured(self, step: int, steps: int, world: int) -> SyncRound:
        """This rank's round just ended, through the ``timing`` hook, checked."""
        mine = SyncRound(step=step, steps=steps, comm_s=self._comm_s, compute_s=self._busy_s / max(1, steps),
                         loss=self._loss_sum / self._loss_count if self._loss_count else None,
                         divergence=self._divergence(world))
        if self.timing is not None:
            mine = self.timing(mine)
            if not isinstance(mine, SyncRound):
                raise TypeError(f"timing must return a gradcomp.SyncRound, got {type(mine).__name__}")
        for name in ("comm_s", "compute_s", "loss", "divergence"):
            x = getattr(mine, name)
            if not (name in ("loss", "divergence") and x is None) \
                    and not ((math.isfinite(x) or name == "divergence") and x >= 0):
                raise ValueError(f"SyncRound.{name} must be a {'' if name == 'divergence' else 'finite '}"
                                 f"number >= 0{' or None' if name in ('loss', 'divergence') else ''}, got {x!r}")
        return mine

    def _dwelt(self, step: int, current: int, new: int, reason: str) -> tuple[int, str | None]:
        """The move ``current -> new`` at ``step`` after the dwell: ``(current, None)`` when
        it reverses the last move sooner than :attr:`dwell` steps after it; else the move,
        with the dwell doubled (a reversal) or reset (the same direction)."""
        up = new > current
        if self._last_move is not None and up != self._last_move[1]:
            if step - self._last_move[0] < self.dwell:
                self.held += 1
                return current, None
            self.dwell = min(2 * self.dwell, MAX_DWELL_STEPS)
        else:
            self.dwell = DWELL_STEPS
        self._last_move = (step, up)
        return new, reason

    def _divergence(self, world: int) -> float | None:
        """This rank's relative divergence of the round (:class:`SyncRound`), or None (not reported)."""
        if self._spread is None:
            return None
        spread_sq, progress_sq = self._spread
        if world < 2 or spread_sq == 0:
            return 0.0  # one model, or every rank moved alike
        return spread_sq / ((world - 1) * progress_sq) if progress_sq > 0 else math.inf

    def _window(self) -> tuple[float, float, float | None, float | None, int]:
        """``(comm_s, compute_s, loss, divergence, rounds)`` over the latest agreed rounds
        that hold :data:`WINDOW_STEPS` inner steps (at least the latest round): the median
        exchange of those that ran the latest round's codec; the compute per step, the loss
        and the divergence (None: none reported), each weighted by the rounds' steps."""
        picked, total = [], 0
        for r in reversed(self._rounds):
            picked.append(r)
            total += r[2]
            if total >= WINDOW_STEPS:
                break
        del self._rounds[:len(self._rounds) - len(picked)]  # a later window never reaches further back
        comm = statistics.median(r[0] for r in picked if r[3] == picked[0][3])
        loss, divergence = (self._weighted(picked, i) for i in (4, 5))
        return comm, sum(r[1] * r[2] for r in picked) / total, loss, divergence, len(picked)

    @staticmethod
    def _weighted(rounds: list[tuple], i: int) -> float | None:
        """The mean of the rounds' field ``i`` weighted by their steps, over those that have it (None: none)."""
        have = [(r[i], r[2]) for r in rounds if r[i] is not None]
        if not have:
            return None
        return sum(x * n for x, n in have) / sum(n for _, n in have) if all(math.isfinite(x) for x, _ in have) \
            else math.inf

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The decisions' memory: ``loss0``, ``decisions``, ``switches``, ``held``, ``dwell``
        and ``last_move`` (``[step, upward]`` or None)."""
        return {"loss0": self.loss0, "decisions": self.decisions, "switches": [dict(e) for e in self.switches],
                "held": self.held, "dwell": self.dwell,
                "last_move": None if self._last_move is None else list(self._last_move)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`'s output (the open round's measurements restart).

        Raises:
            TypeError / ValueError: ``state`` is not such a mapping.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from SyncPeriod.state_dict()), got {type(state).__name__}")
        loss0 = state.get("loss0")
        if loss0 is not None and not (isinstance(loss0, numbers.Real) and math.isfinite(loss0) and loss0 >= 0):
            raise ValueError(f"state['loss0'] must be None or a finite number >= 0, got {loss0!r}")
        decisions = v.integer("state['decisions']", state.get("decisions"), 0)
        switches = state.get("switches", [])
        if not isinstance(switches, list) or not all(isinstance(e, Mapping) for e in switches):
            raise ValueError("state['switches'] must be a list of dicts")
        held = v.integer("state['held']", state.get("held", 0), 0)
        dwell = v.integer("state['dwell']", state.get("dwell", DWELL_STEPS), DWELL_STEPS, MAX_DWELL_STEPS)
        last = state.get("last_move")
        if last is not None and not (isinstance(last, (list, tuple)) and len(last) == 2
                                     and isinstance(last[0], numbers.Integral) and isinstance(last[1], bool)):
            raise ValueError(f"state['last_move'] must be None or [step, upward], got {last!r}")
        self.loss0 = None if loss0 is None else float(loss0)
        self.decisions = decisions
        self.held, self.dwell = held, dwell
        self._last_move = None if last is None else (int(last[0]), bool(last[1]))
        self._warmup = WARMUP_ROUNDS  # a resumed run's first exchange is a new group's first again
        self._rounds, self._local, self._decided_at = [], [], None
        self.switches = [dict(e) for e in switches]
        self.begin()

    def __getstate__(self) -> dict:
        """Everything but the ``clock`` and ``timing`` hooks (the restored one uses
        ``time.perf_counter`` and no hook)."""
        state = self.__dict__.copy()
        state["clock"], state["timing"] = time.perf_counter, None
        return state

    def __repr__(self) -> str:
        return (f"SyncPeriod(min_sync_every={self.min_sync_every}, max_sync_every={self.max_sync_every}, "
                f"period_cost={self.period_cost!r}, comm_share={self.comm_share!r}, start={self.start}, "
                f"divergence_threshold={self.divergence_threshold!r})")


def period_argument(sync_every, min_sync_every=None, max_sync_every=None, comm_share=None, *,
                    period_cost=None, fragments: int = 1, overlap: int = 0) -> SyncPeriod | None:
    """The :class:`SyncPeriod` that :class:`gradcomp.LocalSGD`'s arguments ask for, or None (a fixed period).

    ``sync_every="auto"`` builds one from the other four (None: 1, :data:`MAX_SYNC_EVERY`,
    the cost rule with :data:`PERIOD_COST`); a :class:`SyncPeriod` is taken as it is; an int
    is a fixed period.

    Raises:
        ValueError: ``sync_every`` is another string; the bounds, ``comm_share`` or
            ``period_cost`` are given with a fixed period or a SyncPeriod, or both of the
            latter two; an adaptive period with ``fragments != 1`` or ``overlap != 0`` (its
            rounds end where every parameter was just synchronised).
    """
    given = {n: x for n, x in (("min_sync_every", min_sync_every), ("max_sync_every", max_sync_every),
                               ("comm_share", comm_share), ("period_cost", period_cost)) if x is not None}
    if isinstance(sync_every, str) and sync_every != "auto":
        raise ValueError(f"sync_every must be an int >= 1, 'auto' or a gradcomp.SyncPeriod, got {sync_every!r}")
    if sync_every == "auto":
        period = SyncPeriod(given.get("min_sync_every", 1), given.get("max_sync_every", MAX_SYNC_EVERY),
                            period_cost=period_cost, comm_share=comm_share)
    elif given:
        raise ValueError(f"{', '.join(given)} apply to sync_every='auto' only (a SyncPeriod takes its own), "
                         f"got sync_every={sync_every!r}")
    else:
        period = sync_every if isinstance(sync_every, SyncPeriod) else None
    if period is not None and (fragments, overlap) != (1, 0):
        raise ValueError(f"an adaptive sync_every needs fragments=1 and overlap=0, got fragments={fragments!r}, "
                         f"overlap={overlap!r}")
    return period
