"""``torch.compile`` of each decoder block, with shardkit's autograd Functions inside.

:func:`apply_compile` replaces each block's ``forward`` (an instance attribute, like
:func:`~.checkpointing.apply_ac`) by its ``torch.compile``-d version, so parameter names do not
change and FSDP2's hooks, applied afterwards, stay outside the compiled region. It runs after tp,
cp and ep and before FSDP2 (torchtitan's order), but *inside* activation checkpointing: ``full``
AC then checkpoints the compiled forward, and its recompute runs the compiled graphs again.
(torchtitan compiles the checkpointed block instead; Dynamo refuses shardkit's checkpoint, whose
``context_fn`` is not a pair of dispatch modes.) ``selective`` AC is refused: its dispatch modes
(SAC's and the collective replay) keep Dynamo out of the block, so nothing would be compiled.

Shapes are static (``dynamic=False``): a layout fixes every block's shapes for the whole run, and
dynamic tracing fails on the shape reads of the tensor-parallel styles (``.nbytes`` of a tensor
with symbolic sizes in their input hooks). shardkit's collectives query their group's size and
rank, which Dynamo cannot put in a graph: each such query breaks the graph (the counts per layout
are in docs/guides, "Compiling blocks"; :func:`graph_breaks` measures them).

Source: torchtitan ``apply_compile`` (per-block compile after AC, before FSDP2);
``torch._dynamo.explain`` for the break count.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ShardkitError
from .ac_policy import ACPolicy, ac_kind

__all__ = ["BlockBreaks", "apply_compile", "check_compile", "compile_backends", "graph_breaks"]


def compile_backends() -> tuple[str, ...]:
    """The ``torch.compile`` backends this torch knows (``torch._dynamo.list_backends``, all tags)."""
    return tuple(sorted(torch._dynamo.list_backends(exclude_tags=())))


def check_compile(
    compile: bool | str, where: str = "parallelize(compile=...)", activation_checkpoint: str | ACPolicy = "none"
) -> str | None:
    """The backend ``compile`` names: None for False, ``"inductor"`` for True, else the name itself.

    Raises:
        ShardkitError: ``compile`` neither a bool nor a known backend name; a backend with
            ``activation_checkpoint="selective"`` (module docstring). ``where`` names the flag or
            argument in the message.
    """
    if compile is False or compile is None:
        return None
    backend = "inductor" if compile is True else compile
    backends = compile_backends()
    if not isinstance(backend, str) or backend not in backends:
        raise ShardkitError(f"{where}: backend must be one of {', '.join(backends)}; got {compile!r}")
    if ac_kind(activation_checkpoint) == "selective":
        raise ShardkitError(
            f"{where} {backend!r} with selective activation checkpointing: its dispatch modes keep torch.compile "
            "out of the block (nothing would be compiled); use full or no activation checkpointing"
        )
    return backend


def apply_compile(blocks: Sequence[nn.Module], backend: str | None) -> None:
    """Compile each block's forward in place with ``backend`` (None: nothing).

    Args:
        blocks: the decoder blocks (:func:`~.decoder.decoder_layers`), after tp, cp and ep,
            before activation checkpointing and FSDP2.
        backend: a name from :func:`compile_backends` (checked by :func:`check_compile`), or None.
    """
    if backend is None:
        return
    for block in blocks:
        # static shapes: see the module docstring (the tp styles' shape reads break dynamic tracing)
        block.forward = torch.compile(block.forward, backend=backend, dynamic=False)


@dataclass
class BlockBreaks:
    """What Dynamo made of one decoder block's forward (``torch._dynamo.explain``).

    Attributes:
        graphs: the number of graphs the block was cut into.
        breaks: the number of graph breaks (``graphs - 1`` for a straight-line block).
        reasons: each listed break's reason (first line) and the shardkit function it happened
            in, counted (Dynamo may list fewer breaks than it counts).
    """

    graphs: int
    breaks: int
    reasons: Counter = field(default_factory=Counter)


def graph_breaks(model: nn.Module, block: nn.Module, inputs: dict) -> BlockBreaks:
    """Count the graph breaks of ``block`` (a decoder block of ``model``, not compiled) on ``inputs``.

    Runs ``model(**inputs)`` once to capture the block's arguments, then ``torch._dynamo.explain``
    on the block's forward with them (a second forward of the block: its collectives run again,
    so every rank of the model's groups must call it alike).

    Args:
        model: the parallelized model holding ``block``.
        block: one of its decoder blocks.
        inputs: the model's keyword inputs for one forward.

    Returns:
        :class:`BlockBreaks`.
    """
    captured: dict = {}

    def keep(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = block.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    args, kwargs = captured["call"]
    torch._dynamo.reset()
    # static shapes, as apply_compile compiles (explain would otherwise retrace dynamically)
    with torch._dynamo.config.patch(assume_static_by_default=True, automatic_dynamic_shapes=False):
        report = torch._dynamo.explain(block.forward)(*args, **kwargs)
    reasons = Counter(_reason(r) for r in report.break_reasons)
    return BlockBreaks(report.graph_count, report.graph_break_count, reasons)


def _reason(brk) -> str:
    """A break's reason (first line) and the innermost shardkit function it happened in."""
    ours = [f for f in getattr(brk, "user_stack", []) if f"{os.sep}shardkit{os.sep}" in f.filename]
    where = f" in {Path(ours[-1].filename).stem}.{ours[-1].name}" if ours else ""
    return brk.reason.strip().splitlines()[0] + where
