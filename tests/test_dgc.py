"""Deep Gradient Compression (gc.DGC): momentum correction, masking, warm-up,
clipping, the optimizer contract, state, the kernel, and the DDP hook / PS paths."""

import functools
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp import kernels
from gradcomp.compressors import check_optimizer
from gradcomp.launch import launch


def test_momentum_correction_two_steps_by_hand():
    # m = 0.5, k = 1. Step 1: u = g1 = [1, 2, -4], v = u; top-1 of v is -4 (index 2):
    # sent [0, 0, -4]; u, v zeroed there: u = v = [1, 2, 0].
    # Step 2: u = 0.5 [1, 2, 0] + [2, 1, 1] = [2.5, 2, 1]; v = [1, 2, 0] + u = [3.5, 4, 1];
    # top-1 is 4 (index 1): sent [0, 4, 0]; u = [2.5, 0, 1], v = [3.5, 0, 1].
    d = gc.DGC(gc.TopK(k=1), momentum=0.5)
    p = d.compress(torch.tensor([1.0, 2.0, -4.0]), key="w")
    assert torch.equal(d.decompress(gc.decode(p.wire)), torch.tensor([0.0, 0.0, -4.0]))
    assert torch.equal(d.momenta["w"], torch.tensor([1.0, 2.0, 0.0]))
    assert torch.equal(d.residuals["w"], torch.tensor([1.0, 2.0, 0.0]))
    p = d.compress(torch.tensor([2.0, 1.0, 1.0]), key="w")
    assert torch.equal(d.decompress(p), torch.tensor([0.0, 4.0, 0.0]))
    assert torch.equal(d.momenta["w"], torch.tensor([2.5, 0.0, 1.0]))
    assert torch.equal(d.residuals["w"], torch.tensor([3.5, 0.0, 1.0]))
    assert d.steps["w"] == 2


@pytest.mark.parametrize("masking", [True, False])
def test_masking_zeroes_exactly_the_sent_coordinates(masking):
    torch.manual_seed(0)
    d = gc.DGC(gc.TopK(ratio=0.05), momentum=0.9, momentum_masking=masking)
    d.compress(torch.randn(1000), key=0)
    u0, v0 = d.momenta[0].clone(), d.residuals[0].clone()
    g = torch.randn(1000)
    p = d.compress(g, key=0)
    sent = p.indices.long()
    u_hand = u0 * 0.9 + g  # float32, the same two roundings
    v_hand = v0 + u_hand
    # the sent values are the accumulated velocity there, and they are the top 5% of it
    assert torch.equal(p.values.data, v_hand[sent])
    assert set(sent.tolist()) == set(v_hand.abs().topk(50).indices.tolist())
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[sent] = True
    assert bool((d.residuals[0][mask] == 0).all()) and torch.equal(d.residuals[0][~mask], v_hand[~mask])
    if masking:
        assert bool((d.momenta[0][mask] == 0).all())
        assert torch.equal(d.momenta[0][~mask], u_hand[~mask]) and bool((u_hand[~mask] != 0).all())
    else:
        assert torch.equal(d.momenta[0], u_hand)


def test_bucket_segments_select_their_own_top_k():
    # as the paper selects per layer: a bucket of two parameters (20 and 30 elements)
    # sends ceil(0.1 * 20) = 2 and ceil(0.1 * 30) = 3 values, though the second's are tiny
    d = gc.DGC(gc.TopK(ratio=0.1), momentum=0.0)
    g = torch.cat([10.0 + torch.arange(20.0), 0.01 * torch.arange(30.0)])
    u, r = torch.zeros(50), torch.zeros(50)
    p = d.bind(u, r, 0, [(0, 20), (20, 30)]).compress(g)
    assert p.indices.tolist() == [18, 19, 47, 48, 49]
    assert torch.equal(gc.decode(p.wire).values.data, g[[18, 19, 47, 48, 49]])
    assert r[[18, 19, 47, 48, 49]].abs().sum() == 0 and torch.equal(r[:18], g[:18])


