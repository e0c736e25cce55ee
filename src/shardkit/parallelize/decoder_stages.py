"""Pipeline stages of a Hugging Face decoder causal LM (llama, qwen2, qwen3, qwen3-moe, deepseek-v2, gemma2).

Model-family code, so it lives with the other per-family knowledge of :mod:`shardkit.parallelize`
(moved from ``shardkit.pipeline_parallel.hf_decoder``, whose runner never needs it).

Split rule (:func:`decoder_stage_layers`): the ``L`` decoder layers are cut into ``P``
contiguous blocks with :func:`~shardkit._shapes.balanced_split_sizes`, so the first ``L % P``
stages get one layer more. The extras go to the front because the last stage also runs the
final norm, ``lm_head`` and the loss. ``L >= P`` is required (every stage holds a layer).

Stage 0 holds ``embed_tokens`` and its layers; the last stage holds its layers, the final norm
and ``lm_head``; every stage holds the (parameter-free) rotary embedding and rebuilds what the
family's ``Model.forward`` derives before its layer loop (transformers 5.x): position ids
``0..S-1`` unless given, the causal mask of each layer (a sliding-window mask for layers of type
``sliding_attention`` in ``config.layer_types``, or for every layer when the config has a
``sliding_window`` but no layer types, as Qwen3-MoE does), and the rotary ``position_embeddings``.
The last stage applies the config's ``final_logit_softcapping`` (Gemma 2) to the logits as the
full model does; Gemma 2's scaled input embedding is its embedding module's own forward.
Every layer is called as the full model calls it, with extra keyword arguments passed through
(context parallelism's attention call), so a pipeline computes bitwise the same math.

Parameter names are the full model's (``model.layers.5.mlp.up_proj.weight``,
``lm_head.weight``): layers live in a ``ModuleDict`` keyed by their global index, so a stage's
``state_dict`` merges with the other stages' into the full model's, and the stage carries the
model's own tensor-parallel plan (``stage.tp_plan``, the rules that match it), so
``apply_tp(stage, tp_mesh)`` works unchanged (``sequence_parallel=True`` too).

Sequence-parallel boundaries (``sp_boundary = "shard"``, set by
:func:`~shardkit.parallelize.parallelize_stage` under sequence parallelism): a chunk's output
stays this tp rank's sequence block ``[B, S_r, H]`` (the row-parallel reduce-scatter's output)
and the next chunk's first layer takes it as its sequence-parallel input, as Megatron-LM's
pipeline sends the SP shard: ``tp`` times fewer bytes per rank than the replicated ``[B, S,
H]``. Such a chunk cannot see ``S`` in its input (balanced blocks of different ``S`` can have the
same size), so ``forward`` takes it from ``position_ids`` or ``seq_len`` (the trainer passes
``seq_len``; :attr:`DecoderStageModule.required_kwargs`); the masks and rotary embeddings are
built for ``S`` positions as the full model builds them.

Tied input/output embeddings with ``P > 1``: the first stage's ``embed_tokens`` and the last
stage's ``lm_head`` hold copies of one weight; :func:`sum_tied_embedding_grads` sums their
gradients between those two stages after backward (Megatron-LM's embedding group), so both
copies take the same optimizer step.

Source: the layer partitioning of GPipe (Huang et al., 2019) and Megatron-LM's pipeline stages;
the per-family forward of Hugging Face transformers' decoder models.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._shapes import balanced_split_sizes
from ..comm import ledger
from ..comm._group import resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from ..pipeline_parallel.chunked import chunk_layers
from ..pipeline_parallel.steps import global_chunk
from ..tensor_parallel.plan import CompiledPlan, model_tp_plan

if TYPE_CHECKING:
    from collections.abc import Iterator

    from transformers import PretrainedConfig

    from .._types import Group

__all__ = ["DecoderStageModule", "decoder_stage_layers", "check_pp", "sum_tied_embedding_grads"]


def decoder_stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder-layer indices of every stage (pure: no process group).

    Args:
        num_layers: ``L``, decoder layers of the model.
        num_stages: ``P``, pipeline stages.

    Returns:
        ``P`` contiguous ranges covering ``0..L-1``; the first ``L % P`` have one layer more,
        e.g. ``L=5, P=2 -> [range(0, 3), range(3, 5)]``.

    Raises:
        ShardkitError: ``P < 1`` or ``L < P`` (a stage without layers).
    """
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ShardkitError(f"decoder_stage_layers: num_stages must be an int >= 1, got {num_stages!r}")
    if num_layers < num_stages:
        raise ShardkitError(
            f"decoder_stage_layers: {num_layers} decoder layers cannot fill {num_stages} pipeline stages "
            f"(need layers >= pp)"
        )
    out, start = [], 0
    for size in balanced_split_sizes(num_layers, num_stages):
        out.append(range(start, start + size))
        start += size
    return out


