"""Study reports: a terminal table (rich), ``results.json``, ``results.csv`` and plots.

Plots: ``results.png`` (accuracy against traffic and loss against step, per
mode), ``time.png`` (accuracy against training-clock seconds, one panel per
scenario; where the step time went, a stacked bar per run; the async
staleness histogram).
"""

from __future__ import annotations

import csv
import json
import math
import os
import textwrap
from dataclasses import asdict

from gradcomp.lab.study.config import COMPRESSORS
from gradcomp.lab.study.output import json_ready
from gradcomp.lab.study.study import RunResult, StudyResult

__all__ = ["title", "table", "write_json", "write_csv", "write_plot", "write_time_plot",
           "write_all", "json_ready", "run_record"]

#: Columns of the CSV: (CSV field, meaning).
COLUMNS = (
    ("scenario", "scenario"),
    ("seed", "seed"),
    ("mode", "mode"),
    ("compressor", "compressor"),
    ("bytes_per_worker_per_step", "bytes/worker/step"),
    ("reduction_x", "reduction"),
    ("reduction_pct", "saved"),
    ("test_accuracy_pct", "test acc"),
    ("accuracy_gap_pp", "gap (pp)"),
    ("time_to_target_s", "to target (s)"),
    ("step_time_median_s", "step median (s)"),
    ("step_time_p95_s", "step p95 (s)"),
    ("idle_share", "idle"),
    ("exposed_comm_share", "exposed comm"),
    ("samples_per_s", "samples/s"),
    ("wall_s", "wall (s)"),
)

def granularity_pp(test_samples: int) -> float:
    """Accuracy points one test sample is worth (0.22 on the digits' 450)."""
    return 100.0 / test_samples


def _r(x, nd):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def _row(r: RunResult) -> dict:
    """The CSV row of a run (rounded figures)."""
    t = r.time
    return {
        "scenario": r.scenario.get("name", "loopback"),
        "seed": r.seed,
        "mode": r.mode,
        "compressor": r.label,
        "bytes_per_worker_per_step": round(r.bytes_per_worker_per_step, 1),
        "reduction_x": round(r.reduction_x, 2),
        "reduction_pct": round(r.reduction_pct, 2),
        "test_accuracy_pct": round(100 * r.test_accuracy, 2),
        "accuracy_gap_pp": round(r.accuracy_gap_pp, 2),
        "time_to_target_s": _r(r.time_to_target_s, 3),
        "step_time_median_s": _r(t.get("step_time_median_s"), 5),
        "step_time_p95_s": _r(t.get("step_time_p95_s"), 5),
        "idle_share": _r(t.get("idle_share"), 4),
        "exposed_comm_share": _r(t.get("exposed_comm_share"), 4),
        "samples_per_s": _r(t.get("samples_per_s"), 1),
        "wall_s": round(r.wall_s, 2),
    }


def title(study: StudyResult) -> str:
    """One line describing what every run of the study shared."""
    c = study.config
    modes = {r.mode for r in study.runs}
    per_push = f" (async: {c.lr / c.workers:.3g} per push)" if "async" in modes else ""
    async_m = (f" (async: {c.async_momentum:g})"
               if "async" in modes and c.async_momentum is not None else "")
    algorithm = (f", sync dense algorithm: {c.algorithm}, top-k: {c.sparse_algorithm}"
                 if modes & {"sync", "local"} else "")
    if "local" in modes:
        streaming = f", {c.fragments} fragments, overlap {c.overlap}" if c.fragments > 1 or c.overlap else ""
        algorithm += f", local: sync every {c.sync_every} steps, outer {c.outer}{streaming}"
    what = (f"digits ({study.train_samples} train / {study.test_samples} test), "
            f"MLP {'-'.join(map(str, (64, *c.hidden, 10)))} ({study.num_parameters:,} params)")
    if c.workload != "digits-mlp":
        from gradcomp.lab.study.workloads import describe

        what = (f"{c.workload}: {describe(c, study.num_parameters)}, {study.train_samples} train / "
                f"{study.test_samples} test samples")
    return (f"{what}, "
            f"{c.workers} workers x batch {c.batch_size}, {c.steps} steps, SGD lr {c.lr:g}"
            f"{per_push} momentum {c.momentum:g}{async_m}, seed {c.seed}{algorithm}")


