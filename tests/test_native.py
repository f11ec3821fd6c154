"""The backend's own uncompressed allreduce (gradcomp.comm.native): values,
residual, accounting and the agreement; and the adaptive policy's ``none``
running on it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import native, ring_raw_bytes
from gradcomp.launch import launch

TIMEOUT = 120
N = 1001  # not a multiple of the world size: uneven ring chunks


def _inputs(rank: int) -> torch.Tensor:
    # small integers: every partial sum and the division by 4 are exact in float32
    return (torch.arange(N, dtype=torch.float32) % 17) * (rank + 1) - 3 * rank


def _cases(rank, world):
    out = {}
    x = _inputs(rank)
    meter = gc.TrafficMeter()
    out["sum"] = native.allreduce(x, op="sum", timeout=30, meter=meter)
    out["x_kept"] = torch.equal(x, _inputs(rank))
    out["meter"] = meter.as_dict()
    out["avg"] = native.allreduce(x, op="avg", timeout=30)
    residual = torch.full((N,), 0.25 * rank)
    out["with_residual"] = native.allreduce(x, op="sum", timeout=30, residual=residual)
    out["residual_after"] = residual.clone()
    buf = x.clone().view(7, 143)
    same = native.allreduce(buf, op="sum", timeout=30, out=buf)
    out["in_place"] = (same is buf, buf.clone())
    flat, res = x.clone(), torch.full((N,), 0.5 * rank)
    core_meter = gc.TrafficMeter()
    out["reduce_"] = (native.reduce_(flat, res, op="avg", group=dist.group.WORLD, timeout=30,
                                     meter=core_meter) is flat, flat.clone(), res.clone(),
                      core_meter.as_dict()["phases"]["plain_allreduce"]["bytes_sent"],
                      native.sent_bytes(N, world, rank))
    group = dist.new_group(list(range(world)))  # the mismatch on a group of its own
    native.allreduce(torch.ones(N), group=group, timeout=30)  # agreed, then a rank alone changes
    try:
        native.allreduce(torch.ones(N - 1 if rank == 1 else N), group=group, timeout=30)
        out["mismatch"] = "ok"
    except ValueError as e:
        out["mismatch"] = str(e)
    out["after_mismatch"] = native.allreduce(torch.full((5,), float(rank)), op="sum", group=group,
                                             timeout=30).tolist()
    try:
        native.allreduce(torch.ones(4, dtype=torch.float16), timeout=30)
        out["fp16"] = "ok"
    except TypeError as e:
        out["fp16"] = str(e)
    return out


@pytest.mark.timeout(180)
def test_native_allreduce_values_residual_meter_and_agreement():
    results = launch(_cases, 4, timeout=TIMEOUT)
    world = 4
    xs = [_inputs(r) for r in range(world)]
    total = sum(xs)  # exact (small integers), summed independently of the backend
    for rank, out in enumerate(results):
        assert torch.equal(out["sum"], total), rank
        assert out["x_kept"]
        assert torch.equal(out["avg"], sum(x / world for x in xs)), rank  # divided first, exact
        assert torch.equal(out["with_residual"], total + sum(0.25 * r for r in range(world))), rank
        assert torch.count_nonzero(out["residual_after"]) == 0  # delivered in full
        same, buf = out["in_place"]
        assert same and torch.equal(buf.view(-1), total)
        rs, ag, rs_in, ag_in = ring_raw_bytes(N, world, rank)
        phase = out["meter"]["phases"]["plain_allreduce"]
        assert phase["bytes_sent"] == phase["raw_bytes_sent"] == rs + ag
        assert phase["bytes_received"] == rs_in + ag_in
        assert phase["seconds"] > 0  # the call's wall time
        assert "agreement" in out["meter"]["phases"]  # the first call agreed
        # the unchecked core: in place, (x + residual) / world summed (exact: quarters of small
        # integers), the residual delivered; the bytes it counts are sent_bytes'
        same, flat, res, counted, sent = out["reduce_"]
        assert same and torch.equal(flat, sum((x + 0.5 * r) / world for r, x in enumerate(xs)))
        assert torch.count_nonzero(res) == 0 and counted == sent == rs + ag
        assert "numbers of elements" in out["mismatch"] and "rank 1:" in out["mismatch"], out["mismatch"]
        assert out["after_mismatch"] == [6.0] * 5  # 0 + 1 + 2 + 3: the group still works
        assert "float32" in out["fp16"]


def _adaptive_none(rank, world):
    policy = gc.Adaptive(candidates=("none", "int8"))
    g = torch.Generator().manual_seed(rank)
    meter = gc.TrafficMeter()
    got = []
    for step in range(3):
        x = torch.randn(3000, generator=g)
        got.append(gc.allreduce(x, policy, key="w", meter=meter, timeout=30))
    return policy.codec("w"), got, meter.as_dict()["phases"]


@pytest.mark.timeout(180)
def test_adaptive_none_runs_on_the_backends_allreduce():
    results = launch(_adaptive_none, 3, timeout=TIMEOUT)
    for codec, got, phases in results:
        assert codec == "none"
        assert set(phases) >= {"plain_allreduce"} and "reduce_scatter" not in phases
        for a, b in zip(got, results[0][1]):
            assert torch.equal(a, b)  # bit-identical on every rank
    gens = [torch.Generator().manual_seed(r) for r in range(3)]
    for step in range(3):
        xs = [torch.randn(3000, generator=g) for g in gens]
        assert torch.allclose(results[0][1][step], sum(x / 3 for x in xs), rtol=0, atol=1e-6)
