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
