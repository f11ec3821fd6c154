"""Benchmarks behind ``gradcomp bench`` (one module per target, each with ``main(argv)``).

* :mod:`gradcomp.lab.bench.kernels`: the compression kernels of every backend
  usable here against memory-copy, PyTorch and bitsandbytes baselines.
* :mod:`gradcomp.lab.bench.allreduce`: gradcomp's compressed collectives against
  PyTorch's.

Submodules are imported on demand; importing this package loads nothing else.
"""

__all__ = ()