def link_line(study: StudyResult) -> str:
    """Where the study ran: the scenario and, per mode, the link's configured and achieved rate."""
    from gradcomp.lab.units import format_rate

    parts = []
    for mode, link in study.links.items():
        if link.get("configured_bps"):
            parts.append(f"{mode}: {format_rate(link['configured_bps'])} configured, "
                         f"{format_rate(link['achieved_bps'])} achieved")
        else:
            parts.append(f"{mode}: {link.get('emulation', 'loopback')}")
    sc = study.scenario
    extra = []
    if sc.get("straggler"):
        extra.append(f"straggler worker {sc['straggler']['rank']} x{sc['straggler']['factor']:g}")
    if sc.get("compute_jitter_cv"):
        extra.append(f"compute jitter CV {sc['compute_jitter_cv']:g}")
    if sc.get("link_jitter"):
        extra.append(f"link jitter {sc['link_jitter']:g}")
    seeds = study.seeds
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]}"
    return (f"scenario {sc.get('name', 'loopback')} ({'; '.join(parts)}"
            f"{'; ' + ', '.join(extra) if extra else ''}), {seed_text}, target accuracy "
            f"{100 * study.target_accuracy:.2f}%")


def table(study: StudyResult):
    """A :class:`rich.table.Table` of the runs (one row per configuration; with
    several seeds, means and 95% half-widths)."""
    from rich import box
    from rich.table import Table

    from gradcomp.lab.study.decision import aggregate

    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    perplexity = _perplexities(study) if study.config.workload == "text-gpt" else None
    headers = ("mode", "compressor", "bytes/step", "reduction", "test acc",
               *(("perplexity",) if perplexity else ()), "gap (pp)",
               "step ms", "idle", "exp comm", "to target s", "wall s")
    for header in headers:
        t.add_column(header, justify="left" if header in ("mode", "compressor") else "right",
                     no_wrap=True)
    aggs = aggregate(study.runs)
    many = any(a.seeds > 1 for a in aggs)

    def pm(x, ci, spec, suffix=""):
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return "-"
        text = format(x, spec) + suffix
        if many and ci is not None and not math.isnan(ci):
            text += "±" + format(ci, spec.lstrip("+"))
        return text

    for i, a in enumerate(aggs):
        if i and a.mode != aggs[i - 1].mode:
            t.add_section()
        ttt = (pm(a.time_to_target_s, a.time_to_target_ci, ".2f") if a.reached == a.seeds
               else ("not reached" if not a.reached else
                     f"{pm(a.time_to_target_s, None, '.2f')} ({a.reached}/{a.seeds})"))
        t.add_row(
            a.mode, a.label, f"{a.bytes_per_worker_per_step:,.0f}", f"{a.reduction_x:.2f}x",
            pm(a.accuracy, a.accuracy_ci, ".2f", "%"),
            *((pm(perplexity[(a.scenario, a.mode, a.compressor)], None, ".2f"),) if perplexity else ()),
            pm(a.gap_pp, a.gap_ci, "+.2f"),
            pm(1e3 * a.step_time_median_s, None, ".1f"), pm(100 * a.idle_share, None, ".0f", "%"),
            pm(100 * a.exposed_comm_share, None, ".0f", "%"), ttt, f"{a.wall_s:.1f}")
    return t


def _perplexities(study: StudyResult) -> dict[tuple, float]:
    """Mean test perplexity over seeds per (scenario, mode, compressor) (``exp`` of each run's test loss)."""
    from gradcomp.lab.study.workloads import perplexity

    groups: dict[tuple, list[float]] = {}
    for r in study.runs:
        key = (r.scenario.get("name", "loopback"), r.mode, r.compressor)
        groups.setdefault(key, []).append(perplexity(r.test_loss))
    return {k: sum(v) / len(v) for k, v in groups.items()}


