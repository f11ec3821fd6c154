"""The training study behind ``gradcomp train``.

Trains an MLP on scikit-learn's handwritten digits with several worker
processes, once per (mode, compressor): ``sync`` is DistributedDataParallel
with gradcomp's compressed allreduce hook, ``async`` the parameter server.
Every run shares seed, data order and step budget, so the differences in the
report (wire bytes per worker per step from the transports' traffic meters,
test accuracy, wall time) come from the compressor alone.

Modules: :mod:`~gradcomp.lab.study.data` (split, sharding), :mod:`~gradcomp.lab.study.model`,
:mod:`~gradcomp.lab.study.config` (settings, compressor menu), :mod:`~gradcomp.lab.study.sync`,
:mod:`~gradcomp.lab.study.async_`, :mod:`~gradcomp.lab.study.local` (per-rank loops), :mod:`~gradcomp.lab.study.study` (the grid),
:mod:`~gradcomp.lab.study.report` (table, JSON, CSV, PNG), :mod:`~gradcomp.lab.study.command` (CLI),
:mod:`~gradcomp.lab.study.workloads` (``--workload``: digits-mlp, mnist-cnn, cifar10-resnet18,
text-gpt; their data in :mod:`~gradcomp.lab.study.mnist`, :mod:`~gradcomp.lab.study.cifar`,
:mod:`~gradcomp.lab.study.textdata`, their models in :mod:`~gradcomp.lab.study.nets`).

Command line (``gradcomp train`` or ``python -m gradcomp.lab.study``)::

    gradcomp train                                   # the default study, both modes
    gradcomp train --mode sync --algorithm two_phase --compressors int8,topk-int8-ef
    gradcomp train --workers 8 --steps 400 --out results/

Multi-host through ``torchrun``: when ``RANK`` and ``WORLD_SIZE`` are set,
every process is one rank of that job instead of launching local processes.
Run one mode per job: sync uses every rank as a worker, async makes rank 0
the parameter server and the other ranks workers (``--workers`` defaults to
what the job holds). Rank 0 prints the table and writes the results::

    # two hosts, two processes each: 4 sync workers (run on both hosts)
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 -m gradcomp.lab.study --mode sync
    # one server + 4 workers
    torchrun --standalone --nproc-per-node 5 -m gradcomp.lab.study --mode async

Importing this package is light: torch.distributed, scikit-learn, rich and
matplotlib load when a study runs.
"""

from gradcomp.lab.study.config import COMPRESSORS, DEFAULT_COMPRESSORS, TrainConfig

__all__ = ["COMPRESSORS", "DEFAULT_COMPRESSORS", "TrainConfig", "run_study"]


def run_study(*args, **kwargs):
    """See :func:`gradcomp.lab.study.study.run_study`."""
    from gradcomp.lab.study.study import run_study as _run

    return _run(*args, **kwargs)
