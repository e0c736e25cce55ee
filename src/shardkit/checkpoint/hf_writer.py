"""Write full tensors as a Hugging Face model directory: ``config.json``, safetensors shards and
the tokenizer (or a README saying the tokens are bytes).

What a save must remember for this is :func:`hf_description`: the transformers config of the
trained model (every key, as ``config.json`` holds it) and the ``--model-path`` it was loaded
from (whose tokenizer it was trained on). The trainer keeps it in each save's manifest (entry
``"hf"``); :func:`write_hf` turns it and the full tensors back into a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read.

The model is built on the meta device (no memory, no random init), the tensors are assigned to
it, and transformers' own ``save_pretrained`` writes the shards: its key names and on-disk
format (an MoE's fused ``experts.gate_up_proj`` written as the per-expert ``gate_proj`` /
``up_proj`` its loaders convert back; tied embeddings written once) are the checkpoint format
the Hub's models use.

The directory is written as safely as a save is resumed: non-finite tensors are refused (naming
the parameter) before anything is written; everything goes into a private directory beside the
output (``.<name>.partial-XXXX``) that is renamed to it at the end, so an export that fails or is
stopped (SIGTERM) leaves no directory that looks like a model, and a later one removes what a
killed one left (its writer's pid is gone). A file-system failure (read-only, full disk, a
dangling symbolic link) is one :class:`~shardkit.ShardkitError` naming the path and the cause.

Source: transformers' ``PreTrainedModel.save_pretrained`` (safetensors, ``max_shard_size``) and
``PreTrainedTokenizerBase.save_pretrained``; write-then-rename as in ``git``'s lock files and
DCP's own staging.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._files import check_out_dir  # torch-free: shardkit train checks --save-hf before import torch
from ..errors import ShardkitError
from .integrity import describe_nonfinite, nonfinite_keys
from .lock import _start_time, holder_alive

if TYPE_CHECKING:
    from torch import nn

__all__ = ["HF_ENTRY", "hf_description", "check_out_dir", "write_hf"]

HF_ENTRY = "hf"  # the manifest entry holding hf_description()
_SHARD = "5GB"  # transformers 4's default shard size; its current default (50GB) makes one file of most models
_PARTIAL = ".partial-"  # ".<out name>.partial-XXXX": an export being written beside its output (or a killed one's)
_WRITER = ".shardkit-export-writer"  # in it: the writing process (host, pid, start), to tell a killed one's

_BYTES_README = """# {name}

Exported by shardkit from the save `{save}`.