def run_record(r: RunResult, study: StudyResult) -> dict:
    """One run as written to ``results.json``: every field of the run plus the
    flat time keys the step-time model's validation reads."""
    t = r.time
    c = study.config
    d = dict(asdict(r), test_accuracy_pct=100 * r.test_accuracy)
    if c.workload == "text-gpt":
        from gradcomp.lab.study.workloads import perplexity

        d["test_perplexity"] = perplexity(r.test_loss)
    d.update({
        "algorithm": c.algorithm_for(COMPRESSORS[r.compressor]),
        "world_size": r.workers + (1 if r.mode == "async" else 0),
        "params": study.num_parameters, "batch_size": c.batch_size,
        "straggler": r.scenario.get("straggler"),
        "compute_jitter_cv": r.scenario.get("compute_jitter_cv", 0.0),
        "bytes_per_worker_step": r.bytes_per_worker_per_step,
        "step_time_median_s": t.get("step_time_median_s"),
        "step_time_p95_s": t.get("step_time_p95_s"),
        "phases_median_s": t.get("phases_median_s"),
        "phases_mean_s": t.get("phases_mean_s"),
        "idle_share": t.get("idle_share"),
        "idle_share_fast": t.get("idle_share_fast"),
        "exposed_comm_share": t.get("exposed_comm_share"),
        "samples_per_s": t.get("samples_per_s"),
        "staleness_mean": r.extra.get("staleness_mean"),
        "staleness_max": r.extra.get("staleness_max"),
        "dropped_share": r.extra.get("dropped_share"),
    })
    return d


def write_json(study: StudyResult, path: str, studies: list[StudyResult] | None = None) -> None:
    """Everything: the shared settings, and per run the table's figures, the
    summed meters, the curves and the time figures (``studies``: every
    scenario's study, default ``[study]``)."""
    studies = studies or [study]
    doc = {
        "config": study.config.as_dict(),
        "dataset": {"name": "sklearn digits" if study.config.workload == "digits-mlp"
                    else study.config.workload, "train_samples": study.train_samples,
                    "test_samples": study.test_samples,
                    "granularity_pp": granularity_pp(study.test_samples)},
        "model": {"layers": [64, *study.config.hidden, 10], "parameters": study.num_parameters},
        "threshold": study.threshold,
        "target_accuracy": study.target_accuracy, "target_fraction": study.target_fraction,
        "seeds": study.seeds,
        "scenarios": [s.scenario for s in studies],
        "links": {s.scenario.get("name"): s.links for s in studies},
        "wall_s": sum(s.wall_s for s in studies),
        "runs": [run_record(r, s) for s in studies for r in s.runs],
    }
    with open(path, "w") as f:
        json.dump(json_ready(doc), f, indent=1)


def write_csv(study: StudyResult, path: str, studies: list[StudyResult] | None = None) -> None:
    """One row per run with :data:`COLUMNS` (plus the codec's CLI name)."""
    fields = [name for name, _ in COLUMNS]
    fields.insert(4, "name")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for s in studies or [study]:
            for r in s.runs:
                w.writerow(dict(_row(r), name=r.compressor))


