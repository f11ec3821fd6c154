"""The segment-pipelined ring (gradcomp.comm.pipelined) against the unsegmented ring.

Pipelining changes only when bytes leave: every test here compares, bit for
bit, a pipelined call with the same call through the unsegmented ring (the
payload written in parts with the payload written whole; results, residuals
and meters of the two collectives).
"""

import pytest
import torch

import gradcomp as gc
from gradcomp.comm import pipelined
from gradcomp.launch import launch

TIMEOUT = 120


def _bits(t):
    return t.contiguous().view(torch.int32)


# ------------------------------------------------------------------ the parts
def test_segments_cover_the_chunk_in_aligned_ranges():
    assert pipelined.segments(1000, 4, 256) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert pipelined.segments(769, 4, 256) == [(0, 256), (256, 512), (512, 768), (768, 769)]
    assert pipelined.segments(512, 4, 256) == [(0, 256), (256, 512), (512, 512), (512, 512)]
    assert pipelined.segments(10, 3, 32) == [(0, 10), (10, 10), (10, 10)]


def test_segment_count_and_when_the_pipeline_applies():
    from gradcomp.comm.dense import Plan
    from gradcomp.comm.local import Local

    c = gc.Int8Quantizer()
    assert pipelined.segment_count(Plan(2**24, 2, c)) == 4  # at most MAX_SEGMENTS
    assert pipelined.segment_count(Plan(2**18 + 2, 2, c)) == 2  # chunk 2**17 + 1
    assert pipelined.segment_count(Plan(2**20, 4, c)) == 2  # chunk 2**18
    assert pipelined.segment_count(Plan(2**18, 2, c)) == 1  # chunk 2**17: one segment
    x = torch.zeros(2**20)
    assert pipelined.applies(Local(x, c), Plan(2**20, 4, c))
    assert not pipelined.applies(Local(x, gc.Int8Quantizer(rounding="stochastic")), Plan(2**20, 4, c))
    assert not pipelined.applies(Local(x, gc.FP16()), Plan(2**20, 4, gc.FP16()))
    assert not pipelined.applies(Local(x, c), Plan(2**20, 8, c))  # chunks of 2**17


def test_part_ranges_are_the_scales_and_codes_of_the_part():
    c = gc.Int8Quantizer(block_size=32)
    n, h = 1000, 48  # header of a 1-D payload: 40 + 8 bytes
    nb = 32  # ceil(1000 / 32) scales
    assert c.part_ranges(n, 0, 64) == [(0, h + 4 * 2), (h + 4 * nb, h + 4 * nb + 64)]
    assert c.part_ranges(n, 64, 1000) == [(h + 4 * 2, h + 4 * nb), (h + 4 * nb + 64, h + 4 * nb + 1000)]
    assert c.wire_nbytes((n,)) == h + 4 * nb + n
    assert c.part_ranges(n, 1000, 1000) == [(h, h), (h + 4 * nb + 1000,) * 2]  # empty: no bytes


