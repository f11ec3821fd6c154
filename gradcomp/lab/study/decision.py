"""Aggregation over seeds and the sync-vs-async decision table of the time study.

:func:`aggregate` groups a study's runs by (scenario, mode, compressor) and
gives means with 95% intervals over seeds (Student's t). :func:`decide`
marks, per scenario, the configuration that reached the target accuracy
soonest among those whose mean accuracy gap stays within the bound, and
:func:`write_decision` writes ``decision.json`` and ``decision.md`` with, per
scenario, every configuration's time to target, bytes per step, gap with its
interval and idle share, and the sync-vs-async comparison filled in with the
measured numbers.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

from gradcomp.lab.study.output import json_ready
from gradcomp.lab.study.timing import mean_ci95

__all__ = ["Aggregate", "aggregate", "decide", "contenders", "separated", "verdict", "decision_doc", "write_decision",
           "DEFAULT_MAX_GAP_PP", "decision_markdown", "phases_text"]

#: Accuracy bound of the decision: a mean gap of at most this many points.
DEFAULT_MAX_GAP_PP = 0.5


@dataclass
class Aggregate:
    """One (scenario, mode, compressor) over its seeds (means and 95% half-widths).

    Times are seconds of the training clock; ``time_to_target_s`` averages the
    seeds that reached the target (``reached`` of ``seeds``).
    """

    scenario: str
    mode: str
    compressor: str
    label: str
    seeds: int
    reached: int
    accuracy: float
    accuracy_ci: float
    gap_pp: float
    gap_ci: float
    time_to_target_s: float | None
    time_to_target_ci: float | None
    bytes_per_worker_per_step: float
    reduction_x: float
    step_time_median_s: float
    idle_share: float
    idle_share_fast: float
    exposed_comm_share: float
    wall_s: float
    staleness_mean: float | None = None
    link: dict = field(default_factory=dict)
    winner: bool = False


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.fmean(xs) if xs else math.nan


def aggregate(runs) -> list[Aggregate]:
    """Group runs (:class:`~gradcomp.lab.study.study.RunResult`) by (scenario, mode, compressor)."""
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r.scenario.get("name", "loopback"), r.mode, r.compressor), []).append(r)
    out = []
    for (scen, mode, comp), rs in groups.items():
        acc, acc_ci = mean_ci95([100 * r.test_accuracy for r in rs])
        gap, gap_ci = mean_ci95([r.accuracy_gap_pp for r in rs])
        hit = [r.time_to_target_s for r in rs if r.time_to_target_s is not None]
        ttt, ttt_ci = mean_ci95(hit) if hit else (None, None)
        t = [r.time for r in rs]
        stale = [r.extra.get("staleness_mean") for r in rs if r.extra.get("staleness_mean") is not None]
        out.append(Aggregate(
            scenario=scen, mode=mode, compressor=comp, label=rs[0].label, seeds=len(rs),
            reached=len(hit), accuracy=acc, accuracy_ci=acc_ci, gap_pp=gap, gap_ci=gap_ci,
            time_to_target_s=ttt, time_to_target_ci=ttt_ci,
            bytes_per_worker_per_step=_mean(r.bytes_per_worker_per_step for r in rs),
            reduction_x=_mean(r.reduction_x for r in rs),
            step_time_median_s=_mean(x.get("step_time_median_s") for x in t),
            idle_share=_mean(x.get("idle_share") for x in t),
            idle_share_fast=_mean(x.get("idle_share_fast") for x in t),
            exposed_comm_share=_mean(x.get("exposed_comm_share") for x in t),
            wall_s=_mean(r.wall_s for r in rs),
            staleness_mean=_mean(stale) if stale else None,
            link=rs[0].link))
    return out


def _qualifies(a: Aggregate, max_gap_pp: float) -> bool:
    """Reached the target on every seed with a mean gap within the bound."""
    return a.reached == a.seeds and a.time_to_target_s is not None and a.gap_pp <= max_gap_pp


def separated(a: Aggregate, b: Aggregate) -> bool:
    """True when ``a`` reaches the target sooner than ``b`` beyond their noise: the
    difference of the mean times exceeds the 95% half-widths combined
    (``sqrt(ha**2 + hb**2)``). False when either has no interval (one seed: the
    run-to-run spread is not measured)."""
    ha, hb = a.time_to_target_ci, b.time_to_target_ci
    if any(h is None or (isinstance(h, float) and math.isnan(h)) for h in (ha, hb)):
        return False
    return b.time_to_target_s - a.time_to_target_s > math.hypot(ha, hb)


def contenders(aggs: list[Aggregate], max_gap_pp: float = DEFAULT_MAX_GAP_PP) -> dict[str, list[Aggregate]]:
    """Per scenario, the fastest configuration to the target among those that
    reached it on every seed with a mean gap <= ``max_gap_pp``, followed by every
    other such configuration that it is not :func:`separated` from (by time);
    an empty list where none qualifies."""
    out: dict[str, list[Aggregate]] = {}
    for a in aggs:
        out.setdefault(a.scenario, [])
    for scen in out:
        ok = sorted((a for a in aggs if a.scenario == scen and _qualifies(a, max_gap_pp)),
                    key=lambda a: a.time_to_target_s)
        out[scen] = ok[:1] + [b for b in ok[1:] if not separated(ok[0], b)]
    return out


def decide(aggs: list[Aggregate], max_gap_pp: float = DEFAULT_MAX_GAP_PP) -> dict[str, Aggregate | None]:
    """Per scenario, the aggregate with the least mean time to target among
    those that reached it on every seed with a mean gap <= ``max_gap_pp``, when
    it is :func:`separated` from every other such one (its ``winner`` flag is
    set); None where none qualifies or the fastest is within the others' noise."""
    best = {scen: (c[0] if len(c) == 1 else None) for scen, c in contenders(aggs, max_gap_pp).items()}
    for a in aggs:
        a.winner = best.get(a.scenario) is a
    return best


