"""`gradcomp train --mode auto`: local SGD whose period and codec are chosen online, run beside
the fixed rows, held against sync's none row, its decisions recorded and drawn over time."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from gradcomp.lab.study import command
from gradcomp.lab.study.study import RunResult, compare, default_target, mode_compressors


def _result(mode, compressor, acc, nbytes, seed=0):
    return RunResult(mode=mode, compressor=compressor, label=compressor, workers=2, steps=10,
                     bytes_per_worker_per_step=nbytes, raw_bytes_per_worker_per_step=4e5, test_accuracy=acc,
                     test_loss=0.1, wall_s=1.0, marks=[10], bytes_at_marks=[nbytes], accuracy_at_marks=[acc],
                     losses=[0.1] * 10, meter={}, seed=seed, scenario={"name": "loopback"})


def test_the_auto_mode_runs_one_row_held_against_sync_none():
    assert mode_compressors("auto", ["none", "int8"]) == ["auto"]
    assert mode_compressors("local", ["none", "int8"]) == ["none", "int8"]
    runs = [_result("sync", "none", 0.96, 4e5), _result("local", "none", 0.90, 1e5),
            _result("auto", "auto", 0.95, 5e4)]
    compare(runs)
    auto = runs[-1]
    assert auto.reduction_x == pytest.approx(4e5 / 5e4) and auto.accuracy_gap_pp == pytest.approx(1.0)
    alone = [_result("auto", "auto", 0.9, 5e4), _result("auto", "auto", 0.8, 5e4, seed=1)]
    assert default_target(alone, 0.98) == pytest.approx(0.98 * 0.85)  # no none row: the mode's own runs


def test_auto_options_need_the_auto_mode():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "sync", "--max-sync-every", "8", "--no-progress"]) == 2
    assert "--max-sync-every only apply to --mode auto" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "auto", "--min-sync-every", "9", "--max-sync-every", "8",
                             "--no-progress"]) == 2
    assert "max_sync_every" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "sync", "--comm-share", "0.2", "--no-progress"]) == 2
    assert "--comm-share only apply to --mode auto" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "auto", "--comm-share", "1.5", "--no-progress"]) == 2
    assert "comm_share must be in (0, 1)" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "auto", "--period-cost", "0", "--no-progress"]) == 2
    assert "period_cost must be in (0, 1)" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "auto", "--period-cost", "0.1", "--comm-share", "0.2", "--no-progress"]) == 2
    assert "not both" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "sync", "--partial-work", "on", "--no-progress"]) == 2
    assert "--partial-work only applies to --mode local and auto" in err.getvalue()


@pytest.mark.slow
def test_auto_beside_the_fixed_rows(tmp_path):
    out = tmp_path / "study"
    argv = ["--mode", "sync,auto", "--workers", "2", "--compressors", "int8", "--steps", "40",
            "--eval-every", "10", "--max-sync-every", "8", "--comm-share", "0.3", "--out", str(out), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert command.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    rows = [(r["mode"], r["compressor"]) for r in doc["runs"]]
    assert rows == [("sync", "none"), ("sync", "int8"), ("auto", "auto")]
    sync_none, auto = doc["runs"][0], doc["runs"][2]
    assert doc["config"]["comm_share"] == 0.3
    assert auto["accuracy_gap_pp"] == pytest.approx(100 * (sync_none["test_accuracy"] - auto["test_accuracy"]))
    decisions = auto["extra"]["decisions"]
    assert decisions[0]["step"] == 1 and all(1 <= d["sync_every"] <= 8 for d in decisions)
    assert [d["step"] for d in decisions] == sorted(d["step"] for d in decisions)
    # the periods drawn are the ones the meter's switch log says were agreed, in order
    moves = [e for e in auto["meter"]["switches"] if e.get("kind") == "sync_every"]
    assert all(a["to"] == b["from"] for a, b in zip(moves, moves[1:]))
    periods = [d["sync_every"] for d in decisions]
    periods = [h for i, h in enumerate(periods) if i == 0 or h != periods[i - 1]]
    assert periods in ([e["to"] for e in moves], [1] + [e["to"] for e in moves])
    assert all(d["codec"] for d in decisions)
    series = auto["extra"]["steps_series"]
    assert len(series["t_s"]) == 40 and all(0 <= x <= 1 for x in series["idle_share"])
    assert series["t_s"] == sorted(series["t_s"])
    assert (out / "decisions.png").stat().st_size > 10_000


@pytest.mark.slow
def test_partial_work_cuts_the_stragglers_round_only(tmp_path):
    # worker 1 three times slower: with partial work it runs a third of each round of 8 steps,
    # the others all 8 (their compute is within 1.25x of the median)
    out = tmp_path / "study"
    argv = ["--mode", "local", "--workers", "3", "--compressors", "int8", "--steps", "48", "--sync-every", "8",
            "--straggler", "1:3", "--partial-work", "on", "--eval-every", "16", "--out", str(out), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert command.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["partial_work"] is True
    for run in doc["runs"]:
        cuts = [e for e in run["meter"]["switches"] if e.get("kind") == "partial_work"]
        assert cuts and cuts[0]["step"] == 8 and cuts[0]["sync_every"] == 8
        compute = cuts[0]["compute_s"]
        assert compute[1] > 2 * max(compute[0], compute[2])
        assert cuts[0]["quotas"][0] == cuts[0]["quotas"][2] == 8 and 1 <= cuts[0]["quotas"][1] <= 4
        assert 0 < run["meter"]["events"]["idle_step"] <= 40  # worker 1's only, from step 9 on
