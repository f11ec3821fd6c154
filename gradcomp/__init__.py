"""gradcomp: gradient compression for distributed PyTorch training.

``import gradcomp as gc``; see README.md and the public names below. Importing
gradcomp imports neither torch nor any of its modules: each public name is
loaded on first use (PEP 562), so ``gradcomp --help`` stays fast, and nothing
loads the native module, Triton or CuPy, nor initialises CUDA, before a kernel runs.
"""

from __future__ import annotations

from gradcomp._lazy import lazy_attributes
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
    "Topology": "gradcomp.comm",
    "Adaptive": "gradcomp.adaptive",
    "ddp": "gradcomp.ddp",
    "LocalSGD": "gradcomp.localsgd",
    "ps": "gradcomp.ps",
    "fsdp": "gradcomp.fsdp",
}

__all__ = ["__version__", "BackendUnavailable", "PayloadError", *_EXPORTS]


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _EXPORTS)
