"""Checks shared by the DDP hook's multi-process tests."""

import torch.distributed as dist


def residual_conservation_error(state, model, given, applied):
    """The largest relative error, over ``model``'s parameters, of
    ``applied + sum of the ranks' residuals == sum of what the ranks gave``:
    error feedback loses nothing. ``given`` / ``applied`` map ``id(param)`` to
    the float64 sums a test recorded; collective over the default group."""
    errs = []
    for p in model.parameters():
        held = state.residuals[state._param_keys[id(p)][1]].double().clone()
        gave = given[id(p)].clone()
        dist.all_reduce(held)
        dist.all_reduce(gave)
        errs.append(float((applied[id(p)] + held - gave).norm() / gave.norm()))
    return max(errs)
