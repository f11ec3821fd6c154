"""The cost of one compressed allreduce of a bucket: wire bytes, messages, quantizations, seconds.

The parts the step-time model (:mod:`gradcomp.lab.plan.model`) adds up, per algorithm of
:mod:`gradcomp.comm`, each following what the transport does step by step (the formulas are in
:func:`allreduce_bytes` and :func:`allreduce_seconds`; docs/planning.md). A point-to-point
message of ``m`` bytes takes ``alpha + m / beta`` seconds (``alpha``: per-message latency and
software cost; ``beta``: link bytes per second, full duplex); a rank sending to several peers at
once shares its one link (one port): ``k`` concurrent messages cost ``k alpha + sum(m) / beta``
(Hockney's model as Thakur, Rabenseifner and Gropp 2005 use it for MPICH's collectives). Wire
sizes are exact: every payload's size comes from the compressors' ``wire_nbytes``
(:mod:`gradcomp.wire`) over the exact chunks of :func:`gradcomp.comm.chunks.chunk_bounds`. A
codec operation on ``m`` elements takes ``call_s + m / rate`` (:class:`~gradcomp.lab.plan.profile.Profile`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Protocol

import torch

from gradcomp.comm.cost import SIZE_NBYTES, allreduce_messages  # the library's, re-exported for the model
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.halving_doubling import gathered_offsets
from gradcomp.comm.halving_doubling import fold_layout as hd_layout
from gradcomp.lab.plan.profile import BYTES_PER_ELEMENT, Profile


__all__ = ["ALLREDUCE_ALGORITHMS", "SIZE_NBYTES", "PricedCodec", "wire_nbytes", "allreduce_bytes",
           "allreduce_messages", "quantizations", "compress_s", "decompress_add_s", "allreduce_seconds"]


class PricedCodec(Protocol):
    """What the costs read of a codec (:class:`gradcomp.lab.plan.codecs.PlanCodec` has it)."""

    name: str
    kind: str
    values: str
    density: float
    error_feedback: bool
    compact_indices: bool

    @property
    def sparse(self) -> bool: ...

    @property
    def algorithms(self) -> tuple[str, ...]: ...

    def compressor(self, numel: int): ...


#: the allreduce algorithms of :mod:`gradcomp.comm` the model prices
ALLREDUCE_ALGORITHMS = ("ring", "two_phase", "allgather", "halving_doubling", "sparse_reduce_scatter")


@lru_cache(maxsize=4096)
def wire_nbytes(c: PricedCodec, numel: int) -> int:
    """Exact wire bytes of ``c``'s payload of a 1-D float32 tensor of ``numel`` elements."""
    return c.compressor(numel).wire_nbytes((numel,), torch.float32)


def _chunk_lens(numel: int, world: int) -> list[int]:
    return [hi - lo for lo, hi in chunk_bounds(numel, world)]


