"""The study's workloads: a dataset, a model and their defaults, by name.

``gradcomp train --workload NAME`` picks one; every mode (sync, async, local)
trains it through the same three calls: :func:`load_split` (in the launching
process), :func:`build_model` (in every rank) and :func:`batch_loss`. The
menu's entries (names and defaults) are plain data in :mod:`gradcomp.lab.study.menu`.

=================  =====================================  ==========  =====  =====  ====
name               model, data                            parameters  steps  batch  lr
=================  =====================================  ==========  =====  =====  ====
digits-mlp         MLP 64-384-256-10, sklearn digits 8x8     126,090    350     64  0.1
mnist-cnn          2 conv + 2 dense, 5,000 MNIST 28x28       215,370    300     32  0.05
cifar10-resnet18   ResNet-18 (CIFAR), CIFAR-10 --data-dir  11,173,962    390     32  0.05
text-gpt           2-layer char GPT, --data-file text        ~0.4 M [1]  300     16  0.1
=================  =====================================  ==========  =====  =====  ====

[1] 404,992 + 257 x vocabulary parameters (the vocabulary: the text's distinct characters).

Samples: an image classifier's sample is one image; ``text-gpt``'s is one
window of :data:`gradcomp.lab.study.textdata.BLOCK` characters (its targets: the
same window shifted by one character). Accuracy is the share of correct
predictions over the test split: images, or next characters for
``text-gpt``, whose test loss is also reported as a perplexity
(``exp(loss)``, per character).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradcomp.lab.study.menu import DEFAULT_WORKLOAD, WORKLOADS, Workload

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOAD", "load_split", "build_model", "batch_loss",
           "perplexity", "describe"]


def _get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name]


def load_split(cfg):
    """The train/test split of ``cfg.workload`` (deterministic for ``cfg.seed``).

    Returns:
        An object with ``x_train``, ``y_train``, ``x_test``, ``y_test``
        (tensors, or sized views that index like them: ``x[idx]`` with an
        int64 index tensor or a slice gives a batch tensor), ``num_features``
        and ``num_classes``.

    Raises:
        ValueError: an unknown workload, or a required ``data_dir`` /
            ``data_file`` missing from ``cfg``.
        FileNotFoundError: the data is not where ``cfg`` says (the message
            says where to put it); gradcomp.PayloadError: a malformed file.
        ImportError: the workload's package is not installed.
    """
    w = _get(cfg.workload)
    if w.needs is not None and getattr(cfg, w.needs) is None:
        option = "--" + w.needs.replace("_", "-")
        raise ValueError(f"workload {w.name} needs {option} (see gradcomp train --help)")
    if w.name == "digits-mlp":
        from gradcomp.lab.study.data import load_digits_split

        return load_digits_split(cfg.test_fraction, cfg.seed)
    if w.name == "mnist-cnn":
        from gradcomp.lab.study.mnist import load_mnist_split

        return load_mnist_split(cfg.test_fraction, cfg.seed)
    if w.name == "cifar10-resnet18":
        from gradcomp.lab.study.cifar import load_cifar10

        return load_cifar10(cfg.data_dir)
    from gradcomp.lab.study.textdata import load_text_split

    return load_text_split(cfg.data_file, cfg.test_fraction)


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_model(cfg, data) -> nn.Module:
    """A fresh model for ``cfg.workload`` on ``data`` (from :func:`load_split`),
    initialised from ``cfg.seed``: the same weights in every rank and run."""
    w = _get(cfg.workload)
    if w.name == "digits-mlp":
        from gradcomp.lab.study.model import make_model

        return make_model(cfg.seed, cfg.hidden, data.num_features, data.num_classes)
    from gradcomp.lab.study import nets

    if w.name == "mnist-cnn":
        return _seeded(cfg.seed, lambda: nets.SmallCNN(data.num_classes))
    if w.name == "cifar10-resnet18":
        return _seeded(cfg.seed, lambda: nets.resnet18_cifar(data.num_classes))
    return _seeded(cfg.seed, lambda: nets.CharGPT(data.num_classes, data.block))


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y``: logits ``(B, C)`` with
    labels ``(B,)``, or ``(B, T, C)`` with next-token targets ``(B, T)``."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def perplexity(test_loss: float) -> float:
    """``exp(test_loss)``: the perplexity of a mean cross-entropy in nats (inf past exp's range)."""
    try:
        return math.exp(test_loss)
    except OverflowError:
        return math.inf


def describe(cfg, params: int) -> str:
    """The workload's part of a report's title."""
    return f"{_get(cfg.workload).summary} ({params:,} params)"
