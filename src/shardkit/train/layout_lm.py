"""The decoder LMs' rules that need only the options, checked without torch.

:func:`check_lm_options` is the part of :func:`.lm_spec.validate_lm` that reads no model file
and no torch registry: the names of ``--ac`` and ``--mixed-precision`` and their combinations with
``--compile``, ``--checks`` and ``--dtype``, the sequence length, expert parallelism of a dense
model, ``--packed``'s limits, sequence parallelism across stages of different tp sizes and a token
for every cp rank. :func:`.layout.check_options` calls it before ``import torch`` (issue 32), and
``validate_lm`` calls it again for the callers of the library API (the checks are pure and
idempotent). What stays after torch: the compile backend's name (torch's Dynamo registry) and a
``--model-path`` checkpoint's config (transformers).
"""

from __future__ import annotations

import math

from .._rules import (
    ac_rule,
    cp_tokens_rule,
    ep_rule,
    lm_spatial_rule,
    seq_len_rule,
    sequence_parallel_default,
    sp_pp_tp_rule,
)
from ..errors import ShardkitError
from .model_names import model_facts
from .options import AC_MODES, CP_LAYOUTS, MIXED_PRECISION, MOE_DROP_POLICIES, TrainConfig

__all__ = ["check_lm_options", "check_precision", "check_moe_balance", "check_zero"]


def _raise(why: str | None) -> None:
    if why is not None:
        raise ShardkitError(why)


def check_precision(cfg: TrainConfig) -> None:
    """``--mixed-precision`` one of :data:`.options.MIXED_PRECISION`, and only on float32 masters.

    Raises:
        ShardkitError: an unknown mode (a TOML file bypasses the flag's choices), or bf16 compute
            with a ``--dtype`` other than float32.
    """
    if cfg.mixed_precision not in MIXED_PRECISION:
        raise ShardkitError(
            f"--mixed-precision: mixed precision must be one of {', '.join(MIXED_PRECISION)}; "
            f"got {cfg.mixed_precision!r}"
        )
    if cfg.mixed_precision != "none" and cfg.dtype != "float32":
        raise ShardkitError(
            f"--mixed-precision {cfg.mixed_precision} keeps float32 master parameters and computes in bfloat16: "
            f"it needs --dtype float32, got --dtype {cfg.dtype}"
        )


def check_moe_balance(cfg: TrainConfig, experts: bool | None) -> None:
    """The ``--moe-*`` balancing flags: finite values >= 0, an MoE model, and the layouts they support.

    The sequence-wise loss multiplies two sums over each whole sequence, so it needs every
    sequence on one rank: no context parallelism, no sequence parallelism (which cuts the
    sequence over tp). ``--compile`` traces the router, whose step counters are Python state.

    Raises:
        ShardkitError: naming the flag at fault.
    """
    flags = {
        "--moe-bias-update-rate": cfg.moe_bias_update_rate,
        "--moe-z-loss": cfg.moe_z_loss,
        "--moe-seq-aux-loss": cfg.moe_seq_aux_loss,
    }
    given = [flag for flag, value in flags.items() if value is not None and (value != 0 or "bias" in flag)]
    for flag, value in flags.items():
        if value is not None and (isinstance(value, bool) or not (math.isfinite(value) and value >= 0)):
            raise ShardkitError(f"{flag} must be a finite number >= 0, got {value!r}")
    given += _capacity_flags(cfg)
    if not given:
        return
    if experts is False:
        raise ShardkitError(
            f"{', '.join(given)}: {cfg.model!r} has no routed experts (use --model moe or mla, or an MoE checkpoint)"
        )
    if cfg.compile:
        raise ShardkitError(f"{', '.join(given)} with --compile: the balanced router is not traced yet; drop --compile")
    if cfg.save_hf is not None and cfg.moe_bias_update_rate is not None:
        # the bias is a trainer-side buffer that picks the experts; transformers' Qwen3-MoE and
        # DeepSeek-V2 routers (every MoE family shardkit trains) have no slot for it, so the
        # exported model would route without it: other logits, silently
        raise ShardkitError(
            "--save-hf with --moe-bias-update-rate: the router bias the run learns (e_score_correction_bias, "
            "added to the scores that pick the experts) has no slot in transformers' Qwen3-MoE / DeepSeek-V2 "
            "routers, so the exported model would pick other experts; train without --moe-bias-update-rate "
            "to export, or drop --save-hf"
        )
    if cfg.moe_seq_aux_loss and (cfg.cp_size > 1 or cfg.sequence_parallel):
        why = "context parallelism" if cfg.cp_size > 1 else "sequence parallelism"
        raise ShardkitError(
            f"--moe-seq-aux-loss with {why}: the sequence-wise balance loss needs every sequence whole on one "
            "rank (it multiplies two sums over the sequence); use --moe-z-loss / --moe-bias-update-rate, or "
            "--no-sequence-parallel / no cp"
        )