def write_plot(study: StudyResult, path: str) -> None:
    """A PNG: per mode, test accuracy against the cumulative bytes per worker
    (log scale; sync: sent, async: pushed + pulled; async accuracy is worker
    0's replica) and the training loss (mean over workers) against the step."""
    from matplotlib.figure import Figure

    modes = list(dict.fromkeys(r.mode for r in study.runs))
    fig = Figure(figsize=(12, 4.2 * len(modes) + 0.4))
    axes = fig.subplots(len(modes), 2, squeeze=False)
    for (acc_ax, loss_ax), mode in zip(axes, modes):
        runs = [r for r in study.runs if r.mode == mode and r.seed == study.seeds[0]]
        # a zoom on the last third of training, where the final gaps are
        inset = acc_ax.inset_axes([0.5, 0.08, 0.46, 0.42])
        seen: dict[tuple, str] = {}
        for r in runs:
            curve = tuple(r.accuracy_at_marks)
            same = seen.get(curve)  # an identical accuracy curve drawn before: mark it
            label = r.label if same is None else f"{r.label} (same accuracy as {same})"
            seen.setdefault(curve, r.label)
            style = dict(ls="-", marker=".") if same is None else dict(ls="--", marker="x")
            xs = [max(b, 1.0) / 2**20 for b in r.bytes_at_marks]
            ys = [100 * a for a in r.accuracy_at_marks]
            line, = acc_ax.plot(xs, ys, label=label, **style)
            tail = max(1, (2 * len(xs)) // 3)
            inset.plot(range(tail, len(xs)), ys[tail:], color=line.get_color(), **style)
            loss_ax.plot(range(1, len(r.losses) + 1), _smooth(r.losses), label=r.label, lw=1)
        inset.set_title("last third (by evaluation)", fontsize=7)
        inset.tick_params(labelsize=6)
        inset.grid(True, alpha=0.3)
        moved = "pushed + pulled" if mode == "async" else "sent"
        acc_ax.set(xscale="log", xlabel=f"cumulative MiB {moved} per worker (log)",
                   ylabel="test accuracy (%)", title=f"{mode}: test accuracy vs traffic",
                   ylim=(max(0.0, min(100 * min(r.accuracy_at_marks) for r in runs) - 2), 100))
        loss_ax.set(yscale="log", xlabel="step", ylabel="training loss (smoothed over 10 steps)",
                    title=f"{mode}: training loss, mean over workers")
        for ax in (acc_ax, loss_ax):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title(study), 150)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _smooth(xs: list[float], window: int = 10) -> list[float]:
    """Trailing moving average over ``window`` values."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_time_plot(studies: list[StudyResult], path: str) -> None:
    """``time.png``: accuracy against training-clock seconds (a panel per
    scenario, a line per (mode, compressor), seed means at each mark); a
    stacked bar per run of where the mean step's time went; and the async
    staleness histogram (every async run of the first scenario)."""
    from matplotlib.figure import Figure

    from gradcomp.timeline import PHASES

    n = len(studies)
    fig = Figure(figsize=(max(12, 5 * n), 13))
    grid = fig.add_gridspec(3, n)
    target = studies[0].target_accuracy
    colors = {}
    for j, s in enumerate(studies):
        ax = fig.add_subplot(grid[0, j])
        for key in dict.fromkeys((r.mode, r.compressor) for r in s.runs):
            rs = [r for r in s.runs if (r.mode, r.compressor) == key]
            k = min(len(r.clock_at_marks) for r in rs)
            xs = [sum(r.clock_at_marks[i] for r in rs) / len(rs) for i in range(k)]
            ys = [100 * sum(r.accuracy_at_marks[i] for r in rs) / len(rs) for i in range(k)]
            line, = ax.plot(xs, ys, marker=".", ms=3, lw=1.2,
                            ls="-" if key[0] == "sync" else "--", label=f"{key[0]} {rs[0].label}",
                            color=colors.get(key[1]))
            colors.setdefault(key[1], line.get_color())
        if target is not None:
            ax.axhline(100 * target, color="k", lw=0.8, ls=":", label=f"target {100 * target:.1f}%")
        ax.set(xlabel="training time (s, evaluation excluded)", ylabel="test accuracy (%)",
               title=_scenario_title(s), ylim=(max(0.0, 100 * target - 25) if target else 0, 100))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    bar = fig.add_subplot(grid[1, :])
    labels, bottoms = [], []
    runs = [(s, key, [r for r in s.runs if (r.mode, r.compressor) == key])
            for s in studies for key in dict.fromkeys((r.mode, r.compressor) for r in s.runs)]
    shown = [p for p in PHASES if p != "other"] + ["other"]
    for i, (s, key, rs) in enumerate(runs):
        labels.append(f"{s.scenario.get('name')}\n{key[0]} {rs[0].label}")
        bottom = 0.0
        for p in shown:
            vals = [r.time.get("phases_mean_s", {}).get(p, 0.0) for r in rs if r.time]
            v = 1e3 * sum(vals) / len(vals) if vals else 0.0
            bar.bar(i, v, bottom=bottom, color=_PHASE_COLORS[p], label=p if i == 0 else None)
            bottom += v
        bottoms.append(bottom)
    bar.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    bar.set(ylabel="mean step time (ms), per worker", title="where a step's time goes "
            "(compute / compress / communicate / wait on peers / decompress / apply)")
    bar.legend(fontsize=7, ncol=7)
    bar.grid(True, axis="y", alpha=0.3)
    hist_ax = fig.add_subplot(grid[2, :])
    any_async = False
    for s in studies[:1]:
        for key in dict.fromkeys((r.mode, r.compressor) for r in s.runs if r.mode == "async"):
            rs = [r for r in s.runs if (r.mode, r.compressor) == key]
            hist: dict[int, int] = {}
            for r in rs:
                for k, v in (r.extra.get("staleness_histogram") or {}).items():
                    hist[int(k)] = hist.get(int(k), 0) + int(v)
            if hist:
                any_async = True
                ks = sorted(hist)
                total = sum(hist.values())
                hist_ax.plot(ks, [hist[k] / total for k in ks], marker="o", label=rs[0].label)
    if any_async:
        hist_ax.set(xlabel="staleness (server versions between a push's pull and its apply)",
                    ylabel="share of applied pushes",
                    title=f"async staleness histogram ({_scenario_title(studies[0])})")
        hist_ax.legend(fontsize=7)
        hist_ax.grid(True, alpha=0.3)
    else:
        hist_ax.set_axis_off()
    fig.suptitle(f"gradcomp time study: {title(studies[0])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


_PHASE_COLORS = {"compute": "#4c72b0", "compress": "#dd8452", "communicate": "#55a868",
                 "wait": "#c44e52", "decompress": "#8172b3", "apply": "#937860", "other": "#bbbbbb"}


def _scenario_title(s: StudyResult) -> str:
    from gradcomp.lab.units import format_rate

    links = [v for v in s.links.values() if v.get("configured_bps")]
    rate = (f", achieved {format_rate(links[0]['achieved_bps'])}" if links and links[0].get("achieved_bps")
            else "")
    return f"{s.scenario.get('name', 'loopback')}{rate}, {s.config.workers} workers"


def write_all(study: StudyResult, out_dir: str, studies: list[StudyResult] | None = None,
              max_gap_pp: float | None = None) -> dict[str, str]:
    """Write results.json, results.csv, results.png, time.png, decision.json and
    decision.md into ``out_dir`` (created if needed); returns their paths by kind."""
    from gradcomp.lab.study.decision import DEFAULT_MAX_GAP_PP, write_decision

    studies = studies or [study]
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: os.path.join(out_dir, f"results.{kind}") for kind in ("json", "csv", "png")}
    write_json(study, paths["json"], studies)
    write_csv(study, paths["csv"], studies)
    write_plot(study, paths["png"])
    paths["time_png"] = os.path.join(out_dir, "time.png")
    write_time_plot(studies, paths["time_png"])
    runs = [r for s in studies for r in s.runs]
    paths.update(write_decision(
        runs, out_dir, study.target_accuracy,
        DEFAULT_MAX_GAP_PP if max_gap_pp is None else max_gap_pp,
        {"description": title(study), "seeds": study.seeds,
         "test_granularity_pp": granularity_pp(study.test_samples)}))
    return paths
