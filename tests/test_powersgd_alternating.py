"""gc.PowerSGD(alternating=True): half a power iteration per call on real gloo groups: a rank-1
example worked by hand over a P call and the Q call after it, the exact recovery of a low-rank
average, nothing lost to error feedback on either exchange, one collective per call, the full
iteration first with ``alternate_after`` (the DDP hook: tests/test_powersgd.py)."""

import math

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import native
from gradcomp.launch import launch
from gradcomp.powersgd import Segment

TIMEOUT = 120


def test_alternating_needs_the_warm_start_and_round_trips():
    with pytest.raises(ValueError, match="warm_start"):
        gc.PowerSGD(alternating=True, warm_start=False)
    with pytest.raises(TypeError, match="alternating"):
        gc.PowerSGD(alternating="yes")
    p = gc.PowerSGD(rank=2, alternating=True)
    p.p["w"] = torch.randn(6, 2)
    back = gc.PowerSGD(rank=2, alternating=True)
    back.load_state_dict(p.state_dict())
    assert torch.equal(back.p["w"], p.p["w"]) and back.settings()["alternating"] is True
    with pytest.raises(ValueError, match=r"state\['p'\]"):
        back.load_state_dict({"p": {"w": torch.zeros(3)}})


# ---- worker functions ---------------------------------------------------------------------

def _hand_example(rank, world):
    # M_0 = [[1, 2], [3, 4]], M_1 = [[3, 2], [1, 0]], Q = [1, 0]^T; the same gradients twice
    p = gc.PowerSGD(rank=1, min_compression_rate=0.5, compressor=gc.NoCompression(), alternating=True)
    p.q["w"] = torch.tensor([[1.0], [0.0]])
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) if rank == 0 else torch.tensor([[3.0, 2.0], [1.0, 0.0]])
    res, out = torch.zeros(4), []
    for step in range(2):
        buf = g.reshape(-1).clone()
        p.reduce_(buf, [Segment("w", 0, (2, 2))], step=step, residual=res, timeout=TIMEOUT)
        kept = p.p.get("w")
        out.append((buf.view(2, 2).clone(), res.view(2, 2).clone(), None if kept is None else kept.clone(),
                    p.q["w"].clone()))
    return out


def _low_rank_average(rank, world):
    # every rank holds a part of one rank-2 matrix A: the P call projects A on a seeded Q
    # (not A); the Q call after it projects on the span of A Q, which is A's column space: A
    u = torch.randn(24, 2, generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 18, generator=torch.Generator().manual_seed(2))
    a = u @ w
    part = a * (rank + 1) / sum(range(1, world + 1))  # the parts sum to A
    p = gc.PowerSGD(rank=2, compressor=gc.NoCompression(), alternating=True)
    outs = []
    for step in range(3):
        buf = part.reshape(-1).clone()
        p.reduce_(buf, [Segment("w", 0, (24, 18))], step=step, timeout=TIMEOUT)
        outs.append(buf.view(24, 18) * world)  # the sum
    return a, outs


def _nothing_lost(rank, world):
    segs = [Segment("a", 0, (24, 20)), Segment("b", 480, (7,)), Segment("c", 487, (16, 3, 2, 2))]
    n = 487 + 192
    rows = {}
    for name, comp in (("f32", gc.NoCompression()), ("fp16", None)):
        p = gc.PowerSGD(rank=2, compressor=comp, alternating=True)
        residual, meters, kept = torch.zeros(n), [], []
        for step in range(4):
            g = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + rank))
            before = g.double() + residual.double()  # gradient + old residual
            meters.append(gc.TrafficMeter())
            out = p.reduce_(g.clone(), segs, step=step, residual=residual, meter=meters[-1], timeout=TIMEOUT,
                            check=False)  # no agreement round: the meter counts the exchange alone
            rows.setdefault(name, []).append((before, out.double(), residual.double().clone()))
            kept.append(sorted(p.p))
        rows[name + "-meter"] = [m.as_dict()["bytes_sent"] for m in meters]
        rows[name + "-kept"] = kept
    return rows


def _alternate_after(rank, world):
    # start_iter 1, alternate_after 2: call 0 exact, calls 1-2 the paper's (as a PowerSGD without
    # alternating, bit for bit), then a P call and a Q call
    segs = [Segment("a", 0, (24, 20)), Segment("b", 480, (7,))]
    late = gc.PowerSGD(rank=2, compressor=gc.NoCompression(), alternating=True, alternate_after=2, start_iter=1)
    paper = gc.PowerSGD(rank=2, compressor=gc.NoCompression(), start_iter=1)
    res_late, res_paper, sent, same = torch.zeros(487), torch.zeros(487), [], []
    for step in range(5):
        g = torch.randn(487, generator=torch.Generator().manual_seed(7 * step + rank))
        meter = gc.TrafficMeter()
        a = late.reduce_(g.clone(), segs, step=step, residual=res_late, meter=meter, timeout=TIMEOUT, check=False)
        b = paper.reduce_(g.clone(), segs, step=step, residual=res_paper, timeout=TIMEOUT, check=False)
        sent.append(meter.as_dict()["bytes_sent"])
        same.append(torch.equal(a, b))
    return sent, same


