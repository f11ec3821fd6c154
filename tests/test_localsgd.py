"""gc.LocalSGD (local SGD, DiLoCo, Streaming DiLoCo) on a real 3-process gloo group.

Every multi-process scenario runs in one launch (module fixture) and returns
plain numbers; the tests compare them with values derived independently: a
DDP run, a hand-written float64 Nesterov update, the error-feedback
telescoping sum, the schedule written out by hand and the wire sizes of
gradcomp.wire's documented format.
"""

import copy
import functools
import math
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.comm.agreement import SIGNATURE_NBYTES
from gradcomp.launch import launch

WORLD = 3
TIMEOUT = 120
HEADER = 48  # wire header of a 1-D payload: 40 + 8 * ndim bytes


def _model(seed=0):
    torch.manual_seed(seed)
    # 300 + 30 + 90 + 3 = 423 parameters (divisible by WORLD)
    return nn.Sequential(nn.Linear(10, 30), nn.Tanh(), nn.Linear(30, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def _flat(model, dtype=torch.float32):
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in model.parameters()])


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _identical(t):
    return all(torch.equal(t, o) for o in _gather(t))


def _train(model, opt, ls, steps, start=0, before=None, after=None):
    rank = dist.get_rank()
    for t in range(start + 1, start + steps + 1):
        x, y = _batch(rank, t)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if before is not None:
            before(t)
        ls.step()
        if after is not None:
            after(t)


