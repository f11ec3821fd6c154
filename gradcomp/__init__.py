"""gradcomp: gradient compression for distributed PyTorch training.

``import gradcomp as gc``; see README.md and the public names below. Importing
gradcomp imports neither torch nor any of its modules: each public name is
loaded on first use (PEP 562), so ``gradcomp --help`` stays fast, and nothing
loads the native module, Triton or CuPy, nor initialises CUDA, before a kernel runs.
"""

from __future__ import annotations

import importlib

from gradcomp._version import __version__
from gradcomp.errors import BackendUnavailable, PayloadError

#: Public name -> the module that defines it; a name equal to its module's last
#: component is that module itself (``gc.kernels``, ``gc.ddp``, ...).
_EXPORTS = {
    "Payload": "gradcomp.wire",
    "decode": "gradcomp.wire",
    "kernels": "gradcomp.kernels",
    "Compressor": "gradcomp.compressors",
    "NoCompression": "gradcomp.compressors",
    "FP16": "gradcomp.compressors",
    "BF16": "gradcomp.compressors",
    "Int8Quantizer": "gradcomp.compressors",
    "TopK": "gradcomp.compressors",
    "Threshold": "gradcomp.compressors",
    "ErrorFeedback": "gradcomp.compressors",
    "DGC": "gradcomp.compressors",
    "TrafficMeter": "gradcomp.meter",
    "allreduce": "gradcomp.comm",
    "Adaptive": "gradcomp.adaptive",
    "ddp": "gradcomp.ddp",
    "LocalSGD": "gradcomp.localsgd",
    "ps": "gradcomp.ps",
    "fsdp": "gradcomp.fsdp",
}

__all__ = ["__version__", "BackendUnavailable", "PayloadError", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module == f"gradcomp.{name}" else getattr(mod, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
