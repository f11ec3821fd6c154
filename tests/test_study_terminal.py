"""``gradcomp train``'s terminal output: two tables within 80 columns with every cell whole, the
legend, the conclusion with its uncertainty, and decision.md's verdict within the noise."""

from __future__ import annotations

import io
import math
import types

import pytest

pytest.importorskip("rich")

from rich.console import Console

from gradcomp.lab.study import terminal
from gradcomp.lab.study.conclusion import conclusion, sampling_error_pp
from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.decision import Aggregate, aggregate, decide, decision_doc, verdict
from gradcomp.lab.study.study import RunResult, StudyResult


def _run(mode, name, seed, acc, gap, nbytes, ttt, step_s=12.3456, scenario="loopback"):
    return RunResult(
        mode=mode, compressor=name, label=COMPRESSORS[name].label, workers=4, steps=10,
        bytes_per_worker_per_step=nbytes, raw_bytes_per_worker_per_step=44_696_000.0,
        test_accuracy=acc, test_loss=math.log(3.0 + seed), wall_s=1234.5, marks=[5, 10],
        bytes_at_marks=[1.0, 2.0], accuracy_at_marks=[acc / 2, acc], losses=[1.0] * 10, meter={},
        reduction_x=44_696_000.0 / nbytes, accuracy_gap_pp=gap, seed=seed,
        scenario={"name": scenario}, time={"step_time_median_s": step_s, "idle_share": 0.999,
                                           "exposed_comm_share": 1.0},
        time_to_target_s=ttt)


def _widest_study(seeds=3, workload="digits-mlp"):
    """Every compressor label of the menu in two modes, the largest figures the tables print
    (44.7 MB per step, 1000x reductions, 12 s steps), seeds with intervals, targets missed on
    some seeds and on all."""
    runs = []
    for mode in ("sync", "async"):
        for i, name in enumerate(c for c in COMPRESSORS if mode in COMPRESSORS[c].modes):
            for seed in range(seeds):
                nbytes = 44_696_000.0 / (1 + 333 * i)
                ttt = None if name == "dgc" or (name == "int8" and seed == 0) else 1234.5 + 10 * seed + i
                runs.append(_run(mode, name, seed, 0.9733 - 0.01 * seed, -12.34 + 3 * seed, nbytes, ttt))
    cfg = TrainConfig() if workload == "digits-mlp" else types.SimpleNamespace(workload=workload)
    return StudyResult(config=cfg, runs=runs, num_parameters=11_174_000, threshold=0.1,
                       train_samples=1347, test_samples=450, seeds=list(range(seeds)))


def _render(renderable, width=terminal.WIDTH) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue()


def _expected_cells(study, table):
    """Every cell the table should show, computed from the aggregates."""
    cells = []
    for a in aggregate(study.runs):
        cells += [a.mode, a.label]
        if table == "traffic":
            cells += [f"{a.bytes_per_worker_per_step:,.0f}", f"{a.reduction_x:.2f}x",
                      f"{a.accuracy:.2f}%±{a.accuracy_ci:.2f}", f"{a.gap_pp:+.2f}±{a.gap_ci:.2f}"]
        else:
            cells += [f"{1e3 * a.step_time_median_s:.1f}", f"{100 * a.idle_share:.0f}%",
                      f"{100 * a.exposed_comm_share:.0f}%", f"{a.wall_s:.1f}"]
            if a.reached == a.seeds:
                cells.append(f"{a.time_to_target_s:.2f}±{a.time_to_target_ci:.2f}")
            else:
                cells.append("not reached" if not a.reached else f"{a.time_to_target_s:.2f} ({a.reached}/{a.seeds})")
    return cells


@pytest.mark.parametrize("workload", ["digits-mlp", "text-gpt"])
@pytest.mark.parametrize("kind", ["traffic", "time"])
def test_each_table_fits_80_columns_with_every_cell_whole(kind, workload):
    study = _widest_study(workload=workload)
    table = terminal.traffic_table(study) if kind == "traffic" else terminal.time_table(study)
    text = _render(table)
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= 80, max(text.splitlines(), key=len)
    for cell in _expected_cells(study, kind):
        assert cell in text, cell
    if workload == "text-gpt" and kind == "traffic":
        ppl = sum(math.exp(math.log(3.0 + s)) for s in range(3)) / 3  # exp of the test loss, mean
        assert "ppl" in text and f"{ppl:.2f}" in text


def test_one_seed_shows_no_intervals_and_piped_output_is_whole():
    study = _widest_study(seeds=1)
    for table in (terminal.traffic_table(study), terminal.time_table(study)):
        text = _render(table)  # a pipe: rich's default 80 columns
        assert "±" not in text and "…" not in text and max(map(len, text.splitlines())) <= 80
    legend = terminal.legend(study)
    assert "a±b" not in legend and "gap (pp)" in legend and "exp comm" in legend


def _agg(mode, comp, acc, gap, gap_ci, red, ttt=None, ttt_ci=math.nan, seeds=1):
    return Aggregate(scenario="loopback", mode=mode, compressor=comp, label=COMPRESSORS[comp].label,
                     seeds=seeds, reached=seeds if ttt is not None else 0, accuracy=acc, accuracy_ci=gap_ci,
                     gap_pp=gap, gap_ci=gap_ci, time_to_target_s=ttt, time_to_target_ci=ttt_ci,
                     bytes_per_worker_per_step=1e5 / red, reduction_x=red, step_time_median_s=0.01,
                     idle_share=0.1, idle_share_fast=0.1, exposed_comm_share=0.3, wall_s=1.0)


