"""The local launcher: results come back, failures and hangs end the run, nothing is left."""

import time

import pytest
import torch

from gradcomp.launch import WorkerError, launch

import launch_fns as F


@pytest.mark.slow
def test_results_come_back_with_tensors():
    out = launch(F.allreduce_rank, 3, timeout=60)
    assert [o["world"] for o in out] == [3, 3, 3]
    assert all(torch.equal(o["sum"], torch.tensor([3.0])) for o in out)


@pytest.mark.slow
def test_a_failing_rank_stops_the_run_with_its_traceback():
    t = time.monotonic()
    with pytest.raises(WorkerError, match="deliberate failure") as e:
        launch(F.fail_on_one, 3, timeout=60)
    assert e.value.rank == 1
    assert time.monotonic() - t < 20  # not the 30 s the others sleep


@pytest.mark.slow
def test_a_hang_times_out():
    with pytest.raises(TimeoutError):
        launch(F.hang, 2, timeout=3)


@pytest.mark.slow
def test_expected_failures_are_tolerated():
    assert launch(F.die_on_one, 3, timeout=60, expected_failures={1}) == [0, None, 2]
    with pytest.raises(WorkerError, match="exited with code 3"):
        launch(F.die_on_one, 2, timeout=60)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(F.hang, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch(F.hang, 1, timeout=0)
