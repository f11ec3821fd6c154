"""One torchft replica group (one process) training a small model with gradcomp's
compressed ring allreduce (:class:`gradcomp.integrations.torchft.ManagedAllreduce`).

``python tests/ft_replica.py INDEX LIGHTHOUSE OUT_DIR TARGET_STEP REPLICAS``: one JSON
line per step to ``OUT_DIR/r<INDEX>-<pid>.jsonl`` (committed or not, the quorum's
size, this group's rank in it, the meter's bytes of the step); it stops once the
step is ``>= TARGET_STEP`` and the last 3 committed steps had every replica group in
the quorum (the same step on every member, as they all see the same quorums), then
saves its parameters to ``OUT_DIR/r<INDEX>.pt``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def _phases(meter) -> dict:
    ph = meter.as_dict()["phases"]
    return {k: [ph.get(k, {}).get("bytes_sent", 0), ph.get(k, {}).get("raw_bytes_sent", 0)]
            for k in ("reduce_scatter", "allgather")}


def main(index: int, lighthouse: str, out_dir: str, target: int, replicas: int) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    import gradcomp as gc
    from gradcomp.integrations.torchft import ManagedAllreduce

    start = time.time()
    torch.set_num_threads(1)  # three processes share the host's cores
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=5))
    manager = Manager(pg=pg, load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                       "opt": opt.state_dict()},
                      min_replica_size=2, use_async_quorum=False, replica_id=f"r{index}",
                      lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0,
                      world_size=1, timeout=datetime.timedelta(seconds=5),
                      quorum_timeout=datetime.timedelta(seconds=30))
    ar = ManagedAllreduce(manager, pg, gc.Int8Quantizer(), timeout=3.0)
    log = open(os.path.join(out_dir, f"r{index}-{os.getpid()}.jsonl"), "w", buffering=1)
    log.write(json.dumps({"start": start, "pid": os.getpid()}) + "\n")
    streak = 0
    while True:
        manager.start_quorum()
        t0, before = time.time(), _phases(ar.meter)
        n, rank, step0 = manager.num_participants(), manager.participating_rank(), manager.current_step()
        g = torch.Generator().manual_seed(1000 * step0 + index)
        x, y = torch.randn(16, 40, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            p.grad.copy_(ar.allreduce(p.grad, key=name))
        ok = ar.commit()
        if ok:
            opt.step()
        after = _phases(ar.meter)
        delta = {k: [a - b for a, b in zip(after[k], before[k])] for k in after}
        log.write(json.dumps({"step0": step0, "step": manager.current_step(), "ok": ok, "n": n, "rank": rank,
                              "t0": t0, "t": time.time(), "bytes": delta}) + "\n")
        streak = streak + 1 if ok and n == replicas else 0
        if manager.current_step() >= target and streak >= 3:
            break
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"r{index}.pt"))
    log.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
