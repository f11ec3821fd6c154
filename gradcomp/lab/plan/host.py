"""Ranks sharing one host's cores: the processor-sharing terms of the step-time model.

The alpha-beta model (:mod:`gradcomp.lab.plan.model`) prices every rank as if it
had a machine to itself. When ``R`` processes of one job run on a host with
``C`` cores (the time study: 4 workers, plus the parameter server in async
mode, on 2 cores), three things change, and a :class:`Host` carries the
numbers that describe them:

* **Processor sharing.** ``r`` runnable processes on ``C`` cores each run at
  ``C / r`` of a core once ``r > C``; CPU work (codec kernels, the server's
  decompress-add, optimizer step and pull compression) takes
  :meth:`Host.share` ``= max(1, r / C)`` times its one-core time. A process
  that sleeps (a straggler's emulated delay) or blocks on the network is not
  runnable: it frees its share of a core for the others.
* **Scheduling delay per message.** A message exchange completes only when
  both ends have been scheduled. On an oversubscribed host a peer is often
  descheduled behind another rank's compute and runs only at its next time
  slice, so every exchange step waits :meth:`Host.skew_s` ``=
  slice_s (share - 1)`` for it. That delay overlaps a transfer in flight:
  a step costs ``alpha + max(skew, bytes / beta)`` (a transfer longer than
  the delay hides it; a short one on loopback is set by it).
* **Scattered hand-offs.** Time sharing does not advance the ranks in
  lockstep: whichever ranks the scheduler ran first finish their compute
  first and then wait for the others, a bubble even without a straggler.
  The model treats the scatter as a lognormal compute jitter of coefficient
  of variation :meth:`Host.cv` ``= sched_cv (share - 1)``, combined with any
  configured jitter ``cv`` as ``sqrt(cv^2 + host_cv^2)`` (independent
  factors), whose expected maximum over the ranks
  (:func:`gradcomp.lab.plan.lognormal.expected_max`) gives the wait.

Every term vanishes at ``share == 1``: a host with a core per rank (the
projection's one rank per node) prices exactly as the plain alpha-beta model.
``cores`` is the host's core count; ``slice_s`` and ``sched_cv`` are host
constants, measured (``gradcomp plan validate --fit-seeds``: fitted on a
subset of a time study's runs and checked on the others) and kept in the
profile's ``"host"`` section. Source: processor sharing (Kleinrock 1967,
"Time-shared systems: a theoretical analysis"); the Linux CFS scheduler's
time slice ``sched_latency / nr_running`` per core.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Host"]


@dataclass(frozen=True)
class Host:
    """One host's cores and its scheduling constants.

    Attributes:
        cores: CPU cores of the host (>= 1).
        slice_s: seconds an exchange step waits for a descheduled peer per
            unit of oversubscription (>= 0).
        sched_cv: coefficient of variation of the ranks' compute hand-offs
            per unit of oversubscription (>= 0).

    Raises:
        ValueError: ``cores`` not an integer >= 1, or a constant negative or
            not finite.
    """

    cores: int
    slice_s: float = 0.0
    sched_cv: float = 0.0

    def __post_init__(self):
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"cores must be an integer >= 1, got {self.cores!r}")
        for name in ("slice_s", "sched_cv"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def share(self, runnable: float) -> float:
        """Slowdown of CPU work with ``runnable`` processes: ``max(1, runnable / cores)``."""
        return max(1.0, float(runnable) / self.cores)

    def skew_s(self, runnable: float) -> float:
        """Delay of one exchange step for a descheduled peer: ``slice_s (share - 1)``."""
        return self.slice_s * (self.share(runnable) - 1.0)

    def cv(self, runnable: float) -> float:
        """Hand-off scatter as a compute CV: ``sched_cv (share - 1)``."""
        return self.sched_cv * (self.share(runnable) - 1.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Host":
        """A host from its JSON form ``{"cores", "slice_s", "sched_cv"}`` (other keys ignored).

        Raises:
            ValueError: not an object with an integer ``cores``, or bad constants.
        """
        if not isinstance(d, dict) or "cores" not in d:
            raise ValueError(f"a host must be a JSON object with \"cores\", got {d!r}")
        return cls(cores=d["cores"], slice_s=d.get("slice_s", 0.0), sched_cv=d.get("sched_cv", 0.0))
