"""algorithm="auto" (gradcomp.comm.auto) and the link cost model (gradcomp.comm.cost).

The cost model's numbers are checked against formulas worked by hand here (wire bytes of a
1-D float32 payload: a 48-byte header plus ``4 L`` for NoCompression, ``L + 4 ceil(L / 256)``
for int8 with 256-element blocks). The multi-process tests run on gloo (gradcomp.launch, free
ports, a timeout on every wait) and inject timings through the chooser's ``timing`` hook, so
which algorithm wins is decided by the test, not by the machine's load.
"""

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import cost
from gradcomp.comm.auto import default_for, residual_key
from gradcomp.launch import launch

TIMEOUT = 120


def _w(codec, numel):
    return {"none": 48 + 4 * numel, "int8": 48 + 4 * -(-numel // 256) + numel}[codec]


# ---- the cost model ---------------------------------------------------------------
LINK = cost.Link(1e-3, 1e6)


def test_cost_ring_and_two_phase_by_hand():
    n, N, c = 4096, 4, gc.NoCompression()
    hop = 1e-3 + _w("none", 1024) / 1e6  # one chunk of 1024 elements
    assert cost.transfer_seconds("ring", c, n, N, LINK) == pytest.approx(6 * hop, rel=1e-12)
    # the direct reduce-scatter: 3 messages at once on one port, then the ring allgather
    two = (3e-3 + 3 * _w("none", 1024) / 1e6) + 3 * hop
    assert cost.transfer_seconds("two_phase", c, n, N, LINK) == pytest.approx(two, rel=1e-12)
    assert cost.transfer_steps("ring", c, n, N) == [("inter", 1, 4144)] * 6


def test_cost_halving_doubling_by_hand():
    c = gc.NoCompression()
    # N = 4: halves of 2048 and 1024 elements, then blocks of 1 and 2 owners' payloads
    steps = [_w("none", 2048), _w("none", 1024), _w("none", 1024), 2 * _w("none", 1024)]
    assert cost.transfer_seconds("halving_doubling", c, 4096, 4, LINK) == pytest.approx(
        4e-3 + sum(steps) / 1e6, rel=1e-12)
    # N = 3 folds into p = 2: the folded tensor, one halving, one doubling, p payloads back
    steps = [_w("none", 4096), _w("none", 2048), _w("none", 2048), 2 * _w("none", 2048)]
    assert cost.transfer_seconds("halving_doubling", c, 4096, 3, LINK) == pytest.approx(
        4e-3 + sum(steps) / 1e6, rel=1e-12)


def test_cost_sparse_by_hand():
    c = gc.TopK(ratio=0.01)
    n, N = 10000, 4
    whole = c.wire_nbytes((n,))
    ag = 3 * (1e-3 + 8 / 1e6) + 3 * (1e-3 + whole / 1e6)
    assert cost.transfer_seconds("allgather", c, n, N, LINK) == pytest.approx(ag, rel=1e-12)
    region = c.wire_nbytes((2500,))
    srs = (3e-3 + 3 * region / 1e6) + 3 * (1e-3 + region / 1e6)
    assert cost.transfer_seconds("sparse_reduce_scatter", c, n, N, LINK) == pytest.approx(srs, rel=1e-12)
    # the allgather's bytes grow with N (15 payloads at N = 16), the reduce-scatter's stay near
    # 2 (N - 1) / N payloads (1.875): about 8x apart on a bandwidth-bound link
    big, flat = 1 << 20, cost.Link(0, 1e6)
    ratio = (cost.transfer_seconds("allgather", c, big, 16, flat)
             / cost.transfer_seconds("sparse_reduce_scatter", c, big, 16, flat))
    assert 7 < ratio < 8.1


def test_cost_hierarchical_by_hand():
    c, intra = gc.Int8Quantizer(), cost.Link(1e-4, 1e8)
    # 2 hosts x 2 ranks, 4096 elements: shards of 2048, chunks of 1024 across hosts
    rs = 1e-4 + 4 * 2048 / 1e8  # one float32 shard to the other local rank
    inter = 2 * (1e-3 + 2 * _w("int8", 1024) / 1e6)  # 2 ring steps, both ranks of a host on its link
    ag = 2e-4 + 2 * _w("int8", 1024) / 1e8  # the shard's 2 chunk payloads to the other local rank
    got = cost.transfer_seconds("hierarchical", c, 4096, 4, LINK, intra=intra, hosts=2, per_host=2)
    assert got == pytest.approx(rs + inter + ag, rel=1e-12)
    with pytest.raises(ValueError, match="hosts x per_host"):
        cost.transfer_steps("hierarchical", c, 4096, 4, hosts=3, per_host=2)


def test_cost_messages_and_the_lab_uses_them():
    from gradcomp.lab.plan import costs as lab
    assert cost.allreduce_messages("ring", 8) == 14
    assert [cost.allreduce_messages("halving_doubling", 6, r) for r in range(6)] == [1, 5, 1, 5, 4, 4]
    for alg in ("ring", "two_phase", "allgather", "halving_doubling", "sparse_reduce_scatter"):
        for w in (1, 3, 8):
            assert lab.allreduce_messages(alg, w, w - 1) == cost.allreduce_messages(alg, w, w - 1)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        cost.allreduce_messages("hierarchical", 4)


# ---- bad arguments -----------------------------------------------------------------
def test_bad_arguments():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="'auto'"):
        gc.allreduce(x, gc.Int8Quantizer(), algorithm="fastest")
    with pytest.raises(ValueError, match="margin"):
        gc.AutoAlgorithm(margin=1.5)
    with pytest.raises(ValueError, match="explore"):
        gc.AutoAlgorithm(explore=0)
    with pytest.raises(ValueError, match="prune"):
        gc.AutoAlgorithm(prune=1)
    with pytest.raises(ValueError, match="latency_s"):
        gc.AutoAlgorithm(link=(-1.0, 1e9))
    with pytest.raises(ValueError, match="bytes_per_s"):
        gc.AutoAlgorithm(intra_link=(0.0, 0.0))
    with pytest.raises(TypeError, match="link"):
        gc.AutoAlgorithm(link="10gbit")
    with pytest.raises(TypeError, match="timing"):
        gc.AutoAlgorithm(timing=3)
    with pytest.raises(ValueError, match="adaptive policy"):
        gc.allreduce(x, gc.Adaptive(), algorithm="auto")
    with pytest.raises(ValueError, match="'hierarchical' or 'auto' only"):
        gc.allreduce(x, gc.Int8Quantizer(), algorithm="ring", topology=gc.Topology(ranks_per_host=2))
    with pytest.raises(ValueError, match="'auto'"):
        gc.ddp.GradCompState(algorithm="fastest")


# ---- on real groups -------------------------------------------------------------------
def _gathered(t, group, w):
    flat = t.detach().reshape(-1).float().contiguous()
    out = [torch.empty_like(flat) for _ in range(w)]
    dist.all_gather(out, flat, group=group)
    return out


def _same_everywhere(t, group, w):
    return all(torch.equal(o, t.reshape(-1).float()) for o in _gathered(t, group, w))


def _skewed(group, rank, w):
    """int8: rank 0 sees the ring 1000x slower, rank 1 two-phase: every rank must
    still pick halving-doubling (their agreed MAX), and stay bit-identical."""
    def timing(key, alg, s):
        slow = {0: "ring", 1: "two_phase"}.get(rank)
        return s * 1000 if alg == slow else s

    auto = gc.AutoAlgorithm(explore=1, interval=3, timing=timing)
    meter = gc.TrafficMeter()
    g = torch.Generator().manual_seed(rank)
    same = True
    for _ in range(15):  # 6 exploring, 3 steady, a 6-call re-check
        y = gc.allreduce(torch.randn(3000, generator=g), gc.Int8Quantizer(), algorithm=auto, group=group,
                         key="dense", meter=meter)
        same &= _same_everywhere(y, group, w)
    chosen = ["ring", "two_phase", "halving_doubling"].index(auto.algorithm("dense"))
    everyone = _gathered(torch.tensor([float(chosen)]), group, w)
    return {"same": same, "chosen": auto.algorithm("dense"), "agree": len({int(e) for e in everyone}) == 1,
            "switches": [(s["kind"], s["from"], s["to"]) for s in meter.switches]}


def _phases(first, then, after):
    """A timing hook that makes ``first`` fastest for ``after`` calls, ``then`` afterwards."""
    calls = []

    def timing(key, alg, s):
        calls.append(alg)
        return 1.0 if alg == (first if len(calls) <= after else then) else 2.0
    return timing, calls


def _sparse_nothing_lost(group, rank, w):
    """TopK with error feedback, switched allgather -> sparse reduce-scatter: with integer
    values every sum is exact, so the applied sums plus the residuals equal the inputs' sum."""
    timing, calls = _phases("allgather", "sparse_reduce_scatter", 4)
    auto = gc.AutoAlgorithm(explore=1, interval=1, timing=timing)
    ef = gc.ErrorFeedback(gc.TopK(ratio=0.25))
    g = torch.Generator().manual_seed(100 + rank)
    applied, sent, same = torch.zeros(400), torch.zeros(400), True
    for _ in range(9):  # 4 exploring, 1 steady, a 4-call re-check
        x = torch.randint(-8, 9, (400,), generator=g).float()
        sent += x
        y = gc.allreduce(x, ef, op="sum", algorithm=auto, group=group, key="s")
        same &= _same_everywhere(y, group, w)
        applied += y
    residual = ef.residual(residual_key("s"))
    total_in = sum(_gathered(sent, group, w))
    total_res = sum(_gathered(residual, group, w))
    return {"same": same, "exact": torch.equal(applied + total_res, total_in), "keys": list(ef.residuals),
            "used": sorted(set(calls)), "switches": [(s["from"], s["to"]) for s in auto.switches]}


def _ef_carries_over(group, rank, w):
    """int8 with an ErrorFeedback under auto (switching ring -> two-phase) equals the same
    algorithms called in the same order with one explicit flat residual, bit for bit."""
    timing, calls = _phases("ring", "two_phase", 6)
    auto = gc.AutoAlgorithm(explore=1, interval=1, timing=timing, prune=float("inf"))
    ef = gc.ErrorFeedback(gc.Int8Quantizer())
    g = torch.Generator().manual_seed(200 + rank)
    xs = [torch.randn(1000, generator=g) for _ in range(13)]  # 6 exploring, 1 steady, a 6-call re-check
    got = [gc.allreduce(x, ef, algorithm=auto, group=group, key="e") for x in xs]
    r = torch.zeros(1000)
    ref = [gc.allreduce(x, gc.Int8Quantizer(), algorithm=a, group=group, residual=r) for x, a in zip(xs, calls)]
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, ref)),
            "residual": torch.equal(ef.residual(residual_key("e")), r),
            "switched": [(s["from"], s["to"]) for s in auto.switches]}


