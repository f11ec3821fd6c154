"""gc.fsdp.apply on FSDP2 HSDP (a 2-D (replicate, shard) mesh), gloo, 4 processes as a 2x2 mesh.

Every scenario runs inside one launch (FSDP's first use in a process costs
seconds). The references are computed here, independently of gradcomp:
plain FSDP2 HSDP (its own gloo reduce-scatter and all-reduce) trained from the
same start on the same data; the average of integer-valued gradients written
out by hand; the wire size of an int8 payload from the payload format (48-byte
header, one code per element, one float32 scale per block of 256), and the
elements of each module's reduce-scatter output from FSDP's layout (dim 0
padded to a multiple of the shard group's size).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import gradcomp as gc
from gradcomp.launch import launch

TIMEOUT = 240
WORLD = 4
HEADER = 48  # bytes of a 1-D payload header (wire format version 1)
BLOCK = 256
STEPS = 3
SHAPES = [[(15, 300), (15,)], [(7, 15), (7,)], [(1, 7), (1,)]]  # each Linear's weight and bias


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 15), nn.Tanh(), nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 1))


def _mesh(grid=None):
    if grid is None:  # rows: shard groups {0, 1}, {2, 3} (hosts of 2); columns: replicate groups
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("replicate", "shard"))


def _shard(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 300, generator=g)
    return x, torch.sin(x[:, :1] * 2) + 0.3 * x[:, 1:2]


def _train(rank, model, steps=STEPS, meter=None, micro=1):
    """SGD steps; ``micro`` > 1: that many micro-batches a step, all but the last without
    the replicate all-reduce (``set_requires_all_reduce(False)``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if step == 1 and meter is not None:
            meter.reset()  # the first step's agreement left out: data bytes only
        for k in range(micro):
            model.set_requires_all_reduce(k == micro - 1)
            x, y = _data(rank + 10 * k, step)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _identical(rank, world):
    out = {}
    for alg in ("ring", "two_phase", "halving_doubling", "hierarchical"):
        model = _shard(_model(), _mesh())
        hsdp = gc.fsdp.apply(model, gc.Int8Quantizer(), algorithm=alg, topology=gc.Topology(ranks_per_host=2))
        out[alg] = _train(rank, model)
        if alg == "ring":  # the residuals: their keys and shapes, and a checkpoint's round trip
            out["residuals"] = {k: tuple(r.shape) for k, r in hsdp.residuals.items()}
            out["residual_norm"] = sum(float(r.abs().sum()) for r in hsdp.residuals.values())
            fresh = gc.fsdp.apply(_shard(_model(), _mesh()), gc.Int8Quantizer(),
                                  topology=gc.Topology(ranks_per_host=2))
            fresh.load_state_dict(hsdp.state_dict())
            out["reloaded"] = all(torch.equal(fresh.residuals[k], r) for k, r in hsdp.residuals.items())
    model = _shard(_model(), _mesh())
    gc.fsdp.apply(model, gc.Int8Quantizer(), shard_compressor=gc.Int8Quantizer(), algorithm="two_phase",
                  allgather=gc.Int8Quantizer())
    out["compressed_shard_leg_and_allgather"] = _train(rank, model)
    return out


def _exact(rank, world):
    """No compression on either leg against plain FSDP2 HSDP (torch's own reduce), and the
    calls of ``dist.all_reduce`` (FSDP's replicate all-reduce) each run made."""
    calls = []
    orig = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    out = {}
    dist.all_reduce = counted
    try:
        for name, kw in {"plain": None, "ring": {}, "hierarchical": {"algorithm": "hierarchical",
                                                                    "topology": gc.Topology(ranks_per_host=2)},
                         "gradcomp_shard_leg": {"shard_compressor": gc.NoCompression()}}.items():
            for setting in DIVIDE if name != "hierarchical" else DIVIDE[:1]:  # its leg is the ring's here
                model = _shard(_model(), _mesh())
                _divide(model, setting)
                if kw is not None:
                    gc.fsdp.apply(model, gc.NoCompression(), **kw)
                del calls[:]
                out[name, setting] = (_train(rank, model, micro=2 if setting == "accumulate" else 1), len(calls))
        # a factor FSDP's gloo reduce-scatter cannot apply (PREMUL_SUM), gradcomp's can: 4 = the world
        model = _shard(_model(), _mesh())
        _divide(model, "factor", 4.0)
        gc.fsdp.apply(model, gc.NoCompression(), shard_compressor=gc.NoCompression())
        out["gradcomp_shard_leg", "factor_world"] = (_train(rank, model), 0)
    finally:
        dist.all_reduce = orig
    return out


DIVIDE = ("default", "factor", "force_sum", "accumulate")  # accumulate: 2 micro-batches a step


def _divide(model, setting, factor=2.0):
    """FSDP's ways of dividing the sum: AVG (default), by a set factor (2: the shard group's size,
    what gloo's reduce-scatter can apply), or SUM and divide itself."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if setting == "factor":
                m.set_gradient_divide_factor(factor)
            elif setting == "force_sum":
                m.set_force_sum_reduction_for_comms(True)


def _two_per_host(rank, world):
    """A (4, 1) mesh: one replicate group of all 4 ranks, 2 on each host; "hierarchical" reduces
    exactly inside each host first (shard groups of 1: FSDP reduce-scatters nothing)."""
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
    out = {"plain": _train(rank, _shard(_model(), mesh))}
    for name, comp in (("exact", gc.NoCompression()), ("int8", gc.Int8Quantizer())):
        model = _shard(_model(), mesh)
        gc.fsdp.apply(model, comp, algorithm="hierarchical", topology=gc.Topology(ranks_per_host=2))
        out[name] = _train(rank, model)
    return out


def _integer_grads(rank, world):
    """One backward of integer-valued gradients: each rank's gradient shard."""
    out = {}
    for name, kw in {"ring": {}, "two_phase": {"algorithm": "two_phase"},
                     "hierarchical": {"algorithm": "hierarchical", "topology": gc.Topology(ranks_per_host=2)},
                     "gradcomp_shard_leg": {"shard_compressor": gc.NoCompression()}}.items():
        model = nn.Sequential(nn.Linear(6, 5, bias=False))
        _shard(model, _mesh())
        gc.fsdp.apply(model, gc.NoCompression(), **kw)
        x, c = _integer_inputs(rank)
        (model(x) * c).sum().backward()
        out[name] = model[0].weight.grad.to_local().clone()
    return out


def _integer_inputs(rank):
    x = torch.arange(12, dtype=torch.float32).view(2, 6) * (rank + 1) - 3 * rank
    c = torch.tensor([1.0, -2.0, 3.0, 0.0, 5.0])
    return x, c


def _metered(rank, world):
    out = {}
    for name, kw in {"ring": {}, "hierarchical": {"algorithm": "hierarchical"},
                     "int8_shard_leg": {"shard_compressor": gc.Int8Quantizer()}, "accumulate": {}}.items():
        meter = gc.TrafficMeter()
        model = _shard(_model(), _mesh())
        gc.fsdp.apply(model, gc.Int8Quantizer(), meter=meter, topology=gc.Topology(ranks_per_host=2), **kw)
        _train(rank, model, meter=meter, micro=2 if name == "accumulate" else 1)
        out[name] = meter.as_dict()
    return out


def _bad(rank, world):
    """Bad meshes and topologies: what each rank raised."""
    cases = {
        "shard_spans_hosts": lambda: gc.fsdp.apply(_shard(_model(), _mesh([[0, 2], [1, 3]])),
                                                   topology=gc.Topology(ranks_per_host=2)),
        "uneven_hosts": lambda: gc.fsdp.apply(_shard(_model(), _mesh()), algorithm="hierarchical",
                                              topology=gc.Topology(host="a" if rank < 3 else "b")),
        "flat_inside_a_host": lambda: gc.fsdp.apply(_shard(_model(), _mesh()), topology=gc.Topology(host="one")),
        "one_dim_mesh": lambda: gc.fsdp.apply(_shard(_model(), init_device_mesh("cpu", (world,))),
                                              algorithm="hierarchical"),
        "sparse_algorithm": lambda: gc.fsdp.apply(_shard(_model(), _mesh()), algorithm="allgather"),
        "sparse_compressor": lambda: gc.fsdp.apply(_shard(_model(), _mesh()), gc.TopK(ratio=0.1)),
        # settings that differ on one rank: every rank raises at apply
        "block_size_differs": lambda: gc.fsdp.apply(_shard(_model(), _mesh()),
                                                    gc.Int8Quantizer(128 if rank == 3 else 256)),
        "algorithm_differs": lambda: gc.fsdp.apply(_shard(_model(), _mesh()),
                                                   algorithm="two_phase" if rank == 3 else "ring"),
        "hierarchical_on_one_rank": lambda: gc.fsdp.apply(_shard(_model(), _mesh()),
                                                          algorithm="hierarchical" if rank == 3 else "ring"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    model = _shard(_model(), _mesh())
    gc.fsdp.apply(model)
    try:
        gc.fsdp.apply(model)
        out["twice"] = None
    except ValueError as e:
        out["twice"] = ("ValueError", str(e))
    return out


def _all(rank, world):
    torch.set_num_threads(1)
    return {"identical": _identical(rank, world), "exact": _exact(rank, world),
            "integer": _integer_grads(rank, world), "metered": _metered(rank, world), "bad": _bad(rank, world),
            "two_per_host": _two_per_host(rank, world),
            "start": [p.detach().clone() for p in _model().parameters()]}


@pytest.fixture(scope="module")
def results():
    return launch(_all, WORLD, timeout=TIMEOUT)


@pytest.mark.slow
def test_every_replica_and_shard_ends_bit_identical(results):
    for name, params in results[0]["identical"].items():
        if name in ("residuals", "residual_norm", "reloaded"):
            continue
        for r in results[1:]:
            for a, b in zip(params, r["identical"][name]):
                assert torch.equal(a, b), name
        assert any(not torch.equal(a, s) for a, s in zip(params, results[0]["start"])), name


@pytest.mark.slow
@pytest.mark.parametrize("setting", DIVIDE)
def test_exact_codec_equals_plain_fsdp2_hsdp(results, setting):
    for r in results:
        plain, plain_calls = r["exact"]["plain", setting]
        assert plain_calls > 0  # torch's HSDP all-reduces across the replicate group
        for name in ("ring", "hierarchical", "gradcomp_shard_leg"):
            if (name, setting) not in r["exact"]:
                continue
            params, calls = r["exact"][name, setting]
            assert calls == 0, name  # gradcomp's replicate leg replaced it
            for a, b in zip(params, plain):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_divide_factor_of_the_world_is_the_average(results):
    for r in results:
        params, _ = r["exact"]["gradcomp_shard_leg", "factor_world"]
        plain, _ = r["exact"]["plain", "default"]
        for a, b in zip(params, plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_residuals_per_parameter_shard_and_checkpoint(results):
    names = ["0", "2", "4"]  # the Linear layers' indices in the Sequential
    for rank, r in enumerate(results):
        rep, shard = divmod(rank, 2)
        expected = {}
        for name, mod in zip(names, SHAPES):
            for kind, shape in zip(("weight", "bias"), mod):
                rows = math.ceil(shape[0] / 2) * math.prod(shape[1:])
                expected[(f"{name}.{kind}", shape, 0, 2, shard, "replicate", 2, rep)] = (1, rows)
        assert r["identical"]["residuals"] == expected
        assert r["identical"]["residual_norm"] > 0  # int8 left an error to feed back
        assert r["identical"]["reloaded"]


@pytest.mark.slow
def test_replicate_group_with_two_ranks_per_host(results):
    for r in results:
        for a, b in zip(r["two_per_host"]["exact"], r["two_per_host"]["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(r["two_per_host"]["int8"], results[0]["two_per_host"]["int8"]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_integer_gradients_average_exactly(results):
    # d/dW[i, j] of sum_b (W x_b) . c  is  c_i * sum_b x_b[j]; the mean over the 4 ranks, by hand
    total = torch.zeros(5, 6)
    for rank in range(WORLD):
        x, c = _integer_inputs(rank)
        total += c[:, None] * x.sum(0)[None, :]
    expected = total / WORLD
    for rank, r in enumerate(results):
        shard = rank % 2  # rank = replicate index * 2 + shard index; dim 0 padded to 6: 3 rows per shard
        rows = expected[3 * shard:min(5, 3 * shard + 3)]
        for name, got in r["integer"].items():
            assert torch.equal(got, rows), (rank, name)


def _int8_wire(n):
    return HEADER + n + 4 * math.ceil(n / BLOCK)


def _outputs(shard=2):
    """Elements of each FSDP module's reduce-scatter output (dim 0 padded to a multiple of ``shard``)."""
    return [sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in mod) for mod in SHAPES]


@pytest.mark.slow
def test_meter_counts_each_tier_by_formula(results):
    steps = STEPS - 1  # the meter was reset after the first step
    # replicate leg: a 2-rank ring (or the hierarchical inter leg, 1 rank per host): each rank sends
    # the int8 payload of one half-chunk in the reduce-scatter and of the other in the allgather
    inter = steps * sum(_int8_wire(-(-m // 2)) + _int8_wire(m // 2) for m in _outputs())
    # shard leg: FSDP's float32 ring reduce-scatter over 2 ranks sends one chunk of 4 m bytes;
    # gradcomp's int8 one sends the other rank's chunk once
    intra = {"ring": steps * sum(4 * m for m in _outputs()),
             "int8_shard_leg": steps * sum(_int8_wire(m) for m in _outputs())}
    intra["hierarchical"] = intra["ring"]
    intra["accumulate"] = 2 * intra["ring"]  # 2 micro-batches reduce-scatter, only the last all-reduces
    for r in results:
        for name, d in r["metered"].items():
            tiers = d["tiers"]
            assert tiers["inter_host"]["bytes_sent"] == inter, name
            assert tiers["inter_host"]["bytes_received"] == inter, name
            assert tiers["intra_host"]["bytes_sent"] == intra[name], name
            assert tiers["intra_host"]["bytes_received"] == intra[name], name
            assert d["bytes_sent"] == inter + intra[name], name  # every byte counted in one tier
            assert tiers["inter_host"]["raw_bytes_sent"] == steps * sum(4 * m for m in _outputs()), name


@pytest.mark.slow
def test_bad_mesh_or_topology_raises_on_every_rank(results):
    expect = {"shard_spans_hosts": ("ValueError", "spans hosts"), "uneven_hosts": ("ValueError", "different numbers"),
              "flat_inside_a_host": ("ValueError", "hierarchical"), "one_dim_mesh": ("ValueError", "2-D"),
              "sparse_algorithm": ("ValueError", "algorithm"), "sparse_compressor": ("ValueError", "dense"),
              "twice": ("ValueError", "already"), "block_size_differs": ("ValueError", "compressor settings"),
              "algorithm_differs": ("ValueError", "two_phase"),
              "hierarchical_on_one_rank": ("ValueError", "hierarchical")}
    for name, (kind, word) in expect.items():
        got = [r["bad"][name] for r in results]
        assert all(g is not None for g in got), (name, got)
        assert all(g == got[0] for g in got), (name, got)  # the same error on every rank
        assert got[0][0] == kind and word in got[0][1], (name, got[0])


def test_replicate_all_reduce_checks_its_settings():
    from gradcomp.hsdp import ReplicateAllReduce

    with pytest.raises(ValueError, match="algorithm"):
        ReplicateAllReduce(gc.Int8Quantizer(), True, None, timeout=5.0, algorithm="allgather")
    with pytest.raises(TypeError, match="topology"):
        ReplicateAllReduce(gc.Int8Quantizer(), True, None, timeout=5.0, topology="2x2")
    rep = ReplicateAllReduce(gc.Int8Quantizer(), True, None, timeout=5.0)
    assert rep.uses_residuals and not ReplicateAllReduce(gc.NoCompression(), True, None, timeout=5.0).uses_residuals
    with pytest.raises(ValueError, match="state"):
        rep.load_state_dict({"x": 1})
    with pytest.raises(ValueError, match="shard_compressor"):
        rep.load_state_dict({"residuals": {}, "reduce_scatter": {}})


def test_flat_residual_views_per_key():
    from gradcomp.residual_views import flat_residual

    residuals, flats = {("b",): torch.full((1, 2), 7.0)}, {}
    flat = flat_residual(residuals, flats, "m", [(("a",), 0, 3), (("b",), 3, 5)], 5, 1, "cpu")
    assert flat.tolist() == [0, 0, 0, 7, 7]  # b's old residual copied in, a's new one zero
    flat[0] = 1.0
    assert residuals[("a",)].tolist() == [[1, 0, 0]]  # a view into the flat buffer
    assert flat_residual(residuals, flats, "m", [(("a",), 0, 3), (("b",), 3, 5)], 5, 1, "cpu") is flat
    grid = flat_residual(residuals, flats, "m", [(("a",), 0, 1)], 4, 2, "cpu")  # [2, 2]: column 0
    assert residuals[("a",)].shape == (2, 1) and grid.numel() == 4
