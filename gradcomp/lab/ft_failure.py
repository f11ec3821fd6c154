"""A torchft replica group killed and restarted on the emulated cluster: what the failure costs.

Three replica groups (one process each, the study's digits MLP, random batches
of 64, gradcomp's int8 ring allreduce of one flat gradient buffer through
:class:`gradcomp.integrations.torchft.ManagedAllreduce`) run each in its own
network namespace of a :class:`~gradcomp.lab.cluster.LocalCluster` with links
shaped to ``rate``; torchft's lighthouse runs in a fourth. After the last group
committed step ``kill_at`` it is SIGKILLed and started again at once; it heals
from a survivor and joins. :func:`kill_and_heal` returns the survivors' failed
steps after the kill (``lost_beyond_in_flight``: less the step in flight), the
time from the kill to their next commit and their longest stall between two
commits after it (``survivors_stall_s``), and from the restart to the restarted
group's first commit (``restart_to_entry_s``: interpreter and imports;
``entry_to_first_commit_s``: set-up, quorum, heal over the link, first step).
Every child is ended by its PID on every exit path and the cluster removes its
namespaces. ``python -m gradcomp.lab.ft_failure --help``; results:
docs/results/fault-tolerance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import time

__all__ = ["main", "kill_and_heal"]

#: replica groups of the run, and the lighthouse's host in the cluster (the last one)
REPLICAS = 3
#: the lighthouse's settings (milliseconds): a dead group is noticed after the heartbeat timeout
LIGHTHOUSE = {"min_replicas": 2, "join_timeout_ms": 1000, "heartbeat_timeout_ms": 1500, "quorum_tick_ms": 100}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.ReLU(), torch.nn.Linear(384, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _replica_main(index: int, lighthouse: str, out: str, target: int) -> None:
    """One replica group: a JSON line per step to ``out/r<index>-<pid>.jsonl``; it
    stops once past ``target`` with the last 3 committed steps in a full quorum."""
    import torch

    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce
    from gradcomp.lab.study.ft import replica_manager

    start = time.time()
    torch.set_num_threads(1)  # the replica groups share the host's cores
    addr = os.environ.get("GRADCOMP_CLUSTER_ADDR", "127.0.0.1")
    timeout = datetime.timedelta(seconds=5)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _store, pg, manager = replica_manager(model, opt, replica_id=f"r{index}", addr=addr, lighthouse=lighthouse,
                                          timeout=timeout, min_replica_size=2, use_async_quorum=False,
                                          quorum_timeout=datetime.timedelta(seconds=60))
    ar = ManagedAllreduce(manager, pg, gc.Int8Quantizer(), timeout=5.0)
    params = list(model.parameters())
    with open(os.path.join(out, f"r{index}-{os.getpid()}.jsonl"), "w", buffering=1) as log:
        log.write(json.dumps({"start": start, "pid": os.getpid()}) + "\n")
        streak = 0
        while not (manager.current_step() >= target and streak >= 3):
            manager.start_quorum()
            t0, step0, n = time.time(), manager.current_step(), manager.num_participants()
            g = torch.Generator().manual_seed(1000 * step0 + index)
            x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            flat = ar.allreduce(torch.cat([p.grad.reshape(-1) for p in params]), key="grads")
            for p, part in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(part.view_as(p))
            ok = ar.commit()
            if ok:
                opt.step()
            log.write(json.dumps({"step0": step0, "step": manager.current_step(), "ok": ok, "n": n,
                                  "t0": t0, "t": time.time()}) + "\n")
            streak = streak + 1 if ok and n == REPLICAS else 0
        log.write(json.dumps({"done": manager.current_step(), "digest": _digest(params)}) + "\n")
    manager.shutdown(wait=False)


def _digest(params) -> str:
    """SHA-256 of the parameters' bytes (equal digests: bit-identical parameters)."""
    import hashlib

    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _lighthouse_main() -> None:
    """The lighthouse: prints its port, serves until stdin closes, then stops."""
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
    print(lh.address().rsplit(":", 1)[1], flush=True)
    try:
        sys.stdin.read()  # EOF: the parent asks it to stop (or died)
    finally:
        lh.shutdown()


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def _committed(out: str, index: int, step: int) -> bool:
    return any(r.get("ok") and r["step"] >= step for p in glob.glob(os.path.join(out, f"r{index}-*.jsonl"))
               for r in _records(p))


