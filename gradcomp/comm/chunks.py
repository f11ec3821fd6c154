"""How a flat tensor is cut into one chunk per rank, and what a float32 ring would send.

Every collective in :mod:`gradcomp.comm` splits the ``n`` elements of the
flattened input into ``N`` contiguous chunks, one per rank of the group, as
evenly as possible: the first ``n mod N`` chunks hold ``n // N + 1``
elements, the others ``n // N`` (a chunk may be empty when ``n < N``). Rank
``r`` *owns* chunk ``r``: it holds the fully reduced chunk after the
reduce-scatter phase and is the source of that chunk's bytes in the
allgather phase.

The uncompressed reference for traffic accounting is the standard float32
ring allreduce over the same chunks with the same ownership (Patarasuk and
Yuan 2009): in its reduce-scatter, rank ``r`` sends every chunk except its own
chunk ``r``; in its allgather it sends every chunk except chunk ``r + 1``
(which the next rank owns). Per rank, in bytes::

    raw_sent     = 4 * (2 n - len(r) - len(r + 1))   # = 2 (N - 1) / N * 4 n when N divides n
    raw_received = 4 * (2 n - len(r - 1) - len(r))

(indices modulo ``N``).
"""

from __future__ import annotations

__all__ = ["chunk_bounds", "ring_raw_bytes", "FLOAT32_BYTES"]

#: bytes per element of the uncompressed reference exchange (float32)
FLOAT32_BYTES = 4


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Element ranges ``[(lo, hi), ...]`` of the ``world_size`` chunks of ``numel`` elements.

    Args:
        numel: number of elements (>= 0).
        world_size: number of chunks (>= 1).

    Returns:
        ``world_size`` half-open ranges covering ``[0, numel)`` in order; the
        first ``numel % world_size`` chunks are one element longer.
    """
    base, extra = divmod(numel, world_size)
    bounds = []
    lo = 0
    for j in range(world_size):
        hi = lo + base + (1 if j < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def ring_raw_bytes(numel: int, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """Bytes a float32 ring allreduce of ``numel`` elements moves at ``rank``.

    Returns:
        ``(reduce_scatter_sent, allgather_sent, reduce_scatter_received,
        allgather_received)`` in bytes, from the exact chunk sizes of
        :func:`chunk_bounds` (see the module docstring).
    """
    if world_size == 1:
        return 0, 0, 0, 0
    lens = [hi - lo for lo, hi in chunk_bounds(numel, world_size)]
    n4 = FLOAT32_BYTES * numel
    b = FLOAT32_BYTES
    return (
        n4 - b * lens[rank],
        n4 - b * lens[(rank + 1) % world_size],
        n4 - b * lens[(rank - 1) % world_size],
        n4 - b * lens[rank],
    )