def _ddp_equivalence(rank):
    """H=1, NoCompression, averaging against DDP's averaged SGD (momentum 0.9)."""
    a = _model()
    b = copy.deepcopy(a)
    ls = gc.LocalSGD(a, sync_every=1, compressor=gc.NoCompression())
    ddp = DDP(b)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for t in range(1, 11):
        x, y = _batch(rank, t)
        for model, opt in ((a, opt_a), (ddp, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        ls.step()
    ls.close()
    return {"diff": float((_flat(a) - _flat(b)).abs().max()),
            "moved": float((_flat(a) - _flat(_model())).abs().max()),
            "identical": _identical(_flat(a))}


def _diloco(rank):
    """Outer Nesterov step against a float64 hand-written update."""
    model = _model()
    ls = gc.LocalSGD(model, sync_every=2, compressor=gc.NoCompression(), outer_optimizer="nesterov")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    anchor = _flat(model, torch.float64)
    buf = torch.zeros_like(anchor)
    errs = []

    def before(t):
        nonlocal anchor, buf
        if t % 2 == 0:
            mean = torch.stack(_gather(_flat(model, torch.float64))).mean(0)
            g = anchor - mean
            buf = 0.9 * buf + g
            anchor = anchor - 0.7 * (g + 0.9 * buf)

    def after(t):
        if t % 2 == 0:
            errs.append(float((_flat(model, torch.float64) - anchor).abs().max()))

    _train(model, opt, ls, 6, before=before, after=after)
    ls.close()
    return {"errs": errs, "scale": float(anchor.abs().max())}


def _telescoping(rank):
    """N (anchor_0 - anchor_T) + sum_r residual_r == sum_r sum_t delta_{r,t} (top-k, allgather)."""
    model = _model()
    ls = gc.LocalSGD(model, sync_every=3, compressor=gc.TopK(ratio=0.05))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    anchor0 = _flat(model, torch.float64)
    prev = anchor0.clone()
    total = torch.zeros_like(anchor0)

    def before(t):
        nonlocal total
        if t % 3 == 0:
            total += prev - _flat(model, torch.float64)

    def after(t):
        nonlocal prev
        if t % 3 == 0:
            prev = _flat(model, torch.float64)

    _train(model, opt, ls, 15, before=before, after=after)
    residual = ls.state_dict()["residuals"][0].to(torch.float64)
    ls.close()
    lhs_no_ef = WORLD * (anchor0 - _flat(model, torch.float64))
    lhs = lhs_no_ef + sum(_gather(residual))
    rhs = sum(_gather(total))
    return {"err": float((lhs - rhs).abs().max()), "err_no_ef": float((lhs_no_ef - rhs).abs().max()),
            "algorithm": ls.algorithm}


def _streaming(rank):
    """F=2 fragments, H=6, overlap 2: each parameter synced once per 6 steps,
    with the update computed from the parameters 2 steps earlier."""
    model = _model()
    ls = gc.LocalSGD(model, sync_every=6, compressor=gc.NoCompression(), fragments=2, overlap=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    frag_of = {id(p): i for i, ps in enumerate(ls.parameter_fragments) for p in ps}
    identical_at = {i: [] for i in range(len(params))}
    started = {}
    stale_err, threads = [], []

    def before(t):
        f = ls.fragment_due(t)
        if f is not None:  # the expected new anchor: the mean of the parameters now
            started[f] = [torch.stack(_gather(p.detach().clone())).mean(0) for p in ls.parameter_fragments[f]]

    def after(t):
        if ls.fragment_due(t) is not None:
            threads.append(any(th.name.startswith("gradcomp-localsgd") for th in threading.enumerate()))
        for i, p in enumerate(params):
            if _identical(p.detach()):
                identical_at[i].append(t)
        for f in (0, 1):
            if t - 2 >= 1 and ls.fragment_due(t - 2) == f:
                stale_err.append(max(float((p.detach() - m).abs().max())
                                     for p, m in zip(ls.parameter_fragments[f], started[f])))

    _train(model, opt, ls, 14, before=before, after=after)
    ls.close()
    return {"identical_at": [identical_at[i] for i in range(len(params))],
            "fragment_of": [frag_of[id(p)] for p in params], "syncs": ls.syncs,
            "stale_err": stale_err, "threads": threads}


def _bitwise(rank):
    """Bit-identical parameters after every sync, different ones between syncs."""
    out = {}
    for name, comp, outer in (("int8-nesterov", gc.Int8Quantizer(), "nesterov"),
                              ("topk-int8", gc.TopK(ratio=0.05, values=gc.Int8Quantizer()), None)):
        model = _model()
        ls = gc.LocalSGD(model, sync_every=2, compressor=comp, outer_optimizer=outer)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        res = []
        _train(model, opt, ls, 6, after=lambda t: res.append((t, _identical(_flat(model)))))
        ls.close()
        out[name] = res
    return out


def _bytes(rank):
    out = {}
    for name, h, frags, steps in (("single", 2, 1, 6), ("fragments", 4, 2, 8)):
        model = _model()
        meter = gc.TrafficMeter()
        ls = gc.LocalSGD(model, sync_every=h, compressor=gc.Int8Quantizer(), meter=meter, fragments=frags)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(model, opt, ls, steps)
        ls.close()
        out[name] = {"meter": meter.as_dict(),
                     "sizes": [sum(p.numel() for p in ps) for ps in ls.parameter_fragments]}
    return out


def _roundtrip(rank):
    """Checkpoint at step 6 (an exchange in flight), resume in fresh objects."""
    def build(seed):
        model = _model(seed)
        ls = gc.LocalSGD(model, sync_every=4, compressor=gc.Int8Quantizer(rounding="stochastic"),
                         outer_optimizer="nesterov", fragments=2, overlap=1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ls

    model, opt, ls = build(0)
    _train(model, opt, ls, 6)
    pending = ls.pending_fragment == 0
    ckpt = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), ls.state_dict())
    _train(model, opt, ls, 6, start=6)
    ls.close()
    ref = _flat(model)
    model2, opt2, ls2 = build(1)
    model2.load_state_dict(ckpt[0])
    opt2.load_state_dict(ckpt[1])
    ls2.load_state_dict(ckpt[2])
    _train(model2, opt2, ls2, 6, start=6)
    ls2.close()
    rejected = []
    for kwargs in ({"sync_every": 8, "fragments": 2}, {"sync_every": 4, "fragments": 2, "overlap": 1}):
        other = gc.LocalSGD(_model(), compressor=gc.Int8Quantizer(), **kwargs)  # averaging / other H
        try:
            other.load_state_dict(ckpt[2])
        except ValueError as e:
            rejected.append(str(e))
    return {"pending": pending, "equal": torch.equal(ref, _flat(model2)),
            "steps": (ls.steps, ls2.steps), "syncs": (ls.syncs, ls2.syncs), "rejected": rejected}


def _outer_factory(rank):
    """A factory for the outer optimizer: the same trajectory as "nesterov", bit for bit."""
    finals = []
    for outer in ("nesterov", functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)):
        model = _model()
        ls = gc.LocalSGD(model, sync_every=2, compressor=gc.Int8Quantizer(), outer_optimizer=outer)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), ls, 6)
        ls.close()
        finals.append(_flat(model))
    try:
        gc.LocalSGD(_model(), sync_every=2, outer_optimizer=lambda params: "adam")
        error = None
    except TypeError as e:
        error = str(e)
    return {"equal": torch.equal(*finals), "error": error}


