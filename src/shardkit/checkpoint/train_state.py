"""Training checkpoints that resume on any layout: model, optimizer, step, data position, RNG.

Every tensor is stored as its *full* tensor (the unparallelized model's names and shapes) cut
into the chunks the ranks own, with DCP (:mod:`.chunks`' planners),
so a checkpoint written at ``tp 2 x dp 2`` loads at ``dp_shard 2 x cp 2``, at ``pp 2``, or in one
process:

* parameters and AdamW's ``exp_avg`` / ``exp_avg_sq``: the tensor-/expert-parallel local tensor
  with its :class:`~shardkit.sharding.ShardSpec`; under FSDP2 (HSDP included) the rank's own
  shard of it, never all-gathered: its rows of the local tensor are a rectangle of the full
  tensor at offsets computed from DTensor metadata (:mod:`.fsdp_shards`, a
  :class:`~.chunks.Window`), saved as they are and read straight back into the shard; each
  element written once (DCP deduplicates the replicas: tp's over dp, HSDP's over
  ``dp_replicate``);
* with ZeRO (``--zero``), AdamW's moments all-gathered per bucket into the same per-parameter
  tensors first, and each rank's slice kept on load: a ZeRO save resumes without ZeRO and back.
  A rank's slice of a flat bucket spans parameters and cuts them mid-row, so it is no
  rectangular chunk of any one of them: this gather stays (the bucket's size, not the model's);
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
from torch.distributed.tensor import DTensor

from ..errors import ShardkitError
from ..sharding import set_shard_spec
from .chunks import ChunkLoadPlanner, ChunkSavePlanner, full_shape, set_window
from .contents import check_contents
from .fsdp_shards import saved_local, write_back
from .hf_writer import HF_ENTRY
from .saves import load_checked, open_save, save_checked, saved_entries
from .versioned import MANIFEST, latest_checkpoint

if TYPE_CHECKING:
    from ..parallelize import ParallelModel
    from .background import BackgroundSaves

__all__ = ["save_train_state", "load_train_state", "latest_checkpoint", "MANIFEST"]

_PREFIX = "step_"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _saved(t: torch.Tensor, spec) -> tuple[torch.Tensor, bool]:
    """What is saved of parameter or moment ``t`` (detached, carrying ``spec`` and, for an FSDP2
    shard, its window, for the chunk planners), and whether a load must copy it back into ``t``
    (only a DTensor all-gathered for want of a ``Shard`` placement; the rest are ``t``'s own
    memory, which the load fills in place)."""
    local, where, gathered = saved_local(t)
    return set_window(set_shard_spec(local, spec), where), gathered


def _write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a loaded tensor into ``dst``: an all-gathered DTensor keeps its block of it."""
    if isinstance(dst, DTensor):
        write_back(dst, src)
        return
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
        opt = opt_state.get(p, {})
        for key, t in [(f"model/{name}", p)] + [(f"optim/{name}/{k}", opt[k]) for k in _ADAM_KEYS if k in opt]:
            state[key], copy_back = _saved(t, spec)
            if copy_back:
                targets.append((key, t))
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
            returns. ZeRO's moment gathers still run here; FSDP2 shards are staged as they are
            (each rank copies its shard only).

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
