"""Module-level rank functions for the pipeline tests (picklable)."""

import torch
import torch.distributed as dist
from torch import nn


def engine_steps(rank, world_size, runs, hidden, x, y, m, steps, lr):
    """Each ``(schedule, int8)`` of ``runs`` over ``world_size`` ranks on the
    study's MLP (fresh weights each; int8 or plain boundaries); returns
    ``{(schedule, int8): {stage: state_dict}}`` of this rank's stages after
    ``steps`` SGD steps on (x, y), and the same keys to the activations each
    non-first stage decoded in the first step."""
    from gradcomp.pipeline.boundary import BoundaryCodec
    from gradcomp.pipeline.engine import build_schedule, rank_stages, stages_per_rank
    from gradcomp.pipeline.split import split_sequential
    from gradcomp.pipeline.stage import GradcompStage
    from gradcomp.pipeline.bubble import StageTimeline
    from gradcomp.lab.study.model import make_model
    from gradcomp.lab.study.pipeline import _shapes

    out, decoded = {}, {}
    for schedule, int8 in runs:
        n = world_size * stages_per_rank(schedule)
        parts = split_sequential(make_model(0, hidden), n)
        ex = _shapes(parts, x.shape[0] // m, x.shape[1])
        codec = BoundaryCodec("int8" if int8 else None)
        ids = rank_stages(schedule, rank, world_size)
        stages = [GradcompStage(parts[s], s, n, torch.device("cpu"), codec=codec, timeline=StageTimeline(rank),
                                input_args=ex[s], output_args=ex[s + 1]) for s in ids]
        opt = torch.optim.SGD([q for s in ids for q in parts[s].parameters()], lr=lr)
        sched = build_schedule(schedule, stages, m, nn.functional.cross_entropy)
        for step in range(steps):
            opt.zero_grad()
            kwargs = {"target": y} if any(st.is_last for st in stages) else {}
            if any(st.is_first for st in stages):
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            if step == 0:
                decoded[(schedule, int8)] = {st.stage_index: [st.args_recv_info[i][0].buffer.detach().clone()
                                                      for i in range(m)]
                                     for st in stages if not st.is_first}
            opt.step()
        out[(schedule, int8)] = {s: {k: v.detach().clone() for k, v in parts[s].state_dict().items()} for s in ids}
    return out, decoded


def fixed_time_runs(rank, world_size, ms, steps, fwd_s, bwd_s):
    """GPipe over fixed-time stages for each M of ``ms``; returns this rank's timelines."""
    from gradcomp.pipeline.synthetic import run_fixed_time

    return [run_fixed_time(rank, world_size, "gpipe", m, steps, fwd_s, bwd_s) for m in ms]


def pipedream_record(rank, world_size, n, vertical_sync, compressor):
    """PipeDream over ``world_size`` stages (Linear+Tanh, ..., Linear 5->3; 4-row
    minibatches) with recording; returns (stats, inputs, targets)."""
    from gradcomp.comm.p2p import Comm
    from gradcomp.pipeline.boundary import BoundaryCodec
    from gradcomp.pipeline.pipedream import PipeDreamStage

    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(6 if s == 0 else 5, 5), nn.Tanh()) for s in range(world_size - 1)]
    mods.append(nn.Linear(5, 3))
    xs = [torch.randn(4, 6) for _ in range(n)]
    ys = [torch.randint(0, 3, (4,)) for _ in range(n)]
    mod = mods[rank]
    opt = torch.optim.SGD(mod.parameters(), lr=0.5)
    last = rank == world_size - 1
    stage = PipeDreamStage(mod, rank, Comm(dist.group.WORLD, 30.0), BoundaryCodec(compressor), opt,
                           act_shape=None if last else (4, 5), in_shape=None if rank == 0 else (4, 5),
                           loss_fn=nn.functional.cross_entropy, vertical_sync=vertical_sync, record=True)
    stats = stage.run(n, xs if rank == 0 else None, ys if last else None)
    return stats, xs, ys


def replicated_engine(rank, world_size, cfg, data):
    """One ``gpipe`` run of the study mode's rank loop (pipeline replicas whose
    stage gradients are averaged); returns this rank's stage weights."""
    from gradcomp.lab.study.pipeline import _engine_run, _groups

    pp_group, dp_group = _groups(world_size, cfg.stages)
    return _engine_run(cfg, "gpipe", cfg.microbatches[0], "none", data, pp_group, dp_group)["snapshots"][-1]
