"""``apply_tp``: shard a model in place from a plan, from outside its code.

Every rank of the tp group calls :func:`apply_tp` on a model holding the same full weights (built
from the same seed or checkpoint), or on a model built under ``torch.device("meta")`` that
:func:`shardkit.load_sharded` then fills from a checkpoint, reading only this rank's slices.
Afterwards each rank holds its shards and the model's forward contract is unchanged: logits and
loss are replicated over the group (with ``loss_parallel`` the logits stay vocab-sharded and the
loss is computed by :func:`shardkit.vocab_parallel_cross_entropy`).

Activations between blocks are replicated (Megatron tensor parallelism), or, with
``sequence_parallel=True``, sharded along the sequence (Megatron sequence parallelism: the
model's own plan turned into its sequence-parallel plan, see :mod:`.sp_plan`).

Source: Megatron-LM tensor parallelism (Shoeybi et al., 2019) applied from outside the model as
PyTorch DTensor's ``parallelize_module`` and Hugging Face's ``tp_plan`` do.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm._group import resolve_group
from ..comm._validate import local_checks, maybe_agree
from ..comm.fingerprint import describe_style, group_device, maybe_fingerprint
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Shard
from ._forward_checks import install_forward_checks
from .heads import attention_head_ranges
from .loss_hf import vocab_parallel_causal_lm_loss
from .plan import CompiledPlan, _generic, model_tp_plan, verify_tp_plan
from .sequence import SequenceSharding
from .sp_plan import sequence_parallel_plan
from .sp_saved import check_sp_activation
from .style_base import StyleContext
from .styles import ColwiseParallel, RowwiseParallel

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["apply_tp"]


def _head_ranges(model: nn.Module, compiled: CompiledPlan, world: int) -> dict[str, tuple]:
    """Whole-head ranges for the attention projections the plan cuts with default sizes."""
    out: dict[str, tuple] = {}
    for name, module in model.named_modules():
        layout = (
            attention_head_ranges(module, name, world)
            if hasattr(module, "head_dim") or hasattr(module, "qk_head_dim")
            else {}
        )
        cut = {}
        for child, ranges in layout.items():
            if child.startswith("_"):
                continue
            full = f"{name}.{child}" if name else child
            rule = compiled.match(full)
            style = rule[1] if rule else None
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and (style.sizes, style.parts, style.unit) == (
                None,
                None,
                1,
            ):
                cut[full] = ranges
        if cut:
            out.update(cut)
            ratios = layout.get("_num_key_value_groups")
            if ratios is not None and hasattr(module, "num_key_value_groups"):
                module._shardkit_kv_groups = ratios  # set per rank below, once the rank is known
    return out


def apply_tp(
    model: nn.Module,
    tp_mesh: Group,
    plan: dict | None = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    styles: dict | None = None,
    check: str = "warn",
    sp_activation: str = "gathered",
    async_tp: bool = False,
) -> nn.Module:
    """Apply tensor parallelism to ``model`` in place, following ``plan``.

    Args:
        model: any ``nn.Module``; Hugging Face models bring their own plan.
        tp_mesh: the tp ``ProcessGroup`` or 1-D ``DeviceMesh`` (e.g. ``mesh["tp"]``).
        plan: ``{pattern: style}`` (see :mod:`.plan`); None takes the model's own HF plan
            (``model.tp_plan`` / ``config.base_model_tp_plan``).
        sequence_parallel: turn ``plan`` into its sequence-parallel plan (decoder models:
            hidden states ``[B, S_r, H]`` between blocks, any ``S``; see :mod:`.sp_plan`). The
            forward contract is unchanged (replicated input ids in, logits ``[B, S, V]`` out);
            hidden states returned with ``output_hidden_states`` are the local blocks.
        loss_parallel: keep ``lm_head``'s logits vocab-sharded (``colwise`` without the output
            gather) and compute HF's causal-LM loss with
            :func:`shardkit.vocab_parallel_cross_entropy`, so full-vocab logits never exist. A
            pipeline stage module before the last (``is_last`` False, no ``lm_head``) is left
            as without it; the last stage's logits ``[B, S, V_r]`` go to the caller's loss.
        styles: extra ``{name: ParallelStyle}`` usable by name in ``plan``.
        check: ``"warn"`` (default) warns about plan rules that matched nothing and parameters
            left unsharded; ``"error"`` raises instead; ``"off"`` skips the check.
        sp_activation: with ``sequence_parallel``, what the column-parallel projections keep
            for backward: ``"gathered"`` (the all-gather's ``[B, S, H]`` output, the default
            here) or ``"shard"`` (the ``[B, S / R, H]`` block, all-gathered again in backward,
            Megatron's choice: :mod:`.sp_saved`). No effect without sequence parallelism.
        async_tp: with ``sequence_parallel``, issue each block's sequence all-gather as ring
            steps that overlap its column-parallel readers' matmuls (q/k/v together, gate/up
            together, the head) and each row-parallel reduce-scatter as ring steps overlapping
            its matmul (:mod:`shardkit.comm.collective_matmul`; PyTorch's async TP on c10d
            point-to-point calls). Same values up to the order of sums; ledger ``send``/``recv``.

    Returns:
        ``model`` (the same object); unchanged when the group has one rank.

    Raises:
        ShardkitError: unknown style names, ambiguous rules, shapes a style cannot cut (e.g.
            fewer attention heads than ranks), a model the sequence-parallel plan does not
            cover (MoE blocks, MLA; :func:`.sp_plan.sequence_parallel_error`), or
            (``check="error"``) an imperfect plan; ``async_tp`` without ``sequence_parallel``.
        ShardkitTypeError: a style applied to a module of the wrong kind.
    """
    if not isinstance(model, nn.Module):
        raise ShardkitTypeError(f"apply_tp: model must be an nn.Module, got {type(model).__name__}")
    if check not in ("warn", "error", "off"):
        raise ShardkitError(f"apply_tp: check must be 'warn', 'error' or 'off', got {check!r}")
    check_sp_activation(sp_activation, "apply_tp")
    if async_tp and not sequence_parallel:
        raise ShardkitError(
            "apply_tp: async_tp=True needs sequence_parallel=True (it decomposes the sequence all-gathers and "
            "reduce-scatters; Megatron's all-reduces have no ring form here)"
        )
    g = resolve_group(tp_mesh, "apply_tp")
    # In check mode a plan error seen by one rank only (its own plan or model) is raised on
    # every rank (agreed before the fingerprint), instead of leaving the others waiting in it.
    compiled, error = local_checks(g, lambda: _compile(model, plan, g, sequence_parallel, loss_parallel, styles, check))
    maybe_agree(g, "apply_tp", torch.zeros(0, device=group_device(g, model.parameters())), error=error)
    if g.size == 1:
        return model
    maybe_fingerprint(
        dict(model.named_parameters()),
        g.pg,
        "apply_tp",
        _plan_lines(
            model, compiled, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, async_tp=async_tp
        ),
    )
    heads = _head_ranges(model, compiled, g.size)
    memo: dict = {}
    seq = SequenceSharding(tp_mesh, activation=sp_activation if sequence_parallel else "gathered", async_tp=async_tp)
    for name, module in list(model.named_modules()):
        ratios = getattr(module, "_shardkit_kv_groups", None)
        if ratios is not None:
            module.num_key_value_groups = ratios[g.rank]
            del module._shardkit_kv_groups
        mrule = compiled.match(name) if name else None
        for pname, _ in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            prule = compiled.match(full)
            if prule is not None and not (mrule is not None and prule[1] is mrule[1]):
                ctx = StyleContext(tp_mesh, g, full, model, memo, heads.get(full), seq)
                prule[1].shard_param(module, pname, ctx)
        if mrule is not None:
            mrule[1].apply_module(module, StyleContext(tp_mesh, g, name, model, memo, heads.get(name), seq))
    if loss_parallel:
        _use_vocab_parallel_loss(model, tp_mesh)
    install_forward_checks(model, g)
    return model


def _compile(
    model: nn.Module, plan: dict | None, g, sequence_parallel: bool, loss_parallel: bool, styles, check: str
) -> CompiledPlan:
    """The plan to apply (the model's own when None; loss- and sequence-parallel variants),
    compiled against the model, after the optional plan report."""
    plan = dict(model_tp_plan(model) if plan is None else plan)
    if loss_parallel:
        plan = _loss_parallel_plan(model, plan)
    if sequence_parallel:
        plan = sequence_parallel_plan(model, plan, loss_parallel=loss_parallel, styles=styles)
    compiled = CompiledPlan.build(plan, model, styles)
    if check != "off":
        report = verify_tp_plan(model, plan, styles)
        # Without sequence parallelism a norm's input is replicated over tp, so its replicated
        # weight gets the full gradient on every rank: by design, not worth a warning (every
        # stock Llama's own plan leaves its norms out). With SP the plan must cover them.
        norms = set() if sequence_parallel else _norm_parameters(model)
        unsharded = [n for n in report.unsharded if n not in norms]
        if report.unused_rules or unsharded:
            msg = (
                f"apply_tp: rules that matched nothing: {list(report.unused_rules)}; "
                f"parameters left unsharded: {unsharded}"
            )
            if check == "error":
                raise ShardkitError(msg)
            if g.rank == 0:  # the report is the same on every rank (a pure plan check): say it once
                warnings.warn(msg, stacklevel=5)  # the caller of apply_tp
    return compiled


def _norm_parameters(model: nn.Module) -> set[str]:
    """Generic names (layer indices as ``*``) of the parameters of normalization modules: those
    whose class name ends in ``Norm`` (``LlamaRMSNorm``, ``nn.LayerNorm``, ``nn.GroupNorm``)."""
    return {
        _generic(f"{mname}.{pname}" if mname else pname)
        for mname, module in model.named_modules()
        if type(module).__name__.endswith("Norm")
        for pname, _ in module.named_parameters(recurse=False)
    }


def _plan_lines(model: nn.Module, compiled: CompiledPlan, **options) -> list[str]:
    """The plan as applied to this model, one line per matched module and parameter (for the
    check mode's fingerprint: ranks whose plans differ anywhere get different lines)."""
    lines = [f"options {sorted(options.items())}"]
    for name, module in model.named_modules():
        for full in [name] + [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]:
            rule = compiled.match(full) if full else None
            if rule is not None:
                lines.append(f"{full}: {rule[0]} {describe_style(rule[1])}")
    return lines


def _loss_parallel_plan(model: nn.Module, plan: dict) -> dict:
    """``plan`` with the output head cut colwise without the logits gather."""
    head = getattr(model, "lm_head", None)
    if head is None and getattr(model, "is_last", None) is False:
        return plan  # a pipeline stage before the last: no output head, nothing to change
    if not isinstance(head, nn.Linear):
        raise ShardkitError("apply_tp: loss_parallel needs the model's output head at model.lm_head (an nn.Linear)")
    plan = {k: v for k, v in plan.items() if k != "lm_head"}
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1))
    return plan


def _use_vocab_parallel_loss(model: nn.Module, tp_mesh) -> None:
    """Make HF's ``model.loss_function`` the vocab-parallel causal-LM loss."""
    if not hasattr(type(model), "loss_function"):
        return  # a user model computes its own loss with vocab_parallel_cross_entropy
    model.loss_function = vocab_parallel_causal_lm_loss(tp_mesh)