def test_int8_values_leave_their_quantization_error_in_the_residual():
    torch.manual_seed(1)
    d = gc.DGC(gc.TopK(ratio=0.1, values=gc.Int8Quantizer(block_size=32)), momentum=0.0)
    g = torch.randn(640)
    p = d.compress(g, key=0)
    sent = p.indices.long()
    dec = gc.Int8Quantizer(block_size=32).decompress(p.values)
    assert torch.equal(d.residuals[0][sent], g[sent] - dec)
    assert bool((d.momenta[0][sent] == 0).all())


def test_warmup_density_schedule():
    # final density 0.25 / 256: the stages are exact powers of 4 (the paper's 25% -> 6.25% -> ...)
    d = gc.DGC(gc.TopK(ratio=0.25 / 256), warmup_steps=8)
    n = 2**20
    assert [d.density(s, n) for s in range(10)] == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625,
                                                    0.00390625, 0.00390625, 0.0009765625, 0.0009765625]
    assert [d.k_at(s, n) for s in (0, 2, 7, 8)] == [262144, 65536, 4096, 1024]
    # the default: 0.1% after 4 stages of 25 steps, each 0.004 ** (1/4) = 0.2515 of the one before
    d = gc.DGC(gc.TopK(ratio=0.001), warmup_steps=100)
    n = 10**6
    want = [0.25, 0.25 * 0.004 ** 0.25, 0.25 * 0.004 ** 0.5, 0.25 * 0.004 ** 0.75, 0.001]
    got = [d.k_at(s, n) for s in (0, 25, 50, 75, 100)]
    assert got == [math.ceil(w * n) for w in want] == [250000, 62872, 15812, 3977, 1000]
    assert d.k_at(10**9, n) == 1000
    # no warm-up; a start below the final density; a tiny tensor keeps at least the final k
    assert gc.DGC(gc.TopK(ratio=0.01)).k_at(0, 1000) == 10
    assert gc.DGC(gc.TopK(ratio=0.5), warmup_steps=10, warmup_start=0.25).k_at(0, 100) == 50
    assert gc.DGC(gc.TopK(k=3), warmup_steps=4).k_at(0, 4) == 3


def test_warmup_is_applied_per_step():
    d = gc.DGC(gc.TopK(ratio=0.01), warmup_steps=2, warmup_stages=2, warmup_start=0.5)
    sizes = [d.compress(torch.randn(1000), key="a").nnz for _ in range(3)]
    assert sizes == [500, math.ceil(0.5 * (0.02 ** 0.5) * 1000), 10]


def test_local_clipping_norm():
    g = torch.zeros(100)
    g[:4] = 5.0  # ||g|| = 10
    # clip_norm 2 over 4 workers: the local threshold is 2 / sqrt(4) = 1
    d = gc.DGC(gc.TopK(ratio=1.0), momentum=0.9, clip_norm=2.0, world_size=4, momentum_masking=False)
    assert d.local_clip_norm == 1.0
    d.compress(g, key=0)
    u = d.momenta[0].double()
    assert abs(float(u.norm()) - 10 / (10 + 1e-6)) < 1e-6
    assert torch.allclose(u[:4], torch.full((4,), 5.0 / (10 + 1e-6), dtype=torch.float64), rtol=1e-6)
    # a gradient under the threshold is left as it is
    d = gc.DGC(gc.TopK(ratio=1.0), momentum=0.9, clip_norm=100.0, world_size=4, momentum_masking=False)
    d.compress(g, key=0)
    assert torch.equal(d.momenta[0], g)


def _train(opt_momentum, dgc, steps=6):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=opt_momentum)
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 2, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if dgc is not None:
            for name, p in model.named_parameters():
                p.grad = dgc.decompress(gc.decode(dgc.compress(p.grad, key=name).wire))
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_density_one_without_clipping_is_momentum_sgd():
    reference = _train(0.9, None)
    dgc = gc.DGC(gc.TopK(ratio=1.0), momentum=0.9, momentum_masking=False)
    assert torch.equal(_train(0.0, dgc), reference)
    # with masking every coordinate is sent and masked each step: plain SGD
    masked = gc.DGC(gc.TopK(ratio=1.0), momentum=0.9)
    assert torch.equal(_train(0.0, masked), _train(0.0, None))