def _all(rank, world):
    torch.manual_seed(0)
    return {name: fn(rank) for name, fn in (
        ("ddp", _ddp_equivalence), ("diloco", _diloco), ("telescoping", _telescoping),
        ("streaming", _streaming), ("bitwise", _bitwise), ("bytes", _bytes), ("roundtrip", _roundtrip),
        ("outer_factory", _outer_factory))}


@pytest.fixture(scope="module")
def runs():
    return launch(_all, WORLD, timeout=TIMEOUT)


@pytest.mark.slow
def test_h1_averaging_equals_ddp_sgd(runs):
    for r in runs:
        d = r["ddp"]
        assert d["diff"] <= 1e-6 and d["moved"] > 1e-2 and d["identical"], d


@pytest.mark.slow
def test_diloco_outer_step_is_nesterov(runs):
    for r in runs:
        d = r["diloco"]
        assert len(d["errs"]) == 3 and max(d["errs"]) <= 1e-6 * max(1.0, d["scale"]), d


@pytest.mark.slow
def test_pseudo_gradient_error_feedback_telescopes(runs):
    for r in runs:
        d = r["telescoping"]
        assert d["algorithm"] == "allgather"
        assert d["err"] <= 1e-5, d
        assert d["err_no_ef"] > 100 * 1e-5, d  # the residuals hold real mass


@pytest.mark.slow
def test_streaming_syncs_each_parameter_once_per_h(runs):
    for r in runs:
        d = r["streaming"]
        # fragment 0 starts after steps 3, 9 and lands 2 steps later; fragment 1 after 6, 12
        expected = {0: [5, 11], 1: [8, 14]}
        assert sorted(set(d["fragment_of"])) == [0, 1]
        for frag, at in zip(d["fragment_of"], d["identical_at"]):
            assert at == expected[frag], d
        assert d["syncs"] == 4
        assert d["stale_err"] and max(d["stale_err"]) <= 1e-6, d  # the update of step t, applied at t + 2
        assert all(d["threads"]), d


@pytest.mark.slow
def test_ranks_bit_identical_after_each_sync(runs):
    for r in runs:
        for name, res in r["bitwise"].items():
            assert [same for t, same in res] == [t % 2 == 0 for t, _ in res], (name, res)


def _int8_nbytes(m):
    return HEADER + m + 4 * math.ceil(m / 256)


def _ring_sent(n, rank):
    """Int8 ring allreduce of n elements over WORLD ranks, bytes sent by ``rank``: every
    chunk but its own in the reduce-scatter, every chunk but the next rank's in the allgather."""
    base, extra = divmod(n, WORLD)
    lens = [base + (j < extra) for j in range(WORLD)]
    return (sum(_int8_nbytes(m) for j, m in enumerate(lens) if j != rank)
            + sum(_int8_nbytes(m) for j, m in enumerate(lens) if j != (rank + 1) % WORLD))


