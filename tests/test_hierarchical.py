"""The hierarchical allreduce and its topology, on real gloo groups over loopback.

Hosts are emulated by ``GRADCOMP_HOST_ID`` (or ``gc.Topology``): correctness
needs no network namespaces. Bytes per tier are checked against formulas
written out here: a 1-D payload of ``NoCompression`` is ``48 + 4 len`` bytes
(the 32-byte fixed header, one 8-byte dimension and 8 bytes of padding
before the data; gradcomp.wire), and the inter-host leg is the flat ring or
two-phase exchange over the ``H`` hosts of one local rank's shard.
"""

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp.comm import chunk_bounds
from gradcomp.comm.topology import Topology, check
from gradcomp.launch import launch

TIMEOUT = 120
HEADER = 48  # bytes before the data of a 1-D payload


def _host_env(world, hosts_of):
    return [{"GRADCOMP_HOST_ID": f"node{hosts_of(r)}"} for r in range(world)]


def _data(rank, n):
    """Integer-valued float32 data, different on every rank (sums exact in float32)."""
    i = torch.arange(n, dtype=torch.float32)
    return ((i * (rank + 3)) % 17) - 8 + rank


def _exact_sum(world, n):
    return sum(_data(r, n) for r in range(world))


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# ---------------------------------------------------------------- no processes
def test_topology_arguments():
    with pytest.raises(ValueError, match="at most one"):
        Topology(2, host="a")
    with pytest.raises(ValueError, match="ranks_per_host"):
        Topology(0)
    with pytest.raises(TypeError, match="ranks_per_host"):
        Topology("2")
    with pytest.raises(ValueError, match="inter_algorithm"):
        Topology(inter_algorithm="allgather")
    with pytest.raises(TypeError, match="host"):
        Topology(host=1.5)
    with pytest.raises(ValueError, match="host"):
        Topology(host=" ")
    with pytest.raises(ValueError, match="segments"):
        Topology(segments=17)
    assert Topology(2) == Topology(ranks_per_host=2) != Topology(2, inter_algorithm="two_phase")
    assert gc.Topology is Topology


def _row(host, claim=-1, kind=0, per=0, inter=0, segments=0):
    return (int(host is not None), 0 if host is None else hash(host) & (2**62 - 1), claim, kind, per, inter,
            segments)


def test_check_orders_hosts_and_names_every_bad_case():
    # hosts interleaved: ranks 0, 2 on one host, 1, 3 on the other
    assert check([_row("a"), _row("b"), _row("a"), _row("b")]) == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match=r"different numbers of ranks \(ranks \[0, 1, 2\]: 3, ranks \[3\]: 1\)"):
        check([_row("a"), _row("a"), _row("a"), _row("b")])
    with pytest.raises(ValueError, match=r"ranks \[2\] of 4 have no host id"):
        check([_row("a"), _row("a"), _row(None), _row("b")])
    with pytest.raises(ValueError, match=r"different topologies: ranks \[0, 1\] .*ranks_per_host=2.*ranks \[2\]"):
        check([_row("a", kind=1, per=2), _row("a", kind=1, per=2), _row("b", kind=1, per=1)])
    with pytest.raises(ValueError, match=r"ranks_per_host=2 does not divide the group's 3 ranks"):
        check([_row("a", kind=1, per=2), _row("a", kind=1, per=2), _row("b", kind=1, per=2)])
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE \[4\]"):
        check([_row("a", claim=4), _row("a", claim=4), _row("b", claim=4), _row("b", claim=4)])
    with pytest.raises(ValueError, match="different topologies"):
        check([_row("a", inter=0), _row("a", inter=1)])
    with pytest.raises(ValueError, match="segments=2.*segments=None"):
        check([_row("a", segments=2), _row("a")])


# -------------------------------------------------------------- multi-process
def _inter_sent(make, shard_len, hosts, i):
    """Wire bytes one local rank (index ``i`` in its inter-host group) sends on the
    inter-host leg: the flat algorithm over ``hosts`` ranks on its shard."""
    lens = [hi - lo for lo, hi in chunk_bounds(shard_len, hosts)]
    wire = [make(k) for k in lens]
    # ring and two-phase alike: the reduce-scatter sends every chunk but chunk i
    # (to the next rank, or to its owner), the allgather every chunk but chunk i + 1
    rs = sum(wire[j] for j in range(hosts) if j != i)
    ag = sum(wire[j] for j in range(hosts) if j != (i + 1) % hosts)
    return rs + ag


