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

Source: transformers' ``PreTrainedModel.save_pretrained`` (safetensors, ``max_shard_size``) and
``PreTrainedTokenizerBase.save_pretrained``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ShardkitError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["HF_ENTRY", "hf_description", "check_out_dir", "write_hf"]

HF_ENTRY = "hf"  # the manifest entry holding hf_description()
_SHARD = "5GB"  # transformers 4's default shard size; its current default (50GB) makes one file of most models

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


def check_out_dir(out_dir: str | os.PathLike, flag: str) -> None:
    """Refuse an output directory an export would mix with other files (pure: the file system).

    Raises:
        ShardkitError: naming ``flag``: ``out_dir`` is empty text, a file, or a non-empty directory.
    """
    out = os.fspath(out_dir)
    if not out.strip():
        raise ShardkitError(f"{flag}: give a directory")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ShardkitError(f"{flag} {out!r} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise ShardkitError(f"{flag} {out!r} is not empty; the export would mix with its files: choose a new directory")


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


def _write_tokenizer(out: str, tokenizer: Any, origin: str) -> None:
    """``tokenizer`` saved into ``out``; for a byte-level run (None) a README saying what the tokens are."""
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        return
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(_BYTES_README.format(name=os.path.basename(os.path.abspath(out)), save=origin))


def write_hf(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], hf: dict | None, origin: str) -> str:
    """Write ``tensors`` as a Hugging Face model directory ``out_dir``; return it.

    Args:
        out_dir: a new or empty directory (created).
        tensors: ``{parameter name: full tensor}`` of the unparallelized model (its dtype kept).
        hf: :func:`hf_description` of the model.
        origin: where the tensors come from (a save's path), named in errors and the README.

    Raises:
        ShardkitError: ``hf`` is None (the model has no Hugging Face form), ``out_dir`` is not
            new or empty, tensors missing or left over against the config's model, or the
            tokenizer of the run's ``--model-path`` cannot be read.
    """
    if not isinstance(hf, dict) or not isinstance(hf.get("config"), dict):
        raise ShardkitError(f"export: {origin} holds no Hugging Face config (a model with no Hugging Face form)")
    out = os.fspath(out_dir)
    check_out_dir(out, "export: the output directory")
    model = _meta_model(hf["config"])
    _assign(model, tensors, origin)
    tokenizer = _load_tokenizer(hf.get("model_path"))  # every check passed before anything is written
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, max_shard_size=_SHARD)
    _write_tokenizer(out, tokenizer, origin)
    return out