def _capacity_flags(cfg: TrainConfig) -> list[str]:
    """The capacity flags given (checked); ``--packed`` with cp refused: the ``--verify`` reference
    cuts its token groups by the plain cp layout, not each document's."""
    factor, policy = cfg.moe_capacity_factor, cfg.moe_drop_policy
    if factor is not None and (isinstance(factor, bool) or not (math.isfinite(factor) and factor > 0)):
        raise ShardkitError(f"--moe-capacity-factor must be a finite number > 0, got {factor!r}")
    if policy not in MOE_DROP_POLICIES:
        raise ShardkitError(f"--moe-drop-policy must be one of {', '.join(MOE_DROP_POLICIES)}, got {policy!r}")
    if cfg.moe_pad_to_capacity and factor is None:
        raise ShardkitError("--moe-pad-to-capacity needs --moe-capacity-factor (dropless routing has no capacity)")
    if factor is None:
        return []
    if cfg.packed and cfg.cp_size > 1:
        raise ShardkitError(
            "--moe-capacity-factor with --packed and context parallelism: each rank's token group follows every "
            "document's cp layout, which the --verify reference does not cut yet; drop --packed or cp"
        )
    return ["--moe-capacity-factor"]


def check_lm_options(cfg: TrainConfig, experts: bool | None) -> None:
    """Raise the first refusal of the decoder LMs' option rules (module docstring).

    Args:
        cfg: a configuration with ``tp``, ``dp_replicate`` and ``nproc`` resolved
            (:func:`.layout.check_options`).
        experts: the model has routed experts; None when a ``--model-path`` checkpoint decides
            the family (its config is read after torch, so the ``--ep`` rule waits for it).

    Raises:
        ShardkitError: naming the flags at fault.
    """
    _raise(lm_spatial_rule(cfg.spatial, cfg.spatial_h))
    if ac_rule(cfg.ac) is not None:
        raise ShardkitError(
            f"--ac: activation checkpointing must be one of {', '.join(AC_MODES)} or selective:N; got {cfg.ac!r}"
        )
    if cfg.compile and cfg.ac == "selective":
        # torch's selective-AC dispatch modes keep torch.compile out of the block (parallelize/compiling.py)
        raise ShardkitError(
            f"--compile {cfg.compile!r} with selective activation checkpointing: its dispatch modes keep "
            "torch.compile out of the block (nothing would be compiled); use full or no activation checkpointing"
        )
    if cfg.sp_activation not in (None, "shard", "gathered"):
        raise ShardkitError(f"--sp-activation must be shard or gathered, got {cfg.sp_activation!r}")
    if cfg.compile and cfg.sp_activation == "shard":
        raise ShardkitError("--compile with --sp-activation shard: the regather's state is not traced; use gathered")
    if cfg.compile and cfg.mixed_precision != "none":
        raise ShardkitError(f"--compile with --mixed-precision {cfg.mixed_precision}: not supported together yet")
    if cfg.ac == "selective" and cfg.checks:
        raise ShardkitError("--ac selective with --checks: the check mode changes the recomputed ops; use --ac full")
    _raise(seq_len_rule(cfg.seq_len))
    if experts is not None:
        _raise(ep_rule(cfg.ep, cfg.experts if experts else 0))
    if cfg.experts < 1:
        raise ShardkitError(f"--experts must be >= 1, got {cfg.experts}")
    check_moe_balance(cfg, experts)
    if (cfg.model_path is not None or cfg.tokenizer is not None) and cfg.packed:
        # document borders are known in bytes of the corpus files, not in the tokenizer's tokens
        flag = "--model-path" if cfg.model_path is not None else "--tokenizer"
        raise ShardkitError(f"--packed with {flag}: packed documents are built for byte-level tokens")
    assert cfg.tp is not None and cfg.dp_replicate is not None  # check_options resolved them
    pp_tp = cfg.stage_tp_sizes if cfg.pp_tp is not None else None
    sp = cfg.sequence_parallel
    if sp is None:  # the default cannot break the rule (off with pp_tp); an MoE default is off too
        sp = sequence_parallel_default(bool(experts), cfg.tp, pp_tp)
    _raise(sp_pp_tp_rule(bool(sp), pp_tp))
    if cfg.async_tp and (cfg.tp <= 1 or not sp):
        raise ShardkitError(
            f"--async-tp needs sequence parallelism over --tp > 1 (got --tp {cfg.tp}, sequence parallelism "
            f"{'on' if sp else 'off'}): it decomposes SP's all-gathers and reduce-scatters into ring steps"
        )
    if cfg.async_tp and cfg.compile:
        raise ShardkitError("--async-tp with --compile: the rings' state is not traced; use one of them")
    dp = cfg.dp_replicate * cfg.dp_shard
    if cfg.packed and cfg.cp_size > 1 and cfg.batch_size != dp * cfg.microbatches:
        raise ShardkitError(
            f"--packed with context parallelism: every microbatch must be one row (its documents' cu_seqlens are "
            f"per row), so --batch-size must equal dp x microbatches = {dp * cfg.microbatches}, got {cfg.batch_size}"
        )
    _raise(cp_tokens_rule(cfg.seq_len, cfg.cp_ring, cfg.cp_ulysses))
    if cfg.cp_layout not in CP_LAYOUTS:
        raise ShardkitError(f"--cp-layout must be one of {CP_LAYOUTS}, got {cfg.cp_layout!r}")
    if cfg.cp_layout != "zigzag" and (
        cfg.cp_ring < 2 or cfg.cp_ulysses > 1 or (cfg.packed and cfg.cp_layout == "stripe")
    ):
        raise ShardkitError(
            f"--cp-layout {cfg.cp_layout}: places the tokens of ring cp alone (--cp-ring > 1, --cp-ulysses 1; "
            f"stripe without --packed), got --cp-ring {cfg.cp_ring} --cp-ulysses {cfg.cp_ulysses} --packed {cfg.packed}"
        )


