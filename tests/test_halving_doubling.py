"""gradcomp.allreduce(algorithm="halving_doubling") on real gloo groups (gradcomp.launch).

One launch of 8 processes covers every world size 1..8 (a subgroup of the
first ``w`` ranks for each). Error bound (int8, nearest rounding, see
tests/test_allreduce.py for the per-quantization bound): every reduction step
quantizes partial sums of disjoint sets of ranks, so per step the errors add
up to at most ``0.52 * 1.01 * A / 127`` with ``A`` the sum over ranks of each
rank's absolute maximum; ``log2 p`` halving steps, the owner's compression and,
when ``w`` is not a power of two, the folded ranks' own compression::

    |result - exact| <= (log2 p + 1 + [w > p]) * 0.52 * 1.01 * A / 127     (op="sum")

Bytes per rank (hand-derived, ``n`` a multiple of 256 p, ``W(L)`` the wire
bytes of ``L`` elements: ``48 + 4 L`` for NoCompression, ``48 + L * 257 / 256``
for int8 with 256-element blocks): a rank of the power-of-two group sends
``W(n / 2) + W(n / 4) + ... + W(n / p)`` while halving and ``(p - 1) W(n / p)``
while doubling, i.e. ``48 (log2 p + p - 1) + 2 (p - 1) / p * (W(n) - 48)``;
one with a folded partner also sends ``p W(n / p)`` to it; a folded rank sends
``W(n)``. Messages sent: ``2 log2 p`` (+1 for a fold partner), 1 for a folded rank.
"""

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import agreement, chunk_bounds
from gradcomp.comm.halving_doubling import ALIGN, fold_layout, gathered_offsets
from gradcomp.launch import launch

TIMEOUT = 240
WORLD = 8


