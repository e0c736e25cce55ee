"""``parallelize``: tp -> cp -> ep -> dp on a Hugging Face decoder (or one pipeline stage of it).

One function for every supported family (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2): the
families differ only in their Hugging Face plans, which the transforms read from the model.
Each transform takes its own submesh of the job's :class:`~shardkit.sharding.ParallelMesh`:

1. **tp** (``mesh["tp"]``): :func:`~shardkit.tensor_parallel.apply_tp` with the model's own
   plan, sequence parallelism as a layout option, optionally the vocab-parallel loss. With
   ``ep > 1`` the experts rules are left out: experts are expert-parallel instead.
2. **cp** (``mesh["cp_ring"]`` / ``mesh["cp_ulysses"]``, both for USP):
   :func:`~shardkit.context_parallel.apply_cp` switches the attention; the trainer then cuts
   every batch with :meth:`~shardkit.context_parallel.CPContext.shard_batch`.
3. **ep** (``mesh["ep"]``, borrowed from ``dp_shard x cp x tp``): every experts module keeps its
   block of experts; tokens travel with the all-to-all dispatcher. Tokens are replicated over
   tp only, so each tp rank dispatches its own block of them (``token_group = tp``); with
   sequence parallelism each tp rank already holds its own block of the sequence.
4. **compile** (optional): ``torch.compile`` of every decoder block's forward (:mod:`.compiling`).
5. **mixed precision** (optional): each block and the root compute on a bfloat16 copy of their
   float32 parameters; every parameter-gradient reduction stays float32 (:mod:`.mixed_precision`).
6. **ac**: activation checkpointing of every decoder block, ``full`` or ``selective``
   (:mod:`.checkpointing`), inside FSDP2's hooks, around the (compiled) forward.
7. **dp**: FSDP2 over ``dp_shard x cp`` (HSDP with ``dp_replicate``) when ``dp_shard > 1``;
   everything FSDP2 does not reduce is summed by one :class:`~shardkit.data_parallel.GradientSync`.
   ``grad_reduce`` picks DDP's mean over the data ranks (the default) or their sum (the
   trainer's, with the loss divided by the global token count).

Source: torchtitan ``parallelize_llama`` (TP, then CP, then FSDP, one function per family);
Megatron-LM's TP x CP x EP x DP layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..comm._compat import hf_ep_plan
from ..comm.fingerprint import maybe_fingerprint
from ..context_parallel import apply_cp
from ..data_parallel import GradientSync, GradReduce, ParamLayout, apply_fsdp
from ..data_parallel.grads import check_grad_reduce
from ..data_parallel.zero import ZeroSync, check_zero_stage
from ..errors import ShardkitError
from ..expert_parallel.hf import expert_shard, shard_experts
from ..expert_parallel.styles import ep_styles
from ..sharding import shard_spec
from ..tensor_parallel import apply_tp
from ..tensor_parallel.plan import CompiledPlan, model_tp_plan
from ..tensor_parallel.sp_saved import check_sp_activation
from .ac_policy import ACPolicy
from .checkpointing import apply_ac, check_ac_mode
from .compiling import apply_compile, check_compile
from .mixed_precision import apply_mixed_precision, check_mixed_precision, fsdp_policy

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["ParallelModel", "parallelize", "decoder_layers"]


@dataclass
class ParallelModel:
    """A model (or pipeline stage) after :func:`parallelize`.

    Attributes:
        module: the parallelized module (modified in place; FSDP2-wrapped with ``dp_shard > 1``).
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh`, None for one process.
        cp: the :class:`~shardkit.context_parallel.CPContext` with context parallelism, else None.
        grads: the step's gradient reduction and global-norm clipping.
        layouts: per-parameter layout (tp/ep spec, expert, FSDP), by name.
        loss_parallel: logits stay vocab-sharded over tp (use the vocab-parallel loss).
        sequence_parallel: hidden states between blocks are sequence-sharded over tp.
        stage: the :class:`~shardkit.pipeline_parallel.PipelineStage` (one chunk or several) with
            ``pp > 1``, else None.
    """

    module: nn.Module
    mesh: Any  # ParallelMesh | None
    cp: Any  # CPContext | None
    grads: GradientSync
    layouts: dict[str, ParamLayout]
    loss_parallel: bool = False
    sequence_parallel: bool = False
    stage: Any = field(default=None)  # PipelineStage | None


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM or stage (``model.model.layers``, a list or a dict)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ShardkitError(f"parallelize: {type(model).__name__} has no model.layers (expected a decoder LM)")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """Experts modules named by the model's EP plan (``...mlp.experts``)."""
    ep = hf_ep_plan(getattr(model, "config", None)) or {}
    patterns = {k: v for k, v in ep.items() if v == "ep_dispatch_experts"}
    if not patterns:
        raise ShardkitError(
            f"parallelize: ep > 1 needs a mixture-of-experts model; {type(model).__name__} "
            "has no experts in its config's base_model_ep_plan"
        )
    compiled = CompiledPlan.build(patterns, model, ep_styles())
    return [m for name, m in model.named_modules() if name and compiled.match(name)]


def _tp_plan(model: nn.Module, expert_parallel: bool) -> dict:
    plan = model_tp_plan(model)
    if expert_parallel:  # experts are expert-parallel, not tensor-parallel
        plan = {k: v for k, v in plan.items() if ".experts" not in k}
    return plan


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh | None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    grad_reduce: GradReduce = "mean",
    activation_checkpoint: str | ACPolicy = "none",
    mixed_precision: str = "none",
    compile: bool | str = False,
    zero: int = 0,
    cp_layout: str = "zigzag",
    sp_activation: str | None = None,
    expert_capacity: dict[str, Any] | None = None,
    async_tp: bool = False,
) -> ParallelModel:
    """Apply tensor, context, expert and data parallelism to ``model``, in that order, in place.

    Every rank calls it on a model with the same full weights (built from the same seed or
    checkpoint). Afterwards the forward contract is the model's own, on this rank's data: the
    batch rows of its ``dp`` coordinate, and with cp the tokens of
    :meth:`~shardkit.context_parallel.CPContext.shard_batch`.

    Args:
        model: a transformers causal LM (or a pipeline stage module with the same names).
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh`; None for one process (nothing
            is changed: the same trainer runs the ``--verify`` reference).
        sequence_parallel: shard hidden states between blocks over tp (Megatron-SP).
        loss_parallel: keep the logits vocab-sharded over tp (the vocab-parallel loss).
        grad_reduce: how ``pm.grads.reduce()`` (and FSDP2) combine the gradients of the ``D``
            ranks holding different data (``dp_replicate x dp_shard x cp``):

            * ``"mean"`` (torch DDP's and FSDP2's default): the mean of the per-rank gradients.
              Back-propagate each rank's own mean loss (Hugging Face's ``labels=``). With cp,
              every cp rank's loss is the mean over *its* tokens of the sequence, and the mean
              of those is the global token mean only when every data and cp rank counts the
              same number of tokens (no ``-100`` labels, equal parts); with uneven counts
              back-propagate :func:`~shardkit.data_parallel.global_mean_loss` instead.
            * ``"sum"``: the sum; back-propagate ``sum(token losses) / N`` with ``N`` the
              *global* token count (the trainer's exact normalisation).

            Gradient accumulation over microbatches is yours to scale, as with DDP.
        activation_checkpoint: ``"none"``, ``"full"`` (each decoder block recomputed in
            backward), ``"selective"`` (matmul, attention and collective outputs kept),
            ``"selective:N"`` (every N-th block recomputed whole) or an
            :class:`~.ac_policy.ACPolicy` (ops to save, per-module overrides, every N-th block),
            applied after tp, cp and ep and before FSDP2 (:func:`~.checkpointing.apply_ac`).
        mixed_precision: ``"none"`` or ``"bf16"``: forward and backward in bfloat16 on float32
            master parameters (the optimizer's), every parameter-gradient reduction in float32
            (FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, the
            replicated path's :class:`~shardkit.data_parallel.GradientSync`, tp's hooks); the
            activations' collectives run in bfloat16 (:mod:`.mixed_precision`). Also with
            ``mesh=None``, so a one-process reference computes alike.
        compile: ``torch.compile`` each decoder block's forward after tp, cp and ep, inside
            activation checkpointing and FSDP2 (:func:`~.compiling.apply_compile`): False
            (eager), True (inductor) or a backend name (e.g. ``"aot_eager"``); not with
            ``"selective"`` checkpointing.
        zero: 0 (off), 1 or 2: ZeRO-1 / ZeRO-2 over the data ranks (``dp_replicate x cp``;
            expert weights over ``edp``): ``pm.grads`` is a :class:`~shardkit.data_parallel.ZeroSync`
            and the optimizer must be :class:`~shardkit.data_parallel.ZeroAdamW`. Not with
            ``dp_shard > 1`` (FSDP2 is ZeRO-3 there). Ignored with ``mesh=None``.
        cp_layout: the token placement of ring cp alone (``ring_layout`` of
            :func:`~shardkit.context_parallel.apply_cp`): ``"zigzag"``, ``"contiguous"``, ``"stripe"``.
        expert_capacity: with ``ep > 1``, the capacity keywords of
            :func:`~shardkit.expert_parallel.shard_experts` (``capacity_factor``, ``drop_policy``,
            ``pad_to_capacity``): dropped pairs are never sent. None: dropless.

    Returns:
        :class:`ParallelModel`.

    Raises:
        ShardkitError: a layout the model cannot take (e.g. ``ep > 1`` on a dense model), with
            the reason; ``grad_reduce`` not ``"mean"`` or ``"sum"``; the transforms' own errors
            (head counts, ...); ``zero`` not 0, 1 or 2, or ``zero`` with ``dp_shard > 1``;
            ``mixed_precision`` not ``"none"`` or ``"bf16"``, or ``"bf16"``
            on a model whose parameters are not float32; an unknown compile backend, or compile
            with selective checkpointing or with mixed precision.
        RankMismatchError: in check mode, on every rank: ranks of a data-parallel or an ep group
            given different options (``expert_capacity`` included) or different weights.
        sp_activation: with sequence parallelism, what the column-parallel projections keep for
            backward: ``"shard"`` (the norm's ``[B, S / tp, H]`` output, all-gathered again in
            backward: Megatron's layout, :mod:`shardkit.tensor_parallel.sp_saved`) or
            ``"gathered"`` (the all-gather's ``[B, S, H]`` output, no extra collective). None:
            ``"shard"`` with sequence parallelism over ``tp > 1`` (where it saves memory),
            ``"gathered"`` with ``compile`` or without it.

        async_tp: with sequence parallelism over ``tp > 1``, issue the sequence all-gathers and
            reduce-scatters as collective-matmul rings overlapping their matmuls
            (:func:`shardkit.tensor_parallel.apply_tp`'s ``async_tp``; torchtitan's
            ``enable_async_tensor_parallel``).

    Raises (also):
        ShardkitError: ``sp_activation`` not ``"shard"``, ``"gathered"`` or None;
            ``"shard"`` with ``compile`` (its regather state is not traced); ``async_tp``
            without sequence parallelism over ``tp > 1``, or with ``compile``.
    """
    grad_reduce = check_grad_reduce(grad_reduce, "parallelize")
    zero = check_zero_stage(zero, "parallelize")
    if zero and mesh is not None and mesh.dims.dp_shard > 1:
        raise ShardkitError(
            f"parallelize: zero={zero} with dp_shard={mesh.dims.dp_shard}: FSDP2 already shards parameters, "
            "gradients and optimizer state over dp_shard (ZeRO-3); use zero over dp_replicate x cp with dp_shard 1"
        )
    check_ac_mode(activation_checkpoint)
    check_mixed_precision(mixed_precision)
    backend = check_compile(compile, activation_checkpoint=activation_checkpoint)
    sp_act = _sp_activation(sp_activation, backend)
    _check_async_tp(async_tp, mesh, sequence_parallel, backend)
    if backend is not None and mixed_precision != "none":
        # the per-block bfloat16 cast wraps the forward Dynamo would trace; not tested together yet
        raise ShardkitError(
            f"parallelize: compile={compile!r} with mixed_precision={mixed_precision!r} is not supported"
        )
    if mesh is None:  # one process: no parallel transform, every parameter replicated
        apply_compile(decoder_layers(model), backend)
        apply_mixed_precision(model, decoder_layers(model), mixed_precision)
        apply_ac(decoder_layers(model), activation_checkpoint)
        layouts = _param_layouts(model)
        sync = GradientSync(model, None, layouts, grad_reduce=grad_reduce)
        return ParallelModel(model, None, None, sync, layouts, False, False)
    dims = mesh.dims
    tp, ep = mesh.size("tp"), dims.ep
    if mesh.size("dp_cp") > 1:
        # check mode: the data-parallel (and cp) replicas start from the same weights and options;
        # apply_tp fingerprints the tp group itself
        maybe_fingerprint(
            dict(model.named_parameters()),
            mesh["dp_cp"],
            "parallelize",
            [
                f"layout {dims.describe()}",
                f"sequence_parallel {sequence_parallel}",
                f"loss_parallel {loss_parallel}",
                f"grad_reduce {grad_reduce}",
                f"activation_checkpoint {activation_checkpoint}",
                f"mixed_precision {mixed_precision}",
                f"compile {backend}",
                f"sp_activation {sp_act}",
                f"expert_capacity {_capacity_key(expert_capacity)}",
            ],
        )
    if tp > 1:
        plan = _tp_plan(model, ep > 1) if ep > 1 else None
        apply_tp(
            model,
            mesh["tp"],
            plan,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            check="off",
            sp_activation=sp_act,
            async_tp=async_tp,
        )
    cp = None
    if dims.cp_mode is not None:
        cp_mesh = (
            mesh["cp_ring", "cp_ulysses"]
            if dims.cp_mode == "usp"
            else mesh["cp_ring" if dims.cp_mode == "ring" else "cp_ulysses"]
        )
        cp = apply_cp(model, cp_mesh, dims.cp_mode, ring_layout=cp_layout)
    if ep > 1:
        capacity = dict(expert_capacity or {})
        # the ep group may span tp ranks, which no fingerprint above compares: ranks that drop by
        # different capacities would silently exchange different tokens (check mode only)
        maybe_fingerprint({}, mesh["ep"], "parallelize", [f"expert_capacity {_capacity_key(expert_capacity)}"])
        for experts in _experts_modules(model):
            if tp > 1 and not sequence_parallel:  # the same tokens on the tp ranks: each dispatches its block
                shard_experts(
                    experts, mesh["ep"], mode="dispatch", tokens="replicated", token_group=mesh["tp"], **capacity
                )
            else:  # every rank's tokens are its own (with sequence parallelism: its sequence block)
                shard_experts(experts, mesh["ep"], mode="dispatch", tokens="sharded", **capacity)
    apply_compile(decoder_layers(model), backend)
    # the cast sits inside the checkpoint: a recomputed block casts its weights again
    apply_mixed_precision(model, decoder_layers(model), mixed_precision)
    apply_ac(decoder_layers(model), activation_checkpoint)
    layouts = _param_layouts(model)
    if dims.dp_shard > 1:
        policy = fsdp_policy(mixed_precision)
        for name in apply_fsdp(model, mesh, decoder_layers(model), grad_reduce=grad_reduce, mp_policy=policy):
            layouts[name].fsdp = True
    sync = (
        ZeroSync(model, mesh, layouts, grad_reduce=grad_reduce, stage=zero)
        if zero
        else GradientSync(model, mesh, layouts, grad_reduce=grad_reduce)
    )
    return ParallelModel(
        model,
        mesh,
        cp,
        sync,
        layouts,
        loss_parallel and tp > 1,
        sequence_parallel and tp > 1,
    )


def _capacity_key(expert_capacity: dict[str, Any] | None) -> str:
    """``expert_capacity`` as a canonical string (sorted keys, ``repr`` values) for the fingerprints."""
    return "none" if expert_capacity is None else repr(sorted(expert_capacity.items()))


def _check_async_tp(async_tp: bool, mesh, sequence_parallel: bool, backend: str | None) -> None:
    """Refuse ``async_tp`` where there is no sequence-parallel collective to decompose (pure)."""
    if not async_tp:
        return
    tp = 1 if mesh is None else mesh.size("tp")
    if tp <= 1 or not sequence_parallel:
        raise ShardkitError(
            f"parallelize: async_tp=True needs sequence parallelism over tp > 1 (got tp={tp}, "
            f"sequence_parallel={sequence_parallel}): it decomposes the sequence all-gathers and reduce-scatters"
        )
    if backend is not None:
        raise ShardkitError(f"parallelize: async_tp=True with compile={backend!r}: the rings' state is not traced")


def _sp_activation(value: str | None, backend: str | None) -> str:
    """The sequence-parallel activation layout ``parallelize`` applies (see its docstring)."""
    if value is None:
        return "gathered" if backend is not None else "shard"
    check_sp_activation(value)
    if value == "shard" and backend is not None:
        raise ShardkitError(
            f"parallelize: sp_activation='shard' with compile={backend!r}: the regather's state is not traced; "
            "use sp_activation='gathered'"
        )
    return value


def _param_layouts(model: nn.Module) -> dict[str, ParamLayout]:
    """Each parameter's layout after the tp / cp / ep transforms (FSDP2 marks its own after)."""
    return {
        name: ParamLayout(name, expert_shard(p) is not None, False, shard_spec(p))
        for name, p in model.named_parameters()
    }
