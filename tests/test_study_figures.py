"""The study's figures read by a person: no legend over data or over another panel, titles inside
the figure, at most 8 legend entries per panel, every axis labelled, sync and async apart by line
style with one colour per compressor."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg

from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.figures import MODE_STYLES, results_figure, time_figure
from gradcomp.lab.study.study import RunResult, StudyResult

NAMES = ("none", "fp16", "int8", "int8-ef", "topk-ef", "topk-int8-ef", "threshold-ef", "dgc", "dgc-int8")


def _run(mode, i, name):
    marks = list(range(10, 360, 10))
    acc = [min(0.97, 0.1 + 0.9 * (1 - math.exp(-m / (60 + 20 * i)))) for m in marks]
    return RunResult(mode=mode, compressor=name, label=COMPRESSORS[name].label, workers=4, steps=350,
                     bytes_per_worker_per_step=5e5 / (1 + 10 * i), raw_bytes_per_worker_per_step=5e5,
                     test_accuracy=acc[-1], test_loss=0.1, wall_s=3.0, marks=marks,
                     bytes_at_marks=[m * 5e5 / (1 + 10 * i) for m in marks], accuracy_at_marks=acc,
                     losses=[2.3 * math.exp(-s / 100) + 0.05 for s in range(350)], meter={},
                     scenario={"name": "loopback"}, clock_at_marks=[0.01 * m * (1 + 0.1 * i) for m in marks],
                     time={"phases_mean_s": {"compute": 0.004, "communicate": 0.003, "wait": 0.001}},
                     extra={"staleness_histogram": {"0": 50, "1": 30, "2": 5}} if mode == "async" else {})


def _study():
    runs = [_run(mode, i, name) for mode in ("sync", "async") for i, name in enumerate(NAMES)]
    return StudyResult(config=TrainConfig(), runs=runs, num_parameters=126_090, threshold=0.1,
                       train_samples=1347, test_samples=450, seeds=[0], scenario={"name": "loopback"},
                       target_accuracy=0.95)


def _drawn(fig):
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _check(fig):
    renderer = _drawn(fig)
    axes = [ax for ax in fig.axes if ax.axison]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    for leg in legends:
        box = leg.get_window_extent(renderer)
        for ax in axes:  # every panel's data area, the zoom panels included
            assert not _overlap(box, ax.get_window_extent(renderer)), (leg, ax.get_title())
    for ax in fig.axes:
        leg = ax.get_legend()
        assert leg is None or len(leg.get_texts()) <= 8, ax.get_title()
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
    title = fig._suptitle.get_window_extent(renderer)
    w, h = fig.canvas.get_width_height()
    assert 0 <= title.x0 and title.x1 <= w and 0 <= title.y0 and title.y1 <= h
    return axes


def _styles(ax):
    """(colour, line style) of the lines drawn in ``ax``, per line style."""
    out = {}
    for line in ax.get_lines():
        out.setdefault(line.get_linestyle(), set()).add(line.get_color() if isinstance(line.get_color(), str)
                                                         else tuple(line.get_color()))
    return out


def test_results_png_panels_legend_and_title():
    study = _study()
    fig = results_figure(study, "a long title " * 30)
    axes = _check(fig)
    assert len(axes) == 6  # per mode: traffic, zoom, loss
    sync_acc, async_acc = axes[0], axes[3]
    assert set(_styles(sync_acc)) == {"-"} and set(_styles(async_acc)) == {"--"}
    assert len(_styles(sync_acc)["-"]) == len(NAMES)  # one colour per compressor
    assert _styles(sync_acc)["-"] == _styles(async_acc)["--"]  # the same colours in both modes


def test_time_png_panels_legend_and_title():
    fig = time_figure([_study()], "a long title " * 30)
    axes = _check(fig)
    accuracy = axes[0]
    styles = _styles(accuracy)
    assert len(styles["-"]) == len(NAMES) and styles["-"] <= styles["--"] | styles["-"]
    assert {MODE_STYLES["sync"], MODE_STYLES["async"]} <= set(styles)
    # the one legend below the panels: a colour per compressor, a style per mode, the target
    (fig_legend,) = fig.legends
    texts = [t.get_text() for t in fig_legend.get_texts()]
    assert texts == [COMPRESSORS[n].label for n in NAMES] + ["sync (line style)", "async (line style)",
                                                              "target 95.0%"]


def _auto_run(scenario, phases, straggler):
    """An auto run whose period moved at steps 10 (up) and 30 (down), codec at step 20."""
    r = _run("auto", 0, "auto")
    r.scenario = {"name": scenario, "straggler": straggler}
    r.link = {"name": scenario, "configured_bps": phases[0]["configured_bps"] if phases else None,
              "achieved_bps": phases[0]["achieved_bps"] if phases else None, "phases": phases}
    ts = [0.01 * s for s in range(1, 351)]
    r.extra = {"link_origin_lag_s": 0.05,
               "decisions": [{"t_s": 0.01, "step": 1, "sync_every": 1, "codec": "none"},
                             {"t_s": 0.10, "step": 10, "sync_every": 16, "codec": "none"},
                             {"t_s": 0.20, "step": 20, "sync_every": 16, "codec": "int8"},
                             {"t_s": 0.30, "step": 30, "sync_every": 4, "codec": "int8"}],
               "steps_series": {"t_s": ts, "idle_share": [0.1 + 0.3 * (t > 1.5) for t in ts]}}
    r.meter = {"switches": [{"kind": "sync_every", "step": 10, "from": 1, "to": 16, "reason": "comm_share_high"},
                            {"kind": "sync_every", "step": 30, "from": 16, "to": 4, "reason": "loss_fell"},
                            {"step": 2, "from": "none", "to": "int8", "bucket": 0}]}
    return r


def test_decisions_png_panels_legend_and_title():
    from gradcomp.lab.study.figures import REASON_MARKERS, decisions_figure

    changing = _auto_run("1gbit@0,100mbit@2+custom", [
        {"start_s": 0.0, "configured_bps": 1e9, "achieved_bps": 9.4e8},
        {"start_s": 2.0, "configured_bps": 1e8, "achieved_bps": 9.5e7}], {"rank": 1, "factor": 3.0, "from_s": 2.0})
    steady = _auto_run("loopback", [], None)
    fig = decisions_figure([changing, steady], "a long title " * 30)
    axes = _check(fig)
    assert len(axes) == 8  # per run: period, codec, link rate, idle share
    h_ax, c_ax, l_ax, i_ax = axes[:4]  # the first column
    h_line = h_ax.get_lines()[0]
    assert list(h_line.get_ydata()) == [1, 1, 16, 16, 16, 16, 4, 4]  # the period as a step function
    assert list(h_line.get_xdata())[:3] == [0.01, 0.10, 0.10]
    markers = {line.get_marker(): (line.get_xdata()[0], line.get_ydata()[0]) for line in h_ax.get_lines()[1:]
               if line.get_linestyle() == "None"}
    assert markers == {REASON_MARKERS["comm_share_high"][0]: (0.10, 16), REASON_MARKERS["loss_fell"][0]: (0.30, 4)}
    assert [t.get_text() for t in c_ax.get_yticklabels()] == ["none", "int8"]
    rates = l_ax.get_lines()[0]
    assert list(rates.get_ydata()) == [940.0, 940.0, 95.0, 95.0]
    assert list(rates.get_xdata())[1:3] == [pytest.approx(1.95), pytest.approx(1.95)]  # phase start - lag
    # the link's change (dashed) and the straggler's onset (dotted) in every panel of the column
    for ax in (h_ax, c_ax, l_ax, i_ax):
        vlines = sorted((line.get_linestyle(), round(float(line.get_xdata()[0]), 6)) for line in ax.get_lines()
                        if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2)
        assert vlines == [("--", 1.95), (":", 2.0)]
    assert "unshaped loopback" in axes[6].get_title()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [t for _, t in REASON_MARKERS.values()] + [
        "partial work: the slowest worker's steps a round", "link rate changes", "straggler turns slow"]
    assert not [line for line in h_ax.get_lines() if line.get_linestyle() == "--" and len(set(line.get_xdata())) > 1]


def test_decisions_png_draws_the_slowest_workers_share_under_partial_work():
    from gradcomp.lab.study.figures import decisions_figure

    run = _auto_run("100mbit+straggler", [], {"rank": 1, "factor": 3.0, "from_s": 0.0})
    for d, quotas in zip(run.extra["decisions"], (None, [16, 5, 16, 16], [16, 5, 16, 16], [4, 1, 4, 4])):
        d["quotas"] = quotas
    h_ax = _check(decisions_figure([run], "partial work"))[0]
    (share,) = [line for line in h_ax.get_lines() if line.get_linestyle() == "--" and len(set(line.get_xdata())) > 1]
    assert list(share.get_ydata()) == [1, 1, 5, 5, 5, 5, 1, 1]  # the period until a cut, then the least quota


def test_every_reason_the_period_moves_for_has_a_marker():
    from gradcomp.lab.study.figures import REASON_MARKERS
    from gradcomp.sync_period import REASONS

    assert set(REASON_MARKERS) == set(REASONS)
