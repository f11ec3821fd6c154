"""The command-line options of the step-time model's two tiers (hosts of several ranks).

``gradcomp plan`` and ``gradcomp plan recommend`` take them (:mod:`gradcomp.lab.plan.cli`);
they fill the two-tier fields of a :class:`~gradcomp.lab.plan.model.Setting`.
Details: docs/planning.md#two-tiers.
"""

from __future__ import annotations

import argparse

__all__ = ["tier_options", "tier_kw"]


def tier_options(p: argparse.ArgumentParser, count_type, positive_type) -> None:
    """Add ``--ranks-per-host``, ``--intra-link`` and ``--intra-alpha-us`` to ``p``, parsed
    with the caller's converters of an integer >= 1 and of a finite number > 0."""
    g = p.add_argument_group("two tiers (hosts of several ranks)")
    g.add_argument("--ranks-per-host", type=count_type, default=1, metavar="R",
                   help="ranks (GPUs) per host, a divisor of every node count: the ranks of a host share "
                        "its --link to the other hosts and reach each other over the intra-host tier; "
                        "adds the hierarchical allreduce's rows (default 1: a link per rank)")
    g.add_argument("--intra-link", default=None, metavar="RATE",
                   help="the intra-host tier's rate per rank, e.g. 2400gbit (default: the profile's "
                        "measured one, else free)")
    g.add_argument("--intra-alpha-us", type=positive_type, default=None,
                   help="the intra-host tier's message latency in microseconds (default: the profile's, "
                        "else 0)")


def tier_kw(args) -> dict:
    """The two-tier fields of a :class:`~gradcomp.lab.plan.model.Setting` (ValueError naming the option)."""
    from gradcomp.lab.units import parse_rate

    intra = None
    if args.intra_link is not None and args.intra_link.strip().lower() != "none":
        intra = parse_rate(args.intra_link, "--intra-link") / 8
    return {"local_ranks": args.ranks_per_host, "intra_bytes_per_s": intra,
            "intra_alpha_s": args.intra_alpha_us * 1e-6 if args.intra_alpha_us else None}
