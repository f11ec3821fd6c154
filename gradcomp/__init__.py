"""gradcomp: gradient compression for distributed PyTorch training.

``import gradcomp as gc``; the public names below load on first use (PEP 562). Importing
gradcomp imports neither torch nor the lab (:mod:`gradcomp.lab`), so ``gradcomp --help`` stays
fast; once torch is imported too (before or after), the ``torch.ops.gradcomp.*`` ops exist.
Nothing loads the native module, Triton or CuPy, nor initialises CUDA, before a kernel runs.
"""

from __future__ import annotations

import importlib

from gradcomp._lazy import after_import, lazy_attributes
from gradcomp._version import __version__
from gradcomp.errors import BackendUnavailable, PayloadError

#: Public name -> the module that defines it; a name equal to its module's last
#: component is that module itself (``gc.kernels``, ``gc.ddp``, ...).
_EXPORTS = {
    "Payload": "gradcomp.wire",
    "decode": "gradcomp.wire",
    "decompress": "gradcomp.compressors",
    "decompress_add_": "gradcomp.compressors",
    "kernels": "gradcomp.kernels",
    "compressors": "gradcomp.compressors",
    "catalog": "gradcomp.catalog",
    "wire": "gradcomp.wire",
    "comm": "gradcomp.comm",
    "meter": "gradcomp.meter",
    "timeline": "gradcomp.timeline",
    "launch": "gradcomp.launch",
    "localsgd": "gradcomp.localsgd",
    "pipeline": "gradcomp.pipeline",
    "adaptive": "gradcomp.adaptive",
    "powersgd": "gradcomp.powersgd",
    "Compressor": "gradcomp.compressors",
    "NoCompression": "gradcomp.compressors",
    "FP16": "gradcomp.compressors",
    "BF16": "gradcomp.compressors",
    "Int8Quantizer": "gradcomp.compressors",
    "IntQuantizer": "gradcomp.compressors",
    "SignQuantizer": "gradcomp.compressors",
    "FP8": "gradcomp.compressors",
    "TopK": "gradcomp.compressors",
    "Threshold": "gradcomp.compressors",
    "ErrorFeedback": "gradcomp.compressors",
    "DGC": "gradcomp.compressors",
    "TrafficMeter": "gradcomp.meter",
    "allreduce": "gradcomp.comm",
    "Topology": "gradcomp.comm",
    "AutoAlgorithm": "gradcomp.comm",
    "Adaptive": "gradcomp.adaptive",
    "PowerSGD": "gradcomp.powersgd",
    "ddp": "gradcomp.ddp",
    "LocalSGD": "gradcomp.localsgd",
    "sync_period": "gradcomp.sync_period",
    "SyncPeriod": "gradcomp.sync_period",
    "SyncRound": "gradcomp.sync_period",
    "partial_work": "gradcomp.partial_work",
    "PartialWork": "gradcomp.partial_work",
    "ps": "gradcomp.ps",
    "fsdp": "gradcomp.fsdp",
}

__all__ = ["__version__", "BackendUnavailable", "PayloadError", *_EXPORTS]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _EXPORTS)

# torch.ops.gradcomp.<op> exists once torch and gradcomp are both imported, in either order; the
# schemas and the reference kernels only: _C, Triton and CuPy still load on a kernel's first run
after_import("torch", lambda: importlib.import_module("gradcomp.kernels"))
