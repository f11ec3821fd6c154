"""The training study behind ``gradcomp train``.

Trains a workload (``--workload``) with several worker processes, once per (mode, compressor):
``sync`` is DistributedDataParallel with gradcomp's compressed allreduce hook, ``async`` the
parameter server, ``local`` local SGD, ``pipeline`` pipeline stages. Every run shares seed, data
order and step budget, so the differences in the report (wire bytes per worker per step, test
accuracy, time) come from the compressor alone. The command is :mod:`~gradcomp.lab.study.command`,
the grid :mod:`~gradcomp.lab.study.study`, the per-rank loops ``sync``, ``async_``, ``local``
and ``pipeline``, the report :mod:`~gradcomp.lab.study.report`. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` set) every process is one rank of that job.

Importing this package is light: torch.distributed, scikit-learn, rich and matplotlib load when a
study runs. Details: docs/study.md and docs/cli.md.
"""

from gradcomp.lab.study.config import COMPRESSORS, DEFAULT_COMPRESSORS, TrainConfig

__all__ = ["COMPRESSORS", "DEFAULT_COMPRESSORS", "TrainConfig", "run_study"]


def run_study(*args, **kwargs):
    """See :func:`gradcomp.lab.study.study.run_study`."""
    from gradcomp.lab.study.study import run_study as _run

    return _run(*args, **kwargs)
