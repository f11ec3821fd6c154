"""Pipeline mode on the emulated cluster: the stages in their own network
namespaces on a shaped 100 Mbit link (--link, --scenarios), step time, time to target."""

import json
import math

import pytest

from gradcomp.lab.cluster import requirements_missing

REASON = requirements_missing()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")

ROWS, WIDTH = 64, 384  # the study's batch and the boundary's width (after the MLP's first layer)


def _int8_message(rows: int) -> int:
    """Wire bytes of one int8 boundary message of ``rows`` x WIDTH float32: a 2-D
    header (32 fixed + 2 x 8 shape + 8 crc/pad), one byte per element and one
    float32 scale per block of 256 elements."""
    n = rows * WIDTH
    return 32 + 2 * 8 + 8 + n + 4 * math.ceil(n / 256)


def _cli(argv, capsys):
    from gradcomp.lab.study.command import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


@pytest.mark.slow
@needs_netns
def test_pipeline_on_a_100mbit_link_meters_the_boundaries_and_names_the_link(tmp_path, capsys):
    steps, m = 6, 2
    rc, out, err = _cli(["--mode", "pipeline", "--link", "100mbit", "--microbatches", str(m),
                         "--compressors", "int8", "--steps", str(steps), "--eval-every", "3",
                         "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    result = json.loads((tmp_path / "pipeline.json").read_text())
    runs = result["runs"]
    assert [r["compressor"] for r in runs] == ["none", "int8"]
    for r in runs:
        assert r["scenario"]["name"] == "100mbit" and r["link"]["name"] == "100mbit"
        assert r["link"]["configured_bps"] == 100_000_000
        assert 50e6 < r["link"]["achieved_bps"] <= 101e6  # TCP payload under the shaped rate
        assert r["link"]["emulation"] == "netns+tbf"
        assert r["marks"] == [3, 6] and len(r["clock_at_marks"]) == len(r["accuracy_at_marks"]) == 2
    rows = ROWS // m
    per_message = {"none": rows * WIDTH * 4, "int8": _int8_message(rows)}
    for r in runs:
        # every step: m micro-batches forward (activations) and m back (their gradients)
        assert r["bytes_per_boundary"] == {"fwd 0->1": steps * m * per_message[r["compressor"]],
                                           "bwd 1->0": steps * m * per_message[r["compressor"]]}
        # each direction is its own token bucket of 96 KiB at 100 Mbit/s: the run's
        # bytes beyond one bucket cannot pass faster than the rate
        beyond = steps * m * per_message[r["compressor"]] - 96 * 1024
        assert r["wall_s"] >= 0.95 * 8 * beyond / 100e6
        assert r["model_step_s"] is not None and r["model_step_s"] > 0
    assert "link 100mbit configured 100.0 Mbit/s, achieved" in out


def test_medians_and_time_to_target_by_hand():
    from gradcomp.lab.study.pipeline import _fill_targets
    from gradcomp.lab.study.pipeline_report import medians

    def row(compressor, seed, step_s, accs):
        return {"scenario": {"name": "100mbit"}, "schedule": "gpipe", "microbatches": 4,
                "compressor": compressor, "label": compressor, "seed": seed, "step_s": step_s,
                "model_step_s": None, "bubble": 0.5, "bytes_per_step": 1.0,
                "test_accuracy": accs[-1], "marks": [10, 20], "clock_at_marks": [1.0 * seed + 1, 2.0 * seed + 2],
                "accuracy_at_marks": accs}

    rows = [row("none", 0, 0.030, [0.5, 0.9]), row("none", 1, 0.010, [0.5, 0.9]),
            row("none", 2, 0.020, [0.5, 1.0]),
            row("int8", 0, 0.010, [0.95, 0.96]), row("int8", 1, 0.008, [0.1, 0.2]),
            row("int8", 2, 0.004, [0.5, 0.99])]
    target = _fill_targets(rows, None)
    assert target == pytest.approx(0.98 * (0.9 + 0.9 + 1.0) / 3)  # 0.9147
    assert [r["time_to_target_s"] for r in rows] == [None, None, 6.0, 1.0, None, 6.0]
    assert [r["steps_to_target"] for r in rows] == [None, None, 20, 10, None, 20]
    g = {x["compressor"]: x for x in medians({"runs": rows})}
    assert g["none"]["step_s"] == 0.020 and g["int8"]["step_s"] == 0.008
    assert g["int8"]["step_speedup_x"] == pytest.approx(2.5)
    assert g["none"]["time_to_target_s"] == 6.0 and g["none"]["reached"] == 1
    assert g["int8"]["time_to_target_s"] == pytest.approx(3.5) and g["int8"]["reached"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["--scenarios", "100mbit", "--link", "1gbit"], "--scenarios sets link"),
    (["--schedule", "pipedream", "--scenarios", "loopback+straggler"], "takes no straggler"),
    (["--link-jitter", "0.2"], "--link-jitter needs a shaped --link"),
])
def test_bad_pipeline_time_settings_exit_2_with_one_line(argv, needle, capsys, tmp_path):
    rc, _, err = _cli(["--mode", "pipeline", "--out", str(tmp_path), *argv], capsys)
    assert rc == 2
    assert len(err) == 1 and needle in err[0], err


def test_straggler_slowdown_sleeps_factor_minus_one_times_the_compute(monkeypatch):
    import gradcomp.pipeline.stage as stage_mod
    from gradcomp.pipeline.bubble import Span

    slept = []
    monkeypatch.setattr(stage_mod.time, "perf_counter", lambda: 10.0)
    monkeypatch.setattr(stage_mod.time, "sleep", slept.append)
    st = object.__new__(stage_mod.GradcompStage)  # only _stretch's own state
    st.slowdown = lambda: 3.0
    st._stretch(Span("forward", 1, 0, t0=9.99, t1=0.0))                     # 10 ms of compute
    st._stretch(Span("backward", 1, 0, t0=9.98, t1=0.0, inner_codec=0.005))  # 15 ms + 5 ms decode
    st.slowdown = lambda: 1.0
    st._stretch(Span("forward", 1, 1, t0=9.99, t1=0.0))
    st.slowdown = None
    st._stretch(Span("forward", 1, 2, t0=9.99, t1=0.0))
    assert slept == [pytest.approx(0.020), pytest.approx(0.030)]
