"""The emulated cluster: namespaces up and down on every exit path, shaped rates, jitter."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from gradcomp.lab.cluster import (PREFIX, ClusterError, LocalCluster, leftovers, link_rate_bps, requirements_missing,
                                  topology_type)
from gradcomp.lab.units import format_rate, parse_rate, parse_topology
from gradcomp.launch import WorkerError

REASON = requirements_missing()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(pid: int | None = None) -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    tag = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return [n for n in names if n.startswith(tag)]


def _host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout


def test_parse_rate():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5Gbit") == 2_500_000_000
    assert parse_rate(5e8) == 500_000_000
    assert format_rate(10**10) == "10gbit" and format_rate(1e8) == "100mbit"
    for bad in ("fast", "100", "-1gbit", "0mbit", "1pbit", True):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


def test_link_rate_bps_is_a_rate_tc_can_shape():
    assert link_rate_bps("100mbit") == 100_000_000 and link_rate_bps(2.5e9) == 2_500_000_000
    assert link_rate_bps("150kbit") == 150_000 and isinstance(link_rate_bps("150kbit"), int)
    for bad in ("50kbit", "1tbit", 5e11, "fast"):
        with pytest.raises(ValueError, match="rate"):
            link_rate_bps(bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        LocalCluster(0)
    with pytest.raises(ValueError, match="world_size .* or hosts"):
        LocalCluster(2, hosts=2)
    with pytest.raises(ValueError, match="world_size .* or hosts"):
        LocalCluster()
    with pytest.raises(ValueError, match="ranks_per_host"):
        LocalCluster(hosts=2, ranks_per_host=65)
    with pytest.raises(ValueError, match="use hosts="):
        LocalCluster(2, ranks_per_host=2)
    with pytest.raises(ValueError, match="intra_rate .* ranks_per_host >= 2"):
        LocalCluster(hosts=2, intra_rate="1gbit")
    with pytest.raises(ValueError, match="rate"):
        LocalCluster(hosts=2, ranks_per_host=2, intra_rate="fast")
    with pytest.raises(TypeError, match="world_size"):
        LocalCluster("4")
    with pytest.raises(ValueError, match="rate_jitter"):
        LocalCluster(2, rate_jitter=1.0)
    with pytest.raises(ValueError, match="jitter_period_s"):
        LocalCluster(2, jitter_period_s=0.0)
    with pytest.raises(ValueError, match="latency"):
        LocalCluster(2, latency=-1.0)
    with pytest.raises(ValueError, match="rate"):
        LocalCluster(2, rate="quick")
    with pytest.raises(ClusterError, match="not up"):
        LocalCluster(2).run(print)


def test_two_tier_shape_and_placement():
    c = LocalCluster(hosts=3, ranks_per_host=2, rate="100mbit", intra_rate="1gbit")
    assert (c.world_size, c.topology, c.intra_rate_bps) == (6, "3x2", 10**9)
    assert [c.host_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert len(set(c.namespace_of(r) for r in range(6))) == 3
    env = c.rank_env(3)
    assert (env["GROUP_RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2")
    assert env["GRADCOMP_CLUSTER_ADDR"] == c.addresses[1] and env["MASTER_ADDR"] == c.addresses[0]
    flat = LocalCluster(4)
    assert (flat.hosts, flat.ranks_per_host, flat.topology) == (4, 1, "4x1")
    assert parse_topology(" 2x4 ") == (2, 4) and parse_topology("3X1") == (3, 1)
    for bad in ("2", "2x", "0x4", "axb", "2x4x1"):
        with pytest.raises(ValueError, match="topology"):
            parse_topology(bad)
    import argparse

    assert topology_type("2x4") == (2, 4)
    for bad, what in (("2x65", "ranks_per_host"), ("251x1", "hosts"), ("2x", "topology")):
        with pytest.raises(argparse.ArgumentTypeError, match=what):
            topology_type(bad)


def test_jitter_schedule_is_seeded():
    a = LocalCluster(4, rate="100mbit", rate_jitter=0.5, seed=7)
    b = LocalCluster(4, rate="100mbit", rate_jitter=0.5, seed=7)
    c = LocalCluster(4, rate="100mbit", rate_jitter=0.5, seed=8)
    sched = [[a.scheduled_rate(r, p) for p in range(1, 20)] for r in range(4)]
    assert sched == [[b.scheduled_rate(r, p) for p in range(1, 20)] for r in range(4)]
    assert sched != [[c.scheduled_rate(r, p) for p in range(1, 20)] for r in range(4)]
    flat = [x for row in sched for x in row]
    assert all(50e6 <= x <= 150e6 for x in flat)
    assert max(flat) - min(flat) > 40e6  # the draws spread over the range
    assert a.scheduled_rate(0, 0) == 100_000_000  # period 0 runs at the configured rate


def _integer_sum(rank, world_size):
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + rank
    dist.all_reduce(x)
    return x


def _die(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _where(rank, world_size):
    import socket

    return os.environ["GLOO_SOCKET_IFNAME"], socket.gethostbyname(socket.gethostname()) or ""


@pytest.mark.slow
@needs_netns
def test_up_down_allreduce_exact_and_nothing_left():
    before = _host_links()
    with LocalCluster(3, rate="1gbit") as c:
        assert len(_ours(os.getpid())) == 4  # 3 ranks + the switch
        out = c.run(_integer_sum)
        base = torch.arange(1000, dtype=torch.float32)
        exact = base * 6 + 3  # sum over ranks of base * (r + 1) + r
        for x in out:
            assert torch.equal(x, exact)
        # the achieved rate of the calibration transfer is recorded and plausible
        assert 0.8e9 < c.achieved_bps < 1.2e9
        assert c.describe()["configured_bps"] == 10**9
    assert _ours(os.getpid()) == []
    assert _host_links() == before  # nothing was added to (or left in) the host's namespace


def _gc0_tx_bytes() -> int:
    """Bytes sent on this namespace's gc0 (/proc/net/dev is per network namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "gc0":
                return int(rest.split()[8])
    raise AssertionError("no gc0 in this namespace")