def _hierarchical(group, rank, w):
    """World 4 as 2 hosts x 2: hierarchical is a candidate; made the fastest, it is picked."""
    def timing(key, alg, s):
        return s if alg == "hierarchical" else s * 1000

    auto = gc.AutoAlgorithm(explore=1, timing=timing)
    g = torch.Generator().manual_seed(300 + rank)
    same = True
    for _ in range(9):
        y = gc.allreduce(torch.randn(2048, generator=g), gc.Int8Quantizer(), algorithm=auto, group=group,
                         key="h", topology=gc.Topology(ranks_per_host=2))
        same &= _same_everywhere(y, group, w)
    return {"same": same, "chosen": auto.algorithm("h"), "candidates": sorted(auto._tracks["h"].candidates)}


def _pruned(group, rank, w):
    """On a bandwidth-bound prior the sparse allgather's ``N - 1`` payloads are predicted
    ``N / 2`` times the reduce-scatter's: with prune=1.4 it is never timed at N >= 3."""
    auto = gc.AutoAlgorithm(link=(0.0, 1e6), prune=1.4)
    y = gc.allreduce(torch.randn(4000), gc.TopK(ratio=0.25), algorithm=auto, group=group, key="p")
    t = auto._tracks["p"]
    return {"candidates": t.candidates, "pruned": t.pruned, "chosen": auto.algorithm("p"),
            "same": _same_everywhere(y, group, w)}


