"""gradcomp.allreduce on real multi-process gloo groups (gradcomp.launch).

Error bounds (int8, blockwise absmax, nearest rounding): one quantization of
a block whose absolute maximum is ``m`` errs by at most ``0.5 * m / 127`` per
element, plus float32 rounding in ``(x / m) * 127`` and ``code * scale``
(under ``1e-4 * m / 127``); we allow ``0.52 * m / 127``. Every value a
collective quantizes is a (partial) sum of the ranks' data plus earlier
errors, so its block maximum is at most ``A_b (1 + 0.01)`` where ``A_b`` is
the sum over ranks of each rank's own absolute maximum in block ``b`` of the
chunk. The ring quantizes each block ``N`` times (``N - 1`` hops and the
owner's final compression), two-phase at most twice (each rank's own chunk
once, the owner's sum once), so for ``op="sum"``::

    |result - exact| <= Q * 0.52 * 1.01 * A_b / 127     Q = N (ring), 2 (two_phase)

and ``1 / N`` of that for ``op="avg"``. FP16 / BF16: ``Q * (2**-11 or 2**-8)
* 1.01 * S_i + Q * 2**-24`` per element with ``S_i = sum_r |x_r,i|``; float32
itself: ``N * 2**-23 * S_i``. Sparse allgather results are compared bit for
bit with the sum, in rank order, of every rank's locally decompressed payload.
"""

import math
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp import wire as W
from gradcomp.comm import agreement, chunk_bounds, ring_raw_bytes
from gradcomp.comm.p2p import MIN_PIECE_BYTES, PIECES, pieces
from gradcomp.launch import launch

TIMEOUT = 120

DENSE = {
    "none": lambda: gc.NoCompression(),
    "fp16": lambda: gc.FP16(),
    "bf16": lambda: gc.BF16(),
    "int8": lambda: gc.Int8Quantizer(),
    "int8_b32": lambda: gc.Int8Quantizer(block_size=32),
}
SPARSE = {
    "topk": lambda: gc.TopK(ratio=0.05),
    "topk_int8": lambda: gc.TopK(ratio=0.05, values=gc.Int8Quantizer(block_size=32)),
    "threshold": lambda: gc.Threshold(1.5),  # keeps a different count on every rank
    "threshold_empty": lambda: gc.Threshold(1e30),  # keeps nothing anywhere
}
RELATIVE_STEP = {"none": 2.0**-23, "fp16": 2.0**-11, "bf16": 2.0**-8}


