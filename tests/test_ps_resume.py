"""Resuming a parameter server: ``resume=True`` with no checkpoint is an error naming the directory
(``"if-exists"`` starts afresh), an uncreatable checkpoint directory is one line before anything
runs, a damaged checkpoint's error says what is wrong with the file, and the demo's command line
checks all of it before starting a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from gradcomp import ps
from gradcomp.launch import launch
from gradcomp.lab import ps_demo
from gradcomp.ps import checkpoint as ckpt


def test_resume_values_are_checked():
    assert ckpt.resume_mode(True) is True and ckpt.resume_mode("if-exists") == "if-exists"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="resume must be False, True or 'if-exists'"):
            ckpt.resume_mode(bad)
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        ps.PSConfig(resume=True)
    assert ps.PSConfig(resume="if-exists", checkpoint_dir="somewhere").resume == "if-exists"


def test_an_uncreatable_checkpoint_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError) as e:
        ckpt.usable_dir(str(blocker / "checkpoints"))
    assert str(e.value).startswith(f"checkpoint_dir {blocker / 'checkpoints'} cannot be created or written")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("data, words", [
    (b"", "truncated or damaged"),
    (os.urandom(4096), "not a torch checkpoint"),
])
def test_a_damaged_checkpoint_says_what_is_wrong_without_torchs_advice(tmp_path, data, words):
    path = tmp_path / "ps-server-0.pt"
    path.write_bytes(data)
    with pytest.raises(ps.CheckpointError) as e:
        ckpt.load(str(path))
    assert words in e.value.reason and "weights_only" not in str(e.value) and "\n" not in str(e.value)


def test_a_foreign_pickle_names_what_it_refers_to(tmp_path):
    path = tmp_path / "ps-server-0.pt"
    torch.save({"format": ckpt.FORMAT, "hook": print}, path)
    with pytest.raises(ps.CheckpointError) as e:
        ckpt.load(str(path))
    assert "refers to print" in e.value.reason and "weights_only" not in str(e.value)


def test_resume_shard_without_a_file(tmp_path):
    assert ckpt.resume_shard(str(tmp_path), 0, 1, updater=None) is None  # missing_ok: nothing changes
    with pytest.raises(ps.CheckpointError, match=f"no checkpoint to resume from in {tmp_path}"):
        ckpt.resume_shard(str(tmp_path), 0, 1, updater=None, missing_ok=False)


def _resume_rank(rank, world_size, ckpt_dir):
    dist.barrier()
    if rank == 1:
        with ps.Worker({"x": torch.zeros(4)}, timeout=30.0) as worker:
            worker.pull()
            worker.push({"x": torch.ones(4)})
        return None
    try:
        ps.ParameterServer({"x": torch.zeros(4)}, mode="async", checkpoint_dir=ckpt_dir, resume=True)
        error = None
    except ps.CheckpointError as e:
        error = str(e)
    server = ps.ParameterServer({"x": torch.zeros(4)}, mode="async", checkpoint_dir=ckpt_dir, resume="if-exists")
    return error, server.resumed_from, server.serve()["version"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_true_without_a_checkpoint_raises_if_exists_starts_afresh(tmp_path):
    (error, resumed, version), _ = launch(_resume_rank, 2, args=(str(tmp_path),), timeout=100.0)
    assert error is not None and f"no checkpoint to resume from in {tmp_path}" in error
    assert resumed is None and version == 1  # afresh: one push applied


@pytest.mark.parametrize("argv, words", [
    (["--resume", "--checkpoint-dir", "{missing}"], "--resume: no checkpoint to resume from in {missing}"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--resume", "maybe", "--checkpoint-dir", "{missing}"], "expected nothing or 'if-exists'"),
    (["--checkpoint-dir", "{blocked}"], "--checkpoint-dir {blocked} cannot be written"),
])
def test_demo_checkpoint_options_are_one_line_before_any_process(capsys, tmp_path, argv, words):
    (tmp_path / "a-file").write_text("x")
    paths = {"missing": str(tmp_path / "typo"), "blocked": str(tmp_path / "a-file" / "ckpt")}
    with pytest.raises(SystemExit) as e:
        ps_demo.main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and words.format(**paths) in err
    assert not os.path.exists(paths["missing"])  # nothing created for a typo


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_resume_says_from_which_version(tmp_path):
    run = [sys.executable, "-m", "gradcomp.ps", "--steps", "5", "--checkpoint-dir", str(tmp_path)]
    first = subprocess.run(run, capture_output=True, text=True, timeout=280)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "resumed from" not in first.stdout
    again = subprocess.run(run + ["--resume"], capture_output=True, text=True, timeout=280)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from version 10" in again.stdout  # 2 workers x 5 pushes, async: 10 versions


def _demo_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        ps_demo.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_demo_resume_from_a_damaged_checkpoint_is_one_line_before_any_process(capsys, tmp_path):
    path = ckpt.checkpoint_path(str(tmp_path), 0)
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 8)  # no torch archive
    err = _demo_error(capsys, ["--resume", "--checkpoint-dir", str(tmp_path)])
    assert f"--resume: checkpoint {path}: unreadable" in err and "weights_only" not in err
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 60)  # a zip header, then nothing
    err = _demo_error(capsys, ["--resume", "if-exists", "--checkpoint-dir", str(tmp_path)])
    assert "unreadable" in err and "weights_only" not in err


def test_demo_resume_with_another_number_of_servers_is_one_line(capsys, tmp_path):
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.5)
    ckpt.save_atomic({"format": ckpt.FORMAT, "server_index": 0, "num_servers": 1, "mode": "async",
                      "layout": [["w", [4]]], "version": 3, "params": {"w": w.detach().clone()},
                      "optimizer": opt.state_dict()}, ckpt.checkpoint_path(str(tmp_path), 0))
    err = _demo_error(capsys, ["--resume", "if-exists", "--checkpoint-dir", str(tmp_path), "--num-servers", "2",
                               "--world-size", "4"])
    assert "was written by 1 server(s); resume with --num-servers 1" in err
