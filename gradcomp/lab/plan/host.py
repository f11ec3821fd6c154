"""Ranks sharing one host's cores: the processor-sharing terms of the step-time model.

Details: docs/planning.md#ranks-sharing-a-hosts-cores.
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
