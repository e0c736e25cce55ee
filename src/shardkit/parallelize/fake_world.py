"""The planner's memory rows checked against the real parallelized model, on a fake world.

One process plays one rank of a world of any size at a time: torch's ``fake`` process group
(every collective returns at once, nothing moves), the Hugging Face model built on the ``meta``
device (shapes only, no storage: a 405B stage costs no memory), then the trainer's own
:func:`~.pipeline.parallelize_stage` / :func:`~.decoder.parallelize` on the layout's mesh.
What that rank then holds is counted from the parameters themselves:

* ``held``: the local elements of every parameter (FSDP2's dim-0 shard of a ``DTensor``,
  ``to_local()``; the parameters FSDP2 leaves to shardkit's reductions, tp/ep-local, whole);
* ``gathered``: the elements FSDP2 all-gathers at the peak of a step: the root's parameters
  (embedding, final norm, ``lm_head``), which FSDP2 keeps unsharded from forward through
  backward, plus the largest decoder layer, gathered one at a time; with ``M > 1`` microbatches
  every layer, kept gathered for the step, and as many unsharded gradient elements;
* gradients as ``held`` in the training dtype, AdamW's state 8 bytes per held element plus a
  float32 master copy (4) when the dtype is narrower: the convention of
  :func:`shardkit.plan.memory.memory_per_rank`.

Ranks sampled: one per pipeline stage, the stage's first rank (tp, cp and dp coordinates 0).
tp, cp and ep ranks hold the same sizes (whole heads, whole experts); FSDP2 cuts dim 0 like
``torch.chunk`` (over ``dp_shard x cp``, expert weights over ``edp``), so on an uneven split the
first data rank holds the largest shard.

Source: torchtitan's memory estimation (``estimation.py``: the real model under a fake process
group and fake tensors); FSDP2's root, which is not resharded after forward.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ShardkitError
from ..plan.memory import memory_per_rank
from ..plan.model import ModelShape
from ..plan.options import DTYPE_BYTES, StepOptions, check_layout, resolve_options
from ..sharding import ParallelDims
from .decoder import ParallelModel, decoder_layers, parallelize
from .pipeline import parallelize_stage

__all__ = [
    "RankMemory",
    "count_parallel_model",
    "count_rank",
    "fake_world_memory",
    "fake_world_table",
    "read_hf_config",
]

_ROWS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class RankMemory:
    """What one rank of a layout holds, counted on the real parallelized model.

    Attributes:
        rank: global rank in the fake world. stage: its pipeline stage.
        held: parameter elements it keeps between steps.
        gathered: parameter elements FSDP2 holds unsharded at the peak (0 without ``dp_shard``).
        elem: bytes per element of the training dtype.
        unsharded_grads: gradient elements FSDP2 accumulates unsharded over the microbatches of a
            step (``M > 1``: :func:`shardkit.data_parallel.set_microbatch`), else 0.
        stepped: elements the optimizer holds state for: ZeRO's slices of the flat buckets
            (their padding included); None: ``held``.
    """

    rank: int
    stage: int
    held: int
    gathered: int
    elem: int
    unsharded_grads: int = 0
    stepped: int | None = None

    def rows(self) -> dict[str, float]:
        """``{"params", "grads", "optimizer"}`` in bytes, as :func:`~shardkit.plan.memory.memory_per_rank`."""
        master = 4 if self.elem < 4 else 0
        return {
            "params": float((self.held + self.gathered) * self.elem),
            "grads": float((self.held + self.unsharded_grads) * self.elem),
            "optimizer": float((self.held if self.stepped is None else self.stepped) * (8 + master)),
        }


def _stage_model(config: Any, dims: ParallelDims, stage: int, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the meta device with only ``stage``'s decoder layers built.

    The model is built without layers (its ``post_init`` walks every module, the costly part),
    then the stage's layers are made at their global indices (MoE and dense layers, sliding
    windows follow the index); the other indices hold one empty placeholder the stage never
    references. The full ``config`` stays the model's, so the stage cut is the trainer's.
    """
    import transformers  # only the dry run needs it

    bare = copy.deepcopy(config)
    bare.num_hidden_layers = 0
    bare._experts_implementation = "eager"  # as the trainer builds it
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(bare)
        layer_cls = getattr(sys.modules[type(model).__module__], next(iter(type(model)._no_split_modules)))
        built = {i: layer_cls(config, i) for i in ModelShape.from_config(config).stage_layers(dims.pp, stage)}
    placeholder = nn.Module()
    model.model.layers = nn.ModuleList([built.get(i, placeholder) for i in range(config.num_hidden_layers)])
    model.config = model.model.config = config
    return model.to(dtype).train()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _fsdp_numel(module: nn.Module, seen: set[int]) -> int:
    """Unsharded elements of the FSDP2 parameters (``DTensor`` s) of ``module`` not in ``seen``."""
    total = 0
    for p in module.parameters():
        if hasattr(p, "to_local") and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def count_parallel_model(pm: ParallelModel, microbatches: int = 1) -> tuple[int, int]:
    """``(held, gathered)`` parameter elements of this rank's parallelized model or stage (see
    the module docstring); the same count on a real world and on the fake one. With
    ``microbatches > 1`` every FSDP2 group stays gathered for the step (``set_microbatch``)."""
    held = sum(_local(p).numel() for p in pm.module.parameters())
    seen: set[int] = set()
    blocks = [_fsdp_numel(block, seen) for block in decoder_layers(pm.module)]
    root = _fsdp_numel(pm.module, seen)  # what is left: the root's own group
    return held, root + (sum(blocks) if microbatches > 1 else max(blocks, default=0))


