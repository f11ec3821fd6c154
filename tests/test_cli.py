"""The ``gradcomp`` command line: help, version, option errors (exit 2), bench dispatch."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from gradcomp import __version__
from gradcomp.lab.cli import main
from gradcomp.lab.study.config import COMPRESSORS


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
    (["train", "--topology", "2x"], "--topology"),
    (["bench", "allreduce", "--methods", "int8 hierarchical"], "need hosts: give --topology"),
    (["bench", "allreduce", "--topology", "1x1"], "--topology must hold at least 2 ranks"),
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


@pytest.mark.parametrize("argv, words", [
    (["train", "--topology", "2x2", "--mode", "async"], "--topology applies to --mode sync and local"),
    (["train", "--topology", "2x2", "--workers", "3", "--mode", "sync"], "--workers 3 does not fit --topology 2x2"),
    (["train", "--algorithm", "hierarchical", "--compressors", "auto", "--mode", "sync"],
     "--algorithm hierarchical does not apply to the auto row"),
])
def test_topology_conflicts_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_impossible_batch_exits_2(capsys):
    assert main(["train", "--mode", "sync", "--compressors", "none", "--batch-size", "1000"]) == 2
    assert "exceeds the 1347 training samples" in capsys.readouterr().err


def test_bench_passes_arguments_through(monkeypatch):
    seen = {}
    fake = types.ModuleType("gradcomp.lab.bench.kernels")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "gradcomp.lab.bench.kernels", fake)
    assert main(["bench", "kernels", "--size", "4096", "--out", "somewhere"]) == 0
    assert seen["argv"] == ["--size", "4096", "--out", "somewhere"]


def test_bench_status_is_the_benchmarks(monkeypatch):
    fake = types.ModuleType("gradcomp.lab.bench.allreduce")
    fake.main = lambda argv: 3
    monkeypatch.setitem(sys.modules, "gradcomp.lab.bench.allreduce", fake)
    assert main(["bench", "allreduce"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("module, prog", [("gradcomp.lab.study", "python -m gradcomp.lab.study"),
                                          ("gradcomp", "python -m gradcomp")])
def test_python_dash_m_help(module, prog):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {prog}")


@pytest.mark.slow
def test_python_dash_m_train_bad_option():
    r = subprocess.run([sys.executable, "-m", "gradcomp.lab.study", "--compressors", "gzip"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "allowed: none,fp16" in r.stderr


@pytest.mark.parametrize("argv, words", [
    (["train", "--seed", "-5"], "--seed: expected an integer in [0, 2**32 - 1], got -5"),
    # 0 is allowed: the message names the bound that is ">= 0"
    (["train", "--threshold", "-1"], "--threshold: expected a finite number >= 0, got -1"),
    (["train", "--dgc-warmup", "-1"], "--dgc-warmup: expected a finite number >= 0, got -1"),
    (["train", "--dgc-warmup", "nan"], "--dgc-warmup: expected a finite number >= 0, got nan"),
    (["bench", "kernels", "--size", "0"], "--size: expected an integer >= 1: 1048576, 2**20"),
    (["bench", "kernels", "--sizes", "2**20,2**100000"], "--sizes: expected an integer >= 1"),
    (["bench", "kernels", "--densities", "5"], "--densities: expected numbers in (0, 1]"),
    (["bench", "kernels", "--threads", "abc"], "--threads: expected 'all' or an integer >= 1"),
    (["bench", "kernels", "--block-size", "3"], "--block-size: block_size must be a power of two"),
    (["bench", "kernels", "--dtypes", "int8"], "--dtypes: unknown ['int8']"),
    (["bench", "kernels", "--ops", "bogus"], "--ops: unknown ['bogus']"),
    (["bench", "kernels", "--devices", "tpu"], "--devices: unknown ['tpu']"),
])
def test_more_bad_options_exit_2_with_message(capsys, argv, words):
    code, _, err = _exit_code(capsys, argv)
    assert code == 2
    assert words in err


@pytest.mark.parametrize("argv, words", [
    # one sync worker exchanges nothing: the study divided by zero bytes (a traceback)
    (["train", "--mode", "sync", "--workers", "1", "--compressors", "none"], "at least 2 workers"),
    # the launcher's timeout overflowed inside the ranks (a traceback, exit 1)
    (["train", "--mode", "sync", "--compressors", "none", "--timeout", "1e300"], "timeout must be > 0"),
    # the pipeline mode ignored both without a word
    (["train", "--mode", "pipeline", "--async-momentum", "0.5"], "--async-momentum only applies to --mode async"),
    (["train", "--mode", "pipeline", "--dgc-warmup", "1"], "--dgc-warmup does not apply to --mode pipeline"),
    # was ignored without a word, as --async-momentum is not
    (["train", "--mode", "sync", "--compressors", "none,topk-ef", "--dgc-warmup", "2"],
     "--dgc-warmup only applies to the DGC rows (--compressors dgc, dgc-int8), got --compressors none,topk-ef"),
    # the warm-up's step count overflowed inside the ranks (a traceback, exit 1)
    (["train", "--mode", "sync", "--compressors", "dgc", "--steps", "1", "--dgc-warmup", "1e308"],
     "dgc_warmup_epochs must be a number of epochs in [0, 1e+06]"),
    # adaptive compression needs the DDP hook
    (["train", "--compressors", "auto"], "compressor 'auto' runs in mode(s) sync,auto only"),
    (["train", "--hidden", "64,0"], "--hidden expects comma-separated widths >= 1, got '64,0'"),
    (["train", "--workload", "mnist-cnn", "--hidden", "64"], "--hidden applies to --workload digits-mlp only"),
])
def test_settings_that_cannot_work_exit_2(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_bad_auto_profiles_exit_2_before_the_study(capsys, tmp_path):
    good = tmp_path / "100mbit.json"
    good.write_text('{"version": 1, "alpha_s": 1e-4, "beta_bytes_per_s": 1.25e7, "link": "100mbit"}')
    nobw = tmp_path / "roofline.json"
    nobw.write_text('{"version": 1, "alpha_s": 1e-4, "beta_bytes_per_s": null, "link": "100mbit"}')
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    auto = ["train", "--mode", "sync", "--compressors", "auto", "--steps", "1"]
    for argv, words in [
        (["train", "--mode", "sync", "--compressors", "int8", "--auto-profile", str(good)],
         "--auto-profile only applies to the auto row"),
        ([*auto, "--auto-profile", str(tmp_path / "missing.json")], "--auto-profile: cannot read"),
        ([*auto, "--auto-profile", str(junk)], "is not valid JSON"),
        ([*auto, "--auto-profile", str(nobw)], "has no measured bandwidth"),
        ([*auto, "--auto-profile", f"{good},{good}"], "two profiles for link '100mbit'"),
        ([*auto, "--auto-profile", str(good)], "no profile for scenario 'loopback' (link none); profiles for: 100mbit"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_out_that_is_a_file_exits_2_before_the_study(capsys, tmp_path):
    f = tmp_path / "results"
    f.write_text("not a directory")
    # (the study itself would take many seconds: the check comes first)
    assert main(["train", "--mode", "sync", "--compressors", "none", "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    code, _, err = _exit_code(capsys, ["bench", "kernels", "--out", str(f)])
    assert code == 2 and "exists and is not a directory" in err
    code, _, err = _exit_code(capsys, ["bench", "allreduce", "--out", str(f)])
    assert code == 2 and "exists and is not a directory" in err


def test_threshold_zero_spelled_any_way_is_accepted():
    from gradcomp.lab.study.command import build_parser

    for text in ("0", "0.0", "-0", "0e0"):
        assert build_parser().parse_args(["--threshold", text]).threshold == 0.0
        assert build_parser().parse_args(["--dgc-warmup", text]).dgc_warmup == 0.0


_LIGHT = ("torch", "numpy", "zmq", "gradcomp.kernels")  # none of these loads for --help or --version


@pytest.mark.slow
@pytest.mark.parametrize("argv, heavy", [
    (["--help"], (*_LIGHT, "gradcomp.lab.study")), (["--version"], (*_LIGHT, "gradcomp.lab.study")),
    (["bench", "--help"], (*_LIGHT, "gradcomp.lab.study")), (["train", "--help"], _LIGHT),
    (["plan", "--help"], _LIGHT), (["plan", "recommend", "--help"], _LIGHT),
    (["plan", "calibrate", "--help"], _LIGHT), (["plan", "validate", "--help"], _LIGHT)])
def test_help_and_version_do_not_import_torch(argv, heavy):
    # importing torch takes seconds: gradcomp --help / --version and every subcommand's --help
    # (the console script `gradcomp` calls gradcomp.lab.cli.main) print before it would have loaded
    code = (
        "import sys\n"
        "from gradcomp.lab.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        f"heavy = sorted(m for m in sys.modules if m.startswith({tuple(h + '.' for h in heavy)!r}) "
        f"or m in {heavy!r})\n"
        "print('imported:', heavy[:5])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("imported: []"), r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module, argv", [("gradcomp", ["train", "--help"]), ("gradcomp.lab.study", ["--help"])])
def test_module_entry_help_imports_no_torch(module, argv):
    # the real entry point (python -m ...), its imports as the interpreter reports them
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--workload" in r.stdout and "--stages" in r.stdout
    imported = [line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "gradcomp.lab.study.command" in imported  # the report was read right
    assert not [m for m in imported if m.split(".")[0] == "torch"]


def test_train_choices_match_the_libraries():
    # the parser's choices are plain strings (no torch at --help); they must name what the library takes
    from gradcomp.comm import DENSE_ALGORITHMS
    from gradcomp.localsgd import OUTER_OPTIMIZERS
    from gradcomp.lab.study import menu, workloads
    from gradcomp.lab.study.command import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["outer"].choices) == OUTER_OPTIMIZERS
    assert set(actions["algorithm"].choices) <= set(DENSE_ALGORITHMS)
    assert tuple(actions["workload"].choices) == ("digits-mlp", "mnist-cnn", "cifar10-resnet18", "text-gpt")
    assert actions["workload"].default in actions["workload"].choices
    assert workloads.WORKLOADS is menu.WORKLOADS  # re-exported: one table
    listed = actions["compressors"].help.split("among ", 1)[1].split(" (default", 1)[0]
    assert listed.split(",") == list(COMPRESSORS)


def test_version_has_one_source():
    import pathlib

    import gradcomp._version

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = pathlib.Path(__file__).resolve().parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradcomp._version.__version__"}
    assert __version__ is gradcomp._version.__version__
