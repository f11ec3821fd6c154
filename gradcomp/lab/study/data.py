"""The study's data: scikit-learn's handwritten digits, split and sharded.

``sklearn.datasets.load_digits`` ships inside scikit-learn (1797 grey 8x8
images of the digits 0-9, no download). Pixels (0..16) are scaled to [0, 1]
and centred with the training split's per-pixel mean; the test split is
held out by a stratified split, the same for every run of a study.

Every run of a study sees the same data order: at epoch ``e`` the training
set is permuted by a generator seeded with ``(seed, e)``, cut into global
batches of ``workers * batch_size`` samples (the incomplete tail is dropped),
and worker ``r`` takes the ``r``-th slice of ``batch_size`` samples of each
global batch. With ``label_skew`` (sync, local and auto modes) the data differ between
workers instead: :func:`skewed_shard` gives each worker its own shard, with class
proportions drawn from a Dirichlet distribution (Hsu et al. 2019, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification"), and each worker reads
its shard in its own seeded order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["Digits", "load_digits_split", "worker_batches", "skewed_shard", "check_label_skew", "steps_per_epoch"]


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


def check_label_skew(alpha) -> float:
    """``alpha`` as a float: a finite Dirichlet concentration > 0, else ValueError naming ``label_skew``."""
    if not (isinstance(alpha, (int, float)) and 0 < alpha < float("inf")):
        raise ValueError(f"label_skew must be a Dirichlet concentration > 0 (or None: i.i.d.), got {alpha!r}")
    return float(alpha)


def skewed_shard(labels: torch.Tensor, workers: int, rank: int, alpha: float, seed: int) -> torch.Tensor:
    """The sample indices (int64, sorted) of ``rank``'s shard when every class's samples are
    split between the ``workers`` in proportions drawn from ``Dirichlet(alpha, ..., alpha)``
    (one draw per class, seeded by ``seed``: the same partition on every rank). Small
    ``alpha`` (e.g. 0.1) gives each worker few classes; large (e.g. 100) nearly i.i.d. shards.

    Raises:
        ValueError: ``alpha`` is not a finite number > 0.
    """
    alpha = check_label_skew(alpha)
    mine = []
    with torch.random.fork_rng(devices=[]):  # the caller's global generator is left as it was
        torch.manual_seed(seed * 1_000_003 + 7)
        dirichlet = torch.distributions.Dirichlet(torch.full((workers,), alpha, dtype=torch.float64))
        for c in torch.unique(labels).tolist():
            idx = torch.nonzero(labels == c).flatten()
            idx = idx[torch.randperm(len(idx))]
            cuts = torch.round(torch.cumsum(dirichlet.sample(), 0) * len(idx)).to(torch.int64).tolist()
            mine.append(idx[(cuts[rank - 1] if rank else 0):cuts[rank]])
    return torch.sort(torch.cat(mine)).values


def worker_batches(num_samples: int, workers: int, rank: int, batch_size: int, seed: int,
                   steps: int, *, labels: torch.Tensor | None = None,
                   label_skew: float | None = None) -> Iterator[torch.Tensor]:
    """Yield the sample indices (int64, ``(batch_size,)``) of ``rank``'s batch at
    each of ``steps`` steps; see the module docstring for the order. With
    ``label_skew`` (and ``labels``, int64 ``(num_samples,)``): batches of ``rank``'s
    :func:`skewed_shard`, permuted per epoch by a generator seeded with ``(seed, rank, epoch)``.

    Raises:
        ValueError: one global batch needs more samples than the training set has, or
            (skewed) ``rank``'s shard holds fewer than ``batch_size`` samples.
    """
    if label_skew is not None:
        yield from _shard_batches(skewed_shard(labels, workers, rank, label_skew, seed), rank, batch_size,
                                  seed, steps)
        return
    per_epoch = steps_per_epoch(num_samples, workers, batch_size)
    if per_epoch < 1:
        raise ValueError(f"a global batch of {workers} workers x {batch_size} samples exceeds "
                         f"the {num_samples} training samples")
    g = torch.Generator()
    yield from _epochs(lambda e: torch.randperm(num_samples, generator=g.manual_seed(seed * 1_000_003 + e)),
                       per_epoch, lambda b: (b * workers + rank) * batch_size, batch_size, steps)


def _shard_batches(shard: torch.Tensor, rank: int, batch_size: int, seed: int, steps: int) -> Iterator[torch.Tensor]:
    if len(shard) < batch_size:
        raise ValueError(f"worker {rank}'s shard holds {len(shard)} samples, fewer than a batch of {batch_size}: "
                         "raise label_skew (less skew) or lower the batch size")

    def order(epoch: int) -> torch.Tensor:  # the rank's own seeded order of its shard
        g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_009 + rank)
        return shard[torch.randperm(len(shard), generator=g)]
    yield from _epochs(order, len(shard) // batch_size, lambda b: b * batch_size, batch_size, steps)


def _epochs(order, per_epoch: int, start, batch_size: int, steps: int) -> Iterator[torch.Tensor]:
    """``steps`` batches: epoch ``e``'s sample order ``order(e)`` cut into ``per_epoch`` batches,
    batch ``b`` of them beginning at ``start(b)``."""
    step, epoch = 0, 0
    while step < steps:
        perm = order(epoch)
        for b in range(min(per_epoch, steps - step)):
            yield perm[start(b):start(b) + batch_size]
        step += per_epoch
        epoch += 1
