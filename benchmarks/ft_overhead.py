"""gradcomp on torchft against gradcomp's own path, and what a killed replica group costs.

Three processes train the study's digits MLP (64-384-256-10, random batches of
64) with the int8 ring allreduce of every gradient, on CPU gloo over loopback:

* ``own``: one torch.distributed world (gradcomp.launch), ``gc.allreduce`` per gradient;
* ``ft``: three torchft replica groups (a lighthouse in this process), each step
  ``start_quorum`` + :class:`gradcomp.integrations.torchft.ManagedAllreduce` +
  ``should_commit``; no failure;
* ``kill``: as ``ft``, replica group 2 SIGKILLed after step ``--kill-at`` and
  restarted at once: the survivors' failed steps, the time from the kill to
  their next committed step, and from the restart to the restarted group's
  first committed step (its import and start-up included, then the heal).

Prints the median step time of ``own`` and ``ft`` (steps after ``--warmup``)
and their ratio, then the failure's figures. Run from the repository root::

    python benchmarks/ft_overhead.py [--steps 60] [--kill-at 10] [--quorum-tick-ms 100]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

WORLD = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.ReLU(), torch.nn.Linear(384, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _grads(model, step: int, index: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + index)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def own_rank(rank: int, world: int, steps: int) -> list[float]:
    import gradcomp as gc

    model, codec, times = _model(), gc.Int8Quantizer(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # flat residuals, as ManagedAllreduce keeps them
    residuals = {name: torch.zeros(p.numel()) for name, p in model.named_parameters()}
    for step in range(steps):
        t0 = time.perf_counter()
        _grads(model, step, rank)
        for name, p in model.named_parameters():
            p.grad.copy_(gc.allreduce(p.grad, codec, residual=residuals[name]))
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def replica(index: int, lighthouse: str, out: str, steps: int) -> None:
    """One replica group: a JSON line per step to ``out/r<index>-<pid>.jsonl``."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce

    start = time.time()
    torch.set_num_threads(1)  # as gradcomp.launch sets each rank of the own path
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=5))
    manager = Manager(pg=pg, load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), opt.load_state_dict(sd["o"])),
                      state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()}, min_replica_size=2,
                      use_async_quorum=False, replica_id=f"r{index}", lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      timeout=datetime.timedelta(seconds=5), quorum_timeout=datetime.timedelta(seconds=60))
    ar = ManagedAllreduce(manager, pg, gc.Int8Quantizer(), timeout=3.0)
    with open(os.path.join(out, f"r{index}-{os.getpid()}.jsonl"), "w", buffering=1) as log:
        log.write(json.dumps({"start": start}) + "\n")
        while manager.current_step() < steps:
            t0 = time.perf_counter()
            manager.start_quorum()
            t1 = time.perf_counter()
            _grads(model, manager.current_step(), index)
            t2 = time.perf_counter()
            for name, p in model.named_parameters():
                p.grad.copy_(ar.allreduce(p.grad, key=name))
            t3 = time.perf_counter()
            ok = ar.commit()
            t4 = time.perf_counter()
            if ok:
                opt.step()
            log.write(json.dumps({"step": manager.current_step(), "ok": ok, "n": manager.num_participants(),
                                  "dt": time.perf_counter() - t0, "t": time.time(), "quorum": t1 - t0,
                                  "compute": t2 - t1, "comm": t3 - t2, "commit": t4 - t3}) + "\n")
    manager.shutdown(wait=False)


def _run_ft(steps: int, kill_at: int | None, tick_ms: int) -> dict:
    from torchft.coordination import LighthouseServer

    out = tempfile.mkdtemp(prefix="ft-overhead-")
    lh = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1500,
                          quorum_tick_ms=tick_ms)
    spawn = lambda i: subprocess.Popen([sys.executable, __file__, "replica", str(i), lh.address(), out, str(steps)],  # noqa: E731
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs, killed_at, restarted_at = [spawn(i) for i in range(WORLD)], None, None
    try:
        if kill_at is not None:
            deadline = time.monotonic() + 120
            while not any(json.loads(line).get("step", 0) >= kill_at for p in glob.glob(f"{out}/r2-*.jsonl")
                          for line in open(p)):
                if time.monotonic() > deadline:
                    raise TimeoutError("replica group 2 did not reach the kill step")
                time.sleep(0.02)
            os.kill(procs[2].pid, signal.SIGKILL)
            killed_at = time.time()
            procs[2].wait(timeout=10)
            procs.append(spawn(2))
            restarted_at = time.time()
        for p in procs:
            if p is not procs[2] or kill_at is None:
                p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lh.shutdown()
    logs = {os.path.basename(p): [json.loads(x) for x in open(p)][1:] for p in glob.glob(f"{out}/r*-*.jsonl")}
    return {"logs": logs, "killed_at": killed_at, "restarted_at": restarted_at, "victim": procs[2].pid}


def _failure(res: dict) -> dict:
    logs, kill = res["logs"], res["killed_at"]
    survivors = [v for k, v in logs.items() if not k.startswith("r2-")]
    restarted = next(v for k, v in logs.items() if k.startswith("r2-") and str(res["victim"]) not in k)
    next_commit = [min(r["t"] for r in recs if r["ok"] and r["t"] > kill) - kill for recs in survivors]
    failed = [sum(1 for r in recs if not r["ok"]) for recs in survivors]
    first = min(r["t"] for r in restarted if r["ok"]) - res["restarted_at"]
    return {"kill_to_survivors_next_commit_s": max(next_commit), "survivor_failed_steps": max(failed),
            "restart_to_first_commit_s": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--quorum-tick-ms", type=int, default=100, help="the lighthouse's quorum tick")
    args = ap.parse_args()
    from gradcomp.launch import launch

    own = launch(own_rank, WORLD, args=(args.steps,), timeout=300)
    own_s = statistics.median(t for times in own for t in times[args.warmup:])
    ft = _run_ft(args.steps, None, args.quorum_tick_ms)
    steps = [r for recs in ft["logs"].values() for r in recs[args.warmup:]]
    ft_s = statistics.median(r["dt"] for r in steps)
    parts = {f"ft_{k}_median_s": statistics.median(r[k] for r in steps) for k in ("quorum", "compute", "comm", "commit")}
    print(json.dumps({"own_step_median_s": own_s, "ft_step_median_s": ft_s, "ft_over_own": ft_s / own_s, **parts}))
    print(json.dumps(_failure(_run_ft(args.steps + 20, args.kill_at, args.quorum_tick_ms))))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "replica":
        replica(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
