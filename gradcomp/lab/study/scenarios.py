"""Scenarios of the time study: a link, its jitter, stragglers and compute jitter.

A scenario name is a link followed by optional ``+modifier`` parts::

    loopback                 the unshaped loopback of this host (no emulated cluster)
    10gbit | 1gbit | 100mbit | <any tc rate>
                             every rank in its own network namespace, each link
                             shaped to that rate in both directions
                             (:class:`gradcomp.lab.cluster.LocalCluster`)
    ...+straggler            worker 1's compute takes 3x as long (``--straggler 1:3``)
    ...+jitter               link rate jitter 0.2 and compute jitter CV 0.2

e.g. ``100mbit+straggler``, ``1gbit+jitter``, ``loopback+straggler+jitter``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["Scenario", "parse_scenario", "parse_scenarios", "DEFAULT_SCENARIOS",
           "STRAGGLER", "JITTER", "scenario_list"]

#: ``+straggler``: (worker, factor).
STRAGGLER = (1, 3.0)
#: ``+jitter``: link rate jitter fraction and compute jitter CV.
JITTER = 0.2
#: The decision table's default grid.
DEFAULT_SCENARIOS = ("loopback", "1gbit", "100mbit", "100mbit+straggler")
_MODIFIERS = ("straggler", "jitter")


@dataclass(frozen=True)
class Scenario:
    """Where a study runs.

    Attributes:
        name: the scenario's name (as parsed, or ``"custom"`` from flags).
        link: a ``tc`` rate (``"100mbit"``) or None for the loopback.
        link_jitter: fraction of the link rate redrawn every second.
        straggler: ``(worker, factor)`` or None; compute_jitter: CV (0: none).
        straggler_from_s: seconds into each run from which the straggler is slow.
    """

    name: str = "loopback"
    link: str | None = None
    link_jitter: float = 0.0
    straggler: tuple[int, float] | None = None
    compute_jitter: float = 0.0
    straggler_from_s: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "link": self.link or "none", "link_jitter": self.link_jitter,
                "straggler": ({"rank": self.straggler[0], "factor": self.straggler[1],
                               "from_s": self.straggler_from_s} if self.straggler else None),
                "compute_jitter_cv": self.compute_jitter}


def parse_scenario(name: str) -> Scenario:
    """A :class:`Scenario` from its name (see the module docstring).

    Raises:
        ValueError: an unknown link or modifier (the message lists the allowed ones).
    """
    from gradcomp.lab.cluster import link_rate_bps
    from gradcomp.lab.units import format_rate

    parts = [p.strip() for p in str(name).strip().split("+")]
    head, mods = parts[0], parts[1:]
    if head in ("loopback", "none"):
        link = None
    else:
        try:
            link = format_rate(link_rate_bps(head))
        except ValueError:
            raise ValueError(f"unknown scenario {name!r}: a scenario is loopback or a link rate "
                             "(10gbit, 1gbit, 100mbit, ...) with optional +straggler, +jitter") from None
    bad = [m for m in mods if m not in _MODIFIERS]
    if bad or len(set(mods)) != len(mods):
        raise ValueError(f"unknown scenario {name!r}: modifiers are {', '.join('+' + m for m in _MODIFIERS)} "
                         "(each at most once)")
    jitter = "jitter" in mods
    canonical = "+".join([head if link is None else link, *mods]).replace("none", "loopback")
    return Scenario(name=canonical, link=link, link_jitter=JITTER if jitter and link else 0.0,
                    straggler=STRAGGLER if "straggler" in mods else None,
                    compute_jitter=JITTER if jitter else 0.0)


def parse_scenarios(text: str) -> tuple[Scenario, ...]:
    """Comma-separated scenario names, duplicates dropped.

    Raises:
        ValueError: none given or one unknown.
    """
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    if not names:
        raise ValueError(f"no scenario given, e.g. {','.join(DEFAULT_SCENARIOS)}")
    out = {}
    for n in names:
        s = parse_scenario(n)
        out[s.name] = s
    return tuple(out.values())


def scenario_list(args: argparse.Namespace, workers: int) -> list[Scenario]:
    """The scenarios to run: ``--scenarios``, or one from ``--link`` and friends.

    Raises:
        ValueError: a straggler rank that is not a worker; --scenarios with
            --link / --straggler / --compute-jitter; a link without the emulated cluster.
    """
    if args.scenarios is not None:
        if args.link != "none" or args.straggler or args.compute_jitter or args.link_jitter:
            raise ValueError("--scenarios sets link, jitter and stragglers itself: drop --link, "
                             "--link-jitter, --straggler and --compute-jitter")
        scenarios = list(args.scenarios)
    else:
        if args.link_jitter and args.link == "none":
            raise ValueError("--link-jitter needs a shaped --link (e.g. --link 100mbit)")
        name = "loopback" if args.link == "none" else args.link
        if args.straggler or args.compute_jitter or args.link_jitter:
            name += "+custom"
        straggler = args.straggler
        scenarios = [Scenario(name=name, link=None if args.link == "none" else args.link,
                              link_jitter=args.link_jitter, straggler=straggler[:2] if straggler else None,
                              compute_jitter=args.compute_jitter,
                              straggler_from_s=straggler[2] if straggler and len(straggler) > 2 else 0.0)]
    for s in scenarios:
        if s.straggler is not None and not s.straggler[0] < workers:
            raise ValueError(f"--straggler rank {s.straggler[0]} is not a worker: "
                             f"the study has workers 0..{workers - 1}")
    if any(s.link for s in scenarios):
        from gradcomp.lab.cluster import requirements_missing

        reason = requirements_missing()
        if reason is not None:
            raise ValueError(f"a shaped link needs the emulated cluster: {reason}")
    return scenarios
