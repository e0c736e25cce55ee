"""The decoder LMs' hooks of the spec registry (:mod:`.specs`): rules, model, task, parallelize.

One set of hooks serves every decoder family (the built-in configs of :mod:`.lm_families` and
``--model-path`` checkpoints): the families differ only in their :class:`.lm_families.LMFamily`,
which the hooks take as an argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..errors import ShardkitError
from ..parallelize import ParallelModel, parallelize, parallelize_stage
from ..parallelize.compiling import check_compile
from ..plan.rules import sequence_parallel_default
from .attention import mask_free_sdpa
from .corpus import Corpus, shared_corpus
from .data import BatchSampler, HeldOutBatches, held_out_start
from .layout import SHAPE_FLAGS, check_model_shape
from .layout_lm import check_lm_options
from .lm_families import LMFamily
from .lm_task import LMTask, PackedSampler
from .model import build_model
from .moe_balance import expert_capacity_options, install_moe_balance
from .options import TrainConfig
from .pretrained import read_config
from .trainer import LossScale

__all__ = ["validate_lm", "build_lm", "lm_task", "parallelize_lm", "describe_lm"]

_HF_SIZES = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "moe_intermediate_size",
    "num_experts",
    "n_routed_experts",
)


def validate_lm(cfg: TrainConfig, family: LMFamily) -> TrainConfig:
    """The decoder LMs' real limits (:mod:`shardkit.plan.rules`), against the model's shape;
    ``sequence_parallel`` resolved (None: :func:`~shardkit.plan.rules.sequence_parallel_default`).

    Raises:
        ShardkitError: naming the flags at fault.
    """
    # the rules of the options alone, which the launcher ran before import torch (layout_lm.py);
    # again here for the library's callers of validate_config / spec.validate
    check_lm_options(cfg, family.experts)
    check_compile(cfg.compile or False, "--compile", cfg.ac)  # the backend's name: torch's Dynamo registry
    assert cfg.tp is not None
    pp_tp = cfg.stage_tp_sizes if cfg.pp_tp is not None else None
    if cfg.sequence_parallel is None:
        cfg = dataclasses.replace(cfg, sequence_parallel=sequence_parallel_default(family.experts, cfg.tp, pp_tp))
    _validate_shape(cfg)
    _validate_variants(cfg, family)
    return cfg


def _has_sliding_window(config) -> bool:
    """Some layer of a transformers config (or a family's config dict) attends through a window."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    types = get("layer_types")
    if types is not None:
        return "sliding_attention" in types
    return get("sliding_window") is not None and get("use_sliding_window", True) is not False


def _validate_variants(cfg: TrainConfig, family: LMFamily) -> None:
    """What a model's attention variants (sliding window, Gemma 2's softcap) rule out, before launch.

    * ``--cp-layout stripe`` with a sliding window: a window is a band of global positions, which
      the stripe layout's rank-interleaved tokens do not keep in blocks (ring attention refuses it).
    * ``--packed`` on Gemma 2: without cp the trainer hands packed rows a boolean block-causal
      mask, which Gemma 2's eager attention would add to the scores as numbers and which would
      replace the per-layer sliding-window mask (and with cp that run is the ``--verify`` reference).
    """
    if cfg.cp_layout != "stripe" or cfg.cp_size == 1:
        windowed = False
    elif cfg.model_path is not None:
        windowed = _has_sliding_window(read_config(cfg.model_path))
    else:  # the family's own keys (not family.config: that would load a --tokenizer for its vocabulary)
        windowed = _has_sliding_window(family.extras(cfg))
    if windowed:
        raise ShardkitError(
            "--cp-layout stripe: the model has a sliding window (a band of global positions), which the stripe "
            "layout's interleaved tokens cannot keep; use --cp-layout zigzag or contiguous"
        )
    if cfg.packed and family.model_type == "gemma2":
        raise ShardkitError(
            "--packed with --model gemma2: packed rows get a boolean block-causal mask, which Gemma 2's eager "
            "attention cannot take (it adds masks as numbers) and which would drop its sliding window; train "
            "unpacked windows"
        )


def _validate_shape(cfg: TrainConfig) -> None:
    """A checkpoint's head counts and layers against the layout (the built-in model's, from the
    flags, were checked by :func:`.layout.check_options`, before import torch)."""
    if cfg.model_path is None:
        return
    config = read_config(cfg.model_path)
    n_q = config.num_attention_heads
    check_model_shape(cfg, n_q, getattr(config, "num_key_value_heads", None) or n_q, config.num_hidden_layers)


def build_lm(cfg: TrainConfig, family: LMFamily) -> nn.Module:
    """:func:`.model.build_model`: the checkpoint of ``--model-path``, else ``family`` at the flags' sizes."""
    return build_model(cfg, family)


def lm_task(cfg: TrainConfig, device: torch.device, corpus: Corpus | None = None) -> LMTask:
    """The next-token task with a fresh sampler (the same batches on every rank).

    ``corpus``: the token stream; None: read it with :func:`.corpus.shared_corpus`, collective
    over the world (global rank 0 reads, every rank receives the same tokens). With
    ``--eval-every``, the stream's held-out tail (:func:`.data.held_out_start`) gives the
    validation batches and training draws from the rest only.
    """
    if corpus is None:
        corpus = shared_corpus(cfg, device)
    tokens, docs, held_out = corpus.tokens, list(corpus.doc_sizes), None
    if cfg.eval_every:  # the held-out tail is never trained on
        start = held_out_start(tokens.numel(), cfg.seq_len)
        held_out = HeldOutBatches(tokens[start:], cfg.seq_len, cfg.batch_size, cfg.eval_batches)
        tokens, docs = tokens[:start], _cut_documents(docs, start)
    sampler: PackedSampler | BatchSampler
    if cfg.packed:
        sampler = PackedSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed, docs)
    else:
        sampler = BatchSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
    return LMTask(sampler, device, held_out)


