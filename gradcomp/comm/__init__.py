"""Compressed collectives on torch.distributed process groups.

:func:`allreduce` dispatches to one of six algorithms, all built on
point-to-point ``isend`` / ``irecv`` of wire bytes (:mod:`gradcomp.comm.p2p`)
on any process group (gloo on CPU, NCCL on GPU):

* ``"ring"``: ring reduce-scatter with a decompress-add-recompress per hop
  (:mod:`gradcomp.comm.ring`), then the owner's bytes forwarded around the ring;
  pipelined in segments for large tensors when the compressor writes payloads
  in parts (:mod:`gradcomp.comm.pipelined`: int8 with nearest rounding);
* ``"two_phase"``: direct compressed reduce-scatter, one compression per chunk
  (:mod:`gradcomp.comm.two_phase`), then the same allgather;
* ``"allgather"``: for sparse compressors, every rank's payload gathered and
  the union summed (:mod:`gradcomp.comm.allgather`);
* ``"halving_doubling"`` (``2 log2 N`` messages), ``"sparse_reduce_scatter"`` (sparse, bytes per
  rank flat in N) and ``"hierarchical"`` (exact inside a host, compressed across hosts): one module each;
  ``"auto"`` picks one per bucket (:mod:`gradcomp.comm.auto`).

:func:`reduce_scatter` is the two-phase reduce-scatter on its own
(:mod:`gradcomp.comm.reduce_scatter`), for sharded data parallelism.
"""

from gradcomp.comm._args import (ALGORITHM_CHOICES, ALGORITHMS, DEFAULT_TIMEOUT, DENSE_ALGORITHMS, FLAT_DENSE_ALGORITHMS,
                                 INPUT_DTYPES, NATIVE, OPS, SPARSE_ALGORITHMS, check_algorithm,
                                 member_group)
from gradcomp.comm.auto import AutoAlgorithm
from gradcomp.comm.chunks import chunk_bounds, ring_raw_bytes
from gradcomp.comm.dispatch import allreduce
from gradcomp.comm.policy import CodecPolicy
from gradcomp.comm.reduce_scatter import reduce_scatter
from gradcomp.comm.topology import Topology

__all__ = ["allreduce", "reduce_scatter", "AutoAlgorithm", "ALGORITHMS", "ALGORITHM_CHOICES", "DENSE_ALGORITHMS", "SPARSE_ALGORITHMS",
           "FLAT_DENSE_ALGORITHMS", "OPS", "INPUT_DTYPES", "DEFAULT_TIMEOUT", "NATIVE", "CodecPolicy",
           "Topology", "chunk_bounds", "ring_raw_bytes", "check_algorithm", "member_group"]
