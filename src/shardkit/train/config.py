"""Configuration of ``shardkit train``: defaults < TOML file < command-line flags, then checks.

Everything here is pure (no process group), so every check runs in the launching process
*before* any worker starts: a bad layout fails in well under a second with one message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ShardkitError
from ..sharding import ParallelDims

__all__ = [
    "TrainConfig",
    "DTYPES",
    "SCHEDULES",
    "MODELS",
    "load_toml",
    "merge_config",
    "validate_config",
    "parse_pp_tp",
    "parallel_dims",
]

DTYPES = ("float32", "float64", "bfloat16")
SCHEDULES = ("1f1b", "gpipe")
LR_SCHEDULES = ("constant", "warmup-cosine")
# --model-path families (config.model_type) and the --model names of the same architectures.
FAMILY_MODELS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "moe", "deepseek_v2": "mla"}
# Causal LMs: Llama, Qwen2, Qwen3, Qwen3-MoE ("moe"), DeepSeek-V2 ("mla": multi-head latent
# attention + MoE); "conv-ae" is the spatially sharded convolutional autoencoder.
LM_MODELS = ("llama", "qwen2", "qwen3", "moe", "mla")
MODELS = (*LM_MODELS, "conv-ae")
MOE_MODELS = ("moe", "mla")
MAX_SIZE = 2**31 - 1  # any size or count flag: beyond it no tensor dimension or rank count is meaningful
_SIZES = (
    "nproc",
    "tp",
    "pp",
    "cp_ulysses",
    "cp_ring",
    "dp_shard",
    "dp_replicate",
    "ep",
    "spatial",
    "spatial_h",
    "microbatches",
    "batch_size",
    "seq_len",
    "hidden_size",
    "layers",
    "heads",
    "kv_heads",
    "intermediate_size",
    "experts",
)
MAX_SEED = 2**63 - 1  # torch's generators take a 64-bit seed; shardkit keeps it a non-negative int64
MAX_TIMEOUT_S = 86400  # --timeout: a collective that waits a day for a rank is a hang, not a slow step


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``shardkit train``; field names are the flags with underscores.

    The default model is small enough that the default run (4 CPU processes, 20 steps) takes
    well under 3 minutes on 2 cores: about 0.1 M parameters, GQA with 4 query and 2 key/value
    heads (head dim 16), so tp=2 keeps whole heads per rank.
    """

    model: str = "llama"  # see MODELS
    nproc: int | None = None  # None: the product of the degrees (4 by default)
    spatial: int = 1  # conv-ae only: ranks sharing each frame along W
    spatial_h: int = 1  # conv-ae only: ranks sharing each frame along H (both > 1: H x W tiles)
    tp: int | None = None  # None: 2 for an LM without pp, cp and pp_tp; else 1
    pp_tp: str | None = None  # per-stage tp sizes "2,1,1" (VTP): pp = their count, sum * dp = nproc
    dp: int | None = None  # alias of dp_replicate (kept for old command lines)
    dp_replicate: int | None = None  # None: what nproc leaves after every other degree
    dp_shard: int = 1  # FSDP2 ranks (ZeRO-3 sharding of parameters, gradients, optimizer state)
    pp: int = 1
    cp_ulysses: int = 1  # context parallel: ranks sharing each sequence, all-to-all over heads (Ulysses)
    cp_ring: int = 1  # context parallel: ranks sharing each sequence, zigzag ring attention (both > 1: USP)
    packed: bool = False  # each window is documents (corpus files) packed along S, no cross-file attention
    ep: int = 1  # moe / mla: expert-parallel ranks, borrowed from dp_shard x cp x tp
    loss_parallel: bool = False  # vocab-sharded logits and loss (never the full [B, S, V] logits)
    sequence_parallel: bool | None = None  # None: on for llama with tp > 1 (Megatron-SP)
    experts: int = 4  # moe / mla: routed experts (top-2)
    microbatches: int = 1  # per step and dp rank: pipeline microbatches, or gradient accumulation
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    max_norm: float | None = 1.0  # clip the global gradient norm (None / 0: no clipping)
    skip_nonfinite: int = 0  # skip up to N steps whose global loss or grad norm is NaN/inf; one more stops the run
    steps: int = 20  # total steps: a resumed run continues up to this count
    checkpoint_dir: str | None = None  # save the training state here (DCP, one directory per save)
    save_every: int = 0  # save every N steps (and after the last); 0: only after the last step
    keep: int | None = None  # keep the newest N complete saves (None: all)
    resume: bool = False  # continue from the latest save in --checkpoint-dir (any layout)
    seq_len: int = 128
    batch_size: int = 8  # global, split over dp
    dtype: str = "float32"
    seed: int = 0
    lr: float | None = None  # None: 1e-3 from scratch, 1e-4 (FINETUNE_LR) with --model-path
    lr_schedule: str | None = None  # "constant" or "warmup-cosine"; None: warmup-cosine with --model-path
    verify: bool = False
    checks: bool = False  # run with shardkit's cross-rank check mode on (shardkit.comm.checks)
    timeout: float = 300.0  # seconds any collective (every process group) waits for a rank before failing
    report: str | None = None
    data: str | None = None  # None: the Python standard library's source tree
    model_path: str | None = None  # a local HF checkpoint directory or *.gguf file; None: the built-in config
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 128
    config: str | None = None  # the TOML file these values came from, if any

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks per replica: ``cp_ring * cp_ulysses``."""
        return self.cp_ring * self.cp_ulysses

    @property
    def stage_tp_sizes(self) -> tuple[int, ...]:
        """The tp size of every pipeline stage: ``--pp-tp``, else ``tp`` in each of ``pp`` stages."""
        if self.pp_tp is not None:
            return parse_pp_tp(self.pp_tp)
        return (self.tp or 1,) * self.pp


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
        raise ShardkitError(
            f"--pp-tp must list the tp size (>= 1) of each of at least 2 pipeline stages, e.g. 2,1,1; got {text!r}"
        )
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
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself, outside TOMLDecodeError
        raise ShardkitError(f"--config: {path} is not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from e
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


def _check_writable(flag: str, folder: str) -> None:
    """``folder`` exists as a writable directory, or can be created (checked before launch, so a
    run never trains for nothing and then fails to write its results)."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ShardkitError(f"{flag} {folder}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ShardkitError(f"{flag} {folder}: {probe} is not writable")


