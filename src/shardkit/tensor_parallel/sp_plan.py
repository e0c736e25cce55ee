"""Sequence parallelism as a plan option: a decoder model's tensor-parallel plan turned into its
sequence-parallel plan (``apply_tp(..., sequence_parallel=True)``).

Between blocks each tp rank holds a block of the sequence, hidden states ``[B, S_r, H]``
(balanced sizes of ``S``, any ``S``). The plan, for every decoder layer (a module with
``self_attn`` and ``mlp`` children) of ``R`` tp ranks:

* the first layer's input is split along the sequence (``PrepareModuleInput(Replicate(),
  Shard(1))``; backward all-gathers). Not at the embedding: Hugging Face models derive the
  causal mask and position ids from the embedding output's length;
* the layer's norms run on the local block: :class:`~.replicated.SequenceParallel` (replicated
  weight, gradient summed over tp);
* ``self_attn`` and ``mlp`` gather their input once (``PrepareModuleInput(Shard(1),
  Replicate())``; backward reduce-scatter), shared by q/k/v and by gate/up; their row-parallel
  output projections reduce-scatter along the sequence (``RowwiseParallel(output_layouts=
  Shard(1))``) instead of all-reducing;
* after the last layer: the final norm on blocks and ``lm_head`` gathering its input
  (``ColwiseParallel(input_layouts=Shard(1))``), logits gathered over the vocabulary unless
  ``loss_parallel``; a model without ``lm_head`` (a pipeline stage before the last) gathers the
  last layer's output instead (``PrepareModuleOutput(Shard(1), Replicate())``), so its
  boundary stays replicated.

Refused (:class:`~shardkit.ShardkitError`): MoE blocks and DeepSeek's multi-head latent
attention. Their blocks hold replicated submodules that read the gathered input (the router,
``kv_a_proj_with_mqa`` / ``q_a_proj``) next to tensor-parallel ones, and the expert outputs are
all-reduced inside the experts module; the sequence layout of those paths is not implemented.

Source: Megatron-LM sequence parallelism (Korthikanti et al., 2022); the plan shape of
torchtitan's ``parallelize_llama`` (PyTorch DTensor styles).
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import ShardkitError
from ..layouts import Replicate, Shard
from .plan import CompiledPlan
from .prepare import PrepareModuleInput, PrepareModuleOutput
from .replicated import SequenceParallel
from .styles import ColwiseParallel, ParallelStyle, RowwiseParallel, StyleContext

__all__ = ["sequence_parallel_plan", "sequence_parallel_error", "decoder_layers"]

_BLOCKS = ("self_attn", "mlp")
_MLA = ("kv_a_proj_with_mqa", "q_a_proj")


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every decoder layer, in forward order: the children of the model's
    ``layers`` container (``nn.ModuleList`` or ``nn.ModuleDict``) with ``self_attn`` and ``mlp``."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            layers = [(f"{name}.{k}", m) for k, m in module.named_children()]
            if layers and all(all(hasattr(m, b) for b in _BLOCKS) for _, m in layers):
                return layers
    return []


def sequence_parallel_error(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the sequence-parallel plan, or None (pure: no group)."""
    layers = decoder_layers(model)
    if not layers:
        return (f"{type(model).__name__} has no decoder layers (a 'layers' ModuleList/ModuleDict whose layers have "
                "self_attn and mlp)")
    for name, layer in layers:
        if hasattr(layer.mlp, "experts"):
            return (f"{name}.mlp is a mixture-of-experts block: its router reads the gathered sequence next to the "
                    "tensor-parallel experts, whose outputs are all-reduced inside the experts module; sequence "
                    "parallelism is not implemented for MoE blocks (use sequence_parallel=False)")
        if any(hasattr(layer.self_attn, m) for m in _MLA):
            return (f"{name}.self_attn is multi-head latent attention: its replicated kv_a_proj_with_mqa / q_a_proj "
                    "read the gathered sequence next to the column-parallel projections; sequence parallelism is "
                    "not implemented for MLA (use sequence_parallel=False)")
    return None


def _norms(module: nn.Module, prefix: str) -> list[str]:
    """Names of the parameterized direct children of ``module`` that are not its blocks: the norms."""
    return [f"{prefix}.{n}" for n, m in module.named_children()
            if n not in _BLOCKS and any(True for _ in m.parameters())]


def _generic(name: str) -> str:
    from .plan import _generic as generic

    return generic(name)


def sequence_parallel_plan(model: nn.Module, plan: dict, *, loss_parallel: bool = False, styles=None) -> dict:
    """``plan`` (the model's tensor-parallel plan) turned into its sequence-parallel plan.

    Args:
        model: a decoder causal LM (or a pipeline stage of one) with Hugging Face module names.
        plan: its tensor-parallel plan (style names or objects).
        loss_parallel: keep ``lm_head``'s logits vocab-sharded.
        styles: extra named styles, as for :func:`shardkit.apply_tp`.

    Returns:
        A new plan: ``{pattern: style}`` with the rules of the module docstring added or replaced.

    Raises:
        ShardkitError: see :func:`sequence_parallel_error`; a row-parallel rule that matches
            modules both inside and outside the attention / MLP blocks.
    """
    error = sequence_parallel_error(model)
    if error is not None:
        raise ShardkitError(f"apply_tp(sequence_parallel=True): {error}")
    compiled = CompiledPlan.build(plan, model, styles)
    layers = decoder_layers(model)
    block_names = {f"{n}.{b}" for n, _ in layers for b in _BLOCKS}
    out = {pattern: style for pattern, _, style in compiled.rules}
    # Row-parallel outputs of the attention / MLP blocks: reduce-scatter along the sequence.
    inside: dict[str, bool] = {}
    for name, _ in model.named_modules():
        rule = compiled.match(name) if name else None
        if rule is not None and isinstance(rule[1], RowwiseParallel):
            inside.setdefault(rule[0], True)
            inside[rule[0]] &= name.rsplit(".", 1)[0] in block_names
    for pattern, ok in inside.items():
        if not ok:
            raise ShardkitError(f"apply_tp(sequence_parallel=True): the rowwise rule {pattern!r} matches modules outside "
                                "the decoder layers' self_attn / mlp blocks")
        sp = copy.copy(out[pattern])
        sp.output_layouts = Shard(1)
        out[pattern] = sp
    for name, layer in layers:
        for b in _BLOCKS:
            out[_generic(f"{name}.{b}")] = PrepareModuleInput(Shard(1), Replicate())
        for norm in _norms(layer, name):
            out[_generic(norm)] = SequenceParallel()
    first, last = layers[0][0], layers[-1][0]
    out[first] = PrepareModuleInput(Replicate(), Shard(1))
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        parent = first.rsplit(".", 2)[0] if first.count(".") >= 2 else ""
        base = model.get_submodule(parent) if parent else model
        for n, m in base.named_children():
            if n not in ("layers", "embed_tokens", "rotary_emb") and any(True for _ in m.parameters()):
                out[f"{parent}.{n}" if parent else n] = SequenceParallel()  # the final norm
        rule = compiled.match("lm_head")
        if rule is not None:
            del out[rule[0]]
        out["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate())
    else:
        gather = PrepareModuleOutput(Shard(1), Replicate())
        out[last] = _Chain(out[first], gather) if last == first else gather
    return out


class _Chain(ParallelStyle):
    """Two styles on one module (a one-layer stage: split its input, gather its output)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        self.styles = styles

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        for style in self.styles:
            style.apply_module(module, ctx)
