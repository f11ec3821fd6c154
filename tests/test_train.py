"""The training study (gradcomp.lab.study): data order, model, settings, and small
real studies on local processes whose bytes are checked against the wire-size
formulas."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math

import pytest
import torch

import gradcomp as gc
from gradcomp.comm import chunk_bounds
from gradcomp.comm.agreement import SIGNATURE_NBYTES
from gradcomp.launch import WorkerError
from gradcomp.ps import protocol as P
from gradcomp.lab.study import command
from gradcomp.lab.study.config import COMPRESSORS, DEFAULT_COMPRESSORS, TrainConfig, parse_compressors
from gradcomp.lab.study.data import load_digits_split, skewed_shard, steps_per_epoch, worker_batches
from gradcomp.lab.study.model import make_model, num_parameters
from gradcomp.lab.study.study import _launch_local, calibrate_threshold
from gradcomp.lab.study.torch_powersgd import TorchPowerSGD
from gradcomp.wire import dense_nbytes


# ---- pieces ------------------------------------------------------------------------
def test_digits_split_is_stratified_and_held_out():
    d = load_digits_split(0.25, seed=0)
    assert d.x_train.shape == (1347, 64) and d.x_test.shape == (450, 64)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    train_counts = torch.bincount(d.y_train, minlength=10).float()
    test_counts = torch.bincount(d.y_test, minlength=10).float()
    assert torch.allclose(test_counts / 450, train_counts / 1347, atol=0.01)
    again = load_digits_split(0.25, seed=0)
    assert torch.equal(d.x_test, again.x_test)


def test_worker_batches_partition_each_global_batch_and_repeat():
    n, workers, bs, steps = 100, 3, 8, 10  # 4 global batches per epoch
    per_rank = [list(worker_batches(n, workers, r, bs, seed=5, steps=steps)) for r in range(workers)]
    assert all(len(b) == steps for b in per_rank)
    for step in range(steps):
        together = torch.cat([per_rank[r][step] for r in range(workers)])
        assert together.unique().numel() == workers * bs  # disjoint within a step
    epoch0 = torch.cat([per_rank[r][s] for s in range(4) for r in range(workers)])
    assert epoch0.unique().numel() == 4 * workers * bs  # no repeat inside an epoch
    again = list(worker_batches(n, workers, 1, bs, seed=5, steps=steps))
    assert all(torch.equal(a, b) for a, b in zip(again, per_rank[1]))
    other = list(worker_batches(n, workers, 1, bs, seed=6, steps=steps))
    assert not all(torch.equal(a, b) for a, b in zip(other, per_rank[1]))
    assert steps_per_epoch(n, workers, bs) == 4
    with pytest.raises(ValueError, match="exceeds"):
        next(worker_batches(10, 2, 0, 8, seed=0, steps=1))


def test_skewed_shards_partition_the_data_with_dirichlet_class_proportions():
    y = torch.arange(2000) % 10  # 200 samples per class
    for alpha in (0.05, 1000.0):
        shards = [skewed_shard(y, 4, r, alpha, seed=3) for r in range(4)]
        together = torch.cat(shards)
        assert together.numel() == 2000 and together.unique().numel() == 2000  # disjoint and complete
        assert all(torch.equal(s, skewed_shard(y, 4, r, alpha, seed=3)) for r, s in enumerate(shards))
        # per class, the share each worker holds
        shares = torch.stack([torch.bincount(y[s], minlength=10) for s in shards]).double() / 200
        if alpha < 1:  # nearly every class sits on one worker
            assert shares.max(dim=0).values.mean() > 0.8, shares
        else:  # nearly even: each worker holds about a quarter of every class
            assert (shares - 0.25).abs().max() < 0.06, shares
    assert not torch.equal(skewed_shard(y, 4, 0, 0.5, seed=3), skewed_shard(y, 4, 0, 0.5, seed=4))
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    skewed_shard(y, 4, 1, 0.5, seed=0)
    assert torch.equal(torch.rand(3), expected)  # the caller's generator is untouched
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="label_skew must be a Dirichlet concentration > 0"):
            skewed_shard(y, 4, 0, bad, seed=0)


def test_skewed_worker_batches_read_only_the_workers_shard():
    y = torch.arange(400) % 10
    shard = set(skewed_shard(y, 4, 2, 1.0, seed=0).tolist())
    batches = list(worker_batches(400, 4, 2, 8, seed=0, steps=30, labels=y, label_skew=1.0))
    assert len(batches) == 30 and all(b.numel() == 8 for b in batches)
    assert set(torch.cat(batches).tolist()) <= shard
    per_epoch = len(shard) // 8
    first = torch.cat(batches[:per_epoch])
    assert first.unique().numel() == first.numel()  # no repeat inside an epoch
    with pytest.raises(ValueError, match="fewer than a batch of 500"):
        next(worker_batches(400, 4, 2, 500, seed=0, steps=1, labels=y, label_skew=1.0))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert command.main(["--mode", "async", "--label-skew", "0.5", "--no-progress"]) == 2
    assert "--label-skew only applies to --mode sync, local and auto" in err.getvalue()


def test_default_model_has_at_least_100k_parameters_and_is_seeded():
    m = make_model(0)
    assert num_parameters(m) == 64 * 384 + 384 + 384 * 256 + 256 + 256 * 10 + 10 >= 100_000
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), make_model(0).parameters()))
    assert not torch.equal(next(m.parameters()), next(make_model(1).parameters()))


def test_compressor_menu():
    assert parse_compressors("int8, topk-ef,int8") == ("int8", "topk-ef")
    with pytest.raises(ValueError, match="allowed: none,fp16,bf16"):
        parse_compressors("int8,lz4")
    with pytest.raises(ValueError, match="no compressor"):
        parse_compressors(" , ")
    assert set(DEFAULT_COMPRESSORS) <= set(COMPRESSORS)
    for name, choice in COMPRESSORS.items():
        c = choice.build(threshold=1e-3)
        if name == "auto":  # adaptive compression: a policy over codecs, sync mode and the auto mode's row
            assert isinstance(c, gc.Adaptive) and choice.error_feedback and choice.modes == ("sync", "auto")
            continue
        if choice.torch_hook:  # PyTorch's powerSGD_hook with its defaults: the DDP hook only
            assert isinstance(c, TorchPowerSGD) and c.state.matrix_approximation_rank == choice.low_rank
            assert c.state.use_error_feedback and c.state.warm_start and choice.modes == ("sync",)
            continue
        if choice.low_rank:  # PowerSGD: the DDP hook and local SGD, not the parameter server
            assert isinstance(c, gc.PowerSGD) and c.rank == choice.low_rank and choice.error_feedback
            assert "async" not in choice.modes
            continue
        assert choice.native == (name == "native")
        if choice.native:  # uncompressed on the backend's all_reduce: DDP's plain path, sync only
            assert isinstance(c, gc.NoCompression) and choice.modes == ("sync",)
        assert c.sparse == choice.sparse, name
        # DGC keeps a residual; sign-ef-sgd is the catalog's sign-ef under another optimizer
        assert choice.error_feedback == ((choice.entry or name).endswith("-ef") or choice.dgc)
    with pytest.raises(ValueError, match="threshold"):
        COMPRESSORS["threshold-ef"].build(None)


def test_each_row_runs_on_the_algorithm_that_takes_it():
    cfg = TrainConfig(algorithm="halving_doubling", sparse_algorithm="sparse_reduce_scatter")
    assert cfg.algorithm_for(COMPRESSORS["int8"]) == "halving_doubling"
    assert cfg.algorithm_for(COMPRESSORS["topk-int8-ef"]) == "sparse_reduce_scatter"
    assert cfg.algorithm_for(COMPRESSORS["topk-ef"]) == "sparse_reduce_scatter"
    # threshold's sizes vary, DGC selects per parameter: both stay on the allgather
    assert cfg.algorithm_for(COMPRESSORS["threshold-ef"]) == "allgather"
    assert cfg.algorithm_for(COMPRESSORS["dgc"]) == "allgather"
    assert cfg.algorithm_for(COMPRESSORS["auto"]) == "ring"  # not among the policy's algorithms
    assert TrainConfig().algorithm_for(COMPRESSORS["topk-ef"]) == "allgather"
    with pytest.raises(ValueError, match="sparse_algorithm must be one of"):
        TrainConfig(sparse_algorithm="ring")


def test_config_validation():
    with pytest.raises(ValueError, match="workers"):
        TrainConfig(workers=0)
    with pytest.raises(ValueError, match="algorithm"):
        TrainConfig(algorithm="allgather")
    with pytest.raises(ValueError, match="momentum"):
        TrainConfig(momentum=1.0)
    with pytest.raises(ValueError, match="async_momentum"):
        TrainConfig(async_momentum=-0.1)


def test_async_momentum_applies_to_the_async_server_only():
    from gradcomp.compressors import TopK
    from gradcomp.lab.study.dgc import dgc_compressor, optimizer_momentum

    cfg = TrainConfig(momentum=0.9, async_momentum=0.5)
    assert optimizer_momentum(False, cfg, "async") == 0.5
    assert optimizer_momentum(False, cfg, "sync") == 0.9
    assert optimizer_momentum(True, cfg, "async") == 0.0  # DGC owns the momentum
    assert dgc_compressor(TopK(ratio=0.01), cfg, 1000, "async").momentum == 0.5
    assert dgc_compressor(TopK(ratio=0.01), cfg, 1000).momentum == 0.9
    assert TrainConfig(momentum=0.8).momentum_for("async") == 0.8


def test_dgc_warmup_epochs_set_the_warmup_steps():
    from gradcomp.compressors import TopK
    from gradcomp.lab.study.dgc import dgc_compressor

    # 3,750 samples over 4 workers x 32 = 29 full steps per epoch: 2 epochs = 58 steps
    cfg = TrainConfig(workers=4, batch_size=32, dgc_warmup_epochs=2)
    assert dgc_compressor(TopK(ratio=0.001), cfg, 3750).warmup_steps == 58
    assert dgc_compressor(TopK(ratio=0.001), TrainConfig(), 3750).warmup_steps == 0
    with pytest.raises(ValueError, match="dgc_warmup_epochs"):
        TrainConfig(dgc_warmup_epochs=-1)
    for bad in (True, float("nan"), float("inf"), 1e308, "2"):  # 1e308: its step count overflows
        with pytest.raises(ValueError, match="dgc_warmup_epochs"):
            TrainConfig(dgc_warmup_epochs=bad)
    assert dgc_compressor(TopK(ratio=0.001), TrainConfig(workers=4, batch_size=32, dgc_warmup_epochs=1e6),
                          3750).warmup_steps == 29 * 10**6  # the largest: 29 steps per epoch


def test_threshold_calibration_keeps_one_percent_of_the_first_gradient():
    cfg = TrainConfig(workers=2, batch_size=16)
    tau = calibrate_threshold(cfg)
    data = load_digits_split(cfg.test_fraction, cfg.seed)
    model = make_model(cfg.seed)
    idx = next(worker_batches(len(data.y_train), 2, 0, 16, cfg.seed, 1))
    torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).abs()
    kept = int((g >= tau).sum())
    assert kept == math.ceil(0.01 * g.numel())


# ---- real runs ------------------------------------------------------------------------
def _int8_ring_bytes_per_rank(numel: int, world: int) -> float:
    """Mean bytes a rank sends in one int8 ring allreduce of ``numel`` float32
    elements: in the reduce-scatter every chunk but its own, in the allgather
    every chunk but the next rank's, each as one int8 payload."""
    lens = [hi - lo for lo, hi in chunk_bounds(numel, world)]
    wire = [dense_nbytes("int8", (c,)) for c in lens]
    total = sum(sum(wire) - wire[r] + sum(wire) - wire[(r + 1) % world] for r in range(world))
    return total / world


