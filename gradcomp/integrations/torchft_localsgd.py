"""Local SGD and DiLoCo over the replica groups of a torchft quorum, with compressed pseudo-gradients.

Every replica group trains on its own for ``sync_every`` steps, then averages
its pseudo-gradient ``anchor - params`` over the current quorum with
:class:`~gradcomp.integrations.torchft.ManagedAllreduce` (one torchft step per
synchronisation) and updates the anchor: its mean subtracted (local SGD) or an
outer Nesterov step (DiLoCo, Douillard et al. 2023). A synchronisation that
does not commit discards the local progress since the anchor. The anchor and
the outer optimizer's state are what a healing replica fetches (register
:meth:`ManagedLocalSGD.state_dict` with the manager); see docs/fault-tolerance.md.
"""

from __future__ import annotations

import torch
from torch import nn

from gradcomp import _validate as v
from gradcomp.integrations.torchft import ManagedAllreduce
from gradcomp.localsgd import OUTER_LR, OUTER_MOMENTUM, OUTER_OPTIMIZERS

__all__ = ["ManagedLocalSGD"]


class ManagedLocalSGD:
    """Local SGD / DiLoCo whose synchronisations run on a torchft quorum.

    Call :meth:`step` after every inner optimizer step; every ``sync_every``
    steps it calls :meth:`sync`: ``manager.start_quorum()`` (a replica behind
    the quorum heals there, loading the peer's :meth:`state_dict`: anchor,
    outer optimizer state, and parameters set to the anchor), the compressed
    mean of ``anchor - params`` over the quorum (a healed replica adds zero:
    it has no local progress), ``manager.should_commit()``, then the anchor
    update and the parameters set to the new anchor, bit-identical on every
    member. Error feedback runs on the pseudo-gradient (one flat residual, see
    :class:`~gradcomp.integrations.torchft.ManagedAllreduce`). Register the
    state with ``manager.register_state_dict_fn("localsgd", ls.load_state_dict,
    ls.state_dict)``.

    Args:
        manager, pg: the ``torchft.Manager`` (``use_async_quorum=False``) and its process group.
        model: the module whose float32 CPU parameters are synchronised.
        sync_every: inner steps between synchronisations (>= 1).
        compressor: a gradcomp compressor for the pseudo-gradient.
        outer_optimizer: ``"avg"`` (local SGD) or ``"nesterov"`` (DiLoCo: SGD
            with ``lr=OUTER_LR``, Nesterov momentum ``OUTER_MOMENTUM``).
        algorithm, meter, timeout: as for ``ManagedAllreduce``.

    Raises:
        TypeError / ValueError: a bad argument (the message names it).
    """

    def __init__(self, manager, pg, model: nn.Module, *, sync_every: int, compressor,
                 outer_optimizer: str = "avg", algorithm: str = "ring", meter=None, timeout: float = 30.0):
        self.manager, self.sync_every = manager, v.integer("sync_every", sync_every, 1)
        v.choice("outer_optimizer", outer_optimizer, OUTER_OPTIMIZERS)
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(f"model parameters must be float32 CPU tensors, got {p.dtype} on {p.device}")
        self.anchor = nn.Parameter(self._flat().clone(), requires_grad=False)
        self.outer = None if outer_optimizer == "avg" else torch.optim.SGD(
            [self.anchor], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        self.allreduce = ManagedAllreduce(manager, pg, compressor, algorithm=algorithm, meter=meter,
                                          timeout=timeout)
        self.steps = 0
        #: synchronisations committed / discarded
        self.syncs = self.failed_syncs = 0

    def step(self) -> None:
        """Count one inner step; synchronise every ``sync_every`` of them."""
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> bool:
        """One synchronisation (one torchft step); returns whether it committed."""
        self.manager.start_quorum()
        delta = self.anchor.detach() - self._flat()
        mean = self.allreduce.allreduce(delta, key="pseudo_gradient")
        if not self.allreduce.commit():
            self.failed_syncs += 1
            self._load_anchor()  # the local progress since the anchor is discarded, as the step is
            return False
        with torch.no_grad():
            if self.outer is None:
                self.anchor.sub_(mean)
            else:
                self.anchor.grad = mean
                self.outer.step()
                self.anchor.grad = None
        self._load_anchor()
        self.syncs += 1
        return True

    def state_dict(self) -> dict:
        """What a healing replica needs: the anchor, the outer optimizer's state, the step count."""
        return {"anchor": self.anchor.detach().clone(), "steps": self.steps,
                "outer": None if self.outer is None else self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a peer's :meth:`state_dict`; the parameters become its anchor."""
        with torch.no_grad():
            self.anchor.copy_(state["anchor"])
        self.steps = int(state["steps"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self._load_anchor()

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _load_anchor(self) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(self.anchor[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