def _fmt(x, spec: str, ci=None, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    s = format(x, spec) + suffix
    if ci is not None and not (isinstance(ci, float) and math.isnan(ci)):
        s += " ± " + format(ci, spec.lstrip("+")) + suffix
    return s


def _sync_vs_async(aggs: list[Aggregate], scenario: str) -> list[list[str]]:
    """The seed's sync-vs-async comparison, per mode, with measured numbers."""
    rows = []
    for mode in ("sync", "async"):
        sub = [a for a in aggs if a.scenario == scenario and a.mode == mode]
        if not sub:
            continue
        base = next((a for a in sub if a.compressor == "none"), sub[0])
        fastest = min((a for a in sub if a.time_to_target_s is not None),
                      key=lambda a: a.time_to_target_s, default=None)
        stale = _fmt(base.staleness_mean, ".2f") if mode == "async" else "0 (every step waits)"
        rows.append([
            mode,
            f"{base.bytes_per_worker_per_step / 1e3:,.0f} kB/worker/step uncompressed; "
            f"exposed comm {_fmt(100 * base.exposed_comm_share, '.0f', suffix='%')} of a step",
            f"final acc {_fmt(base.accuracy, '.2f', base.accuracy_ci, '%')} over {base.seeds} seeds; "
            f"mean staleness {stale}",
            f"busy {_fmt(100 * (1 - base.idle_share), '.0f', suffix='%')} of a step "
            f"(fast workers {_fmt(100 * (1 - base.idle_share_fast), '.0f', suffix='%')})",
            (f"{fastest.label}: {_fmt(fastest.time_to_target_s, '.1f', fastest.time_to_target_ci, ' s')}"
             if fastest else "not reached"),
        ])
    return rows


def decision_doc(aggs: list[Aggregate], target: float, max_gap_pp: float, meta: dict) -> dict:
    """The JSON-ready decision document."""
    best = decide(aggs, max_gap_pp)
    close = contenders(aggs, max_gap_pp)
    return {
        "target_accuracy": target, "max_gap_pp": max_gap_pp, **meta,
        "scenarios": {
            scen: {"winner": (None if w is None else {"mode": w.mode, "compressor": w.compressor,
                                                        "time_to_target_s": w.time_to_target_s}),
                   "contenders": [{"mode": a.mode, "compressor": a.compressor, "label": a.label,
                                   "time_to_target_s": a.time_to_target_s,
                                   "time_to_target_ci": a.time_to_target_ci, "seeds": a.seeds}
                                  for a in close[scen]],
                   "link": next(a.link for a in aggs if a.scenario == scen),
                   "rows": [dict(asdict(a), within_bound=a.gap_pp <= max_gap_pp)
                            for a in aggs if a.scenario == scen],
                   "sync_vs_async": _sync_vs_async(aggs, scen)}
            for scen, w in best.items()},
    }


def verdict(scenario: dict) -> str:
    """The sentence under a scenario's decision table: the winner, or why there is none
    (``scenario``: one entry of :func:`decision_doc`'s ``"scenarios"``)."""
    close, w = scenario.get("contenders") or [], scenario["winner"]
    if not close:
        return "No configuration reached the target within the bound on every seed."

    def name(c):
        ci = c.get("time_to_target_ci")
        spread = "" if ci is None or math.isnan(ci) else f" ± {ci:.2f}"
        return f"{c['mode']} {c['label']} ({c['time_to_target_s']:.2f}{spread} s)"
    if w is not None:
        others = sum(1 for a in scenario["rows"] if a["within_bound"] and a["reached"] == a["seeds"]) - 1
        why = (f"ahead of the {others} other qualifying configurations beyond the 95% intervals"
               if others else "the only configuration that qualifies")
        return f"Fastest within the bound: **{name(close[0])}**, {why}."
    seeds = close[0].get("seeds", 1)
    noise = ("with 1 seed the run-to-run spread is not measured" if seeds < 2 else
             f"their 95% intervals over {seeds} seeds overlap")
    more = "--seeds 3" if seeds < 3 else f"--seeds {2 * seeds}"
    return (f"Fastest within the bound: not separable: {', '.join(name(c) for c in close)}; {noise}. "
            f"More seeds ({more} or more) would separate them if the difference is real.")


def phases_text(phases: list[dict]) -> str:
    """A changing link's phases: ``"1gbit from 0 s (941.2mbit achieved), 100mbit from 120 s (...)"``."""
    from gradcomp.lab.units import format_rate

    return ", ".join(f"{format_rate(p['configured_bps'])} from {p['start_s']:g} s ("
                     f"{format_rate(p['achieved_bps']) if p.get('achieved_bps') else '?'} achieved)"
                     for p in phases)


def _link_text(link: dict) -> str:
    from gradcomp.lab.units import format_rate

    if not link or not link.get("configured_bps"):
        return "loopback (unshaped)"
    if len(link.get("phases") or ()) > 1:
        return phases_text(link["phases"]) + " (calibration transfers)"
    got = link.get("achieved_bps")
    return (f"{format_rate(link['configured_bps'])} configured, "
            f"{format_rate(got) if got else '?'} achieved (calibration transfer)")


def decision_markdown(doc: dict) -> str:
    """``decision.md``: a table per scenario, the winner marked, and the sync-vs-async table."""
    lines = [f"# Decision table: which mode and compressor train fastest to the target",
             "",
             f"Target: test accuracy {100 * doc['target_accuracy']:.2f}%; accuracy bound: mean gap "
             f"<= {doc['max_gap_pp']:g} points against the same mode's uncompressed run. "
             f"{doc.get('description', '')}",
             ""]
    for scen, s in doc["scenarios"].items():
        lines += [f"## {scen}", "", f"Link: {_link_text(s['link'])}.", "",
                  "| mode | compressor | time to target (s) | reached | bytes/worker/step | "
                  "gap (pp) | idle | exposed comm | step (ms) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in s["rows"]:
            mark = " **fastest**" if a["winner"] else ("" if a["within_bound"] else " (outside bound)")
            lines.append(
                f"| {a['mode']} | {a['label']}{mark} | "
                f"{_fmt(a['time_to_target_s'], '.2f', a['time_to_target_ci'])} | "
                f"{a['reached']}/{a['seeds']} | {a['bytes_per_worker_per_step']:,.0f} | "
                f"{_fmt(a['gap_pp'], '+.2f', a['gap_ci'])} | {_fmt(100 * a['idle_share'], '.0f', suffix='%')} | "
                f"{_fmt(100 * a['exposed_comm_share'], '.0f', suffix='%')} | "
                f"{_fmt(1e3 * a['step_time_median_s'], '.1f')} |")
        lines += ["", verdict(s), ""]
        lines += ["| mode | network requirement | convergence stability | resource utilisation | "
                  "fastest to target |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in s["sync_vs_async"]]
        lines.append("")
    return "\n".join(lines)


def write_decision(runs, out_dir: str, target: float, max_gap_pp: float = DEFAULT_MAX_GAP_PP,
                   meta: dict | None = None) -> dict[str, str]:
    """Write ``decision.json`` and ``decision.md`` into ``out_dir``; returns their paths."""

    doc = decision_doc(aggregate(runs), target, max_gap_pp, meta or {})
    paths = {"decision_json": os.path.join(out_dir, "decision.json"),
             "decision_md": os.path.join(out_dir, "decision.md")}
    with open(paths["decision_json"], "w") as f:
        json.dump(json_ready(doc), f, indent=1)
    with open(paths["decision_md"], "w") as f:
        f.write(decision_markdown(doc))
    return paths