def _int8_ps_bytes_per_worker(shapes, steps: int) -> float:
    """Mean bytes a parameter-server worker moves per step with int8 push and
    pull: each step a push (+ its reply) and a pull (+ the compressed delta);
    one full float32 pull first, one last pull after the last push, DONE, and
    the HELLO / WELCOME of the connection. On the wire (ZeroMQ) every message
    is an 80-byte header frame, maybe a data frame, each frame with its ZMTP
    frame header: 2 bytes up to 255 bytes, else 9 (RFC 37)."""
    h = 80 + 2

    def msg(n):
        return h + n + (2 if n <= 255 else 9)

    int8_bundle = 8 * (1 + len(shapes)) + sum(dense_nbytes("int8", s) for s in shapes)
    push = steps * (msg(int8_bundle) + h)
    pulls = (steps + 1) * h + msg(P.raw_bundle_nbytes(shapes)) + steps * msg(int8_bundle)
    # DONE and WELCOME are headers; HELLO carries the process's host and pid (a worker's pid
    # has as many digits as this process's, but for a rare rollover: within approx's tolerance)
    hello = msg(len(P.process_description()))
    return (push + pulls + h + hello + h) / steps


@pytest.mark.slow
def test_topology_runs_hosts_of_workers_with_the_hierarchical_algorithm(tmp_path):
    """--topology 2x2 on loopback: 4 workers on 2 hosts (GRADCOMP_HOST_ID), sync and local
    modes on the hierarchical allreduce; every worker ends with the same parameters."""
    out = tmp_path / "t"
    argv = ["--mode", "sync,local", "--compressors", "int8", "--steps", "4", "--eval-every", "2",
            "--sync-every", "2", "--topology", "2x2", "--algorithm", "hierarchical", "--out", str(out),
            "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert command.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert {(r["mode"], r["compressor"]) for r in doc["runs"]} == {
        ("sync", "none"), ("sync", "int8"), ("local", "none"), ("local", "int8")}
    for r in doc["runs"]:
        assert (r["link"]["topology"], r["link"]["world_size"]) == ("2x2", 4)
        if r["mode"] == "sync":
            digests = r["extra"]["param_sha256_per_worker"]
            assert len(digests) == 4 and len(set(digests)) == 1, digests
    by = {(r["mode"], r["compressor"]): r["bytes_per_worker_per_step"] for r in doc["runs"]}
    assert by[("sync", "int8")] < by[("sync", "none")]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """Both modes, 2 workers, none + int8, through the command line."""
    out = tmp_path_factory.mktemp("study")
    argv = ["--workers", "2", "--compressors", "int8", "--steps", "24", "--eval-every", "6",
            "--out", str(out), "--no-progress"]
    terminal = io.StringIO()
    with contextlib.redirect_stdout(terminal):
        assert command.main(argv) == 0
    return out, terminal.getvalue()


