"""Meta-device models made real: parameters allocated (local shards only, after ``apply_tp``)
and the buffers a checkpoint does not hold recomputed, before a checkpoint fills them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["materialize_meta"]


def _swap_params(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter real (uninitialized) storage on ``device``, keeping the object's
    attributes (its ShardSpec) and gradient hooks (replicated heads' sum): a new Parameter
    replaces it in every module that holds it, tied parameters staying tied."""
    swapped: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in swapped:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                # Tensor.register_hook keeps a leaf's hooks in this dict; re-register them on the
                # new tensor so the autograd engine runs them.
                for hook in (getattr(p, "_backward_hooks", None) or {}).values():
                    new.register_hook(hook)
                swapped[id(p)] = new
            module._parameters[name] = swapped[id(p)]


def materialize_meta(
    model: nn.Module,
    device: torch.device | str,
    loaded: set[str],
    init_buffers: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocate ``model``'s meta parameters and buffers on ``device`` (after ``apply_tp``, so
    only local shards) and recompute the buffers a checkpoint does not hold.

    Parameters and the persistent buffers named in ``loaded`` stay uninitialized: the caller
    fills them from the checkpoint. Other meta buffers (non-persistent: rotary ``inv_freq``) are
    recomputed by ``init_buffers(module)``, default Hugging Face's ``model._init_weights`` (which
    recomputes rotary embeddings). Floating buffers are first filled with NaN, so one the
    initializer skipped raises instead of being used.

    Raises:
        ShardkitError: a meta buffer no initializer restores.
    """
    device = torch.device(device)
    _swap_params(model, device)
    owners: list[nn.Module] = []
    for mname, module in model.named_modules():
        missing = False
        for bname, b in list(module._buffers.items()):
            if b is None or not b.is_meta:
                continue
            fill = float("nan") if b.is_floating_point() else 0
            module._buffers[bname] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
            full = f"{mname}.{bname}" if mname else bname
            missing |= bname in module._non_persistent_buffers_set or full not in loaded
        if missing:
            owners.append(module)
    if not owners:
        return
    init_buffers = init_buffers or getattr(model, "_init_weights", None)
    if init_buffers is None:
        raise ShardkitError(
            f"load: buffers of {[type(m).__name__ for m in owners]} were on the meta device and are "
            "not in the checkpoint; pass init_buffers=fn(module) to recompute them"
        )
    with torch.no_grad():
        for module in owners:
            init_buffers(module)
    bad = [
        f"{type(m).__name__}.{n}"
        for m in owners
        for n, b in m._buffers.items()
        if b is not None and b.is_floating_point() and bool(b.isnan().any())
    ]
    if bad:
        raise ShardkitError(f"load: init_buffers left these buffers uninitialized: {bad}")
