"""Atomic server checkpoints: parameters, optimizer state and version.

:func:`save_shard` / :func:`resume_shard` write and restore one server's
shard (a :class:`~gradcomp.ps.apply.ShardUpdater`); :func:`save_atomic` and
:func:`load` are the file format underneath.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from gradcomp.ps.errors import CheckpointError

if TYPE_CHECKING:
    from gradcomp.ps.apply import ShardUpdater

__all__ = ["FORMAT", "RESUME_MODES", "checkpoint_path", "resume_mode", "usable_dir", "save_atomic", "load",
           "save_shard", "resume_shard"]

FORMAT = "gradcomp.ps/1"
#: ``resume``: False (start afresh), True (load the checkpoint; none there is an error),
#: ``"if-exists"`` (load it when there is one, else start afresh)
RESUME_MODES = (False, True, "if-exists")


def resume_mode(resume) -> bool | str:
    """``resume`` checked against :data:`RESUME_MODES` (ValueError naming the allowed values)."""
    if not any(resume is m or (isinstance(m, str) and resume == m) for m in RESUME_MODES):
        raise ValueError(f"resume must be False, True or 'if-exists', got {resume!r}")
    return resume


def usable_dir(directory: str) -> str:
    """``directory`` created if needed and checked writable (a probe file, removed again);
    ValueError naming ``checkpoint_dir`` and the reason otherwise, before any training."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".gradcomp-probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"checkpoint_dir {directory} cannot be created or written: {e.strerror or e}") from None
    return directory


def checkpoint_path(directory: str, server_index: int) -> str:
    """``<directory>/ps-server-<server_index>.pt``."""
    return os.path.join(directory, f"ps-server-{server_index}.pt")


def save_atomic(state: dict, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, flush it to
    disk, then rename it over ``path``: a reader sees the old or the new
    checkpoint, never a torn one, even if the process dies mid-write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: str, layout: list | None = None, num_servers: int | None = None) -> dict:
    """Load and validate a checkpoint written by :func:`save_atomic` (tensors
    on CPU; only tensors and plain containers are unpickled).

    Args:
        path: the file.
        layout: the expected ``[[name, shape], ...]`` of the shard (None: any).
        num_servers: the expected number of servers (None: any).

    Returns:
        The state: ``format``, ``server_index``, ``num_servers``, ``mode``,
        ``layout``, ``version`` (int >= 0), ``params`` (name -> float32
        tensor of the layout's shape) and ``optimizer`` (a state dict).

    Raises:
        CheckpointError: the file cannot be read or unpickled (truncated,
            random bytes, a foreign pickle), is not a gradcomp
            parameter-server checkpoint, or holds another placement.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, random bytes, foreign pickle, I/O error
        raise CheckpointError(path, _unreadable(e)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(path, f"not a gradcomp parameter-server checkpoint (format {FORMAT!r})")
    for key, kind in (("server_index", int), ("num_servers", int), ("mode", str), ("layout", list),
                      ("version", int), ("params", dict), ("optimizer", dict)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise CheckpointError(path, f"field {key!r} is missing or not a {kind.__name__}")
    if state["version"] < 0:
        raise CheckpointError(path, f"negative version {state['version']}")
    if layout is not None and (state["layout"] != layout or state["num_servers"] != num_servers):
        raise CheckpointError(path, f"another parameter placement ({state['num_servers']} servers, "
                                    f"{len(state['layout'])} parameters); resume needs the same model "
                                    "and num_servers")
    for name, shape in state["layout"]:
        t = state["params"].get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or list(t.shape) != list(shape):
            raise CheckpointError(path, f"parameter {name!r} is missing or not a float32 tensor of shape "
                                        f"{tuple(shape)}")
    opt = state["optimizer"]
    if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(path, "the optimizer state is not a torch.optim state dict")
    return state


def _layout(shard) -> list:
    return [[s.name, list(s.shape)] for s in shard]


def save_shard(directory: str, server_index: int, num_servers: int, mode: str, updater: ShardUpdater,
               version: int) -> str:
    """Write ``updater``'s parameters (copied to CPU) and optimizer state at
    ``version`` to ``checkpoint_path(directory, server_index)`` atomically;
    returns the path."""
    path = checkpoint_path(directory, server_index)
    save_atomic({
        "format": FORMAT,
        "server_index": server_index,
        "num_servers": num_servers,
        "mode": mode,
        "layout": _layout(updater.shard),
        "version": version,
        "params": {n: p.detach().cpu().clone() for n, p in updater.params.items()},
        "optimizer": updater.optimizer.state_dict(),
    }, path)
    return path


def resume_shard(directory: str, server_index: int, num_servers: int, updater: ShardUpdater,
                 missing_ok: bool = True) -> int | None:
    """Load this server's checkpoint into ``updater`` (parameters and
    optimizer state), validated whole before anything changes.

    Returns:
        The checkpoint's version; None when there is no checkpoint file and
        ``missing_ok`` (nothing changes).

    Raises:
        CheckpointError: no checkpoint file and not ``missing_ok``; see
            :func:`load`; or the optimizer state does not fit ``updater``'s
            optimizer (which is left as it was).
    """
    path = checkpoint_path(directory, server_index)
    if not os.path.exists(path):
        if missing_ok:
            return None
        raise CheckpointError(path, f"no checkpoint to resume from in {directory} (resume='if-exists' "
                                    "starts afresh when there is none)")
    state = load(path, _layout(updater.shard), num_servers)
    before = updater.optimizer.state_dict()
    try:
        updater.optimizer.load_state_dict(state["optimizer"])
    except Exception as e:
        updater.optimizer.load_state_dict(before)
        raise CheckpointError(path, f"its optimizer state does not fit this optimizer "
                                    f"({type(e).__name__}: {e})") from None
    with torch.no_grad():
        for n, p in updater.params.items():
            p.copy_(state["params"][n])
    return state["version"]


def _unreadable(e: BaseException) -> str:
    """What is wrong with a file ``torch.load(weights_only=True)`` refused, in the file's terms
    (torch's own text suggests turning ``weights_only`` off: unsafe for a damaged or foreign file)."""
    text = str(e)
    if isinstance(e, EOFError) or "PytorchStreamReader" in text:
        what = "truncated or damaged: its archive is incomplete"
    elif isinstance(e, OSError):
        what = e.strerror or type(e).__name__
    elif "Unsupported global" in text:
        name = text.split("GLOBAL", 1)[1].split()[0] if "GLOBAL" in text else "code"
        what = (f"it refers to {name}, where a checkpoint holds only tensors and plain containers: "
                "a foreign or altered file")
    else:
        what = "not a torch checkpoint: random or damaged bytes"
    return f"unreadable ({what}); nothing was loaded"
