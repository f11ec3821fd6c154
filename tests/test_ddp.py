"""The DDP communication hook on real 2-process gloo groups (gradcomp.launch).

Tolerance: every scenario trains a plain DDP model and a hooked DDP model
from the same initial parameters on the same data for 16 SGD steps; the
hooked model's parameters must stay within 2% (relative L2) of the plain
model's, and its last-step loss within 2% (int8 and fp16 with error feedback
change the averaged gradient by well under 1% per step). After every step
the parameters must be bit-identical across ranks and finite.
"""

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.launch import launch

from ddp_checks import residual_conservation_error

TIMEOUT = 120
STEPS = 16
PARAM_TOL = 0.02
LOSS_TOL = 0.02

_layouts: list = []
SCENARIOS = ("rebuild", "unused", "static_channels_last")
FAILING = ((0, 1), (1,))


def _recording_hook(state, bucket):
    """The gradcomp hook, recording which parameters each bucket holds."""
    _layouts.append((state.iter, bucket.index(), tuple(p.numel() for p in bucket.parameters())))
    return compressed_allreduce_hook(state, bucket)


class _Net(nn.Module):
    def __init__(self, conv=False, unused=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3) if conv else None
        self.body = nn.Sequential(nn.Linear(64 if conv else 12, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(),
                                  nn.Linear(32, 3))
        self.unused = nn.Linear(7, 7) if unused else None

    def forward(self, x):
        if self.conv is not None:
            x = self.conv(x).flatten(1)
        return self.body(x)


def _data(rank, step, conv):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(16, 3, 6, 6, generator=g) if conv else torch.randn(16, 12, generator=g)
    return x, torch.randint(0, 3, (16,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def _train(rank, models, steps, conv=False, accumulate=False, loss_allreduce=True):
    """Train each DDP model in ``models`` on the same data; check ranks agree after every step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    losses = [[] for _ in models]
    for step in range(steps):
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            if accumulate and step % 2 == 1:  # one micro-batch accumulated under no_sync
                with m.no_sync():
                    x, y = _data(rank, 1000 + step, conv)
                    nn.functional.cross_entropy(m(x), y).backward()
            x, y = _data(rank, step, conv)
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            if loss_allreduce:  # the user's own collective between DDP steps
                loss = loss.detach().clone()
                dist.all_reduce(loss)
            losses[i].append(float(loss.detach()) / (dist.get_world_size() if loss_allreduce else 1))
            p = _flat(m)
            assert bool(torch.isfinite(p).all()), f"non-finite parameters at step {step}"
            assert _same_on_all_ranks(p), f"ranks disagree at step {step} (model {i})"
    return losses


def _pair(rank, scenario):
    """A plain DDP model and a hooked one from the same initial parameters."""
    conv = scenario == "static_channels_last"
    kw = dict(conv=conv, unused=scenario == "unused")
    torch.manual_seed(0)
    ref = _Net(**kw)
    hooked = _Net(**kw)
    hooked.load_state_dict(ref.state_dict())
    if conv:
        ref = ref.to(memory_format=torch.channels_last)
        hooked = hooked.to(memory_format=torch.channels_last)
    ddp_kw = {
        "rebuild": dict(bucket_cap_mb=0.002),
        "unused": dict(find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=0.004),
        "static_channels_last": dict(static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=0.003),
    }[scenario]
    comp, algorithm = {
        "rebuild": (gc.Int8Quantizer(), "ring"),
        "unused": (gc.Int8Quantizer(block_size=64), "two_phase"),
        "static_channels_last": (gc.FP16(), "ring"),
    }[scenario]
    return ref, hooked, ddp_kw, comp, algorithm


def _scenario(rank, scenario):
    ref, hooked, ddp_kw, comp, algorithm = _pair(rank, scenario)
    ref = DDP(ref, **ddp_kw)
    hooked = DDP(hooked, **ddp_kw)
    meter = gc.TrafficMeter()
    state = GradCompState(compressor=comp, algorithm=algorithm, min_compress_numel=64, start_iter=0,
                          meter=meter, timeout=30)
    hooked.register_comm_hook(state, _recording_hook)
    losses = _train(rank, [ref, hooked], STEPS, conv=scenario == "static_channels_last",
                    accumulate=scenario == "rebuild")
    a, b = _flat(ref).double(), _flat(hooked).double()
    n_params = sum(p.numel() for p in hooked.parameters())
    first = [lay for lay in _layouts if lay[0] == 0]
    later = [lay for lay in _layouts if lay[0] == STEPS - 1]
    return {
        "param_err": float((a - b).norm() / a.norm()),
        "loss_ref": losses[0][-1], "loss_hook": losses[1][-1],
        "iter": state.iter, "steps": meter.steps,
        "ratio": meter.compression_ratio, "phases": sorted(meter.as_dict()["phases"]),
        "residual_numel": sum(r.numel() for r in state.residuals.values()), "n_params": n_params,
        "rebuilt": [lay[2] for lay in first] != [lay[2] for lay in later],
        "buckets": len(later),
    }


def _all_training(rank, world):
    """Every training scenario in one launch (DDP's first construction in a
    process imports torch._dynamo, which costs seconds)."""
    out = {}
    for scenario in SCENARIOS:
        _layouts.clear()
        out[scenario] = _scenario(rank, scenario)
    out["two_models"] = _two_models(rank)
    out["pickled"] = _pickled(rank)
    return out


@pytest.fixture(scope="module")
def trained():
    return launch(_all_training, 2, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hook_trains_like_plain_ddp(trained, scenario):
    res = [r[scenario] for r in trained]
    for r in res:
        assert r["param_err"] < PARAM_TOL, r
        assert abs(r["loss_hook"] - r["loss_ref"]) <= LOSS_TOL * r["loss_ref"], r
        assert r["iter"] == STEPS and r["steps"] == STEPS
        assert "reduce_scatter" in r["phases"] and "allgather" in r["phases"]
        assert r["ratio"] > 1.5  # int8 / fp16 on the wire
        assert 0 < r["residual_numel"] <= r["n_params"]  # bounded by the model size
        assert r["buckets"] > 1
    if scenario == "rebuild":
        assert res[0]["rebuilt"], "DDP did not rebuild its buckets: the scenario tests nothing"


def _two_models(rank):
    """Two DDP models, two states (int8 ring and top-k allgather), trained in turn."""
    torch.manual_seed(1)
    m1 = DDP(_Net(), bucket_cap_mb=0.002)
    m2 = DDP(_Net(unused=True), find_unused_parameters=True)
    s1 = GradCompState(compressor=gc.Int8Quantizer(), min_compress_numel=0, start_iter=1)
    s2 = GradCompState(compressor=gc.TopK(ratio=0.25), algorithm="allgather", min_compress_numel=0,
                       start_iter=1)
    m1.register_comm_hook(s1, compressed_allreduce_hook)
    m2.register_comm_hook(s2, compressed_allreduce_hook)
    losses = _train(rank, [m1, m2], 10)
    sizes1 = sorted(r.numel() for r in s1.residuals.values())
    sizes2 = sorted(r.numel() for r in s2.residuals.values())
    return (losses[0][-1] < losses[0][0], losses[1][-1] < losses[1][0], sizes1, sizes2,
            sorted(p.numel() for p in m1.parameters()), sorted(p.numel() for p in m2.parameters()))


@pytest.mark.slow
def test_two_models_two_states(trained):
    for ok1, ok2, sizes1, sizes2, p1, p2 in (r["two_models"] for r in trained):
        assert ok1 and ok2
        assert sizes1 == p1  # one residual per parameter, keyed per state
        assert sizes2 == p2


def _pickled(rank):
    # find_unused_parameters keeps DDP from rebuilding buckets, so the resumed
    # model sees the same bucket layout as the original one
    torch.manual_seed(2)
    net = _Net()
    model = DDP(net, find_unused_parameters=True)
    state = GradCompState(compressor=gc.Int8Quantizer(rounding="stochastic", seed=3), min_compress_numel=0,
                          start_iter=1, meter=gc.TrafficMeter())
    model.register_comm_hook(state, compressed_allreduce_hook)
    _train(rank, [model], 4, loss_allreduce=False)
    blob = pickle.dumps(state)
    snapshot = {k: v.clone() for k, v in net.state_dict().items()}
    restored = pickle.loads(blob)
    same_residuals = (set(restored.residuals) == set(state.residuals) and all(
        torch.equal(restored.residuals[k], state.residuals[k]) for k in state.residuals))
    checks = [restored.iter == state.iter == 4, same_residuals,
              restored.compressor.counter == state.compressor.counter > 0,
              restored.meter.as_dict() == state.meter.as_dict(),
              restored.process_group is None]
    # continuing with the original and with the restored state gives the same parameters
    _train(rank, [model], 2, loss_allreduce=False)
    net2 = _Net()
    net2.load_state_dict(snapshot)
    model2 = DDP(net2, find_unused_parameters=True)
    model2.register_comm_hook(restored, compressed_allreduce_hook)
    _train(rank, [model2], 2, loss_allreduce=False)
    checks.append(torch.equal(_flat(model), _flat(model2)))
    return checks


@pytest.mark.slow
def test_state_pickles_and_resumes(trained):
    for checks in (r["pickled"] for r in trained):
        assert all(checks), checks


class _Exploding(gc.Int8Quantizer):
    """Raises on the ranks in ``ranks`` from its ``after``-th compression on."""

    def __init__(self, ranks, after):
        super().__init__()
        self.ranks, self.after, self.calls = ranks, after, 0

    def compress(self, t):
        self.calls += 1
        if dist.get_rank() in self.ranks and self.calls > self.after:
            raise ValueError("injected compression failure")
        return super().compress(t)


def _halving_doubling(rank):
    """Plain DDP and the hook on halving-doubling (int8, 3 ranks: one folded in)."""
    ref, hooked, ddp_kw, _, _ = _pair(rank, "rebuild")
    ref, hooked = DDP(ref, **ddp_kw), DDP(hooked, **ddp_kw)
    meter = gc.TrafficMeter()
    state = GradCompState(compressor=gc.Int8Quantizer(), algorithm="halving_doubling", min_compress_numel=64,
                          start_iter=0, meter=meter, timeout=30)
    hooked.register_comm_hook(state, compressed_allreduce_hook)
    losses = _train(rank, [ref, hooked], STEPS, accumulate=True)
    a, b = _flat(ref).double(), _flat(hooked).double()
    state.close()
    return {"param_err": float((a - b).norm() / a.norm()), "loss_ref": losses[0][-1], "loss_hook": losses[1][-1],
            "phases": sorted(meter.as_dict()["phases"])}


def _sparse_reduce_scatter(rank, world):
    """The hook on the sparse reduce-scatter across a bucket rebuild: what every
    parameter gave equals what was applied plus the residuals (per parameter)."""
    torch.manual_seed(0)
    model = DDP(_Net(), bucket_cap_mb=0.002)
    state = GradCompState(compressor=gc.TopK(ratio=0.1), algorithm="sparse_reduce_scatter",
                          min_compress_numel=0, start_iter=0, timeout=30)
    given, applied = {}, {}

    def hook(st, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            given[id(p)] = given.get(id(p), 0) + g.detach().double().reshape(-1)
        _layouts.append((st.iter, bucket.index(), tuple(p.numel() for p in bucket.parameters())))

        def record(fut):
            for p, g in zip(bucket.parameters(), bucket.gradients()):  # views of the reduced buffer
                applied[id(p)] = applied.get(id(p), 0) + g.detach().double().reshape(-1) * world
            return fut.value()
        return compressed_allreduce_hook(st, bucket).then(record)

    model.register_comm_hook(state, hook)
    _layouts.clear()
    losses = _train(rank, [model], STEPS)[0]
    state.close()
    err = residual_conservation_error(state, model, given, applied)
    first = [lay[2] for lay in _layouts if lay[0] == 0]
    later = [lay[2] for lay in _layouts if lay[0] == STEPS - 1]
    return {"err": err, "residual_numel": sum(r.numel() for r in state.residuals.values()),
            "n_params": sum(p.numel() for p in model.parameters()), "rebuilt": first != later,
            "loss_first": losses[0], "loss_last": losses[-1]}


def _new_algorithms(rank, world):
    return {"halving_doubling": _halving_doubling(rank), "sparse_reduce_scatter": _sparse_reduce_scatter(rank, world)}


@pytest.fixture(scope="module")
def new_algorithms():
    return launch(_new_algorithms, 3, timeout=TIMEOUT)


@pytest.mark.slow
def test_hook_on_halving_doubling_trains_like_plain_ddp(new_algorithms):
    res = [r["halving_doubling"] for r in new_algorithms]
    for r in res:
        assert r["param_err"] < PARAM_TOL, r
        assert abs(r["loss_hook"] - r["loss_ref"]) <= LOSS_TOL * r["loss_ref"], r
    # world 3: rank 0 is folded into rank 1, ranks 1 and 2 halve and double
    assert res[0]["phases"] == ["agreement", "fold"], res[0]
    assert res[1]["phases"] == ["agreement", "allgather", "fold", "reduce_scatter"], res[1]
    assert res[2]["phases"] == ["agreement", "allgather", "reduce_scatter"], res[2]


@pytest.mark.slow
def test_hook_on_the_sparse_reduce_scatter_loses_nothing_across_a_rebuild(new_algorithms):
    for r in (res["sparse_reduce_scatter"] for res in new_algorithms):
        assert r["rebuilt"], "DDP did not rebuild its buckets: the scenario tests nothing"
        # float32 sums in the collective: equal up to their rounding
        assert r["err"] < 1e-5, r
        assert r["residual_numel"] == r["n_params"], r
        assert r["loss_last"] < r["loss_first"], r


def _error_in_training(rank, state, steps):
    """(exception type, message) of training a DDP model with ``state``'s hook, or "no error"."""
    torch.manual_seed(3)
    model = DDP(_Net())
    model.register_comm_hook(state, compressed_allreduce_hook)
    try:
        _train(rank, [model], steps, loss_allreduce=False)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _failing(rank, ranks):
    state = GradCompState(compressor=_Exploding(ranks, after=6), min_compress_numel=0, start_iter=1,
                          timeout=3)
    return _error_in_training(rank, state, 20)


def _mismatched_settings(rank):
    comp = gc.Int8Quantizer() if rank == 0 else gc.Int8Quantizer(block_size=64)
    state = GradCompState(compressor=comp, min_compress_numel=0, start_iter=0, timeout=30)
    return _error_in_training(rank, state, 3)


def _all_failures(rank, world):
    # each case has its own state, so its own process group: a broken one does not leak
    out = {ranks: _failing(rank, ranks) for ranks in FAILING}
    out["settings"] = _mismatched_settings(rank)
    return out


@pytest.fixture(scope="module")
def failures():
    return launch(_all_failures, 2, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", FAILING)
def test_comm_thread_error_surfaces_in_training(failures, ranks):
    res = [r[ranks] for r in failures]
    for rank, (kind, msg) in enumerate(res):
        assert kind != "no error", res
        if rank in ranks:
            assert "injected compression failure" in msg, res
        else:  # its peer stopped talking: a timeout, not a hang
            assert "did not finish" in msg or "failed" in msg, res


@pytest.mark.slow
def test_ranks_with_different_settings_fail_in_training(failures):
    # the first bucket checks the state's settings: every rank raises (DDP wraps the
    # hook's ValueError in a RuntimeError), none aborts or hangs
    for kind, msg in (r["settings"] for r in failures):
        assert "ValueError: gradcomp.ddp.GradCompState: the ranks of the group passed different compressor" \
            in msg, (kind, msg)
        assert "rank 1: Int8Quantizer(block_size=64" in msg, msg


def test_state_validation():
    cases = [
        (dict(compressor="int8"), TypeError, "compressor must be a gradcomp compressor"),
        (dict(compressor=gc.ErrorFeedback(gc.Int8Quantizer())), ValueError, "must not be an ErrorFeedback"),
        (dict(algorithm="tree"), ValueError, "algorithm must be one of"),
        (dict(compressor=gc.TopK(ratio=0.1)), ValueError, "needs a dense compressor"),
        (dict(algorithm="allgather"), ValueError, "is for sparse compressors"),
        (dict(algorithm="sparse_reduce_scatter"), ValueError, "is for sparse compressors"),
        (dict(compressor=gc.TopK(ratio=0.1), algorithm="halving_doubling"), ValueError, "needs a dense compressor"),
        (dict(compressor=gc.TopK(k=5), algorithm="sparse_reduce_scatter"), ValueError, "exact TopK with a ratio"),
        (dict(compressor=gc.TopK(ratio=0.1), algorithm="sparse_reduce_scatter", dgc=True), ValueError,
         "DGC .* needs algorithm='allgather'"),
        (dict(compressor="auto", algorithm="halving_doubling"), ValueError, "algorithm must be one of"),
        (dict(min_compress_numel=-1), ValueError, "min_compress_numel must be >= 0"),
        (dict(start_iter=1.5), TypeError, "start_iter must be an int"),
        (dict(error_feedback="yes"), TypeError, "error_feedback must be a bool"),
        (dict(meter={}), TypeError, "meter must be a gradcomp.TrafficMeter"),
        (dict(timeout=0), ValueError, "timeout must be > 0"),
    ]
    assert not dist.is_initialized()
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            GradCompState(**kwargs)
    # before init_process_group (a trainer such as Lightning starts it later): the group comes at the first bucket
    assert GradCompState()._group is None