@pytest.mark.slow
def test_study_writes_table_json_csv_png(tiny_study):
    out, terminal = tiny_study
    for header in ("mode", "compressor", "bytes/step", "reduction", "test acc",
                   "gap (pp)", "step ms", "idle", "exp comm", "to target s", "wall s"):
        assert header in terminal
    assert "MLP 64-384-256-10 (126,090 params), 2 workers x batch 64, 24 steps" in terminal
    assert terminal.count("int8") >= 2 and "results.png" in terminal
    doc = json.loads((out / "results.json").read_text())
    assert [(r["mode"], r["compressor"]) for r in doc["runs"]] == [
        ("sync", "none"), ("sync", "int8"), ("async", "none"), ("async", "int8")]
    assert doc["model"]["parameters"] == num_parameters(make_model(0))
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["none", "int8", "none", "int8"]
    assert float(rows[1]["reduction_x"]) == pytest.approx(doc["runs"][1]["reduction_x"], abs=0.01)
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for r in doc["runs"]:
        assert r["test_accuracy"] > 0.3  # chance is 0.1
        assert len(r["losses"]) == 24 and r["marks"] == [6, 12, 18, 24]
        assert r["bytes_at_marks"] == sorted(r["bytes_at_marks"])
        assert r["wall_s"] > 0


