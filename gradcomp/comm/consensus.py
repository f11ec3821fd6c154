"""Numbers every rank decides from: the element-wise maximum of each rank's, in one small allreduce.

An online policy (the adaptive codec, the adaptive local SGD period) measures
timings on every rank; ranks measure differently, so each decides from the
agreed numbers instead of its own, and all reach the same decision at the
same call. A minimum is agreed as the maximum of the negated value.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradcomp.comm.guard import exclusive

__all__ = ["agree_max"]


def agree_max(local: Sequence[float], group, timeout: float, device, what: str = "gradcomp.agree_max"
              ) -> list[float]:
    """The element-wise ``MAX`` of ``local`` over ``group``'s ranks.

    Args:
        local: this rank's numbers (floats; ``-inf`` for "none").
        group: the process group; every rank calls with as many numbers.
        timeout: seconds the allreduce may take.
        device: where the float64 buffer lives (CPU for gloo, CUDA for NCCL).
        what: the caller, for error messages.

    Returns:
        The agreed numbers, identical on every rank (a single-rank group: ``local``).

    Raises:
        TimeoutError / RuntimeError: a peer did not join within ``timeout`` seconds.
    """
    agreed = torch.tensor(list(local), dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        with exclusive(group, what, timeout):
            work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=timeout))
    return agreed.tolist()