def _wire(codec, numel):
    """Hand-derived wire bytes of a 1-D float32 payload (48-byte header)."""
    return {"none": 48 + 4 * numel, "int8": 48 + 4 * -(-numel // 256) + numel,
            "fp16": 48 + 2 * numel}[codec]


def _expected(codec, n, w, rank):
    """(bytes sent, messages sent, bytes received) at ``rank`` for n a multiple of 256 p."""
    p = 1 << (w.bit_length() - 1)
    rem = w - p
    steps = p.bit_length() - 1
    whole = _wire(codec, n)
    gathered = p * _wire(codec, n // p)
    if rank < 2 * rem and rank % 2 == 0:  # folded: its tensor out, every owner's bytes back
        return whole, 1, gathered
    core = 48 * (steps + p - 1) + 2 * (p - 1) * (whole - 48) // p
    if rank < 2 * rem:  # fold partner: the folded rank's tensor in, every owner's bytes out
        return core + gathered, 2 * steps + 1, core + whole
    return core, 2 * steps, core


def _members(fn, world):
    """Run ``fn(group, rank, w)`` on the first ``w`` ranks for w = 1..world; collect per w."""
    rank = dist.get_rank()
    out = {}
    for w in range(1, world + 1):
        group = dist.new_group(list(range(w)))
        if rank < w:
            out[w] = fn(group, rank, w)
        dist.barrier()
    return out


def _gather(t, group, w):
    flat = t.detach().reshape(-1).float().contiguous()
    out = [torch.empty_like(flat) for _ in range(w)]
    dist.all_gather(out, flat, group=group)
    return out


def _inputs(rank, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def _int8_bound(group, rank, w, n):
    x = _inputs(rank, n, n)
    y = gc.allreduce(x, gc.Int8Quantizer(), op="sum", algorithm="halving_doubling", group=group, timeout=30)
    ys = _gather(y, group, w)
    xs = [t.double() for t in _gather(x, group, w)]
    p = 1 << (w.bit_length() - 1)
    q = (p.bit_length() - 1) + 1 + (w > p)
    a = sum(float(t.abs().max()) for t in xs) if n else 0.0
    err = float((y.double() - torch.stack(xs).sum(0)).abs().max()) if n else 0.0
    return all(torch.equal(ys[0], t) for t in ys), err <= q * 0.52 * 1.01 * a / 127 + 1e-6 * a, (err, a, q)


def _exact_integers(group, rank, w):
    out = []
    for make in (gc.NoCompression, gc.FP16):
        for n in (1, 7, 1000):
            x = torch.randint(-100, 101, (n,), generator=torch.Generator().manual_seed(rank + n)).float()
            y = gc.allreduce(x, make(), op="sum", algorithm="halving_doubling", group=group, timeout=30)
            out.append(torch.equal(y, torch.stack(_gather(x, group, w)).sum(0)))
    return all(out)


def _traffic(group, rank, w):
    out = []
    n = 2**16
    for codec, make in (("none", gc.NoCompression), ("int8", gc.Int8Quantizer)):
        agreement.forget(group)
        meter = gc.TrafficMeter()
        gc.allreduce(_inputs(rank, n, 3), make(), algorithm="halving_doubling", group=group, meter=meter,
                     timeout=30)
        d = meter.as_dict()["phases"]
        payload = {k: v for k, v in d.items() if k != "agreement"}
        got = (sum(v["bytes_sent"] for v in payload.values()), sum(v["messages_sent"] for v in payload.values()),
               sum(v["bytes_received"] for v in payload.values()))
        out.append((codec, got, _expected(codec, n, w, rank)))
    return out


def _error_feedback(group, rank, w):
    n = 1000
    p, me, partner = fold_layout(w, rank)
    ef = gc.ErrorFeedback(gc.Int8Quantizer())
    gc.allreduce(_inputs(rank, n, 5), ef, algorithm="halving_doubling", group=group, key="w", timeout=30)
    if w == 1 or (me >= 0 and partner >= 0):
        expected = set()  # nothing sent, or (a fold partner) only partial sums compressed
    elif me < 0:
        expected = {("w", ("halving_doubling", 0, n))}  # a folded rank: its whole tensor
    else:  # the half of chunks [0, p) it sends first, at distance p / 2
        cb = chunk_bounds(n, p)
        give = (0, p // 2) if me >= p // 2 else (p // 2, p)
        expected = {("w", ("halving_doubling", cb[give[0]][0], cb[give[1] - 1][1]))}
    return set(ef.residuals) == expected, sorted(map(str, ef.residuals))


def _dtypes_and_out(group, rank, w):
    ok = []
    for dtype in (torch.float16, torch.bfloat16):
        x = _inputs(rank, 4097, 9, dtype).view(17, 241)
        ref = gc.allreduce(x, gc.Int8Quantizer(), algorithm="halving_doubling", group=group, timeout=30)
        ok.append(ref.dtype == dtype and ref.shape == x.shape)
        ok.append(all(torch.equal(_gather(ref, group, w)[0], t) for t in _gather(ref, group, w)))
        assert gc.allreduce(x, gc.Int8Quantizer(), algorithm="halving_doubling", group=group, out=x,
                            timeout=30) is x
        ok.append(torch.equal(x, ref))
    return all(ok)


def _everything(rank, world):
    results = {}
    results["bound"] = _members(lambda g, r, w: [_int8_bound(g, r, w, n) for n in (0, 1, w - 1, 1031, 4099)],
                                world)
    results["integers"] = _members(_exact_integers, world)
    results["traffic"] = _members(_traffic, world)
    results["ef"] = _members(_error_feedback, world)
    results["dtypes"] = _members(_dtypes_and_out, world)
    results["disagree"] = _members(_disagreement, world)
    return results


def _disagreement(group, rank, w):
    """All ranks agree on a call, then one rank alone changes it: every rank raises
    the same ValueError (folded, fold partner and plain ranks take turns)."""
    if w < 2:
        return []
    outcomes = []
    for changer in sorted({0, 1 % w, w - 1}):
        x = torch.randn(600)
        gc.allreduce(x, gc.Int8Quantizer(), algorithm="halving_doubling", group=group, timeout=30)
        try:
            gc.allreduce(torch.randn(599) if rank == changer else x, gc.Int8Quantizer(),
                         algorithm="halving_doubling", group=group, timeout=20)
            outcomes.append("ok")
        except ValueError as e:
            outcomes.append("numbers of elements" in str(e) and f"rank {changer}: 599" in str(e))
        # the group still works
        y = gc.allreduce(torch.full((10,), float(rank)), gc.NoCompression(), op="sum",
                         algorithm="halving_doubling", group=group, timeout=20)
        outcomes.append(y.tolist() == [float(w * (w - 1) // 2)] * 10)
    return outcomes


# ---------------------------------------------------------------------- fast tests
@pytest.mark.parametrize("world", range(1, 17))
def test_layout_folds_the_extra_ranks_into_a_power_of_two(world):
    p = 1 << (world.bit_length() - 1)
    rows = [fold_layout(world, r) for r in range(world)]
    assert all(row[0] == p for row in rows)
    assert sorted(me for _, me, _ in rows if me >= 0) == list(range(p))  # a bijection onto [0, p)
    extras = [r for r, (_, me, _) in enumerate(rows) if me < 0]
    assert extras == list(range(0, 2 * (world - p), 2))  # MPICH: the even ranks below 2 (N - p)
    for r in extras:
        assert rows[r][2] == r + 1 and rows[r + 1][2] == r


def test_gathered_offsets_are_aligned():
    offs = gathered_offsets([5, 8, 13, 0, 1])
    assert offs == [0, 8, 16, 32, 32, 40]
    assert all(o % ALIGN == 0 for o in offs)


def test_byte_formula_matches_the_step_by_step_sum():
    # the closed form in _expected against a step-by-step sum over the schedule
    for w in range(2, 9):
        p = 1 << (w.bit_length() - 1)
        n = 256 * p * 3
        for r in range(w):
            _, me, partner = fold_layout(w, r)
            if me < 0:
                continue
            halving = sum(_wire("int8", n // 2**s) for s in range(1, p.bit_length()))
            doubling = (p - 1) * _wire("int8", n // p)
            extra = p * _wire("int8", n // p) if partner >= 0 else 0
            assert _expected("int8", n, w, r)[0] == halving + doubling + extra


@pytest.mark.parametrize("comp", [gc.TopK(ratio=0.1), gc.Threshold(1.0)])
def test_sparse_compressors_are_refused(comp):
    with pytest.raises(ValueError, match="algorithm 'halving_doubling' needs a dense compressor"):
        gc.allreduce(torch.ones(4), comp, algorithm="halving_doubling")


# ---------------------------------------------------------------------- multi-process
@pytest.fixture(scope="module")
def everything():
    return launch(_everything, WORLD, timeout=TIMEOUT)


@pytest.mark.slow
def test_bit_identical_and_within_the_int8_bound_at_every_world(everything):
    for res in everything:
        for w, cases in res["bound"].items():
            for same, within, info in cases:
                assert same, (w, info)
                assert within, (w, info)


@pytest.mark.slow
def test_integer_sums_exact_with_exact_codecs(everything):
    for res in everything:
        assert all(res["integers"].values()), res["integers"]


@pytest.mark.slow
def test_bytes_and_messages_per_rank_match_the_hand_formula(everything):
    for rank, res in enumerate(everything):
        for w, rows in res["traffic"].items():
            for codec, got, want in rows:
                if w == 1:
                    assert got == (0, 0, 0)
                    continue
                assert got == want, (rank, w, codec, got, want)


@pytest.mark.slow
def test_error_feedback_keys_the_data_a_rank_compresses_alone(everything):
    for res in everything:
        for w, (ok, keys) in res["ef"].items():
            assert ok, (w, keys)


@pytest.mark.slow
def test_half_precision_inputs_and_in_place(everything):
    for res in everything:
        assert all(res["dtypes"].values())


@pytest.mark.slow
def test_a_rank_that_changes_its_call_alone_makes_every_rank_raise(everything):
    for res in everything:
        for w, outcomes in res["disagree"].items():
            assert all(o is True for o in outcomes), (w, outcomes)
