"""One collective at a time per process group and process; concurrent calls wait their turn.

Two threads that run gradcomp collectives on one process group at the same
time would post point-to-point messages with the same peers and tags, so
their bytes would mix. :func:`exclusive` holds a group for the duration of a
call: a second thread's call on it waits until the first returns (at most
its ``timeout``), so each rank runs its calls on a group one after another.
Which call of one rank pairs with which of another then depends on the order
in which each rank's threads arrive; the agreement tells the calls apart by
their ``tag`` or, untagged, the calling thread's name
(:func:`gradcomp.comm.agreement.call_identity`), so calls that pair up
wrongly raise the same ``ValueError`` on every rank instead of returning
mixed sums. To run collectives of several threads *concurrently*, give each
thread its own group (``torch.distributed.new_group``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

__all__ = ["exclusive"]

_LOCK = threading.Condition()
# id(group) -> (group, thread name, thread ident): the group is held while its call runs
_IN_USE: dict[int, tuple[object, str, int]] = {}


@contextmanager
def exclusive(group, what: str = "gradcomp.allreduce", timeout: float | None = None):
    """Hold ``group`` for one call of this thread, waiting while another thread holds it.

    Args:
        group: the process group.
        what: the caller, for error messages.
        timeout: seconds to wait for another thread's call to end (None: no limit).

    Raises:
        RuntimeError: this thread already holds ``group`` (a collective started
            inside another on the same group), or another thread held it for
            more than ``timeout`` seconds (nothing was sent by this call).
    """
    key, me = id(group), threading.get_ident()
    deadline = None if timeout is None else time.monotonic() + timeout
    with _LOCK:
        while True:
            held = _IN_USE.get(key)
            if held is None or held[0] is not group:
                break
            if held[2] == me:
                raise RuntimeError(f"{what}: this thread is already in a gradcomp collective on this process "
                                   "group (a collective cannot run inside another on the same group)")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RuntimeError(
                    f"{what}: the process group was in use by thread {held[1]!r} of this process for more "
                    f"than {timeout} s; collectives of several threads on one group run one at a time "
                    "(give each thread its own group, torch.distributed.new_group, to run them concurrently)")
            _LOCK.wait(left)
        _IN_USE[key] = (group, threading.current_thread().name, me)
    try:
        yield
    finally:
        with _LOCK:
            _IN_USE.pop(key, None)
            _LOCK.notify_all()
