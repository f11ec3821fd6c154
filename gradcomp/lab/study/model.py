"""The study's model: a multilayer perceptron for 8x8 digits, and its evaluation."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from gradcomp.lab.study.menu import DEFAULT_HIDDEN

__all__ = ["make_model", "num_parameters", "evaluate", "DEFAULT_HIDDEN"]


def make_model(seed: int, hidden: Sequence[int] = DEFAULT_HIDDEN, in_features: int = 64,
               num_classes: int = 10) -> nn.Sequential:
    """An MLP ``in -> hidden... -> classes`` with ReLU, initialised from ``seed``
    (the same weights in every process and run that use the same seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)


def num_parameters(model: nn.Module) -> int:
    """Trainable parameters (elements)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


#: Samples per forward pass of :func:`evaluate`.
EVAL_BATCH = 500


@torch.no_grad()
def evaluate(model: nn.Module, x, y) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy (fraction in [0, 1]) of ``model`` on
    ``(x, y)``, over every prediction: logits ``(n, C)`` for labels ``(n,)``, or
    ``(n, T, C)`` for next-token targets ``(n, T)``. ``x`` and ``y`` are tensors
    or views sliced like them; :data:`EVAL_BATCH` samples per forward pass."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(y), EVAL_BATCH):
        logits = model(x[i:i + EVAL_BATCH])
        logits = logits.reshape(-1, logits.shape[-1])
        target = y[i:i + EVAL_BATCH].reshape(-1)
        loss_sum += float(nn.functional.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
        count += target.numel()
    model.train(was_training)
    return loss_sum / count, correct / count
