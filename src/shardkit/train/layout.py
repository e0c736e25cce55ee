"""The options of ``shardkit train`` checked on their own, and the world's arithmetic, without torch.

:func:`check_options` is the first half of :func:`.config.validate_config`: every rule that
needs only the options and :mod:`.model_names`' facts of the model (sizes and counts, the
learning rate, seed and timeout, the checkpoint flags, the output folders, ``--nproc`` against
the product of the degrees, the global batch against dp x microbatches). It imports neither
torch nor the library's packages, so ``shardkit train`` refuses such input before
``import torch`` (issue 32), and so are the pipeline schedule's table rules and the decoder LMs'
option rules (:mod:`.layout_lm`). The second half (a checkpoint's config, the compile backend,
the conv model's rules, the mesh) reads the library and stays in :mod:`.config`.
"""

from __future__ import annotations

import dataclasses
import math

from .._files import check_out_dir
from .._rules import batch_rule, pp_layers_rule, pp_tp_chunks_rule, schedule_rule, stage_heads_rule
from ..errors import ShardkitError
from .config_file import check_output_dirs, check_writable
from .layout_lm import check_lm_options, check_moe_balance, check_precision, check_zero
from .loggers import check_loggers
from .model_names import model_facts
from .options import DTYPES, FINETUNE_LR, LR_SCHEDULES, SCHEDULES, SIZE_FLAGS, TrainConfig, parse_pp_tp
from .profile_rules import check_profile_options

__all__ = [
    "check_options",
    "check_model_shape",
    "MAX_SIZE",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "COUNT_FLAGS",
]

MAX_SIZE = 2**31 - 1  # any size or count flag: beyond it no tensor dimension or rank count is meaningful
MAX_SEED = 2**63 - 1  # torch's generators take a 64-bit seed; shardkit keeps it a non-negative int64
MAX_TIMEOUT_S = 86400  # --timeout: a collective that waits a day for a rank is a hang, not a slow step
# --timeout: starting a process group takes about 1 s here (forkserver, torch preloaded; 4-10 s with
# spawn): below it every launch fails with the backend's raw "Wait timeout" before the first step
MIN_TIMEOUT_S = 1.0
# step counts and other counts: bounded like the sizes (an int32 count; beyond it no run ends)
# the built-in decoder's size flags (each >= 1)
SHAPE_FLAGS = ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size")
COUNT_FLAGS = ("steps", "save_every", "keep", "eval_every", "eval_batches", "log_every", "skip_nonfinite")


def _default_tp(cfg: TrainConfig) -> int:
    if cfg.tp is not None:
        return cfg.tp
    plain = cfg.pp == 1 and cfg.cp_size == 1 and cfg.pp_tp is None
    return model_facts(cfg.model).default_tp if plain else 1


def _model_ranks(cfg: TrainConfig) -> int:
    """Ranks of one data-parallel replica (every degree but dp_replicate)."""
    if cfg.pp_tp is not None:
        return sum(parse_pp_tp(cfg.pp_tp))
    assert cfg.tp is not None  # resolved first (_default_tp)
    return cfg.pp * cfg.cp_size * cfg.tp * cfg.spatial_h * cfg.spatial * cfg.dp_shard


