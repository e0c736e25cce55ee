"""Tensor-parallel plans: module-name patterns -> styles, matching, and the plan check.

A plan maps name patterns to styles, as Hugging Face ``base_model_tp_plan`` does:
``{"layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"}``. A ``*`` matches
one dotted name component (a layer index). A pattern names either a module (its style shards the
module's own ``weight``/``bias`` and adds activation hooks) or a parameter
(``layers.*.mlp.experts.gate_up_proj``: only that parameter is cut). Patterns match full names
or names relative to the base model (``model.layers.0...`` matches ``layers.*...``).

Values are style names (the Hugging Face strings, see :func:`default_styles`) or style objects
(:class:`~.styles.ParallelStyle` instances); ``apply_tp(..., styles={...})`` adds names. The
expert-parallel names (``grouped_gemm``, ``ep_router``, ``ep_dispatch_experts``) are
:mod:`shardkit.expert_parallel`'s, which builds on this package: its
:func:`~shardkit.expert_parallel.ep_plan` gives them as style objects, and
``styles=ep_styles()`` adds them by name.

Source: Hugging Face transformers' TP plans and ``verify_tp_plan``; PyTorch DTensor
``parallelize_module`` plans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..comm._compat import hf_tp_plan
from ..errors import ShardkitError, ShardkitTypeError
from ..sharding import Replicate
from .embedding import EmbeddingParallel
from .moe import MoeIdentityExpert, MoeTensorParallelExperts
from .replicated import MlaKvAProjParallel, ReplicatedWithGradAllReduce, SequenceParallel
from .styles import ColwiseParallel, PackedColwiseParallel, PackedRowwiseParallel, ParallelStyle, RowwiseParallel

__all__ = ["default_styles", "model_tp_plan", "CompiledPlan", "PlanReport", "verify_tp_plan"]


def default_styles() -> dict[str, ParallelStyle]:
    """A fresh name -> style table with every Hugging Face tensor-parallel plan string (the
    expert-parallel ones: :func:`shardkit.expert_parallel.ep_styles`)."""
    return {
        "colwise": ColwiseParallel(),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel(),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "packed_colwise": PackedColwiseParallel(),
        "packed_rowwise": PackedRowwiseParallel(),
        "embedding_rowwise": EmbeddingParallel(dim=0),
        "embedding_colwise": EmbeddingParallel(dim=1),
        "sequence_parallel": SequenceParallel(),
        "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
        "mla_kv_a_proj": MlaKvAProjParallel(),
        "moe_tp_experts": MoeTensorParallelExperts(),
        "moe_identity_expert": MoeIdentityExpert(),
    }


def model_tp_plan(model: nn.Module) -> dict:
    """The model's own plan: ``model.tp_plan`` (transformers >= 4.50; read through
    :func:`shardkit.comm._compat.hf_tp_plan`, which gives every supported release the newest one's
    rules), else ``_tp_plan`` plus the config's ``base_model_tp_plan`` under the base model prefix.

    Raises:
        ShardkitError: the model has no plan (pass ``plan=`` explicitly).
    """
    plan = hf_tp_plan(model)
    if not plan:
        plan = dict(getattr(model, "_tp_plan", None) or {})
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        plan.update({prefix + k: v for k, v in base.items()})
    if not plan:
        raise ShardkitError(
            f"apply_tp: {type(model).__name__} has no tensor-parallel plan; pass plan={{pattern: style}}"
        )
    return dict(plan)


def _regex(pattern: str) -> re.Pattern:
    return re.compile("".join("[^.]+" if c == "*" else re.escape(c) for c in pattern))


def _generic(name: str) -> str:
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


@dataclass
class CompiledPlan:
    """A plan with its patterns compiled and its style names resolved."""

    rules: list[tuple[str, re.Pattern, ParallelStyle]]
    base_prefix: str

    @classmethod
    def build(cls, plan: dict, model: nn.Module, styles: dict | None = None) -> CompiledPlan:
        table = {**default_styles(), **(styles or {})}
        rules = []
        for pattern, style in plan.items():
            if not isinstance(pattern, str):
                raise ShardkitTypeError(f"apply_tp: plan keys must be str patterns, got {pattern!r}")
            if isinstance(style, str):
                if style not in table:
                    raise ShardkitError(
                        f"apply_tp: unknown style {style!r} for {pattern!r}; known: {sorted(table)} (expert-parallel "
                        f"names: pass styles=shardkit.expert_parallel.ep_styles(), or the plan of ep_plan(model))"
                    )
                style = table[style]
            if not isinstance(style, ParallelStyle):
                raise ShardkitTypeError(
                    f"apply_tp: the style for {pattern!r} must be a name or a ParallelStyle, got {style!r}"
                )
            rules.append((pattern, _regex(pattern), style))
        prefix = getattr(model, "base_model_prefix", "")
        return cls(rules, f"{prefix}." if prefix and hasattr(model, prefix) else "")

    def match(self, name: str) -> tuple[str, ParallelStyle] | None:
        """The rule matching ``name`` (full or base-model-relative), or None.

        Raises:
            ShardkitError: two rules with different styles match the same name.
        """
        names = [name]
        if self.base_prefix and name.startswith(self.base_prefix):
            names.append(name[len(self.base_prefix) :])
        hits = {(p, id(s)): (p, s) for p, rx, s in self.rules if any(rx.fullmatch(n) for n in names)}
        if len({key[1] for key in hits}) > 1:
            raise ShardkitError(f"apply_tp: {name} matches several plan rules: {sorted(p for p, _ in hits.values())}")
        return next(iter(hits.values()), None)


@dataclass(frozen=True)
class PlanReport:
    """What a plan check found (names generic: layer indices replaced by ``*``).

    Attributes:
        unused_rules: plan patterns that matched no module or parameter.
        unsharded: parameters no rule covers; they stay replicated with plain gradients.
    """

    unused_rules: tuple[str, ...]
    unsharded: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.unused_rules and not self.unsharded


def verify_tp_plan(model: nn.Module, plan: dict | None = None, styles: dict | None = None) -> PlanReport:
    """Check ``plan`` (default: the model's own) against ``model``'s modules (pure: no group).

    Returns:
        A :class:`PlanReport` listing rules that matched nothing and parameters no rule covers.
    """
    compiled = CompiledPlan.build(model_tp_plan(model) if plan is None else plan, model, styles)
    used: set[str] = set()
    unsharded: dict[str, None] = {}
    for mname, module in model.named_modules():
        mrule = compiled.match(mname) if mname else None
        if mrule:
            used.add(mrule[0])
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            prule = compiled.match(full)
            if prule:
                used.add(prule[0])
            elif not mrule:
                unsharded[_generic(full)] = None
    unused = tuple(p for p, _, _ in compiled.rules if p not in used)
    return PlanReport(unused, tuple(unsharded))
