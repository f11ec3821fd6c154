"""``cifar10-resnet18``'s data: CIFAR-10 from the user's disk, never downloaded.

The reader takes the standard "CIFAR-10 python version" (Krizhevsky 2009,
``cifar-10-python.tar.gz`` from https://www.cs.toronto.edu/~kriz/cifar.html,
extracted): a folder ``cifar-10-batches-py`` holding ``data_batch_1`` ..
``data_batch_5`` (training, 10,000 images each) and ``test_batch`` (10,000),
each a pickled dict with ``b"data"``, a uint8 array ``(n, 3072)`` (1,024 red,
then green, then blue values of a 32x32 image, row-major), and ``b"labels"``,
``n`` ints in 0..9. ``--data-dir`` is that folder or the folder above it.

The pickles are unpickled with a restricted unpickler that builds only plain
containers and numpy arrays: a file that tries anything else is rejected
before it can run code. Images are standardised per channel with the
training images' mean and standard deviation (:class:`~gradcomp.lab.study.splits.Images`).
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import torch

from gradcomp.errors import PayloadError
from gradcomp.lab.study.splits import Images, Split

__all__ = ["load_cifar10", "read_batch", "TRAIN_BATCHES", "TEST_BATCH", "FOLDER"]

FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
_PIXELS = 3 * 32 * 32

#: the globals a numpy-array pickle needs (numpy >= 2 moved ``core`` to ``_core``)
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file.

    Returns:
        ``(images, labels)``: uint8 ``(n, 3, 32, 32)`` and int64 ``(n,)`` in 0..9.

    Raises:
        FileNotFoundError: no file at ``path``.
        gradcomp.PayloadError: a truncated or malformed file (not a pickle, a
            forbidden global, missing keys, a wrong shape, dtype or label).
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # truncated or corrupt bytes raise many types
        raise PayloadError(f"{path}: not a CIFAR-10 python batch (truncated or malformed pickle: "
                           f"{type(e).__name__}: {e})") from None
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        keys = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise PayloadError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels', got {keys}")
    data, labels = d[b"data"], d[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != _PIXELS:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise PayloadError(f"{path}: b'data' must be uint8 (n, {_PIXELS}), got {desc}")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise PayloadError(f"{path}: b'labels' must be a list of ints") from None
    if labels.shape != (data.shape[0],):
        raise PayloadError(f"{path}: {data.shape[0]} images but labels of shape {labels.shape}")
    if labels.size and not (labels.min() >= 0 and labels.max() <= 9):
        raise PayloadError(f"{path}: labels must be in 0..9, got {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels


def _folder(data_dir: str) -> str:
    for d in (data_dir, os.path.join(data_dir, FOLDER)):
        if all(os.path.isfile(os.path.join(d, n)) for n in (*TRAIN_BATCHES, TEST_BATCH)):
            return d
    raise FileNotFoundError(
        f"CIFAR-10 not found in --data-dir {data_dir}: download the python version "
        f"(cifar-10-python.tar.gz, https://www.cs.toronto.edu/~kriz/cifar.html), extract it there "
        f"so that {os.path.join(data_dir, FOLDER)} holds {', '.join(TRAIN_BATCHES)} and "
        f"{TEST_BATCH}; gradcomp never downloads it")


def _channel_stats(pixels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (sample) standard deviation of uint8 ``(n, C, H, W)``
    on the [0, 1] scale, exact in float64 from each channel's 256-bin histogram."""
    levels = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(pixels.shape[1]):
        hist = np.bincount(pixels[:, c].ravel(), minlength=256).astype(np.float64)
        n = hist.sum()
        mean = (hist * levels).sum() / n
        var = (hist * (levels - mean) ** 2).sum() / max(n - 1, 1)
        means.append(mean)
        stds.append(max(var ** 0.5, 1e-6))
    return torch.tensor(means, dtype=torch.float32), torch.tensor(stds, dtype=torch.float32)


def load_cifar10(data_dir: str) -> Split:
    """CIFAR-10's standard split from ``data_dir`` (see the module docstring).

    Returns:
        A :class:`Split`: ``x_*`` :class:`Images` indexing as float32
        ``(n, 3, 32, 32)``, ``y_*`` int64 ``(n,)`` in 0..9 (50,000 / 10,000
        samples for the full data set).

    Raises:
        FileNotFoundError: a batch file is missing (the message says where to put them).
        gradcomp.PayloadError: a truncated or malformed batch file.
    """
    folder = _folder(os.fspath(data_dir))
    parts = [read_batch(os.path.join(folder, n)) for n in TRAIN_BATCHES]
    x_tr = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y_tr = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    x_te, y_te = (torch.from_numpy(a) for a in read_batch(os.path.join(folder, TEST_BATCH)))
    mean, std = _channel_stats(x_tr.numpy())
    return Split(Images(x_tr, mean, std), y_tr, Images(x_te, mean, std), y_te,
                 num_features=_PIXELS, num_classes=10,
                 info={"name": "CIFAR-10", "path": folder})