def check_options(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """The checks of :func:`.config.validate_config` that need no library module (no torch); return
    ``cfg`` with ``nproc``, ``dp_replicate``, ``tp``, ``lr`` and ``lr_schedule`` resolved.

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
    model_facts(cfg.model)  # a registered model
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
    tp_given = cfg.tp is not None
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
    for name in (*SIZE_FLAGS, *COUNT_FLAGS):  # a sanity bound; train/limits.py checks what this machine can hold
        if getattr(cfg, name) is not None and getattr(cfg, name) > MAX_SIZE:
            raise ShardkitError(f"--{name.replace('_', '-')} must be <= 2**31 - 1, got {getattr(cfg, name)}")
    lr = cfg.lr if cfg.lr is not None else FINETUNE_LR if cfg.model_path is not None else 1e-3
    if not math.isfinite(lr) or lr <= 0:
        raise ShardkitError(f"--lr must be a finite number > 0, got {lr}")
    cfg = dataclasses.replace(cfg, lr=lr)
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ShardkitError(f"--seed must be in [0, 2**63 - 1], got {cfg.seed}")
    if cfg.skip_nonfinite < 0:
        raise ShardkitError(f"--skip-nonfinite must be >= 0, got {cfg.skip_nonfinite}")
    if not math.isfinite(cfg.timeout) or not MIN_TIMEOUT_S <= cfg.timeout <= MAX_TIMEOUT_S:
        raise ShardkitError(
            f"--timeout must be a finite number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S}], got {cfg.timeout} "
            f"(a process group takes about {MIN_TIMEOUT_S:g} s to start: a shorter timeout fails every launch)"
        )
    if cfg.lr_schedule is None:
        cfg = dataclasses.replace(cfg, lr_schedule="warmup-cosine" if cfg.model_path is not None else "constant")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ShardkitError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {cfg.lr_schedule!r}")
    if cfg.eval_every < 0 or cfg.eval_batches < 1:
        raise ShardkitError(
            f"--eval-every must be >= 0 (0: no validation) and --eval-batches >= 1, got {cfg.eval_every} "
            f"and {cfg.eval_batches}"
        )
    if cfg.eval_every and not model_facts(cfg.model).reads_corpus:
        raise ShardkitError(
            f"--eval-every: --model {cfg.model} trains on no text corpus, so there is no held-out split"
        )
    if cfg.log_every is not None and cfg.log_every < 1:
        raise ShardkitError(f"--log-every must be >= 1 (steps between log lines), got {cfg.log_every}")
    if cfg.save_every < 0:
        raise ShardkitError(f"--save-every must be >= 0, got {cfg.save_every}")
    if cfg.resume and cfg.resume_from is not None:
        raise ShardkitError(
            f"--resume and --resume-from {cfg.resume_from!r}: give one (--resume: the latest save in "
            "--checkpoint-dir; --resume-from: that save)"
        )
    if cfg.resume_from is not None and not cfg.resume_from.strip():
        raise ShardkitError("--resume-from: give a checkpoint directory or one save's directory")
    if (cfg.resume or cfg.save_every or cfg.async_checkpoint) and cfg.checkpoint_dir is None:
        raise ShardkitError("--resume, --save-every and --async-checkpoint need --checkpoint-dir DIR")
    if cfg.keep is not None and (cfg.keep < 1 or cfg.checkpoint_dir is None):
        raise ShardkitError(f"--keep must be >= 1 (complete saves kept) and needs --checkpoint-dir, got {cfg.keep}")
    check_output_dirs(cfg)
    check_loggers(cfg.wandb)  # a bad project name or no wandb package: here, not on rank 0 alone
    check_profile_options(cfg, world_size)
    if cfg.save_hf is not None:
        if not model_facts(cfg.model).decoder:
            raise ShardkitError(f"--save-hf: --model {cfg.model} has no Hugging Face form")
        check_out_dir(cfg.save_hf, "--save-hf")
        check_writable("--save-hf", cfg.save_hf)
    check_zero(cfg)
    if cfg.max_norm is not None and not (math.isfinite(cfg.max_norm) and cfg.max_norm >= 0):
        raise ShardkitError(f"--max-norm must be a finite number >= 0 (0: no clipping), got {cfg.max_norm}")
    if cfg.max_norm == 0:
        cfg = dataclasses.replace(cfg, max_norm=None)
    if cfg.dtype not in DTYPES:
        raise ShardkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.schedule not in SCHEDULES:
        raise ShardkitError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.tokenizer is not None and cfg.model_path is not None:
        raise ShardkitError("--tokenizer with --model-path: the checkpoint encodes --data with its own tokenizer")
    if cfg.tokenizer is not None and not model_facts(cfg.model).reads_corpus:
        raise ShardkitError(f"--tokenizer with --model {cfg.model}: this model reads no text corpus")
    _check_pipeline_flags(cfg)
    cfg = _resolve_world(cfg, tp_given)
    if model_facts(cfg.model).decoder and cfg.model_path is None:  # the built-in model's shape, from the flags
        for name in SHAPE_FLAGS:
            if getattr(cfg, name) < 1:
                raise ShardkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
        if cfg.hidden_size % cfg.heads or cfg.heads % cfg.kv_heads:
            raise ShardkitError(
                f"--hidden-size {cfg.hidden_size} must be divisible by --heads {cfg.heads}, and --heads by "
                f"--kv-heads {cfg.kv_heads}"
            )
        check_model_shape(cfg, cfg.heads, cfg.kv_heads, cfg.layers)
    check_precision(cfg)
    if model_facts(cfg.model).decoder:  # a checkpoint's family (--model-path) decides on experts later
        check_lm_options(cfg, model_facts(cfg.model).experts if cfg.model_path is None else None)
    else:
        check_moe_balance(cfg, False)
    return cfg


def check_model_shape(cfg: TrainConfig, heads: int, kv_heads: int, layers: int) -> None:
    """A decoder's head counts and layers against the layout: whole heads on every tp rank of every
    stage (:func:`~shardkit._rules.stage_heads_rule`), a layer for every stage and chunk. The
    built-in model's come from the flags (:func:`check_options`), a checkpoint's from its config
    (:func:`.lm_spec.validate_lm`).

    Raises:
        ShardkitError: naming the flags at fault.
    """
    for s, t in enumerate(cfg.stage_tp_sizes):
        flag = f"--pp-tp {cfg.pp_tp} (stage {s})" if cfg.pp_tp is not None else f"--tp {t}"
        if (why := stage_heads_rule(heads, kv_heads, t, cfg.cp_size, flag)) is not None:
            raise ShardkitError(why)
    if (why := pp_layers_rule(layers, cfg.pp)) is not None:
        raise ShardkitError(why)
    if cfg.pp * cfg.virtual_stages > layers:
        raise ShardkitError(
            f"--pp {cfg.pp} --virtual-stages {cfg.virtual_stages}: {layers} decoder layers "
            f"cannot fill {cfg.pp * cfg.virtual_stages} chunks (need layers >= pp x virtual stages)"
        )


def _check_pipeline_flags(cfg: TrainConfig) -> None:
    """The schedule rules: ``--virtual-stages`` an int >= 1, chunked schedules only with a pipeline,
    ``--pp-tp`` stages with one chunk each (:func:`~shardkit._rules.pp_tp_chunks_rule`: every
    one-chunk schedule); then the table's own sizes (microbatches, layers per chunk:
    :func:`~shardkit._rules.schedule_rule`, the same rules as the planner's). ``--checks`` runs
    every schedule (the runner reads every message's header and agrees on the table every call)."""
    v, pp = cfg.virtual_stages, len(cfg.stage_tp_sizes) if cfg.pp_tp is not None else cfg.pp
    if not isinstance(v, int) or v < 1:
        raise ShardkitError(f"--virtual-stages must be an int >= 1, got {v!r}")
    simple = v == 1 and cfg.schedule in ("1f1b", "gpipe")
    if pp == 1:
        if not simple:
            raise ShardkitError(f"--schedule {cfg.schedule} --virtual-stages {v} need a pipeline (--pp > 1)")
        return
    if (why := pp_tp_chunks_rule(cfg.pp_tp, cfg.schedule, v)) is not None:
        raise ShardkitError(why)
    # layers against chunks only for v > 1 and the built-in model (one chunk per rank: the pipeline's
    # own layer rule, check_model_shape; a checkpoint's layers are checked when its stages are cut)
    layers = cfg.layers if cfg.model_path is None and v > 1 else pp * v
    if (why := schedule_rule(cfg.schedule, pp, v, cfg.microbatches, layers)) is not None:
        raise ShardkitError(why)


def _tp_hint(cfg: TrainConfig, tp_given: bool, nproc: int) -> str:
    """The way out when the default tp alone does not fit ``nproc`` (``--nproc 1`` of a decoder,
    whose tp defaults to 2): say that tp was not given and that ``--tp 1`` fits."""
    tp = cfg.tp or 1
    if tp_given or tp == 1 or nproc % (_model_ranks(cfg) // tp):
        return ""
    return f" (--tp defaults to {tp} for --model {cfg.model}; add --tp 1 to run on {nproc} process(es))"


def _resolve_world(cfg: TrainConfig, tp_given: bool = True) -> TrainConfig:
    """nproc and dp_replicate from each other (one of them may be unset)."""
    ranks = _model_ranks(cfg)
    dims = (
        f"pp_tp={cfg.pp_tp} (sum {ranks})"
        if cfg.pp_tp is not None
        else f"pp={cfg.pp} x cp={cfg.cp_size} x tp={cfg.tp} x spatial={cfg.spatial_h * cfg.spatial} "
        f"x dp_shard={cfg.dp_shard} = {ranks}"
    )
    if cfg.dp_replicate is None:
        nproc = cfg.nproc if cfg.nproc is not None else max(model_facts(cfg.model).min_nproc, ranks)
        if nproc % ranks:
            raise ShardkitError(
                f"layout {dims} ranks must divide --nproc {nproc} (dp_replicate = nproc // that)"
                + _tp_hint(cfg, tp_given, nproc)
            )
        cfg = dataclasses.replace(cfg, nproc=nproc, dp_replicate=nproc // ranks)
    dp_replicate = cfg.dp_replicate
    assert dp_replicate is not None  # given, or resolved just above
    nproc = dp_replicate * ranks
    if cfg.nproc is not None and cfg.nproc != nproc:
        raise ShardkitError(
            f"layout {dims} x dp_replicate={dp_replicate} = {nproc} ranks, but --nproc is {cfg.nproc}"
            + _tp_hint(cfg, tp_given, cfg.nproc)
        )
    cfg = dataclasses.replace(cfg, nproc=nproc)
    if (why := batch_rule(cfg.batch_size, dp_replicate * cfg.dp_shard, cfg.microbatches)) is not None:
        raise ShardkitError(why)
    return cfg
