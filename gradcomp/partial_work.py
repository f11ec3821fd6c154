"""Partial work: a slow rank runs fewer inner steps of a local SGD round instead of holding it up.

``gc.LocalSGD(model, H, partial_work=True)``: every rank times its own inner steps (the
seconds from the return of one :meth:`~gradcomp.LocalSGD.step` to the next call, computed
steps only, the median of the latest :data:`WINDOW`); at a synchronisation at least
:data:`AGREE_EVERY` inner steps after the last agreement the ranks share those medians (one
small ``MAX`` allreduce, a slot per rank). A rank slower than :data:`TOLERANCE` times the
ranks' lower median then runs ``floor(budget / own)`` inner steps of each round (at least
one), ``budget`` being ``H`` times the slowest compute within the tolerance: it reaches the
synchronisation about when the others do. Its remaining steps of the round are idle (the training loop asks
:attr:`gradcomp.LocalSGD.should_compute` and calls ``step()`` without computing), so the
exchange schedule, and the bit-identical parameters after it, are unchanged. In a round whose
ranks ran different numbers of steps each pseudo-gradient is weighted by its steps (``N x
steps / total``, so that the new anchor is the step-weighted mean of the ranks' models, as
FedAvg weighs a client by the samples it processed, McMahan et al. 2017). FedProx's partial
work for systems heterogeneity (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020); on data that differ between ranks the slow rank's data weighs less (FedNova's
objective inconsistency, Wang et al. 2020, is not corrected here).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm.consensus import agree_max

__all__ = ["PartialWork", "least_period", "partial_work_argument", "quotas", "AGREE_EVERY", "TOLERANCE", "WINDOW"]

#: a rank whose compute per inner step is at most this many times the ranks' lower median
#: runs every step of a round: jitter, a shared host's scheduling (ranks that share cores measure
#: up to about 2x apart from one window to the next) and a rank's own small chores (an
#: evaluation, a checkpoint) must not cut its work; the median, not the fastest, so that one
#: fast rank does not make the others stragglers (the lower one, so that of two ranks the
#: faster is the reference)
TOLERANCE = 2.0
#: computed inner steps whose median is a rank's compute per step (five slow steps move it)
WINDOW = 8
#: inner steps between two agreements at least (an agreement is due at the first
#: synchronisation this many steps after the last), so that a period of one step does not
#: add an allreduce to every step
AGREE_EVERY = 16


def quotas(compute_s: Sequence[float], period: int, tolerance: float = TOLERANCE) -> list[int]:
    """Each rank's inner steps in a round of ``period`` steps, from each rank's seconds per step.

    Ranks within ``tolerance`` times the lower median of the ranks' seconds run all ``period`` steps;
    the round then lasts ``budget = period x`` the slowest of them, and each slower rank runs
    ``max(1, floor(budget / its seconds))`` steps. A rank that measured nothing (``nan`` or <= 0)
    runs all.

    >>> quotas([0.010, 0.011, 0.030, 0.010], 64)
    [64, 64, 23, 64]
    """
    bound, rate = _budget(compute_s, tolerance)
    return [period if not (math.isfinite(t) and t > bound)
            else max(1, min(period, math.floor(period * rate / t + 1e-9))) for t in compute_s]


def least_period(compute_s: Sequence[float], tolerance: float = TOLERANCE) -> int:
    """The least period in which every rank's one inner step fits the round of the ranks within
    ``tolerance``: ``ceil(slowest / budget rate)`` (1 when no rank is beyond it).

    >>> least_period([0.010, 0.011, 0.030, 0.010])
    3
    """
    bound, rate = _budget(compute_s, tolerance)
    return max([1] + [math.ceil(t / rate - 1e-9) for t in compute_s if math.isfinite(t) and t > bound])


def _budget(compute_s: Sequence[float], tolerance: float) -> tuple[float, float]:
    """``(bound, rate)``: the seconds per step beyond which a rank is cut (``tolerance`` x the
    measured ranks' lower median; ``inf`` when none measured), and the slowest seconds per step within it."""
    measured = [t for t in compute_s if math.isfinite(t) and t > 0]
    if not measured:
        return math.inf, math.nan
    bound = tolerance * statistics.median_low(measured)
    return bound, max(t for t in measured if t <= bound)


def partial_work_argument(partial_work, fragments: int, overlap: int) -> "PartialWork | None":
    """``LocalSGD(partial_work=...)`` checked: a :class:`PartialWork` (``True``: the defaults) or None.

    Raises:
        TypeError: not a bool or a :class:`PartialWork`.
        ValueError: with ``fragments != 1`` or ``overlap != 0`` (a round is then no longer one exchange).
    """
    if partial_work is False or partial_work is None:
        return None
    if partial_work is not True and not isinstance(partial_work, PartialWork):
        kind = type(partial_work)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"partial_work must be a bool or a gradcomp.PartialWork, got {name}")
    if (fragments, overlap) != (1, 0):
        raise ValueError(f"partial_work needs fragments=1 and overlap=0, got fragments={fragments}, "
                         f"overlap={overlap}")
    work = PartialWork() if partial_work is True else partial_work
    work.reset()  # an instance given again starts afresh
    return work


