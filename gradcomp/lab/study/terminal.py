"""The study's tables as printed in a terminal, each within 80 columns.

A study's runs print as two tables, one row per (mode, compressor) with seed
means and 95% half-widths: what each compressor sent and what it cost in
accuracy (:func:`traffic_table`), then where the time went (:func:`time_table`);
:func:`legend` explains the headers in one paragraph. Splitting the figures
over two tables keeps every cell whole at the default 80 columns.
"""

from __future__ import annotations

import math

from gradcomp.lab.study.decision import Aggregate, aggregate

__all__ = ["WIDTH", "traffic_table", "time_table", "legend"]

#: the terminal width every table fits (a terminal's default)
WIDTH = 80


def _new_table(headers: tuple[str, ...]):
    from rich import box
    from rich.table import Table

    # collapsed padding: two spaces between columns, no edge, a rule under the header
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False, collapse_padding=True)
    for header in headers:
        t.add_column(header, justify="left" if header in ("mode", "compressor") else "right", no_wrap=True)
    return t


def _pm(x, ci, spec: str, many: bool, suffix: str = "") -> str:
    """``x`` formatted, with ``±ci`` when the table shows several seeds; ``-`` for no value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    text = format(x, spec) + suffix
    if many and ci is not None and not math.isnan(ci):
        text += "±" + format(ci, spec.lstrip("+"))
    return text


def _rows(study):
    aggs = aggregate(study.runs)
    return aggs, any(a.seeds > 1 for a in aggs)


def _fill(t, aggs: list[Aggregate], cells) -> None:
    for i, a in enumerate(aggs):
        if i and a.mode != aggs[i - 1].mode:
            t.add_section()
        t.add_row(a.mode, a.label, *cells(a))


def _perplexities(study) -> dict[tuple, float] | None:
    """Mean test perplexity over seeds per (scenario, mode, compressor) (``exp`` of each
    run's test loss); None but for the text workload."""
    if study.config.workload != "text-gpt":
        return None
    from gradcomp.lab.study.workloads import perplexity

    groups: dict[tuple, list[float]] = {}
    for r in study.runs:
        key = (r.scenario.get("name", "loopback"), r.mode, r.compressor)
        groups.setdefault(key, []).append(perplexity(r.test_loss))
    return {k: sum(v) / len(v) for k, v in groups.items()}


def traffic_table(study):
    """A :class:`rich.table.Table`: per (mode, compressor), bytes per worker per
    step, reduction, test accuracy (the text workload: test perplexity too) and the gap."""
    aggs, many = _rows(study)
    perplexity = _perplexities(study)
    t = _new_table(("mode", "compressor", "bytes/step", "reduction", "test acc",
                    *(("ppl",) if perplexity else ()), "gap (pp)"))

    def cells(a: Aggregate):
        ppl = perplexity[(a.scenario, a.mode, a.compressor)] if perplexity else None
        return (f"{a.bytes_per_worker_per_step:,.0f}", f"{a.reduction_x:.2f}x",
                _pm(a.accuracy, a.accuracy_ci, ".2f", many, "%"),
                *((_pm(ppl, None, ".2f", many),) if perplexity else ()),
                _pm(a.gap_pp, a.gap_ci, "+.2f", many))
    _fill(t, aggs, cells)
    return t


def time_table(study):
    """A :class:`rich.table.Table`: per (mode, compressor), the median step time,
    idle and exposed-communication shares, time to target and wall time."""
    aggs, many = _rows(study)
    t = _new_table(("mode", "compressor", "step ms", "idle", "exp comm", "to target s", "wall s"))

    def cells(a: Aggregate):
        if a.reached == a.seeds:
            ttt = _pm(a.time_to_target_s, a.time_to_target_ci, ".2f", many)
        else:
            ttt = "not reached" if not a.reached else \
                f"{_pm(a.time_to_target_s, None, '.2f', many)} ({a.reached}/{a.seeds})"
        return (_pm(1e3 * a.step_time_median_s, None, ".1f", many),
                _pm(100 * a.idle_share, None, ".0f", many, "%"),
                _pm(100 * a.exposed_comm_share, None, ".0f", many, "%"), ttt, f"{a.wall_s:.1f}")
    _fill(t, aggs, cells)
    return t


def legend(study) -> str:
    """One paragraph explaining the two tables' headers."""
    perplexity = study.config.workload == "text-gpt"
    seeds = len(study.seeds)
    moved = "" if {r.mode for r in study.runs} <= {"sync", "local", "auto", "ft"} else " (async: pushed + pulled)"
    parts = [f"bytes/step: wire bytes one worker sent per step{moved}", "reduction: none's bytes over the row's",
             *(("ppl: test perplexity",) if perplexity else ()),
             "gap (pp): the same mode's none's test accuracy minus the row's, in percentage points (above 0: a loss)",
             "step ms: median step time", "idle: share of a step a worker waits on the others",
             "exp comm: share of a step spent communicating, not hidden behind compute",
             "to target s: training-clock seconds to the target accuracy (k/n: reached on k of n seeds)",
             "wall s: the run's training loop"]
    if seeds > 1:
        parts.append(f"a±b: mean over {seeds} seeds and its 95% half-width")
    return "; ".join(parts) + "."