def test_sampling_error_of_a_difference_by_hand():
    # 1.96 sqrt(2 p (1 - p) / n) at p = 0.97, n = 450
    assert sampling_error_pp(97.0, 450) == pytest.approx(100 * 1.96 * math.sqrt(2 * 0.97 * 0.03 / 450))
    assert sampling_error_pp(100.0, 450) == 0.0


def test_one_seed_conclusion_says_it_cannot_separate_within_the_noise():
    noise = sampling_error_pp(97.0, 450)  # 2.2 points
    aggs = [_agg("sync", "none", 97.0, 0.0, math.nan, 1.0, 3.0),
            _agg("sync", "int8", 97.0, 0.1, math.nan, 3.94, 4.8),
            _agg("sync", "int8-ef", 97.0, 0.1, math.nan, 3.94, 3.0 * 1.6),
            _agg("sync", "topk-ef", 97.0, noise + 1.0, math.nan, 87.0, 2.0)]
    words = conclusion(aggs, 450, 0.5)
    assert 2 <= len(words) <= 4
    # the largest saving without a resolved loss, then the loss beyond the noise
    assert words[0].startswith("sync: int8 sent 3.94x fewer bytes per step than none, test accuracy -0.10")
    assert f"topk1%+ef {-(noise + 1.0):+.2f} points lost accuracy beyond the noise" in words[0]
    assert "1 seed" in words[1] and f"±{noise:.1f} points" in words[1] and "--seeds 3" in words[1]
    assert words[2].startswith("Fastest to the target: not separable: sync none (3.00 s)")
    assert decide(aggs, 0.5)["loopback"] is None  # no winner from one seed


def test_several_seeds_name_a_winner_only_beyond_the_intervals():
    aggs = [_agg("sync", "none", 97.0, 0.0, 0.2, 1.0, 9.0, 0.5, seeds=3),
            _agg("sync", "int8", 97.0, 0.1, 0.2, 3.94, 4.0, 0.5, seeds=3),
            _agg("async", "fp16", 97.0, 0.3, 0.2, 2.0, 4.5, 0.5, seeds=3)]
    # 4.0 vs 4.5: the difference 0.5 is inside hypot(0.5, 0.5) = 0.71
    assert decide(aggs, 0.5)["loopback"] is None
    doc = decision_doc(aggs, 0.9, 0.5, {})
    text = verdict(doc["scenarios"]["loopback"])
    assert "not separable: sync int8 (4.00 ± 0.50 s), async fp16 (4.50 ± 0.50 s)" in text
    assert "intervals over 3 seeds overlap" in text and "--seeds 6" in text and "**" not in text
    aggs[2].time_to_target_s = 5.0  # now 1.0 > 0.71: separated
    assert decide(aggs, 0.5)["loopback"] is aggs[1]
    text = verdict(decision_doc(aggs, 0.9, 0.5, {})["scenarios"]["loopback"])
    assert text.startswith("Fastest within the bound: **sync int8 (4.00 ± 0.50 s)**")
    words = conclusion(aggs, 450, 0.5)
    assert "means over 3 seeds" in words[-2] and "sync int8 (4.00 s), beyond the noise" in words[-1]


def test_a_gap_inside_its_interval_is_not_a_loss():
    aggs = [_agg("async", "none", 97.0, 0.0, 0.3, 1.0, seeds=3),
            _agg("async", "topk-ef", 96.0, 1.0, 1.5, 87.0, seeds=3),   # 1.0 - 1.5 < 0: within
            _agg("async", "dgc", 90.0, 7.0, 1.5, 900.0, seeds=3)]     # 7.0 - 1.5 > 0: a loss
    (mode, noise) = conclusion(aggs, 450, 0.5)
    assert mode.startswith("async: topk1%+ef sent 87.00x fewer bytes per step than none, test accuracy -1.00")
    assert "dgc0.1% -7.00 points lost accuracy beyond the noise" in mode
    assert "3 seeds" in noise


def test_progress_bars_start_at_the_first_step_only():
    from gradcomp.lab.study.command import _Bars

    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True)
    with _Bars(console, total=10, grand_total=20):
        pass  # an error before the first step: nothing printed
    assert buf.getvalue() == ""
    with _Bars(console, total=10, grand_total=20) as bars:
        bars("sync", "int8", 3)
    assert "all runs" in buf.getvalue() and "sync int8" in buf.getvalue()


def test_an_error_found_after_start_up_prints_no_empty_bar(capsys, tmp_path):
    from gradcomp.lab.study import command

    code = command.main(["--workload", "text-gpt", "--data-file", str(tmp_path / "missing.txt"), "--mode", "sync",
                         "--compressors", "none", "--steps", "2", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and "all runs" not in out + err and "--data-file" in err


def test_no_negative_zero_in_the_conclusion():
    aggs = [_agg("sync", "none", 97.0, 0.0, math.nan, 1.0), _agg("sync", "int8", 97.0, 0.0, math.nan, 3.94)]
    assert "test accuracy +0.00 points" in conclusion(aggs, 450, 0.5)[0]
