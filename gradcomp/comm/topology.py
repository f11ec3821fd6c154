"""Which host each rank is on: the topology of the hierarchical allreduce.

A :class:`Topology` says how a rank finds its host: an explicit host id
(``host=``), contiguous blocks of ``ranks_per_host`` group ranks (torchrun's
placement), or the environment (``GRADCOMP_HOST_ID``, else torchrun's
``GROUP_RANK`` checked against ``LOCAL_WORLD_SIZE``). :func:`layout` resolves
it over a process group once: every rank sends what it knows (its host id,
the spec it was given) to every other rank, and every rank checks the same
table, so a bad topology (ranks per host that differ, a rank without a host
id, ranks given different specs) raises the same ``ValueError`` on every
rank before any payload moves. The result, a :class:`Layout` with this
rank's intra-host group (its host's ranks) and inter-host group (the rank of
the same local index on every host), is cached per group and spec.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import _validate as v

__all__ = ["Topology", "Layout", "layout", "INTER_ALGORITHMS", "HOST_ENV", "MAX_SEGMENTS", "check"]

#: algorithms of the inter-host leg (dense, fixed wire sizes)
INTER_ALGORITHMS = ("ring", "two_phase")
#: the environment variable naming this rank's host (any string)
HOST_ENV = "GRADCOMP_HOST_ID"
_KINDS = ("environment", "ranks_per_host", "host")
_FIELDS = 7  # has_host, host hash, claimed ranks per host, spec kind, spec ranks_per_host, inter algorithm, segments
#: most segments a bucket is cut into (the pipeline's depth)
MAX_SEGMENTS = 16


class Topology:
    """Where the ranks of a group are: hosts of equal size, and the inter-host algorithm.

    At most one of ``ranks_per_host`` and ``host``; with neither, each rank's
    host comes from the environment: ``GRADCOMP_HOST_ID`` (any string), else
    torchrun's ``GROUP_RANK`` (then every host must hold ``LOCAL_WORLD_SIZE``
    ranks). Every rank of a group must pass an equal spec (the same
    ``ranks_per_host``, or ``host=`` everywhere, or the environment
    everywhere) and the same ``inter_algorithm``.

    Args:
        ranks_per_host: group ranks ``[h R, (h + 1) R)`` are host ``h``
            (torchrun's placement); must divide the group size.
        host: this rank's host id (str or int; ranks with equal ids share a host).
        inter_algorithm: the compressed allreduce across hosts, ``"ring"`` or
            ``"two_phase"`` (see :func:`gradcomp.allreduce`).
        segments: pieces a bucket is cut into so that the intra-host steps
            of one overlap the inter-host leg of another (1 to 16; None: by
            size, see :func:`gradcomp.comm.hierarchical.segment_bounds`; 1: no overlap).

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
    """

    def __init__(self, ranks_per_host: int | None = None, *, host: str | int | None = None,
                 inter_algorithm: str = "ring", segments: int | None = None):
        if ranks_per_host is not None and host is not None:
            raise ValueError("give at most one of ranks_per_host and host")
        if ranks_per_host is not None:
            ranks_per_host = v.integer("ranks_per_host", ranks_per_host, 1)
        if host is not None and (isinstance(host, bool) or not isinstance(host, (str, int))):
            raise TypeError(f"host must be a str, an int or None, got {type(host).__name__}")
        if host is not None and not str(host).strip():
            raise ValueError("host must be a non-empty id, got an empty string")
        self.ranks_per_host = ranks_per_host
        self.host = None if host is None else str(host)
        self.inter_algorithm = v.choice("inter_algorithm", inter_algorithm, INTER_ALGORITHMS)
        self.segments = None if segments is None else v.integer("segments", segments, 1, MAX_SEGMENTS)

    @property
    def kind(self) -> str:
        """Where the host ids come from: ``"environment"``, ``"ranks_per_host"`` or ``"host"``."""
        if self.ranks_per_host is not None:
            return "ranks_per_host"
        return "host" if self.host is not None else "environment"

    def key(self) -> tuple:
        """What identifies this spec on this rank (the layout cache's key)."""
        return (self.kind, self.ranks_per_host, self.host, self.inter_algorithm, self.segments)

    def own_host(self, group_rank: int) -> tuple[str | None, int]:
        """This rank's host id (None: unknown) and the ranks per host it claims (-1: none)."""
        if self.ranks_per_host is not None:
            return f"block:{group_rank // self.ranks_per_host}", -1
        if self.host is not None:
            return f"host:{self.host}", -1
        env = os.environ.get(HOST_ENV, "").strip()
        if env:
            return f"env:{env}", -1
        node = os.environ.get("GROUP_RANK", "").strip()
        if node:
            local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
            return f"torchrun:{node}", int(local) if local.isdigit() else -1
        return None, -1

    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        spec = (f"ranks_per_host={self.ranks_per_host}" if self.ranks_per_host is not None
                else f"host={self.host!r}" if self.host is not None else "from the environment")
        return f"Topology({spec}, inter_algorithm={self.inter_algorithm!r}, segments={self.segments})"


@dataclass(frozen=True)
class Layout:
    """A resolved topology, the same on every rank of the group (groups aside).

    Attributes:
        hosts: the group ranks of each host, hosts ordered by their lowest rank.
        host: this rank's host index. local_rank: its index within its host.
        intra: process group of this rank's host (None with one rank per host).
        inter: process group of the ``local_rank``-th rank of every host (None with one host).
        inter_algorithm: ``"ring"`` or ``"two_phase"``.
        segments: the spec's ``segments`` (None: by size).
    """

    hosts: tuple[tuple[int, ...], ...]
    host: int
    local_rank: int
    intra: object
    inter: object
    inter_algorithm: str
    segments: int | None = None

    @property
    def host_count(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0])


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def layout(group, topology: Topology | None, timeout: float, device="cpu") -> Layout:
    """The :class:`Layout` of ``group`` under ``topology`` (None: from the environment),
    resolved and its groups built on the first call, cached afterwards.

    Collective on the first call for a (group, spec): every rank of ``group``
    must call it (it exchanges 56 bytes with every rank, then builds the
    subgroups with ``dist.new_group``).

    Raises:
        ValueError: the ranks gave different specs, a rank has no host id,
            hosts hold different numbers of ranks, or ``ranks_per_host`` does
            not divide the group (the same message on every rank).
        TimeoutError / RuntimeError: a rank did not take part within ``timeout`` seconds.
    """
    topology = Topology() if topology is None else topology
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
    key = topology.key()
    with _LOCK:
        found = _CACHE.get(group, {}).get(key)
    if found is not None:
        return found
    table = _exchange(group, topology, timeout, device)
    hosts = check(table, topology)
    rank = dist.get_rank(group)
    host = next(h for h, members in enumerate(hosts) if rank in members)
    intra, inter = _build_groups(group, hosts, host, hosts[host].index(rank), timeout)
    out = Layout(hosts, host, hosts[host].index(rank), intra, inter, topology.inter_algorithm, topology.segments)
    with _LOCK:
        _CACHE.setdefault(group, {})[key] = out
    return out


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _exchange(group, topology: Topology, timeout: float, device) -> list[tuple[int, ...]]:
    """Every rank's row (:data:`_FIELDS` int64s), indexed by group rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    host, claim = topology.own_host(rank)
    row = [int(host is not None), _hash(host) if host is not None else 0, claim,
           _KINDS.index(topology.kind), topology.ranks_per_host or 0,
           INTER_ALGORITHMS.index(topology.inter_algorithm), topology.segments or 0]
    if world == 1:
        return [tuple(row)]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    out = torch.empty(world * _FIELDS, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = gather(out, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            raise TimeoutError(f"gradcomp topology: rank {rank} of {world} did not hear from every rank "
                               f"within {timeout} s: {e}") from e
        raise
    vals = out.view(world, _FIELDS).tolist()
    return [tuple(r) for r in vals]


def _spec(row) -> str:
    kind = _KINDS[row[3]]
    what = {"environment": "the environment", "host": "host=...",
            "ranks_per_host": f"ranks_per_host={row[4]}"}[kind]
    return f"Topology({what}, inter_algorithm={INTER_ALGORITHMS[row[5]]!r}, segments={row[6] or None})"


def check(table: list[tuple[int, ...]], topology: Topology | None = None) -> tuple[tuple[int, ...], ...]:
    """The hosts (group ranks of each, ordered by lowest rank) of an exchanged
    table, or the ValueError every rank raises alike.

    Args:
        table: per group rank, ``(has_host, host hash, claimed ranks per host,
            spec kind, spec ranks_per_host, inter algorithm, segments or 0)``.
    """
    specs: dict[str, list[int]] = {}
    for r, row in enumerate(table):
        specs.setdefault(_spec(row), []).append(r)
    if len(specs) > 1:
        raise ValueError("hierarchical allreduce: the ranks passed different topologies: "
                         + "; ".join(f"ranks {rs} {s}" for s, rs in specs.items()))
    missing = [r for r, row in enumerate(table) if not row[0]]
    if missing:
        raise ValueError(f"hierarchical allreduce: ranks {missing} of {len(table)} have no host id: set "
                         f"{HOST_ENV}, launch with torchrun (which sets GROUP_RANK and LOCAL_WORLD_SIZE), or "
                         "pass topology=gradcomp.Topology(ranks_per_host=R) or Topology(host=...)")
    per = table[0][4]
    if per and len(table) % per:
        raise ValueError(f"hierarchical allreduce: ranks_per_host={per} does not divide the group's "
                         f"{len(table)} ranks")
    by_host: dict[int, list[int]] = {}
    for r, row in enumerate(table):
        by_host.setdefault(row[1], []).append(r)
    hosts = tuple(tuple(rs) for rs in sorted(by_host.values(), key=lambda rs: rs[0]))
    sizes = {len(h) for h in hosts}
    if len(sizes) > 1:
        raise ValueError("hierarchical allreduce: hosts hold different numbers of ranks ("
                         + ", ".join(f"ranks {list(h)}: {len(h)}" for h in hosts)
                         + "); every host must hold the same number")
    wrong = [r for r, row in enumerate(table) if row[2] not in (-1, len(hosts[0]))]
    if wrong:
        raise ValueError(f"hierarchical allreduce: ranks {wrong} have LOCAL_WORLD_SIZE "
                         f"{sorted({table[r][2] for r in wrong})} but their hosts hold {len(hosts[0])} ranks each")
    return hosts


def _build_groups(group, hosts, host: int, local: int, timeout: float):
    """This rank's intra-host and inter-host process groups (None where one rank)."""
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    span = datetime.timedelta(seconds=timeout)

    def make(members):
        if len(members) == 1:
            return None
        return dist.new_group(sorted(ranks[g] for g in members), backend=backend, timeout=span,
                              use_local_synchronization=True)

    intra = make(hosts[host])
    inter = make([h[local] for h in hosts])
    return intra, inter
