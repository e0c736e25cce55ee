"""``--model conv-ae``'s hooks of the spec registry (:mod:`.specs`): rules, model, task, parallelize.

The model, its data and its loss are :mod:`.conv_ae`'s; the layout is spatial (W, or H x W
tiles) x dp, applied by :func:`shardkit.parallelize.parallelize_conv`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from ..errors import ShardkitError
from ..parallelize import ParallelModel, parallelize_conv
from .conv_ae import (
    CROP,
    MIN_LOCAL_WIDTH,
    SPATIAL_DIMS,
    ConvAETask,
    CropSampler,
    build_conv_ae,
    load_image,
    save_reconstruction,
)
from .options import TrainConfig

__all__ = ["validate_conv", "build_conv", "conv_task", "parallelize_conv_ae", "conv_outputs"]


def validate_conv(cfg: TrainConfig) -> TrainConfig:
    """spatial (W, or H x W tiles) x dp (data-parallel replicas or FSDP2) only, with at least
    :data:`.conv_ae.MIN_LOCAL_WIDTH` columns (rows) of the crop per rank; no sequence parallelism.

    Raises:
        ShardkitError: an LM option, or more spatial ranks than the crop has room for.
    """
    if cfg.model_path is not None:
        raise ShardkitError("--model-path loads causal LMs; --model conv-ae is built from its own config")
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
    if cfg.mixed_precision != "none":
        raise ShardkitError(
            f"--mixed-precision {cfg.mixed_precision} with --model conv-ae: mixed precision casts decoder blocks"
        )
    if cfg.ac != "none":
        raise ShardkitError(f"--ac {cfg.ac} with --model conv-ae: activation checkpointing wraps decoder blocks")
    if cfg.compile is not None:
        raise ShardkitError(f"--compile {cfg.compile} with --model conv-ae: compiling wraps decoder blocks")
    for flag, ranks, length, what in (
        ("--spatial", cfg.spatial, CROP[1], "columns"),
        ("--spatial-h", cfg.spatial_h, CROP[0], "rows"),
    ):
        if ranks > length // MIN_LOCAL_WIDTH:
            raise ShardkitError(
                f"{flag} {ranks}: the {length}-{what[:-1]} crops give each rank fewer than "
                f"{MIN_LOCAL_WIDTH} {what} (at most {flag} {length // MIN_LOCAL_WIDTH})"
            )
    return dataclasses.replace(cfg, sequence_parallel=False)


def build_conv(cfg: TrainConfig) -> nn.Module:
    """The unsharded autoencoder (the same weights on every rank: ``cfg.seed``)."""
    return build_conv_ae(cfg.dtype, cfg.seed)


def conv_task(cfg: TrainConfig, device: torch.device, corpus=None) -> ConvAETask:
    """Random crops of the sample photo (``corpus`` unused: there is no text)."""
    return ConvAETask(CropSampler(load_image(), CROP, cfg.batch_size, cfg.seed), device, getattr(torch, cfg.dtype))


def parallelize_conv_ae(model: nn.Module, mesh, cfg: TrainConfig, task) -> tuple[ParallelModel, None]:
    """:func:`~shardkit.parallelize.parallelize_conv` over the crops' H and W dims; no pipeline loss."""
    # the trainer divides the loss by the global element count itself: sum, not DDP's mean
    return parallelize_conv(model, mesh, SPATIAL_DIMS, grad_reduce="sum"), None


def conv_outputs(cfg: TrainConfig, folder: str, full_params: dict) -> list[str]:
    """``reconstruction.png`` of the fixed eval crops by the trained (full) model, in ``folder``."""
    model = build_conv_ae(cfg.dtype, cfg.seed)
    model.load_state_dict(full_params)
    path = os.path.join(folder, "reconstruction.png")
    save_reconstruction(model, path)
    return [path]
