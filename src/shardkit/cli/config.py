"""Configuration of ``shardkit train``: defaults < TOML file < command-line flags, then checks.

Everything here is pure (no process group), so every check runs in the launching process
*before* any worker starts: a bad layout fails in well under a second with one message.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ShardkitError

__all__ = ["TrainConfig", "DTYPES", "SCHEDULES", "MODELS", "CP_MODELS", "load_toml", "merge_config", "validate_config",
           "parse_pp_tp"]

DTYPES = ("float32", "float64", "bfloat16")
SCHEDULES = ("1f1b", "gpipe")
# Causal LMs trained with tensor (+ expert) parallelism; "llama" also with pp and sequence
# parallelism. "moe" is Qwen3-MoE, "mla" DeepSeek-V2 (multi-head latent attention + MoE).
LM_MODELS = ("llama", "qwen2", "qwen3", "moe", "mla")
MODELS = (*LM_MODELS, "conv-ae")
# Dense causal LMs trained with context parallelism (apply_cp switches their HF attention).
CP_MODELS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``shardkit train``; field names are the flags with underscores.

    The default model is small enough that the default run (4 CPU processes, 20 steps) takes
    well under 3 minutes on 2 cores: about 0.1 M parameters, GQA with 4 query and 2 key/value
    heads (head dim 16), so tp=2 keeps whole heads per rank.
    """

    model: str = "llama"  # see MODELS: a causal LM (tp x dp; llama also pp) or "conv-ae" (spatial)
    nproc: int | None = None  # None: 4 for llama, spatial for conv-ae
    spatial: int = 1  # conv-ae only: ranks sharing each frame along W
    tp: int | None = None  # None: 2 without pp and cp, 1 with --pp > 1 (the same tp in every stage) or cp
    pp_tp: str | None = None  # per-stage tp sizes "2,1,1" (VTP): pp = their count, sum * dp = nproc
    dp: int | None = None  # None: nproc // (tp * pp)
    pp: int = 1
    cp_ulysses: int = 1  # context parallel: ranks sharing each sequence, all-to-all over heads (Ulysses)
    cp_ring: int = 1  # context parallel: ranks sharing each sequence, zigzag ring attention (both > 1: USP)
    packed: bool = False  # cp only: each window is documents (corpus files) packed along S, no cross-file attention
    ep: int = 1  # moe / mla: experts sharded over the tp ranks (ep == tp) with all-to-all dispatch
    loss_parallel: bool = False  # vocab-sharded logits and loss (never the full [B, S, V] logits)
    experts: int = 4  # moe / mla: routed experts (top-2)
    microbatches: int = 1  # per step and dp rank; pp > 1 only
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    steps: int = 20
    seq_len: int = 128
    batch_size: int = 8  # global, split over dp
    dtype: str = "float32"
    seed: int = 0
    lr: float = 1e-3
    verify: bool = False
    report: str | None = None
    data: str | None = None  # None: the Python standard library's source tree
    model_path: str | None = None  # None: random init of the built-in config
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 128
    config: str | None = None  # the TOML file these values came from, if any

    @property
    def dp_size(self) -> int:
        """The dp degree (``dp`` or ``nproc // model_ranks``, nproc defaulting to 4)."""
        nproc = self.nproc if self.nproc is not None else 4
        return self.dp if self.dp is not None else nproc // self.model_ranks

    @property
    def tp_size(self) -> int:
        """The tp degree (``tp``, or its default: 2 without pp and cp, else 1)."""
        return self.tp if self.tp is not None else (2 if self.pp == 1 and self.cp_size == 1 else 1)

    @property
    def stage_tp_sizes(self) -> tuple[int, ...]:
        """The tp size of every pipeline stage: ``--pp-tp``, else ``tp`` in each of ``pp`` stages."""
        if self.pp_tp is not None:
            return parse_pp_tp(self.pp_tp)
        return (self.tp_size,) * self.pp

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks per replica: ``cp_ring * cp_ulysses``."""
        return self.cp_ring * self.cp_ulysses

    @property
    def model_ranks(self) -> int:
        """Ranks holding one model replica: the sum of the stage tp sizes, times the cp size."""
        return sum(self.stage_tp_sizes) * self.cp_size


def parse_pp_tp(text) -> tuple[int, ...]:
    """``"2,1,1"`` -> ``(2, 1, 1)``: the tp size of each pipeline stage (pure).

    Raises:
        ShardkitError: not a comma-separated list of at least two ints >= 1.
    """
    try:
        sizes = tuple(int(t) for t in str(text).split(","))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or any(t < 1 for t in sizes):
        raise ShardkitError(f"--pp-tp must list the tp size (>= 1) of each of at least 2 pipeline stages, "
                            f"e.g. 2,1,1; got {text!r}")
    return sizes


_FIELDS = {f.name: f for f in fields(TrainConfig)}
_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


def _type_name(field) -> str:
    return str(field.type).split(" ")[0]  # "int | None" -> "int"


def load_toml(path: str | Path) -> dict:
    """Read a TOML file of ``shardkit train`` options (keys are option names with underscores).

    Raises:
        ShardkitError: the file is missing or not valid TOML, has an unknown key or a value of
            the wrong type.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ShardkitError(f"--config: cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ShardkitError(f"--config: {path} is not valid TOML: {e}") from e
    for key, value in data.items():
        if key not in _FIELDS or key == "config":
            known = ", ".join(k for k in _FIELDS if k != "config")
            raise ShardkitError(f"--config: unknown key {key!r} in {path} (known keys: {known})")
        want = _TYPES[_type_name(_FIELDS[key])]
        if isinstance(value, bool) and want is not bool or not isinstance(value, want):
            raise ShardkitError(f"--config: {key} in {path} must be {_type_name(_FIELDS[key])}, got {value!r}")
    return data


def merge_config(file_values: dict, cli_values: dict) -> TrainConfig:
    """Defaults, overridden by ``file_values``, overridden by the flags that were given.

    Args:
        file_values: keys/values from :func:`load_toml` (may be empty).
        cli_values: parsed flags; a value of None means "not given on the command line".
    """
    merged = {**file_values, **{k: v for k, v in cli_values.items() if v is not None and k in _FIELDS}}
    return dataclasses.replace(TrainConfig(), **merged)


def validate_config(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Check a configuration before launching; return it with ``dp`` and ``nproc`` resolved.

    Args:
        cfg: the merged configuration.
        world_size: the existing world's size when already running under torchrun (then
            ``nproc`` must be unset or equal to it).

    Raises:
        ShardkitError: with a message naming the options at fault.
    """
    if world_size is not None:
        if cfg.nproc not in (None, world_size):
            raise ShardkitError(f"--nproc {cfg.nproc} does not match the torchrun world size {world_size}")
        cfg = dataclasses.replace(cfg, nproc=world_size)
    if cfg.model not in MODELS:
        raise ShardkitError(f"--model must be one of {', '.join(MODELS)}, got {cfg.model!r}")
    if cfg.model == "conv-ae":
        return _validate_conv_ae(cfg)
    if cfg.spatial != 1:
        raise ShardkitError(f"--spatial {cfg.spatial} needs --model conv-ae (llama uses --tp/--pp/--dp)")
    _validate_lm_kind(cfg)
    if cfg.nproc is None:
        cfg = dataclasses.replace(cfg, nproc=4)
    if cfg.pp_tp is not None:
        sizes = parse_pp_tp(cfg.pp_tp)
        if cfg.tp is not None:
            raise ShardkitError(f"--tp {cfg.tp} with --pp-tp {cfg.pp_tp}: give the stage tp sizes once (--pp-tp)")
        if cfg.pp not in (1, len(sizes)):
            raise ShardkitError(f"--pp {cfg.pp} but --pp-tp {cfg.pp_tp} lists {len(sizes)} stages")
        # tp=1 here: the per-stage sizes live in pp_tp (a rectangular pp x tp mesh cannot hold them).
        cfg = dataclasses.replace(cfg, pp=len(sizes), pp_tp=",".join(map(str, sizes)), tp=1)
    cfg = dataclasses.replace(cfg, tp=cfg.tp_size)
    for name in ("nproc", "tp", "pp", "cp_ulysses", "cp_ring", "microbatches", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.seq_len < 2:
        raise ShardkitError(f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {cfg.seq_len}")
    if cfg.lr <= 0:
        raise ShardkitError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.dtype not in DTYPES:
        raise ShardkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    _validate_pipeline(cfg)
    _validate_cp(cfg)
    model_ranks = cfg.model_ranks
    layout = f"pp={cfg.pp} x tp={cfg.tp}" if cfg.pp > 1 else f"tp={cfg.tp}"
    if cfg.pp_tp is not None:
        layout = f"pp_tp={cfg.pp_tp} ({model_ranks} ranks)"
    if cfg.cp_size > 1:
        layout = f"tp={cfg.tp} x cp_ring={cfg.cp_ring} x cp_ulysses={cfg.cp_ulysses}"
    if cfg.dp is None:
        if cfg.nproc % model_ranks:
            what = f"--pp {cfg.pp} x --tp {cfg.tp} = {model_ranks}" if cfg.pp > 1 else f"--tp {cfg.tp}"
            if cfg.pp_tp is not None:
                what = f"--pp-tp {cfg.pp_tp} (sum {model_ranks})"
            rule = "nproc // (tp * pp)" if cfg.pp > 1 else "nproc // tp"
            if cfg.cp_size > 1:
                what = f"--tp {cfg.tp} x --cp-ring {cfg.cp_ring} x --cp-ulysses {cfg.cp_ulysses} = {model_ranks}"
                rule = "nproc // (tp * cp_ring * cp_ulysses)"
            raise ShardkitError(f"{what} must divide --nproc {cfg.nproc} (dp defaults to {rule})")
        cfg = dataclasses.replace(cfg, dp=cfg.nproc // model_ranks)
    if model_ranks * cfg.dp != cfg.nproc:
        raise ShardkitError(
            f"layout {layout} x dp={cfg.dp} = {model_ranks * cfg.dp} ranks, but --nproc is {cfg.nproc}"
        )
    if cfg.batch_size % (cfg.dp * cfg.microbatches):
        what = f"dp={cfg.dp} x microbatches={cfg.microbatches}" if cfg.microbatches > 1 else f"dp={cfg.dp}"
        raise ShardkitError(f"--batch-size {cfg.batch_size} (global) must be divisible by {what}")
    _validate_model(cfg)
    return cfg


def _validate_cp(cfg: TrainConfig) -> None:
    """Context parallelism (:func:`shardkit.context_parallel.apply_cp`): tp x cp x dp, dense models."""
    if cfg.cp_size == 1:
        if cfg.packed:
            raise ShardkitError("--packed needs context parallelism (--cp-ulysses or --cp-ring > 1)")
        return
    flags = f"--cp-ring {cfg.cp_ring} --cp-ulysses {cfg.cp_ulysses}"
    if cfg.pp > 1:
        raise ShardkitError(f"{flags} with --pp {cfg.pp}: context parallelism is for tp x cp x dp runs (not pipelines)")
    if cfg.model not in CP_MODELS:
        raise ShardkitError(f"{flags}: context parallelism is built for --model {', '.join(CP_MODELS)}, not {cfg.model}")
    if cfg.loss_parallel:
        raise ShardkitError(f"{flags} with --loss-parallel: the cp loss needs full-vocabulary logits")
    import torch

    from ..context_parallel._sizes import _order

    # shard_batch's split: the zigzag ring parts of S (Ulysses alone: one part), each split
    # over the Ulysses ranks. HF layers cannot run on zero tokens, so every rank needs one: the
    # rule shard_batch enforces per batch, checked here before any process starts.
    smallest = min(_order((0, cfg.seq_len), cfg.cp_ring, torch.device("cpu")).sizes)
    if smallest < cfg.cp_ulysses:
        raise ShardkitError(f"--seq-len {cfg.seq_len} with {flags}: every cp rank needs at least one token "
                            f"(the smallest ring part has {smallest} tokens for {cfg.cp_ulysses} Ulysses rank(s))")


def _validate_lm_kind(cfg: TrainConfig) -> None:
    """Options that depend on which causal LM is trained (checked before the layout)."""
    if cfg.model != "llama":
        if cfg.pp != 1 or cfg.pp_tp is not None:
            raise ShardkitError(f"--model {cfg.model}: pipeline stages (--pp, --pp-tp) are built for llama only")
        if cfg.model_path is not None:
            raise ShardkitError(f"--model-path loads Llama checkpoints; --model {cfg.model} is built from its config")
    if cfg.ep != 1:
        if cfg.model not in ("moe", "mla"):
            raise ShardkitError(f"--ep {cfg.ep} needs a mixture-of-experts model (--model moe or mla)")
        if cfg.ep != (cfg.tp or 2):
            raise ShardkitError(f"--ep {cfg.ep} must equal --tp {cfg.tp or 2}: experts are sharded over the tp ranks")
    if cfg.loss_parallel and cfg.pp != 1:
        raise ShardkitError("--loss-parallel is for tp x dp runs (not --pp)")
    if cfg.experts < 1:
        raise ShardkitError(f"--experts must be >= 1, got {cfg.experts}")


def _validate_conv_ae(cfg: TrainConfig) -> TrainConfig:
    """``--model conv-ae``: spatial ranks only (nproc = spatial, dp = 1)."""
    from .conv_ae import CROP, MIN_LOCAL_WIDTH

    given = [f"--{name} {getattr(cfg, name)}" for name in ("tp", "pp", "dp", "microbatches")
             if getattr(cfg, name) not in (None, 1)]
    if given:
        raise ShardkitError(f"{', '.join(given)} with --model conv-ae: it trains with --spatial only "
                            "(tp, pp, microbatches and dp x spatial are not supported)")
    for name in ("spatial", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.spatial > CROP[1] // MIN_LOCAL_WIDTH:
        raise ShardkitError(f"--spatial {cfg.spatial}: the {CROP[1]}-column crops give each rank fewer than "
                            f"{MIN_LOCAL_WIDTH} columns (at most --spatial {CROP[1] // MIN_LOCAL_WIDTH})")
    nproc = cfg.spatial if cfg.nproc is None else cfg.nproc
    if nproc != cfg.spatial:
        raise ShardkitError(f"layout spatial={cfg.spatial} x dp=1 = {cfg.spatial} ranks, but --nproc is {nproc}")
    if cfg.lr <= 0:
        raise ShardkitError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.dtype not in DTYPES:
        raise ShardkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    return dataclasses.replace(cfg, nproc=nproc, tp=1, dp=1)


def _validate_pipeline(cfg: TrainConfig) -> None:
    if cfg.schedule not in SCHEDULES:
        raise ShardkitError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.pp == 1 and cfg.microbatches > 1:
        raise ShardkitError(f"--microbatches {cfg.microbatches} needs --pp > 1 (microbatches split pipeline steps)")
    # pp x tp: each stage gets plain Megatron TP over its own tp group (apply_tp on the stage
    # module with the model's own plan), replicated activations at the stage boundaries.


def _validate_model(cfg: TrainConfig) -> None:
    from ..pipeline_parallel.hf_decoder import check_pp
    from ..tensor_parallel import check_tp

    if cfg.model_path is None:
        for name in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size"):
            if getattr(cfg, name) < 1:
                raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
        if cfg.hidden_size % cfg.heads or cfg.heads % cfg.kv_heads:
            raise ShardkitError(
                f"--hidden-size {cfg.hidden_size} must be divisible by --heads {cfg.heads}, and --heads by "
                f"--kv-heads {cfg.kv_heads}"
            )
        from types import SimpleNamespace

        model_config = SimpleNamespace(
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.layers,
            tie_word_embeddings=False,  # build_model unties
        )
    else:
        model_config = model_config_from_path(cfg.model_path)
        if model_config.vocab_size < 256:
            raise ShardkitError(f"--model-path: vocab_size {model_config.vocab_size} < 256 (byte-level tokens)")
    if cfg.pp == 1 and cfg.cp_size == 1:
        try:
            check_tp(model_config, cfg.tp)
        except ShardkitError as e:
            raise ShardkitError(f"--tp {cfg.tp}: {e}") from None
    elif cfg.cp_size > 1 and (model_config.num_attention_heads % cfg.tp or model_config.num_key_value_heads % cfg.tp):
        raise ShardkitError(f"--tp {cfg.tp} with context parallelism: the {model_config.num_attention_heads} query and "
                            f"{model_config.num_key_value_heads} key/value heads must both divide into whole heads per tp rank")
    for s, t in enumerate(cfg.stage_tp_sizes if cfg.pp > 1 else ()):
        try:
            check_tp(model_config, t)
        except ShardkitError as e:
            flag = f"--pp-tp {cfg.pp_tp} (stage {s})" if cfg.pp_tp is not None else f"--tp {t}"
            raise ShardkitError(f"{flag}: {e}") from None
    try:
        check_pp(model_config, cfg.pp)
    except ShardkitError as e:
        raise ShardkitError(f"--pp {cfg.pp}: {e}") from None


def uses_sequence_parallel(cfg: TrainConfig) -> bool:
    """Llama without --loss-parallel (and without cp) keeps tensor + sequence parallelism
    (apply_tp(..., sequence_parallel=True)); every other causal LM is sharded by its own Hugging
    Face plan through apply_tp. With cp the sequence is already split over the cp ranks: the
    sequence-parallel split at layers[0] would cut it again, so cp uses the plain Megatron plan."""
    return cfg.model == "llama" and not cfg.loss_parallel and cfg.cp_size == 1


def model_config_from_path(path: str):
    """The Hugging Face config of a local checkpoint directory (no weights are read).

    Raises:
        ShardkitError: ``path`` has no readable ``config.json``.
    """
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ShardkitError(f"--model-path: {path} has no config.json (expected a local Hugging Face checkpoint)")
    return AutoConfig.from_pretrained(path, local_files_only=True)
