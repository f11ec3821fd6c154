"""Two-tier figures of the allreduce benchmark (``--topology HxR``): what crossed the slow links.

With ``--topology HxR`` the benchmark runs ``H`` hosts of ``R`` ranks (a two-tier
:class:`~gradcomp.lab.cluster.LocalCluster` on a shaped link; on loopback, hosts named by
``GRADCOMP_HOST_ID``) and adds the hierarchical methods: ``int8 hierarchical`` and ``int8
hierarchical two_phase`` (exact float32 inside a host, int8 ring or two-phase across hosts,
the intra-host steps pipelined with the inter-host leg) and ``int8 hierarchical unpipelined``
(one segment: the stages one after the other), each called unchecked after its warm-up, as
the DDP hook calls it. Its JSON rows then also hold, per method: ``link_bytes_per_host`` (what
each host's ``gc0`` sent per call, from the kernel's interface counters, TCP/IP headers
included; median over calls, mean over hosts), and for the hierarchical methods
``inter_bytes_per_host`` (the meter's inter-host bytes of a host's ranks summed),
``bucket_wire_bytes`` (the bucket compressed once) and ``intra_share`` (the time the calling
thread spent on the intra-host steps over the call's, median over calls of the mean over ranks).
"""

from __future__ import annotations

import statistics

__all__ = ["HIERARCHICAL_METHODS", "gc0_tx_bytes", "host_figures", "host_table"]

#: the hierarchical methods' ``(name, inter-host algorithm, segments)``
HIERARCHICAL_METHODS = (("int8 hierarchical", "ring", None), ("int8 hierarchical two_phase", "two_phase", None),
                        ("int8 hierarchical unpipelined", "ring", 1))


def gc0_tx_bytes() -> int | None:
    """Bytes this network namespace's ``gc0`` sent (None outside an emulated cluster)."""
    with open("/proc/net/dev") as f:  # per network namespace
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "gc0":
                return int(rest.split()[8])
    return None


def host_figures(everything, name: str, world: int, per_host: int, repeat: int) -> dict:
    """Per-host figures of one method from every rank's ``(times, link, share, inter)``."""
    hosts = world // per_host
    heads = [everything[h * per_host] for h in range(hosts)]
    out = {"link_bytes_per_host": None, "inter_bytes_per_host": None, "intra_share": None}
    if heads[0][1][name][0] is not None:
        out["link_bytes_per_host"] = statistics.median(
            sum(hd[1][name][i] for hd in heads) / hosts for i in range(repeat))
    if everything[0][3].get(name) is not None:
        out["inter_bytes_per_host"] = sum(e[3][name] for e in everything) / hosts
    if everything[0][2][name]:
        out["intra_share"] = statistics.median(
            sum(e[2][name][i] for e in everything) / world for i in range(repeat))
    return out


def host_table(rows) -> str:
    """The two-tier figures: per host, what crossed the slow link; the intra-host stage's share."""
    head = (f"{'topo':>5} {'numel':>9} {'method':<28} {'ms':>8} {'inter MiB':>9} {'link MiB':>8} "
            f"{'intra%':>6}")
    lines = ["per host and call: inter = meter's inter-host bytes, link = gc0's counter", head,
             "-" * len(head)]

    def mib(v):
        return "-" if v is None else f"{v / 2**20:.3f}"

    for r in rows:
        share = "-" if r.get("intra_share") is None else f"{100 * r['intra_share']:.1f}"
        lines.append(f"{r['topology']:>5} {r['numel']:>9} {r['method'][:28]:<28} {r['median_ms']:>8.1f} "
                     f"{mib(r.get('inter_bytes_per_host')):>9} {mib(r.get('link_bytes_per_host')):>8} "
                     f"{share:>6}")
    return "\n".join(lines)
