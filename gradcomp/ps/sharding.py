"""Placement of named parameters on server ranks, balanced by bytes."""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gradcomp import _validate as v

__all__ = ["ParamSpec", "param_specs", "shard_parameters", "layout_checksum", "named_tensors"]


@dataclass(frozen=True)
class ParamSpec:
    """Name and shape of one parameter; ``index`` is its position in the model.

    ``nbytes`` is its float32 size in bytes (``4 * numel``): the servers hold
    float32 parameters whatever the workers compute in.
    """

    name: str
    shape: tuple[int, ...]
    index: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def named_tensors(params, argname: str = "params") -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from an ``nn.Module`` (its ``named_parameters()``) or a
    mapping of names to floating tensors.

    Raises:
        TypeError: ``params`` is neither, or holds a non-floating tensor.
        ValueError: it holds no parameter.
    """
    if isinstance(params, torch.nn.Module):
        out = dict(params.named_parameters())
    elif isinstance(params, Mapping):
        out = {}
        for k, t in params.items():
            if not isinstance(k, str):
                raise TypeError(f"{argname} keys must be parameter names (str), got {type(k).__name__}")
            out[k] = v.tensor(f"{argname}[{k!r}]", t)
    else:
        raise TypeError(f"{argname} must be an nn.Module or a mapping of names to tensors, "
                        f"got {type(params).__name__}")
    if not out:
        raise ValueError(f"{argname} holds no parameter")
    return out


def param_specs(tensors: Mapping[str, torch.Tensor]) -> list[ParamSpec]:
    """The :class:`ParamSpec` of each named tensor, in the mapping's order."""
    return [ParamSpec(name, tuple(int(d) for d in t.shape), i) for i, (name, t) in enumerate(tensors.items())]


def shard_parameters(specs: list[ParamSpec], num_servers: int) -> list[list[ParamSpec]]:
    """Assign whole parameters to ``num_servers`` servers, balancing bytes.

    Greedy largest-first (the LPT rule of Graham 1969, as in the parameter
    server of Li et al. 2014, which keys ranges of parameters to servers):
    parameters sorted by decreasing size (ties: model order) each go to the
    server holding the fewest bytes so far (ties: the lowest server index).
    The result is deterministic, so every rank computes the same placement.

    Args:
        specs: the parameters, in model order.
        num_servers: number of server ranks (>= 1, <= number of parameters).

    Returns:
        One list per server, each in model order.

    Raises:
        ValueError: ``num_servers`` out of range, or duplicate names.
    """
    num_servers = v.integer("num_servers", num_servers, 1)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    if num_servers > len(specs):
        raise ValueError(f"num_servers must be <= the number of parameters ({len(specs)}) so that "
                         f"every server holds one, got {num_servers}")
    load = [0] * num_servers
    shards: list[list[ParamSpec]] = [[] for _ in range(num_servers)]
    for s in sorted(specs, key=lambda s: (-s.nbytes, s.index)):
        i = min(range(num_servers), key=lambda j: (load[j], j))
        shards[i].append(s)
        load[i] += s.nbytes
    return [sorted(sh, key=lambda s: s.index) for sh in shards]


def layout_checksum(shard: list[ParamSpec]) -> int:
    """CRC-32 of a shard's names and shapes: workers stamp it on every request so
    a server rejects messages built for another placement."""
    text = ";".join(f"{s.name}:{','.join(map(str, s.shape))}" for s in shard)
    return zlib.crc32(text.encode())
