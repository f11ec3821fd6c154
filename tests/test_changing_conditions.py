"""Conditions that change within a run of `gradcomp train`: a straggler's onset
(``--straggler RANK:FACTOR@SECONDS``) and a link whose rate changes (``--link RATE@S,...``),
parsed, carried into the runs and recorded in the results."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from gradcomp.lab.cluster import requirements_missing
from gradcomp.lab.study import command
from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.timing import ComputeDelay, parse_straggler_onset

REASON = requirements_missing()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")


def test_parse_straggler_onset():
    assert parse_straggler_onset("1:3@60") == (1, 3.0, 60.0)
    assert parse_straggler_onset("2:1.5") == (2, 1.5, 0.0)
    assert parse_straggler_onset("0:4@0.5s", workers=2) == (0, 4.0, 0.5)


@pytest.mark.parametrize("text, words", [
    ("1:3@-1", "--straggler must be RANK:FACTOR@SECONDS"), ("1:3@x", "not a number of seconds"),
    ("1:3@60,1:1@90", "--straggler must be one RANK:FACTOR[@SECONDS]"), ("5:3@1", "a worker in 0..3"),
    ("1:0.5@3", "FACTOR must be a number >= 1"), ("1@3", "RANK:FACTOR (e.g. 1:3)")])
def test_parse_straggler_onset_errors(text, words):
    with pytest.raises(ValueError) as e:
        parse_straggler_onset(text, workers=4)
    assert words in str(e.value) and "--straggler" in str(e.value)


def test_a_straggler_turns_slow_at_its_onset():
    d = ComputeDelay(worker=1, straggler=(1, 3.0), straggler_from_s=0.3)
    assert d.factor(1) == 1.0  # not started: its onset has not come
    d.start(time.perf_counter() + 60)  # its clock started now would reach the onset in 60.3 s
    assert d.factor(1) == 1.0 and not d.slow_now()
    d.start(time.perf_counter() - 0.31)  # started 0.31 s ago: past the onset
    assert d.factor(2) == 3.0 and d.slow_now()
    assert ComputeDelay(worker=0, straggler=(1, 3.0), straggler_from_s=0.0).factor(1) == 1.0
    with pytest.raises(ValueError, match="straggler_from_s must be a finite number of seconds >= 0"):
        TrainConfig(straggler=(1, 3.0), straggler_from_s=-1.0)


def test_the_command_line_takes_schedules():
    p = command.build_parser()
    args = p.parse_args(["--link", "1000mbit@0,100mbit@120", "--straggler", "1:3@60"])
    assert args.link == "1gbit@0,100mbit@120" and args.straggler == (1, 3.0, 60.0)
    assert p.parse_args(["--link", "100mbit"]).link == "100mbit"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        p.parse_args(["--link", "1gbit@0,100mbit@0"])
    assert "argument --link: rate must be RATE@SECONDS" in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "pipeline", "--straggler", "1:3@5", "--no-progress"]) == 2
    assert "not pipeline" in err.getvalue()


@pytest.mark.slow
def test_a_straggler_onset_delays_only_the_steps_after_it():
    """Worker 1's steps carry a delay span exactly when they start after the onset."""
    from dataclasses import replace

    from gradcomp.lab.study.data import load_digits_split
    from gradcomp.lab.study.study import _launch_local

    # The onset is early and the run long (hundreds of steps) so that steps begin on both sides of it
    # on a fast host too: 40 steps could end before a 0.25 s onset.
    onset = 0.1
    cfg = TrainConfig(workers=2, steps=300, eval_every=300, straggler=(1, 3.0), straggler_from_s=onset)
    data = load_digits_split(test_fraction=cfg.test_fraction, seed=cfg.seed)
    logs, _ = _launch_local("sync", [(replace(cfg), "none", 0)], [data], None)
    worker1 = logs[1][0]
    t0 = worker1._t0  # the training clock's start, from which the onset counts
    delays = [[a for p, a, _ in s.spans if p == "delay"] for s in worker1.steps]
    # no delay before the onset (the hook reads the clock just before it asks whether it is slow)
    assert all(a - t0 >= onset - 1e-3 for d in delays for a in d)
    late = [d for s, d in zip(worker1.steps, delays) if s.start - t0 >= onset]
    assert late and all(late) and len(late) < len(delays)  # every step begun after it is delayed
    assert not any(p == "delay" for s in logs[0][0].steps for p, _, _ in s.spans)


@pytest.mark.slow
@needs_netns
def test_a_changing_link_is_recorded_with_its_achieved_rate_per_phase(tmp_path):
    out = tmp_path / "study"
    argv = ["--mode", "sync", "--workers", "2", "--compressors", "int8", "--steps", "20", "--eval-every",
            "10", "--link", "100mbit@0,25mbit@1", "--straggler", "1:2@1", "--out", str(out), "--no-progress"]
    terminal = io.StringIO()
    with contextlib.redirect_stdout(terminal):
        assert command.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    for r in doc["runs"]:
        phases = r["link"]["phases"]
        assert [(p["start_s"], p["configured_bps"]) for p in phases] == [(0.0, 100e6), (1.0, 25e6)]
        for p in phases:
            assert abs(p["achieved_bps"] - p["configured_bps"]) / p["configured_bps"] < 0.15, p
        assert r["scenario"]["straggler"] == {"rank": 1, "factor": 2.0, "from_s": 1.0}
        assert 0 <= r["extra"]["link_origin_lag_s"] < 5.0  # the schedule restarted at this run's start
    assert "100mbit from 0 s" in terminal.getvalue() and "25mbit from 1 s" in terminal.getvalue()