def _two_tier_run(rank, world_size, n):
    """Where the rank runs, an exact hierarchical sum, and what its host's link carried."""
    import gradcomp as gc

    place = (os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"])
    x = torch.arange(n, dtype=torch.float32) % 11 + rank
    exact = sum(torch.arange(n, dtype=torch.float32) % 11 + r for r in range(world_size))
    y = gc.allreduce(x, gc.NoCompression(), op="sum", algorithm="hierarchical")  # topology from the env
    meter = gc.TrafficMeter()
    dist.barrier()
    before = _gc0_tx_bytes()
    dist.barrier()
    gc.allreduce(x, gc.Int8Quantizer(), algorithm="hierarchical", meter=meter, check=False)
    dist.barrier()
    carried = _gc0_tx_bytes() - before
    return place, torch.equal(y, exact), meter.as_dict()["tiers"]["inter_host"]["bytes_sent"], carried


@pytest.mark.slow
@needs_netns
def test_two_tier_cluster_runs_hierarchical_and_leaves_nothing():
    """Hosts of two ranks: torchrun's variables per host, intra-host traffic off
    the shaped links (gc0 carries the meter's inter-host bytes plus TCP/IP
    headers and the barriers), the intra tier shaped to its own rate."""
    before = _host_links()
    with LocalCluster(hosts=2, ranks_per_host=2, rate="1gbit", intra_rate="200mbit") as c:
        assert len(_ours(os.getpid())) == 3  # 2 hosts + the switch
        assert abs(c.achieved_bps - 1e9) / 1e9 < 0.2
        assert abs(c.intra_achieved_bps - 200e6) / 200e6 < 0.15, c.intra_achieved_bps
        assert c.link_rate(1, "lo") == 200_000_000
        d = c.describe()
        assert (d["topology"], d["world_size"], d["intra"]["configured_bps"]) == ("2x2", 4, 200_000_000)
        out = c.run(_two_tier_run, 2**18, timeout=120)
    assert [o[0] for o in out] == [("0", "0", "2"), ("0", "1", "2"), ("1", "0", "2"), ("1", "1", "2")]
    assert all(o[1] for o in out)
    for host in range(2):
        meter_bytes = out[2 * host][2] + out[2 * host + 1][2]
        carried = out[2 * host][3]  # both ranks of the host read the same interface
        assert meter_bytes <= carried < 1.03 * meter_bytes + 20_000, (meter_bytes, carried)
    assert _ours(os.getpid()) == []
    assert _host_links() == before


@pytest.mark.slow
@needs_netns
def test_rate_100mbit_within_15_percent():
    with LocalCluster(2, rate="100mbit", calibrate=False) as c:
        bps = c.measure_rate(nbytes=4 << 20)
    assert abs(bps - 100e6) / 100e6 < 0.15, bps


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("shape", [dict(world_size=2), dict(hosts=2, ranks_per_host=2)])
def test_rank_sigkilled_cleans_up(shape):
    with pytest.raises(WorkerError):
        with LocalCluster(**shape, rate="1gbit", calibrate=False) as c:
            c.run(_die, timeout=60)
    assert _ours(os.getpid()) == []


def _script(body: str) -> str:
    head = (f"import sys, time\nsys.path.insert(0, {ROOT!r})\n"
            "from gradcomp.lab.cluster import LocalCluster\nimport tests.test_cluster as t\n")
    return head + textwrap.dedent(body)


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("sig,shape", [(signal.SIGINT, "2"), (signal.SIGTERM, "2"),
                                       (signal.SIGINT, "hosts=2, ranks_per_host=2")])
def test_signal_to_parent_cleans_up(sig, shape):
    body = f"""
        with LocalCluster({shape}, rate="1gbit", calibrate=False) as c:
            print("up", flush=True)
            c.run(t._sleep, timeout=120)
    """
    p = subprocess.Popen([sys.executable, "-c", _script(body)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30
        while len(_ours(p.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the ranks are inside their namespaces now
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode != 0
    assert _ours(p.pid) == []


def _sleep(rank, world_size):
    time.sleep(100)


@pytest.mark.slow
@needs_netns
def test_killed_parent_leftovers_removed_by_next_cluster():
    body = """
        c = LocalCluster(2, rate="1gbit", calibrate=False).__enter__()
        print("up", flush=True)
        time.sleep(100)
    """
    p = subprocess.Popen([sys.executable, "-c", _script(body)], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
    finally:
        p.kill()
        p.wait(10)
    assert len(_ours(p.pid)) == 3
    assert set(_ours(p.pid)) <= set(leftovers())
    with LocalCluster(2, rate="1gbit", calibrate=False):
        assert _ours(p.pid) == []
    assert _ours(os.getpid()) == []


@pytest.mark.slow
@needs_netns
def test_gloo_binds_to_the_shaped_interface():
    with LocalCluster(2, rate="1gbit", calibrate=False) as c:
        out = c.run(_where)
        ifname = [o[0] for o in out]
        assert ifname == ["gc0", "gc0"]
        assert c.rank_env(1)["MASTER_ADDR"] == c.addresses[0]


def _rates_in_periods(rank, world_size, remote, period_s, periods):
    """Rank 0 restarts the jitter (period 0 from now); then in each of ``periods`` (jitter
    period indices), once it has begun, one measured transfer 0 -> 1; returns
    [(period, bit/s, period at the end)]."""
    from gradcomp.lab.cluster import measure_link

    origin = torch.tensor([remote.restart() if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(origin, 0)
    t0 = origin.item()
    out = []
    for p in periods:
        start = t0 + p * period_s + 0.15
        time.sleep(max(0.0, start - time.monotonic()))
        dist.barrier()
        bps = measure_link(rank, world_size, 2 << 20)
        out.append((p, bps, int((time.monotonic() - t0) // period_s)))
    return out


def _min_rate(c, p):
    return min(c.scheduled_rate(0, p), c.scheduled_rate(1, p))  # upload of 0, download of 1


@pytest.mark.slow
@needs_netns
def test_jitter_changes_the_achieved_rate_as_scheduled():
    period_s = 2.0

    def spread(s):
        c = LocalCluster(2, "100mbit", rate_jitter=0.6, seed=s)
        return min(abs(_min_rate(c, p) - _min_rate(c, p + 1)) / 100e6 for p in range(1, 12))

    seed = next(s for s in range(500) if spread(s) > 0.2)
    with LocalCluster(2, rate="100mbit", rate_jitter=0.6, jitter_period_s=period_s, seed=seed,
                      calibrate=False) as c:
        # the ranks restart the jitter once they are up (a loaded host starts them slowly)
        out = c.run(_rates_in_periods, c.shaper.remote(), period_s, [1, 2], timeout=120)[1]
        assert c.link_rate(0) == pytest.approx(c.scheduled_rate(0, c.current_period()), rel=0.01)
    for p, bps, end in out:
        assert end == p, "a transfer outlasted its period"
        expected = _min_rate(c, p)
        assert abs(bps - expected) / expected < 0.15, (p, bps, expected)
    assert abs(out[0][1] - out[1][1]) / 100e6 > 0.1  # the two periods' rates differ


@pytest.mark.slow
@needs_netns
def test_latency_needs_netem():
    probe = subprocess.run(["bash", "-c", "modinfo sch_netem >/dev/null 2>&1 || "
                                          "grep -q sch_netem /proc/modules"], timeout=30)
    if probe.returncode == 0:
        pytest.skip("this kernel has sch_netem")
    with pytest.raises(ClusterError, match="sch_netem"):
        with LocalCluster(2, latency=0.001, calibrate=False):
            pass
    assert _ours(os.getpid()) == []


@needs_netns
@pytest.mark.slow
def test_torchrun_across_two_namespaces_as_hosts(tmp_path):
    """torchrun --nnodes 2 with each namespace as one host: rank 0 writes the
    results, bytes per worker per step equal a single-host run's, and every
    rank ends with bit-identical parameters."""
    import json

    from gradcomp.lab.study import command

    common = ["--mode", "sync", "--compressors", "int8", "--steps", "6", "--eval-every", "3",
              "--no-progress"]
    local = tmp_path / "local"
    assert command.main(["--workers", "4", "--out", str(local), *common]) == 0
    out = tmp_path / "torchrun"
    env = {"PYTHONPATH": ROOT, "GRADCOMP_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with LocalCluster(2, rate="1gbit", calibrate=False) as c:
        endpoint = f"{c.addresses[0]}:29512"
        procs = [c.popen(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                "--nproc-per-node", "2", "--node-rank", str(host),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                "--rdzv-id", "gradcomp-test",
                                # the first host serves the rendezvous store and each host
                                # advertises its namespace's address (torchrun would look
                                # both up from the hostname, which all namespaces share)
                                "--rdzv-conf", f"is_host={int(host == 0)}",
                                "--local-addr", c.addresses[host], "-m", "gradcomp.lab.study",
                                "--out", str(out), *common],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for host in range(2)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=180)[0])
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    ran = {(r["mode"], r["compressor"]): r for r in json.loads((out / "results.json").read_text())["runs"]}
    ref = {(r["mode"], r["compressor"]): r for r in json.loads((local / "results.json").read_text())["runs"]}
    assert set(ran) == set(ref) == {("sync", "none"), ("sync", "int8")}
    for key in ref:
        assert ran[key]["bytes_per_worker_per_step"] == ref[key]["bytes_per_worker_per_step"]
        digests = ran[key]["extra"]["param_sha256_per_worker"]
        assert len(digests) == 4 and len(set(digests)) == 1, digests
        # the same training as on one host: the same parameters
        assert digests == ref[key]["extra"]["param_sha256_per_worker"]


@needs_netns
@pytest.mark.slow
def test_parameter_server_runs_across_namespaces():
    """The ZeroMQ parameter server binds to its namespace's shaped interface;
    the demo's workers reach it there and the run converges."""
    r = subprocess.run([sys.executable, "-m", "gradcomp.ps", "--steps", "10", "--link", "1gbit",
                        "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    doc = json.loads(r.stdout)
    assert doc["updates"] == 20 and doc["link"]["configured_bps"] == 10**9
    assert 0.8e9 < doc["link"]["achieved_bps"] < 1.2e9
    assert doc["address"].startswith("tcp://198.18.0.1:")
    assert _ours() == [] or all(not n.startswith(f"{PREFIX}{os.getpid()}-") for n in _ours())
