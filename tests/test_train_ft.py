"""``gradcomp train --mode ft``: sync training on torchft's per-step quorum, a late worker left out."""

from __future__ import annotations

import pytest

from gradcomp.lab.cli import main
from gradcomp.lab.study.config import TrainConfig


@pytest.mark.parametrize("argv, words", [
    (["--mode", "sync", "--ft-timeout", "0.1"], "--ft-timeout only applies to --mode ft"),
    (["--mode", "ft", "--ft-timeout", "61"], "ft_timeout must be a number of seconds in (0, 60]"),
    (["--mode", "ft", "--ft-timeout", "0"], "--ft-timeout: expected"),
    (["--mode", "ft", "--compressors", "dgc"], "compressor 'dgc' runs in mode(s) sync,async,local,auto only"),
    (["--mode", "ft", "--workers", "1"], "ft mode needs at least 2 workers"),
])
def test_bad_ft_options_exit_2_with_one_line(capsys, argv, words):
    try:  # argparse exits; settings that cannot work together return the status
        status = main(["train", "--compressors", "none", "--no-progress", *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert words in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("workers, timeout_s, want", [
    (4, 0.05, {"min_replicas": 3, "join_timeout_ms": 50, "quorum_tick_ms": 25}),
    (2, 0.001, {"min_replicas": 1, "join_timeout_ms": 1, "quorum_tick_ms": 1}),
    (3, 0.5, {"min_replicas": 2, "join_timeout_ms": 500, "quorum_tick_ms": 100}),
])
def test_lighthouse_settings_follow_the_timeout(workers, timeout_s, want):
    from gradcomp.lab.study.ft import HEARTBEAT_TIMEOUT_MS, lighthouse_settings

    cfg = TrainConfig(workers=workers, ft_timeout=timeout_s)
    assert lighthouse_settings(cfg) == {**want, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS}


def _ft_study(straggler, ft_timeout):
    pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gradcomp[ft]')")
    from gradcomp.lab.study.study import run_study

    cfg = TrainConfig(workers=3, steps=14, hidden=(32,), eval_every=7, straggler=straggler, ft_timeout=ft_timeout,
                      timeout=120.0)
    return run_study(cfg, ["ft"], ["none"]).runs[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ft_without_a_late_worker_is_plain_sync():
    from gradcomp.comm import ring_raw_bytes

    run = _ft_study(None, 5.0)  # a generous join timeout: every worker in every quorum
    params = 64 * 32 + 32 + 32 * 10 + 10
    assert run.mode == "ft" and run.steps == 14
    assert run.meter["events"].get("not_participating", 0) == 0
    assert run.meter["events"].get("step_rolled_back", 0) == 0
    # one flat float32 ring allreduce of every parameter per step and worker
    assert run.meter["raw_bytes_sent"] == 14 * sum(sum(ring_raw_bytes(params, 3, r)[:2]) for r in range(3))
    assert len(set(run.extra["param_sha256_per_worker"])) == 1  # every replica holds the same parameters
    assert 0 < run.test_accuracy <= 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_late_worker_is_left_out_heals_and_ends_bit_identical():
    # worker 1 computes 40x as long: far later than the 5 ms join timeout to every quorum
    run = _ft_study((1, 40.0), 0.005)
    ev = run.meter["events"]
    assert ev.get("not_participating", 0) >= 1  # it joined behind, healed and contributed nothing
    assert ev.get("step_rolled_back", 0) == 0
    assert len(set(run.extra["param_sha256_per_worker"])) == 1  # it ends on the others' parameters
    assert 0 < run.test_accuracy <= 1
