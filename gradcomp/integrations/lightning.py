"""PyTorch Lightning: a DDP strategy that runs gradcomp's compressed allreduce hook on every device.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers the
hook on CUDA devices only (a limit from PyTorch 1.8 that gloo no longer has): with
``accelerator="cpu"`` it trains, uncompressed, and the meter reads 0.
:class:`GradCompDDPStrategy` registers the hook on any device (CPU and gloo
included). Needs the ``integrations`` extra (``pip install "gradcomp[integrations]"``).
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradcomp.ddp import GradCompState, compressed_allreduce_hook

__all__ = ["GradCompDDPStrategy"]


class GradCompDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with gradcomp's :func:`~gradcomp.ddp.compressed_allreduce_hook`
    registered on the DDP model whatever its device.

    Args:
        state: the hook's :class:`~gradcomp.ddp.GradCompState` (it may be made
            before ``torch.distributed`` is initialised: it makes its group at
            the first bucket).
        **kwargs: the other ``DDPStrategy`` arguments (``process_group_backend``, ...).

    Raises:
        TypeError: ``state`` is not a GradCompState, or ``ddp_comm_hook`` /
            ``ddp_comm_state`` are given too.
    """

    def __init__(self, state: GradCompState, **kwargs):
        if not isinstance(state, GradCompState):
            raise TypeError(f"state must be a gradcomp.ddp.GradCompState, got {type(state).__name__}")
        clash = sorted({"ddp_comm_hook", "ddp_comm_state"} & set(kwargs))
        if clash:
            raise TypeError(f"GradCompDDPStrategy sets {', '.join(clash)} itself: pass the state only")
        super().__init__(ddp_comm_state=state, ddp_comm_hook=compressed_allreduce_hook, **kwargs)

    def _register_ddp_hooks(self) -> None:
        # Lightning's own method returns without registering unless the device is CUDA
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(f"expected a DistributedDataParallel model, got {type(self.model).__name__}")
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)
