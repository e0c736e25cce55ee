"""Hugging Face's causal-LM loss on vocab-sharded logits (``apply_tp(..., loss_parallel=True)``).

Same contract as transformers' ``ForCausalLMLoss``: labels are shifted left by one (the last
position ignored), ``ignore_index`` tokens are skipped, and the loss is the token mean, or the
token sum divided by ``num_items_in_batch`` when that is given (gradient accumulation). The
logits are ``[B, S, V_r]``, this rank's vocabulary block; the full ``[B, S, V]`` is never built
(:func:`~.loss.vocab_parallel_cross_entropy`). Unlike transformers, float64 logits are not
rounded to float32 (half precision is computed in float32 as there).

Source: Megatron-LM vocab-parallel cross entropy (Shoeybi et al., 2019); transformers'
``ForCausalLMLoss`` for the label and reduction conventions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loss import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_causal_lm_loss"]


def vocab_parallel_causal_lm_loss(tp_mesh):
    """A ``model.loss_function`` replacement computing the causal-LM loss over ``tp_mesh``."""

    def loss_function(
        logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
    ):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(
            logits, shift_labels, tp_mesh, ignore_index=ignore_index, reduction=reduction
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    return loss_function
