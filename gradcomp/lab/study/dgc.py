"""The study's Deep Gradient Compression rows (``dgc``, ``dgc-int8``).

DGC (Lin et al. 2018, :class:`gradcomp.DGC`) applies the momentum on the
worker before compressing (momentum correction), so a DGC run moves the
study's momentum from the optimizer into the compressor: the optimizer (the
DDP ranks' in sync mode, the server's in async mode) is plain SGD with the
study's learning rate, and ``gc.DGC`` gets ``momentum = cfg.momentum``. Every
other setting is the study's, so a DGC row differs from the ``topk-ef`` rows by the
DGC fixes and the density alone.

Settings: final density :data:`gradcomp.catalog.DGC_DENSITY` (0.1%, the paper's, selected per
parameter); local clipping off (the study's baseline does not clip either);
momentum factor masking on; warm-up over ``cfg.dgc_warmup_epochs`` epochs
(``gradcomp train --dgc-warmup``) from :data:`WARMUP_START` in four stages:
none by default (:data:`WARMUP_EPOCHS`; the paper warms up for 4 epochs from
25%). At 0.1% a worker sends each coordinate about once in 1,000 steps, so a
row needs longer runs than the workloads' defaults (``gradcomp train --steps``)
to come near ``none``; what the rows measured: docs/results/dgc.md.
"""

from __future__ import annotations

from gradcomp.compressors import DGC, Compressor
from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.data import steps_per_epoch

__all__ = ["WARMUP_EPOCHS", "WARMUP_START", "dgc_compressor", "optimizer_momentum"]

#: default warm-up length in epochs of the study's data (``TrainConfig.dgc_warmup_epochs``)
WARMUP_EPOCHS = TrainConfig.dgc_warmup_epochs
#: density of the first warm-up stage
WARMUP_START = 0.01


def dgc_compressor(top: Compressor, cfg: TrainConfig, train_samples: int, mode: str = "sync") -> DGC:
    """The DGC wrapper of a DGC row's top-k (``choice.build()``), for ``cfg``'s ``mode``."""
    warmup = round(cfg.dgc_warmup_epochs * steps_per_epoch(train_samples, cfg.workers, cfg.batch_size))
    return DGC(top, momentum=cfg.momentum_for(mode), world_size=cfg.workers, warmup_steps=warmup,
               warmup_start=WARMUP_START)


def optimizer_momentum(dgc: bool, cfg: TrainConfig, mode: str = "sync") -> float:
    """The optimizer's momentum: 0 for a DGC row (DGC applies it), else the study's for ``mode``."""
    return 0.0 if dgc else cfg.momentum_for(mode)
