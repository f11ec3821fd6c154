"""One collective at a time per process group and process.

Two threads that run gradcomp collectives on one process group at the same
time post point-to-point messages with the same peers and tags, so their
bytes mix (equal sizes: silently wrong results on both; other sizes: a
misleading error or an abort). :func:`exclusive` marks a group as in use for
the duration of a call and makes a second, concurrent call fail at once with
a clear error. The documented way to run collectives from several threads is
one group per thread (``torch.distributed.new_group``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["exclusive"]

_LOCK = threading.Lock()
# id(group) -> (group, thread name): the group is held while its call runs
_IN_USE: dict[int, tuple[object, str]] = {}


@contextmanager
def exclusive(group, what: str = "gradcomp.allreduce"):
    """Hold ``group`` for one call of this thread.

    Raises:
        RuntimeError: another thread of this process is in a call on ``group``
            (nothing was sent by this call).
    """
    key = id(group)
    with _LOCK:
        held = _IN_USE.get(key)
        if held is not None and held[0] is group:
            raise RuntimeError(
                f"{what}: the process group is already in use by thread {held[1]!r} of this process; "
                "collectives that run concurrently on one group mix their messages. Give each thread "
                "its own group (torch.distributed.new_group)")
        _IN_USE[key] = (group, threading.current_thread().name)
    try:
        yield
    finally:
        with _LOCK:
            _IN_USE.pop(key, None)
