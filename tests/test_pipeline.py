"""Pipeline parallelism: the engine's schedules on gradcomp stages, the measured
bubble, PipeDream's weight stashing, compressed boundaries, the CLI's checks."""

import math
import statistics

import pytest
import torch
from torch import nn

from gradcomp.launch import launch
from gradcomp.pipeline import BoundaryCodec, analyze, split_sequential
from gradcomp.lab.study.model import make_model
from tests import pipeline_fns as F


def test_split_balances_parameters_and_rejects_too_many_stages():
    model = make_model(0, (384, 256))  # layers of 24960, 98560, 2570 parameters
    a, b = split_sequential(model, 2)
    assert [type(m).__name__ for m in a] == ["Linear", "ReLU"]  # max(24960, 101130) < max(123520, 2570)
    assert len(b) == 3
    x = torch.randn(5, 64)
    torch.testing.assert_close(b(a(x)), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_stages must be from 1 to the model's 3 layers"):
        split_sequential(model, 4)


def test_one_bubble_formula_for_the_library_the_planner_and_the_study():
    from gradcomp.lab.plan import model as plan_model
    from gradcomp.lab.study.pipeline import theory_bubble
    from gradcomp.pipeline import bubble_fraction

    # p stages, m micro-batches, v chunks: the step takes v m + p - 1 slots of which p - 1 idle
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(1, 5) == 0.0
    assert bubble_fraction(4, 8, chunks=2) == 3 / 19
    assert plan_model.bubble_fraction is bubble_fraction
    assert theory_bubble("gpipe", 4, 8) == theory_bubble("1f1b", 4, 8) == 3 / 11
    assert theory_bubble("interleaved", 4, 8) == 3 / 19 and theory_bubble("zb", 4, 8) is None
    for bad in ({"stages": 0}, {"microbatches": 2.0}, {"chunks": True}):
        args = {"stages": 4, "microbatches": 8, **bad}
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer >= 1"):
            bubble_fraction(**args)


def test_int8_boundary_decodes_within_the_bound():
    torch.manual_seed(1)
    x = torch.randn(16, 384) * torch.linspace(0.01, 10, 384)
    codec = BoundaryCodec()  # int8, 256-element blocks
    wire = codec.encode(x, "fwd 0->1")
    out = codec.decode_into(wire, torch.empty_like(x), "fwd 0->1")
    flat, dec = x.reshape(-1).double(), out.reshape(-1).double()
    for start in range(0, flat.numel(), 256):
        block = flat[start:start + 256]
        bound = block.abs().max() / 127 / 2  # half a quantization step of the block's absmax scale
        assert (dec[start:start + 256] - block).abs().max() <= bound * (1 + 1e-6)
    d = codec.meter.as_dict()["phases"]["fwd 0->1"]
    assert d["bytes_sent"] == wire.numel() and d["raw_bytes_sent"] == 4 * x.numel()
    assert d["raw_bytes_sent"] / d["bytes_sent"] >= 3.9


def _accumulated(hidden, x, y, m, steps, lr):
    """The single-process reference: SGD on the mean of per-micro-batch losses."""
    ref = make_model(0, hidden)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (nn.functional.cross_entropy(ref(xm), ym) / m).backward()
        opt.step()
    return ref


def _check_stages(ref, n, got):
    parts = split_sequential(ref, n)
    seen = set()
    for rank_states in got:
        for s, state in rank_states.items():
            seen.add(s)
            for k, v in parts[s].state_dict().items():
                torch.testing.assert_close(state[k], v, rtol=0, atol=1e-5)
    assert seen == set(range(n))


@pytest.mark.slow
def test_engine_schedules_match_gradient_accumulation_and_int8_decodes_within_the_bound():
    # GPipe P=2 M=4, and 1F1B, interleaved, zero-bubble V over 2 ranks; 4 layers (2 ranks x 2 stages)
    hidden, m, steps, lr = (32, 24, 16), 4, 3, 0.2
    torch.manual_seed(4)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    runs = [("gpipe", False), ("1f1b", False), ("interleaved", False), ("zb", False), ("1f1b", True)]
    got = launch(F.engine_steps, 2, (runs, hidden, x, y, m, steps, lr), timeout=120)
    ref = _accumulated(hidden, x, y, m, steps, lr)
    assert not torch.equal(ref[0].weight, make_model(0, hidden)[0].weight)  # it trained
    for schedule, n in (("gpipe", 2), ("1f1b", 2), ("interleaved", 4), ("zb", 4)):
        _check_stages(ref, n, [g[0][(schedule, False)] for g in got])
    # int8 boundaries under 1F1B: what stage 1 decoded is stage 0's exact output within the bound
    parts = split_sequential(make_model(0, hidden), 2)
    for xm, dec in zip(x.chunk(m), got[1][1][("1f1b", True)][1]):
        exact = parts[0](xm).detach().reshape(-1).double()
        dec = dec.reshape(-1).double()
        assert not torch.equal(dec, exact)  # it was compressed
        for start in range(0, exact.numel(), 256):
            block = exact[start:start + 256]
            # half a quantization step of the block's absmax scale: absmax / 127 / 2
            assert (dec[start:start + 256] - block).abs().max() <= block.abs().max() / 254 * (1 + 1e-6)


@pytest.mark.slow
def test_pipeline_replicas_average_their_stage_gradients():
    from gradcomp.lab.study.data import load_digits_split, worker_batches
    from gradcomp.lab.study.pipeline import PipelineConfig

    cfg = PipelineConfig(stages=2, workers=4, microbatches=(2,), steps=3, batch_size=8, lr=0.1,
                         momentum=0.9, hidden=(32, 24))
    data = load_digits_split(0.25, 0)
    got = launch(F.replicated_engine, 4, (cfg, data), timeout=120)
    ref = make_model(0, cfg.hidden)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    per_replica = [worker_batches(len(data.y_train), 2, r, 8, 0, 3) for r in range(2)]
    for idx in zip(*per_replica):
        opt.zero_grad()
        for i in idx:  # the mean over 2 replicas of the mean over 2 micro-batches
            for part in i.chunk(2):
                (nn.functional.cross_entropy(ref(data.x_train[part]), data.y_train[part]) / 4).backward()
        opt.step()
    _check_stages(ref, 2, got[:2])
    _check_stages(ref, 2, got[2:])


@pytest.mark.slow
def test_measured_bubble_of_fixed_time_stages_matches_gpipe_formula():
    # 100 ms per forward and backward: long against the milliseconds a message can
    # take on a loaded 2-core host, as the formula assumes
    p, fwd_s, bwd_s, steps, ms = 2, 0.1, 0.1, 6, (1, 4)
    runs = launch(F.fixed_time_runs, p, (ms, steps, fwd_s, bwd_s), timeout=120)
    for i, m in enumerate(ms):
        tls = [r[i] for r in runs]
        # per step (the first left out as warm-up); the median keeps a step that the
        # host's other load delayed from deciding the result
        per_step = [analyze(tls, steps=[k]) for k in range(1, steps)]
        bubble = statistics.median(r["bubble"] for r in per_step)
        assert abs(bubble - (p - 1) / (m + p - 1)) <= 0.05, (m, [r["bubble"] for r in per_step])
        for rank in range(p):  # every stage computed m forwards per step
            forward = statistics.median(r["per_rank"][rank]["forward"] for r in per_step)
            assert forward == pytest.approx(m * fwd_s, rel=0.25)


def _stage0_grads(x, w, b, grad_out):
    """Gradients of stage 0 (tanh(x w^T + b)) for an output gradient, in float64."""
    w = w.double().requires_grad_(True)
    b = b.double().requires_grad_(True)
    out = torch.tanh(x.double() @ w.T + b)
    return torch.autograd.grad(out, [w, b], grad_outputs=grad_out.double())


@pytest.mark.slow
def test_pipedream_backward_uses_its_forward_weights():
    n, p = 7, 3
    out = launch(F.pipedream_record, p, (n, False, None), timeout=90)
    s0, xs = out[0][0], out[0][1]
    # stage s of p keeps p - s minibatches in flight: p - 1 - s updates land between forward and backward
    for s, (stats, _, _) in enumerate(out):
        steady = p - 1 - s
        assert stats.staleness == [min(j, steady) for j in range(n)]
    assert [r["mb"] for r in s0.records] == list(range(n))
    for r in s0.records[1:]:
        w, b = s0.versions[r["forward_version"]]
        gw, gb = _stage0_grads(xs[r["mb"]], w, b, r["grad_out"])
        torch.testing.assert_close(r["param_grads"][0].double(), gw, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["param_grads"][1].double(), gb, rtol=0, atol=1e-6)
        # the weights it lands on give another gradient: the check can tell them apart
        w2, b2 = s0.versions[r["update_version"]]
        assert not torch.allclose(_stage0_grads(xs[r["mb"]], w2, b2, r["grad_out"])[0], gw, atol=1e-6)


@pytest.mark.slow
def test_pipedream_vertical_sync_and_int8_boundaries():
    n = 6
    (s0, _, _), (s1, _, _) = launch(F.pipedream_record, 2, (n, True, "int8"), timeout=90)
    # every stage runs minibatch i on the weight version the input stage used
    assert s1.forward_versions == s0.forward_versions == [0, 0, 1, 2, 3, 4]
    assert s1.staleness[1:] == [1] * (n - 1)


def _cli(argv, capsys):
    from gradcomp.lab.study.command import main

    rc = main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, needle", [
    (["--microbatches", "0"], "--microbatches must be >= 1"),
    (["--stages", "4"], "larger than the model's 3 layers"),
    (["--workers", "3"], "--workers 3 is not divisible by --stages 2"),
    (["--schedule", "interleaved"], "needs 4 stages, more than the model's 3 layers"),
    (["--compressors", "topk-ef"], "needs a dense compressor"),
    (["--schedule", "pipedream", "--workers", "4"], "one pipeline replica"),
])
def test_bad_pipeline_settings_exit_2_with_one_line(argv, needle, capsys, tmp_path):
    rc, err = _cli(["--mode", "pipeline", "--out", str(tmp_path), *argv], capsys)
    assert rc == 2
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.slow
def test_cli_pipeline_runs_and_reports(tmp_path, capsys):
    import json

    rc, _ = _cli(["--mode", "pipeline", "--schedule", "1f1b,pipedream", "--microbatches", "2",
                  "--steps", "4", "--out", str(tmp_path)], capsys)
    assert rc == 0
    runs = json.loads((tmp_path / "pipeline.json").read_text())["runs"]
    assert [(r["schedule"], r["compressor"]) for r in runs] == [
        ("1f1b", "none"), ("1f1b", "int8"), ("pipedream", "none"), ("pipedream", "int8")]
    for r in runs:
        assert set(r["bytes_per_boundary"]) == {"fwd 0->1", "bwd 1->0"}
        assert 0 < r["bubble"] < 1 and math.isfinite(r["test_accuracy"])
    assert runs[1]["reduction_x"] >= 3.8
    # 4 steps x 2 micro-batches of 32 x 384 float32 activations forward and their gradients back
    assert runs[0]["bytes_per_step"] == 2 * 2 * 32 * 384 * 4
