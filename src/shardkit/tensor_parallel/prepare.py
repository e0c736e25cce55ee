"""Layout changes of a module's activations: ``PrepareModuleInput`` / ``PrepareModuleOutput``.

Sequence parallelism keeps hidden states ``[B, S_r, H]`` between blocks and needs the whole
sequence inside attention and the MLP. Preparing the block's input once (one all-gather whose
backward reduce-scatters the sum of the q/k/v partial gradients) replaces one ``f`` per
projection; the children's :class:`~.styles.ColwiseParallel` recognize the prepared tensor
through the model's :class:`~.sequence.SequenceSharding`.

Source: PyTorch DTensor's ``PrepareModuleInput`` / ``PrepareModuleOutput`` (layouts
:class:`~shardkit.sharding.Replicate` / :class:`~shardkit.sharding.Shard`), on shardkit's own
collectives; Megatron-LM sequence parallelism (Korthikanti et al., 2022).
"""

from __future__ import annotations

from torch import nn

from ..comm import all_reduce_forward
from ..errors import ShardkitError
from ..sharding import Partial, Replicate, Shard, check_layout
from .sequence import SequenceSharding
from .style_base import ParallelStyle, StyleContext, replace_input

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "layout_change"]


def _replace_output(out, fn):
    """Apply ``fn`` to a module's output, or to the first element of a tuple output."""
    if isinstance(out, tuple):
        return (fn(out[0]), *out[1:])
    return fn(out)


def layout_change(seq: SequenceSharding, src, dst, what: str, block: str | None = None):
    """The function taking a hidden-states tensor from layout ``src`` to ``dst`` (activations).

    ``Shard(d) -> Replicate()``: all-gather (backward reduce-scatter: the consumers return
    partial gradients); ``Replicate() -> Shard(d)``: split (backward all-gather);
    ``Replicate() -> Replicate()``: Megatron's ``f``; ``Partial() -> Shard(d)``: reduce-scatter
    (backward all-gather); ``Partial() -> Replicate()``: all-reduce (Megatron's ``g``); equal
    shards: identity.

    Raises:
        ShardkitError: a change between two different ``Shard`` dims, or to ``Partial()``.
    """
    check_layout(src, what, partial=True)
    check_layout(dst, what)
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return lambda x: seq.reduce_scatter(x, dst.dim)
        return lambda x: all_reduce_forward(x, seq.group)
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return lambda x: seq.gather(x, src.dim, block)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return lambda x: seq.split(x, dst.dim)
    if isinstance(src, Replicate):
        return seq.replicate
    if src.dim == dst.dim:
        return lambda x: x
    raise ShardkitError(f"{what}: no layout change from {src!r} to {dst!r}")


class PrepareModuleInput(ParallelStyle):
    """Change the layout of a module's hidden-states input (first positional or ``hidden_states=``).

    ``PrepareModuleInput(Shard(1), Replicate())`` on an attention block gathers the sequence
    once for q, k and v (their styles recognize the gathered tensor; the gather's backward
    reduce-scatters the sum of their partial gradients); ``(Replicate(), Shard(1))`` splits it
    (the sequence-parallel region starts there; backward all-gathers).

    Args:
        input_layouts: the layout the input arrives in.
        desired_input_layouts: the layout the module needs.
    """

    def __init__(
        self, input_layouts: Replicate | Shard = Shard(1), desired_input_layouts: Replicate | Shard = Replicate()
    ) -> None:
        self.input_layouts = check_layout(input_layouts, "PrepareModuleInput input_layouts")
        self.desired_input_layouts = check_layout(desired_input_layouts, "PrepareModuleInput desired_input_layouts")

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        assert ctx.seq is not None  # StyleContext.of and apply_tp always give one
        what = f"PrepareModuleInput at {ctx.name}"
        # block: with async TP, this gather's ring computes the matmuls of its registered readers
        fn = layout_change(ctx.seq, self.input_layouts, self.desired_input_layouts, what, ctx.name)
        module.register_forward_pre_hook(lambda m, args, kwargs: replace_input(args, kwargs, fn), with_kwargs=True)


class PrepareModuleOutput(ParallelStyle):
    """Change the layout of a module's output (or of the first element of a tuple output).

    ``PrepareModuleOutput(Shard(1), Replicate())`` after the last decoder layer of a pipeline
    stage gathers the sequence for a replicated stage boundary; the gradient arriving there is
    the full gradient on every rank, so backward keeps this rank's block (no communication).
    ``PrepareModuleOutput(Partial(), Shard(1))`` on a sequence-parallel MoE block reduce-scatters
    the sum of its routed and shared experts' partial outputs once.

    Args:
        output_layouts: the layout the module produces.
        desired_output_layouts: the layout its users need.
    """

    def __init__(
        self,
        output_layouts: Replicate | Shard | Partial = Shard(1),
        desired_output_layouts: Replicate | Shard = Replicate(),
    ) -> None:
        self.output_layouts = check_layout(output_layouts, "PrepareModuleOutput output_layouts", partial=True)
        self.desired_output_layouts = check_layout(desired_output_layouts, "PrepareModuleOutput desired_output_layouts")

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        src, dst, seq = self.output_layouts, self.desired_output_layouts, ctx.seq
        assert seq is not None  # StyleContext.of and apply_tp always give one
        if isinstance(src, Shard) and isinstance(dst, Replicate):
            fn = lambda x: seq.gather_replicated_grad(x, src.dim)  # noqa: E731
        else:
            fn = layout_change(seq, src, dst, f"PrepareModuleOutput at {ctx.name}")
        module.register_forward_hook(lambda m, args, out: _replace_output(out, fn))
