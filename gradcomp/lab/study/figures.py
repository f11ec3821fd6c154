"""The study's figures as matplotlib Figures a person reads: ``results.png``, ``time.png``, ``decisions.png``.

One colour per compressor and one line style per mode, the same in every
panel and explained once, in a legend outside the data (below the panels);
titles wrapped inside the figure; every axis says what it measures.
:mod:`gradcomp.lab.study.report` saves them.
"""

from __future__ import annotations

import textwrap

__all__ = ["MODE_STYLES", "REASON_MARKERS", "results_figure", "time_figure", "decisions_figure", "codec_colors"]

#: line style per mode
MODE_STYLES = {"sync": "-", "async": "--", "local": ":", "auto": "-.", "ft": (0, (3, 1, 1, 1, 1, 1))}
_PHASE_COLORS = {"compute": "#4c72b0", "compress": "#dd8452", "communicate": "#55a868",
                 "wait": "#c44e52", "decompress": "#8172b3", "apply": "#937860", "other": "#bbbbbb"}


def codec_colors(runs) -> dict[str, str]:
    """One colour per compressor, in order of first appearance (matplotlib's tab10 / tab20)."""
    from matplotlib import colormaps

    names = list(dict.fromkeys(r.compressor for r in runs))
    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _legends(fig, runs, colors, modes, extra=()) -> None:
    """One legend below the panels: a colour per compressor, a line style per mode, ``extra`` handles."""
    from matplotlib.lines import Line2D

    labels = {r.compressor: r.label for r in runs}
    handles = [Line2D([], [], color=colors[c], lw=2, label=labels[c]) for c in colors]
    if len(modes) > 1:
        handles += [Line2D([], [], color="k", ls=MODE_STYLES.get(m, "-"), label=f"{m} (line style)") for m in modes]
    handles += list(extra)
    fig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)), fontsize=8)