def test_check_optimizer():
    p = [nn.Parameter(torch.zeros(2))]
    check_optimizer(torch.optim.SGD(p, lr=0.1))
    check_optimizer(functools.partial(torch.optim.SGD, lr=0.1, weight_decay=1e-4))
    with pytest.raises(ValueError, match="momentum=0.9.*gc.DGC"):
        check_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="plain SGD"):
        check_optimizer(functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5))
    with pytest.warns(UserWarning, match="Adam"):
        check_optimizer(torch.optim.Adam(p))
    with pytest.raises(TypeError, match="optimizer"):
        check_optimizer(3)


def test_bad_arguments():
    with pytest.raises(TypeError, match="TopK"):
        gc.DGC(gc.Int8Quantizer())
    for kw, match in (({"momentum": 1.0}, "momentum"), ({"clip_norm": 0.0}, "clip_norm"),
                      ({"warmup_start": 0.0}, "warmup_start"), ({"warmup_steps": -1}, "warmup_steps"),
                      ({"warmup_stages": 0}, "warmup_stages"), ({"world_size": 0}, "world_size")):
        with pytest.raises(ValueError, match=match):
            gc.DGC(gc.TopK(ratio=0.1), **kw)
    with pytest.raises(TypeError, match="momentum_masking"):
        gc.DGC(gc.TopK(ratio=0.1), momentum_masking=1)
    d = gc.DGC(gc.TopK(ratio=0.1))
    d.compress(torch.randn(10), key="a")
    with pytest.raises(ValueError, match="one key per tensor"):
        d.compress(torch.randn(11), key="a")
    with pytest.raises(ValueError, match="out="):
        d.compress(torch.randn(10), key="b", out=torch.empty(10, dtype=torch.uint8))


def test_nonfinite_gradient_resets_the_state():
    d = gc.DGC(gc.TopK(k=1))
    d.compress(torch.tensor([1.0, 2.0, 3.0]), key=0)
    g = torch.tensor([float("nan"), 0.0, 0.0])
    p = d.compress(g, key=0)
    assert torch.isnan(d.decompress(p)).any()  # the payload shows it (AMP skips the step)
    assert d.nonfinite_resets == 1 and not bool(d.momenta[0].any()) and not bool(d.residuals[0].any())


