"""The two-tier model: bytes and time of the hierarchical allreduce on hosts of R ranks.

What :mod:`gradcomp.comm.hierarchical` does, priced step by step with the alpha-beta terms of
:mod:`gradcomp.lab.plan.model` (a flat allreduce's time is its ``allreduce_seconds``). Per
segment of ``m`` elements (shards of ``s = ceil(m / R)``): the intra-host reduce-scatter sends
``R - 1`` float32 shards over the intra-host tier (``alpha_i + 4 s / beta_i`` each, one port)
and adds ``R - 1`` of them; the inter-host leg is the flat ring or two-phase allreduce of a
shard over the ``H`` hosts, with the ``R`` ranks of a host sharing its link (``beta / R``);
the intra-host allgather sends the shard's ``H`` chunk payloads to ``R - 1`` ranks and
decodes theirs. Segments pipeline: the calling thread runs the inter-host legs one after
the other while the intra-host transfers of the neighbouring segments proceed, so
``T = rs + (S - 1) max(inter, rs + ag) + inter + ag``. Bytes are exact (the codecs'
``wire_nbytes`` over the exact chunks). Not modelled: CPU contention between the intra-host
transfers and the inter-host leg beyond ``share`` (one factor for every kernel).
"""

from __future__ import annotations

from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.hierarchical import segment_bounds
from gradcomp.lab.plan.model import PlanCodec, allreduce_bytes, allreduce_seconds
from gradcomp.lab.plan.profile import Profile

__all__ = ["hierarchical_bytes", "hierarchical_seconds"]


def _shard_len(seg: int, per_host: int, local: int) -> int:
    lo, hi = chunk_bounds(seg, per_host)[local]
    return hi - lo


def hierarchical_bytes(c: PlanCodec, numel: int, hosts: int, per_host: int, inter_algorithm: str = "ring",
                       segments: int | None = None) -> dict:
    """Bytes of one hierarchical allreduce of ``numel`` float32 elements.

    Returns:
        ``{"inter_host_per_host": bytes a host's ranks send over the links between
        hosts, "intra_host_per_rank": bytes local rank 0 sends inside its host}``
        (inter-host: rank 0 of the inter-host group's count, per local rank).
    """
    inter = intra = 0
    for a, b in segment_bounds(numel, segments):
        for local in range(per_host):
            s = _shard_len(b - a, per_host, local)
            if s and hosts > 1:
                inter += allreduce_bytes(c, inter_algorithm, s, hosts, 0)[0]
        s0 = _shard_len(b - a, per_host, 0)
        intra += 4 * (b - a - s0)
        if s0 and per_host > 1:
            chunks = [hi - lo for lo, hi in chunk_bounds(s0, hosts)]
            wires = sum(c.compressor(k).wire_nbytes((k,)) for k in chunks) if hosts > 1 else 4 * s0
            intra += (per_host - 1) * wires
    return {"inter_host_per_host": inter, "intra_host_per_rank": intra}


def hierarchical_seconds(c: PlanCodec, numel: int, hosts: int, per_host: int, prof: Profile,
                         inter_algorithm: str = "ring", segments: int | None = None,
                         share: float = 1.0) -> dict:
    """Time of one hierarchical allreduce (see the module docstring).

    Args:
        prof: a profile whose ``alpha_s`` / ``beta_bytes_per_s`` are the inter-host link's
            and whose ``intra`` the intra-host tier's (``gradcomp plan calibrate
            --topology HxR``; without it the intra-host transfers cost nothing).
        share: slowdown of every kernel by processor sharing (1: a core per rank).

    Returns:
        ``{"total", "intra", "inter"}`` seconds (``intra`` and ``inter``: each stage's time
        summed over segments, as if they did not overlap).

    Raises:
        ValueError: no inter-host link bandwidth in ``prof``.
    """
    if prof.beta_bytes_per_s is None:
        raise ValueError("the profile has no inter-host bandwidth (beta_bytes_per_s)")
    intra = prof.intra or {}
    alpha_i, beta_i = intra.get("alpha_s", 0.0), intra.get("beta_bytes_per_s", float("inf"))
    segs = segment_bounds(numel, segments)
    rs = ag = it = 0.0
    for a, b in segs:
        s = _shard_len(b - a, per_host, 0)
        peers = per_host - 1
        rs += peers * (alpha_i + 4 * s / beta_i) + share * prof.seconds("raw.decompress_add", peers * s)
        if hosts > 1 and s:
            it += allreduce_seconds(c, inter_algorithm, s, hosts, prof.alpha_s, prof.beta_bytes_per_s / per_host,
                                    prof, share)["total"]
            wire = sum(c.compressor(k).wire_nbytes((k,)) for k in (hi - lo for lo, hi in chunk_bounds(s, hosts)))
            ag += peers * (hosts * alpha_i + wire / beta_i) + share * prof.seconds(f"{c.kind}.decompress", peers * s)
        else:
            ag += peers * (alpha_i + 4 * s / beta_i)
    k = len(segs)
    total = (rs + ag + it) if k == 1 else (rs / k + (k - 1) * max(it / k, (rs + ag) / k) + it / k + ag / k)
    return {"total": total, "intra": rs + ag, "inter": it}