def _default_tp(cfg: TrainConfig) -> int:
    if cfg.tp is not None:
        return cfg.tp
    lm_plain = cfg.model != "conv-ae" and cfg.pp == 1 and cfg.cp_size == 1 and cfg.pp_tp is None
    return 2 if lm_plain else 1


def _model_ranks(cfg: TrainConfig) -> int:
    """Ranks of one data-parallel replica (every degree but dp_replicate)."""
    if cfg.pp_tp is not None:
        return sum(parse_pp_tp(cfg.pp_tp))
    return cfg.pp * cfg.cp_size * cfg.tp * cfg.spatial_h * cfg.spatial * cfg.dp_shard


def validate_config(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Check a configuration before launching; return it with every degree resolved.

    Only real limits are refused (each with its reason; the README lists them). Every check is
    pure, so a bad layout fails in the launching process before any worker starts.

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
    if cfg.dp is not None:
        if cfg.dp_replicate not in (None, cfg.dp):
            raise ShardkitError(f"--dp {cfg.dp} and --dp-replicate {cfg.dp_replicate}: --dp is an alias, give one")
        cfg = dataclasses.replace(cfg, dp_replicate=cfg.dp, dp=None)
    if cfg.pp_tp is not None:
        sizes = parse_pp_tp(cfg.pp_tp)
        if cfg.tp is not None:
            raise ShardkitError(f"--tp {cfg.tp} with --pp-tp {cfg.pp_tp}: give the stage tp sizes once (--pp-tp)")
        if cfg.pp not in (1, len(sizes)):
            raise ShardkitError(f"--pp {cfg.pp} but --pp-tp {cfg.pp_tp} lists {len(sizes)} stages")
        cfg = dataclasses.replace(cfg, pp=len(sizes), pp_tp=",".join(map(str, sizes)))
    cfg = dataclasses.replace(cfg, tp=_default_tp(cfg))
    for name in (
        "tp",
        "pp",
        "cp_ulysses",
        "cp_ring",
        "dp_shard",
        "ep",
        "spatial",
        "spatial_h",
        "microbatches",
        "steps",
        "batch_size",
    ):
        if getattr(cfg, name) < 1:
            raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("nproc", "dp_replicate"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in _SIZES:  # a sanity bound; train/limits.py checks what this machine can hold
        if getattr(cfg, name) is not None and getattr(cfg, name) > MAX_SIZE:
            raise ShardkitError(f"--{name.replace('_', '-')} must be <= 2**31 - 1, got {getattr(cfg, name)}")
    if cfg.lr is None:
        from .schedule import FINETUNE_LR

        cfg = dataclasses.replace(cfg, lr=FINETUNE_LR if cfg.model_path is not None else 1e-3)
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ShardkitError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ShardkitError(f"--seed must be in [0, 2**63 - 1], got {cfg.seed}")
    if cfg.skip_nonfinite < 0:
        raise ShardkitError(f"--skip-nonfinite must be >= 0, got {cfg.skip_nonfinite}")
    if not math.isfinite(cfg.timeout) or not 0 < cfg.timeout <= MAX_TIMEOUT_S:
        raise ShardkitError(f"--timeout must be a finite number of seconds in (0, {MAX_TIMEOUT_S}], got {cfg.timeout}")
    if cfg.lr_schedule is None:
        cfg = dataclasses.replace(cfg, lr_schedule="warmup-cosine" if cfg.model_path is not None else "constant")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ShardkitError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {cfg.lr_schedule!r}")
    if cfg.save_every < 0:
        raise ShardkitError(f"--save-every must be >= 0, got {cfg.save_every}")
    if (cfg.resume or cfg.save_every) and cfg.checkpoint_dir is None:
        raise ShardkitError("--resume and --save-every need --checkpoint-dir DIR")
    if cfg.keep is not None and (cfg.keep < 1 or cfg.checkpoint_dir is None):
        raise ShardkitError(f"--keep must be >= 1 (complete saves kept) and needs --checkpoint-dir, got {cfg.keep}")
    for flag, folder in (("--report", cfg.report), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if folder is not None:
            _check_writable(flag, folder)
    if cfg.max_norm is not None and not (math.isfinite(cfg.max_norm) and cfg.max_norm >= 0):
        raise ShardkitError(f"--max-norm must be a finite number >= 0 (0: no clipping), got {cfg.max_norm}")
    if cfg.max_norm == 0:
        cfg = dataclasses.replace(cfg, max_norm=None)
    if cfg.dtype not in DTYPES:
        raise ShardkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.schedule not in SCHEDULES:
        raise ShardkitError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    cfg = _resolve_world(cfg)
    if cfg.model_path is not None:
        if cfg.model == "conv-ae":
            raise ShardkitError("--model-path loads causal LMs; --model conv-ae is built from its own config")
        from .pretrained import read_config

        cfg = dataclasses.replace(cfg, model=FAMILY_MODELS[read_config(cfg.model_path).model_type])
    if cfg.model == "conv-ae":
        _validate_conv_ae(cfg)
        cfg = dataclasses.replace(cfg, sequence_parallel=False)
    else:
        cfg = _validate_lm(cfg)
    parallel_dims(cfg)  # the mesh's own checks (ep borrowing, pp_tp), before launch
    return cfg


def _resolve_world(cfg: TrainConfig) -> TrainConfig:
    """nproc and dp_replicate from each other (one of them may be unset)."""
    ranks = _model_ranks(cfg)
    dims = (
        f"pp_tp={cfg.pp_tp} (sum {ranks})"
        if cfg.pp_tp is not None
        else f"pp={cfg.pp} x cp={cfg.cp_size} x tp={cfg.tp} x spatial={cfg.spatial_h * cfg.spatial} "
        f"x dp_shard={cfg.dp_shard} = {ranks}"
    )
    if cfg.dp_replicate is None:
        nproc = cfg.nproc if cfg.nproc is not None else max(4, ranks) if cfg.model != "conv-ae" else ranks
        if nproc % ranks:
            raise ShardkitError(f"layout {dims} ranks must divide --nproc {nproc} (dp_replicate = nproc // that)")
        cfg = dataclasses.replace(cfg, nproc=nproc, dp_replicate=nproc // ranks)
    nproc = cfg.dp_replicate * ranks
    if cfg.nproc is not None and cfg.nproc != nproc:
        raise ShardkitError(
            f"layout {dims} x dp_replicate={cfg.dp_replicate} = {nproc} ranks, but --nproc is {cfg.nproc}"
        )
    cfg = dataclasses.replace(cfg, nproc=nproc)
    dp = cfg.dp_replicate * cfg.dp_shard
    if cfg.batch_size % (dp * cfg.microbatches):
        what = f"dp={dp} x microbatches={cfg.microbatches}" if cfg.microbatches > 1 else f"dp={dp}"
        raise ShardkitError(f"--batch-size {cfg.batch_size} (global) must be divisible by {what}")
    return cfg


def parallel_dims(cfg: TrainConfig) -> ParallelDims:
    """The :class:`~shardkit.ParallelDims` of a validated configuration (pure).

    Raises:
        ShardkitError: from ParallelDims (e.g. ``ep`` not dividing the ranks it borrows).
    """
    pp_tp = parse_pp_tp(cfg.pp_tp) if cfg.pp_tp is not None else None
    return ParallelDims(
        dp_replicate=cfg.dp_replicate,
        dp_shard=cfg.dp_shard,
        pp=cfg.pp,
        cp_ring=cfg.cp_ring,
        cp_ulysses=cfg.cp_ulysses,
        spatial_h=cfg.spatial_h,
        spatial=cfg.spatial,
        tp=1 if pp_tp else cfg.tp,
        ep=cfg.ep,
        pp_tp=pp_tp,
        world_size=cfg.nproc,
    )


def _validate_conv_ae(cfg: TrainConfig) -> None:
    """``--model conv-ae``: spatial (W, or H x W tiles) x dp (data-parallel replicas or FSDP2) only."""
    from .conv_ae import CROP, MIN_LOCAL_WIDTH

    given = [
        f"--{name.replace('_', '-')} {getattr(cfg, name)}"
        for name in ("tp", "pp", "cp_ring", "cp_ulysses", "ep")
        if getattr(cfg, name) != 1
    ]
    if given or cfg.pp_tp is not None or cfg.loss_parallel or cfg.packed:
        raise ShardkitError(
            f"{', '.join(given) or 'the LM options'} with --model conv-ae: a convolutional model has "
            "no heads, experts, sequence or vocabulary to shard (it composes --spatial / --spatial-h with dp)"
        )
    for flag, ranks, length, what in (
        ("--spatial", cfg.spatial, CROP[1], "columns"),
        ("--spatial-h", cfg.spatial_h, CROP[0], "rows"),
    ):
        if ranks > length // MIN_LOCAL_WIDTH:
            raise ShardkitError(
                f"{flag} {ranks}: the {length}-{what[:-1]} crops give each rank fewer than "
                f"{MIN_LOCAL_WIDTH} {what} (at most {flag} {length // MIN_LOCAL_WIDTH})"
            )


def _validate_lm(cfg: TrainConfig) -> TrainConfig:
    """Options of the causal LMs: their real limits, checked against the model's shape."""
    if cfg.spatial != 1 or cfg.spatial_h != 1:
        flag = f"--spatial {cfg.spatial}" if cfg.spatial != 1 else f"--spatial-h {cfg.spatial_h}"
        raise ShardkitError(f"{flag} needs --model conv-ae (language models use --tp/--cp-*/--pp/--dp*)")
    if cfg.seq_len < 2:
        raise ShardkitError(f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {cfg.seq_len}")
    if cfg.ep > 1 and cfg.model not in MOE_MODELS:
        raise ShardkitError(f"--ep {cfg.ep} needs a mixture-of-experts model (--model {' or '.join(MOE_MODELS)})")
    if cfg.experts < 1:
        raise ShardkitError(f"--experts must be >= 1, got {cfg.experts}")
    if cfg.model_path is not None and cfg.packed:
        # document borders are known in bytes of the corpus files, not in the tokenizer's tokens
        raise ShardkitError("--packed with --model-path: packed documents are built for byte-level tokens")
    dense = cfg.model in ("llama", "qwen2", "qwen3")
    if cfg.sequence_parallel is None:
        cfg = dataclasses.replace(cfg, sequence_parallel=dense and cfg.tp > 1 and cfg.pp_tp is None)
    if cfg.sequence_parallel and cfg.pp_tp is not None:
        raise ShardkitError(
            "--sequence-parallel with --pp-tp: stages of different tp sizes exchange replicated hidden states"
        )
    if cfg.packed and cfg.cp_size > 1 and cfg.batch_size != cfg.dp_replicate * cfg.dp_shard * cfg.microbatches:
        raise ShardkitError(
            f"--packed with context parallelism: every microbatch must be one row (its documents' cu_seqlens are "
            f"per row), so --batch-size must equal dp x microbatches = "
            f"{cfg.dp_replicate * cfg.dp_shard * cfg.microbatches}, got {cfg.batch_size}"
        )
    if cfg.cp_size > 1:
        _validate_cp_tokens(cfg)
    _validate_model(cfg)
    return cfg


def _validate_cp_tokens(cfg: TrainConfig) -> None:
    import torch

    from ..context_parallel._sizes import _order

    # shard_batch's split: the zigzag ring parts of S (Ulysses alone: one part), each split
    # over the Ulysses ranks. HF layers cannot run on zero tokens, so every rank needs one: the
    # rule shard_batch enforces per batch, checked here before any process starts.
    flags = f"--cp-ring {cfg.cp_ring} --cp-ulysses {cfg.cp_ulysses}"
    smallest = min(_order((0, cfg.seq_len), cfg.cp_ring, torch.device("cpu")).sizes)
    if smallest < cfg.cp_ulysses:
        raise ShardkitError(
            f"--seq-len {cfg.seq_len} with {flags}: every cp rank needs at least one token "
            f"(the smallest ring part has {smallest} tokens for {cfg.cp_ulysses} Ulysses rank(s))"
        )


def _validate_model(cfg: TrainConfig) -> None:
    """Head counts, layers and vocabulary of the model against the layout."""
    from ..pipeline_parallel import check_pp

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
            tie_word_embeddings=False,
        )  # build_model unties
    else:
        from .pretrained import read_config

        model_config = read_config(cfg.model_path)
    n_q = model_config.num_attention_heads
    n_kv = getattr(model_config, "num_key_value_heads", None) or n_q
    for s, t in enumerate(cfg.stage_tp_sizes):
        flag = f"--pp-tp {cfg.pp_tp} (stage {s})" if cfg.pp_tp is not None else f"--tp {t}"
        if t > n_q:
            raise ShardkitError(f"{flag}: {n_q} attention heads cannot be split over {t} ranks (whole heads per rank)")
        if t > 1 and cfg.cp_size > 1 and (n_q % t or n_kv % t):
            # the cp attention gets the same number of heads on every tp rank
            raise ShardkitError(
                f"{flag} with context parallelism: tp must divide num_attention_heads={n_q} and "
                f"num_key_value_heads={n_kv} (whole query and key/value heads per rank)"
            )
    try:
        check_pp(model_config, cfg.pp)
    except ShardkitError as e:
        raise ShardkitError(f"--pp {cfg.pp}: {e}") from None
