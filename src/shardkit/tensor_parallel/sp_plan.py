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
  boundary stays replicated; unless the model's ``sp_boundary`` is ``"shard"`` (a pipeline
  stage sending its sequence block, Megatron-LM's SP pipeline): then no chunk gathers its
  output and a chunk without the embedding takes its input as the block, its first layer
  declaring the split sizes of ``S`` (its ``position_ids``' length).

Mixture-of-experts blocks (tensor-parallel experts, ``moe_tp_experts``): the block gathers its
input once; the router (replicated) reads it through :meth:`~.sequence.SequenceSharding.
partial_grad` (its input gradient is the same on every rank, so each rank hands back only its
sequence block to the gather's reduce-scatter); the experts keep ``f`` on the routing weights
only and leave their output partial, as do the shared experts' row-parallel ``down_proj``; the
block's output, the sum of those partial outputs, is reduce-scattered once
(``PrepareModuleOutput(Partial(), Shard(1))``). Multi-head latent attention (DeepSeek-V2):
``kv_a_proj_with_mqa`` and ``q_a_proj`` (replicated) read the gathered input through
``partial_grad`` too.

Expert-parallel MoE blocks (experts left out of the plan: ``shardkit.parallelize`` with
``ep > 1`` dispatches them over ``ep``): the block runs on this rank's sequence block, no gather
and no reduce-scatter. Each rank's tokens are its own, so the token dispatch sends them straight
to their experts; the router (replicated) is :class:`~.replicated.SequenceParallel` (its
gradient, a sum over local tokens, is summed over tp); shared experts, a tensor-parallel MLP,
gather their input and reduce-scatter their output like a dense block.

Source: Megatron-LM sequence parallelism (Korthikanti et al., 2022); the plan shape of
torchtitan's ``parallelize_llama`` (PyTorch DTensor styles).
"""

from __future__ import annotations

import copy

from torch import nn

from .._shapes import balanced_split_sizes
from ..errors import ShardkitError
from ..sharding import Partial, Replicate, Shard
from .moe import MoeTensorParallelExperts
from .plan import CompiledPlan
from .prepare import PrepareModuleInput, PrepareModuleOutput
from .replicated import SequenceParallel
from .style_base import ParallelStyle, StyleContext, replace_input
from .styles import ColwiseParallel, RowwiseParallel

__all__ = ["sequence_parallel_plan", "sequence_parallel_error", "decoder_layers"]

_BLOCKS = ("self_attn", "mlp")
# Replicated modules that read a block's gathered input directly (their input gradient is the
# same on every rank): MLA's latent projections, an MoE block's router.
_REPLICATED_READERS = {"self_attn": ("kv_a_proj_with_mqa", "q_a_proj"), "mlp": ("gate",)}


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
    if not decoder_layers(model):
        return (
            f"{type(model).__name__} has no decoder layers (a 'layers' ModuleList/ModuleDict whose layers have "
            "self_attn and mlp)"
        )
    return None


def _norms(module: nn.Module, prefix: str) -> list[str]:
    """Names of the parameterized direct children of ``module`` that are not its blocks: the norms."""
    return [
        f"{prefix}.{n}" for n, m in module.named_children() if n not in _BLOCKS and any(True for _ in m.parameters())
    ]


def sequence_parallel_plan(
    model: nn.Module, plan: dict, *, loss_parallel: bool = False, styles: dict[str, ParallelStyle] | None = None
) -> dict:
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
            modules outside the attention / MLP blocks or of different layouts; experts that
            are not ``moe_tp_experts`` (expert-parallel dispatch).
    """
    error = sequence_parallel_error(model)
    if error is not None:
        raise ShardkitError(f"apply_tp(sequence_parallel=True): {error}")
    compiled = CompiledPlan.build(plan, model, styles)
    layers = decoder_layers(model)
    moe = {f"{n}.mlp" for n, layer in layers if hasattr(layer.mlp, "experts")}
    ep_moe = {block for block in moe if compiled.match(f"{block}.experts") is None}  # expert-parallel experts
    moe -= ep_moe
    shared = {
        f"{block}.shared_experts"
        for block in ep_moe
        if isinstance(getattr(model.get_submodule(block), "shared_experts", None), nn.Module)
    }
    dense = {f"{n}.{b}" for n, _ in layers for b in _BLOCKS} - moe - ep_moe
    out = {pattern: style for pattern, _, style in compiled.rules}
    _sequence_outputs(model, compiled, out, dense | shared, moe)
    for name, layer in layers:
        for b in _BLOCKS:
            block = f"{name}.{b}"
            gather_in = PrepareModuleInput(Shard(1), Replicate())
            if block in ep_moe:  # runs on the local tokens: only the router and shared experts change
                rule = compiled.match(f"{block}.gate")
                if rule is not None:
                    out.pop(rule[0], None)
                out[f"{block}.gate"] = SequenceParallel() if rule is None else _Chain(rule[1], SequenceParallel())
                if f"{block}.shared_experts" in shared:
                    out[f"{block}.shared_experts"] = gather_in
                continue
            # exact names: a layer's blocks may differ from the next one's (dense and MoE layers)
            out[block] = _Chain(gather_in, PrepareModuleOutput(Partial(), Shard(1))) if block in moe else gather_in
            for child in _REPLICATED_READERS[b]:
                if isinstance(getattr(getattr(layer, b), child, None), nn.Module):
                    key = f"{block}.{child}"
                    rule = compiled.match(f"{block}.{child}")
                    reader: ParallelStyle = _PartialGradInput()
                    if rule is not None:
                        out.pop(rule[0], None)
                        reader = _Chain(rule[1], reader)
                    out[key] = reader
        for norm in _norms(layer, name):
            out[norm] = SequenceParallel()
    # a pipeline rank holding several chunks (virtual stages): each chunk's input is split and
    # each chunk's output gathered, as for a whole stage; the head follows the last chunk
    segments = _chunk_segments(model, layers)
    sharded = getattr(model, "sp_boundary", "gathered") == "shard"
    chunks = getattr(model, "chunks", None) or [0] * len(segments)  # global chunk: 0 holds the embedding
    for k, (first, _) in enumerate(segments):
        out[first] = _ShardedInput() if sharded and chunks[k] != 0 else PrepareModuleInput(Replicate(), Shard(1))
    for first, last in segments[:-1] if not sharded else []:
        gather = PrepareModuleOutput(Shard(1), Replicate())
        out[last] = _Chain(out[first], gather) if last == first else gather
    first, last = segments[-1]
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
        out["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate()
        )
    elif not sharded:
        gather = PrepareModuleOutput(Shard(1), Replicate())
        out[last] = _Chain(out[first], gather) if last == first else gather
    return out


def _chunk_segments(model: nn.Module, layers: list) -> list[tuple[str, str]]:
    """(first, last) layer name of each chunk of ``model`` in forward order: its ``chunk_layers``
    (a pipeline stage holding several chunks), else one segment of every layer."""
    sizes = [len(r) for r in getattr(model, "chunk_layers", None) or [layers]]
    out, start = [], 0
    for n in sizes:
        out.append((layers[start][0], layers[start + n - 1][0]))
        start += n
    return out


def _sequence_outputs(model: nn.Module, compiled: CompiledPlan, out: dict, dense: set, moe: set) -> None:
    """Give the rules of the blocks' output modules their sequence-parallel layouts, in ``out``.

    Row-parallel outputs of dense blocks: ``Shard(1)`` (reduce-scatter); row-parallel modules
    and tensor-parallel experts inside an MoE block: ``Partial()`` (the block reduces once).
    """
    modes: dict[str, set] = {}
    for name, _ in model.named_modules():
        rule = compiled.match(name) if name else None
        if rule is None:
            continue
        parent = name.rsplit(".", 1)[0]
        in_moe = any(name.startswith(m + ".") for m in moe)
        if isinstance(rule[1], RowwiseParallel):
            mode = "shard" if parent in dense else "partial" if in_moe else "outside"
        elif in_moe and name.endswith(".experts"):
            if not isinstance(rule[1], MoeTensorParallelExperts):
                raise ShardkitError(
                    f"apply_tp(sequence_parallel=True): {name} uses {type(rule[1]).__name__}; sequence "
                    "parallelism is implemented for tensor-parallel experts (moe_tp_experts) only, "
                    "not for expert-parallel token dispatch"
                )
            mode = "experts"
        else:
            continue
        modes.setdefault(rule[0], set()).add(mode)
    for pattern, kinds in modes.items():
        if len(kinds) != 1 or "outside" in kinds:
            raise ShardkitError(
                f"apply_tp(sequence_parallel=True): the rule {pattern!r} matches modules of different "
                f"sequence layouts ({sorted(kinds)}; 'outside' = not in a decoder layer's blocks)"
            )
        (kind,) = kinds
        if kind == "experts":
            out[pattern] = MoeTensorParallelExperts(reduce_input_grad=False, output_layouts=Partial())
            continue
        sp = copy.copy(out[pattern])
        sp.output_layouts = Shard(1) if kind == "shard" else Partial()
        out[pattern] = sp


class _PartialGradInput(ParallelStyle):
    """A replicated module reading a block's gathered input: its input gradient (the same on every
    rank) is handed back as this rank's sequence block (:meth:`.sequence.SequenceSharding.partial_grad`)."""

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        seq = ctx.seq
        assert seq is not None  # StyleContext.of and apply_tp always give one
        module.register_forward_pre_hook(
            lambda m, args, kwargs: replace_input(args, kwargs, seq.partial_grad), with_kwargs=True
        )


class _ShardedInput(ParallelStyle):
    """The first layer of a pipeline chunk whose input arrives as this rank's sequence block:
    declares this forward's split sizes, balanced over ``S`` = the length of the layer's
    ``position_ids`` (:meth:`.sequence.SequenceSharding.set_sizes`), as a split would have."""

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        seq = ctx.seq
        assert seq is not None  # StyleContext.of and apply_tp always give one

        def declare(m: nn.Module, args: tuple, kwargs: dict) -> None:
            pos, x = kwargs.get("position_ids"), args[0] if args else kwargs.get("hidden_states")
            if pos is None or x is None:
                raise ShardkitError(f"{ctx.name}: a sequence-block input needs hidden_states and position_ids")
            sizes = balanced_split_sizes(pos.shape[-1], seq.info.size)
            if x.shape[1] != sizes[seq.info.rank]:
                raise ShardkitError(
                    f"{ctx.name}: tp rank {seq.info.rank} of {seq.info.size} got {x.shape[1]} tokens, but its "
                    f"block of {pos.shape[-1]} is {sizes[seq.info.rank]} (sizes {sizes})"
                )
            seq.set_sizes(sizes)

        module.register_forward_pre_hook(declare, with_kwargs=True)


class _Chain(ParallelStyle):
    """Several styles on one module, applied in order (an MoE block's input gather and output
    reduce-scatter; a one-layer stage's split and gather; MLA's ``mla_kv_a_proj`` and its input's
    partial gradient)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        self.styles = styles

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        for style in self.styles:
            style.apply_module(module, ctx)
