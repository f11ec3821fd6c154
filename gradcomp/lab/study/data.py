"""The study's data: scikit-learn's handwritten digits, split and sharded.

``sklearn.datasets.load_digits`` ships inside scikit-learn (1797 grey 8x8
images of the digits 0-9, no download). Pixels (0..16) are scaled to [0, 1]
and centred with the training split's per-pixel mean; the test split is
held out by a stratified split, the same for every run of a study.

Every run of a study sees the same data order: at epoch ``e`` the training
set is permuted by a generator seeded with ``(seed, e)``, cut into global
batches of ``workers * batch_size`` samples (the incomplete tail is dropped),
and worker ``r`` takes the ``r``-th slice of ``batch_size`` samples of each
global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["Digits", "load_digits_split", "worker_batches", "steps_per_epoch"]


@dataclass
class Digits:
    """Train and test tensors: ``x_*`` float32 ``(n, 64)``, ``y_*`` int64 ``(n,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def num_classes(self) -> int:
        return 10


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    """Load the digits and split them, stratified by class.

    Args:
        test_fraction: share of the 1797 samples held out for testing, in (0, 1).
        seed: seed of the split.

    Raises:
        ImportError: scikit-learn is not installed (``pip install gradcomp[train]``).
        ValueError: ``test_fraction`` outside (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the training study needs scikit-learn: pip install 'gradcomp[train]'") from e
    ds = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        ds.data, ds.target, test_size=test_fraction, stratify=ds.target, random_state=seed)
    x_tr = torch.as_tensor(x_tr, dtype=torch.float32) / 16.0
    x_te = torch.as_tensor(x_te, dtype=torch.float32) / 16.0
    mean = x_tr.mean(dim=0)
    return Digits(x_tr - mean, torch.as_tensor(y_tr, dtype=torch.int64),
                  x_te - mean, torch.as_tensor(y_te, dtype=torch.int64))


def steps_per_epoch(num_samples: int, workers: int, batch_size: int) -> int:
    """Full global batches of ``workers * batch_size`` samples in one epoch."""
    return num_samples // (workers * batch_size)


def worker_batches(num_samples: int, workers: int, rank: int, batch_size: int, seed: int,
                   steps: int) -> Iterator[torch.Tensor]:
    """Yield the sample indices (int64, ``(batch_size,)``) of ``rank``'s batch at
    each of ``steps`` steps; see the module docstring for the order.

    Raises:
        ValueError: one global batch needs more samples than the training set has.
    """
    per_epoch = steps_per_epoch(num_samples, workers, batch_size)
    if per_epoch < 1:
        raise ValueError(f"a global batch of {workers} workers x {batch_size} samples exceeds "
                         f"the {num_samples} training samples")
    step, epoch = 0, 0
    g = torch.Generator()
    while step < steps:
        g.manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(num_samples, generator=g)
        for b in range(per_epoch):
            if step >= steps:
                return
            start = (b * workers + rank) * batch_size
            yield perm[start:start + batch_size]
            step += 1
        epoch += 1