# ---------------------------------------------------------------------- helpers
def _inputs(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def _gather(t):
    """Every rank's float32 copy of ``t`` (widening is exact)."""
    flat = t.detach().reshape(-1).float()
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _int8_bound(xs, world, block, quantizations):
    """Per-element bound for op='sum' (see the module docstring)."""
    n = xs[0].numel()
    bound = torch.zeros(n, dtype=torch.float64)
    for lo, hi in chunk_bounds(n, world):
        for b0 in range(lo, hi, block):
            b1 = min(hi, b0 + block)
            a = sum(float(x[b0:b1].abs().max()) for x in xs)
            bound[b0:b1] = quantizations * 0.52 * 1.01 * a / 127
    return bound


def _expected_dense_bytes(make, n, world, rank):
    c = make()
    lens = [hi - lo for lo, hi in chunk_bounds(n, world)]
    wire = [c.wire_nbytes((k,), torch.float32) for k in lens]
    rs = sum(wire[j] for j in range(world) if j != rank)
    ag = sum(wire[j] for j in range(world) if j != (rank + 1) % world)
    return rs, ag


def _check_case(rank, world, name, make, algorithm, op, n, dtype):
    agreement.forget(dist.group.WORLD)  # every case starts with an agreement
    x = _inputs(rank, n, dtype, seed=n)
    comp = make()
    meter = gc.TrafficMeter()
    y = gc.allreduce(x, comp, op=op, algorithm=algorithm, meter=meter, timeout=30)
    where = f"{name}/{algorithm}/{op}/n={n}/{dtype}"
    assert y.shape == x.shape and y.dtype == x.dtype, where
    ys = _gather(y)
    assert all(torch.equal(ys[0], t) for t in ys), f"ranks differ: {where}"
    xs = [t.double() for t in _gather(x)]
    exact = torch.stack(xs).sum(0) if n else torch.zeros(0, dtype=torch.float64)
    div = world if op == "avg" else 1
    got = y.double().reshape(-1)
    out_round = 0.0 if dtype == torch.float32 else 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    s_abs = torch.stack([t.abs() for t in xs]).sum(0) if n else exact
    if name in SPARSE:
        local = []
        for t in _gather(x):
            c = make()
            local.append(c.decompress(c.compress(t)).float())
        ref = torch.zeros(n)
        for t in local:
            ref += t
        ref = (ref / div).to(dtype).double() if op == "avg" else ref.to(dtype).double()
        assert torch.equal(got, ref), f"sparse union differs: {where}"
    else:
        if name.startswith("int8"):
            q = world if algorithm == "ring" else 2
            bound = _int8_bound(xs, world, comp.block_size, q) / div
        else:
            q = world if algorithm == "ring" else 2
            step = RELATIVE_STEP[name]
            bound = (world * step * s_abs if name == "none"
                     else q * step * 1.01 * s_abs + q * 2.0**-24) / div
        # the cast of the float32 result back to float16 / bfloat16 rounds once more
        bound = bound + out_round * (exact.abs() / div + bound) + (2.0**-24 if dtype == torch.float16 else 0)
        err = (got - exact / div).abs()
        assert bool((err <= bound).all()), (f"error above bound: {where}: "
                                           f"max excess {float((err - bound).max())}")
    # traffic: wire bytes from the gradcomp.wire formulas, raw bytes from the float32 ring
    rs_raw, ag_raw, rs_raw_in, ag_raw_in = ring_raw_bytes(n, world, rank)
    lens = [hi - lo for lo, hi in chunk_bounds(n, world)]
    assert rs_raw + ag_raw == 4 * (2 * n - lens[rank] - lens[(rank + 1) % world])
    if n % world == 0:
        assert rs_raw + ag_raw == 2 * (world - 1) * 4 * n // world
    d = meter.as_dict()
    ph = d["phases"]
    # every case starts with a signature of 7 int64 to every other rank
    nbytes = agreement.SIGNATURE_NBYTES * (world - 1)
    assert ph["agreement"]["bytes_sent"] == nbytes == ph["agreement"]["bytes_received"], where
    assert ph["agreement"]["raw_bytes_sent"] == 0, where
    assert d["raw_bytes_sent"] == rs_raw + ag_raw, where
    if algorithm == "two_phase":  # raw bytes are counted per message: chunk `rank`, N - 1 times
        rs_raw_in = (world - 1) * 4 * lens[rank]
    assert d["raw_bytes_received"] == rs_raw_in + ag_raw_in, where
    if name in SPARSE:
        sizes = [make().compress(t).nbytes for t in _gather(x)]
        assert ph["sizes"]["bytes_sent"] == 8 * (world - 1) and ph["sizes"]["raw_bytes_sent"] == 0
        assert ph["allgather"]["bytes_sent"] == sum(s for j, s in enumerate(sizes) if j != (rank + 1) % world)
        assert ph["allgather"]["bytes_received"] == sum(s for j, s in enumerate(sizes) if j != rank)
        assert ph["allgather"]["messages_sent"] == world - 1
    else:
        rs, ag = _expected_dense_bytes(make, n, world, rank)
        if name == "int8":
            hdr = W.header_nbytes(1)
            assert rs == sum(hdr + k + 4 * math.ceil(k / 256) for j, k in enumerate(lens) if j != rank)
        assert ph["reduce_scatter"]["bytes_sent"] == rs, where
        assert ph["allgather"]["bytes_sent"] == ag, where
        assert ph["reduce_scatter"]["raw_bytes_sent"] == rs_raw
        assert ph["allgather"]["raw_bytes_sent"] == ag_raw
        assert ph["reduce_scatter"]["messages_sent"] == world - 1
    return meter.bytes_sent


def _matrix(rank, world):
    sizes = [0, 1, world - 1, 1031, 2**16 + 3]
    for n in sizes:
        for name, make in DENSE.items():
            for algorithm in ("ring", "two_phase"):
                _check_case(rank, world, name, make, algorithm, "avg", n, torch.float32)
        for name, make in SPARSE.items():
            _check_case(rank, world, name, make, "allgather", "sum", n, torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        for name in ("int8", "fp16", "none"):
            _check_case(rank, world, name, DENSE[name], "ring", "sum", 4099, dtype)
        _check_case(rank, world, "topk", SPARSE["topk"], "allgather", "avg", 4099, dtype)
    # large enough that each message travels in several concurrent pieces
    _check_case(rank, world, "none", DENSE["none"], "two_phase", "sum", 2**18 + 5, torch.float32)
    return True


# ---------------------------------------------------------------------- tests
def test_pieces_cover_messages_exactly():
    assert pieces(0) == []
    assert pieces(10) == [(0, 10)]
    for nbytes in (1, MIN_PIECE_BYTES - 1, MIN_PIECE_BYTES, 3 * MIN_PIECE_BYTES + 1, 10**7 + 3):
        ps = pieces(nbytes)
        assert 1 <= len(ps) <= PIECES and ps[0][0] == 0 and ps[-1][1] == nbytes
        assert all(a[1] == b[0] for a, b in zip(ps, ps[1:]))
        assert max(e - s for s, e in ps) - min(e - s for s, e in ps) <= 1
    assert len(pieces(2**24)) == PIECES


def test_chunk_bounds_and_raw_formula():
    assert chunk_bounds(0, 3) == [(0, 0)] * 3
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for n, world in [(1000, 4), (1001, 3), (5, 8)]:
        total = sum(sum(ring_raw_bytes(n, world, r)[:2]) for r in range(world))
        assert total == 2 * (world - 1) * 4 * n  # every chunk crosses N-1 links in each phase
    assert ring_raw_bytes(10, 1, 0) == (0, 0, 0, 0)


@pytest.mark.parametrize("algorithm,comp,match", [
    ("ring", gc.TopK(ratio=0.1), "algorithm 'ring' needs a dense compressor.*TopK"),
    ("two_phase", gc.Threshold(1.0), "algorithm 'two_phase' needs a dense compressor.*Threshold"),
    ("allgather", gc.Int8Quantizer(), "algorithm 'allgather' is for sparse.*Int8Quantizer"),
    ("ring", gc.ErrorFeedback(gc.TopK(k=3)), "needs a dense compressor"),
    ("tree", gc.Int8Quantizer(), r"algorithm must be one of \('ring', 'two_phase', 'allgather', 'hierarchical', 'halving_doubling'"),
])
def test_algorithm_compressor_mismatch(algorithm, comp, match):
    with pytest.raises(ValueError, match=match):
        gc.allreduce(torch.ones(4), comp, algorithm=algorithm)


def test_argument_errors():
    with pytest.raises(ValueError, match=r"op must be one of \('avg', 'sum'\)"):
        gc.allreduce(torch.ones(4), gc.Int8Quantizer(), op="mean")
    with pytest.raises(TypeError, match="tensor must have dtype"):
        gc.allreduce(torch.ones(4, dtype=torch.int32), gc.NoCompression())
    with pytest.raises(TypeError, match="tensor must have dtype"):
        gc.allreduce(torch.ones(4, dtype=torch.float64), gc.NoCompression())
    with pytest.raises(TypeError, match="tensor must be a dense torch.Tensor"):
        gc.allreduce([1.0, 2.0], gc.NoCompression())
    with pytest.raises(TypeError, match="compressor must be a gradcomp compressor"):
        gc.allreduce(torch.ones(4), "int8")
    with pytest.raises(ValueError, match="timeout"):
        gc.allreduce(torch.ones(4), gc.Int8Quantizer(), timeout=0)
    with pytest.raises(TypeError, match="check must be True or False"):
        gc.allreduce(torch.ones(4), gc.Int8Quantizer(), check="yes")
    with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor of 4"):
        gc.allreduce(torch.ones(4), gc.Int8Quantizer(), residual=torch.zeros(3))
    with pytest.raises(ValueError, match="either an ErrorFeedback compressor or residual"):
        gc.allreduce(torch.ones(4), gc.ErrorFeedback(gc.Int8Quantizer()), residual=torch.zeros(4))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(4,\)"):
        gc.allreduce(torch.ones(4), gc.Int8Quantizer(), out=torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gc.allreduce(torch.ones(4, 2), gc.Int8Quantizer(), out=torch.ones(2, 4).t())
    with pytest.raises(ValueError, match="fixed wire size"):
        gc.allreduce(torch.ones(4), _VariableSize(), algorithm="ring")


class _VariableSize(gc.NoCompression):
    def wire_nbytes(self, shape, dtype=torch.float32):
        return None


def _world_one(rank, world):
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(3, 5).to(dtype)[:, ::2]  # non-contiguous
        c = gc.Int8Quantizer(rounding="stochastic")
        m = gc.TrafficMeter()
        y = gc.allreduce(x, c, meter=m)
        out.append((torch.equal(y, x), y.dtype == dtype, y.shape == x.shape, y.data_ptr() != x.data_ptr(),
                    m.bytes_sent, m.raw_bytes_sent, c.counter))
    y0 = gc.allreduce(torch.empty(0), gc.TopK(ratio=0.1), algorithm="allgather")
    out.append(y0.shape == (0,))
    return out


@pytest.mark.slow
def test_world_one_returns_a_copy_and_sends_nothing():
    res = launch(_world_one, 1, timeout=TIMEOUT)[0]
    assert res[-1] is True
    for same, dt, shape, copy, sent, raw, counter in res[:-1]:
        assert same and dt and shape and copy and sent == 0 and raw == 0 and counter == 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matrix_bounds_bit_identity_and_bytes(world):
    assert launch(_matrix, world, timeout=TIMEOUT) == [True] * world


def _integers(rank, world):
    out = []
    for algorithm in ("ring", "two_phase"):
        for n in (1, 10, 1001):
            x = torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(rank)).float()
            y = gc.allreduce(x, gc.NoCompression(), op="sum", algorithm=algorithm)
            exact = torch.stack(_gather(x)).sum(0)
            out.append(torch.equal(y, exact))
    return all(out)


@pytest.mark.slow
def test_integer_inputs_sum_exactly_without_compression():
    assert launch(_integers, 3, timeout=TIMEOUT) == [True] * 3


def _out_argument(rank, world):
    cases = [(gc.Int8Quantizer, "ring"), (gc.FP16, "two_phase"), (lambda: gc.TopK(ratio=0.1), "allgather")]
    for make, algorithm in cases:
        for dtype in (torch.float32, torch.bfloat16):
            x = _inputs(rank, 1003, dtype).view(17, 59)
            keep = x.clone()
            ref = gc.allreduce(x, make(), algorithm=algorithm)
            other = torch.empty_like(x)
            assert gc.allreduce(x, make(), algorithm=algorithm, out=other) is other
            assert torch.equal(other, ref) and torch.equal(x, keep)
            assert gc.allreduce(x, make(), algorithm=algorithm, out=x) is x  # in place
            assert torch.equal(x, ref)
    return True


@pytest.mark.slow
def test_out_argument_and_in_place():
    assert launch(_out_argument, 3, timeout=TIMEOUT) == [True] * 3


def _error_feedback(rank, world):
    n = 3000
    lens = chunk_bounds(n, world)
    x = _inputs(rank, n, torch.float32)
    ef = gc.ErrorFeedback(gc.Int8Quantizer())
    gc.allreduce(x, ef, algorithm="ring", key="w")
    ring_keys = set(ef.residuals)
    ef2 = gc.ErrorFeedback(gc.Int8Quantizer())
    gc.allreduce(x, ef2, algorithm="two_phase", key="w")
    ef3 = gc.ErrorFeedback(gc.TopK(ratio=0.1))
    gc.allreduce(x, ef3, algorithm="allgather", key="w")
    assert ring_keys == {("w", (rank - 1) % world)}
    assert set(ef2.residuals) == {("w", j) for j in range(world) if j != rank}
    assert set(ef3.residuals) == {"w"}
    # explicit flat residual: kept where this rank compressed its own data alone,
    # delivered (reset to zero) where its data was added exactly
    for algorithm in ("ring", "two_phase"):
        r = torch.full((n,), 1e-3)
        gc.allreduce(x, gc.Int8Quantizer(), algorithm=algorithm, residual=r)
        own = {(rank - 1) % world} if algorithm == "ring" else set(range(world)) - {rank}
        for j, (lo, hi) in enumerate(lens):
            seg = r[lo:hi]
            if j in own:
                v = x[lo:hi] + 1e-3
                assert bool((seg.abs() <= 0.52 * v.abs().max() / 127).all()) and bool((seg != 0).any())
            else:
                assert bool((seg == 0).all())
    # error feedback delivers what compression held back: with top-k (whose
    # union is summed exactly) the running mean of repeated reductions of the
    # same inputs approaches the exact mean, while without it the error stays
    exact = torch.stack(_gather(x)).double().mean(0)
    ef4 = gc.ErrorFeedback(gc.TopK(ratio=0.1))
    acc = torch.zeros(n, dtype=torch.float64)
    steps = 30
    for _ in range(steps):
        acc += gc.allreduce(x, ef4, algorithm="allgather", key=0).double()
    one = gc.allreduce(x, gc.TopK(ratio=0.1), algorithm="allgather").double()
    e_one = float((one - exact).norm() / exact.norm())
    e_avg = float((acc / steps - exact).norm() / exact.norm())
    assert e_avg < 0.25 * e_one, (e_avg, e_one)
    return True


@pytest.mark.slow
def test_error_feedback_placement_and_residuals():
    assert launch(_error_feedback, 3, timeout=TIMEOUT) == [True] * 3


def _two_phase_beats_ring(rank, world):
    x = _inputs(rank, 2**15, torch.float32, seed=7)
    exact = torch.stack(_gather(x)).double().mean(0)
    errs = {}
    for algorithm in ("ring", "two_phase"):
        y = gc.allreduce(x, gc.Int8Quantizer(), algorithm=algorithm)
        errs[algorithm] = float((y.double() - exact).norm() / exact.norm())
    return errs


@pytest.mark.slow
def test_two_phase_error_below_ring_at_world_4():
    errs = launch(_two_phase_beats_ring, 4, timeout=TIMEOUT)[0]
    assert errs["two_phase"] < errs["ring"], errs


class _Corrupting(gc.Int8Quantizer):
    """Rank 1's payloads get a bad magic number ("corrupt") or one code of
    -128 ("bad_code": the header is fine, the receiving kernel must catch it)."""

    def __init__(self, case):
        super().__init__()
        self.case = case

    def compress(self, t):
        p = super().compress(t)
        if dist.get_rank() == 1:
            if self.case == "corrupt":
                p.wire[0] = 0
            else:
                p.codes[p.codes.numel() // 2] = -128
        return p


def _failures(rank, world, case):
    x = torch.randn(1000)
    dist.barrier()  # the others' 3 s timeout and the absent rank's stay count from here
    try:
        if case == "missing" and rank == 1:
            time.sleep(8)  # never joins (but stays alive past the others' timeout): they time out, not hang
            return "absent"
        comp = gc.Int8Quantizer() if case == "missing" else _Corrupting(case)
        gc.allreduce(x, comp, algorithm="two_phase" if case == "bad_code_two_phase" else "ring", timeout=3)
        return "ok"
    except (TimeoutError, RuntimeError, gc.PayloadError) as e:
        return type(e).__name__


def _disagreeing(rank, world, case):
    n = 1000
    comp, op, algorithm = gc.Int8Quantizer(), "avg", "ring"
    if rank == 2:
        if case.startswith("numel"):
            n = 999
            algorithm = case.split("-")[1]
            comp = gc.TopK(ratio=0.1) if algorithm == "allgather" else comp
        elif case == "op":
            op = "sum"
        elif case == "algorithm":
            algorithm = "two_phase"
        elif case == "codec":
            comp = gc.FP16()
        elif case == "block_size":
            comp = gc.Int8Quantizer(block_size=32)
    elif case == "numel-allgather":
        comp, algorithm = gc.TopK(ratio=0.1), "allgather"
    elif case.startswith("numel"):
        algorithm = case.split("-")[1]
    meter = gc.TrafficMeter()
    try:
        gc.allreduce(torch.randn(n), comp, op=op, algorithm=algorithm, timeout=20, meter=meter)
        outcome = "ok"
    except ValueError as e:
        outcome = str(e)
    # nothing but the agreement moved, and the group still works
    payload_bytes = meter.bytes_sent - meter.as_dict()["phases"]["agreement"]["bytes_sent"]
    x = torch.full((10,), float(rank))
    y = gc.allreduce(x, gc.NoCompression(), op="sum", timeout=20)
    return outcome, payload_bytes, y.tolist()


def _new_groups(rank, world):
    agreed = []
    for i in range(6):
        group = dist.new_group([0, 1])
        meter = gc.TrafficMeter()
        gc.allreduce(torch.randn(1000 + i % 2), gc.Int8Quantizer(), group=group, meter=meter, timeout=20)
        agreed.append(meter.as_dict()["phases"]["agreement"]["bytes_sent"])
        dist.destroy_process_group(group)
        del group
    return agreed


@pytest.mark.slow
def test_a_new_group_never_inherits_an_agreement():
    # what a destroyed group agreed on goes with it, even if a new group object
    # lands at the same address
    for agreed in launch(_new_groups, 2, timeout=TIMEOUT):
        assert agreed == [agreement.SIGNATURE_NBYTES] * 6, agreed


@pytest.mark.slow
@pytest.mark.parametrize("case,field", [("numel-ring", "numbers of elements"),
                                        ("numel-two_phase", "numbers of elements"),
                                        ("numel-allgather", "numbers of elements"),
                                        ("op", "op"), ("algorithm", "algorithm"),
                                        ("codec", "compressor types"), ("block_size", "payload size")])
def test_ranks_that_disagree_all_raise_and_the_group_survives(case, field):
    res = launch(_disagreeing, 3, (case,), timeout=TIMEOUT)
    for rank, (outcome, payload_bytes, y) in enumerate(res):
        assert "ranks of the group passed different" in outcome and field in outcome, (rank, outcome)
        assert "rank 2:" in outcome, outcome
        if case == "codec":
            assert "rank 0: 'int8'" in outcome and "rank 2: 'fp16'" in outcome, outcome
        assert payload_bytes == 0, (rank, payload_bytes)
        assert y == [3.0] * 10  # 0 + 1 + 2


def _residuals_kept(rank, world, algorithm):
    sparse = algorithm == "allgather"
    comp = gc.ErrorFeedback(gc.TopK(ratio=0.1) if sparse else gc.Int8Quantizer())
    gc.allreduce(torch.randn(500), comp, algorithm=algorithm, key="w", timeout=20)  # residuals exist
    before = {k: r.clone() for k, r in comp.residuals.items()}
    n = 999 if rank == 2 else 1000  # every rank's call differs from the last agreed one: all check
    try:
        gc.allreduce(torch.randn(n), comp, algorithm=algorithm, key="w", timeout=20)
        outcome = "ok"
    except ValueError as e:
        outcome = str(e)
    same = comp.residuals.keys() == before.keys() and all(torch.equal(comp.residuals[k], r)
                                                          for k, r in before.items())
    return outcome, same, len(before)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ring", "two_phase", "allgather"])
def test_a_disagreement_loses_no_residual(algorithm):
    for outcome, same, count in launch(_residuals_kept, 3, (algorithm,), timeout=TIMEOUT):
        assert "numbers of elements" in outcome and same and count > 0, (outcome, same, count)


class _FailsOnce(gc.Int8Quantizer):
    """Raises on its first compress, on every rank (after the agreement)."""

    failed = False

    def compress(self, t, *, out=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("compression failed")
        return super().compress(t, out=out)


def _unchecked_and_recovering(rank, world):
    x = _inputs(rank, 5000, torch.float32)
    meter = gc.TrafficMeter()
    y = gc.allreduce(x, gc.Int8Quantizer(), meter=meter, check=False, timeout=20)
    phases = sorted(meter.as_dict()["phases"])
    same = torch.equal(y, gc.allreduce(x, gc.Int8Quantizer(), timeout=20))  # checked or not, same bytes
    comp = _FailsOnce()
    try:
        gc.allreduce(x, comp, op="sum", timeout=20)  # a new descriptor: it agrees, then fails
        first = "ok"
    except RuntimeError as e:
        first = str(e)
    # the failed call left no message behind, so the next call's line up
    z = gc.allreduce(torch.full((10,), float(rank)), comp, op="sum", timeout=20)
    return phases, same, first, z.tolist()


@pytest.mark.slow
def test_unchecked_calls_and_a_failure_after_the_agreement():
    for phases, same, first, z in launch(_unchecked_and_recovering, 3, timeout=TIMEOUT):
        assert phases == ["allgather", "reduce_scatter"]  # no agreement with check=False
        assert same and first == "compression failed"
        assert z == pytest.approx([3.0] * 10, rel=0.02)  # 0 + 1 + 2, through int8


def _agreement_traffic(rank, world):
    def agreed(x, comp=None, algorithm="ring", **kw):
        meter = gc.TrafficMeter()
        gc.allreduce(x, comp or gc.Int8Quantizer(), algorithm=algorithm, meter=meter, timeout=20, **kw)
        return meter.as_dict()["phases"].get("agreement", {}).get("bytes_sent", 0)

    a, b = torch.randn(3000), torch.randn(2000)
    seen = [agreed(a), agreed(a), agreed(b), agreed(b), agreed(a), agreed(a, op="sum"),
            agreed(a, gc.FP16()), agreed(a, gc.TopK(ratio=0.1), "allgather"),
            agreed(a, gc.TopK(ratio=0.1), "allgather"), agreed(a, gc.FP16()), agreed(a, gc.FP16(), check=False)]
    # all ranks agreed on 3000 elements; now rank 2 alone changes its call: it
    # checks, the others do not; they find its disagreement envelopes and agree too
    try:
        gc.allreduce(b if rank == 2 else a, gc.FP16(), timeout=3)
        outcome = "ok"
    except ValueError as e:
        outcome = str(e)
    return seen, outcome


def _replayed(numel, world, rank, codec):
    """Bytes a rank sends replaying a ring call's reduce-scatter: at step s an
    envelope of 8 bytes per piece of the wire of chunk (rank - s - 1) mod world,
    for s = 0 .. world - 2."""
    bounds = chunk_bounds(numel, world)
    return sum(8 * len(pieces(W.dense_nbytes(codec, (bounds[(rank - s - 1) % world][1]
                                                    - bounds[(rank - s - 1) % world][0],))))
               for s in range(world - 1))


@pytest.mark.slow
def test_agreement_only_when_the_call_changes():
    res = launch(_agreement_traffic, 3, timeout=TIMEOUT)
    d = agreement.SIGNATURE_NBYTES * 2
    for rank, (seen, outcome) in enumerate(res):
        # a, a, b, b, a, a-sum, a-fp16, topk, topk, a-fp16 (the last agreement
        # was topk's), unchecked; a changed call first replays the last agreed
        # call's reduce-scatter messages as envelopes (its size exchange for the allgather)
        int8_a, int8_b = _replayed(3000, 3, rank, "int8"), _replayed(2000, 3, rank, "int8")
        assert seen == [d, 0, d + int8_a, 0, d + int8_b, d + int8_a, d + int8_a,
                        d + _replayed(3000, 3, rank, "fp16"), 0, d + 8 * 2, 0], seen
        # every rank: the same ValueError, within the 3 s timeout
        assert "numbers of elements" in outcome and "rank 2: 2000" in outcome, outcome


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "corrupt", "bad_code", "bad_code_two_phase"])
def test_failures_raise_instead_of_hanging(case):
    res = launch(_failures, 3, (case,), timeout=60)
    if case == "missing":
        assert res[1] == "absent" and res[0] == "TimeoutError", res
        assert res[2] in ("TimeoutError", "RuntimeError"), res
    else:
        assert "PayloadError" in res and "ok" not in res[:1] + res[2:], res