@lru_cache(maxsize=4096)
def allreduce_bytes(c: PricedCodec, algorithm: str, numel: int, world: int, rank: int = 0) -> tuple[int, int]:
    """``(sent, received)`` wire bytes at ``rank`` for one allreduce of ``numel`` elements.

    Dense (``ring``, ``two_phase``: the same bytes sent): the reduce-scatter
    sends every chunk but ``rank``'s and receives ``N - 1`` payloads of chunk
    ``rank`` (two-phase) or every chunk but ``rank - 1``'s (ring: in step ``s``
    chunk ``rank - s - 2``); the allgather sends every chunk but ``rank + 1``'s
    and receives every chunk but ``rank``'s. Sparse ``allgather``: ``N - 1``
    whole-tensor payloads forwarded each way plus ``8 (N - 1)`` bytes of sizes.
    ``sparse_reduce_scatter``: two-phase's formula with top-k region payloads.
    ``halving_doubling``: step by step over its schedule
    (:func:`_halving_doubling_bytes`).

    Raises:
        ValueError: an algorithm that does not take this codec.
    """
    if algorithm not in c.algorithms or algorithm not in ALLREDUCE_ALGORITHMS:
        allowed = tuple(a for a in c.algorithms if a in ALLREDUCE_ALGORITHMS)
        raise ValueError(f"algorithm for {c.name} must be one of {allowed}, got {algorithm!r}")
    if world == 1:
        return 0, 0
    if algorithm == "allgather":
        p = wire_nbytes(c, numel)
        return (world - 1) * (p + SIZE_NBYTES), (world - 1) * (p + SIZE_NBYTES)
    if algorithm == "halving_doubling":
        return _halving_doubling_bytes(c, numel, world, rank)
    lens = _chunk_lens(numel, world)
    w = [wire_nbytes(c, n) for n in lens]
    total = sum(w)
    sent = (total - w[rank]) + (total - w[(rank + 1) % world])
    ag_received = total - w[rank]  # every chunk but this rank's own
    if algorithm in ("two_phase", "sparse_reduce_scatter"):
        return sent, (world - 1) * w[rank] + ag_received  # N - 1 payloads of chunk rank
    return sent, (total - w[(rank - 1) % world]) + ag_received  # ring: chunks rank-2, ..., rank


