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

from functools import lru_cache

from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.hierarchical import segment_bounds
from gradcomp.lab.plan.costs import PricedCodec, allreduce_bytes, allreduce_seconds, wire_nbytes
from gradcomp.lab.plan.profile import Profile

__all__ = ["hierarchical_bytes", "hierarchical_sent", "hierarchical_seconds", "intra_tier"]


def _shard_len(seg: int, per_host: int, local: int) -> int:
    lo, hi = chunk_bounds(seg, per_host)[local]
    return hi - lo


@lru_cache(maxsize=4096)
def hierarchical_bytes(c: PricedCodec, numel: int, hosts: int, per_host: int, inter_algorithm: str = "ring",
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
            wires = sum(wire_nbytes(c, k) for k in chunks) if hosts > 1 else 4 * s0
            intra += (per_host - 1) * wires
    return {"inter_host_per_host": inter, "intra_host_per_rank": intra}


def hierarchical_sent(c: PricedCodec, numel: int, hosts: int, per_host: int, inter_algorithm: str = "ring",
                      segments: int | None = None) -> int:
    """Bytes local rank 0 sends in one hierarchical allreduce, both tiers (what the
    meter counts for it): its share ``1 / R`` of the host's inter-host bytes plus
    its intra-host bytes (:func:`hierarchical_bytes`)."""
    b = hierarchical_bytes(c, numel, hosts, per_host, inter_algorithm, segments)
    return -(-b["inter_host_per_host"] // per_host) + b["intra_host_per_rank"]


def intra_tier(prof: Profile, alpha_s: float | None = None, bytes_per_s: float | None = None) -> tuple[float, float]:
    """``(alpha, beta)`` of the intra-host tier: the given values, else the profile's
    ``intra`` (``plan calibrate --topology``), else no cost (0 s, infinite bytes per second)."""
    intra = prof.intra or {}
    alpha = alpha_s if alpha_s is not None else intra.get("alpha_s", 0.0)
    beta = bytes_per_s if bytes_per_s is not None else intra.get("beta_bytes_per_s", float("inf"))
    return float(alpha), float(beta)


def hierarchical_seconds(c: PricedCodec, numel: int, hosts: int, per_host: int, prof: Profile,
                         inter_algorithm: str = "ring", segments: int | None = None,
                         share: float = 1.0, *, alpha_s: float | None = None,
                         beta_bytes_per_s: float | None = None, intra: tuple[float, float] | None = None,
                         skew: float = 0.0) -> dict:
    """Time of one hierarchical allreduce (see the module docstring).

    Per segment of ``m`` elements (shard ``s = ceil(m / R)``, ``P = R - 1`` peers, ``w`` the
    shard's ``H`` chunk payloads): ``rs = P alpha_i + max(skew, 4 P s / beta_i) + P da_raw(s)``;
    ``inter`` = the flat ``inter_algorithm`` allreduce of ``s`` elements over ``H`` hosts at
    ``beta / R``; ``ag = P H alpha_i + max(skew, P w / beta_i) + P H d(s / H)``.

    Args:
        prof: kernel rates, and the links unless given: ``alpha_s`` / ``beta_bytes_per_s``
            the inter-host link's (default the profile's), ``intra`` the intra-host tier's
            ``(alpha, beta)`` (default :func:`intra_tier` of the profile).
        share: slowdown of every kernel by processor sharing (1: a core per rank).
        skew: seconds each exchange step waits for a descheduled peer (hidden behind a
            longer transfer), as in :func:`~gradcomp.lab.plan.costs.allreduce_seconds`.

    Returns:
        ``{"total", "intra", "inter", "kernel", "transfer"}`` seconds (``intra`` and
        ``inter``: each stage's time summed over segments, as if they did not overlap;
        ``kernel``: the codec and summing work, at most ``total``).

    Raises:
        ValueError: no inter-host link bandwidth.
    """
    alpha = prof.alpha_s if alpha_s is None else alpha_s
    beta = prof.beta_bytes_per_s if beta_bytes_per_s is None else beta_bytes_per_s
    if beta is None:
        raise ValueError("the profile has no inter-host bandwidth (beta_bytes_per_s)")
    alpha_i, beta_i = intra if intra is not None else intra_tier(prof)
    segs = segment_bounds(numel, segments)
    peers = per_host - 1
    rs = ag = it = kernel = 0.0
    for a, b in segs:
        s = _shard_len(b - a, per_host, 0)
        k_rs = share * peers * prof.seconds("raw.decompress_add", s)
        rs += peers * alpha_i + max(skew if peers else 0.0, peers * 4 * s / beta_i) + k_rs
        kernel += k_rs
        if hosts > 1 and s:
            t = allreduce_seconds(c, inter_algorithm, s, hosts, alpha, beta / per_host, prof, share, skew)
            it += t["total"]
            kernel += t["kernel"]
            chunks = [hi - lo for lo, hi in chunk_bounds(s, hosts)]
            wire = sum(wire_nbytes(c, k) for k in chunks)
            k_ag = share * peers * sum(prof.seconds(f"{c.kind}.decompress", k) for k in chunks)
            ag += peers * hosts * alpha_i + max(skew if peers else 0.0, peers * wire / beta_i) + k_ag
            kernel += k_ag
        else:
            ag += peers * alpha_i + max(skew if peers else 0.0, peers * 4 * s / beta_i)
    k = len(segs)
    total = (rs + ag + it) if k == 1 else (rs / k + (k - 1) * max(it / k, (rs + ag) / k) + it / k + ag / k)
    kernel = min(kernel, total)
    return {"total": total, "intra": rs + ag, "inter": it, "kernel": kernel, "transfer": total - kernel}
