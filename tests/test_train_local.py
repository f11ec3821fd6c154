"""``gradcomp train --mode local``: the local SGD / DiLoCo runs of the study and their options."""

from __future__ import annotations

import json
import math

import pytest

from gradcomp.comm.agreement import SIGNATURE_NBYTES
from gradcomp.lab.cli import main
from gradcomp.lab.study import report
from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.study import StudyResult, run_study

HEADER = 48  # wire header of a 1-D payload (40 + 8 * ndim bytes)


@pytest.mark.parametrize("argv, words", [
    (["--mode", "local", "--sync-every", "0"], "--sync-every: expected an integer >= 1, got 0"),
    (["--mode", "local", "--sync-every", "8", "--fragments", "3"], "fragments must divide sync_every"),
    (["--mode", "local", "--sync-every", "8", "--fragments", "2", "--overlap", "4"],
     "overlap must be < sync_every / fragments = 4"),
    (["--mode", "local", "--overlap", "-1"], "--overlap: expected an integer >= 0, got -1"),
    (["--mode", "local", "--outer", "adam"], "--outer: invalid choice: 'adam'"),
    (["--mode", "sync", "--sync-every", "8"], "--sync-every only apply to --mode local"),
    (["--mode", "local", "--workers", "1"], "local mode needs at least 2 workers"),
])
def test_bad_local_options_exit_2_with_one_line(capsys, argv, words):
    try:  # argparse exits; settings that cannot work together return the status
        status = main(["train", "--compressors", "none", "--no-progress", *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert words in err.strip().splitlines()[-1], err  # after argparse's usage lines, if any


@pytest.fixture(scope="module")
def local_study():
    cfg = TrainConfig(workers=2, steps=18, hidden=(32,), eval_every=6, sync_every=4, outer="nesterov")
    return run_study(cfg, ["local"], ["int8"])


def _int8_nbytes(m):
    return HEADER + m + 4 * math.ceil(m / 256)


@pytest.mark.slow
def test_local_runs_count_the_bytes_of_every_sync(local_study, tmp_path):
    params = 64 * 32 + 32 + 32 * 10 + 10  # 2,410
    assert local_study.num_parameters == params
    none, int8 = local_study.runs
    assert (none.mode, none.compressor, int8.mode, int8.compressor) == ("local", "none", "local", "int8")
    # syncs after steps 4, 8, 12, 16 and the final one after step 18; two workers:
    # each sends both halves once per sync (reduce-scatter and allgather), plus two signatures
    # (the settings agreed at construction, the first exchange's)
    for run in (none, int8):
        assert run.extra["local_syncs"] == 5
    agreed = 2 * SIGNATURE_NBYTES
    assert none.bytes_per_worker_per_step == (5 * 2 * (HEADER + 4 * params // 2) + agreed) / 18
    assert int8.bytes_per_worker_per_step == (5 * 2 * _int8_nbytes(params // 2) + agreed) / 18
    assert int8.raw_bytes_per_worker_per_step == 5 * 4 * params / 18
    assert 3.5 < int8.reduction_x < 4
    assert 0 < int8.test_accuracy <= 1 and math.isfinite(int8.test_loss)
    report.write_json(local_study, str(tmp_path / "results.json"))
    assert "sync every 4 steps, outer nesterov" in report.title(local_study)
    assert '"mode": "local"' in (tmp_path / "results.json").read_text()
    # the MLP 64-32-10: two weights and two biases
    assert json.loads((tmp_path / "results.json").read_text())["model"] == {
        "workload": "digits-mlp", "parameters": params, "param_tensors": 4, "layers": [64, 32, 10]}


def test_the_results_record_the_model_of_any_workload():
    from dataclasses import replace

    study = StudyResult(config=TrainConfig(workload="mnist-cnn"), runs=[], num_parameters=215_370,
                        param_tensors=8, threshold=0.1, train_samples=1, test_samples=1)
    assert report.model_record(study) == {"workload": "mnist-cnn", "parameters": 215_370, "param_tensors": 8}
    # not recorded: no count (the validator then falls back), still no MLP layers
    assert report.model_record(replace(study, param_tensors=None)) == {"workload": "mnist-cnn",
                                                                         "parameters": 215_370}


def test_a_study_without_its_baseline_runs_the_named_rows_alone():
    cfg = TrainConfig(workers=2, steps=4, hidden=(16,), eval_every=2, sync_every=2)
    study = run_study(cfg, ["local"], ["int8"], target_acc=0.5, baseline=False)
    assert [(r.mode, r.compressor) for r in study.runs] == [("local", "int8")]
    with pytest.raises(ValueError, match="at least one row"):
        run_study(cfg, ["local"], [], baseline=False)
