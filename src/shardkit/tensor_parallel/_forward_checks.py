"""Check mode for a tensor-parallel model: one agreement per forward instead of one per op.

A tensor-parallel forward issues a dozen collectives over tp (Megatron-SP: an all-gather and a
reduce-scatter around attention and around the MLP of every layer). Every one of their
message sizes is a function of the forward's inputs and of the plan and weight shapes, and
those the check mode can agree once: the plan and weights by the fingerprint at
:func:`~shardkit.apply_tp`, the inputs here, at the start of every forward of the root model.
The contract of a tensor-parallel model is that its inputs are replicated over tp (the same
``input_ids`` on every tp rank), so this agreement checks their values too (their checksums):
tp ranks fed different batches are one error on every rank, not a silently wrong model.

After it, the ops over the tp group inside that forward skip their own agreement (they still
raise their local errors); ops over other groups (cp, ep, dp) are still checked one by one.
Whether an op is checked is then still the same on every rank: the region is entered right
after a collective agreement and left when the forward returns (or raises), the same program
points on every tp rank. Only a forward given ``input_ids`` (the replicated-input contract) is
covered; a pipeline stage fed hidden states keeps the per-op checks.

Measured: ``shardkit bench --cases checks_train`` (docs/reliability.md).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm._group import GroupInfo
from ..comm.checks import checks_enabled, cover
from ..comm.fingerprint import fingerprint

__all__ = ["install_forward_checks"]


def _inputs(args, kwargs) -> dict[str, torch.Tensor] | None:
    """The forward's tensor inputs by name, or None without ``input_ids`` (not covered)."""
    tensors = {f"args[{i}]": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    tensors.update((k, v) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))
    if "input_ids" in tensors or ("args[0]" in tensors and not tensors["args[0]"].is_floating_point()):
        return tensors
    return None


def install_forward_checks(model: nn.Module, g: GroupInfo) -> None:
    """Register the hooks on ``model`` (the root :func:`~shardkit.apply_tp` sharded); they act
    only while the check mode is on."""
    entered: list[bool] = []  # one flag per forward in progress (forwards may nest)

    def before(module, args, kwargs):
        tensors = _inputs(args, kwargs) if checks_enabled() else None
        entered.append(False)  # popped by ``after`` even when the agreement raises
        if tensors is not None:
            fingerprint(tensors, g.pg, f"{type(module).__name__}.forward", hint="tp ranks must get the same inputs")
            cover(g.pg, True)
            entered[-1] = True

    def after(module, args, kwargs, output):
        if entered and entered.pop():
            cover(g.pg, False)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