def check_zero(cfg: TrainConfig) -> None:
    """``--zero``: 0, 1 or 2, and not over FSDP2 ranks (pure).

    ZeRO shards the optimizer state (and gradients) over ``dp_replicate x cp``; with
    ``--dp-shard > 1`` FSDP2 already shards parameters, gradients and state there (ZeRO-3), and
    HSDP's replicas all-reduce inside FSDP2, so the two are not stacked: refused, with the layout
    to use instead. The conv autoencoder's layouts are spatial x dp without ZeRO.

    Raises:
        ShardkitError: naming the options at fault.
    """
    if isinstance(cfg.zero, bool) or cfg.zero not in (0, 1, 2):
        raise ShardkitError(f"--zero must be 0 (off), 1 (optimizer state) or 2 (and gradients), got {cfg.zero!r}")
    if not cfg.zero:
        return
    if cfg.dp_shard > 1:
        raise ShardkitError(
            f"--zero {cfg.zero} with --dp-shard {cfg.dp_shard}: FSDP2 already shards parameters, gradients and "
            "optimizer state over dp_shard (ZeRO-3); use --zero over --dp-replicate (x cp) with --dp-shard 1"
        )
    if not model_facts(cfg.model).decoder:
        raise ShardkitError(f"--zero {cfg.zero} with --model {cfg.model}: ZeRO is built for the decoder LMs")