def _halving_doubling_bytes(c: PricedCodec, numel: int, world: int, rank: int) -> tuple[int, int]:
    """``(sent, received)`` of :func:`allreduce_bytes` for ``halving_doubling``:
    the halving steps' halves, the doubling steps' blocks of owners' payloads
    (each padded to 8 bytes), and the fold messages of a folded pair."""
    p, me, partner = hd_layout(world, rank)
    lens = _chunk_lens(numel, p)
    offsets = gathered_offsets([wire_nbytes(c, m) for m in lens])
    if me < 0:  # folded: its tensor out, every owner's payload back
        return wire_nbytes(c, numel), offsets[-1]
    sent = received = 0
    a, b, d = 0, p, p // 2
    while d >= 1:  # recursive halving: give one half of [a, b), keep the other
        give, keep = ((a, a + d), (a + d, b)) if me & d else ((a + d, b), (a, a + d))
        sent += wire_nbytes(c, sum(lens[give[0]:give[1]]))
        received += wire_nbytes(c, sum(lens[keep[0]:keep[1]]))
        a, b = keep
        d //= 2
    d = 1
    while d < p:  # recursive doubling: blocks of d owners' payloads
        mine, theirs = (me // d) * d, ((me ^ d) // d) * d
        sent += offsets[mine + d] - offsets[mine]
        received += offsets[theirs + d] - offsets[theirs]
        d *= 2
    if partner >= 0:
        sent, received = sent + offsets[-1], received + wire_nbytes(c, numel)
    return sent, received


def quantizations(algorithm: str, world: int) -> int:
    """The most compressions a rank's contribution to an element of the result
    goes through (each adds its quantization error): the ring ``N`` (``N - 1``
    hops and the owner's), two-phase 2, the sparse allgather 1, the sparse
    reduce-scatter 2 (the sender's selection and the owner's re-selection),
    halving-doubling ``log2 p + 1`` (``log2 p`` halving steps and the owner's),
    plus 1 when N is not a power of two (a folded rank's own).

    Raises:
        ValueError: an unknown algorithm.
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALLREDUCE_ALGORITHMS}, got {algorithm!r}")
    if world == 1:
        return 0
    if algorithm == "halving_doubling":
        p = 1 << (world.bit_length() - 1)
        return (p.bit_length() - 1) + 1 + (1 if world > p else 0)
    return {"ring": world, "two_phase": 2, "allgather": 1, "sparse_reduce_scatter": 2}[algorithm]



def compress_s(c: PricedCodec, prof: Profile, n: int, ef: bool) -> float:
    """Seconds to compress ``n`` elements (dense) or a whole ``n``-element tensor
    (sparse: selection, values, error feedback when ``ef``)."""
    if c.sparse:
        k = max(1, math.ceil(c.density * n))
        t = prof.seconds(f"{c.kind}.select", n)
        t += prof.seconds("int8.compress", k) if c.values == "int8" else 0.0
        return t + (prof.seconds("ef.update", n) if ef else 0.0)
    if ef and f"{c.kind}.compress_ef" in BYTES_PER_ELEMENT:  # the fused error-feedback kernel
        return prof.seconds(f"{c.kind}.compress_ef", n)
    return prof.seconds(f"{c.kind}.compress", n)


def decompress_add_s(c: PricedCodec, prof: Profile, n: int) -> float:
    """Seconds to add the decoding of an ``n``-element tensor's payload (sparse: its ``k`` values;
    a top-k payload with int8 values and compact indices at the profile's measured
    ``sparse.payload_decompress_add``, the whole call with its index decoding, where it has one)."""
    if c.sparse:
        k = max(1, math.ceil(c.density * n))
        whole = "sparse.payload_decompress_add"
        if c.values == "int8" and c.compact_indices and whole in prof.kernels:
            return prof.seconds(whole, k)
        return prof.seconds("sparse.decompress_add", k) + (
            prof.seconds("int8.decompress", k) if c.values == "int8" else 0.0)
    return prof.seconds(f"{c.kind}.decompress_add", n)


def allreduce_seconds(c: PricedCodec, algorithm: str, numel: int, world: int, alpha: float, beta: float,
                      prof: Profile, share: float = 1.0, skew: float = 0.0, local_ranks: int = 1,
                      intra: tuple[float, float] | None = None) -> dict:
    """Time of one compressed allreduce of ``numel`` float32 elements.

    A bucket of n elements over N ranks (chunks of
    ``L = ceil(n / N)`` elements, ``w`` = wire bytes of a chunk, ``hop = alpha + w / beta``;
    ``c``, ``rc``, ``d``, ``da`` = compress, decompress-add-recompress,
    decompress, decompress-add of one chunk), following what
    :mod:`gradcomp.comm` does step by step:

    * ``ring`` (:mod:`gradcomp.comm.ring`): ``c + (N - 1) hop + (N - 1) rc``
      (compress one chunk; ``N - 1`` hops, after each the received partial sum is
      decompressed, added and requantized, the owner's final one included), then
      the allgather ``hop + (N - 2) max(hop, d) + d`` (each received chunk is
      decompressed while the next one travels). Bytes sent per rank: the
      ``N - 1`` chunks of each phase; each element is quantized ``N`` times.
    * ``two_phase`` (:mod:`gradcomp.comm.two_phase`): ``(N - 1) c`` (every
      foreign chunk compressed once, before sending) ``+ (N - 1) alpha + (N - 1) w / beta``
      (direct exchange, one port) ``+ (N - 2) da + rc``, then the same allgather.
      Same bytes as the ring, two quantizations.
    * ``allgather`` (sparse, :mod:`gradcomp.comm.allgather`): ``[ef] + select(n) +
      values(k)``, the size exchange ``(N - 1) (alpha + 8 / beta)``, the payloads
      forwarded around the ring ``(N - 1) (alpha + P / beta)`` (``P``: the whole
      tensor's sparse payload), then ``N`` decompress-adds of ``k`` elements:
      each rank receives ``(N - 1) P`` bytes, growing with ``N`` where the dense
      ring's ``2 (N - 1) / N`` stays flat.
    * ``sparse_reduce_scatter`` (:mod:`gradcomp.comm.sparse_reduce_scatter`):
      two-phase's exchange with region payloads ``w`` (top-k of ``L`` elements):
      ``(N - 1) c + (N - 1) alpha + (N - 1) w / beta + (N - 1) da + c`` (the
      owner's re-selection), then the ring allgather of region payloads. Bytes
      sent per rank: ``N - 1`` region payloads per phase, about ``2 (N - 1) / N P``.
    * ``halving_doubling`` (:mod:`gradcomp.comm.halving_doubling`; ``p`` the
      largest power of two <= N, ``l = log2 p``, ``L = n / p``): halving steps
      ``s = 1 .. l`` each ``c(n / 2^s) + alpha + w(n / 2^s) / beta + da(n / 2^s)``
      (the last one's ``da`` fused into the owner's ``rc(L)``), doubling steps
      each ``max(alpha + 2^(s-1) w(L) / beta, decoding the last block)``; with
      ``N > p`` the folded rank's ``c(n) + alpha + w(n) / beta + da(n)`` before
      and ``alpha + p w(L) / beta + p d(L)`` after. ``2 l`` messages per rank
      (+2 on a folded pair's path) against the ring's ``2 (N - 1)``; bytes per
      rank ``2 (p - 1) / p`` of the tensor's payload, as the ring's.

    Args:
        alpha: seconds per message; beta: link bytes per second.
        share: slowdown of the codec kernels by processor sharing
            (:meth:`gradcomp.lab.plan.host.Host.share`, 1 with a core per rank).
        skew: seconds each exchange step waits for a descheduled peer,
            hidden behind a longer transfer (:meth:`gradcomp.lab.plan.host.Host.skew_s`).
        local_ranks: ``R`` ranks per host of a two-tier cluster (ranks of a host
            consecutive; ``beta`` is then the host's link, ``alpha`` its latency).
            The ring's (and the sparse allgather's) steps cross the link once per
            host, as with one rank per host; a direct exchange (two-phase, the
            sparse reduce-scatter) puts ``R (N - R)`` of its chunks on each
            host's link instead of ``N - 1`` on a rank's; a halving-doubling step
            between hosts carries the ``R`` ranks' messages on one link, a step
            inside a host costs ``intra``'s ``alpha_i + m / beta_i``.
        intra: ``(alpha_i, beta_i)`` of the intra-host tier (default: no cost).

    Returns:
        ``{"total": s, "kernel": s, "transfer": s}`` (``transfer`` counts the
        alphas and bytes on the critical path, ``kernel`` the codec work
        that is not hidden behind a transfer).
    """
    if world == 1 or numel == 0:
        return {"total": 0.0, "kernel": 0.0, "transfer": 0.0}
    ef = c.error_feedback

    def step(nbytes: float, messages: int = 1) -> float:  # one exchange step
        return messages * alpha + max(skew, nbytes / beta)

    r = local_ranks if world % max(1, local_ranks) == 0 else 1
    off_host = r * (world - r)  # chunks of a direct exchange crossing one host's link (N - 1 when R = 1)

    if algorithm == "allgather":
        p = wire_nbytes(c, numel)
        transfer = (world - 1) * step(SIZE_NBYTES) + (world - 1) * step(p)
        kernel = share * (compress_s(c, prof, numel, ef) + world * decompress_add_s(c, prof, numel))
        return {"total": transfer + kernel, "kernel": kernel, "transfer": transfer}
    if algorithm == "halving_doubling":
        return _halving_doubling_seconds(c, numel, world, _tier_steps(step, r, intra, skew), prof, share)
    if algorithm == "sparse_reduce_scatter":
        return _sparse_reduce_scatter_seconds(c, numel, world, step, prof, share, off_host)
    if algorithm not in ("ring", "two_phase"):
        raise ValueError(f"algorithm must be one of {ALLREDUCE_ALGORITHMS}, got {algorithm!r}")
    L = -(-numel // world)
    w = wire_nbytes(c, L)
    hop = step(w)
    rc = share * prof.seconds(f"{c.kind}.reduce_compress", L)
    d = share * prof.seconds(f"{c.kind}.decompress", L)
    if algorithm == "ring":
        rs_transfer = (world - 1) * hop
        rs_kernel = share * compress_s(c, prof, L, ef) + (world - 1) * rc
    else:
        rs_transfer = step(off_host * w, world - 1)
        rs_kernel = share * ((world - 1) * compress_s(c, prof, L, ef)
                             + (world - 2) * decompress_add_s(c, prof, L)) + rc
    ag = hop + (world - 2) * max(hop, d) + d
    ag_transfer = (world - 1) * hop
    total = rs_transfer + rs_kernel + ag
    return {"total": total, "kernel": total - rs_transfer - ag_transfer, "transfer": rs_transfer + ag_transfer}


def _tier_steps(step, local_ranks: int, intra: tuple[float, float] | None, skew: float):
    """A halving-doubling step ``(nbytes, distance)``: between hosts (``distance >= R``, the
    host's ``R`` ranks sending at once on its link) or inside one (the intra-host tier)."""
    alpha_i, beta_i = intra if intra is not None else (0.0, math.inf)

    def tier_step(nbytes: float, distance: int) -> float:
        if distance >= local_ranks:
            return step(local_ranks * nbytes)
        return alpha_i + max(skew, nbytes / beta_i)
    return tier_step


def _halving_doubling_seconds(c: PricedCodec, numel: int, world: int, step, prof: Profile, share: float) -> dict:
    """:func:`allreduce_seconds` of ``halving_doubling`` on its longest path (a
    fold partner's when ``world`` is not a power of two; see the module docstring)."""
    p = 1 << (world.bit_length() - 1)
    levels = p.bit_length() - 1
    L = -(-numel // p)
    w = wire_nbytes(c, L)
    folded = world > p
    transfer = kernel = 0.0
    if folded:  # the folded rank's whole tensor, added by its partner
        transfer += step(wire_nbytes(c, numel), p)
        kernel += share * (compress_s(c, prof, numel, c.error_feedback) + decompress_add_s(c, prof, numel))
    for s in range(1, levels + 1):  # halving: compress the half given, add the half received
        m = -(-numel // 2**s)
        transfer += step(wire_nbytes(c, m), p >> s)  # halving: partner at distance p / 2^s
        kernel += share * compress_s(c, prof, m, c.error_feedback and s == 1 and not folded)
        kernel += share * (decompress_add_s(c, prof, m) if s < levels else 0.0)
    kernel += share * prof.seconds(f"{c.kind}.reduce_compress", L)  # the owner's, fused with the last add
    d = share * prof.seconds(f"{c.kind}.decompress", L)
    waits = 0.0
    for s in range(1, levels + 1):  # doubling: blocks of 2^(s-1) payloads, the last block decoded meanwhile
        hop = step(2 ** (s - 1) * w, 2 ** (s - 1))  # doubling: partner at distance 2^(s-1)
        transfer += hop
        waits += max(0.0, 2 ** (s - 2) * d - hop) if s > 1 else 0.0
    kernel += waits + (p // 2) * d
    if folded:  # every owner's payload back to the folded rank, which decodes them all
        transfer += step(p * w, p)
        kernel += p * d
    return {"total": transfer + kernel, "kernel": kernel, "transfer": transfer}


def _sparse_reduce_scatter_seconds(c: PricedCodec, numel: int, world: int, step, prof: Profile,
                                   share: float, off_host: int) -> dict:
    """:func:`allreduce_seconds` of ``sparse_reduce_scatter``: the direct exchange of
    region payloads, the owner's re-selection, the ring allgather of region payloads."""
    L = -(-numel // world)
    w = wire_nbytes(c, L)
    ef = c.error_feedback
    rs_transfer = step(off_host * w, world - 1)
    rs_kernel = share * ((world - 1) * compress_s(c, prof, L, ef) + (world - 1) * decompress_add_s(c, prof, L)
                         + compress_s(c, prof, L, ef))  # every other region's selection, the owner's re-selection
    hop = step(w)
    d = share * decompress_add_s(c, prof, L)
    ag = hop + (world - 2) * max(hop, d) + d
    total = rs_transfer + rs_kernel + ag
    return {"total": total, "kernel": total - rs_transfer - (world - 1) * hop, "transfer": rs_transfer + (world - 1) * hop}
