"""Cost of the step timeline: the study's sync step with and without it.

Usage::

    python benchmarks/timeline_overhead.py [--workers 2] [--steps 400] [--block 20] [--link none]

Each rank trains the study's model (digits MLP, DDP + gradcomp's int8 hook)
in blocks of ``--block`` steps that alternate between the timeline on (a
:class:`gradcomp.timeline.StepTimeline` in the hook, the collectives' spans, the
loop's marks: exactly what ``gradcomp train`` records) and off (no timeline
anywhere), so a change in the host's load hits both alike. Printed: the
median step time of each (the slowest rank's), their ratio, and the overhead
in percent. On the loopback, steps are shortest, so the share is largest there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _rank(rank: int, world: int, steps: int, block: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp as gc
    from gradcomp.ddp import GradCompState, compressed_allreduce_hook
    from gradcomp.timeline import StepTimeline
    from gradcomp.lab.study.data import load_digits_split, worker_batches
    from gradcomp.lab.study.model import make_model

    data = load_digits_split(0.25, 0)
    out = {"on": [], "off": []}
    setups = {}
    for kind in ("on", "off"):
        model = make_model(0)
        ddp = DistributedDataParallel(model)
        tl = StepTimeline() if kind == "on" else None
        state = GradCompState(compressor=gc.Int8Quantizer(), min_compress_numel=0, start_iter=0,
                              timeline=tl)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        setups[kind] = (ddp, opt, tl, state)
    batches = list(worker_batches(len(data.y_train), world, rank, 64, 0, steps))
    for b in range(0, steps, block):
        kind = "on" if (b // block) % 2 == 0 else "off"
        ddp, opt, tl, state = setups[kind]
        for idx in batches[b:b + block]:
            dist.barrier()
            t0 = time.perf_counter()
            if tl is not None:
                tl.begin_step(t0)
                with tl.span("delay"):
                    pass
            loss = nn.functional.cross_entropy(ddp(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tl is not None:
                tl.mark("backward_end")
                tl.marked("handoff")
                tl.mark("apply_start")
            opt.step()
            loss.item()
            if tl is not None:
                tl.end_step()
            out[kind].append(time.perf_counter() - t0)
    for _, _, _, state in setups.values():
        state.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--link", default="none", help="none (loopback) or a rate, e.g. 100mbit")
    args = p.parse_args(argv)
    if args.workers < 2 or args.steps < 2 * args.block or args.block < 1:
        p.error("need --workers >= 2, --block >= 1 and --steps >= 2 x --block")
    if args.link == "none":
        from gradcomp.launch import launch

        res = launch(_rank, args.workers, (args.steps, args.block), timeout=1200)
        link = "loopback"
    else:
        from gradcomp.lab.cluster import LocalCluster
        from gradcomp.lab.units import format_rate

        with LocalCluster(args.workers, rate=args.link) as c:
            res = c.run(_rank, args.steps, args.block, timeout=1200)
            link = f"{args.link} (achieved {format_rate(c.achieved_bps)})"
    n = min(len(r["on"]) for r in res)
    on = statistics.median(max(r["on"][i] for r in res) for i in range(n))
    off = statistics.median(max(r["off"][i] for r in res) for i in range(n))
    print(f"timeline overhead, world {args.workers}, link {link}, {n} steps each, "
          f"blocks of {args.block} alternating")
    print(f"median step: timeline on {1e3 * on:.3f} ms, off {1e3 * off:.3f} ms, "
          f"on/off {on / off:.4f} (overhead {100 * (on / off - 1):+.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