def count_rank(config: Any, dims: ParallelDims, rank: int, opts: StepOptions) -> RankMemory:
    """Build ``rank``'s parallelized model (stage) of a fake world of ``dims.product`` ranks and count it.

    Args:
        config: a transformers ``PretrainedConfig`` of a decoder causal LM.
        dims: the layout (``pp_tp`` is not supported: its stages are not a rectangle).
        rank: the global rank to play, ``0 <= rank < dims.product``.
        opts: the step options (dtype; ``sequence_parallel`` None: the trainer's default).

    Returns:
        :class:`RankMemory`.

    Raises:
        ShardkitError: a process group is already initialized in this process (the fake world
            needs its own), ``pp_tp``, a bad rank, or the transforms' own refusals.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ShardkitError("plan --dry-run: a process group is already initialized here; the fake world needs its own")
    if dims.pp_tp is not None:
        raise ShardkitError(f"plan --dry-run: pp_tp layouts ({dims.describe()}) are not counted on a fake world")
    if not 0 <= rank < dims.product:
        raise ShardkitError(f"plan --dry-run: rank must be in [0, {dims.product}), got {rank}")
    shape = ModelShape.from_config(config)
    opts = resolve_options(shape, dims, opts)
    stage = rank // (dims.product // dims.pp)
    dist.init_process_group("fake", rank=rank, world_size=dims.product, store=FakeStore())
    try:
        mesh = dims.build_mesh("cpu")
        model = _stage_model(config, dims, stage, getattr(torch, opts.dtype))
        kw: dict[str, Any] = dict(
            sequence_parallel=bool(opts.sequence_parallel),
            grad_reduce="sum",
            zero=opts.zero,
            sp_activation=opts.sp_activation,
        )
        if dims.pp > 1:
            pm = parallelize_stage(model, mesh, lambda logits, labels: logits.sum(), **kw)
        else:
            pm = parallelize(model, mesh, **kw)
        held, gathered = count_parallel_model(pm, opts.microbatches)
        buckets = getattr(pm.grads, "buckets", None)  # ZeroSync: the optimizer steps one slice of each
        stepped = sum(b.shard.numel() for b in buckets) if buckets is not None else None
    finally:
        dist.destroy_process_group()
    unsharded_grads = gathered if opts.microbatches > 1 else 0
    return RankMemory(rank, stage, held, gathered, DTYPE_BYTES[opts.dtype], unsharded_grads, stepped)


def fake_world_memory(config: Any, dims: ParallelDims, opts: StepOptions) -> list[dict[str, Any]]:
    """Counted against planned params, grads and optimizer bytes, one row per pipeline stage.

    Each stage's first rank (see the module docstring) is built and counted with
    :func:`count_rank`; its planned rows are :func:`~shardkit.plan.memory.memory_per_rank`.

    Returns:
        One dict per stage: ``stage``, ``rank``, ``counted`` and ``planned`` (each
        ``{"params", "grads", "optimizer"}`` in bytes) and ``ratio`` (counted / planned, per row).

    Raises:
        ShardkitError: the trainer's refusals of the layout (:func:`shardkit.plan.options.check_layout`),
            and those of :func:`count_rank`.
    """
    shape = ModelShape.from_config(config)
    check_layout(shape, dims, opts)
    per_stage = dims.product // dims.pp
    out = []
    for stage in range(dims.pp):
        counted = count_rank(config, dims, stage * per_stage, opts).rows()
        plan = memory_per_rank(shape, dims, opts, stage)
        planned = {k: plan[k] for k in _ROWS}
        ratio = {k: counted[k] / planned[k] if planned[k] else float(counted[k] == 0) for k in _ROWS}
        out.append(dict(stage=stage, rank=stage * per_stage, counted=counted, planned=planned, ratio=ratio))
    return out


def read_hf_config(config: Any) -> Any:
    """A transformers ``PretrainedConfig`` from itself, a ``config.json`` dict or a path to one.

    Raises:
        ShardkitError: unreadable file, or a ``model_type`` transformers does not know.
    """
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    if not isinstance(config, dict):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as e:
            raise ShardkitError(f"plan --dry-run: cannot read the config {config}: {e}") from e
    fields = dict(config)
    try:
        return transformers.AutoConfig.for_model(fields.pop("model_type", None), **fields)
    except ValueError as e:
        raise ShardkitError(f"plan --dry-run: transformers cannot build this config: {e}") from e


def fake_world_table(config: Any, dims: ParallelDims, opts: StepOptions) -> list[str]:
    """:func:`fake_world_memory` as printable lines: per stage, counted / planned GiB of params,
    grads and optimizer state, and the largest relative difference.

    Args:
        config: a ``PretrainedConfig``, a ``config.json`` dict or a path (:func:`read_hf_config`).
        dims: as :func:`fake_world_memory`.
        opts: as :func:`fake_world_memory`.

    Raises:
        ShardkitError: as :func:`read_hf_config` and :func:`fake_world_memory`.
    """
    rows = fake_world_memory(read_hf_config(config), dims, opts)
    gib = 2**30
    lines = [
        f"{dims.describe()} ({dims.product} ranks), {opts.dtype}: counted on a fake world / planned, GiB per rank",
        " | ".join(["stage", "rank", *(f"{k} counted / planned" for k in _ROWS), "max diff"]),
    ]
    for r in rows:
        cells = [f"{r['counted'][k] / gib:.2f} / {r['planned'][k] / gib:.2f}" for k in _ROWS]
        worst = max(abs(v - 1) for v in r["ratio"].values())
        lines.append(" | ".join([str(r["stage"]), str(r["rank"]), *cells, f"{worst:.2%}"]))
    return lines