def _two_ranks(rank, world):
    dist.barrier()
    return {"hand": _hand_example(rank, world), "low": _low_rank_average(rank, world),
            "lost": _nothing_lost(rank, world), "after": _alternate_after(rank, world)}


@pytest.fixture(scope="module")
def two():
    res = launch(_two_ranks, 2, timeout=TIMEOUT)
    return {k: [r[k] for r in res] for k in res[0]}


# ---- the checks -----------------------------------------------------------------------------

def test_a_p_call_then_a_q_call_by_hand(two):
    s = 1 / math.sqrt(2)
    for rank in range(2):
        (out0, res0, kept_p, _), (out1, res1, gone, q1) = two["hand"][rank]
        # P call: P_w = M_w Q = [1, 3], [3, 1]; average [2, 2]; update P Q^T = [[2, 0], [2, 0]];
        # residual M_w - P_w Q^T: [[0, 2], [0, 4]] and [[0, 2], [0, 0]]; kept basis +-[1, 1] / sqrt 2
        assert torch.allclose(out0, torch.tensor([[2.0, 0.0], [2.0, 0.0]]), atol=1e-6)
        assert torch.allclose(res0, torch.tensor([[0.0, 2.0], [0.0, 4.0]] if rank == 0 else [[0.0, 2.0], [0.0, 0.0]]),
                              atol=1e-6)
        assert torch.allclose(kept_p.abs(), torch.full((2, 1), s), atol=1e-6)
        # Q call on M_w = g_w + e_w: [[1, 4], [3, 8]] and [[3, 4], [1, 0]]; Q_w = M_w^T P = [4, 12] s
        # and [4, 4] s; average [4, 8] s; update P Q^T = [[2, 4], [2, 4]]; residual M_w - P Q_w^T
        assert torch.allclose(out1, torch.tensor([[2.0, 4.0], [2.0, 4.0]]), atol=1e-6)
        sign = 1 if rank == 0 else -1
        assert torch.allclose(res1, sign * torch.tensor([[-1.0, -2.0], [1.0, 2.0]]), atol=1e-6)
        assert gone is None  # the basis was used: the next call sends P again
        assert torch.allclose(q1.abs(), torch.tensor([[4.0], [8.0]]) * s, atol=1e-6)
    assert torch.equal(two["hand"][0][1][0], two["hand"][1][1][0])


def test_the_q_call_recovers_a_low_rank_average_exactly(two):
    a, outs = two["low"][0]
    assert (outs[0] - a).norm() > 0.05 * a.norm()  # the P call: A on a seeded, unrelated Q
    for out in outs[1:]:  # every later call projects on a basis spanning A's rows or columns
        assert torch.allclose(out, a, atol=1e-4 * a.abs().max())
    assert torch.equal(two["low"][0][1][1], two["low"][1][1][1])


@pytest.mark.parametrize("name", ["f32", "fp16"])
def test_error_feedback_loses_nothing_on_either_exchange(two, name):
    for step in range(4):
        contributed = sum(two["lost"][r][name][step][0] for r in range(2))
        applied = 2 * two["lost"][0][name][step][1]
        kept = sum(two["lost"][r][name][step][2] for r in range(2))
        assert torch.allclose(applied + kept, contributed, atol=1e-4 if name == "f32" else 1e-2)
        assert torch.equal(two["lost"][0][name][step][1], two["lost"][1][name][step][1])
        assert kept.abs().max() > 1e-2
    assert two["lost"][0][name + "-kept"] == [["a", "c"], [], ["a", "c"], []]  # P, Q, P, Q


def test_one_collective_per_call_alternating_its_size(two):
    # P's of a (24 x 2) and c (16 x 2) with the 7 elements sent whole, then Q's of a (20 x 2) and
    # c (12 x 2) with them: float32 on the backend's allreduce (the FP16 one's first calls too)
    p_call, q_call = 24 * 2 + 16 * 2 + 7, 20 * 2 + 12 * 2 + 7
    for rank in range(2):
        f32 = two["lost"][rank]["f32-meter"]
        assert f32 == [native.sent_bytes(n, 2, rank) for n in (p_call, q_call, p_call, q_call)]
        fp16 = two["lost"][rank]["fp16-meter"]
        # float32 until each exchange has an exponent (the first P and Q calls), float16 after
        assert fp16[:2] == f32[:2] and fp16[2:] == [native.sent_bytes(n, 2, rank) // 2 for n in (p_call, q_call)]


def test_alternate_after_runs_the_full_iteration_first(two):
    p_call, q_call = 24 * 2 + 7, 20 * 2
    for rank in range(2):
        sent, same = two["after"][rank]
        two_rounds = native.sent_bytes(p_call, 2, rank) + native.sent_bytes(q_call, 2, rank)
        assert sent == [native.sent_bytes(487, 2, rank), two_rounds, two_rounds,
                        native.sent_bytes(p_call, 2, rank), native.sent_bytes(q_call + 7, 2, rank)]
        assert same == [True, True, True, False, False]  # the paper's updates until it alternates
    with pytest.raises(ValueError, match="alternate_after"):
        gc.PowerSGD(alternating=True, alternate_after=-1)
