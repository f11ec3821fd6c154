"""``gradcomp plan``'s output: tables within 80 columns with every cell whole, where each input came
from (this machine measured once and cached, given, default, or the shipped profile named as another
machine's), a recommendation in words, and one-line errors before any work."""

from __future__ import annotations

import io
import os

import pytest

pytest.importorskip("rich")

from rich.console import Console

from gradcomp.lab.cli import main
from gradcomp.lab.plan import machine, tables
from gradcomp.lab.plan.codecs import plan_codec
from gradcomp.lab.plan.costs import compress_s
from gradcomp.lab.plan.profile import OPS, Profile
from gradcomp.lab.plan.project import project
from gradcomp.lab.units import format_count


def _render(renderable) -> str:
    buf = io.StringIO()
    Console(file=buf, width=tables.WIDTH, color_system=None).print(renderable)
    return buf.getvalue()


def _check(text: str, cells) -> None:
    assert "…" not in text
    assert max(map(len, text.splitlines())) <= 80, max(text.splitlines(), key=len)
    for cell in cells:
        assert cell in text, cell


@pytest.fixture(scope="module")
def rows():
    prof = Profile.load(machine.SHIPPED_PROFILE)
    out = project([16, 1024], [("10gbit", 1.25e9), ("100gbit", 12.5e9)], [25_000_000, 7 * 10**9], prof,
                  straggler_cv=0.2)
    # the widest cells: the longest codec on its algorithm, steps of hours, ten-fold speed-ups
    r = out[-1]
    r["best_sync"] = "topk-int8-ef/allgather"
    r["sync"]["topk-int8-ef/allgather"]["step_s"] = 98_765.4
    r["baseline"]["step_s"] = 123_456.7
    r["speedup"]["topk-int8-ef/allgather"] = 12.345
    r["best_async"] = "topk-int8-ef/ps"
    r["staleness_best_async"] = 12345.6
    return out


def test_durations_by_hand():
    assert [tables.duration(s) for s in (0.0031, 0.6558, 15.483, 3342.7)] == [
        "3.1 ms", "655.8 ms", "15.48 s", "3,343 s"]


def test_projection_tables_fit_80_columns(rows):
    sync, other = (_render(t) for t in tables.projection_tables(rows, 0.2))
    cells, more = [], []
    for r in rows:
        key = [format_count(r["params"]), r["link"], str(r["nodes"])]
        name, alg = r["best_sync"].split("/")
        cells += key + [tables.duration(r["compute_s"]), tables.duration(r["baseline"]["step_s"]),
                        f"{name} {tables.ALGORITHM_ABBREVIATIONS[alg]}",
                        tables.duration(r["sync"][r["best_sync"]]["step_s"]), f"{r['speedup'][r['best_sync']]:.2f}x"]
        more += key + [f"{100 * r['comm_share_none']:.1f}%", f"{100 * r['comm_share_best']:.1f}%",
                       r["best_async"].split("/")[0], f"{r['async_over_sync']:.2f}x",
                       f"{r['staleness_best_async']:.1f}", f"{100 * r['idle_share']:.1f}%"]
    _check(sync, cells)
    _check(other, more)
    assert "123,457 s" in sync and "topk-int8-ef AG" in sync and "12.35x" in sync


def test_speedup_table_names_each_codecs_fastest_algorithm(rows):
    text = _render(tables.speedup_table(rows))
    cells = []
    for r in rows:
        for codec in ("none", "fp16", "int8", "int8-ef", "topk-ef", "topk-int8-ef"):
            keys = [k for k in r["speedup"] if k.split("/")[0] == codec]
            best = max(keys, key=lambda k: r["speedup"][k])
            x = r["speedup"][best]
            cells.append(f"{x:.2f} " if x < 10 else f"{x:.1f} ")
    _check(text, cells)
    assert "bf16" not in text.split("algorithm)")[-1] and "threshold" not in text  # left out, as before


def _validation_out():
    label = "sync topk-int8-ef allgather 100mbit N=4 straggler 1:3"
    row = {"label": label, "step_s": {"measured": 0.1234, "predicted": 123.4}, "step_error_pct": 99_900.0,
           "idle_share": {"measured": 0.123, "predicted": 0.999}, "exposed_comm_s": {"measured": None,
                                                                                    "predicted": 12.3},
           "bytes": {"measured": 44_696_000.0, "predicted": 44_696_123.0}}
    return {"rows": [row, dict(row, label="async none ps loopback N=3")]}


def test_validation_tables_wrap_long_labels_and_keep_every_number():
    out = _validation_out()
    step, comm = (_render(t) for t in tables.validation_tables(out, "results/"))
    _check(step, ["123.4 ms", "123 s", "+99900.0%", "12.3%", "99.9%"])
    _check(comm, ["-", "12.30 s", "44,696,000", "44,696,123"])
    for word in out["rows"][0]["label"].split():  # wrapped at spaces, no word cut
        assert word in step and word in comm


def test_breakdown_table_fits_with_two_lines_per_group():
    terms = ("compute", "wait", "codec", "comm", "apply")
    group = {"group": ("100mbit+straggler", "async", "topk-int8-ef"), "runs": 3,
             "step_s": {"measured": 9.8765, "predicted": 1.2345}, "step_error_pct": -87.5,
             "terms": {"measured": {t: 9.8765 for t in terms}, "predicted": {t: 1.2345 for t in terms}}}
    text = _render(tables.breakdown_table([group], terms))
    _check(text, ["9,876.5", "1,234.5", "-88%", "(3", "runs)", "async", "topk-int8-ef"])