def _smooth(xs: list[float], window: int = 10) -> list[float]:
    """Trailing moving average over ``window`` values."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def results_figure(study, title: str):
    """Per mode, test accuracy against cumulative MiB per worker (log scale), a zoom
    on the last third of training (accuracy against the step) and the smoothed
    training loss: three panels side by side, nothing drawn over another."""
    from matplotlib.figure import Figure

    modes = list(dict.fromkeys(r.mode for r in study.runs))
    colors = codec_colors(study.runs)
    fig = Figure(figsize=(15, 4.2 * len(modes) + 1.4), layout="constrained")
    axes = fig.subplots(len(modes), 3, squeeze=False, width_ratios=(1.2, 0.8, 1.0))
    for (acc_ax, zoom, loss_ax), mode in zip(axes, modes):
        runs = [r for r in study.runs if r.mode == mode and r.seed == study.seeds[0]]
        for r in runs:
            style = dict(color=colors[r.compressor], ls=MODE_STYLES.get(mode, "-"), marker=".", ms=4, lw=1.2)
            ys = [100 * a for a in r.accuracy_at_marks]
            acc_ax.plot([max(b, 1.0) / 2**20 for b in r.bytes_at_marks], ys, **style)
            tail = max(1, (2 * len(ys)) // 3) if len(ys) > 1 else 0
            zoom.plot(r.marks[tail:], ys[tail:], **style)
            loss_ax.plot(range(1, len(r.losses) + 1), _smooth(r.losses), color=colors[r.compressor],
                         ls=MODE_STYLES.get(mode, "-"), lw=1)
        moved = "pushed + pulled" if mode == "async" else "sent"
        acc_ax.set(xscale="log", xlabel=f"cumulative MiB {moved} per worker (log scale)",
                   ylabel="test accuracy (%)", title=f"{mode}: test accuracy against traffic",
                   ylim=(max(0.0, min(100 * min(r.accuracy_at_marks) for r in runs) - 2), 100))
        zoom.set(xlabel="step", ylabel="test accuracy (%)", title=f"{mode}: zoom on the last third")
        loss_ax.set(yscale="log", xlabel="step", ylabel="training loss (mean of 10 steps)",
                    title=f"{mode}: training loss, mean over workers")
        for ax in (acc_ax, zoom, loss_ax):
            ax.grid(True, which="both", alpha=0.3)
    _legends(fig, study.runs, colors, modes)
    fig.suptitle("\n".join(textwrap.wrap(title, 160)), fontsize=9)
    return fig


def _scenario_title(s) -> str:
    from gradcomp.lab.units import format_rate

    links = [v for v in s.links.values() if v.get("configured_bps")]
    rate = (f", achieved {format_rate(links[0]['achieved_bps'])}" if links and links[0].get("achieved_bps")
            else "")
    return f"{s.scenario.get('name', 'loopback')}{rate}, {s.config.workers} workers"


def _accuracy_panels(fig, grid, studies, colors) -> None:
    target = studies[0].target_accuracy
    for j, s in enumerate(studies):
        ax = fig.add_subplot(grid[0, j])
        for key in dict.fromkeys((r.mode, r.compressor) for r in s.runs):
            rs = [r for r in s.runs if (r.mode, r.compressor) == key]
            k = min(len(r.clock_at_marks) for r in rs)
            xs = [sum(r.clock_at_marks[i] for r in rs) / len(rs) for i in range(k)]
            ys = [100 * sum(r.accuracy_at_marks[i] for r in rs) / len(rs) for i in range(k)]
            ax.plot(xs, ys, marker=".", ms=3, lw=1.2, ls=MODE_STYLES.get(key[0], "-"), color=colors[key[1]])
        if target is not None:
            ax.axhline(100 * target, color="k", lw=0.8, ls=":")
        ax.set(xlabel="training time (s, evaluation excluded)", ylabel="test accuracy (%, seed mean)",
               title=_scenario_title(s), ylim=(max(0.0, 100 * target - 25) if target else 0, 100))
        ax.grid(True, alpha=0.3)


def _phase_bars(fig, grid, studies) -> None:
    from gradcomp.timeline import PHASES

    bar = fig.add_subplot(grid[1, :])
    runs = [(s, key, [r for r in s.runs if (r.mode, r.compressor) == key])
            for s in studies for key in dict.fromkeys((r.mode, r.compressor) for r in s.runs)]
    shown = [p for p in PHASES if p != "other"] + ["other"]
    labels = []
    for i, (s, key, rs) in enumerate(runs):
        labels.append(f"{s.scenario.get('name')}\n{key[0]} {rs[0].label}")
        bottom = 0.0
        for p in shown:
            vals = [r.time.get("phases_mean_s", {}).get(p, 0.0) for r in rs if r.time]
            v = 1e3 * sum(vals) / len(vals) if vals else 0.0
            bar.bar(i, v, bottom=bottom, color=_PHASE_COLORS[p], label=p if i == 0 else None)
            bottom += v
    bar.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    bar.set(xlabel="run (scenario, mode, compressor)", ylabel="mean step time per worker (ms)",
            title="where a step's time goes")
    bar.legend(fontsize=7, ncol=len(shown), loc="lower center", bbox_to_anchor=(0.5, 1.08), frameon=False)
    bar.grid(True, axis="y", alpha=0.3)


def _staleness(fig, grid, studies, colors) -> None:
    ax = fig.add_subplot(grid[2, :])
    drawn = False
    for key in dict.fromkeys((r.mode, r.compressor) for r in studies[0].runs if r.mode == "async"):
        hist: dict[int, int] = {}
        for r in (r for r in studies[0].runs if (r.mode, r.compressor) == key):
            for k, v in (r.extra.get("staleness_histogram") or {}).items():
                hist[int(k)] = hist.get(int(k), 0) + int(v)
        if hist:
            drawn = True
            ks, total = sorted(hist), sum(hist.values())
            ax.plot(ks, [hist[k] / total for k in ks], marker="o", ls="--", color=colors[key[1]])
    if not drawn:
        ax.set_axis_off()
        return
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # staleness counts versions
    ax.set(xlabel="staleness (server versions between a push's pull and its apply)",
           ylabel="share of applied pushes", title=f"async staleness ({_scenario_title(studies[0])})")
    ax.grid(True, alpha=0.3)


def time_figure(studies, title: str):
    """Accuracy against training-clock seconds (a panel per scenario, seed means),
    a stacked bar per run of where the mean step's time went, and the async
    staleness histogram of the first scenario."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    runs = [r for s in studies for r in s.runs]
    colors = codec_colors(runs)
    n = len(studies)
    fig = Figure(figsize=(max(12, 5 * n), 14), layout="constrained")
    grid = fig.add_gridspec(3, n, height_ratios=(1.1, 1.0, 0.7))
    _accuracy_panels(fig, grid, studies, colors)
    _phase_bars(fig, grid, studies)
    _staleness(fig, grid, studies, colors)
    target = studies[0].target_accuracy
    extra = [Line2D([], [], color="k", lw=0.8, ls=":", label=f"target {100 * target:.1f}%")] if target else []
    _legends(fig, runs, colors, list(dict.fromkeys(r.mode for r in runs)), extra)
    width = int(14 * fig.get_figwidth())  # characters of 9-point text across the figure
    fig.suptitle("\n".join(textwrap.wrap(f"gradcomp time study: {title}", width)), fontsize=9)
    return fig


