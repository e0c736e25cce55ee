"""Training checkpoints that resume on any layout: model, optimizer, step, data position, RNG.

Every tensor is stored as its *full* tensor (the unparallelized model's names and shapes) cut
into the chunks the ranks own, with DCP (:mod:`shardkit.tensor_parallel.dcp`'s chunk planners),
so a checkpoint written at ``tp 2 x dp 2`` loads at ``dp_shard 2 x cp 2``, at ``pp 2``, or in one
process:

* parameters and AdamW's ``exp_avg`` / ``exp_avg_sq``: the tensor-/expert-parallel local tensor
  (FSDP2 shards all-gathered over their data-parallel mesh first) with its
  :class:`~shardkit.tensor_parallel.ShardSpec`; each element written once (DCP deduplicates the
  replicas);
* AdamW's ``step``, the step count, the data sampler's generator state and torch's RNG state:
  replicated tensors, written once.

Layout on disk, one directory per save (nothing the user trained is ever overwritten in place)::

    DIR/step_00000010/      DCP files, then MANIFEST.json written last by rank 0
    DIR/latest              the name of the newest complete save, replaced atomically

A save killed half-way leaves a directory without a manifest, which loading ignores and the next
save removes; ``latest`` still names the previous complete save.

Source: PyTorch Distributed Checkpoint (DCP) resharding loads, as torchtitan's checkpointer uses
them; the manifest-last / atomic-pointer commit protocol of Megatron-LM's and DCP's async savers.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import ShardkitError
from ..tensor_parallel.dcp import _ChunkLoadPlanner, _ChunkSavePlanner
from ..tensor_parallel.spec import _SPEC_ATTR

if TYPE_CHECKING:
    from ..parallelize import ParallelModel

__all__ = ["save_train_state", "load_train_state", "latest_checkpoint", "MANIFEST"]

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _tagged(t: torch.Tensor, spec) -> torch.Tensor:
    """``t`` (detached) carrying ``spec`` for the chunk planners."""
    t = t.detach()
    if spec is not None:
        setattr(t, _SPEC_ATTR, spec)
    return t


def _local_full(t: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel local tensor: an FSDP2 DTensor all-gathered over its dp mesh."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a loaded tensor-parallel local tensor into ``dst`` (an FSDP2 DTensor keeps its shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(dst, DTensor):
        src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst = dst.to_local()
    with torch.no_grad():
        dst.copy_(src)


def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state before the first step (zeros; ``step`` 0) so that loading has targets."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in _ADAM_KEYS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _state_dict(pm, optimizer, extra: dict[str, torch.Tensor]) -> tuple[dict, list]:
    """The flat ``{key: tensor}`` to save or load into, and ``(key, target)`` pairs to write back."""
    state, targets = {}, []
    params = dict(pm.module.named_parameters())
    for name, p in params.items():
        spec = pm.layouts[name].spec
        local = _local_full(p)
        state[f"model/{name}"] = _tagged(local, spec)
        targets.append((f"model/{name}", p))
        opt = optimizer.state.get(p, {})
        for key in _ADAM_KEYS:
            if key in opt:
                state[f"optim/{name}/{key}"] = _tagged(_local_full(opt[key]), spec)
                targets.append((f"optim/{name}/{key}", opt[key]))
        if "step" in opt:
            state[f"optim/{name}/step"] = opt["step"].detach().reshape(()).to(torch.float32).clone()
            targets.append((f"optim/{name}/step", opt["step"]))
    for key, t in extra.items():
        state[f"train/{key}"] = t
    return state, targets


def _broadcast_error(error: str | None) -> str | None:
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete save under ``root`` (the path named by ``latest``), or None.

    Raises:
        ShardkitError: ``latest`` names a directory without a manifest (a damaged checkpoint).
    """
    pointer = os.path.join(os.fspath(root), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(os.fspath(root), name)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise ShardkitError(f"checkpoint: {pointer} names {name}, which has no {MANIFEST} (incomplete save)")
    return path


def _atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_stale(root: str, keep: str) -> None:
    """Rank 0: remove save directories without a manifest (killed saves), never ``keep``."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and name != keep and os.path.isdir(path) and not os.path.isfile(
                os.path.join(path, MANIFEST)):
            shutil.rmtree(path, ignore_errors=True)


def save_train_state(root: str | os.PathLike, pm: ParallelModel, optimizer: torch.optim.Optimizer, step: int,
                     extra: dict[str, torch.Tensor], layout: str = "") -> str:
    """Collective over the world: save the training state after ``step`` steps; return its directory.

    Args:
        root: the checkpoint directory (created); each save gets ``step_<step>/`` inside it.
        pm: the :class:`~shardkit.parallelize.ParallelModel` being trained.
        optimizer: its AdamW optimizer.
        step: steps done.
        extra: replicated tensors to keep (data-sampler and RNG states), the same on every rank.
        layout: a description of the layout that wrote it, kept in the manifest.

    Raises:
        ShardkitError: on every rank, when ``root`` exists and is not a directory.
        torch.distributed.checkpoint.api.CheckpointException: a rank failed to write; the
            previous save stays the latest.
    """
    root = os.path.abspath(os.fspath(root))
    name = f"step_{step:08d}"
    path = os.path.join(root, name)
    error = None
    if dist.get_rank() == 0:
        if os.path.exists(root) and not os.path.isdir(root):
            error = f"{root} exists and is not a directory"
        else:
            os.makedirs(root, exist_ok=True)
            _remove_stale(root, keep="")
            shutil.rmtree(path, ignore_errors=True)  # a save of the same step that never completed
    error = _broadcast_error(error)
    if error:
        raise ShardkitError(f"save_train_state: {error}")
    state, _ = _state_dict(pm, optimizer, extra)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), planner=_ChunkSavePlanner(state))
    # dcp.save returns on every rank only after the coordinator wrote .metadata: complete.
    if dist.get_rank() == 0:
        manifest = {"step": step, "layout": layout, "time": time.time(), "keys": len(state)}
        _atomic_text(os.path.join(path, MANIFEST), json.dumps(manifest, indent=2))
        _atomic_text(os.path.join(root, LATEST), name)
    dist.barrier()
    return path


def load_train_state(path: str | os.PathLike, pm: ParallelModel, optimizer: torch.optim.Optimizer,
                     extra: dict[str, torch.Tensor]) -> int:
    """Collective over the world: load a save into ``pm``, ``optimizer`` and ``extra``; return its step.

    ``pm`` may use any layout (tp, pp, cp, ep, FSDP2 or none): every rank reads the ranges of the
    full tensors it holds. ``extra`` holds tensors of the saved shapes, filled in place.

    Raises:
        ShardkitError: on every rank: the save has no manifest, or a key of this model is missing
            from it (another model or a pipeline stage that does not match).
    """
    path = os.fspath(path)
    error = None
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(path, MANIFEST)):
        error = f"{path} has no {MANIFEST} (not a complete save)"
    error = _broadcast_error(error)
    if error:
        raise ShardkitError(f"load_train_state: {error}")
    _ensure_adam_state(optimizer)
    state, targets = _state_dict(pm, optimizer, extra)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(k for k in state if k not in saved)
    if missing:  # the same keys on every rank of a stage: the same verdict, but agree anyway
        error = f"keys missing from {path}: {missing[:5]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if bad:
        raise ShardkitError("load_train_state: " + "; ".join(bad[:4]))
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=_ChunkLoadPlanner(state))
    for key, dst in targets:
        _write_back(dst, state[key].reshape(dst.shape) if dst.dim() == 0 else state[key])
    with open(os.path.join(path, MANIFEST)) as f:
        return int(json.load(f)["step"])