@pytest.mark.slow
def test_study_bytes_match_the_wire_formulas(tiny_study):
    doc = json.loads((tiny_study[0] / "results.json").read_text())
    runs = {(r["mode"], r["compressor"]): r for r in doc["runs"]}
    model = make_model(0)
    n = num_parameters(model)
    shapes = [tuple(p.shape) for p in model.parameters()]

    sync_none, sync_int8 = runs["sync", "none"], runs["sync", "int8"]
    # the whole model is one DDP bucket, compressed from the first step; the
    # hook checks the ranks' settings and then its call once (a signature each
    # to the other rank)
    assert sync_int8["bytes_per_worker_per_step"] == pytest.approx(
        _int8_ring_bytes_per_rank(n, 2) + 2 * SIGNATURE_NBYTES / 24, rel=1e-12)
    raw_ring = 2 * (2 - 1) / 2 * 4 * n
    assert sync_int8["raw_bytes_per_worker_per_step"] == raw_ring
    assert sync_none["bytes_per_worker_per_step"] == pytest.approx(raw_ring, rel=1e-3)
    assert 3.9 < sync_int8["reduction_x"] < 4.0
    assert sync_int8["reduction_x"] == pytest.approx(
        sync_none["bytes_per_worker_per_step"] / sync_int8["bytes_per_worker_per_step"])
    assert sync_int8["reduction_pct"] == pytest.approx(100 * (1 - 1 / sync_int8["reduction_x"]))

    async_none, async_int8 = runs["async", "none"], runs["async", "int8"]
    assert async_int8["bytes_per_worker_per_step"] == pytest.approx(
        _int8_ps_bytes_per_worker(shapes, 24))
    assert async_int8["raw_bytes_per_worker_per_step"] == pytest.approx(
        async_none["bytes_per_worker_per_step"])
    assert 3.5 < async_int8["reduction_x"] < 3.94
    phases = async_int8["meter"]["phases"]
    assert set(phases) == {"connect", "push", "pull"}
    assert phases["pull"]["bytes_received"] < phases["pull"]["raw_bytes_received"] / 3


