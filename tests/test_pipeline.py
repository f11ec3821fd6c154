"""Pipeline parallelism: the engine's schedules on gradcomp stages, the measured
bubble, PipeDream's weight stashing, compressed boundaries, the CLI's checks."""

import math

import pytest
import torch
from torch import nn

from gradcomp.launch import launch
from gradcomp.pipeline import BoundaryCodec, analyze, split_sequential
from gradcomp.pipeline.synthetic import run_fixed_time
from gradcomp.train.model import make_model
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
def test_gpipe_matches_gradient_accumulation():
    hidden, m, steps, lr = (32, 24), 4, 3, 0.2
    torch.manual_seed(3)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    got = launch(F.engine_steps, 2, (["gpipe"], hidden, x, y, m, steps, lr), timeout=90)
    ref = _accumulated(hidden, x, y, m, steps, lr)
    _check_stages(ref, 2, [g[0]["gpipe"] for g in got])
    assert not torch.equal(ref[0].weight, make_model(0, hidden)[0].weight)  # it trained


@pytest.mark.slow
def test_other_engine_schedules_match_and_int8_boundaries_decode_within_the_bound():
    hidden, m, steps, lr = (32, 24, 16), 4, 2, 0.2  # 4 layers: 2 ranks x 2 stages
    torch.manual_seed(4)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    scheds = ["1f1b", "interleaved", "zb"]
    got = launch(F.engine_steps, 2, (scheds, hidden, x, y, m, steps, lr), timeout=120)
    ref = _accumulated(hidden, x, y, m, steps, lr)
    _check_stages(ref, 2, [g[0]["1f1b"] for g in got])
    _check_stages(ref, 4, [g[0]["interleaved"] for g in got])
    _check_stages(ref, 4, [g[0]["zb"] for g in got])
    # int8 boundaries under 1F1B: what stage 1 decoded is stage 0's exact output within the bound
    got = launch(F.engine_steps, 2, (["1f1b"], hidden, x, y, m, 1, lr, True), timeout=90)
    parts = split_sequential(make_model(0, hidden), 2)
    for i, (xm, dec) in enumerate(zip(x.chunk(m), got[1][1]["1f1b"][1])):
        exact = parts[0](xm).detach().reshape(-1).double()
        dec = dec.reshape(-1).double()
        assert not torch.equal(dec, exact)  # it was compressed
        for start in range(0, exact.numel(), 256):
            block = exact[start:start + 256]
            assert (dec[start:start + 256] - block).abs().max() <= block.abs().max() / 254 * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 4])
def test_measured_bubble_of_sleep_stages_matches_gpipe_formula(m):
    p, fwd_s, bwd_s = 2, 0.05, 0.05
    steps = 5
    tls = launch(run_fixed_time, p, ("gpipe", m, steps, fwd_s, bwd_s), timeout=90)
    # per step (the first left out as warm-up); the median keeps a step that the
    # host's other load delayed from deciding the result
    per_step = [analyze(tls, steps=[i]) for i in range(1, steps)]
    bubble = sorted(r["bubble"] for r in per_step)[len(per_step) // 2 - 1: len(per_step) // 2 + 1]
    assert abs(sum(bubble) / 2 - (p - 1) / (m + p - 1)) <= 0.05
    for res in per_step:  # every stage computed m forwards (and backwards) per step
        for r in res["per_rank"]:
            assert r["forward"] == pytest.approx(m * fwd_s, rel=0.25)


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
    from gradcomp.train.command import main

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
