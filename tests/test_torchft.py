"""gradcomp on torchft: compressed allreduce over a per-step quorum of replica groups.

Kill and heal end to end: 3 replica groups (one process each, CPU gloo), torchft's
lighthouse started here; one group is SIGKILLed mid-training and restarted. The
survivors go on without a lost or doubled step, the restarted one heals from a
peer and joins, and all end with bit-identical parameters. Every wait is bounded,
every child is ended by its PID and the lighthouse is shut down.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gradcomp[ft]')")

from gradcomp.comm import ring_raw_bytes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPLICAS, TARGET, KILL_AT = 3, 14, 4


def _spawn(index: int, lighthouse: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "ft_replica.py"), str(index), lighthouse, out,
                             str(TARGET), str(REPLICAS)],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, f"err{index}.txt"), "a"))


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _reached(out: str, index: int, step: int) -> bool:
    for path in glob.glob(os.path.join(out, f"r{index}-*.jsonl")):
        if any(r.get("ok") and r["step"] >= step for r in _records(path)):
            return True
    return False


def _committed_steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records if r.get("ok")]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_kill_and_heal_three_replica_groups(tmp_path):
    from torchft.coordination import LighthouseServer

    out = str(tmp_path)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1500)
    procs: list[subprocess.Popen] = []
    try:
        procs = [_spawn(i, lighthouse.address(), out) for i in range(REPLICAS)]
        _wait_for(lambda: _reached(out, 2, KILL_AT), 60, f"replica 2 to commit step {KILL_AT}")
        victim = procs[2]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        killed_at = time.time()
        procs.append(_spawn(2, lighthouse.address(), out))
        for p in procs[:2] + procs[3:]:
            assert p.wait(timeout=90) == 0, open(os.path.join(out, "err0.txt")).read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lighthouse.shutdown()

    logs = {os.path.basename(p)[:-6]: _records(p) for p in glob.glob(os.path.join(out, "r*-*.jsonl"))}
    first = {k: v for k, v in logs.items() if str(victim.pid) not in k}
    survivors = [v for k, v in first.items() if k.startswith(("r0-", "r1-"))]
    restarted = next(v for k, v in first.items() if k.startswith("r2-"))
    # every committed step exactly once: a commit advances its group by one step, none is doubled,
    # and a group skips steps only by healing from a peer that committed them (a failed step commits
    # nothing; a survivor whose step failed may heal at the next quorum, as a late joiner does)
    groups = survivors + [restarted]
    for i, recs in enumerate(groups):
        done = [r for r in recs if r.get("ok")]
        assert all(r["step"] == r["step0"] + 1 for r in done), done
        steps = [r["step"] for r in done]
        assert steps == sorted(set(steps)), steps
        others = {s for j, g in enumerate(groups) if j != i for s in _committed_steps(g)}
        for prev, cur in zip(done, done[1:]):
            assert cur["step0"] >= prev["step"], (prev, cur)
            assert set(range(prev["step"] + 1, cur["step0"] + 1)) <= others, (prev, cur)
    for recs in survivors:  # they saw the failure: a failed step or a quorum of 2
        assert any(not r["ok"] or r["n"] == REPLICAS - 1 for r in recs if "ok" in r)
    # the restarted group did not start over from step 0: in its first quorum of every group it healed
    # to the step the survivors had reached (at least the step the victim had committed with one of
    # them). Its first quorum may be of two groups at step 0: a group that started late is kept out of
    # the fast quorums of the others until the kill, and may then meet the restarted one at step 0.
    assert next(r["step0"] for r in restarted if r.get("n") == REPLICAS) >= KILL_AT
    assert steps[-1] == _committed_steps(survivors[0])[-1] == _committed_steps(survivors[1])[-1] >= TARGET
    # all three end bit-identical
    params = [torch.load(os.path.join(out, f"r{i}.pt")) for i in range(REPLICAS)]
    for p in params[1:]:
        assert all(torch.equal(p[k], params[0][k]) for k in p)
    # the meter's float32-equivalent bytes follow the ring's formula for the quorum of each step
    numels = [t.numel() for t in params[0].values()]
    for recs in survivors + [restarted]:
        for r in (r for r in recs if r.get("ok")):
            want = [sum(ring_raw_bytes(n, r["n"], r["rank"])[i] for n in numels) for i in (0, 1)]
            assert [r["bytes"]["reduce_scatter"][1], r["bytes"]["allgather"][1]] == want, r
    assert killed_at > 0


def _replica_steps(index: int, lighthouse: str, grads: list[torch.Tensor], fail_step: int | None, out: dict):
    """One replica group in a thread: two steps of a top-k allgather on the quorum."""
    import datetime

    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=10))
    manager = Manager(pg=pg, load_state_dict=lambda sd: None, state_dict=lambda: {}, min_replica_size=2,
                      use_async_quorum=False, replica_id=f"t{index}", lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      timeout=datetime.timedelta(seconds=10), init_sync=False)
    ar = ManagedAllreduce(manager, pg, gc.TopK(0.25), algorithm="allgather", timeout=10.0)
    try:
        for step, g in enumerate(grads):
            manager.start_quorum()
            before = {k: r.clone() for k, r in ar.residuals.items()}
            result = ar.allreduce(g, key="g")
            if step == fail_step:
                manager.report_error(RuntimeError("a peer of this replica group failed"))
            out[(index, step)] = (result, ar.commit(), before, ar.residuals["g"].clone(),
                                  manager.num_participants())
        out[(index, "events")] = ar.meter.as_dict()["events"]
    finally:
        manager.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_residuals_flat_kept_on_commit_rolled_back_otherwise():
    import threading

    from torchft.coordination import LighthouseServer

    import gradcomp as gc
    from gradcomp.compressors import decompress

    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(64, generator=gen) for _ in range(2)] for _ in range(2)]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000)
    out: dict = {}
    try:
        threads = [threading.Thread(target=_replica_steps, args=(i, lighthouse.address(), grads[i],
                                                                  1 if i == 1 else None, out)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads) and len(out) == 6, sorted(out, key=str)
    finally:
        lighthouse.shutdown()

    def sent(x):  # what top-k puts on the wire for x, decoded
        return decompress(gc.TopK(0.25).compress(x)).reshape(-1)

    d = [sent(grads[i][0]) for i in range(2)]
    for i in range(2):
        result, ok, before, residual, n = out[(i, 0)]
        assert ok and n == 2 and before == {}
        assert torch.equal(result, (d[0] + d[1]) / 2)  # the mean over the quorum
        assert torch.equal(residual, grads[i][0] - d[i])  # this group's own compression error
    # step 1: group 1's step does not commit, so its residual goes back; group 0 keeps its new one
    _, ok0, before0, residual0, _ = out[(0, 1)]
    _, ok1, before1, residual1, _ = out[(1, 1)]
    assert ok0 and not ok1
    assert torch.equal(residual1, before1["g"]) and torch.equal(residual1, grads[1][0] - d[1])
    x0 = grads[0][1] + before0["g"]
    assert torch.equal(residual0, x0 - sent(x0))
    # the meter counts group 1's rolled-back step; both stayed in a quorum of 2 throughout
    assert out[(0, "events")] == {} and out[(1, "events")] == {"step_rolled_back": 1}


LR, SYNC_EVERY, SYNCS = 0.1, 2, 2


def _inner_grad(index: int, step: int) -> torch.Tensor:
    return torch.randn(8 * 4 + 4, generator=torch.Generator().manual_seed(100 * index + step))


def _linear() -> torch.nn.Linear:
    """The same Linear(8, 4) in every thread (the global RNG is shared between threads)."""
    model, g = torch.nn.Linear(8, 4), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _diloco_replica(index: int, lighthouse: str, out: dict):
    """One replica group in a thread: DiLoCo with SYNCS synchronisations of SYNC_EVERY inner steps."""
    import datetime

    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradcomp as gc
    from gradcomp.integrations.torchft_localsgd import ManagedLocalSGD

    model = _linear()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=10))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=2, use_async_quorum=False,
                      replica_id=f"d{index}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10),
                      init_sync=False)
    ls = ManagedLocalSGD(manager, pg, model, sync_every=SYNC_EVERY, compressor=gc.NoCompression(),
                         outer_optimizer="nesterov", timeout=10.0)
    manager.register_state_dict_fn("localsgd", ls.load_state_dict, ls.state_dict)
    try:
        for step in range(SYNC_EVERY * SYNCS):
            g = _inner_grad(index, step)
            model.weight.grad, model.bias.grad = g[:32].view(4, 8).clone(), g[32:].clone()
            inner.step()
            ls.step()
        out[index] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), ls.syncs,
                      ls.allreduce.meter.as_dict()["bytes_sent"])
    finally:
        manager.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_diloco_on_the_quorum_matches_the_outer_step_computed_here():
    import threading

    from torchft.coordination import LighthouseServer

    from gradcomp.localsgd import OUTER_LR, OUTER_MOMENTUM

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000)
    out: dict = {}
    try:
        threads = [threading.Thread(target=_diloco_replica, args=(i, lighthouse.address(), out)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads) and len(out) == 2
    finally:
        lighthouse.shutdown()
    # the same arithmetic here: inner SGD from the anchor, mean pseudo-gradient, outer Nesterov SGD
    ref = _linear()
    anchor = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).clone())
    outer = torch.optim.SGD([anchor], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for s in range(SYNCS):
        deltas = []
        for i in range(2):
            p = anchor.detach().clone()
            for step in range(s * SYNC_EVERY, (s + 1) * SYNC_EVERY):
                p.add_(_inner_grad(i, step), alpha=-LR)
            deltas.append(anchor.detach() - p)
        anchor.grad = (deltas[0] + deltas[1]) / 2
        outer.step()
    for i in range(2):
        params, syncs, sent = out[i]
        assert syncs == SYNCS and sent > 0
        assert torch.equal(params, anchor.detach())


def _ddp_replica(index: int, lighthouse: str, out: dict):
    """One replica group in a thread: one DDP step whose buckets go through comm_hook."""
    import datetime

    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupDummy, ProcessGroupGloo

    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce, comm_hook

    model = _linear()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=10))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=2, use_async_quorum=False,
                      replica_id=f"h{index}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10),
                      init_sync=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1),
                                                    find_unused_parameters=True)
    state = ManagedAllreduce(manager, pg, gc.NoCompression(), timeout=10.0)
    ddp.register_comm_hook(state, comm_hook)
    try:
        manager.start_quorum()
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(index))
        ddp(x).square().sum().backward()
        out[index] = ([p.grad.clone() for p in model.parameters()], state.commit(), x)
    finally:
        manager.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_ddp_comm_hook_averages_the_buckets_over_the_quorum():
    import threading

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000)
    out: dict = {}
    try:
        threads = [threading.Thread(target=_ddp_replica, args=(i, lighthouse.address(), out)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads) and len(out) == 2
    finally:
        lighthouse.shutdown()
    local = []
    for i in range(2):  # each replica's own gradient, computed here
        m = _linear()
        m(out[i][2]).square().sum().backward()
        local.append([p.grad for p in m.parameters()])
    for i in range(2):
        grads, ok, _ = out[i]
        assert ok
        for g, a, b in zip(grads, local[0], local[1]):
            assert torch.allclose(g, (a + b) / 2, atol=1e-6)


def test_managed_allreduce_bad_arguments_name_them():
    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce

    with pytest.raises(ValueError, match="algorithm"):
        ManagedAllreduce(None, None, gc.TopK(0.1), algorithm="ring")
    with pytest.raises(ValueError, match="algorithm"):
        ManagedAllreduce(None, None, gc.Int8Quantizer(), algorithm="allgather")
    with pytest.raises(ValueError, match="algorithm"):
        ManagedAllreduce(None, None, gc.Int8Quantizer(), algorithm="tree")
    with pytest.raises(ValueError, match="timeout"):
        ManagedAllreduce(None, None, gc.Int8Quantizer(), timeout=0)
    with pytest.raises(TypeError, match="meter"):
        ManagedAllreduce(None, None, gc.Int8Quantizer(), meter=3)
    with pytest.raises(TypeError, match="compressor"):
        ManagedAllreduce(None, None, "int8")


class _FakeManager:
    """The four Manager calls ``commit`` makes, scripted per step: (participants, participating, commits)."""

    def __init__(self, steps):
        self.steps, self.i = list(steps), -1

    def wait_quorum(self):
        self.i += 1

    def num_participants(self):
        return self.steps[self.i][0]

    def is_participating(self):
        return self.steps[self.i][1]

    def should_commit(self):
        return self.steps[self.i][2]


def test_commit_counts_quorum_changes_left_out_steps_and_rollbacks():
    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce

    # 3, 3, 2 (a change), 2 not participating, 3 (a change) and not committed, 3
    script = [(3, True, True), (3, True, True), (2, True, True), (2, False, True), (3, True, False), (3, True, True)]
    ar = ManagedAllreduce(_FakeManager(script), None, gc.NoCompression())
    assert [ar.commit() for _ in script] == [s[2] for s in script]
    assert ar.meter.as_dict()["events"] == {"quorum_change": 2, "not_participating": 1, "step_rolled_back": 1}
    assert (ar.committed, ar.rolled_back) == (5, 1)
