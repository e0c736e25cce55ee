"""Limits of ``shardkit train`` against the machine it launches on: cores and memory.

:func:`.config.validate_config` checks what is true anywhere (degrees, divisibility, head counts);
this module checks what this machine can hold, in the launching process before any worker starts
(``cli/train.py``'s ``config_from_args``), so a run that cannot fit fails with one message instead
of exhausting memory after launch:

* a local launch starts at most :data:`RANKS_PER_CPU` ranks per CPU this process may run on
  (``os.sched_getaffinity``), and never refuses :data:`MIN_LOCAL_RANKS` or fewer (the README's
  8-rank layouts run on 2 cores);
* the estimated memory of the ranks on this machine (:func:`shardkit.plan.memory.memory_per_rank`:
  parameters, gradients, AdamW state, activations and logits, plus :data:`RANK_OVERHEAD` for the
  process itself) must not exceed its memory: ``MemTotal`` for CPU ranks (all local ranks share
  it), the GPU's memory for a torchrun rank on CUDA.

The estimate is the planner's model, which counts no attention score matrix (flash attention) and
no allocator slack: it refuses what cannot fit, it does not promise that everything else does.
"""

from __future__ import annotations

import os

import torch

from ..errors import ShardkitError
from ..plan import ModelShape, StepOptions
from ..plan.memory import memory_per_rank
from ..plan.options import rank_stage
from .config import TrainConfig, parallel_dims
from .pretrained import read_config
from .specs import model_spec

__all__ = ["RANKS_PER_CPU", "MIN_LOCAL_RANKS", "RANK_OVERHEAD", "check_machine", "builtin_shape", "memory_estimate"]

RANKS_PER_CPU = 4
MIN_LOCAL_RANKS = 8
# One idle rank (Python, torch, transformers imported, gloo buffers): 300-400 MB RSS measured; the
# lower end keeps the check a refusal of the impossible only.
RANK_OVERHEAD = 256 << 20
_GIB = 1 << 30


def _cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _host_memory() -> int:
    """This machine's physical memory in bytes (``MemTotal``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def builtin_shape(cfg: TrainConfig) -> ModelShape:
    """The :class:`~shardkit.plan.ModelShape` of the built-in model of ``cfg``: its family's config
    (:meth:`.lm_families.LMFamily.config`, the one :func:`.model.build_model` builds), without
    importing transformers."""
    family = model_spec(cfg.model).family
    assert family is not None  # a decoder LM (check_machine skips the others)
    return ModelShape.from_config(family.config(cfg))


def memory_estimate(cfg: TrainConfig) -> list[dict[str, float]]:
    """The planner's memory of every rank of a validated LM configuration, in bytes.

    Returns:
        One ``{"params", "grads", "optimizer", "activations", "total"}`` per global rank.

    Raises:
        ShardkitError: the model's shape is outside the planner's model (e.g. an MLA latent
            rank of 0); callers treat it as "no estimate".
    """
    if cfg.model_path is not None:
        shape = ModelShape.from_config(read_config(cfg.model_path))
    else:
        shape = builtin_shape(cfg)
    dims = parallel_dims(cfg)
    opts = StepOptions(
        cfg.seq_len, cfg.batch_size, cfg.microbatches, cfg.dtype, cfg.sequence_parallel, cfg.loss_parallel, cfg.schedule
    )
    stages = {s: memory_per_rank(shape, dims, opts, s) for s in range(dims.pp)}
    return [stages[rank_stage(dims, r)[0]] for r in range(dims.product)]


def _size_flags(cfg: TrainConfig) -> str:
    sizes = ["batch_size", "seq_len", "microbatches"]
    if cfg.model_path is None:
        sizes += ["hidden_size", "layers", "intermediate_size"] + (["experts"] if model_spec(cfg.model).experts else [])
    return " ".join(f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in sizes) + f" --dtype {cfg.dtype}"


def check_machine(cfg: TrainConfig, local_launch: bool) -> None:
    """Refuse a validated configuration this machine cannot run (rules: the module docstring).

    Args:
        cfg: the output of :func:`.config.validate_config`.
        local_launch: the launcher starts ``cfg.nproc`` ranks here (else: under torchrun, where
            ``LOCAL_WORLD_SIZE`` ranks share this machine).

    Raises:
        ShardkitError: naming the flags, the estimate and the machine's limit.
    """
    assert cfg.nproc is not None  # validate_config resolved it
    if local_launch and cfg.nproc > max(MIN_LOCAL_RANKS, RANKS_PER_CPU * _cpus()):
        limit = max(MIN_LOCAL_RANKS, RANKS_PER_CPU * _cpus())
        raise ShardkitError(
            f"--nproc {cfg.nproc}: a local launch starts at most max({MIN_LOCAL_RANKS}, "
            f"{RANKS_PER_CPU} x CPUs) ranks: {limit} on this machine ({_cpus()} CPUs)"
        )
    if not model_spec(cfg.model).planned:
        return  # e.g. conv-ae: fixed-size frames and channels, its memory does not grow with the flags
    try:
        ranks = memory_estimate(cfg)
    except ShardkitError:
        return  # outside the planner's model: the model builder reports what it cannot build
    cuda = not local_launch and _cuda_memory() is not None
    local = cfg.nproc if local_launch else 1 if cuda else int(os.environ.get("LOCAL_WORLD_SIZE", cfg.nproc))
    worst = max(ranks, key=lambda m: m["total"])
    need = local * (worst["total"] + (0 if cuda else RANK_OVERHEAD))
    have = _cuda_memory() if cuda else _host_memory()
    assert have is not None
    if need > have:
        parts = ", ".join(f"{k} {worst[k] / _GIB:.2f}" for k in ("params", "grads", "optimizer", "activations"))
        where = "this GPU's memory" if cuda else f"this machine's memory (MemTotal) for {local} local rank(s)"
        raise ShardkitError(
            f"{_size_flags(cfg)} with --nproc {cfg.nproc}: a rank needs about "
            f"{worst['total'] / _GIB:.1f} GiB ({parts} GiB), {need / _GIB:.1f} GiB in all, more than "
            f"{where}: {have / _GIB:.1f} GiB. Lower these sizes or shard more (--tp, --dp-shard, --pp)"
        )


def _cuda_memory() -> int | None:
    """This torchrun rank's GPU memory in bytes, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory
