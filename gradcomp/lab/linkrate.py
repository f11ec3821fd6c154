"""The achieved rate of one point-to-point transfer between two ranks of a group.

:func:`measure_link` is what :class:`gradcomp.lab.cluster.LocalCluster` runs on entry to
record each tier's achieved rate (and what tests run to check a shaped link): TCP payload
bytes over the receiver's time, after a handshake, so connection set-up is not counted.
"""

from __future__ import annotations

import math
import time

__all__ = ["measure_link"]


def measure_link(rank: int, world_size: int, nbytes: int, src: int = 0, dst: int = 1,
                 group=None) -> float | None:
    """Run on every rank of an initialised group: rank ``src`` sends ``nbytes``
    to rank ``dst``, which returns the achieved rate in bit/s (others return None).

    The receiver's clock starts when a 1-byte handshake from the sender
    arrives (the big message follows at once) and stops when the last byte is
    in, so connection set-up and the sender's enqueue time are excluded.
    """
    import torch
    import torch.distributed as dist

    if rank not in (src, dst):
        return None
    peer = dst if rank == src else src
    tiny = torch.zeros(1, dtype=torch.uint8)
    big = torch.empty(nbytes, dtype=torch.uint8)
    # warm the connection (gloo opens pairs lazily, TCP ramps up)
    for _ in range(2):
        if rank == src:
            dist.send(tiny, peer, group=group)
        else:
            dist.recv(tiny, peer, group=group)
    if rank == src:
        dist.send(tiny, peer, group=group)
        dist.send(big, peer, group=group)
        dist.recv(tiny, peer, group=group)
        return None
    dist.recv(tiny, peer, group=group)
    t0 = time.perf_counter()
    dist.recv(big, peer, group=group)
    dt = time.perf_counter() - t0
    dist.send(tiny, peer, group=group)
    return 8.0 * nbytes / dt if dt > 0 else math.inf
