"""Asynchronous parameter-server training with compressed push and pull:
1 server + 3 workers on local processes, least squares with a known optimum.

Run: python examples/parameter_server.py
"""

import functools
import textwrap

import torch
import torch.nn as nn

import gradcomp as gc
from gradcomp import ps
from gradcomp.launch import launch

TRUE_W = torch.linspace(-1, 1, 64)


def model_fn():
    return nn.Linear(64, 1, bias=False)


def loss_fn(model, step, worker_index):
    g = torch.Generator().manual_seed(1000 * worker_index + step)
    x = torch.randn(32, 64, generator=g)
    return ((model(x).squeeze(1) - x @ TRUE_W) ** 2).mean()


CONFIG = ps.PSConfig(
    mode="async", steps=300, num_servers=1,
    compressor=gc.Int8Quantizer(), compress_pull=True,
    max_staleness=8, staleness_lr=True,
    optimizer=functools.partial(torch.optim.SGD, lr=0.02, momentum=0.5),
)


def rank_main(rank, world_size):
    out = ps.run(rank, world_size, model_fn, loss_fn, CONFIG)
    if out["role"] == "server":
        w = next(iter(out["params"].values())).reshape(-1)
        return {"stats": out["stats"], "error": float((w - TRUE_W).norm() / TRUE_W.norm())}
    return None


if __name__ == "__main__":
    server = launch(rank_main, 1 + 3)[0]
    s = server["stats"]
    print(f"relative distance to the optimum: {server['error']:.2e}")
    print({k: s[k] for k in s if k in ("version", "dropped", "rejected", "staleness_histogram")})
    print(textwrap.fill(
        f"version: updates the server applied; dropped: pushes staler than max_staleness="
        f"{CONFIG.max_staleness} versions, discarded (the worker pulls afresh and goes on); rejected: "
        "malformed or foreign pushes; staleness_histogram: accepted pushes by how many versions "
        "the server had moved on since the worker's pull", width=80))