@pytest.mark.parametrize("n,block", [(1000, 32), (4099, 256), (64, 64)])
def test_a_payload_written_in_parts_equals_the_whole(n, block):
    g = torch.Generator().manual_seed(n)
    x, acc0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    x[n // 3] = float("nan")  # a NaN block decodes to NaN either way
    c = gc.Int8Quantizer(block_size=block)
    parts = pipelined.segments(n, 3, c.part_align())
    assert c.part_align() == block

    whole = c.compress(x)
    q = c.open_wire(n)
    for a, b in parts:
        c.compress_part_(x[a:b], q, a, b)
    assert torch.equal(q.wire, whole.wire)
    assert c.counter == 2  # one per payload, as compress

    r0 = torch.randn(n, generator=g)  # error feedback: x + residual quantized, the error kept
    ef = gc.ErrorFeedback(gc.Int8Quantizer(block_size=block))
    ef.residuals["k"] = r0.clone()
    whole_ef = ef.compress(x, key="k")
    r = r0.clone()
    q = c.open_wire(n)
    for a, b in parts:
        c.compress_part_(x[a:b], q, a, b, residual=r[a:b])
    assert torch.equal(q.wire, whole_ef.wire)
    assert torch.equal(_bits(r), _bits(x + r0 - gc.Int8Quantizer(block_size=block).decompress(whole_ef)))

    p = gc.Int8Quantizer(block_size=block).compress(torch.randn(n, generator=g))
    for divisor, decode in ((1, False), (3, True)):
        acc_whole, acc_parts = acc0.clone(), acc0.clone()
        want = c.reduce_compress_(p, acc_whole, divisor=divisor, decode=decode)
        q = c.open_wire(n)
        for a, b in parts:
            c.reduce_compress_part_(p, acc_parts[a:b], q, a, b, divisor=divisor, decode=decode)
        assert torch.equal(q.wire, want.wire)
        assert torch.equal(_bits(acc_parts), _bits(acc_whole))

    out = torch.empty(n)
    for a, b in parts:
        c.decompress_part_(whole, a, b, out[a:b])
    assert torch.equal(_bits(out), _bits(c.decompress(whole)))


def test_only_nearest_int8_has_parts():
    assert gc.Int8Quantizer(rounding="stochastic").part_align() == 0
    for c in (gc.NoCompression(), gc.FP16(), gc.BF16(), gc.TopK(ratio=0.1)):
        assert c.part_align() == 0, c

    class Mine(gc.Int8Quantizer):
        def compress(self, t, *, out=None):
            return super().compress(t, out=out)

    assert Mine().part_align() == 0  # a subclass's own compress must run


def test_a_bad_segment_raises_payload_error():
    c = gc.Int8Quantizer(block_size=32)
    p = c.compress(torch.randn(256))
    p.codes[100] = -128  # outside the format
    p = gc.wire.decode(p.wire, check_int8=False)
    with pytest.raises(gc.PayloadError):
        c.decompress_part_(p, 64, 128, torch.empty(64))


# ------------------------------------------------------- across processes
CASES = [  # (numel, block size, op, error feedback)
    (5003, 32, "avg", "keyed"),
    (4099, 256, "sum", "flat"),
    (3000, 64, "avg", "none"),
]


def _collective(x, case, force_whole):
    n, block, op, ef = case
    inner = gc.Int8Quantizer(block_size=block)
    comp = gc.ErrorFeedback(inner) if ef == "keyed" else inner
    residual = torch.linspace(-0.01, 0.01, n) if ef == "flat" else None
    meter = gc.TrafficMeter()
    runs = []
    real = pipelined.allreduce

    def counted(*a, **k):
        runs.append(1)
        return real(*a, **k)

    pipelined.allreduce = counted
    applies = pipelined.applies
    if force_whole:
        pipelined.applies = lambda *a: False
    try:
        ys = [gc.allreduce(x, comp, op=op, key="w", residual=residual, meter=meter, timeout=30)
              for _ in range(2)]  # the second call starts from the first's residuals
    finally:
        pipelined.allreduce, pipelined.applies = real, applies
    phases = {ph: {k: v for k, v in d.items() if k != "seconds"} for ph, d in meter.as_dict()["phases"].items()
              if ph != "agreement"}  # only the first of the two collectives agrees
    res = comp.residuals if ef == "keyed" else ({0: residual} if ef == "flat" else {})
    return ys, phases, {k: r.clone() for k, r in res.items()}, len(runs), inner.counter


def _compare(rank, world):
    pipelined.MIN_SEGMENT_NUMEL, pipelined.MAX_SEGMENTS = 200, 8  # several segments per chunk at test sizes
    out = []
    for i, case in enumerate(CASES):
        g = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(case[0], generator=g) * (1 + rank)
        if i == 0 and rank == 1:
            x[77] = float("inf")  # a non-finite block: NaN in the result, its residual reset
        seg = _collective(x, case, force_whole=False)
        whole = _collective(x, case, force_whole=True)
        same_y = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(seg[0], whole[0]))
        same_r = seg[2].keys() == whole[2].keys() and all(torch.equal(_bits(seg[2][k]), _bits(whole[2][k]))
                                                          for k in seg[2])
        out.append((same_y, same_r, seg[1] == whole[1], seg[3], whole[3], seg[4] == whole[4],
                    bool(torch.isnan(seg[0][0]).any())))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_ring_equals_the_unsegmented_ring(world):
    for rank, rows in enumerate(launch(_compare, world, timeout=TIMEOUT)):
        for case, (same_y, same_r, same_meter, runs_seg, runs_whole, same_counter, nan) in zip(CASES, rows):
            where = (world, rank, case)
            assert runs_seg == 2 and runs_whole == 0, where  # the pipeline ran, then did not
            assert same_y and same_r and same_meter and same_counter, (where, same_y, same_r, same_meter)
        assert rows[0][-1] and not rows[1][-1]  # the Inf reached every rank as NaN


def _changed_alone(rank, world):
    pipelined.MIN_SEGMENT_NUMEL, pipelined.MAX_SEGMENTS = 200, 8
    comp = gc.Int8Quantizer(block_size=32)
    gc.allreduce(torch.randn(5000), comp, timeout=10)  # agreed, pattern kept (pipelined)
    try:  # rank 2 alone changes its call: it checks, the others find its envelopes
        gc.allreduce(torch.randn(4000 if rank == 2 else 5000), comp, timeout=10)
        outcome = "ok"
    except ValueError as e:
        outcome = str(e)
    y = gc.allreduce(torch.full((10,), float(rank)), gc.NoCompression(), op="sum", timeout=10)
    return outcome, y.tolist()


@pytest.mark.slow
def test_a_rank_that_changes_its_call_alone_is_found_by_every_rank():
    for rank, (outcome, y) in enumerate(launch(_changed_alone, 3, timeout=TIMEOUT)):
        assert "numbers of elements" in outcome and "rank 2: 4000" in outcome, (rank, outcome)
        assert y == [3.0] * 10
