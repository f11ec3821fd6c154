"""Study reports: ``results.json``, ``results.csv`` and plots (the terminal tables: :mod:`.terminal`).

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
from dataclasses import asdict

from gradcomp.lab.study.config import COMPRESSORS
from gradcomp.lab.study.output import json_ready
from gradcomp.lab.study.study import RunResult, StudyResult

__all__ = ["write_decisions_plot", "title", "link_line", "write_json", "model_record", "write_csv", "write_plot", "write_time_plot",
           "write_all", "json_ready", "run_record", "granularity_pp"]

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

def granularity_pp(test_predictions: int) -> float:
    """Accuracy points one test prediction is worth (0.22 on the digits' 450 images; a
    sequence workload predicts every character of a test window)."""
    return 100.0 / test_predictions


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
                 if modes & {"sync", "local", "auto", "ft"} else "")
    if "ft" in modes:
        algorithm += f", ft: quorum join timeout {c.ft_timeout * 1e3:g} ms"
    if "local" in modes:
        streaming = f", {c.fragments} fragments, overlap {c.overlap}" if c.fragments > 1 or c.overlap else ""
        algorithm += f", local: sync every {c.sync_every} steps, outer {c.outer}{streaming}"
    if c.label_skew is not None:
        algorithm += f", data: each worker's classes in Dirichlet({c.label_skew:g}) proportions"
    if "auto" in modes:
        share = "" if c.comm_share is None else f" at an exchange share of {c.comm_share:g}"
        share += "" if c.period_cost is None else f" at a period cost of {c.period_cost:g}"
        algorithm += f", auto: period chosen in {c.min_sync_every}..{c.max_sync_every} steps{share}, outer {c.outer}"
    if modes & {"local", "auto"} and c.partial_work is not None:
        algorithm += f", partial work {'on' if c.partial_work else 'off'} (local and auto)"
    elif "auto" in modes:
        algorithm += ", partial work in auto"
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
    from gradcomp.lab.study.decision import phases_text
    from gradcomp.lab.units import format_rate

    parts = []
    for mode, link in study.links.items():
        if len(link.get("phases") or ()) > 1:
            parts.append(f"{mode}: " + phases_text(link["phases"]))
        elif link.get("configured_bps"):
            parts.append(f"{mode}: {format_rate(link['configured_bps'])} configured, "
                         f"{format_rate(link['achieved_bps'])} achieved")
        else:
            parts.append(f"{mode}: {link.get('emulation', 'loopback')}")
    sc = study.scenario
    extra = []
    if sc.get("straggler"):
        onset = sc["straggler"].get("from_s") or 0
        extra.append(f"straggler worker {sc['straggler']['rank']} x{sc['straggler']['factor']:g}"
                     + (f" from {onset:g} s" if onset else ""))
    if sc.get("compute_jitter_cv"):
        extra.append(f"compute jitter CV {sc['compute_jitter_cv']:g}")
    if sc.get("link_jitter"):
        extra.append(f"link jitter {sc['link_jitter']:g}")
    seeds = study.seeds
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]}"
    return (f"scenario {sc.get('name', 'loopback')} ({'; '.join(parts)}"
            f"{'; ' + ', '.join(extra) if extra else ''}), {seed_text}, target accuracy "
            f"{100 * study.target_accuracy:.2f}%")


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


def model_record(study: StudyResult) -> dict:
    """The results' ``"model"``: the workload, its parameters and parameter tensors, and the
    layer widths of the digits MLP (the only workload built from ``--hidden``)."""
    c = study.config
    rec: dict = {"workload": c.workload, "parameters": study.num_parameters}
    if study.param_tensors is not None:
        rec["param_tensors"] = study.param_tensors
    if c.workload == "digits-mlp":
        rec["layers"] = [64, *c.hidden, 10]
    return rec


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
                    "granularity_pp": granularity_pp(study.predictions)},
        "model": model_record(study),
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
    """``results.png``: per mode, test accuracy against the cumulative bytes per
    worker (log scale; sync: sent, async: pushed + pulled; async accuracy is
    worker 0's replica) and the training loss (mean over workers) against the
    step (:func:`gradcomp.lab.study.figures.results_figure`)."""
    from gradcomp.lab.study.figures import results_figure

    results_figure(study, title(study)).savefig(path, dpi=110)


def write_time_plot(studies: list[StudyResult], path: str) -> None:
    """``time.png``: accuracy against training-clock seconds (a panel per
    scenario, a line per (mode, compressor), seed means at each mark); a
    stacked bar per run of where the mean step's time went; and the async
    staleness histogram (:func:`gradcomp.lab.study.figures.time_figure`)."""
    from gradcomp.lab.study.figures import time_figure

    time_figure(studies, title(studies[0])).savefig(path, dpi=100)


def write_decisions_plot(studies: list[StudyResult], path: str) -> bool:
    """``decisions.png``: per scenario, the first seed's auto run's period, codec, link rate and
    idle share over time (:func:`gradcomp.lab.study.figures.decisions_figure`); False (nothing
    written) when no study ran the auto mode."""
    from gradcomp.lab.study.figures import decisions_figure

    runs = [next(r for r in s.runs if r.mode == "auto" and r.seed == s.seeds[0])
            for s in studies if any(r.mode == "auto" for r in s.runs)]
    if not runs:
        return False
    decisions_figure(runs, title(studies[0])).savefig(path, dpi=100)
    return True


def write_all(study: StudyResult, out_dir: str, studies: list[StudyResult] | None = None,
              max_gap_pp: float | None = None) -> dict[str, str]:
    """Write results.json, results.csv, results.png, time.png, decision.json,
    decision.md and (with the auto mode) decisions.png into ``out_dir`` (created if
    needed); returns their paths by kind."""
    from gradcomp.lab.study.decision import DEFAULT_MAX_GAP_PP, write_decision

    studies = studies or [study]
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: os.path.join(out_dir, f"results.{kind}") for kind in ("json", "csv", "png")}
    write_json(study, paths["json"], studies)
    write_csv(study, paths["csv"], studies)
    write_plot(study, paths["png"])
    paths["time_png"] = os.path.join(out_dir, "time.png")
    write_time_plot(studies, paths["time_png"])
    if write_decisions_plot(studies, os.path.join(out_dir, "decisions.png")):
        paths["decisions_png"] = os.path.join(out_dir, "decisions.png")
    runs = [r for s in studies for r in s.runs]
    paths.update(write_decision(
        runs, out_dir, study.target_accuracy,
        DEFAULT_MAX_GAP_PP if max_gap_pp is None else max_gap_pp,
        {"description": title(study), "seeds": study.seeds,
         "test_granularity_pp": granularity_pp(study.predictions)}))
    return paths
