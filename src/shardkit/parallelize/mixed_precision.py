"""Mixed precision: bfloat16 compute on float32 master parameters, every gradient reduction in float32.

One design for every path (FSDP2 / HSDP, replicated dp, tp, cp, ep, pp):

* **Masters.** Parameters stay float32: the optimizer updates them and keeps its state in float32.
* **Compute.** Each decoder block, and the root module for the parameters outside the blocks
  (embedding, final norm, ``lm_head``), runs its forward on a bfloat16 copy of its parameters made
  when that forward starts (FSDP2's ``param_dtype``, a per-block cast). Activations are then
  bfloat16, and so are the collectives that move them, forward and backward: tp's f/g and the
  sequence-parallel gathers, cp's all-to-all and ring, ep's token dispatch, pp's send/recv, and
  FSDP2's parameter all-gathers.
* **Reductions.** The copy is a differentiable cast: its backward hands each master a float32
  gradient. So every reduction of a *parameter* gradient runs in float32: FSDP2's reduce-scatter
  (and HSDP's all-reduce) with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, :class:`~shardkit.data_parallel.GradientSync`'s ``dp_cp`` / ``edp``
  all-reduces, and tp's ``sum_grad_over`` hooks on replicated weights (they sit on the master).

FSDP2 casts the parameters it owns itself (its policy, :func:`fsdp_policy`); the wrapper of
:func:`apply_mixed_precision` casts, when the forward starts, every floating parameter of the
module not yet in the compute dtype: the ones FSDP2 leaves out, and all of them without FSDP2.
It is applied after tp, cp and ep and before activation checkpointing, so a recomputed block
casts again inside the checkpoint (its recompute sees the same bfloat16 weights).

Source: PyTorch FSDP2 ``MixedPrecisionPolicy`` (module-level casts, float32 reduce dtype);
torchtitan's ``parallelize_llama`` (bf16 params, fp32 reductions); Megatron-LM's fp32 main
parameters and gradients; Micikevicius et al. 2018, "Mixed Precision Training".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import ShardkitError

__all__ = ["MIXED_PRECISION", "apply_mixed_precision", "check_mixed_precision", "compute_dtype", "fsdp_policy"]

# The modes: "none" (compute in the parameters' dtype) and "bf16".
MIXED_PRECISION = ("none", "bf16")
_COMPUTE = {"bf16": torch.bfloat16}


def check_mixed_precision(mode: str, where: str = "parallelize") -> str:
    """``mode`` if it is one of :data:`MIXED_PRECISION`.

    Raises:
        ShardkitError: any other value, naming ``where`` and the allowed modes.
    """
    if mode not in MIXED_PRECISION:
        raise ShardkitError(f"{where}: mixed precision must be one of {', '.join(MIXED_PRECISION)}; got {mode!r}")
    return mode


def compute_dtype(mode: str) -> torch.dtype | None:
    """The forward / backward compute dtype of ``mode`` (None for ``"none"``)."""
    return _COMPUTE.get(check_mixed_precision(mode))


def fsdp_policy(mode: str):
    """FSDP2's ``MixedPrecisionPolicy`` for ``mode``: bf16 parameters, float32 gradient reductions.

    ``"none"``: the default policy (everything in the parameters' dtype).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = compute_dtype(mode)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _slots(module: nn.Module, skip: set[int]) -> list[tuple[nn.Module, str]]:
    """``(owner, name)`` of every parameter under ``module`` whose id is not in ``skip`` (looked up
    by name at call time: FSDP2 replaces the parameter objects after this wrapper is applied)."""
    return [
        (owner, name)
        for owner in module.modules()
        for name, p in owner._parameters.items()
        if p is not None and id(p) not in skip
    ]


def _cast_forward(forward: Callable, slots: list[tuple[nn.Module, str]], dtype: torch.dtype, *args, **kwargs):
    swapped = []
    try:
        for owner, name in slots:
            p = owner._parameters[name]
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                # the differentiable cast: backward hands the float32 master a float32 gradient
                owner._parameters[name] = p.to(dtype)  # type: ignore[assignment]
                swapped.append((owner, name, p))
        return forward(*args, **kwargs)
    finally:
        for owner, name, p in reversed(swapped):
            owner._parameters[name] = p


def apply_mixed_precision(model: nn.Module, blocks: Sequence[nn.Module], mode: str) -> None:
    """Run each block's and the root's forward on a compute-dtype copy of their parameters, in place.

    Args:
        model: the (stage) model after tp, cp and ep (before activation checkpointing and FSDP2).
        blocks: its decoder blocks; each casts its own parameters, the root the rest.
        mode: one of :data:`MIXED_PRECISION`; ``"none"`` changes nothing.

    Raises:
        ShardkitError: an unknown mode; a floating parameter that is not float32 (the masters
            must be float32: build the model in float32).
    """
    dtype = compute_dtype(mode)
    if dtype is None:
        return
    wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if wrong:
        raise ShardkitError(
            f"mixed_precision={mode!r} keeps float32 master parameters: build the model in float32; "
            f"{wrong[0][0]} is {wrong[0][1]}"
        )
    inside: set[int] = set()
    for block in blocks:
        block.forward = _wrapped(block.forward, _slots(block, set()), dtype)
        inside.update(id(p) for p in block.parameters())
    model.forward = _wrapped(model.forward, _slots(model, inside), dtype)


def _wrapped(forward: Callable, slots: list[tuple[nn.Module, str]], dtype: torch.dtype) -> Callable:
    # keeps the forward's name and signature visible (inspect follows __wrapped__)
    return functools.update_wrapper(functools.partial(_cast_forward, forward, slots, dtype), forward)
