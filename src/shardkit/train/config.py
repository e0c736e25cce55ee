"""Configuration of ``shardkit train``: defaults < TOML file < command-line flags, then checks.

Everything here is pure (no process group), so every check runs in the launching process
*before* any worker starts: a bad layout fails in well under a second with one message. The
options themselves are :class:`.options.TrainConfig`; the rules of one model are its spec's
(:mod:`.specs`), and the decoder LMs' layout rules are :mod:`shardkit.plan.rules`, which the
planner reads too.
"""

from __future__ import annotations

import dataclasses

from ..sharding import ParallelDims
from .config_file import load_toml, merge_config
from .layout import check_options
from .options import DTYPES, SCHEDULES, TrainConfig, parse_pp_tp
from .pretrained import read_config
from .specs import MODELS, model_spec, spec_of_family

__all__ = [
    "TrainConfig",
    "DTYPES",
    "SCHEDULES",
    "MODELS",
    "load_toml",
    "merge_config",
    "validate_config",
    "finish_config",
    "parse_pp_tp",
    "parallel_dims",
]


def validate_config(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """Check a configuration before launching; return it with every degree resolved.

    Only real limits are refused (each with its reason; the README lists them). Every check is
    pure, so a bad layout fails in the launching process before any worker starts: first
    :func:`.layout.check_options` (no torch: the layout, mixed precision, the pipeline schedule,
    the LM options), then the model's own rules and the mesh.

    Args:
        cfg: the merged configuration.
        world_size: the existing world's size when already running under torchrun (then
            ``nproc`` must be unset or equal to it).

    Raises:
        ShardkitError: with a message naming the options at fault.
    """
    return finish_config(check_options(cfg, world_size))


def finish_config(cfg: TrainConfig) -> TrainConfig:
    """The second half of :func:`validate_config`, on a configuration that passed
    :func:`.layout.check_options` (the command line runs that half before importing torch, with
    mixed precision, the pipeline schedule and the LM options' rules): a checkpoint's family, the
    model's own rules (a checkpoint's heads and layers, the compile backend, ...) and the mesh.

    Raises:
        ShardkitError: with a message naming the options at fault.
    """
    if cfg.model_path is not None and model_spec(cfg.model).family is not None:
        # the checkpoint's family decides the model (read_config refuses unsupported ones)
        cfg = dataclasses.replace(cfg, model=spec_of_family(read_config(cfg.model_path).model_type).name)
    cfg = model_spec(cfg.model).validate(cfg)
    parallel_dims(cfg)  # the mesh's own checks (ep borrowing, pp_tp), before launch
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
