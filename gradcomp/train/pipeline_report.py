"""Reports of ``gradcomp train --mode pipeline``: a table, ``pipeline.json`` and the bubble plot."""

from __future__ import annotations

import json
import os

__all__ = ["print_report", "write_all", "write_plot"]


def _kib(n: float) -> str:
    return f"{n / 1024:.0f}"


def print_report(result: dict) -> None:
    """Print the runs table and, for PipeDream runs, the per-stage staleness and update rates."""
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    console = Console(highlight=False, width=max(Console().width, 120))
    console.print(f"pipeline: MLP {cfg['hidden']} ({result['layers']} layers) in {cfg['stages']} stages x "
                  f"{cfg['workers'] // cfg['stages']} replica(s), batch {cfg['batch_size']} per replica, "
                  f"{cfg['steps']} steps, SGD lr {cfg['lr']} momentum {cfg['momentum']}, seed {cfg['seed']}")
    t = Table()
    seeds = result.get("seeds", 1) > 1
    for col in (("seed",) if seeds else ()) + ("schedule", "M", "compressor", "boundary B/step", "reduction", "test acc", "gap (pp)",
                "bubble", "theory", "idle", "act peak KiB/stage", "wall (s)"):
        t.add_column(col, justify="left" if col in ("schedule", "compressor") else "right")
    for r in result["runs"]:
        th = r["bubble_theory"]
        t.add_row(*((str(r["seed"]),) if seeds else ()), r["schedule"], str(r["microbatches"]) if r["schedule"] != "pipedream" else "-",
                  r["label"], f"{r['bytes_per_step']:,.0f}", f"{r['reduction_x']:.2f}x",
                  f"{100 * r['test_accuracy']:.2f}%", f"{r['accuracy_gap_pp']:+.2f}",
                  f"{r['bubble']:.3f}", "-" if th is None else f"{th:.3f}", f"{r['idle_fraction']:.3f}",
                  "/".join(_kib(s["activation_peak_bytes"]) for s in r["per_stage"]), f"{r['wall_s']:.1f}")
    console.print(t)
    if seeds:
        groups: dict[tuple, list[dict]] = {}
        for r in result["runs"]:
            groups.setdefault((r["schedule"], r["microbatches"], r["label"]), []).append(r)
        for (schedule, m, label), rs in groups.items():
            n = len(rs)
            what = f"{schedule} M={m}" if schedule != "pipedream" else schedule
            console.print(f"{what} {label}: test acc {100 * sum(r['test_accuracy'] for r in rs) / n:.2f}% "
                          f"mean of {n} seeds, gap {sum(r['accuracy_gap_pp'] for r in rs) / n:+.2f} pp "
                          f"(max {max(r['accuracy_gap_pp'] for r in rs):+.2f}), reduction "
                          f"{min(r['reduction_x'] for r in rs):.2f}x")
    for r in result["runs"]:
        if r["schedule"] != "pipedream":
            continue
        parts = [f"stage {i}: staleness {s['staleness_mean']:.2f} (max {s['staleness_max']}), "
                 f"{s['update_rate_per_s']:.0f} updates/s, first update at {s['first_update_s']:.3f} s"
                 for i, s in enumerate(r["per_stage"])]
        seed = f" seed {r['seed']}" if seeds else ""
        console.print(f"pipedream {r['label']}{seed}: " + "; ".join(parts))


def write_plot(result: dict, path: str) -> bool:
    """Measured bubble and its idle part (``none`` runs) and the theory over M per
    schedule; False (nothing written) when no schedule ran with more than one M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float | None, float]]] = {}
    for r in result["runs"]:
        if (r["compressor"] == "none" and r["schedule"] != "pipedream"
                and r.get("seed", 0) == result["config"]["seed"]):  # the first seed's
            series.setdefault(r["schedule"], []).append(
                (r["microbatches"], r["bubble"], r["bubble_theory"], r["idle_fraction"]))
    if not any(len(v) > 1 for v in series.values()):
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        pts.sort()
        ms = [pt[0] for pt in pts]
        line, = ax.plot(ms, [pt[1] for pt in pts], "o-", label=f"{name} measured (idle + wait)")
        ax.plot(ms, [pt[3] for pt in pts], "s:", color=line.get_color(),
                label=f"{name} idle (input not sent yet)")
        if all(pt[2] is not None for pt in pts):
            ax.plot(ms, [pt[2] for pt in pts], "--", color=line.get_color(), label=f"{name} theory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (M)")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"pipeline bubble, P = {result['config']['stages']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_all(result: dict, out_dir: str) -> list[str]:
    """Write ``pipeline.json`` (and ``pipeline-bubble.png`` when M varies) to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "pipeline.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    paths = [path]
    png = os.path.join(out_dir, "pipeline-bubble.png")
    if write_plot(result, png):
        paths.append(png)
    return paths
