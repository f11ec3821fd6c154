"""gc.PowerSGD on real gloo groups (gradcomp.launch): a rank-1 example worked by hand, PyTorch's
powerSGD_hook on the same inputs and the same initial Q, error feedback that loses nothing, the
DDP hook and LocalSGD bit-identical on every rank, and the bytes the meter counts."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.comm import native
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.launch import launch
from gradcomp.powersgd import Segment

TIMEOUT = 120


# ---- one process: settings and which parameters are matrices -----------------------------

def test_which_parameters_are_compressed():
    p = gc.PowerSGD(rank=4)  # a matrix pays (rows + cols) r elements: compressed above 2x that
    assert p.matrix((64, 32)) == (64, 32, 4)  # 2048 > 2 * 96 * 4
    assert p.matrix((32, 3, 3, 3)) == (32, 27, 4)  # a conv kernel: shape[0] rows
    assert p.matrix((8, 3, 3, 3)) is None  # 216 <= 2 * 35 * 4
    assert p.matrix((10, 10)) is None  # 100 <= 2 * 20 * 4
    assert p.matrix((100,)) is None and p.matrix((0, 5)) is None
    assert gc.PowerSGD(rank=100, min_compression_rate=0.5).matrix((512, 8)) == (512, 8, 8)  # rank capped by the shape
    assert p.wire_numel([(64, 32), (10,), (10, 10)]) == (64 * 4 + 10 + 100, 32 * 4)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="rank"):
        gc.PowerSGD(rank=0)
    with pytest.raises(ValueError, match="min_compression_rate"):
        gc.PowerSGD(min_compression_rate=0)
    with pytest.raises(ValueError, match="ErrorFeedback"):
        gc.PowerSGD(compressor=gc.ErrorFeedback(gc.FP16()))
    with pytest.raises(ValueError, match="dense"):
        gc.PowerSGD(compressor=gc.TopK(ratio=0.1))
    with pytest.raises(ValueError, match="algorithm"):
        GradCompState(compressor=gc.PowerSGD(), algorithm="allgather")
    p = gc.PowerSGD()
    with pytest.raises(ValueError, match="overlaps another"):  # checked before anything moves
        p.reduce_(torch.zeros(10), [Segment("a", 0, (6,)), Segment("b", 4, (2, 3))], step=0)
    with pytest.raises(ValueError, match="leaves the 10 elements"):
        p.reduce_(torch.zeros(10), [Segment("a", 4, (2, 4))], step=0)
    with pytest.raises(TypeError, match="Segment"):
        p.reduce_(torch.zeros(10), [("a", 0, (10,))], step=0)
    with pytest.raises(TypeError, match="hashable keys"):  # a key names a warm start and a cached layout
        p.reduce_(torch.zeros(10), [Segment(["a"], 0, (10,))], step=0)
    with pytest.raises(ValueError, match="flat contiguous"):
        p.reduce_(torch.zeros(4, 5).t(), [], step=0)


def test_state_round_trips():
    import pickle

    p = gc.PowerSGD(rank=2, seed=3)
    p.q["w"] = torch.randn(5, 2)
    p.residuals["w"] = torch.randn(10)
    back = gc.PowerSGD(rank=2, seed=3)
    back.load_state_dict(p.state_dict())
    assert torch.equal(back.q["w"], p.q["w"]) and torch.equal(back.residuals["w"], p.residuals["w"])
    with pytest.raises(ValueError, match="2-D float32"):
        back.load_state_dict({"q": {"w": torch.zeros(3)}})
    state = pickle.loads(pickle.dumps(GradCompState(compressor=p)))  # before torch.distributed starts
    assert state.powersgd is state.compressor and repr(state.powersgd) == repr(p)
    assert torch.equal(state.powersgd.q["w"], p.q["w"])


# ---- worker functions ---------------------------------------------------------------------

def _hand_example(rank, world):
    # M_0 = [[1, 2], [3, 4]], M_1 = [[3, 2], [1, 0]]; Q = [1, 0]^T (set as the warm start)
    p = gc.PowerSGD(rank=1, min_compression_rate=0.5, compressor=gc.NoCompression())
    p.q["w"] = torch.tensor([[1.0], [0.0]])
    m = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) if rank == 0 else torch.tensor([[3.0, 2.0], [1.0, 0.0]])
    buf, res = m.reshape(-1).clone(), torch.zeros(4)
    p.reduce_(buf, [Segment("w", 0, (2, 2))], step=0, residual=res, timeout=TIMEOUT)
    return buf.view(2, 2), res.view(2, 2), p.q["w"]


def _against_torch(rank, world):
    shapes = [(32, 16), (16,), (12, 3, 3, 3), (6, 5), (40, 24)]  # distinct shapes: one batch each in torch
    ours = gc.PowerSGD(rank=4, compressor=gc.NoCompression())
    state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                     min_compression_rate=2, use_error_feedback=True, warm_start=True)
    state.iter = 2  # its plain-allreduce steps (for DDP's bucket rebuild) are over
    segs, off = [], 0
    for i, s in enumerate(shapes):
        segs.append(Segment(i, off, s))
        off += math.prod(s)
    # the same initial Q in both (drawn alike on every rank); torch orthonormalizes stored Qs too
    g = torch.Generator().manual_seed(7)
    qs = {seg.key: torch.randn(ours.matrix(seg.shape)[1], 4, generator=g) for seg in segs if ours.matrix(seg.shape)}
    ours.q.update({k: q.clone() for k, q in qs.items()})
    half = gc.PowerSGD(rank=4)  # FP16 factors summed by the backend: float32 on its first call
    half.q.update({k: q.clone() for k, q in qs.items()})
    half_residual = torch.zeros(off)
    state.p_memory_dict[0] = torch.empty(sum(ours.matrix(s.shape)[0] * 4 for s in segs if s.key in qs))
    state.q_memory_dict[0] = torch.cat([q.reshape(-1) for q in qs.values()])
    residual = torch.zeros(off)
    out = []
    for step in range(3):
        grads = torch.randn(off, generator=torch.Generator().manual_seed(100 * step + rank))
        mine = ours.reduce_(grads.clone(), segs, step=step, residual=residual, timeout=TIMEOUT)
        theirs = torch_psgd.powerSGD_hook(state, _Bucket(grads.clone(), shapes)).wait()
        halved = half.reduce_(grads.clone(), segs, step=step, residual=half_residual, timeout=TIMEOUT)
        out.append((mine, theirs.clone(), halved))
    return out


class _Bucket:
    """What powerSGD_hook reads of a dist.GradBucket."""

    def __init__(self, buf, shapes):
        self._buf, self._grads, off = buf, [], 0
        for s in shapes:
            self._grads.append(buf[off:off + math.prod(s)].view(s))
            off += math.prod(s)

    def buffer(self):
        return self._buf

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


def _nothing_lost(rank, world):
    p = gc.PowerSGD(rank=2, compressor=gc.NoCompression())
    segs = [Segment("a", 0, (24, 20)), Segment("b", 480, (7,)), Segment("c", 487, (16, 3, 2, 2))]
    n = 487 + 192
    residual = torch.zeros(n)
    rows = []
    for step in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64).float()
        before = (g.double() + residual.double())  # what this rank contributes: gradient + old residual
        out = p.reduce_(g.clone(), segs, step=step, residual=residual, timeout=TIMEOUT)
        rows.append((before, out.double(), residual.double().clone()))
    return rows


def _before_start_iter(rank, world):
    p = gc.PowerSGD(rank=1, start_iter=1)
    g = torch.randn(40, 30, generator=torch.Generator().manual_seed(rank))
    residual = torch.randn(1200, generator=torch.Generator().manual_seed(50 + rank))
    reference = (g.reshape(-1) + residual).double()  # what the exact average delivers
    dist.all_reduce(reference)
    out = p.reduce_(g.reshape(-1).clone(), [Segment("w", 0, (40, 30))], step=0, residual=residual, timeout=TIMEOUT)
    return out, (reference / world).float(), residual.abs().max()


def _meter_bytes(rank, world):
    segs = [Segment("w", 0, (256, 128)), Segment("b", 256 * 128, (128,))]
    out = []
    for exchange in ("gradcomp", "backend"):  # FP16 factors on gradcomp's ring, then on the backend's allreduce
        p = gc.PowerSGD(rank=4, exchange=exchange)
        meters = []
        for step in range(2):
            meters.append(gc.TrafficMeter())
            buf = torch.randn(256 * 128 + 128, generator=torch.Generator().manual_seed(rank + 10 * step))
            p.reduce_(buf, segs, step=step, residual=torch.zeros_like(buf), meter=meters[-1], timeout=TIMEOUT,
                      check=step == 0)
        out.append(meters[-1].as_dict())
    return out


def _overflow(rank, world):
    # an exponent far too large for these values: the float16 sum overflows on every rank alike,
    # and both exchanges run again in float32 (the result of the exact exchange, bit for bit)
    segs = [Segment("w", 0, (40, 30)), Segment("b", 1200, (30,))]
    fp16, exact = gc.PowerSGD(rank=2), gc.PowerSGD(rank=2, compressor=gc.NoCompression())
    fp16._exponents[(tuple(segs), 1230)] = [60, 60]
    g = torch.randn(1230, generator=torch.Generator().manual_seed(rank))
    res_a, res_b = torch.zeros(1230), torch.zeros(1230)
    a = fp16.reduce_(g.clone(), segs, step=0, residual=res_a, timeout=TIMEOUT)
    b = exact.reduce_(g.clone(), segs, step=0, residual=res_b, timeout=TIMEOUT)
    return a, b, res_a, res_b, fp16._exponents[(tuple(segs), 1230)]


def _allreduce_and_localsgd(rank, world):
    p = gc.PowerSGD(rank=2, compressor=gc.NoCompression())
    t = torch.randn(30, 20, generator=torch.Generator().manual_seed(rank))
    outs = [gc.allreduce(t, p, key="w", timeout=TIMEOUT) for _ in range(2)]
    # int8 factors (the same first Q): P's rounding tilts the basis, Q's reaches the update
    q0 = torch.randn(20, 2, generator=torch.Generator().manual_seed(9))
    exact, int8 = gc.PowerSGD(rank=2, compressor=gc.NoCompression()), gc.PowerSGD(rank=2, compressor=gc.Int8Quantizer())
    exact.q["v"], int8.q["v"] = q0.clone(), q0.clone()
    outs += [gc.allreduce(t, exact, key="v", timeout=TIMEOUT), gc.allreduce(t, int8, key="v", timeout=TIMEOUT)]
    half = gc.PowerSGD(rank=2)  # FP16 factors summed in float16 by gloo from the second call on
    outs += [gc.allreduce(t, half, key="h", timeout=TIMEOUT) for _ in range(3)]
    outs.append(torch.tensor([e is not None for e in half._exponents[((Segment("h", 0, (30, 20)),), 600)]]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    ls = gc.LocalSGD(model, sync_every=2, compressor=gc.PowerSGD(rank=2), timeout=TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 20, generator=torch.Generator().manual_seed(rank))
    for _ in range(4):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        ls.step()
    ls.close()
    return outs, [q.clone() for q in p.q.values()], torch.cat([w.detach().reshape(-1) for w in model.parameters()])


def _ddp(rank, world, alternating):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    ddp = DDP(model)
    state = GradCompState(compressor=gc.PowerSGD(rank=2, alternating=alternating), start_iter=1, min_compress_numel=0,
                          timeout=TIMEOUT)
    ddp.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=gen)
    y = x[:, :3].argmax(1)  # learnable: the largest of the first three inputs
    losses, digests = [], []
    for _ in range(12):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        digests.append(torch.cat([w.detach().reshape(-1) for w in model.parameters()]).clone())
    state.close()
    return losses, digests, sorted(state.powersgd.q)


@pytest.fixture(scope="module")
def two():
    res = launch(_two_ranks, 2, timeout=TIMEOUT)
    return {k: [r[k] for r in res] for k in res[0]}  # name -> one result per rank


def _two_ranks(rank, world):
    return {"hand": _hand_example(rank, world), "torch": _against_torch(rank, world),
            "lost": _nothing_lost(rank, world), "meter": _meter_bytes(rank, world),
            "start": _before_start_iter(rank, world), "overflow": _overflow(rank, world)}


# ---- the checks -----------------------------------------------------------------------------

def test_a_rank_one_example_by_hand(two):
    # P_w = M_w Q: [1, 3], [3, 1]; averaged [2, 2] -> orthonormal [1, 1] / sqrt 2
    # Q_w = M_w^T P: [4, 6] / sqrt 2, [4, 2] / sqrt 2; averaged [4, 4] / sqrt 2
    # update P Q^T = [[2, 2], [2, 2]]; residual M_w - P Q_w^T: [[-1, -1], [1, 1]] and its negative
    for rank, (out, res, q) in enumerate(two["hand"]):
        assert torch.allclose(out, torch.full((2, 2), 2.0), atol=1e-6)
        sign = 1 if rank == 0 else -1
        assert torch.allclose(res, sign * torch.tensor([[-1.0, -1.0], [1.0, 1.0]]), atol=1e-6)
        assert torch.allclose(q.abs(), torch.full((2, 1), 4 / math.sqrt(2)), atol=1e-6)  # the warm start
    assert torch.equal(two["hand"][0][0], two["hand"][1][0])


def test_matches_pytorch_powersgd_hook_with_the_same_initial_q(two):
    for rank_out in two["torch"]:
        for step, (mine, theirs, halved) in enumerate(rank_out):
            # the same algorithm in float32, both with error feedback and warm start: only rounding differs
            assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), (step, (mine - theirs).abs().max())
            if step == 0:  # no exponent yet: the FP16 exchange's first call is float32
                assert torch.equal(halved, mine)
            else:  # float16 sums: 11 significant bits, a few roundings per element
                assert 0 < (halved - theirs).norm() < 1e-2 * theirs.norm(), (step, (halved - theirs).norm())
    for step in range(3):
        for i in (0, 2):
            assert torch.equal(two["torch"][0][step][i], two["torch"][1][step][i])  # bit-identical across ranks


def test_error_feedback_loses_nothing(two):
    world = 2
    for step in range(3):
        contributed = sum(two["lost"][r][step][0] for r in range(world))
        applied = world * two["lost"][0][step][1]  # every rank applies the same average
        kept = sum(two["lost"][r][step][2] for r in range(world))
        assert torch.allclose(applied + kept, contributed, atol=1e-4)
        assert torch.equal(two["lost"][0][step][1], two["lost"][1][step][1])
        assert kept.abs().max() > 1e-2  # the rank-2 projection did drop something


def test_before_start_iter_the_average_is_exact(two):
    for out, reference, left in two["start"]:
        assert torch.allclose(out, reference, rtol=1e-6, atol=1e-6)  # float32 sums in another order
        assert left == 0  # the residual was delivered
    assert torch.equal(two["start"][0][0], two["start"][1][0])


def test_the_meter_counts_two_fp16_exchanges_on_either_exchange(two):
    # P (256 x 4) with the 128-element vector, then Q (128 x 4), each a gradcomp ring of FP16
    # payloads: a rank sends every chunk but its own, then every chunk but its successor's
    world = 2
    for rank, (m, backend) in enumerate(two["meter"]):
        sent = 0
        for n in (256 * 4 + 128, 128 * 4):
            w = [gc.FP16().wire_nbytes((hi - lo,)) for lo, hi in chunk_bounds(n, world)]
            sent += (sum(w) - w[rank]) + (sum(w) - w[(rank + 1) % world])
        assert m["bytes_sent"] == sent
        # PyTorch's hook: the same elements in float32 over three allreduces, 2 (N - 1) / N of each
        assert sent < 0.6 * 2 * (world - 1) / world * 4 * (256 * 4 + 128 + 128 * 4)
        # on the backend (its second call: FP16): a ring allreduce's bytes of each exchange, 2 per element
        assert backend["bytes_sent"] == sum(native.sent_bytes(n, world, rank) // 2 for n in (256 * 4 + 128, 128 * 4))


def test_an_overflowing_fp16_sum_is_sent_again_in_float32(two):
    for a, b, res_a, res_b, exponents in two["overflow"]:
        assert torch.equal(a, b) and torch.equal(res_a, res_b)
        assert exponents[0] is not None and exponents[0] < 60 and exponents[1] < 60  # from the float32 sums


def test_the_exponent_puts_the_last_sum_below_float16s_largest_value():
    from gradcomp.powersgd import _next_exponent

    for amax, world in ((3.0, 4), (1e-5, 2), (700.0, 3), (0.5, 4)):
        avg = torch.tensor([0.1 * amax, -amax, 0.0])
        e = _next_exponent(avg, world)
        assert 2 ** 9 < amax * world * 2.0 ** e <= 2 ** 10  # 64x of headroom below 65504
    assert _next_exponent(torch.zeros(3), 4) is None and _next_exponent(torch.tensor([float("nan")]), 4) is None


def test_exchange_is_checked():
    with pytest.raises(ValueError, match="exchange"):
        gc.PowerSGD(exchange="nccl")
    with pytest.raises(ValueError, match="exchange='backend'"):
        gc.PowerSGD(compressor=gc.Int8Quantizer(), exchange="backend")
    assert gc.PowerSGD().exchange == "backend" and gc.PowerSGD(compressor=gc.Int8Quantizer()).exchange == "gradcomp"


def test_collective_and_localsgd_across_three_ranks():
    res = launch(_allreduce_and_localsgd, 3, timeout=TIMEOUT)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[0], res[0][0]))
        assert all(torch.equal(a, b) for a, b in zip(r[1], res[0][1]))
        assert torch.equal(r[2], res[0][2])  # LocalSGD's parameters bit-identical
    assert torch.isfinite(res[0][2]).all()
    exact, int8 = res[0][0][2], res[0][0][3]
    assert 0 < (int8 - exact).norm() < 0.05 * exact.norm()  # int8 factors: close to float32's, not equal
    assert res[0][0][-1].all()  # the float16 path ran (an exponent for both exchanges)


@pytest.mark.slow
@pytest.mark.parametrize("alternating", [False, True])  # two collectives a step, or one
def test_ddp_hook_trains_bit_identical_on_three_ranks(alternating):
    res = launch(_ddp, 3, (alternating,), timeout=TIMEOUT)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[1], res[0][1]))
    losses = res[0][0]
    assert losses[-1] < losses[0] - 0.03  # plain SGD on one rank's batch: 1.096 -> 0.982 in 12 steps
    assert res[0][2]  # warm-start Qs kept per parameter key
