"""Backup workers on the parameter server (sync mode, Chen et al. 2016).

A step is applied with the first ``N - b`` pushes; the held-back worker waits
on a multiprocessing Event set by a peer once that step is applied (no sleep),
so which pushes make up each step is fixed, and the expected parameters are
computed here from exactly the payloads those pushes carried.
"""

from __future__ import annotations

import functools
import multiprocessing

import pytest
import torch

import gradcomp as gc
from gradcomp import ps
from gradcomp.compressors import decompress
from gradcomp.launch import launch

LR = 0.5
NUMEL = 300


def _grad(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(NUMEL, generator=g)


def _init() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))


def _push(worker, rank, step, sent):
    """Push this rank's gradient of ``step``; record the dense gradient the server
    decodes if it accepts it (an EF clone encodes the same bytes) and the residual
    held before and after."""
    g = _grad(rank, step)
    before = worker.compressor.residual("w")
    before = None if before is None else before.clone()
    probe = worker.compressor.clone()
    decoded = decompress(probe.compress(g, key="w")).reshape(-1)
    result = worker.push({"w": g})
    after = worker.compressor.residual("w")
    sent.append((step, result.statuses[0], decoded.numpy().copy(),
                 None if before is None else before.numpy().copy(),
                 None if after is None else after.numpy().copy()))


def _rank(rank, world_size, applied0, applied1):
    """1 server + 3 workers, backup_workers=1, 2 steps. Step 0: ranks 1, 2
    (rank 3 held until step 0 is applied); step 1: ranks 2, 3 (rank 1 held
    until step 1 is applied)."""
    params = {"w": _init()}
    if rank == 0:
        server = ps.ParameterServer(params, mode="sync", optimizer=functools.partial(torch.optim.SGD, lr=LR),
                                    backup_workers=1, worker_timeout=60.0)
        stats = server.serve()
        return {"stats": stats, "w": server.parameters()["w"].cpu().numpy().copy()}
    worker = ps.Worker(params, compressor=gc.ErrorFeedback(gc.Int8Quantizer()), timeout=60.0)
    sent = []
    with worker:
        worker.pull()
        if rank == 3:
            assert applied0.wait(60), "step 0 was not applied"
        _push(worker, rank, 0, sent)
        worker.pull()  # ranks 1, 2: returns once step 0 is applied
        if rank == 1:
            applied0.set()
            assert applied1.wait(60), "step 1 was not applied"
        _push(worker, rank, 1, sent)
        worker.pull()
        if rank == 3:
            applied1.set()
    return {"sent": sent, "version": worker.version}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_step_applied_with_the_first_n_minus_b_pushes():
    ctx = multiprocessing.get_context("forkserver")
    applied0, applied1 = ctx.Event(), ctx.Event()
    out = launch(_rank, 4, args=(applied0, applied1), timeout=100.0)
    stats, w = out[0]["stats"], torch.from_numpy(out[0]["w"])
    sent = {r: out[r]["sent"] for r in (1, 2, 3)}
    status = {(r, step): st for r in sent for step, st, *_ in sent[r]}
    # exactly the planned pushes made up each step; the late ones were dropped, not applied
    assert status == {(1, 0): "accepted", (2, 0): "accepted", (3, 0): "dropped",
                      (1, 1): "dropped", (2, 1): "accepted", (3, 1): "accepted"}
    assert stats["version"] == stats["updates"] == 2 and stats["backup_workers"] == 1
    assert stats["accepted"] == 4 and stats["dropped"] == 2 and stats["pushes"] == 6
    assert stats["dropped_staleness_histogram"] == {1: 2}
    # the same two drops reach the server's meter as events; sync applies no stale push
    assert stats["traffic"]["events"] == {"push_dropped": 2}
    assert {r: stats["workers"][r]["dropped"] for r in (1, 2, 3)} == {1: 1, 2: 0, 3: 1}
    assert all(out[r]["version"] == 2 for r in (1, 2, 3))

    def decoded(r, step):
        return torch.from_numpy(next(d for s, _, d, *_ in sent[r] if s == step))

    expected = _init()  # SGD without momentum: w -= lr * mean of the step's accepted gradients
    expected.add_((decoded(1, 0) + decoded(2, 0)) / 2, alpha=-LR)
    expected.add_((decoded(2, 1) + decoded(3, 1)) / 2, alpha=-LR)
    assert torch.equal(w, expected)  # each accepted push applied once, no dropped push applied

    # a dropped push leaves its worker's residual as it was before it (bit for bit)
    for r, step in ((3, 0), (1, 1)):
        _, _, _, before, after = next(x for x in sent[r] if x[0] == step)
        if before is None:
            assert after is None or not after.any()
        else:
            assert (after == before).all()
    # an accepted push keeps the new residual: x + r - D(C(x + r))
    _, _, d, before, after = next(x for x in sent[1] if x[0] == 0)
    assert torch.allclose(torch.from_numpy(after), _grad(1, 0) - torch.from_numpy(d), atol=1e-6)


def test_backup_workers_bad_values_name_the_argument():
    with pytest.raises(ValueError, match="backup_workers"):
        ps.PSConfig(mode="sync", backup_workers=-1)
    with pytest.raises(ValueError, match="backup_workers.*sync"):
        ps.PSConfig(mode="async", backup_workers=1)
    with pytest.raises(TypeError, match="backup_workers"):
        ps.PSConfig(mode="sync", backup_workers=1.0)
    ps.PSConfig(mode="async", backup_workers=0)
    cfg = ps.PSConfig(mode="sync", backup_workers=3)
    with pytest.raises(ValueError, match=r"backup_workers must be < the number of workers \(3\)"):
        ps.run(1, 4, lambda: torch.nn.Linear(2, 2), lambda m, s, i: m.weight.sum(), cfg)


@pytest.mark.parametrize("argv, words", [
    (["train", "--mode", "async", "--backup-workers", "1"], "--backup-workers only applies to --mode sync"),
    (["train", "--mode", "sync", "--workers", "4", "--backup-workers", "4"],
     "backup_workers must be None or an int in [0, workers=4), got 4"),
    (["train", "--mode", "sync", "--backup-workers", "-1"], "--backup-workers: expected an integer >= 0, got -1"),
])
def test_train_backup_workers_bad_values_exit_2(capsys, argv, words):
    from gradcomp.lab.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own checks
        code = e.code
    assert code == 2
    assert words in capsys.readouterr().err

