"""The study's model: a multilayer perceptron for 8x8 digits, and its evaluation."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["make_model", "num_parameters", "evaluate", "DEFAULT_HIDDEN"]

#: Hidden widths of the default model: 64-384-256-10, 126,090 parameters.
DEFAULT_HIDDEN = (384, 256)


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


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy (fraction in [0, 1]) of ``model`` on ``(x, y)``."""
    was_training = model.training
    model.eval()
    logits = model(x)
    loss = float(nn.functional.cross_entropy(logits, y))
    acc = float((logits.argmax(dim=1) == y).float().mean())
    model.train(was_training)
    return loss, acc