def _shapes_case(rank, world, hosts, per, inter, via):
    """Bit-identity (int8), exact integer sums (none, fp16), the tier bytes, avg == sum / world.
    ``via="topology"`` also cuts every bucket into 3 pipelined segments."""
    segments = 3 if via == "topology" else 1
    topo = Topology(per, inter_algorithm=inter, segments=3) if via == "topology" else (
        Topology(inter_algorithm=inter) if inter != "ring" else None)
    host, local = rank // per, rank % per
    out = {}
    for n in (0, 1, 5, 1000, 3 * 4096 + 7):
        x = _data(rank, n)
        exact = _exact_sum(world, n)
        q = gc.allreduce(x, gc.Int8Quantizer(block_size=64), algorithm="hierarchical", topology=topo)
        assert all(torch.equal(q, t) for t in _gather(q)), (n, "int8 results differ between ranks")
        meters = {}
        for make in (gc.NoCompression, gc.FP16):
            meters[make] = meter = gc.TrafficMeter()
            y = gc.allreduce(x, make(), op="sum", algorithm="hierarchical", topology=topo, meter=meter)
            assert torch.equal(y, exact), (n, make.__name__)
        avg = gc.allreduce(x, gc.NoCompression(), op="avg", algorithm="hierarchical", topology=topo)
        assert torch.equal(avg, exact / world), n
        # tiers: NoCompression's meter, by the formulas of the module docstring. Per
        # segment (the bucket cut as chunk_bounds) a rank's shard is its chunk_bounds
        # chunk; the reduce-scatter sends the other local ranks' shards, raw float32;
        # the allgather sends the R - 1 others the H chunk payloads of this rank's
        # shard as the inter-host leg ended with them (HEADER + 4 len each)
        tiers = meters[gc.NoCompression].as_dict()["tiers"]
        intra_bytes = inter_bytes = 0
        for a, b in chunk_bounds(n, segments):
            lo, hi = chunk_bounds(b - a, per)[local]
            intra_bytes += 4 * (b - a - (hi - lo))
            if hi > lo:
                intra_bytes += (per - 1) * (hosts * HEADER + 4 * (hi - lo))
                inter_bytes += _inter_sent(lambda k: HEADER + 4 * k, hi - lo, hosts, host)
        assert tiers.get("intra_host", {}).get("bytes_sent", 0) == intra_bytes, (n, tiers)
        assert tiers.get("inter_host", {}).get("bytes_sent", 0) == inter_bytes, (n, tiers)
        out[n] = (intra_bytes, inter_bytes)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("hosts,per,inter,via", [(2, 2, "ring", "env"), (2, 3, "two_phase", "topology"),
                                                 (3, 2, "ring", "topology")])
