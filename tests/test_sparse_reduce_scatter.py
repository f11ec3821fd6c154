"""gradcomp.allreduce(algorithm="sparse_reduce_scatter") on real gloo groups (gradcomp.launch).

One launch of 8 processes covers every world size 1..8 (a subgroup of the
first ``w`` ranks for each). The result is compared bit for bit with an
oracle that follows the algorithm's definition on the gathered inputs: for
each region ``j`` (chunk ``j``), the owner's own elements plus every other
rank's locally compressed-and-decompressed region, in rank order, then that
sum compressed and decompressed once more.

Bytes per rank (hand-derived): a top-k payload of ``L`` elements keeping
``k = ceil(density L)`` is a 48-byte header, the index section (Elias-Fano:
``ceil(k b / 8) + ceil((k + ((L - 1) >> b)) / 8)`` bytes with
``b = floor(log2(L / k))``, or ``4 k`` when that is smaller, padded to 8) and
the values (int8: a 48-byte header, ``4 ceil(k / 256)`` bytes of scales and
``k`` codes). Rank ``r`` sends every region's payload but its own in the
reduce-scatter and every region's but ``r + 1``'s in the allgather.

Nothing lost: with error feedback and ``op="sum"``, ``sum(results) +
sum(residuals) == sum(inputs)`` over steps and ranks; exact for integer
inputs with raw (float32) values.
"""

import math

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import agreement, chunk_bounds
from gradcomp.launch import launch

TIMEOUT = 300
WORLD = 8
ALG = "sparse_reduce_scatter"