def _stop(procs: list[subprocess.Popen]) -> None:
    """End every child still running by its PID (SIGKILL), and reap it."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _run(cluster, out: str, target: int, kill_at: int, timeout: float) -> dict:
    """Start the lighthouse and the replica groups in ``cluster``, kill and restart
    the last group; returns the pids and times of the kill and the restart."""
    argv = [sys.executable, "-m", "gradcomp.lab.ft_failure"]
    env = {"RUST_LOG": "warn", "PYTHONWARNINGS": "ignore"}
    procs: list[subprocess.Popen] = []
    try:
        lh = cluster.popen(REPLICAS, [*argv, "lighthouse"], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
        procs.append(lh)
        port = lh.stdout.readline().strip()  # bounded: the lighthouse prints its port at once or dies
        if not port.isdigit():
            raise RuntimeError(f"the lighthouse did not start (exit status {lh.poll()})")
        address = f"http://{cluster.addresses[REPLICAS]}:{port}"
        errs = [open(os.path.join(out, f"err{i}.txt"), "a") for i in range(REPLICAS)]

        def spawn(i: int) -> subprocess.Popen:
            p = cluster.popen(i, [*argv, "replica", str(i), address, out, str(target)], env=env,
                              stdout=subprocess.DEVNULL, stderr=errs[i])
            procs.append(p)
            return p

        replicas = [spawn(i) for i in range(REPLICAS)]
        victim = replicas[-1]
        _wait(lambda: _committed(out, REPLICAS - 1, kill_at), timeout, f"group {REPLICAS - 1} to commit step {kill_at}")
        os.kill(victim.pid, signal.SIGKILL)  # `ip netns exec` execs: the pid is the replica's
        killed_at = time.time()
        victim.wait(timeout=10)
        restarted_at = time.time()
        replicas.append(spawn(REPLICAS - 1))
        deadline = time.monotonic() + timeout
        for p in replicas[:-2] + replicas[-1:]:
            left = max(1.0, deadline - time.monotonic())
            if p.wait(timeout=left) != 0:
                raise RuntimeError(f"replica pid {p.pid} exited with {p.returncode}: see {out}/err*.txt")
        lh.stdin.close()  # asks the lighthouse to stop
        lh.wait(timeout=10)
        return {"victim": victim.pid, "restarted": replicas[-1].pid, "killed_at": killed_at,
                "restarted_at": restarted_at}
    finally:
        _stop(procs)


def _figures(out: str, run: dict) -> dict:
    """The failure's figures from the replica logs (see the module docstring)."""
    logs = {}  # pid -> (group index, records), from the file names r<index>-<pid>.jsonl
    for path in glob.glob(os.path.join(out, "r*-*.jsonl")):
        index, pid = os.path.basename(path)[1:-len(".jsonl")].split("-")
        logs[int(pid)] = (int(index), _records(path))
    kill, restart = run["killed_at"], run["restarted_at"]
    survivors = [recs for pid, (i, recs) in logs.items() if i != REPLICAS - 1]
    restarted = logs[run["restarted"]][1]
    steps = [r for recs in survivors for r in recs if "ok" in r]
    failed = [sum(1 for r in recs if "ok" in r and not r["ok"] and r["t"] > kill) for recs in survivors]
    next_commit = [min(r["t"] for r in recs if r.get("ok") and r["t"] > kill) - kill for recs in survivors]
    stall = []  # per survivor: the longest time between two commits, the later one after the kill
    for recs in survivors:
        t = [kill] + [r["t"] for r in recs if r.get("ok") and r["t"] > kill]
        stall.append(max(b - a for a, b in zip(t, t[1:])))
    first_commit = min(r["t"] for r in restarted if r.get("ok"))
    digests = {recs[-1].get("digest") for pid, (i, recs) in logs.items() if pid != run["victim"]}
    step_s = sorted(r["t"] - r["t0"] for r in steps if r["ok"] and r["t"] < kill)
    return {"survivor_failed_steps": max(failed), "lost_beyond_in_flight": max(0, max(failed) - 1),
            "kill_to_survivors_next_commit_s": max(next_commit), "survivors_stall_s": max(stall), "restart_to_first_commit_s": first_commit - restart,
            "restart_to_entry_s": restarted[0]["start"] - restart, "entry_to_first_commit_s": first_commit - restarted[0]["start"],
            "restarted_first_step": next(r["step0"] for r in restarted if "step0" in r),
            "step_median_s": step_s[len(step_s) // 2] if step_s else None,
            "bit_identical": len(digests) == 1 and None not in digests}


def kill_and_heal(rate: str = "100mbit", target: int = 40, kill_at: int = 10, timeout: float = 240.0,
                  out: str | None = None) -> dict:
    """Kill and restart one of three torchft replica groups on an emulated cluster
    (see the module docstring).

    Args:
        rate: the links' rate (:func:`gradcomp.lab.cluster.link_rate_bps`'s syntax).
        target: steps every group trains (at least ``kill_at + 5``).
        kill_at: the step the last group has committed when it is killed (>= 1).
        timeout: seconds each wait may take.
        out: folder for the replicas' logs (default: a new temporary one).

    Returns:
        The figures, the link (``link``: configured and achieved rates) and ``out``.

    Raises:
        gradcomp.lab.cluster.ClusterError: no namespaces here (not root, no iproute2).
        TimeoutError / RuntimeError: a wait ran out or a replica failed (its log is in ``out``).
    """
    import tempfile

    from gradcomp import _validate as v
    from gradcomp.lab.cluster import LocalCluster

    kill_at = v.integer("kill_at", kill_at, 1, 10**6)
    target = v.integer("target", target, kill_at + 5, 10**6)
    out = out or tempfile.mkdtemp(prefix="gradcomp-ft-failure-")
    with LocalCluster(REPLICAS + 1, rate=rate) as cluster:
        run = _run(cluster, out, target, kill_at, timeout)
        link = cluster.describe()
    return {**_figures(out, run), "link": link, "out": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gradcomp.lab.ft_failure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", default="100mbit", help="the links' rate (default 100mbit)")
    ap.add_argument("--steps", type=int, default=40, help="steps every replica group trains (default 40)")
    ap.add_argument("--kill-at", type=int, default=10, help="kill after this committed step (default 10)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the kill this many times (default 1)")
    args = ap.parse_args(argv)
    for _ in range(args.runs):
        print(json.dumps(kill_and_heal(args.link, args.steps, args.kill_at)), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        _replica_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "lighthouse":
        _lighthouse_main()
    else:
        sys.exit(main())
