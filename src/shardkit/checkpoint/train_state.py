"""Training checkpoints that resume on any layout: model, optimizer, step, data position, RNG.

Every tensor is stored as its *full* tensor (the unparallelized model's names and shapes) cut
into the chunks the ranks own, with DCP (:mod:`.chunks`' planners),
so a checkpoint written at ``tp 2 x dp 2`` loads at ``dp_shard 2 x cp 2``, at ``pp 2``, or in one
process:

* parameters and AdamW's ``exp_avg`` / ``exp_avg_sq``: the tensor-/expert-parallel local tensor
  (FSDP2 shards all-gathered over their data-parallel mesh first) with its
  :class:`~shardkit.sharding.ShardSpec`; each element written once (DCP deduplicates the
  replicas);
* with ZeRO (``--zero``), AdamW's moments all-gathered per bucket into the same per-parameter
  tensors first, and each rank's slice kept on load: a ZeRO save resumes without ZeRO and back;
* AdamW's ``step``, the step count, the data sampler's generator state and torch's RNG state:
  replicated tensors, written once.

Layout on disk, one directory per save (nothing the user trained is ever overwritten in place)::

    DIR/step_00000010/      DCP files, then MANIFEST.json written last by rank 0
    DIR/latest              the name of the newest complete save, replaced atomically

A save killed half-way leaves a directory without a manifest, which loading ignores and the next
save removes; ``latest`` still names the previous complete save (the commit protocol of
:mod:`.versioned`, shared with :func:`~shardkit.save_sharded_checkpoint`). Loading refuses
missing, unexpected or differently typed keys on every rank (:mod:`.contents`).

Source: PyTorch Distributed Checkpoint (DCP) resharding loads, as torchtitan's checkpointer uses
them; the manifest-last / atomic-pointer commit protocol of Megatron-LM's and DCP's async savers.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import ShardkitError
from ..sharding import set_shard_spec
from .chunks import ChunkLoadPlanner, ChunkSavePlanner, full_shape
from .contents import check_contents
from .hf_writer import HF_ENTRY
from .saves import load_checked, open_save, save_checked, saved_entries
from .versioned import MANIFEST, latest_checkpoint

if TYPE_CHECKING:
    from ..parallelize import ParallelModel
    from .background import BackgroundSaves

__all__ = ["save_train_state", "load_train_state", "latest_checkpoint", "MANIFEST"]

_PREFIX = "step_"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _tagged(t: torch.Tensor, spec) -> torch.Tensor:
    """``t`` (detached) carrying ``spec`` for the chunk planners."""
    return set_shard_spec(t.detach(), spec)


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
    # a ZeRO optimizer (shardkit.data_parallel.ZeroAdamW) steps slices of flat buckets: it hands
    # out the full per-parameter moments (a collective gather), so every layout saves alike
    full_state = getattr(optimizer, "full_param_state", None)
    opt_state = full_state() if full_state is not None else optimizer.state
    for name, p in params.items():
        spec = pm.layouts[name].spec
        local = _local_full(p)
        state[f"model/{name}"] = _tagged(local, spec)
        targets.append((f"model/{name}", p))
        opt = opt_state.get(p, {})
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


def save_train_state(
    root: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, torch.Tensor],
    layout: str = "",
    *,
    keep: int | None = None,
    model: dict | None = None,
    hf: dict | None = None,
    background: BackgroundSaves | None = None,
) -> str:
    """Collective over the world: save the training state after ``step`` steps; return its directory.

    Args:
        root: the checkpoint directory (created); each save gets ``step_<step>/`` inside it.
        pm: the :class:`~shardkit.parallelize.ParallelModel` being trained.
        optimizer: its AdamW optimizer.
        step: steps done.
        extra: replicated tensors to keep (data-sampler and RNG states), the same on every rank.
        layout: a description of the layout that wrote it, kept in the manifest.
        keep: complete saves kept, this one included (None: all).
        model: a description of the model (JSON), kept in the manifest so that a resume can
            be checked before launch.
        hf: the model's Hugging Face description (:func:`.hf_writer.hf_description`), kept in
            the manifest so that :func:`~shardkit.export_hf` can write the save as a Hugging
            Face model directory; None: a model with no Hugging Face form.
        background: a :class:`~shardkit.checkpoint.background.BackgroundSaves` of ``root``
            (``--async-checkpoint``): the previous background save is waited for, this one is
            checked and staged to CPU memory, and the call returns while it is written; it is
            the latest once :meth:`~shardkit.checkpoint.background.BackgroundSaves.wait`
            returns. The state's collectives (FSDP2 all-gathers, ZeRO's moments) still run here.

    Raises:
        ShardkitError: on every rank, with nothing committed (the previous save stays the
            latest): ``root`` is a file or holds other files, another run holds its lock,
            ``step`` names a complete save (never replaced), the state holds a NaN or an
            infinity, or a rank failed to write (the cause named, e.g. "No space left on device").
    """
    state, _ = _state_dict(pm, optimizer, extra)
    manifest = {"step": step, "layout": layout, "time": time.time(), "keys": len(state), "model": model}
    if hf is not None:
        manifest[HF_ENTRY] = hf
    return save_checked(
        root,
        _PREFIX,
        _world(),
        state,
        ChunkSavePlanner(state),
        manifest,
        "save_train_state",
        number=step,
        keep=keep,
        background=background,
    )


def load_train_state(
    path: str | os.PathLike,
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, torch.Tensor],
    *,
    allow_unverified: bool = False,
) -> int:
    """Collective over the world: load a save into ``pm``, ``optimizer`` and ``extra``; return its step.

    ``pm`` may use any layout (tp, pp, cp, ep, FSDP2 or none): every rank reads the ranges of the
    full tensors it holds. ``extra`` holds tensors of the saved shapes, filled in place.

    Raises:
        ShardkitError: on every rank, before anything is read: the save has no manifest or a
            damaged one, no checksums (unless ``allow_unverified``: a save of an earlier
            shardkit, loaded with a warning), its ``.metadata`` differs from its checksum or is not DCP metadata
            (refused, never run), keys of this model are missing from it, keys of it are in no
            rank's model, or a full shape or dtype differs (another model, or ``--dtype``
            changed: a load never casts). While reading: an item that differs from its
            checksum or is truncated (named, with its file), an IO error, or a NaN / inf.
    """
    path = os.fspath(path)
    _ensure_adam_state(optimizer)
    state, targets = _state_dict(pm, optimizer, extra)
    saved = error = reader = None
    step = 0
    try:
        manifest, metadata, reader = open_save(path, allow_unverified)
        saved = saved_entries(metadata)
        found = manifest.get("step")
        if not isinstance(found, int) or isinstance(found, bool) or found < 0:
            raise ShardkitError(f"{os.path.join(path, MANIFEST)} is damaged: step {found!r} is not a count")
        step = found
    except (OSError, ShardkitError) as exc:
        error = f"cannot read {path}: {exc}"
    check_contents(
        {k: (tuple(full_shape(t)), t.dtype) for k, t in state.items()},
        saved,
        _world(),
        "load_train_state",
        read_error=error,
    )
    assert reader is not None  # opened, or check_contents raised on every rank
    load_checked(state, reader, ChunkLoadPlanner(state), _world(), "load_train_state", path)
    for key, dst in targets:
        _write_back(dst, state[key].reshape(dst.shape) if dst.dim() == 0 else state[key])
    keep_slices = getattr(optimizer, "load_full_param_state", None)
    if keep_slices is not None:  # ZeRO: each rank keeps its slice of the loaded moments
        keep_slices()
    return step


def _world():
    """The default process group (these functions are collective over it)."""
    world = dist.group.WORLD
    if world is None:
        raise ShardkitError("train state: torch.distributed is not initialized")
    return world
