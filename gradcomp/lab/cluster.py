"""An emulated cluster on one machine: one network namespace per host, shaped links.

:class:`LocalCluster` gives every host a Linux network namespace whose interface ``gc0`` is
plugged into a bridge in a "switch" namespace. A host runs ``ranks_per_host`` ranks (default
1): they share its namespace and reach each other over its loopback (unshaped, or a tbf at
``intra_rate``: the fast tier); hosts reach each other over links shaped by a tbf in both
directions (on ``gc0`` and on the switch port) to ``rate`` (the slow tier), which may change
at given seconds (a schedule) and be redrawn every ``jitter_period_s`` (``rate_jitter``,
:mod:`gradcomp.lab.shaping`). Nothing is created in the machine's own
namespace: its interfaces, loopback and qdiscs are never touched.

Ranks run through :func:`gradcomp.launch.launch` in their host's namespace, with gloo bound to
``gc0`` and torchrun's ``GROUP_RANK``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set per host.
Leaving the ``with`` block on any path (an exception, SIGINT, SIGTERM) kills what runs in its
namespaces and deletes them; a cluster whose process was SIGKILLed leaves namespaces named
:data:`PREFIX` plus its PID, which the next cluster removes once that PID is gone. Needs Linux,
root and iproute2, else :class:`ClusterError` says which is missing. Shapes, rates, burst
sizes and what cannot be emulated (per-message latency without ``sch_netem``): docs/cluster.md.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gradcomp.lab.linkrate import measure_link
from gradcomp.lab.shaping import (MAX_RATE_BPS, MIN_RATE_BPS, RateSchedule, Shaper, link_rate_bps,
                                  link_schedule)
from gradcomp.lab.units import format_rate, format_schedule, parse_topology

__all__ = ["LocalCluster", "ClusterError", "link_rate_bps", "link_schedule", "requirements_missing",
           "leftovers", "remove_leftovers", "measure_link", "launch_on", "link_argument", "link_type", "jitter_type",
           "topology_type", "LINKS", "MAX_WORLD", "MAX_RANKS_PER_HOST",
           "PREFIX", "IFNAME"]

#: Every namespace a cluster makes is named ``PREFIX<pid>-<n>-<role>``; ``$GRADCOMP_NETNS_PREFIX``
#: (read at import) gives users who share a machine prefixes of their own.
PREFIX = os.environ.get("GRADCOMP_NETNS_PREFIX", "gcc-")
if not re.fullmatch(r"[a-z][a-z0-9]{0,7}-", PREFIX):
    raise ValueError(f"GRADCOMP_NETNS_PREFIX must be 1 to 8 lowercase letters or digits (a letter first) "
                     f"and a '-', got {PREFIX!r}")
#: The rank-side interface, the same name in every rank's namespace.
IFNAME = "gc0"
#: Named links of the command line (``none`` = the unshaped loopback).
LINKS = ("none", "100mbit", "1gbit", "10gbit")
#: Addresses: 198.18.0.0/15 is reserved for network benchmarks (RFC 2544).
SUBNET = "198.18.0"
#: most hosts (one address each in SUBNET)
MAX_WORLD = 250
#: most ranks on one host
MAX_RANKS_PER_HOST = 64

_counter = itertools.count()


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built or used here (the message says why)."""


def link_argument(text: str) -> str:
    """A command-line ``--link`` value: ``"none"`` (or ``loopback``) or a rate,
    normalised (``"1000mbit"`` -> ``"1gbit"``).

    Raises:
        ValueError: neither (the message says what is allowed).
    """
    if text in ("none", "loopback"):
        return "none"
    try:
        return format_rate(link_rate_bps(text))
    except ValueError as e:
        raise ValueError(f"{e}; or none (the unshaped loopback)") from None


