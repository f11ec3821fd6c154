"""The link cost model: each allreduce algorithm's critical path in messages, bytes, seconds.

A point-to-point message of ``m`` bytes costs ``alpha + m / beta`` seconds (Hockney's model,
as Thakur, Rabenseifner and Gropp 2005 price MPICH's collectives); ``k`` messages a rank sends
at once share its one port: ``k alpha + sum(m) / beta``. An algorithm is a sequence of such
steps (:func:`transfer_steps`), its time their sum (:func:`transfer_seconds`). Wire sizes are
the compressors' own (``wire_nbytes`` over the chunks of :func:`~gradcomp.comm.chunks.chunk_bounds`).
Only transfers are priced, not the codec kernels: the model ranks algorithms for
``algorithm="auto"`` (:mod:`gradcomp.comm.auto`), whose measurements correct it; the lab's
planner (``gradcomp plan``) adds the kernels. Formulas and defaults: docs/collectives.md#auto.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradcomp import _validate as v
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.halving_doubling import fold_layout

__all__ = ["Link", "DEFAULT_LINK", "DEFAULT_INTRA_LINK", "SIZE_NBYTES", "transfer_steps",
           "transfer_seconds", "allreduce_messages"]

#: one payload size in the sparse allgather's size exchange (int64)
SIZE_NBYTES = 8


@dataclass(frozen=True)
class Link:
    """One tier's link: seconds per message and bytes per second.

    Args:
        latency_s: ``alpha``, seconds per point-to-point message (latency and
            software cost; finite, >= 0).
        bytes_per_s: ``beta``, bytes per second one rank's port carries each
            way (full duplex; > 0, ``inf`` for a link whose bytes cost nothing).

    Raises:
        TypeError / ValueError: a bad value (named in the message).
    """

    latency_s: float
    bytes_per_s: float

    def __post_init__(self):
        latency_s = v.real("latency_s", self.latency_s)
        bytes_per_s = v.real("bytes_per_s", self.bytes_per_s)
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s (seconds per message) must be a finite number >= 0, got {latency_s!r}")
        if not (bytes_per_s > 0 and not math.isnan(bytes_per_s)):
            raise ValueError(f"bytes_per_s must be a number > 0 (inf allowed), got {bytes_per_s!r}")
        object.__setattr__(self, "latency_s", float(latency_s))
        object.__setattr__(self, "bytes_per_s", float(bytes_per_s))

    def seconds(self, messages: int, nbytes: float) -> float:
        """``messages x latency_s + nbytes / bytes_per_s``."""
        return messages * self.latency_s + nbytes / self.bytes_per_s


#: the link assumed when none is given: 10 Gbit/s Ethernet (1.25e9 bytes/s) and 50 us per
#: message (a gloo point-to-point message's software cost is tens of microseconds)
DEFAULT_LINK = Link(50e-6, 1.25e9)
#: the intra-host tier assumed when none is given: 10 us per message, 1e10 bytes/s (PCIe /
#: shared memory class)
DEFAULT_INTRA_LINK = Link(10e-6, 1e10)


def _wire(compressor, numel: int) -> int:
    """Wire bytes of ``compressor``'s payload of ``numel`` float32 elements."""
    n = compressor.wire_nbytes((numel,), torch.float32)
    if n is None:
        raise ValueError(f"the cost model needs a compressor with a fixed wire size, got {compressor!r}")
    return n


