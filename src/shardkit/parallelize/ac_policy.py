"""Activation checkpointing as a policy object: :class:`ACPolicy` (ops to save, per-module-name
overrides, every N-th block), and the named presets it generalizes.

* ``"none"``: no block is checkpointed.
* ``"full"`` = ``ACPolicy(save_ops=frozenset(), overrides={}, every=1)``: every block recomputes
  whole in backward (no dispatch mode: torch.compile and the check mode compose with it).
* ``"selective"`` = ``ACPolicy()``: the outputs of :data:`SAVED_OPS` (matmuls, attention) are
  kept, except inside :data:`OUTPUT_PROJECTIONS` (overridden to ``"recompute"``).
* ``"selective:N"`` (``shardkit train --ac selective:N``) = ``ACPolicy(save_ops=frozenset(),
  overrides={}, every=N)``: torchtitan's layer-level selective checkpointing, every N-th block
  (``N - 1, 2N - 1, ...`` of the blocks handed to :func:`~.checkpointing.apply_ac`) recomputes
  whole and the others keep everything.

A policy decides per op of a checkpointed block (torch's SAC,
:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): inside a submodule whose
name matches an override, ``"recompute"`` keeps nothing and ``"save"`` keeps the outputs of
:data:`SAVED_OPS` and of ``save_ops``; elsewhere the outputs of ``save_ops`` are kept. Names
match a submodule's name relative to the block (``"self_attn.o_proj"``) exactly, by a dotted
suffix (``"o_proj"``) or as an ``fnmatch`` pattern (``"mlp.*_proj"``); the innermost matching
submodule decides, the last matching override of it wins.

Source: torchtitan ``apply_ac`` (op-level SAC with an op save list, per-FQN forced recompute,
layer-level selective ``selective_ac_option=N``); Korthikanti et al. 2022 (selective recompute).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from .._rules import ac_rule, parse_ac
from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["ACPolicy", "BlockPolicy", "OUTPUT_PROJECTIONS", "SAVED_OPS", "ac_kind", "as_policy"]


def _aten_ops(*names: str) -> frozenset:
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# Outputs the selective policy keeps: the matmuls and the attention kernels (the expensive ops).
SAVED_OPS = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)

# Submodules (transformers' names) whose matmul outputs the selective policy recomputes
# (checkpointing's module docstring: kept, they made a selective block hold more than none).
OUTPUT_PROJECTIONS = ("o_proj", "down_proj")

_RULES = ("save", "recompute")


def _overrides(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = tuple((str(k), str(v)) for k, v in items)
    bad = [f"{k}: {v!r}" for k, v in out if v not in _RULES]
    if bad:
        raise ShardkitError(f"ACPolicy: an override must be 'save' or 'recompute'; got {', '.join(bad)}")
    return out


@dataclass(frozen=True)
class ACPolicy:
    """Which activations a checkpointed decoder block keeps (module docstring).

    Args:
        save_ops: ``torch.ops`` overloads (``torch.ops.aten.mm.default``) whose outputs are kept;
            empty with no ``"save"`` override: the block recomputes whole (``"full"``).
        overrides: ``{submodule name or pattern: "save" | "recompute"}`` (or pairs).
        every: checkpoint every N-th block (blocks ``N - 1, 2N - 1, ...``); the others keep
            everything.

    Raises:
        ShardkitTypeError: a ``save_ops`` entry that is not an op overload.
        ShardkitError: an override other than ``"save"`` / ``"recompute"``; ``every < 1``.
    """

    save_ops: frozenset = SAVED_OPS
    overrides: Any = field(default_factory=lambda: {name: "recompute" for name in OUTPUT_PROJECTIONS})
    every: int = 1

    def __post_init__(self) -> None:
        ops = frozenset(self.save_ops)
        wrong = [repr(op) for op in ops if not isinstance(op, torch._ops.OpOverload)]
        if wrong:
            raise ShardkitTypeError(f"ACPolicy: save_ops must be op overloads (torch.ops.aten.mm.default); got {wrong}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ShardkitError(f"ACPolicy: every must be an int >= 1, got {self.every!r}")
        object.__setattr__(self, "save_ops", ops)
        object.__setattr__(self, "overrides", _overrides(self.overrides))

    @property
    def recomputes_whole(self) -> bool:
        """True when a checkpointed block keeps only its inputs (``"full"``: no dispatch mode)."""
        return not self.save_ops and all(rule != "save" for _, rule in self.overrides)

    def rule_for(self, name: str) -> str | None:
        """The override of the submodule ``name`` (relative to its block), or None."""
        found = None
        for pattern, rule in self.overrides:
            if name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
                found = rule
        return found


def as_policy(mode: str | ACPolicy) -> ACPolicy | None:
    """The :class:`ACPolicy` of a preset name, ``"selective:N"`` or a policy; None for ``"none"``.

    Raises:
        ShardkitError: an unknown name.
        ShardkitTypeError: neither a string nor an :class:`ACPolicy`.
    """
    if isinstance(mode, ACPolicy):
        return mode
    if not isinstance(mode, str):
        raise ShardkitTypeError(f"activation_checkpoint must be a name or an ACPolicy, got {type(mode).__name__}")
    why = ac_rule(mode)
    if why is not None:
        raise ShardkitError(f"activation_checkpoint: {why.removeprefix('--ac ')}")
    name, every = parse_ac(mode)
    if name == "none":
        return None
    if name == "selective":
        return ACPolicy()
    return ACPolicy(save_ops=frozenset(), overrides={}, every=every)


def ac_kind(mode: str | ACPolicy) -> str:
    """``"none"``, ``"full"`` (blocks recompute whole) or ``"selective"`` (an op-level policy)."""
    policy = as_policy(mode)
    if policy is None:
        return "none"
    return "full" if policy.recomputes_whole else "selective"


class BlockPolicy:
    """An :class:`ACPolicy` on one block: the SAC policy function, with forward hooks on the
    overridden submodules keeping the stack of rules in effect (the forward's and the recompute's)."""

    def __init__(self, block: nn.Module, policy: ACPolicy) -> None:
        self.save_ops = policy.save_ops
        self.stack: list[str] = []
        for name, module in block.named_modules():
            rule = policy.rule_for(name) if name else None
            if rule is not None:
                module.register_forward_pre_hook(lambda m, args, rule=rule: self._enter(rule))
                module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, rule: str) -> None:
        self.stack.append(rule)

    def _leave(self, module, args, output) -> None:  # returns None: the module's output stays
        self.stack.pop()

    def keeps(self, func) -> bool:
        """Whether the policy keeps the output of ``func`` called now."""
        if self.stack:
            return self.stack[-1] == "save" and (func in SAVED_OPS or func in self.save_ops)
        return func in self.save_ops

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if self.keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE


def every_nth(blocks: Iterable[nn.Module], every: int) -> list[bool]:
    """Which of ``blocks`` an ``every``-N policy checkpoints: ``N - 1, 2N - 1, ...``."""
    return [(i + 1) % every == 0 for i, _ in enumerate(blocks)]
