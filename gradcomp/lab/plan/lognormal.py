"""Stragglers: the expected maximum of independent lognormal compute times.

A synchronous step waits for its slowest worker, so with compute times
``T_i = s_i X_i`` (``X_i`` lognormal with mean 1 and coefficient of variation
``cv``; ``s_i`` the worker's mean, e.g. a straggler's ``factor * T``) the
compute part of the step is ``E[max_i T_i]`` (the order statistic behind
"T + max dT"). For a lognormal with mean 1 and CV ``c``:
``sigma**2 = ln(1 + c**2)``, ``mu = -sigma**2 / 2``. The expectation of the
maximum is evaluated from its distribution function
``E[M] = integral_0^inf (1 - prod_i F(x / s_i)) dx`` by the trapezoidal rule
on a log-spaced grid (in ``y = ln x``, integrand ``(1 - prod F) e^y``), with
``1 - prod F`` computed as ``-expm1(sum log1p(-Q))`` from the upper tails
``Q`` so that it stays accurate when every ``F`` is close to 1.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["lognormal_sigma", "expected_max"]

_GRID = 4001
_SPAN = 12.0  # standard deviations either side


def lognormal_sigma(cv: float) -> float:
    """The log-space standard deviation of a lognormal with coefficient of variation ``cv``."""
    if not (isinstance(cv, (int, float)) and math.isfinite(cv) and cv >= 0):
        raise ValueError(f"cv must be a finite number >= 0, got {cv!r}")
    return math.sqrt(math.log1p(cv * cv))


def expected_max(scales, cv: float) -> float:
    """``E[max_i s_i X_i]`` for independent ``X_i`` lognormal with mean 1 and CV ``cv``.

    Args:
        scales: the workers' mean compute times ``s_i`` (seconds, > 0), a
            sequence or a mapping ``{scale: count}`` (e.g. ``{T: 1023, 3 * T: 1}``)
            for large groups of equal workers.
        cv: coefficient of variation of every worker's compute time (>= 0).
            ``cv = 0`` gives ``max_i s_i``.

    Returns:
        The expected maximum, in the units of ``scales``.

    Raises:
        ValueError: an empty set of scales, a scale <= 0, or a bad ``cv``.
    """
    groups = dict(scales) if isinstance(scales, dict) else {}
    if not isinstance(scales, dict):
        for s in scales:
            groups[float(s)] = groups.get(float(s), 0) + 1
    if not groups or any(not (s > 0 and math.isfinite(s)) or c < 0 for s, c in groups.items()):
        raise ValueError(f"scales must be a non-empty set of finite numbers > 0, got {scales!r}")
    groups = {float(s): int(c) for s, c in groups.items() if c > 0}
    sigma = lognormal_sigma(cv)
    if sigma == 0.0:
        return max(groups)
    mu = -0.5 * sigma * sigma
    lo = math.log(min(groups)) + mu - _SPAN * sigma
    hi = math.log(max(groups)) + mu + _SPAN * sigma
    y = np.linspace(lo, hi, _GRID)
    log_f = np.zeros_like(y)  # sum_i log F(x / s_i)
    for s, count in groups.items():
        z = (y - math.log(s) - mu) / sigma
        upper = 0.5 * np.array([math.erfc(v / math.sqrt(2.0)) for v in z])  # Q = 1 - F
        lower = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in z])  # F
        with np.errstate(divide="ignore"):  # F underflows to 0 far below the mean: log F = -inf
            log_f += count * np.where(z < 0, np.log(lower), np.log1p(-upper))
    integrand = -np.expm1(log_f) * np.exp(y)
    # below the grid every F is ~0: the integrand is e^y, whose integral to -inf is e^lo
    return float(np.trapezoid(integrand, y) + math.exp(lo))