def link_type(text: str) -> str:
    """:func:`link_argument` as an ``argparse`` type (the reason in the usage error)."""
    import argparse

    try:
        return link_argument(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def jitter_type(text: str) -> float:
    """A ``--link-jitter`` fraction in [0, 1) as an ``argparse`` type."""
    import argparse

    try:
        val = float(text)
    except ValueError:
        val = -1.0
    if not 0 <= val < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return val


def requirements_missing() -> str | None:
    """None when a cluster can be built here, else the reason it cannot."""
    if not os.path.isdir("/proc/sys/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not on PATH"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def _namespaces() -> list[str]:
    r = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still in namespace ``ns`` (all started by the
    cluster that made it) and wait briefly for them to go."""
    r = _sh("ip", "netns", "pids", ns, check=False)
    pids = [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _delete(namespaces: Sequence[str]) -> None:
    for ns in namespaces:
        _kill_inside(ns)
    for ns in namespaces:
        _sh("ip", "netns", "del", ns, check=False)


def leftovers() -> list[str]:
    """Namespaces of clusters whose creating process is gone (found by :data:`PREFIX`)."""
    out = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            out.append(ns)
    return out


def remove_leftovers() -> list[str]:
    """Remove :func:`leftovers` (their processes killed first); returns their names."""
    old = leftovers()
    _delete(old)
    return old


def _burst(bps: int) -> int:
    """A token bucket's size in bytes: ``max(96 KiB, rate x 1 ms)``."""
    return max(96 * 1024, bps // 8 // 1000)


def _shape(world_size, hosts, ranks_per_host) -> tuple[int, int]:
    """``(hosts, ranks_per_host)`` from ``world_size`` (one rank per host) or ``hosts``."""
    from gradcomp import _validate

    if (world_size is None) == (hosts is None):
        raise ValueError("give world_size (one rank per host) or hosts (with ranks_per_host), not both "
                         f"and not neither; got world_size={world_size!r}, hosts={hosts!r}")
    per = _validate.integer("ranks_per_host", ranks_per_host, 1, MAX_RANKS_PER_HOST)
    if world_size is not None:
        if per != 1:
            raise ValueError("world_size means one rank per host: use hosts= with ranks_per_host=")
        return _validate.integer("world_size", world_size, 1, MAX_WORLD), 1
    return _validate.integer("hosts", hosts, 1, MAX_WORLD), per


def topology_type(text: str) -> tuple[int, int]:
    """A ``--topology HxR`` value (:func:`gradcomp.lab.units.parse_topology`) a cluster can
    build, as an ``argparse`` type."""
    import argparse

    try:
        hosts, per = parse_topology(text, "topology")
        _shape(None, hosts, per)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return hosts, per


@dataclass(frozen=True)
class _Link:
    ns: str        # the namespace the shaped interface is in
    dev: str       # the interface
    parent: str    # tc parent of the tbf qdisc ("root" or "1:")


class LocalCluster:
    """An emulated cluster of hosts with shaped links (see the module docstring).

    Args:
        world_size: ranks, one per host (the same as ``hosts=world_size``);
            give this or ``hosts``.
        rate: every inter-host link's rate in each direction (``"100mbit"``,
            ``"1gbit"``, ``"10gbit"``, any ``tc`` rate, or bit/s), or a schedule
            (:func:`link_schedule`: ``"1gbit@0,100mbit@120"``, seconds since the cluster
            came up or since the last ``shaper.restart()``).
        rate_jitter: fraction ``f`` in [0, 1): every ``jitter_period_s`` each
            inter-host link's rate is redrawn from ``rate x U(1 - f, 1 + f)``.
        jitter_period_s: seconds between redraws (>= 0.05).
        seed: seed of the redraws.
        latency: one-way delay per link in seconds (needs ``sch_netem``); None: none added.
        mtu: interface MTU in bytes (576 to 65535, default 9000, jumbo frames).
        calibrate: measure the achieved rate of each tier on entry (and of every phase of a
            schedule: :attr:`phases_achieved_bps`).
        hosts: hosts, 1 to 250 (with ``ranks_per_host``: the two-tier cluster).
        ranks_per_host: ranks sharing each host's namespace, 1 to 64; rank
            ``g`` runs on host ``g // ranks_per_host`` (torchrun's placement).
        intra_rate: the rate of each host's intra-host bus (its loopback,
            shared by all of its ranks' traffic to each other); None: unshaped.

    Use::

        with LocalCluster(hosts=2, ranks_per_host=4, rate="100mbit") as c:
            out = c.run(fn, arg)      # fn(rank, world_size, arg) in each rank's host namespace
            c.achieved_bps            # inter-host, measured by a calibration transfer on entry
            c.intra_achieved_bps      # intra-host (ranks_per_host >= 2)

    Raises:
        ValueError / TypeError: a bad argument (named in the message).
        ClusterError: not root, no iproute2, no ``sch_netem`` for ``latency``, or an
            ``ip`` / ``tc`` command failed (the command and its message are given).
    """

    def __init__(self, world_size: int | None = None, rate: str | int | float = "1gbit",
                 rate_jitter: float = 0.0, jitter_period_s: float = 1.0, seed: int = 0,
                 latency: float | None = None, mtu: int = 9000, calibrate: bool = True, *,
                 hosts: int | None = None, ranks_per_host: int = 1,
                 intra_rate: str | int | float | None = None):
        from gradcomp import _validate

        self.hosts, self.ranks_per_host = _shape(world_size, hosts, ranks_per_host)
        self.world_size = self.hosts * self.ranks_per_host
        self.phases = link_schedule(rate)
        self.rate_bps = self.phases[0][1]  # the rate when the cluster comes up
        self.intra_rate_bps = None if intra_rate is None else link_rate_bps(intra_rate)
        if self.intra_rate_bps is not None and self.ranks_per_host < 2:
            raise ValueError("intra_rate shapes traffic between ranks of one host: it needs ranks_per_host >= 2")
        self.rate_jitter = _validate.real("rate_jitter", rate_jitter)
        if not 0 <= self.rate_jitter < 1:
            raise ValueError(f"rate_jitter must be in [0, 1), got {rate_jitter!r}")
        self.jitter_period_s = _validate.real("jitter_period_s", jitter_period_s)
        if not 0.05 <= self.jitter_period_s <= 3600:
            raise ValueError(f"jitter_period_s must be in [0.05, 3600] seconds, got {jitter_period_s!r}")
        self.seed = _validate.integer("seed", seed, 0, 2**63 - 1)
        if latency is not None:
            latency = _validate.real("latency", latency)
            if not 0 <= latency <= 10:
                raise ValueError(f"latency must be None or in [0, 10] seconds, got {latency!r}")
        self.latency = latency
        self.mtu = _validate.integer("mtu", mtu, 576, 65535)
        self.calibrate_on_enter = _validate.flag("calibrate", calibrate)
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.namespaces = [f"{self.name}-h{h}" for h in range(self.hosts)]
        self.switch = f"{self.name}-sw"
        self.addresses = [f"{SUBNET}.{h + 1}" for h in range(self.hosts)]
        self.achieved_bps: float | None = None
        self.phases_achieved_bps: list[float] | None = None
        self.schedule = RateSchedule(self.phases, self.rate_jitter, self.jitter_period_s, self.seed)
        #: applies the changing rate (a schedule or jitter) while the cluster is up; else None
        self.shaper: Shaper | None = None
        self.intra_achieved_bps: float | None = None
        self._links: list[tuple[_Link, _Link]] = []
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    @property
    def topology(self) -> str:
        """``"HxR"``: hosts x ranks per host."""
        return f"{self.hosts}x{self.ranks_per_host}"

    def host_of(self, rank: int) -> int:
        """The host index of ``rank`` (``rank // ranks_per_host``)."""
        return rank // self.ranks_per_host

    def namespace_of(self, rank: int) -> str:
        """The network namespace ``rank`` runs in (its host's)."""
        return self.namespaces[self.host_of(rank)]

    # ------------------------------------------------------------------ shaping

    @property
    def burst_bytes(self) -> int:
        """The inter-host token bucket's size: ``max(96 KiB, rate x 1 ms)``."""
        return _burst(self.rate_bps)

    def _tbf(self, verb: str, link: _Link, bps: int, configured: int | None = None) -> None:
        burst = _burst(self.rate_bps if configured is None else configured)
        _sh("tc", "-n", link.ns, "qdisc", verb, "dev", link.dev,
            *(("root",) if link.parent == "root" else ("parent", link.parent)), "handle", "10:",
            "tbf", "rate", f"{bps}bit", "burst", str(burst),
            "limit", str(burst + bps // 8 // 20))  # 50 ms of queue

    def scheduled_rate(self, host: int, period: int) -> int:
        """The rate in bit/s of host ``host``'s link at the start of jitter period ``period``
        (:meth:`RateSchedule.rate_at <gradcomp.lab.shaping.RateSchedule.rate_at>`)."""
        return self.schedule.rate_at(host, period * self.jitter_period_s)

    def current_period(self) -> int:
        """The jitter period now (0 while no jitter runs)."""
        if self.rate_jitter == 0 or self.shaper is None:
            return 0
        return int(self.shaper.now_s() // self.jitter_period_s)

    def link_rate(self, host: int, dev: str = IFNAME) -> int:
        """The rate in bit/s that ``tc`` reports now for host ``host``'s upload
        qdisc (``dev="lo"``: its intra-host bus, when shaped)."""
        out = _sh("tc", "-n", self.namespaces[host], "qdisc", "show", "dev", dev).stdout
        m = re.search(r"tbf 10: .*?rate ([0-9.]+)([KMG]?)bit", out)
        if m is None:
            raise ClusterError(f"no tbf qdisc on host {host}'s {dev}: {out.strip()}")
        return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])

    def _apply(self, t_s: float) -> None:
        """Set every inter-host link to its scheduled rate at ``t_s`` (``tc qdisc change``)."""
        base = self.schedule.base_at(t_s)
        for host, pair in enumerate(self._links):
            for link in pair:
                self._tbf("change", link, self.schedule.rate_at(host, t_s), base)

    def _measure_phases(self) -> list[float]:
        """The achieved rate of each phase of the schedule, measured with the links set to
        that phase's base rate; the links are back at phase 0 after."""
        out = []
        for start, bps in self.phases:
            for pair in self._links:
                for link in pair:
                    self._tbf("change", link, bps, bps)
            out.append(self.measure_rate(int(min(128 << 20, max(1 << 20, bps / 8 * 0.5)))))
        self._apply(0.0)
        return out

    # ---------------------------------------------------------------- lifecycle

    def _netem_supported(self) -> str | None:
        r = _sh("tc", "-n", self.namespaces[0], "qdisc", "add", "dev", "lo", "root", "netem",
                "delay", "0ms", check=False)
        if r.returncode != 0:
            return (r.stderr or r.stdout).strip() or "tc refused netem"
        _sh("tc", "-n", self.namespaces[0], "qdisc", "del", "dev", "lo", "root", check=False)
        return None

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for r, ns in enumerate(self.namespaces):  # r: the host
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if r == 0 and self.latency is not None:
                reason = self._netem_supported()
                if reason is not None:
                    raise ClusterError(f"latency={self.latency!r} needs the kernel's sch_netem "
                                       f"qdisc, which this kernel lacks ({reason}); run without latency")
            port = f"sw{r}"
            _sh("ip", "-n", self.switch, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", IFNAME, "mtu", str(self.mtu), "netns", ns)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[r]}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            up = _Link(ns, IFNAME, "root")
            if self.latency is not None:
                _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "netem",
                    "delay", f"{self.latency * 1e3:.3f}ms", "limit", "100000")
                up = _Link(ns, IFNAME, "1:")
            down = _Link(self.switch, port, "root")
            for link in (up, down):
                self._tbf("add", link, self.rate_bps)
            self._links.append((up, down))
            if self.intra_rate_bps is not None:  # the host's own loopback: its intra-host bus
                self._tbf("add", _Link(ns, "lo", "root"), self.intra_rate_bps, self.intra_rate_bps)

    def __enter__(self) -> "LocalCluster":
        reason = requirements_missing()
        if reason is not None:
            raise ClusterError(f"LocalCluster: {reason}")
        remove_leftovers()
        self._install_signal_handlers()
        atexit.register(self._teardown)
        try:
            self._build()
            self._up = True
            if self.calibrate_on_enter and self.hosts >= 2 and len(self.phases) > 1:
                self.phases_achieved_bps = self._measure_phases()
            if self.schedule.changing:
                self.shaper = Shaper(self.schedule, self._apply)
                self.shaper.start(f"{self.name}-shaper")
            if self.calibrate_on_enter and self.hosts >= 2:
                self.achieved_bps = (self.measure_rate() if self.phases_achieved_bps is None
                                     else self.phases_achieved_bps[0])
            if self.calibrate_on_enter and self.ranks_per_host >= 2:
                self.intra_achieved_bps = self.measure_rate(tier="intra")
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def _teardown(self) -> None:
        if self.shaper is not None:
            self.shaper.stop()
            self.shaper = None
        _delete([*self.namespaces, self.switch])
        self._up = False
        self._links = []
        self._restore_signal_handlers()
        atexit.unregister(self._teardown)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum, frame):
            raise SystemExit(128 + signum)

        for sig, handler in ((signal.SIGTERM, on_term), (signal.SIGINT, signal.default_int_handler)):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    # -------------------------------------------------------------------- running

    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment of a rank's processes: gloo on ``gc0``, host 0 as master,
        and torchrun's variables for its host (``GROUP_RANK``, ``LOCAL_RANK``,
        ``LOCAL_WORLD_SIZE``)."""
        host = self.host_of(rank)
        return {"GLOO_SOCKET_IFNAME": IFNAME, "MASTER_ADDR": self.addresses[0],
                "GRADCOMP_CLUSTER_ADDR": self.addresses[host], "GROUP_RANK": str(host),
                "LOCAL_RANK": str(rank % self.ranks_per_host), "LOCAL_WORLD_SIZE": str(self.ranks_per_host)}

    def _check_up(self) -> None:
        if not self._up:
            raise ClusterError("the cluster is not up: use it inside `with LocalCluster(...) as c:`")

    def run(self, fn: Callable[..., Any], *args, timeout: float = 300.0,
            env: dict[str, str] | None = None, world_size: int | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank, each in its host's
        namespace, joined in a gloo group over the shaped links.

        Args:
            fn: a module-level (picklable) function.
            timeout: seconds for the whole run and every collective in it.
            env: extra environment variables for every rank.
            world_size: run on the first ``world_size`` ranks only (default all).

        Returns:
            The per-rank return values.

        Raises:
            gradcomp.launch.WorkerError / TimeoutError: as :func:`gradcomp.launch.launch`.
        """
        self._check_up()
        n = self.world_size if world_size is None else world_size
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.world_size:
            raise ValueError(f"world_size must be an int in [1, {self.world_size}], got {world_size!r}")
        return self.run_on(fn, list(range(n)), *args, timeout=timeout, env=env)

    def run_on(self, fn: Callable[..., Any], ranks: Sequence[int], *args, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> list[Any]:
        """Run ``fn(i, len(ranks), *args)`` on processes placed as cluster ranks
        ``ranks`` (each in that rank's host namespace, with its :meth:`rank_env`),
        joined in a group of their own: e.g. ``[0, ranks_per_host]`` for a pair
        on two hosts, ``[0, 1]`` for a pair on one.

        Returns / Raises: as :meth:`run`.
        """
        from gradcomp.launch import launch

        self._check_up()
        ranks = list(ranks)
        if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size
                            for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct ranks in [0, {self.world_size - 1}], got {ranks!r}")
        return launch(fn, len(ranks), args, timeout=timeout, env=env,
                      rank_env=[self.rank_env(r) for r in ranks], netns=[self.namespace_of(r) for r in ranks])

    def popen(self, rank: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` in rank ``rank``'s host namespace (``ip netns exec``), with
        :meth:`rank_env` on top of this process's environment and ``env``.
        The caller waits for it (with a timeout); whatever is left runs until the cluster exits."""
        self._check_up()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size - 1}], got {rank!r}")
        full_env = {**os.environ, **(env or {}), **self.rank_env(rank)}
        return subprocess.Popen(["ip", "netns", "exec", self.namespace_of(rank), *argv],
                                env=full_env, **kwargs)

    def measure_rate(self, nbytes: int | None = None, timeout: float = 120.0, tier: str = "inter") -> float:
        """Achieved rate in bit/s of one transfer (:func:`gradcomp.lab.linkrate.measure_link`):
        ``tier="inter"`` from host 0 to host 1, ``"intra"`` between ranks 0 and 1 of host 0.
        ``nbytes`` default: half a second at the rate (1 to 128 MiB; 32 MiB unshaped)."""
        self._check_up()
        if tier not in ("inter", "intra"):
            raise ValueError(f"tier must be 'inter' or 'intra', got {tier!r}")
        pair = [0, self.ranks_per_host] if tier == "inter" else [0, 1]
        if pair[1] >= self.world_size:
            raise ClusterError(f"measuring the {tier}-host tier needs at least 2 "
                               f"{'hosts' if tier == 'inter' else 'ranks per host'}")
        bps = self.rate_bps if tier == "inter" else self.intra_rate_bps
        if nbytes is None:
            nbytes = 32 << 20 if bps is None else int(min(128 << 20, max(1 << 20, bps / 8 * 0.5)))
        return self.run_on(measure_link, pair, nbytes, timeout=timeout)[1]

    def describe(self) -> dict:
        """What the runs ran on (for results JSON): the inter-host link's
        configured and achieved rates at the top level, the intra-host tier's under ``"intra"``."""
        intra = {"name": format_rate(self.intra_rate_bps) if self.intra_rate_bps else "none",
                 "configured_bps": self.intra_rate_bps, "achieved_bps": self.intra_achieved_bps,
                 "emulation": "netns loopback" + ("+tbf" if self.intra_rate_bps else "")}
        achieved = self.phases_achieved_bps or [self.achieved_bps if len(self.phases) == 1 else None] * len(self.phases)
        phases = [{"start_s": t, "configured_bps": bps, "achieved_bps": achieved[i]}
                  for i, (t, bps) in enumerate(self.phases)]
        return {"name": format_schedule(self.phases, format_rate), "configured_bps": self.rate_bps,
                "phases": phases,
                "achieved_bps": self.achieved_bps, "rate_jitter": self.rate_jitter,
                "jitter_period_s": self.jitter_period_s, "seed": self.seed,
                "latency_s": self.latency, "mtu": self.mtu, "world_size": self.world_size,
                "hosts": self.hosts, "ranks_per_host": self.ranks_per_host, "topology": self.topology,
                "intra": intra, "emulation": "netns+tbf"}


def launch_on(link: str | None, fn: Callable[..., Any], world_size: int, args: tuple = (), *,
              timeout: float = 300.0, rate_jitter: float = 0.0, seed: int = 0,
              env: dict[str, str] | None = None) -> tuple[list[Any], dict]:
    """Run ``fn(rank, world_size, *args)`` on local processes: over the loopback
    (``link`` None or ``"none"``, :func:`gradcomp.launch.launch`) or in a
    :class:`LocalCluster` whose links run at ``link``.

    Returns:
        ``(per-rank results, link description)`` (:meth:`LocalCluster.describe`,
        or ``{"name": "none", ...}`` for the loopback).
    """
    if link in (None, "none"):
        from gradcomp.launch import launch

        return (launch(fn, world_size, args, timeout=timeout, env=env),
                {"name": "none", "configured_bps": None, "achieved_bps": None, "emulation": "loopback"})
    with LocalCluster(world_size, rate=link, rate_jitter=rate_jitter, seed=seed) as c:
        return c.run(fn, *args, timeout=timeout, env=env), c.describe()
