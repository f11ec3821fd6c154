"""A workload's train/test split and the lazily normalised image view it may hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Split", "Images"]


@dataclass
class Split:
    """Train and test data of a workload (see :func:`gradcomp.lab.study.workloads.load_split`).

    Attributes:
        x_train, y_train, x_test, y_test: tensors or views indexed like them
            (``x[idx]`` with an int64 index tensor or a slice), ``len`` = samples.
        num_features: input elements per sample; num_classes: logits per prediction.
        block: context length of a sequence workload (0 otherwise).
        info: what a report shows about the data (name, origin, vocabulary, ...).
    """

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    num_features: int
    num_classes: int
    block: int = 0
    info: dict | None = None


class Images:
    """uint8 images ``(n, C, H, W)`` that index as float32 ``(pixel / 255 - mean) / std``
    per channel: a quarter of the memory of stored float32 (the 50,000 CIFAR-10
    training images: 154 MB instead of 614 MB per copy).

    Args:
        pixels: uint8 ``(n, C, H, W)``; mean, std: float32 ``(C,)`` on the [0, 1] scale.
    """

    def __init__(self, pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor):
        if pixels.dtype != torch.uint8 or pixels.dim() != 4:
            raise ValueError(f"pixels must be uint8 (n, C, H, W), got {pixels.dtype} {tuple(pixels.shape)}")
        self.pixels = pixels
        self.mean = mean.reshape(1, -1, 1, 1).float()
        self.std = std.reshape(1, -1, 1, 1).float()

    def __len__(self) -> int:
        return self.pixels.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.pixels.shape

    def __getitem__(self, idx) -> torch.Tensor:
        return (self.pixels[idx].float() / 255.0 - self.mean) / self.std
