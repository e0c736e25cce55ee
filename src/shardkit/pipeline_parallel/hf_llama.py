"""Pipeline stages of a Hugging Face ``LlamaForCausalLM``: one tensor in, one tensor out.

Split rule (:func:`llama_stage_layers`): the ``L`` decoder layers are cut into ``P`` contiguous
blocks with :func:`~shardkit._shapes.balanced_split_sizes`, so the first ``L % P`` stages get
one layer more. The extras go to the front because the last stage also runs the final norm,
``lm_head`` and the loss. ``L >= P`` is required (every stage holds at least one layer).

Stage 0 holds ``embed_tokens`` and its layers; the last stage holds its layers, ``model.norm``
and ``lm_head``; every stage holds the (parameter-free) rotary embedding and rebuilds position
ids, rotary ``(cos, sin)`` and the causal mask from the sequence length exactly as
``LlamaModel.forward`` does, so a pipeline computes bitwise the same math as the full model.
Parameter names are the full model's (``model.layers.5.mlp.up_proj.weight``, ``lm_head.weight``):
layers live in a ``ModuleDict`` keyed by their global index, so a stage's ``state_dict`` merges
with the other stages' into the full model's without renaming.

Source: the layer partitioning of GPipe (Huang et al., 2019) and Megatron-LM's pipeline stages.
"""

from __future__ import annotations

import torch
from torch import nn

from .._shapes import balanced_split_sizes
from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["LlamaStageModule", "llama_stage_layers", "check_llama_pp"]


def llama_stage_layers(num_layers: int, num_stages: int) -> list[range]:
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
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ShardkitError(f"llama_stage_layers: num_stages must be an int >= 1, got {num_stages!r}")
    if num_layers < num_stages:
        raise ShardkitError(
            f"llama_stage_layers: {num_layers} decoder layers cannot fill {num_stages} pipeline stages "
            f"(need layers >= pp)"
        )
    out, start = [], 0
    for size in balanced_split_sizes(num_layers, num_stages):
        out.append(range(start, start + size))
        start += size
    return out


def check_llama_pp(config, num_stages: int) -> None:
    """Check that a Llama config can be cut into ``num_stages`` stages (pure).

    Raises:
        ShardkitError: fewer layers than stages, or tied word embeddings with more than one stage
            (``embed_tokens`` and ``lm_head`` would live on different ranks).
    """
    llama_stage_layers(config.num_hidden_layers, num_stages)
    if num_stages > 1 and getattr(config, "tie_word_embeddings", False):
        raise ShardkitError(
            "pipeline: tie_word_embeddings=True is not supported with pp > 1 (embed_tokens is on the first "
            "stage, lm_head on the last); use an untied model"
        )


class _Body(nn.Module):
    """Holds a stage's share of ``LlamaModel`` under the full model's attribute names."""


class LlamaStageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` of a ``LlamaForCausalLM``.

    ``forward(x)``: stage 0 takes input ids ``[B, S]`` (int64), the others hidden states
    ``[B, S, H]``; the last stage returns logits ``[B, S, V]``, the others hidden states
    ``[B, S, H]``. Full-sequence training forward only (no padding mask, no KV cache).

    Args:
        model: the full ``LlamaForCausalLM`` (same weights on every rank). Its modules are
            reused, not copied; the modules of other stages are simply not referenced, so each
            rank keeps only its stage's parameters once ``model`` is dropped.
        stage_index: this stage, ``0 <= stage_index < num_stages``.
        num_stages: ``P``.

    Raises:
        ShardkitTypeError: ``model`` does not have the Llama module layout.
        ShardkitError: see :func:`check_llama_pp`; a bad ``stage_index``.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int) -> None:
        super().__init__()
        try:
            base, config = model.model, model.config
            layers, lm_head = base.layers, model.lm_head
        except AttributeError as e:
            raise ShardkitTypeError(f"LlamaStageModule: expected a LlamaForCausalLM-shaped model: {e}") from e
        check_llama_pp(config, num_stages)
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ShardkitError(f"LlamaStageModule: stage_index must be in [0, {num_stages}), got {stage_index!r}")
        self.config = config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_indices = llama_stage_layers(config.num_hidden_layers, num_stages)[stage_index]
        self.model = _Body()
        if self.is_first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): layers[i] for i in self.layer_indices})
        self.model.rotary_emb = base.rotary_emb
        if self.is_last:
            self.model.norm = base.norm
            self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.model.embed_tokens(x) if self.is_first else x
        # As LlamaModel.forward without a cache: positions 0..S-1, the mask of the same config
        # (None with SDPA, which then runs is_causal).
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        position_embeddings = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
        if self.is_last:
            h = self.lm_head(self.model.norm(h))
        return h
