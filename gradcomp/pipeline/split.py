"""Cut a sequential model into contiguous pipeline stages."""

from __future__ import annotations

from torch import nn

__all__ = ["layer_blocks", "split_sequential"]


def layer_blocks(model: nn.Sequential) -> list[list[nn.Module]]:
    """Group ``model``'s children into layers: each module with parameters
    together with the parameter-free modules (activations) that follow it.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``.
        ValueError: it has no module with parameters.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}")
    blocks: list[list[nn.Module]] = []
    for m in model:
        if any(True for _ in m.parameters()) or not blocks:
            blocks.append([m])
        else:
            blocks[-1].append(m)
    if not any(any(True for _ in m.parameters()) for b in blocks for m in b):
        raise ValueError("model has no layer with parameters to place on a stage")
    return blocks


def _cost(block: list[nn.Module]) -> int:
    return sum(p.numel() for m in block for p in m.parameters())


def split_sequential(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Split ``model`` into ``num_stages`` contiguous ``nn.Sequential`` stages.

    Layers (see :func:`layer_blocks`) are never cut; the split minimises the
    largest stage's parameter count (the linear-partition problem, solved
    exactly by dynamic programming), a proxy for the slowest stage's compute in
    an MLP. The stages share the model's modules (no copy).

    Args:
        model: the model; ``model(x) == stages[-1](...stages[0](x))``.
        num_stages: stages wanted, from 1 to the number of layers.

    Returns:
        The stages, input stage first.

    Raises:
        TypeError: ``model`` not an ``nn.Sequential`` or ``num_stages`` not an int.
        ValueError: ``num_stages`` < 1 or larger than the number of layers.
    """
    blocks = layer_blocks(model)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be an int, got {type(num_stages).__name__}")
    if not 1 <= num_stages <= len(blocks):
        raise ValueError(f"num_stages must be from 1 to the model's {len(blocks)} layers, "
                         f"got {num_stages}")
    cost = [_cost(b) for b in blocks]
    n = len(blocks)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible max stage cost splitting blocks[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                val = max(best[k - 1][j], prefix[i] - prefix[j])
                if val < best[k][i]:
                    best[k][i], cut[k][i] = val, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [nn.Sequential(*[m for b in blocks[a:b] for m in b]) for a, b in reversed(bounds)]
