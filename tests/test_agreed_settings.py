"""Every setting that decides a message pattern, given another value on one rank:
the same ValueError on every rank, naming it, within seconds (it used to pair
unrelated exchanges silently, or wait out the full timeout)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp as gc
from gradcomp.comm.settings import compressor_text, setting_text
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.launch import launch

TIMEOUT = 240
#: a mismatch named on every rank within this many seconds (loopback): half the collectives' own
#: 20 s timeout, so the agreement named it, not a timeout (8 processes on 2 cores may lag seconds)
NAMED_WITHIN_S = 10.0
PRIOR = (1e-4, 1.25e8)  # 0.1 ms per message, 1 Gbit/s


def _timed(fn):
    """(outcome, seconds): outcome the ValueError's text or "ok"."""
    t0 = time.perf_counter()
    try:
        fn()
        return "ok", time.perf_counter() - t0
    except (ValueError, RuntimeError) as e:  # DDP wraps the hook's ValueError in a RuntimeError
        return str(e), time.perf_counter() - t0


# ---- LocalSGD -----------------------------------------------------------------------------
LOCALSGD = {  # case -> (setting named, keyword arguments of rank 1; rank 0 takes the defaults below)
    "sync_every": ("sync_every", {"sync_every": 3}),
    "fragments": ("fragments", {"fragments": 2}),
    "overlap": ("overlap", {"overlap": 1}),
    "compressor": ("compressor", {"compressor": gc.FP16()}),
    "algorithm": ("algorithm", {"algorithm": "two_phase"}),
    "error_feedback": ("error_feedback", {"error_feedback": False}),
    "outer_optimizer": ("outer_optimizer", {"outer_optimizer": "nesterov"}),
    "layout": ("parameter 0", {"model": "transposed"}),
    "partial_work": ("partial_work", {"partial_work": True}),
    "partial_work_tolerance": ("partial_work", {"partial_work": gc.PartialWork(tolerance=2.5)}),
    "same": (None, {"compressor": gc.Int8Quantizer(seed=7)}),  # another seed only: agreed
}


def _localsgd(rank, world):
    out = {}
    for case, (_, theirs) in LOCALSGD.items():
        kw = {"sync_every": 4, "fragments": 1, "overlap": 0, "compressor": gc.Int8Quantizer(),
              "algorithm": "ring", "error_feedback": True, "outer_optimizer": None, "model": "plain",
              "partial_work": gc.PartialWork() if case == "partial_work_tolerance" else False}
        if rank == 1:
            kw.update(theirs)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)) if kw.pop("model") == "plain" else \
            nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        out[case] = _timed(lambda: gc.LocalSGD(model, timeout=20, **kw).close())
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_localsgd_settings_are_agreed_at_construction():
    """Hole: ranks with sync_every 2 and 3 paired steps 2 and 4 with 3 and 6."""
    res = launch(_localsgd, 2, timeout=TIMEOUT)
    for case, (named, _) in LOCALSGD.items():
        outcomes = {r[case][0] for r in res}
        assert len(outcomes) == 1, (case, outcomes)
        outcome = outcomes.pop()
        if named is None:
            assert outcome == "ok", (case, outcome)
            continue
        assert f"gradcomp.LocalSGD: the ranks of the group passed different {named} (rank 0:" in outcome, \
            (case, outcome)
        assert all(r[case][1] < NAMED_WITHIN_S for r in res), (case, [r[case][1] for r in res])


# ---- the adaptive codec ----------------------------------------------------------------------
ADAPTIVE = {  # case -> (setting named, rank 0's policy, rank 1's policy)
    "priors": ("link", {"link": PRIOR}, {"link": (1e-4, 1.3e8)}),
    "prior_and_none": ("link", {"link": PRIOR}, {}),
    "interval": ("interval", {}, {"interval": 5}),
    "candidates": ("candidates", {}, {"candidates": ("none", "int8")}),
    "same": (None, {"link": PRIOR}, {"link": PRIOR}),
}


def _adaptive(rank, world):
    out = {}
    for case, (_, mine, theirs) in ADAPTIVE.items():
        group = dist.new_group(list(range(world)))  # a policy agrees once per group
        policy = gc.Adaptive(**(theirs if rank == 1 else mine))
        x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(rank))
        out[case] = _timed(lambda: [gc.allreduce(x, policy, key="w", group=group, timeout=20)
                                    for _ in range(3)])
    # compressor="auto" on one rank, a prior on the other, in the DDP hook
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(256, 128))
    state = GradCompState(compressor="auto" if rank == 0 else gc.Adaptive(link=PRIOR), min_compress_numel=0,
                          start_iter=0, timeout=20)
    model.register_comm_hook(state, compressed_allreduce_hook)
    out["ddp_auto_and_prior"] = _timed(lambda: model(torch.randn(4, 256)).sum().backward())
    state.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaptive_policies_agree_on_their_priors():
    """Hole: a rank predicting ``none`` went straight to the collective while one
    predicting int8 timed its kernels first; both failed after the full timeout."""
    res = launch(_adaptive, 2, timeout=TIMEOUT)
    for case, (named, mine, theirs) in ADAPTIVE.items():
        outcomes = {r[case][0] for r in res}
        assert len(outcomes) == 1, (case, outcomes)
        outcome = outcomes.pop()
        if named is None:
            assert outcome == "ok", (case, outcome)
            continue
        assert f"gradcomp.Adaptive: the ranks of the group passed different {named}" in outcome, outcome
        if case.startswith("prior"):  # the priors themselves are named
            assert f"rank 0: {mine['link']!r}" in outcome, outcome
            assert f"rank 1: {theirs.get('link')!r}" in outcome, outcome
        assert all(r[case][1] < NAMED_WITHIN_S for r in res)
    for r in res:
        outcome, seconds = r["ddp_auto_and_prior"]
        assert "gradcomp.ddp.GradCompState: the ranks of the group passed different compressor" in outcome
        assert "link=None" in outcome and f"link={PRIOR!r}" in outcome, outcome
        assert seconds < NAMED_WITHIN_S