def _pad8(x):
    return -(-x // 8) * 8


def _topk_nbytes(numel, density, int8_values):
    """Hand-derived wire bytes of an exact top-k payload of ``numel`` elements."""
    k = max(1, math.ceil(density * numel)) if numel else 0
    index = _pad8(4 * k)
    if k:
        b = (numel // k).bit_length() - 1
        ef = _pad8(-(-k * b // 8) + -(-(k + ((numel - 1) >> b)) // 8))
        index = min(index, ef)
    values = 48 + (4 * -(-k // 256) + k if int8_values else 4 * k)
    return 48 + index + values


def _expected_sent(n, w, rank, density, int8_values):
    lens = [n // w + (1 if j < n % w else 0) for j in range(w)]  # chunk_bounds, by hand
    sizes = [_topk_nbytes(m, density, int8_values) for m in lens]
    return sum(sizes) - sizes[rank] + sum(sizes) - sizes[(rank + 1) % w]


def _members(fn, world):
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


def _make():
    return gc.TopK(ratio=0.05, values=gc.Int8Quantizer(block_size=32))


def _oracle(xs, w, op):
    """The algorithm's definition on every rank's input (see the module docstring)."""
    if w == 1:  # a group of one returns a copy (gc.allreduce's contract)
        return xs[0].clone()
    n = xs[0].numel()
    out = torch.zeros(n)
    for j, (lo, hi) in enumerate(chunk_bounds(n, w)):
        acc = xs[j][lo:hi].clone()
        for r in range(w):
            if r != j:
                c = _make()
                acc += c.decompress(c.compress(xs[r][lo:hi]))
        c = _make()
        out[lo:hi] = c.decompress(c.compress(acc))
    return out / w if op == "avg" else out


def _against_oracle(group, rank, w):
    out = []
    for n in (0, 1, w - 1, 1031, 2**14 + 3):
        for op in ("avg", "sum"):
            x = torch.randn(n, generator=torch.Generator().manual_seed(7 * n + rank)) * (1 + rank)
            y = gc.allreduce(x, _make(), op=op, algorithm=ALG, group=group, timeout=30)
            ys = _gather(y, group, w)
            same = all(torch.equal(ys[0], t) for t in ys)
            out.append((n, op, same, torch.equal(y, _oracle(_gather(x, group, w), w, op))))
    return out


def _exact_integers(group, rank, w):
    out = []
    for n in (1, 7, 1000):
        x = torch.randint(-100, 101, (n,), generator=torch.Generator().manual_seed(rank + n)).float()
        y = gc.allreduce(x, gc.TopK(ratio=1.0), op="sum", algorithm=ALG, group=group, timeout=30)
        out.append(torch.equal(y, torch.stack(_gather(x, group, w)).sum(0)))
    return all(out)


def _traffic(group, rank, w):
    n = 2**16
    out = []
    for density, values in ((0.01, gc.Int8Quantizer()), (0.05, None)):
        agreement.forget(group)
        meter = gc.TrafficMeter()
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        gc.allreduce(x, gc.TopK(ratio=density, values=values), algorithm=ALG, group=group, meter=meter, timeout=30)
        ph = {k: v for k, v in meter.as_dict()["phases"].items() if k != "agreement"}
        sent = sum(v["bytes_sent"] for v in ph.values())
        messages = sum(v["messages_sent"] for v in ph.values())
        want = _expected_sent(n, w, rank, density, values is not None) if w > 1 else 0
        out.append((sent, want, messages, 2 * (w - 1), sorted(ph)))
    return out


def _conservation(group, rank, w):
    """Integer inputs, raw values: sum(results) + sum(residuals) == sum(inputs), exactly."""
    n, steps = 1000, 5
    out = []
    for mode in ("flat", "keyed"):
        residual = torch.zeros(n) if mode == "flat" else None
        ef = gc.ErrorFeedback(gc.TopK(ratio=0.1)) if mode == "keyed" else None
        applied = torch.zeros(n)
        given = torch.zeros(n)
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + rank)
            x = torch.randint(-50, 51, (n,), generator=g).float()
            given += x
            comp = ef if ef is not None else gc.TopK(ratio=0.1)
            applied += gc.allreduce(x, comp, op="sum", algorithm=ALG, group=group, residual=residual,
                                    key="w", timeout=30)
        held = residual if residual is not None else torch.zeros(n)
        if ef is not None:
            bounds = chunk_bounds(n, w)
            for (_, j), r in ef.residuals.items():
                held[bounds[j][0]:bounds[j][1]] += r
        total_held = torch.stack(_gather(held, group, w)).sum(0)
        total_given = torch.stack(_gather(given, group, w)).sum(0)
        lo, hi = chunk_bounds(n, w)[rank]
        out.append((torch.equal(applied + total_held, total_given),  # nothing lost
                    w == 1 or bool(held[lo:hi].abs().sum() > 0),  # the owner's re-selection dropped something
                    w == 1 or not torch.equal(applied, total_given)))  # so the test is not trivial
    return out


def _disagreement(group, rank, w):
    if w < 2:
        return []
    outcomes = []
    for changer in sorted({0, w - 1}):
        x = torch.randn(600)
        gc.allreduce(x, gc.TopK(ratio=0.1), algorithm=ALG, group=group, timeout=30)
        try:
            gc.allreduce(torch.randn(599) if rank == changer else x, gc.TopK(ratio=0.1), algorithm=ALG,
                         group=group, timeout=20)
            outcomes.append("ok")
        except ValueError as e:
            outcomes.append("numbers of elements" in str(e) and f"rank {changer}: 599" in str(e))
        y = gc.allreduce(torch.full((10,), float(rank)), gc.TopK(ratio=1.0), op="sum", algorithm=ALG,
                         group=group, timeout=20)
        outcomes.append(y.tolist() == [float(w * (w - 1) // 2)] * 10)
    return outcomes


def _everything(rank, world):
    return {"oracle": _members(_against_oracle, world), "integers": _members(_exact_integers, world),
            "traffic": _members(_traffic, world), "conservation": _members(_conservation, world),
            "disagree": _members(_disagreement, world)}


# ---------------------------------------------------------------------- fast tests
@pytest.mark.parametrize("comp,match", [
    (gc.Threshold(1.0), "exact TopK with a ratio"),
    (gc.TopK(k=10), "exact TopK with a ratio"),
    (gc.TopK(ratio=0.1, exact=False), "exact TopK with a ratio"),
    (gc.ErrorFeedback(gc.TopK(k=3)), "exact TopK with a ratio"),
    (gc.Int8Quantizer(), "algorithm 'sparse_reduce_scatter' is for sparse compressors"),
])
def test_compressors_it_refuses(comp, match):
    with pytest.raises(ValueError, match=match):
        gc.allreduce(torch.ones(4), comp, algorithm=ALG)


@pytest.mark.parametrize("world", range(2, 9))
def test_bytes_per_rank_do_not_grow_with_the_world(world):
    # top-k 1% + int8 of 2**20 elements: under 2x one rank's whole payload and within
    # 10% of 2 (N - 1) / N times it (the allgather algorithm sends N - 1 times it)
    n = 2**20
    whole = _topk_nbytes(n, 0.01, True)
    assert whole == gc.TopK(ratio=0.01, values=gc.Int8Quantizer()).wire_nbytes((n,))
    for rank in range(world):
        sent = _expected_sent(n, world, rank, 0.01, True)
        assert sent < 2 * whole
        assert abs(sent / (2 * (world - 1) / world * whole) - 1) < 0.10, (world, rank, sent, whole)


# ---------------------------------------------------------------------- multi-process
@pytest.fixture(scope="module")
def everything():
    return launch(_everything, WORLD, timeout=TIMEOUT)


@pytest.mark.slow
def test_bit_identical_and_equal_to_the_oracle(everything):
    for res in everything:
        for w, rows in res["oracle"].items():
            for n, op, same, oracle in rows:
                assert same and oracle, (w, n, op, same, oracle)


@pytest.mark.slow
def test_integer_sums_exact_when_everything_is_kept(everything):
    for res in everything:
        assert all(res["integers"].values()), res["integers"]


@pytest.mark.slow
def test_bytes_and_messages_per_rank_match_the_hand_formula(everything):
    for res in everything:
        for w, rows in res["traffic"].items():
            for sent, want, messages, want_messages, phases in rows:
                assert sent == want and messages == want_messages, (w, sent, want, messages)
                assert w == 1 or phases == ["allgather", "reduce_scatter"]


@pytest.mark.slow
def test_nothing_is_lost_with_error_feedback(everything):
    for res in everything:
        for w, rows in res["conservation"].items():
            for exact, dropped, nontrivial in rows:
                assert exact and dropped and nontrivial, (w, exact, dropped, nontrivial)


@pytest.mark.slow
def test_a_rank_that_changes_its_call_alone_makes_every_rank_raise(everything):
    for res in everything:
        for w, outcomes in res["disagree"].items():
            assert all(o is True for o in outcomes), (w, outcomes)