def test_state_dict_round_trip():
    torch.manual_seed(5)
    d = gc.DGC(gc.TopK(ratio=0.1), warmup_steps=3)
    for _ in range(2):
        d.compress(torch.randn(50), key="a")
    state = pickle.loads(pickle.dumps(d.state_dict()))
    e = gc.DGC(gc.TopK(ratio=0.1), warmup_steps=3)
    e.load_state_dict(state)
    g = torch.randn(50)
    assert torch.equal(d.compress(g, key="a").wire, e.compress(g, key="a").wire)
    assert e.steps["a"] == 3 and d.residual_nbytes() == 2 * 50 * 4
    bad = dict(state, momenta={})
    with pytest.raises(ValueError, match="momenta"):
        e.load_state_dict(bad)
    # a bad velocity is named as one (it was reported as state['residuals'][...])
    nan = torch.full((50,), float("nan"))
    with pytest.raises(ValueError, match=r"state\['momenta'\]\['a'\] holds NaN or Inf"):
        e.load_state_dict(dict(state, momenta={"a": nan}))
    with pytest.raises(TypeError, match=r"state\['momenta'\]\['a'\] must be a floating tensor holding data"):
        e.load_state_dict(dict(state, momenta={"a": torch.zeros(50, device="meta")}))
    assert e.steps["a"] == 3 and torch.equal(e.momenta["a"], d.momenta["a"])  # unchanged


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_accumulate_kernel_matches_reference(scale):
    torch.manual_seed(6)
    n = 100_003
    g, u, v = torch.randn(n), torch.randn(n), torch.randn(n)
    outs = []
    for backend in ("cpu", "reference"):
        uu, vv = u.clone(), v.clone()
        kernels.dgc_accumulate_(g, uu, vv, 0.9, scale, backend=backend)
        outs.append((uu, vv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    want_u = u * 0.9 + (g if scale == 1.0 else g * scale)
    assert torch.equal(outs[0][0], want_u) and torch.equal(outs[0][1], v + want_u)
    # fused with the top-k of v: the same state and selection as the two ops
    for k in (1, 100, 5000):
        outs = []
        for backend in ("cpu", "reference"):
            uu, vv = u.clone(), v.clone()
            outs.append((*kernels.dgc_topk_(g, uu, vv, 0.9, scale, k, backend=backend), uu, vv))
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        assert torch.equal(outs[0][0], kernels.topk(outs[0][3], k)[0])
    with pytest.raises(TypeError, match="float32"):
        kernels.dgc_accumulate_(g.double(), u, v, 0.9)
    with pytest.raises(ValueError, match="elements"):
        kernels.dgc_accumulate_(g, u[:-1], v, 0.9)


def test_ps_config_enforces_the_optimizer_contract():
    dgc = gc.DGC(gc.TopK(ratio=0.01))
    with pytest.raises(ValueError, match="explicit plain-SGD"):
        gc.ps.PSConfig(compressor=dgc)
    with pytest.raises(ValueError, match="plain SGD"):
        gc.ps.PSConfig(compressor=dgc, optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    cfg = gc.ps.PSConfig(compressor=dgc, optimizer=functools.partial(torch.optim.SGD, lr=0.1), compress_pull=True)
    assert isinstance(cfg.server_pull_compressor(), gc.TopK)


# ---- multi-process: the DDP hook and the parameter server ------------------------------

def _ddp_dgc(rank, world_size, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
    plain = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
    plain.load_state_dict(model.state_dict())
    ddp, ref = DDP(model), DDP(plain)
    if mode == "dense":  # density 1, no masking: momentum SGD, the hook owning the momentum
        dgc = gc.DGC(gc.TopK(ratio=1.0), momentum=0.9, momentum_masking=False)
        state = gc.ddp.GradCompState(compressor=dgc, algorithm="allgather", min_compress_numel=0, start_iter=2)
    else:
        state = gc.ddp.GradCompState(compressor=gc.TopK(ratio=0.01), dgc=True, algorithm="allgather",
                                     min_compress_numel=100, start_iter=1)
    assert state.dgc.world_size == world_size
    ddp.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    check_optimizer(opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(8):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)
        for m, o in ((ddp, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    state.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    restored = pickle.loads(pickle.dumps(state))
    state.close()
    return {"same": all(torch.equal(t, flat) for t in gathered), "err": float((flat - want).norm() / want.norm()),
            "momenta": len(restored.momenta), "dgc": repr(restored.dgc), "finite": bool(torch.isfinite(flat).all())}


@pytest.mark.slow
def test_ddp_hook_with_dgc():
    for mode in ("dense", "sparse"):
        out = launch(_ddp_dgc, 2, args=(mode,), timeout=120)
        assert all(o["same"] and o["finite"] and o["momenta"] == 4 for o in out)
        assert out[0]["dgc"].startswith("DGC(TopK(")
        if mode == "dense":
            # bit for bit it differs only by the order of float32 sums (mean of
            # the two ranks' velocities vs momentum of the mean gradient)
            assert out[0]["err"] < 1e-5
        else:
            assert out[0]["err"] < 0.5  # trains, near the reference after 8 steps of 1%


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _loss(model, step, worker):
    g = torch.Generator().manual_seed(100 * worker + step)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _ps_dgc(rank, world_size, config):
    out = gc.ps.run(rank, world_size, _model, _loss, config)
    if out["role"] == "worker":
        return {"losses": out["losses"], "push": out["stats"]["traffic"]["phases"]["push"]["bytes_sent"]}
    return {"updates": out["stats"]["updates"]}


@pytest.mark.slow
def test_parameter_server_push_with_dgc():
    steps = 12
    config = gc.ps.PSConfig(mode="async", steps=steps, compressor=gc.DGC(gc.TopK(ratio=0.1), world_size=2),
                            optimizer=functools.partial(torch.optim.SGD, lr=0.05), timeout=60, worker_timeout=60)
    out = launch(_ps_dgc, 3, args=(config,), timeout=120)
    assert out[0]["updates"] == 2 * steps
    raw = 4 * sum(p.numel() for p in _model().parameters())
    for w in out[1:]:
        assert all(math.isfinite(x) for x in w["losses"])
        assert w["push"] < steps * raw / 3  # top-10% payloads, not float32