def test_shapes_bit_identical_exact_and_tier_bytes(hosts, per, inter, via):
    world = hosts * per
    env = _host_env(world, lambda r: r // per) if via == "env" else None
    out = launch(_shapes_case, world, (hosts, per, inter, via), timeout=TIMEOUT, rank_env=env)
    # per host, the inter-host bytes are 2 (H - 1) / H of the bucket's payload bytes plus headers
    n = 3 * 4096 + 7
    per_host = sum(out[r][n][1] for r in range(per))
    payload = 4 * n * 2 * (hosts - 1) / hosts
    headers = 2 * (hosts - 1) * per * HEADER * (3 if via == "topology" else 1)
    assert payload < per_host <= payload + headers + 8 * per


def _interleaved(rank, world):
    """Hosts of ranks {0, 2} and {1, 3}: identical results, exact sums."""
    n = 4099
    x = _data(rank, n)
    y = gc.allreduce(x, gc.NoCompression(), op="sum", algorithm="hierarchical")
    assert torch.equal(y, _exact_sum(world, n))
    z = gc.allreduce(x, gc.Int8Quantizer(), algorithm="hierarchical")
    return z


@pytest.mark.slow
def test_hosts_need_not_be_contiguous():
    out = launch(_interleaved, 4, timeout=TIMEOUT, rank_env=_host_env(4, lambda r: r % 2))
    assert all(torch.equal(out[0], t) for t in out)


def _residual_case(rank, world, per):
    """A flat residual is delivered in full by a lossless codec, and with int8 kept only
    inside the shard this rank sends across hosts."""
    n = 1001
    x = _data(rank, n)
    res = (torch.arange(n, dtype=torch.float32) % 5) - 2 + rank
    expected = sum(_data(r, n) + (torch.arange(n, dtype=torch.float32) % 5) - 2 + r for r in range(world))
    y = gc.allreduce(x, gc.NoCompression(), op="sum", algorithm="hierarchical", residual=res)
    assert torch.equal(y, expected)
    assert not res.any()
    res2 = torch.zeros(n)
    gc.allreduce(x * 0.37, gc.Int8Quantizer(block_size=32), algorithm="hierarchical", residual=res2)
    lo, hi = chunk_bounds(n, per)[rank % per]
    assert not res2[:lo].any() and not res2[hi:].any()
    return bool(res2[lo:hi].any())


@pytest.mark.slow
def test_residual_delivered_outside_the_shard_kept_inside():
    out = launch(_residual_case, 4, (2,), timeout=TIMEOUT, rank_env=_host_env(4, lambda r: r // 2))
    assert any(out)  # some rank compressed alone and kept an error


def _bad(rank, world, case):
    meter = gc.TrafficMeter()
    x = _data(rank, 64)
    topo = None
    if case == "spec":
        topo = Topology(2 if rank != 1 else 1)
    try:
        gc.allreduce(x, gc.Int8Quantizer(), algorithm="hierarchical", topology=topo, meter=meter)
    except ValueError as e:
        err = str(e)
    else:
        err = None
    sent = meter.bytes_sent
    # the group is still usable: a flat allreduce afterwards
    y = gc.allreduce(x, gc.NoCompression(), op="sum")
    return err, sent, torch.equal(y, _exact_sum(world, 64))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sizes", "missing", "spec"])
def test_a_bad_topology_raises_the_same_error_on_every_rank(case):
    if case == "sizes":
        env = [{"GRADCOMP_HOST_ID": h} for h in ("a", "a", "a", "b")]
    elif case == "missing":
        env = [{"GRADCOMP_HOST_ID": h} for h in ("a", "a", "b")] + [{}]
    else:
        env = None
    out = launch(_bad, 4, (case,), timeout=TIMEOUT, rank_env=env)
    errors = {o[0] for o in out}
    assert len(errors) == 1 and None not in errors, errors
    want = {"sizes": "different numbers of ranks", "missing": "ranks [3] of 4 have no host id",
            "spec": "different topologies"}[case]
    assert want in errors.pop()
    assert all(o[1] == 0 for o in out)  # nothing moved
    assert all(o[2] for o in out)


def _ddp_and_localsgd(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    ddp = DDP(model)
    meter = gc.TrafficMeter()
    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer(), algorithm="hierarchical", start_iter=0,
                                 min_compress_numel=0, meter=meter, topology=Topology(2))
    ddp.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()
    state.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same_ddp = all(torch.equal(flat, t) for t in _gather(flat))
    tiers = meter.as_dict()["tiers"]

    torch.manual_seed(1 + rank)  # LocalSGD broadcasts rank 0's parameters first
    net = torch.nn.Linear(40, 30)
    ls = gc.LocalSGD(net, sync_every=2, compressor=gc.Int8Quantizer(), algorithm="hierarchical",
                     topology=Topology(2))
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        inner.zero_grad()
        net(torch.randn(4, 40, generator=g)).square().mean().backward()
        inner.step()
        ls.step()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    same_local = all(torch.equal(flat, t) for t in _gather(flat))
    return same_ddp, tiers["intra_host"]["bytes_sent"] > 0, tiers["inter_host"]["bytes_sent"] > 0, same_local


@pytest.mark.slow
def test_ddp_hook_and_localsgd_end_bit_identical():
    out = launch(_ddp_and_localsgd, 4, timeout=TIMEOUT)
    assert all(all(o) for o in out), out


def test_topology_only_with_hierarchical():
    with pytest.raises(ValueError, match="hierarchical"):
        gc.allreduce(torch.ones(4), gc.Adaptive(), topology=Topology(2))
    with pytest.raises(ValueError, match="hierarchical"):
        gc.ddp.GradCompState(algorithm="ring", topology=Topology(2))
    with pytest.raises(TypeError, match="topology"):
        gc.ddp.GradCompState(algorithm="hierarchical", topology=2)


def _sparse_rejected(rank, world):
    with pytest.raises(ValueError, match="dense"):
        gc.allreduce(torch.ones(8), gc.TopK(k=2), algorithm="hierarchical")
    with pytest.raises(ValueError, match="hierarchical"):
        gc.allreduce(torch.ones(8), gc.Int8Quantizer(), algorithm="ring", topology=Topology(1))
    return True


@pytest.mark.slow
def test_bad_calls_raise_before_anything_moves():
    assert launch(_sparse_rejected, 2, timeout=TIMEOUT) == [True, True]


def _large_and_degenerate(rank, world, per):
    """The inter-host leg on the segment-pipelined ring (chunks of 2**18 elements,
    int8 nearest), and one host or one rank per host: identical results, exact sums."""
    if world // per > 1 and per > 1:
        n = 2**20
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        y = gc.allreduce(x, gc.Int8Quantizer(), algorithm="hierarchical", topology=Topology(per, segments=1))
        assert all(torch.equal(y, t) for t in _gather(y))
        exact = torch.stack(_gather(x)).double().mean(0)
        assert float((y.double() - exact).norm() / exact.norm()) < 0.02
    n = 4097
    x = _data(rank, n)
    y = gc.allreduce(x, gc.NoCompression(), op="sum", algorithm="hierarchical", topology=Topology(per))
    assert torch.equal(y, _exact_sum(world, n))
    z = gc.allreduce(x, gc.Int8Quantizer(), algorithm="hierarchical", topology=Topology(per, segments=2))
    assert all(torch.equal(z, t) for t in _gather(z))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world,per", [(4, 2), (3, 3), (3, 1)])
def test_pipelined_inter_leg_one_host_and_one_rank_per_host(world, per):
    assert launch(_large_and_degenerate, world, (per,), timeout=TIMEOUT) == [True] * world