# ---- where the inputs come from --------------------------------------------------------------
def test_this_machine_is_measured_once_then_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADCOMP_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(on_progress=None):
        calls.append(1)
        return Profile(kernels={op: 1e9 for op in OPS}, source={"measured": f"day {len(calls)}"})
    monkeypatch.setattr(machine, "measure_here", fake_measure)
    prof, origin = machine.this_machine()
    assert (origin.kind, origin.when, len(calls)) == ("measured", "day 1", 1)
    assert origin.path == machine.cache_path() and os.path.isfile(origin.path)
    assert machine.this_machine()[1].when == "day 1" and len(calls) == 1  # cached
    assert machine.this_machine(recalibrate=True)[1].when == "day 2" and len(calls) == 2

    def broken(on_progress=None):
        raise RuntimeError("no native kernels")
    monkeypatch.setattr(machine, "measure_here", broken)
    os.remove(machine.cache_path())
    prof, origin = machine.this_machine()
    assert origin.kind == "shipped" and "no native kernels" in origin.why
    assert prof.kernels == Profile.load(machine.SHIPPED_PROFILE).kernels


def test_a_cached_profile_without_a_codecs_rates_is_measured_again(monkeypatch, tmp_path):
    # a profile cached before the 4-bit codec existed: its kernels would be priced at 0 s
    monkeypatch.setenv("GRADCOMP_CACHE_DIR", str(tmp_path))
    old = [op for op in OPS if not op.startswith("int4.")]
    Profile(kernels={op: 1e9 for op in old}, source={"measured": "before int4"}).save(machine.cache_path())
    assert compress_s(plan_codec("int4-ef"), Profile.load(machine.cache_path()), 10**6, ef=True) == 0.0
    calls = []

    def fake_measure(on_progress=None):
        calls.append(1)
        return Profile(kernels={op: 2e8 for op in OPS}, source={"measured": "after int4"})
    monkeypatch.setattr(machine, "measure_here", fake_measure)
    prof, origin = machine.this_machine()
    assert (origin.kind, origin.when, len(calls)) == ("measured", "after int4", 1)
    assert compress_s(plan_codec("int4-ef"), prof, 10**6, ef=True) == pytest.approx(10**6 / 2e8)
    assert Profile.load(machine.cache_path()).source["measured"] == "after int4"  # the cache replaced
    assert machine.this_machine()[1].when == "after int4" and len(calls) == 1  # complete now: kept


def test_recommend_names_a_given_profile_and_speaks_in_words(capsys):
    assert main(["plan", "recommend", "--nodes", "64", "--link", "1gbit", "--params", "1B", "--compute-ms", "200",
                 "--profile", machine.SHIPPED_PROFILE]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"inputs: kernels from --profile {machine.SHIPPED_PROFILE}" in out
    assert "measured here" not in out and "per N gradients" not in out
    assert "recommended: " in out and " per step" in out and "each worker sends" in out


def test_given_kernels_and_latency_are_named_as_given(capsys):
    assert main(["plan", "recommend", "--nodes", "64", "--link", "1gbit", "--params", "1B", "--compute-ms", "200",
                 "--alpha-us", "20", "--kernel-gbps", "1000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "kernels given (--kernel-gbps 1000" in out and "latency 20.0 us per message, given (--alpha-us)" in out


@pytest.mark.slow
def test_first_use_measures_this_machine_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GRADCOMP_CACHE_DIR", str(tmp_path))
    argv = ["plan", "recommend", "--nodes", "8", "--link", "10gbit", "--params", "25M", "--compute-ms", "50"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "kernels measured on this machine" in out and "--recalibrate" in out
    assert "latency 20.0 us per message, a default" in out
    cached = Profile.load(machine.cache_path())
    assert set(cached.kernels) == set(OPS) and cached.source["measured"]


# ---- errors before any work -------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["plan", "--profile", "/nonexistent.json"], "--profile /nonexistent.json: No such file"),
    (["plan", "recommend", "--nodes", "8", "--link", "1gbit", "--params", "1B", "--compute-ms", "1",
      "--kernels-json", "/nonexistent.json"], "--kernels-json /nonexistent.json: No such file"),
    (["plan", "--out", "/proc/no-such-dir"], "--out /proc/no-such-dir cannot be written"),
    (["plan", "calibrate", "--out", "/proc/no-such-dir/p.json"], "--out /proc/no-such-dir cannot be written"),
])
def test_bad_paths_are_one_line_before_any_work(capsys, argv, words, monkeypatch, tmp_path):
    monkeypatch.setenv("GRADCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "measure_here", lambda on_progress=None: pytest.fail("measured"))
    import gradcomp.lab.plan.calibrate as C
    monkeypatch.setattr(C, "measure", lambda *a, **k: pytest.fail("calibrated"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_calibrate_out_that_is_a_directory(capsys, tmp_path):
    assert main(["plan", "calibrate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is a directory" in err and err.count("\n") == 1


def test_every_recommend_option_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "recommend", "--help"])
    text = capsys.readouterr().out
    import re
    opts = re.findall(r"^  (--[a-z-]+)(.*)$", text, re.M)
    assert len(opts) >= 15
    for name, rest in opts:
        # the help follows on the option's line or on the next one
        assert rest.strip() or re.search(rf"^  {name}.*\n {{10,}}\S", text, re.M), name
