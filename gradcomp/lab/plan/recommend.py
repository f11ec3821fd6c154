"""Recommendation: the mode, compressor and algorithm the model expects to train fastest.

Every combination the library runs is predicted (:func:`candidates`): sync
with each compressor on each algorithm that takes it (``ring``,
``two_phase`` for dense codecs, ``allgather`` for sparse ones, and the
synchronous parameter server ``ps``), and async (parameter server) with each
compressor. Compressors whose accuracy gap (:attr:`gradcomp.lab.plan.codecs.PlanCodec.gap_pts`)
exceeds ``max_gap`` points (or was never measured, unless named in ``compressors``) and,
when ``max_staleness`` is given, async runs whose predicted mean staleness exceeds it are
left out. They are ranked by the time to apply
``N`` workers' gradients once: a sync step, or ``N / X`` for async at ``X``
pushes per second (async gradients are stale: the staleness is reported).

Uncertainty: the ranking is repeated with the inputs moved one at a time
and all at once in the direction that hurts the winner (alpha x0.5 and x2,
bandwidth x0.8 and x1.2, kernel rates x0.5 and x2, compute x0.8 and
x1.2: the spread between the configured and achieved link rates, CPU vs GPU
kernels and the compute jitter measured in the time study); reported are the
winner's time range over these cases and in how many of them it stays first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gradcomp.lab.plan.model import CODECS, Prediction, Setting, predict
from gradcomp.lab.plan.profile import Profile

__all__ = ["candidates", "rank", "recommend", "Recommendation", "PERTURBATIONS"]

#: (input, factors) moved for the uncertainty estimate
PERTURBATIONS = (("alpha", (0.5, 2.0)), ("bandwidth", (0.8, 1.2)), ("kernels", (0.5, 2.0)),
                 ("compute", (0.8, 1.2)))


def candidates(compressors=None) -> list[tuple[str, str, str]]:
    """Every ``(mode, compressor, algorithm)`` the library runs, for ``compressors`` (default: all)."""
    out = []
    for name in compressors or CODECS:
        c = CODECS[name]
        out += [("sync", name, alg) for alg in c.algorithms]
        out.append(("async", name, "ps"))
    return out


def _time(p: Prediction) -> float:
    """Seconds to apply every worker's gradient once."""
    return p.step_s if p.mode == "sync" else p.nodes / p.throughput


def rank(s: Setting, prof: Profile, *, max_gap: float = 0.5, max_staleness: float | None = None,
         compressors=None) -> tuple[list[Prediction], list[tuple[Prediction, str]]]:
    """Predictions sorted fastest first, and the excluded ones with the reason."""
    kept, excluded = [], []
    for mode, name, alg in candidates(compressors):
        p = predict(mode, name, alg, s, prof)
        if CODECS[name].gap_pts is None and compressors is None:
            excluded.append((p, "accuracy gap not measured (name it to rank it)"))
        elif (CODECS[name].gap_pts or 0.0) > max_gap:
            excluded.append((p, f"accuracy gap {CODECS[name].gap_pts:.2f} pts > {max_gap:g}"))
        elif max_staleness is not None and p.staleness_mean is not None and p.staleness_mean > max_staleness:
            excluded.append((p, f"mean staleness {p.staleness_mean:.1f} > {max_staleness:g}"))
        else:
            kept.append(p)
    kept.sort(key=_time)
    return kept, excluded


def _perturbed(s: Setting, prof: Profile, what: str, f: float) -> tuple[Setting, Profile]:
    if what == "alpha":
        return dataclasses.replace(s, alpha_s=s.alpha(prof) * f), prof
    if what == "bandwidth":
        return dataclasses.replace(s, link_bytes_per_s=s.link_bytes_per_s * f), prof
    if what == "compute":
        return dataclasses.replace(s, compute_s=s.compute_s * f), prof
    kernels = {op: r * f for op, r in prof.kernels.items()}
    return s, dataclasses.replace(prof, kernels=kernels)


@dataclass
class Recommendation:
    """The answer of :func:`recommend`.

    Attributes:
        best, runner_up: the two fastest predictions (runner_up None if alone).
        baseline: sync, no compression, ring.
        ranking: every kept prediction, fastest first; excluded: ``(prediction, reason)``.
        time_range_s: the winner's fastest and slowest time over the perturbed inputs.
        stays_best: in how many perturbed cases the winner is still first, of ``cases``.
    """

    best: Prediction
    runner_up: Prediction | None
    baseline: Prediction
    ranking: list
    excluded: list
    time_range_s: tuple[float, float]
    stays_best: int
    cases: int

    @staticmethod
    def key(p: Prediction) -> tuple[str, str, str]:
        return p.mode, p.compressor, p.algorithm

    def seconds(self, p: Prediction) -> float:
        return _time(p)


def recommend(s: Setting, prof: Profile, *, max_gap: float = 0.5, max_staleness: float | None = None,
              compressors=None) -> Recommendation:
    """Rank every candidate for ``s`` (``compressors``: names of the planner's codecs, default all)
    and estimate how sure the choice is.

    Raises:
        ValueError: every candidate is excluded (``max_gap`` < 0 or no async/sync left).
    """
    ranking, excluded = rank(s, prof, max_gap=max_gap, max_staleness=max_staleness, compressors=compressors)
    if not ranking:
        raise ValueError(f"no candidate passes max_gap={max_gap} and max_staleness={max_staleness}")
    best = ranking[0]
    baseline = predict("sync", "none", "ring", s, prof)
    times, stays, cases = [_time(best)], 0, 0
    scenarios = [(what, f) for what, fs in PERTURBATIONS for f in fs]
    worst = [("alpha", 2.0), ("bandwidth", 0.8), ("kernels", 0.5), ("compute", 0.8)]
    for combo in [[sc] for sc in scenarios] + [worst]:
        s2, p2 = s, prof
        for what, f in combo:
            s2, p2 = _perturbed(s2, p2, what, f)
        r2, _ = rank(s2, p2, max_gap=max_gap, max_staleness=max_staleness, compressors=compressors)
        mine = predict(best.mode, best.compressor, best.algorithm, s2, p2)
        times.append(_time(mine))
        cases += 1
        stays += bool(r2) and Recommendation.key(r2[0]) == Recommendation.key(best)
    return Recommendation(best, ranking[1] if len(ranking) > 1 else None, baseline, ranking, excluded,
                          (min(times), max(times)), stays, cases)
