"""The ``gradcomp`` command line: help, version, option errors (exit 2), bench dispatch."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from gradcomp import __version__
from gradcomp.cli import main
from gradcomp.train.config import COMPRESSORS


def _exit_code(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_help_lists_subcommands(capsys):
    code, out, _ = _exit_code(capsys, ["--help"])
    assert code == 0
    assert "train" in out and "bench" in out


def test_version(capsys):
    code, out, _ = _exit_code(capsys, ["--version"])
    assert code == 0
    assert out.strip() == f"gradcomp {__version__}"


def test_train_help_shows_options(capsys):
    code, out, _ = _exit_code(capsys, ["train", "--help"])
    assert code == 0
    for opt in ("--workers", "--mode", "--compressors", "--steps", "--seed", "--out",
                "--algorithm", "--batch-size", "--lr"):
        assert opt in out


def test_no_subcommand_is_an_error(capsys):
    code, _, err = _exit_code(capsys, [])
    assert code == 2
    assert "required" in err


@pytest.mark.parametrize("argv, words", [
    (["train", "--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["train", "--workers", "two"], "--workers: expected an integer >= 1, got 'two'"),
    (["train", "--mode", "fast"], "--mode: invalid choice: 'fast'"),
    (["train", "--algorithm", "tree"], "--algorithm: invalid choice: 'tree'"),
    (["train", "--lr", "-1"], "--lr: expected a finite number > 0"),
    (["train", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["bench", "gpu"], "invalid choice: 'gpu'"),
])
def test_bad_option_exits_2_with_message(capsys, argv, words):
    code, _, err = _exit_code(capsys, argv)
    assert code == 2
    assert words in err


def test_unknown_compressor_lists_allowed_names(capsys):
    code, _, err = _exit_code(capsys, ["train", "--compressors", "int8,zip9"])
    assert code == 2
    assert "unknown compressor name(s): zip9" in err
    assert ",".join(COMPRESSORS) in err


def test_impossible_batch_exits_2(capsys):
    assert main(["train", "--mode", "sync", "--compressors", "none", "--batch-size", "1000"]) == 2
    assert "exceeds the 1347 training samples" in capsys.readouterr().err


def test_bench_passes_arguments_through(monkeypatch):
    seen = {}
    fake = types.ModuleType("gradcomp.bench.kernels")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "gradcomp.bench.kernels", fake)
    assert main(["bench", "kernels", "--size", "4096", "--out", "somewhere"]) == 0
    assert seen["argv"] == ["--size", "4096", "--out", "somewhere"]


def test_bench_status_is_the_benchmarks(monkeypatch):
    fake = types.ModuleType("gradcomp.bench.allreduce")
    fake.main = lambda argv: 3
    monkeypatch.setitem(sys.modules, "gradcomp.bench.allreduce", fake)
    assert main(["bench", "allreduce"]) == 3


@pytest.mark.parametrize("module, prog", [("gradcomp.train", "python -m gradcomp.train"),
                                          ("gradcomp", "python -m gradcomp")])
def test_python_dash_m_help(module, prog):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {prog}")


def test_python_dash_m_train_bad_option():
    r = subprocess.run([sys.executable, "-m", "gradcomp.train", "--compressors", "gzip"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "allowed: none,fp16" in r.stderr
