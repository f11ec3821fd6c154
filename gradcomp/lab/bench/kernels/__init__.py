"""Kernel microbenchmark: every backend usable here against common baselines.

Usage::

    gradcomp bench kernels [--sizes 2**16,2**20,2**24] [--size N] [--dtypes float32,bfloat16]
                           [--ops quantize_int8,topk,...] [--threads 1,all] [--repeat 7]
                           [--densities 0.01,0.001] [--out DIR] [--quick]
    python benchmarks/kernels.py ...

For each device (CPU; CUDA too when a GPU is present), thread setting, op,
size ``n`` (elements), dtype and, for the sparse ops, density (k / n), it
times every backend that runs the op on that device (``cpu``, ``reference``,
``triton``, ``cuda``; see :func:`gradcomp.kernels.available_backends`) and
these baselines, all in the same run and interleaved round by round (so a
load change on the machine hits every candidate alike):

* ``copy``: ``numpy.copyto`` of the n-element input (n * itemsize bytes;
  ``Tensor.copy_`` on CUDA): read + written bytes per second is the
  memory-bandwidth ceiling (numpy copies with one thread);
* ``reference``: the pure-PyTorch reference (:mod:`gradcomp.kernels.reference`);
* ``compiled``: a fused int8 blockwise absmax quantizer / dequantizer written
  for ``torch.compile`` and compiled with ``fullgraph=True`` and static shapes
  for each case at its thread count (``--compile-ops``, by default the
  quantize / dequantize ops; :mod:`.peers` gives its numerics; dropped with
  a note on failure);
* ``torch.topk``: ``torch.topk(x.abs(), k)`` for ``topk`` and ``approx_topk``;
* ``bitsandbytes``: ``quantize_blockwise`` / ``dequantize_blockwise`` (its
  8-bit dynamic blockwise code, same block size, into preallocated ``out`` /
  ``absmax`` buffers) when bitsandbytes imports.

Besides the registry's ops, ``dgc`` times one Deep Gradient Compression step
per backend (:class:`gradcomp.DGC`'s kernel work on float32: the
momentum-correction pass ``u = m u + g; v += u`` with the exact top-k of ``v``,
fused by the native backend (``kernels.dgc_topk_``), and the masking of the
sent coordinates in ``u`` and ``v``) against two
baselines on the automatically chosen backend: ``topk`` (the plain top-k
kernel on the gradient) and ``topk+ef`` (the best plain error-feedback top-k
a user would write: ``r += g``, top-k of ``r``, ``r[sent] = 0``); ``/topk`` and
``/topk+ef`` are its time over theirs. Its bandwidth counts the 20 bytes per
element a step must move (g, u, v read; u, v written), so its ``%copy`` says
how near the step runs to the memory floor, where top-k moves 4.

Outputs are preallocated where the op accepts them (``out_q``/``out_scales``,
``out``) for backends and peers alike. Reported per row: median, p10 and
p90 seconds over the rounds, effective bandwidth (bytes read + written by the
op / median time, GB/s = 1e9 bytes/s), and per backend the ratios against the
baselines (``x ref`` = reference time / backend time, etc.; ``%copy`` =
bandwidth / copy bandwidth; for ``quantize_int8_ef``, ``ef/q`` = its time over
the same backend's plain ``quantize_int8``). The table is plain text within 80 columns, one
heading per case, two lines per backend (timings, then ratios); ``DIR/kernels.json`` gets it
all with the machine, versions, the command line and the targets check.

Threads: ``1`` runs with ``torch.set_num_threads(1)`` and one native thread
(``gradcomp.kernels.cpu.set_num_threads``); ``all`` with every core for both.
Every peer runs at every thread setting.

The default (three sizes up to 2**24, float32, all ops, 1 and all threads)
takes a few minutes on two cores, plus a ``torch.compile`` per int8 case
(cached on disk afterwards); ``--quick`` runs sizes 2**16 and 2**20 with
fewer rounds.

Modules: :mod:`.cases` (cases, inputs, backend calls, byte counts),
:mod:`.peers` (the peers), :mod:`.timing` (threads, warm-up, interleaved
rounds, statistics), :mod:`.runner` (the run over all cases), :mod:`.report`
(ratios, targets, the table) and :mod:`.cli` (options, ``main``).
"""

from .cli import build_parser, main, parse_size
from .report import TARGET_SIZE, TARGETS, check_targets, print_report, report_lines

__all__ = ["main", "build_parser", "parse_size", "TARGETS", "TARGET_SIZE", "check_targets", "print_report",
           "report_lines"]
