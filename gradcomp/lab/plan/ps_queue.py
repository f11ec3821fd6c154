"""The parameter server's queue: response times of a closed network by exact mean value analysis.

The asynchronous parameter server of the step-time model (:mod:`gradcomp.lab.plan.model`,
:func:`~gradcomp.lab.plan.model.async_throughput`) is a single queueing server visited by
closed groups of workers. Details: docs/planning.md#the-host-model.
"""

from __future__ import annotations

__all__ = ["mva_response"]


def mva_response(groups: list[tuple[int, float]], demand: float) -> list[float]:
    """Response times at a single queueing server of a closed network (exact mean value analysis).

    ``groups`` are ``(count, think)``: ``count`` workers that each spend
    ``think`` seconds per cycle away from the server, then one service of
    ``demand`` seconds there (one or two groups: the workers, and a
    straggler). Exact MVA for a product-form network (Reiser and Lavenberg
    1980, "Mean-value analysis of closed multichain queuing networks"; Lazowska
    et al. 1984, "Quantitative System Performance", ch. 7), over the
    populations ``(a, b)`` up to the groups' counts: a group's response time
    at population ``P`` is ``D (1 + Q(P - one of its workers))``, its
    throughput ``count / (think + R)``, and ``Q`` the sum of throughput times
    response. ``R - D`` is the time a worker queues behind the others'
    pushes; the throughput tends to ``1 / D`` as the server saturates.

    Returns:
        The response time ``R`` (seconds) of each group at its full population.

    Raises:
        ValueError: not one or two groups, or a count < 1.
    """
    if not 1 <= len(groups) <= 2 or any(c < 1 for c, _ in groups):
        raise ValueError(f"groups must be one or two (count >= 1, think) pairs, got {groups!r}")
    (na, za), (nb, zb) = groups[0], (groups[1] if len(groups) == 2 else (0, 0.0))
    q = [[0.0] * (nb + 1) for _ in range(na + 1)]  # q[a][b]: mean number at the server
    ra = rb = demand
    for i in range(na + 1):
        for j in range(nb + 1):
            if i == j == 0:
                continue
            ra = demand * (1.0 + q[i - 1][j]) if i else demand
            rb = demand * (1.0 + q[i][j - 1]) if j else demand
            q[i][j] = (i * ra / (za + ra) if i else 0.0) + (j * rb / (zb + rb) if j else 0.0)
    return [ra, rb][:len(groups)]