def check_pp(config: PretrainedConfig, num_stages: int) -> None:
    """Check that a decoder config can be cut into ``num_stages`` stages (pure).

    Raises:
        ShardkitError: fewer layers than stages.
    """
    decoder_stage_layers(config.num_hidden_layers, num_stages)


class _Body(nn.Module):
    """Holds a stage's share of the base model under the full model's attribute names."""


def _plan_for(stage: nn.Module, plan: dict) -> dict:
    """The rules of ``plan`` that match a module or parameter of ``stage``."""
    compiled = CompiledPlan.build(plan, stage)
    used = set()
    for name, module in stage.named_modules():
        names = [name] + [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        for n in names:
            rule = compiled.match(n) if n else None
            if rule is not None:
                used.add(rule[0])
    return {k: v for k, v in plan.items() if k in used}


class DecoderStageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` of a Hugging Face decoder causal LM.

    ``forward(x, position_ids=None, attention_mask=None, **layer_kwargs)``: stage 0 takes input
    ids ``[B, S]`` (int64), the others hidden states ``[B, S, H]``; the last stage returns
    logits ``[B, S, V]``, the others hidden states ``[B, S, H]``. ``position_ids`` ``[B or 1,
    S]`` defaults to ``0..S-1`` (context parallelism passes the global positions of the local
    tokens); ``layer_kwargs`` go to every decoder layer (e.g. the ``shardkit_cp`` attention call
    of :meth:`shardkit.context_parallel.CPContext.shard_batch`); ``use_cache`` and ``input_ids``
    are ignored. Training forward only (no KV cache).

    Args:
        model: the full ``*ForCausalLM`` (same weights on every rank). Its modules are reused,
            not copied; the modules of other stages are simply not referenced, so each rank
            keeps only its stage's parameters once ``model`` is dropped.
        stage_index: this stage, ``0 <= stage_index < num_stages`` (the pipeline rank).
        num_stages: ``P``.
        virtual_stages: ``v``, chunks per rank: the layers are cut into ``P v`` chunks by
            :func:`~shardkit.pipeline_parallel.chunk_layers` and this module holds the ``v`` of its rank under
            ``placement`` (:mod:`shardkit.pipeline_parallel.steps`); ``forward(x, chunk=c)`` runs local chunk ``c`` (the
            embedding on chunk 0, the norm and head on the last) and :meth:`chunk_module` gives
            each chunk as a module for :class:`~shardkit.pipeline_parallel.PipelineStage`.
        placement: ``"looped"`` or ``"v"``.

    Raises:
        ShardkitTypeError: ``model`` does not have the decoder layout (``model.model.layers``,
            ``embed_tokens``, ``norm``, ``rotary_emb``, ``lm_head``).
        ShardkitError: see :func:`check_pp`; a bad ``stage_index``; fewer layers than ``P v``.
    """

    base_model_prefix = "model"

    def __init__(
        self, model: nn.Module, stage_index: int, num_stages: int, *, virtual_stages: int = 1, placement: str = "looped"
    ) -> None:
        super().__init__()
        try:
            base, config = model.model, model.config
            layers, lm_head = base.layers, model.lm_head
            embed, norm, rotary = base.embed_tokens, base.norm, base.rotary_emb
        except AttributeError as e:
            raise ShardkitTypeError(f"DecoderStageModule: expected a Hugging Face *ForCausalLM decoder: {e}") from e
        check_pp(config, num_stages)
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ShardkitError(f"DecoderStageModule: stage_index must be in [0, {num_stages}), got {stage_index!r}")
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        v = virtual_stages
        # the layers of each chunk this rank holds, and the global chunk of each (v = 1: the stage)
        self.chunk_layers = chunk_layers(config.num_hidden_layers, num_stages, v, placement, stage_index)
        self.chunks = [global_chunk(placement, stage_index, c, num_stages) for c in range(v)]
        self.is_first, self.is_last = 0 in self.chunks, num_stages * v - 1 in self.chunks
        # the two copies of a tied embedding are on ranks 0 and p - 1 (summed by
        # sum_tied_embedding_grads); "v" puts both ends on rank 0: one parameter, nothing to sum
        self.tied = num_stages > 1 and lm_head.weight is embed.weight and placement != "v"
        self.layer_indices = [i for r in self.chunk_layers for i in r]
        self.model = _Body()
        if self.is_first:
            self.model.embed_tokens = embed
        self.model.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_indices})
        self.model.rotary_emb = rotary
        if self.is_last:
            self.model.norm = norm
            self.lm_head = lm_head
        self._sliding = {i: self._is_sliding(i) for i in self.layer_indices}
        # "gathered": chunks exchange replicated [B, S, H]; "shard": each tp rank's sequence block
        self.sp_boundary = "gathered"
        try:
            plan = model_tp_plan(model)
        except ShardkitError:
            plan = {}
        self.tp_plan = _plan_for(self, plan) if plan else {}

    def _is_sliding(self, i: int) -> bool:
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return types[i] == "sliding_attention"
        return getattr(self.config, "sliding_window", None) is not None

    def _masks(self, h, attention_mask, position_ids) -> dict[bool, object]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        if isinstance(attention_mask, dict):  # ready masks per layer kind (the trainer's packed rows)
            return {
                s: attention_mask["sliding_attention" if s else "full_attention"] for s in set(self._sliding.values())
            }
        # transformers renamed the mask builders' `past_key_values` to `cache` (the old name warns
        # and is to be removed): pass whichever this version takes. No cache: stages train.
        cache_kw = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        kw = {
            "config": self.config,
            "inputs_embeds": h,
            "attention_mask": attention_mask,
            cache_kw: None,
            "position_ids": position_ids,
        }
        out = {}
        for sliding in set(self._sliding.values()):
            out[sliding] = (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kw)
        return out

    @property
    def required_kwargs(self) -> tuple[tuple[str, ...], ...]:
        """Keyword arguments every microbatch's call needs, each as its alternatives (checked by
        :func:`~shardkit.pipeline_parallel.run_schedule` on every rank before the first step):
        ``seq_len`` or ``position_ids`` with sequence-parallel boundaries, else none."""
        return (("seq_len", "position_ids"),) if self.sp_boundary == "shard" else ()

    def _length(self, h: torch.Tensor, first: bool, position_ids: torch.Tensor | None, seq_len: int | None) -> int:
        """``S``, the sequence length the layers attend over: ``h``'s own, unless ``h`` is this tp
        rank's block of it (a sequence-parallel boundary)."""
        if first or self.sp_boundary != "shard":
            return h.shape[1]
        if position_ids is not None:
            return position_ids.shape[-1]
        if seq_len is None:
            raise ShardkitError(
                "DecoderStageModule: with sequence-parallel stage boundaries a chunk's input is this tp "
                f"rank's block ({h.shape[1]} tokens) of a sequence whose length it cannot know: pass "
                "seq_len (or position_ids) in run_schedule's stage_kwargs"
            )
        return seq_len

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether local ``chunk`` is the model's first (embedding) and its last (norm, head)."""
        g = self.chunks[chunk]
        return g == 0, g == self.num_stages * len(self.chunks) - 1

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters local ``chunk`` uses (its layers; the embedding, norm and head at the ends)."""
        first, last = self._ends(chunk)
        mods = [self.model.layers[str(i)] for i in self.chunk_layers[chunk]]
        mods += ([self.model.embed_tokens] if first else []) + ([self.model.norm, self.lm_head] if last else [])
        return [p for m in mods for p in m.parameters()]

    def chunk_module(self, chunk: int) -> nn.Module:
        """Local ``chunk`` as a module of its own (for :class:`~shardkit.pipeline_parallel.PipelineStage`)."""
        return _DecoderChunk(self, chunk)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        chunk: int = 0,
        seq_len: int | None = None,
        **layer_kwargs: Any,
    ) -> torch.Tensor:
        layer_kwargs.pop("use_cache", None)
        layer_kwargs.pop("input_ids", None)
        first, last = self._ends(chunk)
        h = self.model.embed_tokens(x) if first else x
        S = self._length(h, first, position_ids, seq_len)
        if position_ids is None:  # as the full model without a cache
            position_ids = torch.arange(S, device=h.device).unsqueeze(0)
        # a sequence block: the mask builders read only the batch, length, dtype and device
        masks = self._masks(h if S == h.shape[1] else h.new_empty((h.shape[0], S, 0)), attention_mask, position_ids)
        position_embeddings = self.model.rotary_emb(h, position_ids=position_ids)
        for i in self.chunk_layers[chunk]:
            h = self.model.layers[str(i)](
                h,
                attention_mask=masks[self._sliding[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                **layer_kwargs,
            )
        if last:
            h = self.lm_head(self.model.norm(h))
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap:  # Gemma 2's final logit softcap, as its *ForCausalLM.forward applies it
                h = torch.tanh(h / cap) * cap
        return h


class _DecoderChunk(nn.Module):
    """One local chunk of a :class:`DecoderStageModule`: ``forward`` runs that chunk and
    ``parameters()`` yields its parameters. The stage module stays their only owner (it is what
    the optimizer, the data-parallel wrappers and checkpoints see), so it is not a submodule."""

    def __init__(self, owner: DecoderStageModule, chunk: int) -> None:
        super().__init__()
        self.__dict__["owner"] = owner  # bypasses Module.__setattr__: not registered
        self.chunk = chunk

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.__dict__["owner"](x, chunk=self.chunk, **kwargs)

    @property
    def required_kwargs(self) -> tuple[tuple[str, ...], ...]:
        return self.__dict__["owner"].required_kwargs

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self.__dict__["owner"].chunk_parameters(self.chunk))


def sum_tied_embedding_grads(stage_module: DecoderStageModule, pp_group: Group) -> None:
    """Sum the tied embedding's gradient between the first and the last stage (collective over
    those two stages; others return at once). Call after backward, before the optimizer step.

    The first stage's ``embed_tokens.weight`` and the last stage's ``lm_head.weight`` are copies
    of one parameter; each gets ``grad_first + grad_last`` (one send and one receive each, the
    sum computed in the same order on both, so the copies stay bitwise equal). With tensor
    parallelism inside the stages both copies must be cut the same way (the plans' vocab-row
    shards are), and ``pp_group`` is the group of this tp rank's stages.

    Args:
        stage_module: this rank's :class:`DecoderStageModule`.
        pp_group: the pipeline ``ProcessGroup`` or 1-D ``DeviceMesh`` (group rank = stage).

    Raises:
        ShardkitError: the group size differs from the number of stages, or this rank's group
            rank is not its stage index.
    """
    op = "sum_tied_embedding_grads"
    g = resolve_group(pp_group, op)
    P, s = stage_module.num_stages, stage_module.stage_index
    if g.size != P or g.rank != s:
        raise ShardkitError(
            f"{op}: the pipeline group has {g.size} ranks (this one {g.rank}) but the stage is {s} of {P}"
        )
    if not stage_module.tied or not (stage_module.is_first or stage_module.is_last):
        return
    p = stage_module.model.embed_tokens.weight if stage_module.is_first else stage_module.lm_head.weight
    mine = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
    theirs = torch.empty_like(mine)
    peer = P - 1 if stage_module.is_first else 0
    ops = [
        dist.P2POp(dist.isend, mine, group=g.pg, group_peer=peer),
        dist.P2POp(dist.irecv, theirs, group=g.pg, group_peer=peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ledger.record("send", op, "backward", g.size, mine.nbytes, 0, pg=g.pg, peer=peer, dtype=mine.dtype)
    ledger.record("recv", op, "backward", g.size, 0, theirs.nbytes, pg=g.pg, peer=peer, dtype=theirs.dtype)
    first, last = (mine, theirs) if stage_module.is_first else (theirs, mine)
    p.grad = first + last