def transfer_steps(algorithm: str, compressor, numel: int, world: int, *, hosts: int = 1,
                    per_host: int = 1) -> list[tuple[str, int, int]]:
    """The steps one allreduce of ``numel`` float32 elements over ``world`` ranks
    takes on its critical path, in order: ``(tier, messages, bytes)`` with tier
    ``"inter"`` or ``"intra"`` (hierarchical's host-local steps). With ``L =
    ceil(n / N)`` and ``w(m)`` the wire bytes of ``m`` elements:

    * ``ring``: ``2 (N - 1)`` steps of one message of ``w(L)``.
    * ``two_phase``: the direct reduce-scatter, ``N - 1`` messages of ``w(L)``
      at once, then the ring allgather's ``N - 1`` steps of ``w(L)``.
    * ``halving_doubling`` (``p`` the largest power of two <= N, ``L_p = ceil(n / p)``):
      with ``N > p`` first a fold step ``w(n)``; halving steps ``s = 1 .. log2 p``
      of ``w(ceil(n / 2^s))``; doubling steps of ``2^(s-1) w(L_p)``; with ``N > p``
      the fold back, ``p w(L_p)``: ``2 log2 p`` messages (+2).
    * ``allgather`` (sparse): ``N - 1`` size messages (8 bytes) then ``N - 1``
      steps forwarding a whole-tensor payload ``w(n)``.
    * ``sparse_reduce_scatter``: two-phase's steps with region payloads ``w(L)``.
    * ``hierarchical`` (``hosts`` x ``per_host`` = ``world``, shard ``s =
      ceil(n / R)``): the intra-host reduce-scatter, ``R - 1`` float32 shards
      ``4 s`` at once; the ring across hosts of the shard, ``2 (H - 1)`` steps of
      ``R w(ceil(s / H))`` (a host's ``R`` ranks share its link); the intra-host
      allgather, ``(R - 1) H`` messages of the shard's chunk payloads at once.

    Raises:
        ValueError: an unknown algorithm; ``hosts x per_host != world`` for
            ``hierarchical``; a compressor without a fixed wire size.
    """
    n, N = numel, world
    if N < 2 or n == 0:
        return []
    L = -(-n // N)
    if algorithm == "ring":
        return [("inter", 1, _wire(compressor, L))] * (2 * (N - 1))
    if algorithm in ("two_phase", "sparse_reduce_scatter"):
        w = _wire(compressor, L)
        return [("inter", N - 1, (N - 1) * w)] + [("inter", 1, w)] * (N - 1)
    if algorithm == "allgather":
        return [("inter", 1, SIZE_NBYTES)] * (N - 1) + [("inter", 1, _wire(compressor, n))] * (N - 1)
    if algorithm == "halving_doubling":
        return _halving_doubling(compressor, n, N)
    if algorithm == "hierarchical":
        return _hierarchical(compressor, n, hosts, per_host, world)
    raise ValueError(f"algorithm must be one of ('ring', 'two_phase', 'allgather', 'hierarchical', "
                     f"'halving_doubling', 'sparse_reduce_scatter'), got {algorithm!r}")


def _halving_doubling(compressor, n: int, N: int) -> list[tuple[str, int, int]]:
    p = 1 << (N.bit_length() - 1)
    levels = p.bit_length() - 1
    wl = _wire(compressor, -(-n // p))
    steps = [("inter", 1, _wire(compressor, n))] if N > p else []
    steps += [("inter", 1, _wire(compressor, -(-n // 2**s))) for s in range(1, levels + 1)]
    steps += [("inter", 1, 2 ** (s - 1) * wl) for s in range(1, levels + 1)]
    return steps + ([("inter", 1, p * wl)] if N > p else [])


def _hierarchical(compressor, n: int, H: int, R: int, N: int) -> list[tuple[str, int, int]]:
    if H * R != N or H < 1 or R < 1:
        raise ValueError(f"hierarchical needs hosts x per_host == world, got {H} x {R} != {N}")
    s = -(-n // R)
    steps = [("intra", R - 1, 4 * (R - 1) * s)] if R > 1 else []
    if H > 1:
        steps += [("inter", R, R * _wire(compressor, -(-s // H)))] * (2 * (H - 1))
    if R > 1:
        chunks = sum(_wire(compressor, hi - lo) for lo, hi in chunk_bounds(s, H)) if H > 1 else 4 * s
        steps.append(("intra", (R - 1) * H if H > 1 else R - 1, (R - 1) * chunks))
    return steps


def transfer_seconds(algorithm: str, compressor, numel: int, world: int, link: Link = DEFAULT_LINK, *,
                      intra: Link = DEFAULT_INTRA_LINK, hosts: int = 1, per_host: int = 1) -> float:
    """Predicted transfer seconds of one allreduce: the sum over
    :func:`transfer_steps` of ``messages x alpha + bytes / beta``, on ``link``
    (and ``intra`` for hierarchical's host-local steps). Hierarchical's ``R``
    messages at once in a step across hosts are the ``R`` ranks' of a host in
    parallel on its one link: they cost one ``alpha``.

    Raises:
        ValueError: as :func:`transfer_steps`.
    """
    total = 0.0
    for tier, messages, nbytes in transfer_steps(algorithm, compressor, numel, world, hosts=hosts,
                                                  per_host=per_host):
        if tier == "intra":
            total += intra.seconds(messages, nbytes)
        else:
            parallel = per_host if algorithm == "hierarchical" else 1
            total += link.seconds(messages // parallel, nbytes)
    return total


def allreduce_messages(algorithm: str, world: int, rank: int = 0) -> int:
    """Point-to-point payload messages ``rank`` sends in one flat allreduce over
    ``world`` ranks (a message cut into concurrent pieces counts once, as the
    meter counts it): ``2 (N - 1)`` for the ring, two-phase, the sparse
    reduce-scatter and the sparse allgather (``N - 1`` sizes, ``N - 1``
    payloads); halving-doubling ``2 log2 p`` (``p`` the largest power of two
    <= N), one more for a rank a folded rank hands its tensor to, 1 for the folded rank.

    Raises:
        ValueError: an unknown or non-flat algorithm.
    """
    flat = ("ring", "two_phase", "allgather", "halving_doubling", "sparse_reduce_scatter")
    if algorithm not in flat:
        raise ValueError(f"algorithm must be one of {flat}, got {algorithm!r}")
    if world == 1:
        return 0
    if algorithm != "halving_doubling":
        return 2 * (world - 1)
    p, me, partner = fold_layout(world, rank)
    if me < 0:
        return 1
    return 2 * (p.bit_length() - 1) + (1 if partner >= 0 else 0)