This model was trained on **byte-level tokens** (shardkit train without `--model-path`): token
`i` is the byte value `i` (0-255) of the UTF-8 text, so no tokenizer files are written. Encode
text with `list(text.encode("utf-8"))` and decode ids with `bytes(ids).decode("utf-8", "replace")`.
"""


def hf_description(
    model: nn.Module, model_path: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None
) -> dict | None:
    """What :func:`write_hf` needs besides the tensors (JSON), or None for a model with no
    Hugging Face form (one without a transformers config, e.g. the conv autoencoder).

    Args:
        model: the full, unparallelized model (a transformers ``PreTrainedModel``).
        model_path: the local checkpoint directory or GGUF file it was loaded from (its tokenizer
            is the one the run used), None for a model built from flags.
        tokenizer: the ``--tokenizer`` directory or GGUF file a model built from flags was
            trained on; None with ``model_path`` or for byte-level tokens.

    Returns:
        ``{"config": config.json's dict, "model_path": absolute path or None}``; the tokenizer's
        source is ``model_path`` (``--model-path``'s, else ``--tokenizer``'s).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    source = model_path if model_path is not None else tokenizer
    path = None if source is None else str(Path(source).expanduser().resolve())
    return {"config": json.loads(config.to_json_string(use_diff=False)), "model_path": path}


def _meta_model(config_dict: dict) -> Any:
    """The causal LM (a transformers ``PreTrainedModel``) of ``config_dict`` on the meta device (no
    memory, no init)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ShardkitError(f"export: the save's config names model_type {model_type!r}, unknown to transformers")
    config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _assign(model: Any, tensors: dict[str, torch.Tensor], origin: str) -> None:
    """Put ``tensors`` into the meta ``model`` (a transformers ``PreTrainedModel``); every parameter
    must get a value (tied ones once)."""
    _, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected:
        raise ShardkitError(
            f"export: {len(unexpected)} tensor(s) of {origin} are not parameters of the "
            f"{type(model).__name__} its config describes: {', '.join(sorted(unexpected)[:6])}"
        )
    model.tie_weights()  # a tied lm_head is saved once, as the input embedding
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing:
        raise ShardkitError(
            f"export: {len(missing)} parameter(s) of the {type(model).__name__} are not in {origin}: "
            f"{', '.join(missing[:6])}"
        )


def _load_tokenizer(model_path: str | None) -> Any:
    """The tokenizer the run trained on (``--model-path``'s or ``--tokenizer``'s), or None for a byte-level run."""
    if model_path is None:
        return None
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not path.exists():
        raise ShardkitError(
            f"export: the run was trained on the tokenizer of --model-path {model_path}, which no longer exists; "
            "restore it there to export its tokenizer"
        )
    kwargs: dict = {"local_files_only": True}
    if path.is_file():  # a GGUF file: its vocabulary and merges are in its metadata
        path, kwargs["gguf_file"] = path.parent, path.name
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShardkitError(f"export: cannot load the tokenizer of --model-path {model_path}: {exc}") from None


def _write_tokenizer(out: str, tokenizer: Any, origin: str, name: str) -> None:
    """``tokenizer`` saved into ``out``; for a byte-level run (None) a README saying what the tokens are."""
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        return
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(_BYTES_README.format(name=name, save=origin))


def _remove_abandoned(parent: str, name: str) -> None:
    """Remove the partial directories of ``name`` that a killed export left in ``parent`` (its
    writer, recorded inside, is a process of this host that is gone); others' are left alone."""
    prefix = f".{name}{_PARTIAL}"
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if not entry.startswith(prefix) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _WRITER)) as f:
                writer = json.load(f)
        except (OSError, ValueError):
            continue  # no record (not ours, or being created): left alone, never in the way
        if isinstance(writer, dict) and not holder_alive(writer):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _partial_dir(target: str) -> Iterator[str]:
    """A private directory beside ``target`` to write into, removed on leaving unless renamed."""
    parent, name = os.path.split(target)
    probe = parent
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):  # makedirs would say "File exists" of a file in the way
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), probe)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned(parent, name)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}{_PARTIAL}")
    try:
        with open(os.path.join(tmp, _WRITER), "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}, f)
        yield tmp
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: str, target: str) -> None:
    """Rename the finished ``tmp`` to ``target`` (new, or an empty directory it replaces)."""
    os.remove(os.path.join(tmp, _WRITER))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it private (0700); the model gets the usual mode
    try:
        os.replace(tmp, target)
    except OSError as exc:
        if os.path.isdir(target) and os.listdir(target):  # ENOTEMPTY / EEXIST: filled meanwhile
            raise ShardkitError(
                f"export: {target!r} was filled by something else while the model was written: nothing "
                "of the export was put there; choose a new directory"
            ) from None
        raise exc


def _write_failure(out: str, exc: Exception) -> ShardkitError:
    """One error for a file-system failure while writing ``out``: the path and the cause."""
    where = getattr(exc, "filename", None)
    cause = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__
    return ShardkitError(
        f"export: cannot write the model to {out!r}: {cause}{f' ({where})' if where else ''}; "
        f"nothing was left at {out!r}"
    )


def write_hf(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], hf: dict | None, origin: str) -> str:
    """Write ``tensors`` as a Hugging Face model directory ``out_dir``; return it.

    Args:
        out_dir: a new or empty directory (created).
        tensors: ``{parameter name: full tensor}`` of the unparallelized model (its dtype kept).
        hf: :func:`hf_description` of the model.
        origin: where the tensors come from (a save's path), named in errors and the README.

    The files are written into a private directory beside ``out_dir`` and renamed to it at the
    end: an error or a signal on the way leaves nothing at ``out_dir`` (see the module's note).

    Raises:
        ShardkitError: ``hf`` is None (the model has no Hugging Face form), ``out_dir`` is not
            new or empty (or a dangling symbolic link), a tensor holds a NaN or an infinity
            (named), tensors missing or left over against the config's model, the tokenizer of
            the run's ``--model-path`` cannot be read, or writing failed (the path and the cause:
            read-only, no space left, ...).
    """
    from safetensors import SafetensorError

    if not isinstance(hf, dict) or not isinstance(hf.get("config"), dict):
        raise ShardkitError(f"export: {origin} holds no Hugging Face config (a model with no Hugging Face form)")
    out = os.fspath(out_dir)
    check_out_dir(out, "export: the output directory")
    bad = describe_nonfinite(nonfinite_keys(tensors))
    if bad:
        raise ShardkitError(f"export: {origin} holds {bad}: refused (a model is never exported with them)")
    model = _meta_model(hf["config"])
    _assign(model, tensors, origin)
    tokenizer = _load_tokenizer(hf.get("model_path"))  # every check passed before anything is written
    target = os.path.realpath(out) if os.path.islink(out) else os.path.abspath(out)  # a link to an empty dir
    try:
        with _partial_dir(target) as tmp:
            model.save_pretrained(tmp, max_shard_size=_SHARD)
            _write_tokenizer(tmp, tokenizer, origin, os.path.basename(target))
            _publish(tmp, target)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        raise _write_failure(out, exc) from None
    return out