def _everything(rank, world):
    # the hierarchical layout's groups first: torch's locally synchronised groups can meet
    # the store keys of an earlier group over the same ranks
    out = {"hierarchical": _hierarchical(dist.group.WORLD, rank, world)}
    for w in range(2, world + 1):
        group = dist.new_group(list(range(w)))
        if rank < w:
            out[w] = {"skewed": _skewed(group, rank, w), "sparse": _sparse_nothing_lost(group, rank, w),
                      "ef": _ef_carries_over(group, rank, w), "pruned": _pruned(group, rank, w)}
        dist.barrier()
    return out


@pytest.mark.slow
def test_auto_on_worlds_2_to_4():
    results = launch(_everything, 4, timeout=TIMEOUT)
    for rank, per_world in enumerate(results):
        h = per_world.pop("hierarchical")
        assert h["same"] and h["chosen"] == "hierarchical", (rank, h)
        assert h["candidates"] == ["halving_doubling", "hierarchical", "ring", "two_phase"]
        assert sorted(per_world) == list(range(max(2, rank + 1), 5))
        for w, r in per_world.items():
            sk = r["skewed"]
            assert sk["same"] and sk["agree"] and sk["chosen"] == "halving_doubling", (rank, w, sk)
            assert sk["switches"] == [("algorithm", None, "halving_doubling")], (rank, w, sk)
            sp = r["sparse"]
            assert sp["same"] and sp["exact"], (rank, w, sp)
            assert sp["keys"] == [("auto", "s")]
            assert sp["switches"] == [(None, "allgather"), ("allgather", "sparse_reduce_scatter")], (rank, w, sp)
            ef = r["ef"]
            assert ef["equal"] and ef["residual"], (rank, w, ef)
            assert ef["switched"] == [(None, "ring"), ("ring", "two_phase")], (rank, w, ef)
            pr = r["pruned"]
            assert pr["same"], (rank, w, pr)
            if w >= 3:  # predicted N / 2 >= 1.5 times slower: never timed, the other one runs at once
                assert pr["pruned"] == ["allgather"] and pr["candidates"] == ["sparse_reduce_scatter"], pr
                assert pr["chosen"] == "sparse_reduce_scatter"
            else:  # equal bytes at N = 2: both timed
                assert pr["pruned"] == [] and pr["chosen"] is None, pr