def _cut_documents(sizes: list[int], end: int) -> list[int]:
    """Document sizes of the stream's first ``end`` tokens (the last one cut at ``end``)."""
    out, total = [], 0
    for size in sizes:
        if total >= end:
            break
        out.append(min(size, end - total))
        total += out[-1]
    return out


def parallelize_lm(model: nn.Module, mesh, cfg: TrainConfig, task) -> tuple[ParallelModel, LossScale | None]:
    """:func:`~shardkit.parallelize.parallelize` (or ``parallelize_stage`` with ``pp > 1``) for
    ``cfg``'s options; the pipeline's loss function with a pipeline, else None."""
    # validate_config resolved sequence_parallel; one process (mesh None) has neither option
    sp, lp = (bool(cfg.sequence_parallel), cfg.loss_parallel) if mesh is not None else (False, False)
    # the --verify reference (mesh None) keeps every activation: --verify checks AC against plain autograd;
    # it computes in the same mixed precision (parallelize casts with mesh None too)
    ac = cfg.ac if mesh is not None else "none"
    compile = (cfg.compile or False) if mesh is not None else False  # ... and compiled blocks against eager
    # the trainer divides every rank's loss by the global token count itself: sum, not DDP's mean
    options: dict[str, Any] = dict(
        sequence_parallel=sp,
        loss_parallel=lp,
        grad_reduce="sum",
        activation_checkpoint=ac,
        mixed_precision=cfg.mixed_precision,
        compile=compile,
        zero=cfg.zero if mesh is not None else 0,  # the --verify reference: plain AdamW
        cp_layout=cfg.cp_layout,
        sp_activation=cfg.sp_activation if sp else None,
        async_tp=cfg.async_tp and sp,  # the --verify reference (sp False) runs the plain model
        expert_capacity=expert_capacity_options(cfg),
    )
    # before any transform (none touches the routers), for the parallel run and the reference alike
    install_moe_balance(model, cfg, reference=mesh is None)
    if cfg.cp_size == 1:  # no causal-mask builder, no device read per forward (cp has its own attention)
        mask_free_sdpa(model)
    if mesh is not None and mesh.dims.pp > 1:
        loss = LossScale(task)
        pm = parallelize_stage(model, mesh, loss, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, **options)
        loss.bind(pm)
        return pm, loss
    pm = parallelize(model, mesh, **options)
    return pm, None


def describe_lm(cfg: TrainConfig, family: LMFamily) -> dict:
    """What fixes the parameters beyond ``model`` and ``dtype``: the checkpoint's config sizes,
    else the flags' sizes (and the experts of an MoE family)."""
    if cfg.model_path is not None:
        config = read_config(cfg.model_path)
        return {
            "config": {k: getattr(config, k) for k in _HF_SIZES if isinstance(getattr(config, k, None), (int, str))}
        }
    out = {k: getattr(cfg, k) for k in SHAPE_FLAGS}
    if family.experts:
        out["experts"] = cfg.experts
    return out
