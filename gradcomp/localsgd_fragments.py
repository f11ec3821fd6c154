"""The fragments of local SGD: runs of parameters synchronised together, each with its float32 memory.

:class:`gradcomp.LocalSGD` keeps one :class:`Fragment` per run of parameters that it
synchronises together (Streaming DiLoCo; one fragment for plain local SGD and DiLoCo), on
a schedule :func:`check_schedule` validates. See docs/local-sgd.md.
"""

from __future__ import annotations

import torch
from torch import nn

from gradcomp import _validate as v
from gradcomp.powersgd import Segment

__all__ = ["Fragment", "check_schedule", "cpu_copy", "partition"]


def check_schedule(sync_every, fragments=1, overlap=0) -> tuple[int, int, int]:
    """Validate a synchronisation schedule.

    Returns:
        ``(sync_every, fragments, overlap)`` as ints.

    Raises:
        TypeError: a value is not an int.
        ValueError: ``sync_every < 1``, ``fragments < 1`` or not dividing
            ``sync_every``, ``overlap < 0`` or ``overlap >= sync_every / fragments``.
    """
    sync_every = v.integer("sync_every", sync_every, 1)
    fragments = v.integer("fragments", fragments, 1)
    if sync_every % fragments:
        raise ValueError(f"fragments must divide sync_every (one fragment every sync_every / fragments "
                         f"steps), got fragments={fragments}, sync_every={sync_every}")
    overlap = v.integer("overlap", overlap, 0)
    interval = sync_every // fragments
    if overlap >= interval:
        raise ValueError(f"overlap must be < sync_every / fragments = {interval} (an exchange must be "
                         f"applied before the next one starts), got overlap={overlap}")
    return sync_every, fragments, overlap


def cpu_copy(x):
    """``x`` with every tensor inside (dicts, lists, tuples) replaced by a CPU copy."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: cpu_copy(val) for k, val in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(cpu_copy(val) for val in x)
    return x


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into ``fragments`` non-empty contiguous runs,
    each cut placed where the running element count is nearest ``k / F`` of the total."""
    total = sum(sizes)
    out: list[list[int]] = [[] for _ in range(fragments)]
    f, cum = 0, 0
    for i, n in enumerate(sizes):
        must = len(sizes) - i <= fragments - 1 - f  # one parameter left per remaining fragment
        if out[f] and f < fragments - 1 and (must or (cum + n / 2) * fragments > (f + 1) * total):
            f += 1
        out[f].append(i)
        cum += n
    return out


class Fragment:
    """One fragment's parameters and its float32 memory (anchor, residual)."""

    def __init__(self, params: list[nn.Parameter], error_feedback: bool, key: int = 0, first: int = 0):
        self.params = params
        self.key = key  # its index: the adaptive codec's key for its exchanges
        self.first = first  # the ordinal of its first parameter among the synchronised ones
        self.numel = sum(p.numel() for p in params)
        device = params[0].device
        self.anchor = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
        # the outer optimizer's parameters: views of the anchor, shaped like the model's
        self.views: list[torch.Tensor] = []
        off = 0
        for p in params:
            self.views.append(self.anchor[off:off + p.numel()].view(p.shape))
            off += p.numel()
        self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device) if error_feedback else None
        self.checked = False  # the ranks agreed on this fragment's exchange
        self.loaded_at = 0  # the step count when the anchor was last loaded into the parameters

    def segments(self) -> list[Segment]:
        """Each parameter's place in the flat pseudo-gradient (PowerSGD's matrices), keyed
        by its ordinal among the synchronised parameters (the same on every rank)."""
        return [Segment(("localsgd", self.first + i), x.storage_offset(), tuple(x.shape))
                for i, x in enumerate(self.views)]

    def pseudo_gradient(self) -> torch.Tensor:
        """``anchor - params`` as a new flat float32 tensor."""
        delta = self.anchor.clone()
        off = 0
        for p in self.params:
            delta[off:off + p.numel()].sub_(p.detach().reshape(-1).to(torch.float32))
            off += p.numel()
        return delta

    def residual_copy(self) -> torch.Tensor | None:
        """A copy of the residual (flat float32), or None (no error feedback)."""
        return None if self.residual is None else self.residual.clone()

    def divergence(self, mean: torch.Tensor, held: torch.Tensor | None = None) -> tuple[float, float]:
        """How far this rank's model went from the averaged one over the round, before :meth:`load`.

        Args:
            mean: the averaged pseudo-gradient (flat float32, on the anchor's device).
            held: the residual before the exchange (error feedback), or None: what this rank
                sent is then ``anchor - params + held - residual``, so that the codec's own
                error does not count as divergence.

        Returns:
            ``(||sent - mean||^2, ||mean||^2)`` (float64 sums), ``sent`` this rank's
            pseudo-gradient ``anchor - params`` (plus the residual's change): its squared
            distance from the averaged one, i.e. its model's from the averaged model, and
            the round's common progress.
        """
        spread = self.pseudo_gradient().sub_(mean)
        if held is not None and self.residual is not None:
            spread.add_(held).sub_(self.residual)
        norms = torch.stack([torch.linalg.vector_norm(spread, dtype=torch.float64),
                             torch.linalg.vector_norm(mean, dtype=torch.float64)])
        spread_sq, progress_sq = norms.square().tolist()  # one host sync
        return spread_sq, progress_sq

    def load(self) -> None:
        """Copy the anchor into the parameters."""
        with torch.no_grad():
            for p, a in zip(self.params, self.views):
                p.copy_(a)