class PartialWork:
    """One rank's share of each local SGD round (see the module docstring).

    Args:
        tolerance: a rank at most this many times slower than the ranks' lower median runs every step (> 1).
        clock: seconds, monotonic (default ``time.perf_counter``; tests inject one).

    Attributes:
        quota: this rank's inner steps in the current round (its period until an agreement cuts it).
        compute_s: the agreed seconds per inner step of each rank at the last agreement (``nan``:
            not measured yet), or None before the first.
        agreed_at: the inner step of the last agreement, or None.
        quotas: every rank's inner steps per round as last agreed, or None.
    """

    def __init__(self, tolerance: float = TOLERANCE, *, clock=time.perf_counter):
        self.tolerance = v.real("tolerance", tolerance)
        if not (math.isfinite(self.tolerance) and self.tolerance > 1.0):
            raise ValueError(f"tolerance must be a finite number > 1, got {tolerance!r}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget every measurement and agreement: every rank computes every step until the next
        agreement (a restored checkpoint, a new :class:`~gradcomp.LocalSGD`)."""
        self.quota: int | None = None
        self.compute_s: list[float] | None = None
        self.agreed_at: int | None = None
        self.quotas: list[int] | None = None
        self._rank = 0
        self.done = 0  # inner steps of this round so far
        self._exchanged = 0  # ``done`` at the round's last exchange (a sync() within the round)
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._returned: float | None = None

    @property
    def should_compute(self) -> bool:
        """Whether this rank runs its next inner step (False: its share of the round is done)."""
        return self.quota is None or self.done < self.quota

    def steps_run(self) -> list[int] | None:
        """Every rank's computed inner steps since the last exchange (None before the quotas)."""
        if self.quotas is None:
            return None
        return [min(self.done, q) - min(self._exchanged, q) for q in self.quotas]

    def weigh_(self, delta: torch.Tensor) -> bool:
        """Weigh this rank's pseudo-gradient ``delta`` in place by its steps, ``N x steps /
        total`` over the ranks, before the averaging exchange; True when the ranks ran different
        numbers of steps (else ``delta`` is untouched)."""
        run = self.steps_run()
        self._exchanged = self.done
        if run is None or len(set(run)) == 1 or not sum(run):
            return False
        delta.mul_(len(run) * run[self._rank] / sum(run))
        return True

    def stepped(self, meter=None) -> None:
        """The training loop reached :meth:`gradcomp.LocalSGD.step`: time the step if it computed,
        else count an ``"idle_step"`` event in ``meter`` (a :class:`~gradcomp.TrafficMeter`)."""
        now = self.clock()
        if not self.should_compute:
            if meter is not None:
                meter.record_event("idle_step")
        elif self._returned is not None:
            self._recent.append(max(0.0, now - self._returned))
        self.done += 1

    def returned(self) -> None:
        """:meth:`gradcomp.LocalSGD.step` returns: the next inner step's compute starts."""
        self._returned = self.clock()

    def new_round(self, step: int, period: int, group, timeout: float, device, meter=None,
                  most: int | None = None) -> int:
        """A synchronisation ended after inner step ``step``; the next round lasts ``period`` steps.

        Agrees on every rank's seconds per step when due (every rank calls it at the same
        synchronisation with the same ``step`` and ``period``) and sets :attr:`quota`. When the
        agreed quotas cut a rank's round (or stop cutting) or the period is raised, logs
        ``{"kind": "partial_work", "step", "sync_every", "quotas", "compute_s", "raised_from"}``
        (the same on every rank) in ``meter`` (a :class:`~gradcomp.TrafficMeter`).

        ``most``: an adaptive period's upper bound; the period is then raised to
        :func:`least_period` (at most ``most``), so that a cut rank's one step fits the round
        (a shorter round would wait for it). Returns the next round's period.

        Raises:
            TimeoutError / RuntimeError: a peer did not join within ``timeout`` seconds.
        """
        self.done = self._exchanged = 0
        self._rank = dist.get_rank(group)
        if period >= 2 and (self.agreed_at is None or step - self.agreed_at >= AGREE_EVERY):
            mine = statistics.median(self._recent) if self._recent else math.nan
            slots = [-math.inf] * dist.get_world_size(group)
            slots[self._rank] = -1.0 if math.isnan(mine) else mine  # -1: nothing measured
            agreed = agree_max(slots, group, timeout, device, "gradcomp.PartialWork")
            self.compute_s = [t if t >= 0 else math.nan for t in agreed]
            self.agreed_at = step
        if self.compute_s is None:
            self.quota = period
            return period
        asked = period
        if most is not None:
            period = max(period, min(most, least_period(self.compute_s, self.tolerance)))
        shares = quotas(self.compute_s, period, self.tolerance)
        self.quota = shares[self._rank]
        # a rank within the tolerance always runs the whole round: a cut is min < max
        cut, was_cut = min(shares) < max(shares), self.quotas is not None and min(self.quotas) < max(self.quotas)
        if meter is not None and (period != asked or shares != self.quotas and (cut or was_cut)):
            meter.record_switch({"kind": "partial_work", "step": step, "sync_every": period, "quotas": shares,
                                 "compute_s": self.compute_s, "raised_from": asked if period != asked else None})
        self.quotas = shares
        return period

    def __repr__(self) -> str:
        return f"PartialWork(tolerance={self.tolerance}, quota={self.quota})"