@pytest.mark.slow
def test_the_native_row_runs_every_bucket_on_the_backends_allreduce(tmp_path):
    argv = ["--mode", "sync", "--workers", "2", "--compressors", "native", "--steps", "12",
            "--eval-every", "6", "--out", str(tmp_path), "--no-progress"]
    terminal = io.StringIO()
    with contextlib.redirect_stdout(terminal):
        assert command.main(argv) == 0
    assert "all_reduce f32" in terminal.getvalue()
    runs = {r["compressor"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    native, none = runs["native"], runs["none"]
    raw_ring = 2 * (2 - 1) / 2 * 4 * num_parameters(make_model(0))  # nominal float32 ring bytes, no header
    assert native["raw_bytes_per_worker_per_step"] == raw_ring
    # and, once, the hook's settings checked with the other rank (one signature)
    assert native["bytes_per_worker_per_step"] == pytest.approx(raw_ring + SIGNATURE_NBYTES / 12, rel=1e-12)
    assert set(native["meter"]["phases"]) == {"plain_allreduce", "agreement"}
    assert "plain_allreduce" not in none["meter"]["phases"]  # none: gradcomp's ring
    assert native["test_accuracy"] == pytest.approx(none["test_accuracy"], abs=0.05)


@pytest.mark.slow
def test_a_failing_worker_stops_the_study_with_its_error():
    cfg = TrainConfig(workers=2, steps=2, timeout=60)
    data = load_digits_split(cfg.test_fraction, cfg.seed)
    with pytest.raises(WorkerError, match="KeyError: 'no-such-codec'"):
        _launch_local("sync", [(cfg, "no-such-codec", 0)], [data], None)


def test_the_sign_sgd_row_runs_two_phase_with_server_error_feedback(tmp_path):
    argv = ["--mode", "sync", "--workers", "2", "--compressors", "sign-ef,sign-ef-sgd", "--steps", "12",
            "--eval-every", "6", "--out", str(tmp_path), "--no-progress"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert command.main(argv) == 0
    runs = {r["compressor"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert (runs["sign-ef-sgd"]["algorithm"], runs["sign-ef"]["algorithm"]) == ("two_phase", "ring")
    # same codec and bytes per element; plain SGD at lr / (1 - momentum) moves the model elsewhere
    assert runs["sign-ef-sgd"]["test_loss"] != runs["sign-ef"]["test_loss"]


@pytest.mark.slow
def test_low_rank_rows_run_one_bucket_on_a_model_of_two():
    # the wide MLP's 4.5 MB make DDP two buckets, on which PyTorch's hook hangs on gloo (each
    # waits inside a callback); the low-rank rows run one bucket; the alternating row beside it
    cfg = TrainConfig(workers=2, steps=5, timeout=60, hidden=(1024, 1024))
    data = load_digits_split(cfg.test_fraction, cfg.seed)
    logs, _ = _launch_local("sync", [(cfg, "torch-powersgd4", 0), (cfg, "powersgd4-alt", 0)], [data, data], None)
    for run in range(2):
        assert logs[0][run].extra["param_sha256"] == logs[1][run].extra["param_sha256"]
    assert logs[0][1].meter["bytes_sent"] < logs[0][0].meter["bytes_sent"]  # FP16 factors against float32


@pytest.mark.slow
def test_pytorchs_powersgd_hook_row_beside_gradcomps():
    # both low-rank rows exact for two steps, then rank 4 on 2 workers; PyTorch's bytes counted
    # at a ring allreduce's float32 volume of its three allreduces a step
    cfg = TrainConfig(workers=2, steps=6, timeout=60)
    data = load_digits_split(cfg.test_fraction, cfg.seed)
    logs, _ = _launch_local("sync", [(cfg, "powersgd4", 0), (cfg, "torch-powersgd4", 0)], [data, data], None)
    ours, theirs = logs[0]
    for run in range(2):  # every rank ends with the same parameters
        assert logs[0][run].extra["param_sha256"] == logs[1][run].extra["param_sha256"]
    psgd = gc.PowerSGD(rank=4)
    shapes = [p.shape for p in make_model(0).parameters()]
    first, second = psgd.wire_numel(shapes)
    ring = 2 * (2 - 1) / 2 * 4
    expected = 2 * ring * num_parameters(make_model(0)) + 4 * ring * (first + second)
    assert theirs.meter["phases"]["powerSGD_hook"]["bytes_sent"] == expected
    # gradcomp's: the same exact steps, float32 factors on its first compressed step (no exponent
    # yet), then FP16 factors on the backend's allreduce: half of PyTorch's bytes a step
    mine = 2 * ring * num_parameters(make_model(0)) + ring * (first + second) + 3 * ring / 2 * (first + second)
    assert ours.meter["phases"]["plain_allreduce"]["bytes_sent"] == mine