# ---- the DDP hook -----------------------------------------------------------------------------
DDP = {"start_iter": {"start_iter": 1}, "min_compress_numel": {"min_compress_numel": 1 << 20},
       "algorithm": {"algorithm": "two_phase"}, "server_error_feedback": {"server_error_feedback": True}}


def _ddp(rank, world):
    out = {}
    for case, theirs in DDP.items():
        both = {"algorithm": "two_phase"} if case == "server_error_feedback" else {}  # it needs two-phase
        kw = {"min_compress_numel": 0, "start_iter": 0, **both, **(theirs if rank == 1 else {})}
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(64, 32))
        state = GradCompState(timeout=20, **kw)
        model.register_comm_hook(state, compressed_allreduce_hook)
        out[case] = _timed(lambda: model(torch.randn(4, 64)).sum().backward())
        state.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_hook_settings_are_agreed_at_the_first_bucket():
    res = launch(_ddp, 2, timeout=TIMEOUT)
    for case in DDP:
        outcomes = {r[case][0].split("\n")[0] for r in res}
        assert len(outcomes) == 1, (case, outcomes)
        outcome = outcomes.pop()
        assert f"GradCompState: the ranks of the group passed different {case} (rank 0:" in outcome, outcome
        assert all(r[case][1] < NAMED_WITHIN_S for r in res)


# ---- FSDP -----------------------------------------------------------------------------------
def _linear(n_in, n_out, bias=True, dtype=torch.float32, nest=False):
    layer = nn.Linear(n_in, n_out, bias=bias).to(dtype)
    return nn.Sequential(nn.Sequential(layer) if nest else layer)


FSDP = {  # case -> (what is named, rank 0's model, rank 1's model)
    "shape": ("parameter 0", (16, 32, False), (32, 16, False)),  # as filed: the same sizes
    "shape_and_bias": ("parameter 0", (16, 32), (32, 16)),
    "name": ("parameter 0", (16, 32), (16, 32, True, torch.float32, True)),
    "dtype": ("parameter 0", (16, 32), (16, 32, True, torch.bfloat16)),
    "same": (None, (16, 32), (16, 32)),
}


def _fsdp(rank, world):
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    for case, (_, mine, theirs) in FSDP.items():
        model = _linear(*(theirs if rank == 1 else mine))
        fully_shard(model, mesh=mesh)
        out[case] = _timed(lambda: gc.fsdp.apply(model, timeout=20))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_layouts_are_agreed_by_name_shape_and_dtype():
    """Hole: Linear(16, 32) on one rank and Linear(32, 16) on the other were accepted."""
    res = launch(_fsdp, 2, timeout=TIMEOUT)
    for case, (named, _, _) in FSDP.items():
        outcomes = {r[case][0] for r in res}
        assert len(outcomes) == 1, (case, outcomes)
        outcome = outcomes.pop()
        if named is None:
            assert outcome == "ok", outcome
            continue
        assert f"the ranks of the group passed different {named}" in outcome, (case, outcome)
        assert all(r[case][1] < NAMED_WITHIN_S for r in res)
    shape = res[0]["shape"][0]
    assert "shape (32, 16)" in shape and "shape (16, 32)" in shape, shape


# ---- the texts compared (no processes) ----------------------------------------------------------
def test_setting_texts_leave_out_what_differs_between_processes():
    class Opaque:
        pass

    assert setting_text(Opaque()) == setting_text(Opaque())  # no object address
    assert setting_text(lambda p: p) == setting_text(lambda p: p)
    assert setting_text(0.1) == "0.1" and setting_text(PRIOR) == "(0.0001, 125000000.0)"
    assert setting_text("ring") == "ring"
    # ranks may seed stochastic rounding apart; the block size and the rounding must agree
    assert compressor_text(gc.Int8Quantizer(seed=1)) == compressor_text(gc.Int8Quantizer(seed=2))
    assert compressor_text(gc.Int8Quantizer(block_size=64)) != compressor_text(gc.Int8Quantizer())
    assert compressor_text(gc.Int8Quantizer(rounding="stochastic", seed=3)) == \
        "Int8Quantizer(block_size=256, rounding='stochastic')"