#: marker of each reason the period moved (:data:`gradcomp.sync_period.REASONS`)
REASON_MARKERS = {"comm_share_high": ("^", "exchange grew against compute: H up"),
                  "comm_share_low": ("v", "exchange shrank against compute: H down"),
                  "loss_fell": ("x", "loss fell: H down (AdaComm)"),
                  "divergence_high": ("D", "models diverge, loss fell: H down"),
                  "divergence_low": ("d", "models agree: loss factor lifted, H up")}


def _step_xy(ts: list[float], ys: list, t_end: float) -> tuple[list[float], list]:
    """A step function's points: ``ys[i]`` from ``ts[i]`` until the next time (the last until ``t_end``)."""
    xs, out = [], []
    for i, (t, y) in enumerate(zip(ts, ys)):
        xs += [t, ts[i + 1] if i + 1 < len(ts) else max(t, t_end)]
        out += [y, y]
    return xs, out


def _events(r) -> list[tuple[float, str]]:
    """The changes of conditions within run ``r`` on its training clock: link phase starts and
    the straggler's onset, as ``(t_s, label)``."""
    lag = r.extra.get("link_origin_lag_s") or 0.0
    out = [(p["start_s"] - lag, "link") for p in (r.link.get("phases") or [])[1:]]
    strag = (r.scenario or {}).get("straggler") or {}
    if strag.get("from_s"):
        out.append((strag["from_s"], "straggler"))
    return out


