"""One FSDP2 module's trainable parameters as its reduce-scatter lays them out.

FSDP2 lays every parameter's gradient, padded on dim 0 to a multiple of the
shard group's size ``N``, into one flat buffer of ``N`` chunks (chunk ``j``:
every parameter's shard ``j``, in the parameter group's order). A step may
leave some parameters without a gradient; :meth:`ModuleLayout.layout` tells
from the buffer's size which ones took part, or None when that is ambiguous,
so error feedback (docs/fsdp2.md) never applies one parameter's residual to another.
"""

from __future__ import annotations

import math

__all__ = ["ModuleLayout", "unique_subset", "MAX_LAYOUTS"]

#: an ambiguous layout search stops at this many distinct partial sums
MAX_LAYOUTS = 4096


class ModuleLayout:
    """One FSDP module's parameters, in FSDP's reduce-scatter order."""

    def __init__(self, name: str, param_group, names: dict[int, str]):
        self.name = name
        self.param_group = param_group
        self.device = param_group.device
        self._names = names

    def params(self, world: int) -> list[tuple[str, tuple, int, int]]:
        """``(name, shape, shard_dim, S_p)`` of each trainable parameter, ``S_p``
        its elements per chunk (FSDP pads dim 0 to a multiple of ``world``)."""
        out = []
        for i, fp in enumerate(self.param_group.fsdp_params):
            p = fp.sharded_param
            if not p.requires_grad:
                continue
            shape, dim = tuple(p.shape), fp.fsdp_placement.dim
            if dim == 0:
                per = math.ceil(shape[0] / world) * math.prod(shape[1:]) if shape else 1
            else:
                per = math.prod(shape) // world
            out.append((self._names.get(id(p), f"{self.name}#{i}"), shape, dim, per))
        return out

    def details(self) -> dict[str, str]:
        """What the ranks agree on at :func:`apply`: the module's name and, in FSDP's order, each
        parameter's name, shape, dtype, the dtype FSDP reduces it in, shard dim and whether it trains."""
        policy, out = self.param_group.mp_policy, {"FSDP module": self.name or "<root>"}
        for i, fp in enumerate(self.param_group.fsdp_params):
            p = fp.sharded_param
            out[f"parameter {i}"] = (f"{self._names.get(id(p), '?')}: shape {tuple(p.shape)}, {p.dtype} (reduced in "
                                     f"{policy.reduce_dtype or policy.param_dtype or p.dtype}), shard dim "
                                     f"{fp.fsdp_placement.dim}" + ("" if p.requires_grad else ", frozen"))
        return out

    def layout(self, n: int, world: int, rank: int) -> list[tuple[tuple, int, int]] | None:
        """``(residual key, lo, hi)`` of each parameter in an input of ``n``
        elements (its columns ``[lo, hi)`` of each chunk), or None when more
        than one subset of the trainable parameters fits."""
        params = self.params(world)
        chosen = unique_subset([p[3] for p in params], n // world)
        if chosen is None:
            return None
        out, off = [], 0
        for i, (name, shape, dim, per) in enumerate(params):
            if i in chosen:
                out.append(((name, shape, dim, world, rank), off, off + per))
                off += per
        return out


def unique_subset(sizes: list[int], total: int) -> set[int] | None:
    """Indices of the one subset of ``sizes`` (kept in order) summing to
    ``total``; None if there are none or several (or too many to tell)."""
    if sum(sizes) == total:
        return set(range(len(sizes)))
    # sum -> (count of subsets reaching it, capped at 2; one subset reaching it)
    reach: dict[int, tuple[int, frozenset]] = {0: (1, frozenset())}
    for i, s in enumerate(sizes):
        nxt = dict(reach)
        for t, (c, sub) in reach.items():
            if t + s > total:
                continue
            c0, sub0 = nxt.get(t + s, (0, None))
            nxt[t + s] = (min(2, c0 + c), sub0 if sub0 is not None else sub | {i})
        reach = nxt
        if len(reach) > MAX_LAYOUTS:
            return None
    count, sub = reach.get(total, (0, None))
    return set(sub) if count == 1 else None
