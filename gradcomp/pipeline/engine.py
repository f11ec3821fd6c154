"""The engine's schedules on gradcomp stages: which stages a rank holds, and the schedule object.

=============  ============================================  ===========================
``schedule``   engine class                                  stages on rank ``r`` of ``p``
=============  ============================================  ===========================
gpipe          ``ScheduleGPipe`` (Huang et al. 2019)         ``r``
1f1b           ``Schedule1F1B`` (PipeDream-flush, Narayanan  ``r``
               et al. 2021)
interleaved    ``ScheduleInterleaved1F1B`` (Megatron-LM,     ``r`` and ``r + p`` (loop)
               Narayanan et al. 2021)
zb             ``ScheduleZBVZeroBubble`` (Qi et al. 2024,    ``r`` and ``2p - 1 - r`` (V)
               zero bubble, V shape: split backward into
               input and weight gradients)
=============  ============================================  ===========================
"""

from __future__ import annotations

from typing import Callable

from torch.distributed import pipelining as pp

__all__ = ["SCHEDULES", "stages_per_rank", "rank_stages", "build_schedule", "check_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def stages_per_rank(schedule: str) -> int:
    """Virtual stages each rank holds under ``schedule`` (1 or 2)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return 2 if schedule in ("interleaved", "zb") else 1


def rank_stages(schedule: str, rank: int, ranks: int) -> list[int]:
    """The (virtual) stage indices rank ``rank`` of ``ranks`` holds, in order."""
    if stages_per_rank(schedule) == 1:
        return [rank]
    if schedule == "interleaved":
        return [rank, rank + ranks]
    return [rank, 2 * ranks - 1 - rank]


def check_schedule(schedule: str, ranks: int, microbatches: int, layers: int) -> None:
    """Raise ValueError (one line, naming the setting) when the engine cannot
    run ``schedule`` with ``ranks`` pipeline ranks, ``microbatches`` per step
    and a model of ``layers`` layers."""
    if microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {microbatches}")
    stages = ranks * stages_per_rank(schedule)
    if stages > layers:
        raise ValueError(f"--schedule {schedule} with --stages {ranks} needs {stages} stages, "
                         f"more than the model's {layers} layers (widen the model with --hidden)")
    if schedule == "1f1b" and microbatches < ranks:
        raise ValueError(f"--schedule 1f1b needs --microbatches >= --stages ({ranks}), got {microbatches}")
    if schedule == "interleaved":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise ValueError(f"--schedule interleaved needs --microbatches a multiple of "
                             f"{rounds} rounds, got {microbatches}")


def build_schedule(schedule: str, stages: list, microbatches: int, loss_fn: Callable):
    """The engine schedule object over this rank's ``stages`` (from :func:`rank_stages`).

    ``loss_fn(output, target)`` is averaged over micro-batches (``scale_grads``).
    """
    if schedule == "gpipe":
        return pp.ScheduleGPipe(stages[0], microbatches, loss_fn=loss_fn)
    if schedule == "1f1b":
        return pp.Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
    if schedule == "interleaved":
        return pp.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    if schedule == "zb":
        return pp.ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