def _decision_column(fig, grid, j: int, r) -> None:
    """The four panels of one auto run: H (with each move's reason and the slowest worker's steps
    a round under partial work), codec, link rate, idle share."""
    from gradcomp.lab.units import format_rate

    decisions = r.extra.get("decisions") or []
    series = r.extra.get("steps_series") or {"t_s": [], "idle_share": []}
    t_end = series["t_s"][-1] if series["t_s"] else r.wall_s
    step_t = dict(zip(range(1, len(series["t_s"]) + 1), series["t_s"]))
    h_ax, c_ax, l_ax, i_ax = (fig.add_subplot(grid[k, j]) for k in range(4))
    ts = [d["t_s"] for d in decisions]
    h_ax.plot(*_step_xy(ts, [d["sync_every"] for d in decisions], t_end), color="#4c72b0", lw=1.2)
    if any(d.get("quotas") for d in decisions):  # partial work: the slowest worker's share of a round
        h_ax.plot(*_step_xy(ts, [min(d.get("quotas") or [d["sync_every"]]) for d in decisions], t_end),
                  color="#8172b3", lw=1, ls="--")
    for e in (e for e in r.meter.get("switches", []) if e.get("kind") == "sync_every"):
        marker, _ = REASON_MARKERS.get(e["reason"], ("o", e["reason"]))
        h_ax.plot([step_t.get(e["step"], 0.0)], [e["to"]], marker=marker, color="k", ms=5, ls="none")
    h_ax.set(yscale="log", ylabel="period H (steps)", title=f"{(r.scenario or {}).get('name', 'loopback')}: "
             f"auto, seed {r.seed}")
    codecs = list(dict.fromkeys(d["codec"] or "?" for d in decisions)) or ["?"]
    c_ax.plot(*_step_xy(ts, [codecs.index(d["codec"] or "?") for d in decisions], t_end), color="#dd8452", lw=1.2)
    c_ax.set_yticks(range(len(codecs)), codecs, fontsize=7)
    c_ax.set(ylim=(-0.5, len(codecs) - 0.5), ylabel="codec chosen")
    phases = r.link.get("phases") or ([{"start_s": 0.0, "achieved_bps": r.link.get("achieved_bps")}]
                                      if r.link.get("configured_bps") else [])
    lag = r.extra.get("link_origin_lag_s") or 0.0
    if phases and all(p.get("achieved_bps") for p in phases):
        xs = [max(0.0, p["start_s"] - lag) for p in phases]
        l_ax.plot(*_step_xy(xs, [p["achieved_bps"] / 1e6 for p in phases], t_end), color="#55a868", lw=1.2)
        rates = [p["achieved_bps"] / 1e6 for p in phases]
        l_ax.set(yscale="log", ylim=(min(rates) / 2, max(rates) * 2))  # 1 gbit and 100 mbit both readable
        l_ax.set_title("achieved: " + ", ".join(format_rate(p["achieved_bps"]) for p in phases), fontsize=8)
    else:
        l_ax.set_title("unshaped loopback: no link rate", fontsize=8)
    l_ax.set(ylabel="achieved link rate\n(Mbit/s, log scale)")
    i_ax.plot(series["t_s"], [100 * x for x in _smooth(series["idle_share"])], color="#c44e52", lw=1)
    i_ax.set(ylabel="idle share (%,\nmean of 10 steps)", ylim=(0, 100))
    for ax in (h_ax, c_ax, l_ax, i_ax):
        ax.set(xlim=(0, t_end), xlabel="training time (s, evaluation excluded)")
        ax.grid(True, alpha=0.3)
        for t, what in _events(r):
            ax.axvline(t, color="k", lw=0.8, ls="--" if what == "link" else ":")


def decisions_figure(runs, title: str):
    """The auto mode's decisions over time, a column per auto run given (one per scenario):
    the period ``H`` (each move marked with its reason), the codec, the link's achieved rate
    per phase and the workers' idle share against the training clock, with the link's phase
    changes and the straggler's onset as vertical lines."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    runs = list(runs)
    fig = Figure(figsize=(max(8, 6 * len(runs)), 12), layout="constrained")
    grid = fig.add_gridspec(4, len(runs), height_ratios=(1.2, 0.8, 0.8, 1.0))
    for j, r in enumerate(runs):
        _decision_column(fig, grid, j, r)
    handles = [Line2D([], [], marker=m, color="k", ls="none", label=text) for m, text in REASON_MARKERS.values()]
    handles += [Line2D([], [], color="#8172b3", lw=1, ls="--",
                       label="partial work: the slowest worker's steps a round"),
                Line2D([], [], color="k", lw=0.8, ls="--", label="link rate changes"),
                Line2D([], [], color="k", lw=0.8, ls=":", label="straggler turns slow")]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8)
    width = int(14 * fig.get_figwidth())
    fig.suptitle("\n".join(textwrap.wrap(f"gradcomp auto mode, decisions over time: {title}", width)), fontsize=9)
    return fig
