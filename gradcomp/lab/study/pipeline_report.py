"""Reports of ``gradcomp train --mode pipeline``: a table, ``pipeline.json`` and the bubble plot."""

from __future__ import annotations

import json
import os

__all__ = ["print_report", "write_all", "write_plot", "medians", "median_lines"]


def _kib(n: float) -> str:
    return f"{n / 1024:.0f}"


def print_report(result: dict) -> None:
    """Print the runs table and, for PipeDream runs, the per-stage staleness and update rates."""
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    console = Console(highlight=False)
    if not console.is_terminal:  # a log file: the whole table, not truncated cells
        console = Console(highlight=False, width=max(console.width, 200))
    console.print(f"pipeline: MLP {cfg['hidden']} ({result['layers']} layers) in {cfg['stages']} stages x "
                  f"{cfg['workers'] // cfg['stages']} replica(s), batch {cfg['batch_size']} per replica, "
                  f"{cfg['steps']} steps, SGD lr {cfg['lr']} momentum {cfg['momentum']}, seed {cfg['seed']}")
    for sc in result.get("scenarios", []):
        console.print(_link_line(sc), highlight=False)
    t = Table()
    seeds = result.get("seeds", 1) > 1
    many = len(result.get("scenarios", [])) > 1
    for col in (("scenario",) if many else ()) + (("seed",) if seeds else ()) + (
            "schedule", "M", "compressor", "boundary B/step", "reduction", "test acc", "gap (pp)",
            "bubble", "theory", "idle", "act peak KiB/stage", "step (ms)", "model (ms)",
            "to target (s)", "wall (s)"):
        t.add_column(col, justify="left" if col in ("scenario", "schedule", "compressor") else "right")
    for r in result["runs"]:
        th = r["bubble_theory"]
        t.add_row(*((r["scenario"]["name"],) if many else ()), *((str(r["seed"]),) if seeds else ()),
                  r["schedule"], str(r["microbatches"]) if r["schedule"] != "pipedream" else "-",
                  r["label"], f"{r['bytes_per_step']:,.0f}", f"{r['reduction_x']:.2f}x",
                  f"{100 * r['test_accuracy']:.2f}%", f"{r['accuracy_gap_pp']:+.2f}",
                  f"{r['bubble']:.3f}", "-" if th is None else f"{th:.3f}", f"{r['idle_fraction']:.3f}",
                  "/".join(_kib(s["activation_peak_bytes"]) for s in r["per_stage"]),
                  _ms(r["step_s"]), _ms(r["model_step_s"]), _s(r["time_to_target_s"]), f"{r['wall_s']:.1f}")
    console.print(t)
    console.print(f"target accuracy {100 * result['target_accuracy']:.2f}%"
                  + (f" ({result['target_fraction']:g} x the first none baseline)"
                     if result.get("target_fraction") else ""), highlight=False)
    for line in median_lines(result):
        console.print(line, highlight=False)
    if seeds:
        groups: dict[tuple, list[dict]] = {}
        for r in result["runs"]:
            groups.setdefault((r["scenario"]["name"], r["schedule"], r["microbatches"], r["label"]),
                              []).append(r)
        for (scenario, schedule, m, label), rs in groups.items():
            n = len(rs)
            what = f"{schedule} M={m}" if schedule != "pipedream" else schedule
            what = f"{scenario} {what}" if many else what
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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _link_line(entry: dict) -> str:
    link = entry["link"]
    if link.get("configured_bps") is None:
        return f"scenario {entry['scenario']['name']}: loopback (unshaped)"
    achieved = link.get("achieved_bps")
    return (f"scenario {entry['scenario']['name']}: link {link['name']} configured "
            f"{link['configured_bps'] / 1e6:.1f} Mbit/s, achieved "
            + ("-" if achieved is None else f"{achieved / 1e6:.1f} Mbit/s")
            + f" ({link.get('emulation')}, {link.get('world_size')} hosts, MTU {link.get('mtu')})")


def _median(xs: list) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def medians(result: dict) -> list[dict]:
    """Per (scenario, schedule, M, compressor): the median over seeds of the step
    time, bubble and time to target, and the step-time speedup against ``none``
    (ratio of the medians); runs that missed the target count as missing."""
    groups: dict[tuple, list[dict]] = {}
    for r in result["runs"]:
        groups.setdefault((r["scenario"]["name"], r["schedule"], r["microbatches"], r["compressor"]),
                          []).append(r)
    out = []
    for (scenario, schedule, m, compressor), rs in groups.items():
        out.append({"scenario": scenario, "schedule": schedule, "microbatches": m,
                    "compressor": compressor, "label": rs[0]["label"], "seeds": len(rs),
                    "step_s": _median([r["step_s"] for r in rs]),
                    "model_step_s": _median([r["model_step_s"] for r in rs]),
                    "bubble": _median([r["bubble"] for r in rs]),
                    "time_to_target_s": _median([r["time_to_target_s"] for r in rs]),
                    "reached": sum(r["time_to_target_s"] is not None for r in rs),
                    "bytes_per_step": _median([r["bytes_per_step"] for r in rs]),
                    "test_accuracy": _median([r["test_accuracy"] for r in rs])})
    base = {(g["scenario"], g["schedule"], g["microbatches"]): g for g in out if g["compressor"] == "none"}
    for g in out:
        b = base.get((g["scenario"], g["schedule"], g["microbatches"]))
        g["step_speedup_x"] = (b["step_s"] / g["step_s"]
                               if b is not None and b["step_s"] and g["step_s"] else None)
    return out


def median_lines(result: dict) -> list[str]:
    """One line per (scenario, schedule, M, compressor) with :func:`medians`."""
    lines = []
    for g in medians(result):
        what = g["schedule"] if g["schedule"] == "pipedream" else f"{g['schedule']} M={g['microbatches']}"
        speed = "" if g["step_speedup_x"] is None else f" ({g['step_speedup_x']:.2f}x none's)"
        lines.append(f"{g['scenario']} {what} {g['label']}: median of {g['seeds']} seed(s): step "
                     f"{_ms(g['step_s'])} ms{speed}, model {_ms(g['model_step_s'])} ms, bubble "
                     f"{g['bubble']:.3f}, time to target {_s(g['time_to_target_s'])} s "
                     f"({g['reached']}/{g['seeds']} reached)")
    return lines


def write_plot(result: dict, path: str) -> bool:
    """Measured bubble and its idle part (``none`` runs) and the theory over M per
    schedule; False (nothing written) when no schedule ran with more than one M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float | None, float]]] = {}
    for r in result["runs"]:
        if (r["compressor"] == "none" and r["schedule"] != "pipedream"
                and r.get("seed", 0) == result["config"]["seed"]  # the first seed's, first scenario's
                and r["scenario"]["name"] == result["runs"][0]["scenario"]["name"]):
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
        json.dump({**result, "medians": medians(result)}, f, indent=1)
    paths = [path]
    png = os.path.join(out_dir, "pipeline-bubble.png")
    if write_plot(result, png):
        paths.append(png)
    return paths
