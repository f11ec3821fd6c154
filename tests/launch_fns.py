"""Module-level worker functions for the launcher tests (they must be picklable)."""

import os
import time

import torch
import torch.distributed as dist


def allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"sum": t, "world": dist.get_world_size()}


def fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    time.sleep(30)


def hang(rank, world_size):
    time.sleep(60)


def die_on_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank
