"""This machine's profile for the planner, measured on first use and cached per host and device.

``gradcomp plan`` and ``plan recommend`` price codec kernels with rates of the
machine they run on: the first call times every codec op here
(:func:`gradcomp.lab.plan.calibrate.measure_kernels`, some seconds) and keeps the
profile in the user's cache directory (``$GRADCOMP_CACHE_DIR``, else
``$XDG_CACHE_HOME/gradcomp``, else ``~/.cache/gradcomp``), one file per host and
device; ``--recalibrate`` measures again, and so does a cached profile that lacks
the rate of an op the planner prices (one written before a codec was added:
its kernels would otherwise cost nothing). The latency per message is not
measured here (it is the network's): ``--alpha-us`` gives it, else
:data:`~gradcomp.lab.plan.profile.DEFAULT_ALPHA_S`. The shipped reference
profile is used only when measuring is impossible, and said to be another machine's.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

from gradcomp.lab.plan.profile import DEFAULT_ALPHA_S, OPS, Profile

__all__ = ["SHIPPED_PROFILE", "MEASURE_NUMEL", "ProfileOrigin", "cache_dir", "cache_path", "measure_here",
           "this_machine"]

#: the reference profile shipped with gradcomp (its development machine's, not the user's)
SHIPPED_PROFILE = os.path.join(os.path.dirname(__file__), "default_profile.json")
#: float32 elements each kernel is timed on at first use (4 MiB: a few seconds for every op)
MEASURE_NUMEL = 2**20


@dataclass
class ProfileOrigin:
    """Where a profile's kernel rates came from: ``kind`` is ``"measured"`` (on this
    machine, ``when``, cached at ``path``), ``"file"`` (``--profile``) or ``"shipped"``
    (the reference profile, with ``why`` this machine could not be measured)."""

    kind: str
    path: str
    when: str = ""
    why: str = ""


def cache_dir() -> str:
    """The directory of the cached profiles (not created)."""
    if os.environ.get("GRADCOMP_CACHE_DIR"):
        return os.environ["GRADCOMP_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradcomp")


def cache_path(device: str = "cpu") -> str:
    """``<cache_dir>/profile-<host name>-<device>.json``."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return os.path.join(cache_dir(), f"profile-{host}-{device}.json")


def measure_here(on_progress: Callable[[int, int], None] | None = None) -> Profile:
    """This machine's kernel rates and per-call costs (CPU, torch's threads), the
    default latency per message, the host name and date in ``source``."""
    from gradcomp.lab.plan.calibrate import measure_kernels

    k = measure_kernels(numel=MEASURE_NUMEL, repeats=5, on_progress=on_progress)
    source = {**k["source"], "machine": socket.gethostname(), "measured": time.strftime("%Y-%m-%d %H:%M"),
              "alpha": f"default {DEFAULT_ALPHA_S * 1e6:g} us (not measured)"}
    return Profile(alpha_s=DEFAULT_ALPHA_S, kernels=k["kernels"], call_s=k["call_s"], source=source)


def this_machine(recalibrate: bool = False, on_progress=None) -> tuple[Profile, ProfileOrigin]:
    """The cached profile of this machine; measured (and cached) when there is none,
    when it lacks the rate of an op of :data:`~gradcomp.lab.plan.profile.OPS` (cached
    before that op existed), or ``recalibrate``; the shipped profile when measuring fails.

    Args:
        recalibrate: measure even when a cached profile exists.
        on_progress: ``f(done, total)`` as the kernels are timed.
    """
    path = cache_path()
    if not recalibrate and os.path.exists(path):
        try:
            prof = Profile.load(path)
            if all(op in prof.kernels for op in OPS):
                return prof, ProfileOrigin("measured", path, prof.source.get("measured", ""))
        except (OSError, ValueError):
            pass  # a damaged cache entry is measured again (as is an incomplete one, above)
    try:
        prof = measure_here(on_progress)
    except (ImportError, RuntimeError, OSError) as e:  # no kernels here: the reference is all there is
        return Profile.load(SHIPPED_PROFILE), ProfileOrigin("shipped", SHIPPED_PROFILE, why=f"{type(e).__name__}: {e}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.save(path)
    except OSError as e:
        return prof, ProfileOrigin("measured", f"(not cached: {e.strerror or e})", prof.source["measured"])
    return prof, ProfileOrigin("measured", path, prof.source["measured"])