def test_chooser_pickles_without_its_hooks():
    import pickle
    auto = gc.AutoAlgorithm(link=(1e-4, 1e8), explore=2, timing=lambda k, a, s: s)
    back = pickle.loads(pickle.dumps(auto))
    assert back.timing is None and back.settings() == auto.settings()
    assert repr(back) == repr(auto)


def _training(rank, world):
    """The DDP hook and LocalSGD with algorithm="auto": the replicas stay identical."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    auto = gc.AutoAlgorithm(explore=1, interval=2)
    meter = gc.TrafficMeter()
    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer(), algorithm=auto, min_compress_numel=0,
                                 start_iter=0, meter=meter)
    model.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):  # 3 candidates x 2 exploring calls per bucket, then steady and re-checks
        opt.zero_grad()
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()
    state.close()
    ddp_same = all(_same_everywhere(p.detach(), None, world) for p in model.parameters())
    local = torch.nn.Linear(16, 8)
    ls = gc.LocalSGD(local, sync_every=1, compressor=gc.Int8Quantizer(), algorithm="auto")
    lopt = torch.optim.SGD(local.parameters(), lr=0.1)
    for _ in range(31):  # the default chooser: 5 rounds of 3 candidates x 2 exploring calls, then steady
        lopt.zero_grad()
        local(torch.randn(4, 16, generator=g)).square().mean().backward()
        lopt.step()
        ls.step()
    same = True
    for _ in range(31):  # algorithm="auto": the group's own chooser, default settings
        y = gc.allreduce(torch.randn(500, generator=g), gc.Int8Quantizer(), algorithm="auto", key="k")
        same &= _same_everywhere(y, None, world)
    return {"ddp": ddp_same, "switched": [s["kind"] for s in meter.switches], "plain": same,
            "plain_chosen": default_for(dist.group.WORLD).algorithm("k"),
            "chosen": {auto.algorithm(("bucket", i)) for i in range(len(auto._tracks))},
            "local": all(_same_everywhere(p.detach(), None, world) for p in local.parameters()),
            "local_chosen": ls.auto.algorithm(0)}  # LocalSGD keys its tracks by fragment index


@pytest.mark.slow
def test_ddp_hook_and_local_sgd_with_auto():
    results = launch(_training, 2, timeout=TIMEOUT)
    for r in results:
        assert r["ddp"] and r["local"], r
        assert r["switched"] and set(r["switched"]) == {"algorithm"}, r
        assert r["chosen"] <= {"ring", "two_phase", "halving_doubling"} and None not in r["chosen"], r
        assert r["local_chosen"] in ("ring", "two_phase", "halving_doubling"), r
        assert r["plain"] and r["plain_chosen"] in ("ring", "two_phase", "halving_doubling"), r
    assert results[0]["chosen"] == results[1]["chosen"]
