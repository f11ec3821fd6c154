"""Server-side error feedback of the two-phase allreduce (the owner's residual of its chunk).

The exact checks use FP16 on integer-valued float32 data: every rank's own
values (and the ring's partial sums of ``N - 1`` ranks) stay below 2048, which
float16 holds exactly, so the first-stage error is zero; the full sum of ``N``
ranks lies above 2048, where float16 keeps only even integers, so the owner's
compression errs by a known amount (round half to even). The expected outputs
are computed here step by step from that definition.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import chunk_bounds
from gradcomp.launch import launch

from ddp_checks import residual_conservation_error

TIMEOUT = 120
ON = {"server_error_feedback": True}
STEPS = 12
N = 203  # elements: chunks of unequal lengths at world 2-4


def _ints(rank: int, world: int) -> torch.Tensor:
    """Integers in [2048 / N + 5, 2047 / (N - 1) - 1]: each rank's values and
    any N - 1 ranks' sum < 2048, all N ranks' sum > 2048."""
    lo, hi = 2048 // world + 5, 2047 // (world - 1) - 1
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(lo, hi + 1, (N,), generator=g).to(torch.float32)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    ts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t)
    return ts


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float64)


def _expected(target: torch.Tensor, steps: int, server: bool) -> list[torch.Tensor]:
    """The outputs of ``steps`` reductions of the same inputs whose exact result
    is ``target`` (float64): with a server residual ``e``, ``y = fp16(t + e)``,
    ``e <- t + e - y``; without one, ``y = fp16(t)`` every step."""
    e, ys = torch.zeros_like(target), []
    for _ in range(steps):
        p = target + e if server else target
        y = _fp16(p)
        if server:
            e = p - y
        ys.append(y)
    return ys


def _running_sums(rank, world):
    x = _ints(rank, world)
    s = torch.stack(_gather(x)).double().sum(0)
    out = {}
    # averages where dividing by the world size is exact in float32 (powers of two)
    for op in ("sum", "avg") if world in (2, 4) else ("sum",):
        target = s if op == "sum" else s / world
        for mode in ("keyed", "flat", "ring"):
            ef = gc.ErrorFeedback(gc.FP16()) if mode != "flat" else None
            res = torch.zeros(N) if mode == "flat" else None
            algorithm = "ring" if mode == "ring" else "two_phase"
            ys, same = [], True
            for _ in range(STEPS):
                y = gc.allreduce(x, ef if ef is not None else gc.FP16(), op=op, algorithm=algorithm, key="w",
                                 residual=res, timeout=60, server_error_feedback=mode != "ring")
                same = same and all(torch.equal(t, y) for t in _gather(y))
                ys.append(y.double())
            want = _expected(target, STEPS, server=mode != "ring")
            drift = [float((sum(ys[:t + 1]) - (t + 1) * target).abs().max()) for t in range(STEPS)]
            out[(op, mode)] = (same, all(torch.equal(a, b) for a, b in zip(ys, want)), drift)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_server_residual_keeps_the_running_sum_on_the_true_sums(world):
    res = launch(_running_sums, world, timeout=TIMEOUT)
    assert all(r == res[0] for r in res)
    for (op, mode), (same, as_expected, drift) in res[0].items():
        assert same, (op, mode)  # bit-identical on every rank
        assert as_expected, (op, mode)  # the outputs computed by hand above
        if mode == "ring":  # the owner's error, the same every step: it grows with the steps
            assert drift[-1] == STEPS * drift[0] > 0, (op, drift)
        else:  # delayed, not lost: at most half a float16 step (2 for sums, 2 / N for averages)
            assert max(drift) == drift[0] > 0, (op, mode, drift)
            assert max(drift) <= (1.0 if op == "sum" else 1.0 / world), (op, mode, drift)


def _placement(rank, world):
    x = _ints(rank, world)
    lo, hi = chunk_bounds(N, world)[rank]
    # an exact compressor: the server residual exists and is zero, the result exact
    ef = gc.ErrorFeedback(gc.NoCompression())
    y = gc.allreduce(x, ef, op="sum", algorithm="two_phase", key="w", timeout=60, **ON)
    exact_ok = torch.equal(y.double(), torch.stack(_gather(x)).double().sum(0))
    zero_keyed = set(ef.residuals) == {("w", j) for j in range(world)} and all(
        bool((r == 0).all()) for r in ef.residuals.values())
    r = torch.zeros(N)
    gc.allreduce(x, gc.NoCompression(), algorithm="two_phase", residual=r, timeout=60, **ON)
    zero_flat = bool((r == 0).all())
    # a lossy one: the owner's key holds (sum + e) - D(C(sum + e)) in the units of the result
    ef = gc.ErrorFeedback(gc.FP16())
    y = gc.allreduce(x, ef, op="sum", algorithm="two_phase", key="w", timeout=60, **ON)
    s = torch.stack(_gather(x)).double().sum(0)
    owner = ef.residual(("w", rank)).double()
    owner_ok = torch.equal(owner, (s - _fp16(s))[lo:hi]) and bool((owner != 0).any())
    return exact_ok, zero_keyed, zero_flat, owner_ok


@pytest.mark.slow
def test_residual_placement_and_an_exact_compressor():
    for r in launch(_placement, 3, timeout=TIMEOUT):
        assert r == (True, True, True, True), r


def _state(rank, world):
    comp = lambda: gc.ErrorFeedback(gc.SignQuantizer(block_size=32))  # noqa: E731
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(N, generator=g) for _ in range(6)]
    a = comp()
    ya = [gc.allreduce(x, a, algorithm="two_phase", key="w", timeout=60, **ON) for x in xs[:3]]
    b = comp()
    b.load_state_dict(a.state_dict())
    saved = ("w", rank) in a.state_dict()["residuals"]
    ya += [gc.allreduce(x, a, algorithm="two_phase", key="w", timeout=60, **ON) for x in xs[3:]]
    yb = [gc.allreduce(x, b, algorithm="two_phase", key="w", timeout=60, **ON) for x in xs[3:]]
    same = all(torch.equal(t, y) for y in ya for t in _gather(y))
    # a fresh error feedback (server residual lost) gives another result
    c = comp()
    yc = gc.allreduce(xs[3], c, algorithm="two_phase", key="w", timeout=60, **ON)
    return saved, same, all(torch.equal(u, w) for u, w in zip(ya[3:], yb)), not torch.equal(yc, ya[3])


@pytest.mark.slow
def test_sign_codec_state_round_trip_and_bit_identity():
    for r in launch(_state, 4, timeout=TIMEOUT):
        assert r == (True, True, True, True), r


def _ddp_conserves(rank, world):
    """The DDP hook on two-phase across steps: what every parameter gave equals
    what was applied plus the residuals held (summed over ranks), the owner's
    server residual included."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3)), bucket_cap_mb=0.001)
    state = gc.ddp.GradCompState(compressor=gc.SignQuantizer(block_size=32), algorithm="two_phase",
                                 min_compress_numel=0, start_iter=0, timeout=30, server_error_feedback=True)
    given, applied = {}, {}

    def hook(st, bucket):
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            given[id(p)] = given.get(id(p), 0) + grad.detach().double().reshape(-1)

        def record(fut):
            for p, grad in zip(bucket.parameters(), bucket.gradients()):  # views of the reduced buffer
                applied[id(p)] = applied.get(id(p), 0) + grad.detach().double().reshape(-1) * world
            return fut.value()
        return gc.ddp.compressed_allreduce_hook(st, bucket).then(record)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        x = torch.randn(16, 12, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state.close()
    return residual_conservation_error(state, model, given, applied)


@pytest.mark.slow
def test_ddp_hook_on_two_phase_loses_nothing():
    for err in launch(_ddp_conserves, 4, timeout=TIMEOUT):
        assert err < 1e-5, err  # float32 sums in the collective: equal up to their rounding


def test_bad_settings_name_the_argument():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="server_error_feedback applies to algorithm='two_phase' only"):
        gc.allreduce(x, gc.ErrorFeedback(gc.FP16()), algorithm="ring", server_error_feedback=True)
    with pytest.raises((TypeError, ValueError), match="server_error_feedback"):
        gc.allreduce(x, gc.FP16(), algorithm="two_phase", server_error_feedback="yes")
    with pytest.raises(ValueError, match="server_error_feedback needs algorithm='two_phase'"):
        gc.ddp.GradCompState(compressor=gc.FP16(), algorithm="ring", server_error_feedback=True)
    with pytest.raises(ValueError, match="error_feedback=True"):
        gc.ddp.GradCompState(compressor=gc.FP16(), algorithm="two_phase", error_feedback=False,
                             server_error_feedback=True)
    with pytest.raises(TypeError, match="server_error_feedback must be True or False"):
        gc.ddp.GradCompState(compressor=gc.FP16(), algorithm="two_phase", server_error_feedback=1)
    state = gc.ddp.GradCompState(compressor=gc.FP16(), algorithm="two_phase", server_error_feedback=True)
    import pickle
    assert pickle.loads(pickle.dumps(state)).server_error_feedback is True
