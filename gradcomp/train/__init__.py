"""The training study behind ``gradcomp train``.

Trains an MLP on scikit-learn's handwritten digits with several worker
processes, once per (mode, compressor): ``sync`` is DistributedDataParallel
with gradcomp's compressed allreduce hook, ``async`` the parameter server.
Every run shares seed, data order and step budget, so the differences in the
report (wire bytes per worker per step from the transports' traffic meters,
test accuracy, wall time) come from the compressor alone.

Modules: :mod:`~gradcomp.train.data` (split, sharding), :mod:`~gradcomp.train.model`,
:mod:`~gradcomp.train.config` (settings, compressor menu), :mod:`~gradcomp.train.sync`,
:mod:`~gradcomp.train.async_` (per-rank loops), :mod:`~gradcomp.train.study` (the grid),
:mod:`~gradcomp.train.report` (table, JSON, CSV, PNG), :mod:`~gradcomp.train.command` (CLI).

Importing this package is light: torch.distributed, scikit-learn, rich and
matplotlib load when a study runs.
"""

from gradcomp.train.config import COMPRESSORS, DEFAULT_COMPRESSORS, TrainConfig

__all__ = ["COMPRESSORS", "DEFAULT_COMPRESSORS", "TrainConfig", "run_study"]


def run_study(*args, **kwargs):
    """See :func:`gradcomp.train.study.run_study`."""
    from gradcomp.train.study import run_study as _run

    return _run(*args, **kwargs)