@pytest.mark.slow
def test_bytes_equal_the_formula(runs):
    for rank, r in enumerate(runs):
        single = r["bytes"]["single"]
        assert single["sizes"] == [423]
        m = single["meter"]
        agreement = SIGNATURE_NBYTES * (WORLD - 1)
        # the constructor's settings agreement, the first exchange's, 3 syncs in 6 steps
        assert m["bytes_sent"] == 3 * 4 * _int8_nbytes(141) + 2 * agreement
        assert m["raw_bytes_sent"] == 3 * 2 * (WORLD - 1) * 4 * 141
        assert m["steps"] == 6
        frag = r["bytes"]["fragments"]
        assert frag["sizes"] == [300, 123]
        # fragment 1's first (checked) exchange differs from fragment 0's, which the
        # group agreed on last: it first replays fragment 0's reduce-scatter messages
        # as 8-byte envelopes (gradcomp.comm.replay), one per chunk of 300 but this rank's own
        replay = (WORLD - 1) * 8
        assert frag["meter"]["bytes_sent"] == (agreement + replay
                                               + sum(2 * _ring_sent(n, rank) + agreement for n in (300, 123)))
        assert frag["meter"]["steps"] == 8


@pytest.mark.slow
def test_state_dict_round_trip_resumes_the_same_trajectory(runs):
    for r in runs:
        d = r["roundtrip"]
        assert d["pending"] and d["equal"], d
        assert d["steps"] == (12, 12) and d["syncs"][0] == d["syncs"][1] == 6, d
        assert len(d["rejected"]) == 2, d
        assert "sync_every=4" in d["rejected"][0] and "averaging" in d["rejected"][1], d


@pytest.mark.slow
def test_outer_optimizer_factory(runs):
    for r in runs:
        d = r["outer_factory"]
        assert d["equal"] and "must return a torch.optim.Optimizer" in d["error"], d


@pytest.mark.parametrize("kwargs, name", [
    ({"sync_every": 0}, "sync_every"),
    ({"sync_every": 8, "fragments": 3}, "fragments"),
    ({"sync_every": 8, "fragments": 0}, "fragments"),
    ({"sync_every": 8, "fragments": 2, "overlap": 4}, "overlap"),
    ({"sync_every": 8, "overlap": -1}, "overlap"),
    ({"sync_every": 8, "outer_optimizer": "adam"}, "outer_optimizer"),
    ({"sync_every": 8, "compressor": gc.TopK(ratio=0.1), "algorithm": "ring"}, "algorithm"),
    ({"sync_every": 8, "fragments": 8}, "fragments"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        gc.LocalSGD(_model(), **kwargs)


def test_bad_argument_types():
    with pytest.raises(TypeError, match="model"):
        gc.LocalSGD([torch.zeros(3)], sync_every=4)
    with pytest.raises(TypeError, match="sync_every"):
        gc.LocalSGD(_model(), sync_every=2.0)
    with pytest.raises(ValueError, match="ErrorFeedback"):
        gc.LocalSGD(_model(), sync_every=4, compressor=gc.ErrorFeedback(gc.Int8Quantizer()))
    with pytest.raises(RuntimeError, match="initialised"):
        gc.LocalSGD(_model(), sync_every=4)


class _Exploding(gc.Int8Quantizer):
    """Raises on rank 1 from its ``after``-th compression on."""

    def __init__(self, after):
        super().__init__()
        self.after, self.calls = after, 0

    def compress(self, t):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls > self.after:
            raise ValueError("injected compression failure")
        return super().compress(t)


def _failure_in_background(rank, world):
    """Rank 1's exchange fails on the background thread: every rank raises, none hangs."""
    model = _model()
    ls = gc.LocalSGD(model, sync_every=4, compressor=_Exploding(after=4), error_feedback=False,
                     fragments=2, overlap=1, timeout=3)
    try:
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), ls, 12)
    except Exception as e:
        return type(e).__name__, str(e), ls.steps
    return "no error", "", ls.steps


@pytest.mark.slow
def test_a_failed_background_exchange_raises_on_every_rank():
    res = launch(_failure_in_background, 2, timeout=TIMEOUT)
    for rank, (kind, msg, steps) in enumerate(res):
        assert kind != "no error" and steps < 12, res
        if rank == 1:
            assert "injected compression failure" in msg, res
        else:  # its peer stopped talking: a timeout, not a hang
            assert kind in ("TimeoutError", "RuntimeError"), res
