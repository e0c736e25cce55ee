"""Export a training save of ``shardkit train`` to a Hugging Face model directory.

A save (:func:`~shardkit.save_train_state`) stores every parameter as its full tensor cut into
the chunks the ranks owned, whatever the layout (tp, pp, cp, ep, FSDP2); its manifest holds the
model's transformers config and the ``--model-path`` whose tokenizer the run used (entry
``"hf"``, :func:`.hf_writer.hf_description`). :func:`export_hf` reads the ``model/*`` tensors
whole in this one process (each item checked against the manifest's checksum,
:class:`.reader.VerifiedReader`), leaves out what only a resume needs (``optim/*``: AdamW's
moments and step; ``train/*``: the data sampler's generator and torch's RNG) and writes them
with :func:`.hf_writer.write_hf`. It needs no process group: run it anywhere the save can be read.

Source: PyTorch Distributed Checkpoint's planner-driven loads (here without a process group);
transformers' ``save_pretrained`` for the output format.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import ShardkitError
from .chunks import ChunkLoadPlanner
from .hf_writer import HF_ENTRY, check_out_dir, write_hf
from .integrity import dcp_failure
from .paths import check_inside
from .reader import VerifiedReader
from .saves import open_save, saved_entries
from .versioned import MANIFEST, complete_saves, latest_checkpoint, read_manifest

__all__ = ["export_hf", "find_save"]

_PREFIX = "step_"  # the trainer's saves (train_state.py)
_MODEL = "model/"
_TRAIN_ONLY = ("optim/", "train/")  # AdamW state; data sampler and RNG: resume-only, never exported
# the aux-loss-free balancing bias of each router (train.moe_balance): part of the model's routing
_ROUTER_BIAS = "train/moe_bias/"


def find_save(checkpoint_dir: str | os.PathLike, step: int | None = None) -> str:
    """The save of ``checkpoint_dir`` at ``step`` (None: the latest); ``checkpoint_dir`` may also
    be one save's own directory.

    Raises:
        ShardkitError: naming the directory: it does not exist, holds no complete save, holds
            none at ``step`` (the message lists the steps it holds), or the save (or ``latest``)
            is a symbolic link resolving outside it.
    """
    root = os.fspath(checkpoint_dir)
    where = f"--checkpoint-dir {root!r}"
    if not os.path.isdir(root):
        raise ShardkitError(f"export: {where} {'is not a directory' if os.path.exists(root) else 'does not exist'}")
    if os.path.isfile(os.path.join(root, MANIFEST)):  # a save's own directory
        return root
    saves = complete_saves(root, _PREFIX)
    if not saves:
        raise ShardkitError(f"export: {where} holds no complete save of shardkit train (step_* with a {MANIFEST})")
    try:
        if step is None:
            latest = latest_checkpoint(root)
            found = latest if latest is not None else os.path.join(root, saves[-1])
        else:
            name = f"{_PREFIX}{step:08d}"
            if name not in saves:
                steps = ", ".join(str(int(s[len(_PREFIX) :])) for s in saves)
                raise ShardkitError(f"--step {step}: {where} holds no save at step {step}; its saves: steps {steps}")
            found = os.path.join(root, name)
        check_inside(root, found, "save")  # a link into another root is never exported
    except ShardkitError as exc:
        raise ShardkitError(f"export: {exc}") from None
    return found


def _no_hf_form(path: str, manifest: dict) -> ShardkitError:
    """Why a save without the ``hf`` entry cannot be exported."""
    model = manifest.get("model")
    if isinstance(model, dict) and "model" in model and not {"config", "hidden_size"} & model.keys():
        name = model["model"]
        return ShardkitError(f"export: {path} is a save of --model {name}, which has no Hugging Face form")
    return ShardkitError(
        f"export: {path} does not say which Hugging Face model it holds (written by an earlier shardkit, or "
        "not by shardkit train); resume it for one more step with this version to write a save that does"
    )


def _read_parameters(path: str, metadata: Metadata, reader: VerifiedReader) -> dict[str, torch.Tensor]:
    """The full ``model/*`` tensors of an opened save, by parameter name (one process, no group)."""
    entries = saved_entries(metadata)
    unknown = sorted(k for k in entries if not k.startswith((_MODEL, *_TRAIN_ONLY)))
    if unknown:
        raise ShardkitError(f"export: {path} holds keys of no known kind: {', '.join(unknown[:6])}")
    if any(k.startswith(_ROUTER_BIAS) for k in entries):
        raise ShardkitError(
            f"export: {path} was trained with --moe-bias-update-rate: its routers add a learned bias "
            "to the scores that pick the experts, and transformers' MoE models have no slot for it, "
            "so the exported model would route otherwise (the rule of train --save-hf); refused"
        )
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in entries.items() if k.startswith(_MODEL)}
    if not state:
        raise ShardkitError(f"export: {path} holds no model parameters")
    try:
        with warnings.catch_warnings():
            # no_dist is the intent (one process reads the whole save); DCP warns that it assumes it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(state), no_dist=True)
    except CheckpointException as exc:
        raise dcp_failure(exc, "export", "reading", path) from None
    return {k[len(_MODEL) :]: t for k, t in state.items()}


def export_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    step: int | None = None,
    *,
    allow_unverified: bool = False,
) -> str:
    """Write a save of ``shardkit train`` as a Hugging Face model directory; return ``out_dir``.

    ``out_dir`` gets ``config.json`` (the trained model's transformers config: Llama, Qwen2,
    Qwen3, Qwen3-MoE or DeepSeek-V2), ``generation_config.json``, safetensors shards of the full
    parameters (with ``model.safetensors.index.json`` when there are several) and the tokenizer
    the run used (``--model-path``: a checkpoint directory's or a GGUF file's); a byte-level run
    gets a ``README.md`` saying how its tokens map to text instead. Load it with
    ``AutoModelForCausalLM.from_pretrained(out_dir)``. Works for a save of any layout, in one
    process, with or without an initialized process group (nothing collective).

    Args:
        checkpoint_dir: a ``--checkpoint-dir`` of ``shardkit train`` (or one save inside it).
        out_dir: a new or empty directory.
        step: the save to export (None: the latest).
        allow_unverified: export a save whose manifest has no checksums (an earlier
            shardkit's), with a warning; refused otherwise.

    Raises:
        ShardkitError: ``checkpoint_dir`` missing or holding no save, no save at ``step``, a
            damaged save (manifest, metadata or an item differing from its checksum), a model
            with no Hugging Face form (``conv-ae``), ``out_dir`` not new or empty, or the run's
            tokenizer unreadable.
    """
    check_out_dir(out_dir, "export: --out")
    path = find_save(checkpoint_dir, step)
    hf = read_manifest(path).get(HF_ENTRY)  # a model with no Hugging Face form is refused before any read
    if not isinstance(hf, dict):
        raise _no_hf_form(path, read_manifest(path))
    _, metadata, reader = open_save(path, allow_unverified)
    return write_hf(out_dir, _read_parameters(path, metadata, reader), hf, path)
