"""Study reports: a terminal table (rich), ``results.json``, ``results.csv`` and a plot."""

from __future__ import annotations

import csv
import json
import math
import os
import textwrap
from dataclasses import asdict

from gradcomp.train.study import RunResult, StudyResult

__all__ = ["title", "table", "write_json", "write_csv", "write_plot", "write_all"]

#: Columns of the table and the CSV: (CSV field, table header).
COLUMNS = (
    ("mode", "mode"),
    ("compressor", "compressor"),
    ("bytes_per_worker_per_step", "bytes/worker/step"),
    ("reduction_x", "reduction"),
    ("reduction_pct", "saved"),
    ("test_accuracy_pct", "test acc"),
    ("accuracy_gap_pp", "gap (pp)"),
    ("wall_s", "wall (s)"),
)


def _row(r: RunResult) -> dict:
    """The CSV row of a run (rounded figures)."""
    return {
        "mode": r.mode,
        "compressor": r.label,
        "bytes_per_worker_per_step": round(r.bytes_per_worker_per_step, 1),
        "reduction_x": round(r.reduction_x, 2),
        "reduction_pct": round(r.reduction_pct, 2),
        "test_accuracy_pct": round(100 * r.test_accuracy, 2),
        "accuracy_gap_pp": round(r.accuracy_gap_pp, 2),
        "wall_s": round(r.wall_s, 2),
    }


def title(study: StudyResult) -> str:
    """One line describing what every run of the study shared."""
    c = study.config
    modes = {r.mode for r in study.runs}
    per_push = f" (async: {c.lr / c.workers:.3g} per push)" if "async" in modes else ""
    algorithm = f", sync dense algorithm: {c.algorithm}" if modes & {"sync", "local"} else ""
    if "local" in modes:
        streaming = f", {c.fragments} fragments, overlap {c.overlap}" if c.fragments > 1 or c.overlap else ""
        algorithm += f", local: sync every {c.sync_every} steps, outer {c.outer}{streaming}"
    return (f"digits ({study.train_samples} train / {study.test_samples} test), "
            f"MLP {'-'.join(map(str, (64, *c.hidden, 10)))} ({study.num_parameters:,} params), "
            f"{c.workers} workers x batch {c.batch_size}, {c.steps} steps, SGD lr {c.lr:g}"
            f"{per_push} momentum {c.momentum:g}, seed {c.seed}{algorithm}")


def table(study: StudyResult):
    """A :class:`rich.table.Table` of the runs."""
    from rich.table import Table

    t = Table()
    for _, header in COLUMNS:
        t.add_column(header, justify="left" if header in ("mode", "compressor") else "right")
    for i, r in enumerate(study.runs):
        if i and r.mode != study.runs[i - 1].mode:
            t.add_section()
        t.add_row(
            r.mode, r.label, f"{r.bytes_per_worker_per_step:,.0f}",
            f"{r.reduction_x:.2f}x", f"{r.reduction_pct:.1f}%", f"{100 * r.test_accuracy:.2f}%",
            f"{r.accuracy_gap_pp:+.2f}", f"{r.wall_s:.1f}")
    return t


def _json_ready(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return x


def write_json(study: StudyResult, path: str) -> None:
    """Everything: the shared settings, and per run the table's figures, the
    summed meters and the curves."""
    doc = {
        "config": study.config.as_dict(),
        "dataset": {"name": "sklearn digits", "train_samples": study.train_samples,
                    "test_samples": study.test_samples},
        "model": {"layers": [64, *study.config.hidden, 10], "parameters": study.num_parameters},
        "threshold": study.threshold,
        "wall_s": study.wall_s,
        "runs": [dict(asdict(r), test_accuracy_pct=100 * r.test_accuracy) for r in study.runs],
    }
    with open(path, "w") as f:
        json.dump(_json_ready(doc), f, indent=1)


def write_csv(study: StudyResult, path: str) -> None:
    """One row per run with the table's columns (plus the codec's CLI name)."""
    fields = [name for name, _ in COLUMNS]
    fields.insert(2, "name")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in study.runs:
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
        runs = [r for r in study.runs if r.mode == mode]
        for r in runs:
            acc_ax.plot([max(b, 1.0) / 2**20 for b in r.bytes_at_marks],
                        [100 * a for a in r.accuracy_at_marks], marker=".", label=r.label)
            loss_ax.plot(range(1, len(r.losses) + 1), _smooth(r.losses), label=r.label, lw=1)
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


def write_all(study: StudyResult, out_dir: str) -> dict[str, str]:
    """Write results.json, results.csv and results.png into ``out_dir`` (created
    if needed); returns their paths by kind."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: os.path.join(out_dir, f"results.{kind}") for kind in ("json", "csv", "png")}
    write_json(study, paths["json"])
    write_csv(study, paths["csv"])
    write_plot(study, paths["png"])
    return paths
