"""The optimizer of a ZeRO layout: AdamW over this rank's slices, then the parameters all-gathered.

:class:`ZeroAdamW` is ``torch.optim.AdamW`` over :attr:`.zero.ZeroSync.shard_params` (one
slice of each flat bucket, views of the model's parameters): its ``exp_avg`` / ``exp_avg_sq``
hold ``1 / R`` of the elements. Its :meth:`~ZeroAdamW.step` steps the slices, then
:meth:`~.zero.ZeroSync.gather_params` brings every rank's updated slice to every rank. A
learning-rate scheduler sees an ordinary AdamW (its ``param_groups``).

Checkpoints keep the full tensors, whatever the layout (:mod:`shardkit.checkpoint.train_state`):
:meth:`~ZeroAdamW.full_param_state` all-gathers the moments of each bucket over its group into
per-parameter tensors (the state of an unsharded AdamW, so a ZeRO save resumes without ZeRO and
back), and :meth:`~ZeroAdamW.load_full_param_state` keeps this rank's slice of what was loaded
into them. The gather holds one bucket's full moments for the save's duration.

Source: Megatron-LM's distributed optimizer (state sharded, checkpoint written as full
per-parameter tensors); Rajbhandari et al. 2020, "ZeRO", sec. 5.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import _c10d
from .zero import ZeroSync

__all__ = ["ZeroAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class ZeroAdamW(torch.optim.AdamW):
    """AdamW over this rank's ZeRO slices; :meth:`step` all-gathers the updated parameters.

    Args:
        sync: the model's :class:`~.zero.ZeroSync` (``pm.grads`` of a ``zero`` layout).
        lr: learning rate.
        eps: AdamW's eps.
    """

    def __init__(self, sync: ZeroSync, lr: float, eps: float) -> None:
        """See the class docstring."""
        super().__init__(sync.shard_params, lr=lr, eps=eps)
        self.zero = sync
        self._full: list[tuple[nn.Parameter, dict[str, torch.Tensor]]] = []

    def step(self, closure=None):  # type: ignore[override]
        """AdamW's step on the slices, then the all-gather of the parameters (collective over
        the buckets' groups)."""
        loss = super().step(closure)
        self.zero.gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The slices' gradients and the model's (a step that never reduced)."""
        super().zero_grad(set_to_none=set_to_none)
        for b in self.zero.buckets:
            for p in b.params:
                p.grad = None

    def full_param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """``{model parameter: {"exp_avg", "exp_avg_sq", "step"}}`` as an unsharded AdamW holds them.

        Collective over every bucket's group (an all-gather of each moment). A bucket whose slice
        has no state yet (before the first step) is left out, as AdamW leaves out such parameters.
        """
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        self._full = []
        for b in self.zero.buckets:
            st = self.state.get(b.shard, {})
            if not all(k in st for k in _MOMENTS):
                continue
            fulls = {}
            for key in _MOMENTS:
                mine = st[key].detach()
                if b.group is None:
                    fulls[key] = mine.clone()
                else:
                    fulls[key] = _c10d.all_gather(
                        mine, b.group, 0, [b.shard_size] * b.ranks, "zero_state", "checkpoint"
                    )
            self._full.append((b.shard, fulls))
            for i, p in enumerate(b.params):
                out[p] = {key: b.view(fulls[key], i) for key in _MOMENTS}
                if "step" in st:
                    out[p]["step"] = st["step"]
        return out

    def load_full_param_state(self) -> None:
        """Keep this rank's slice of the full moments :meth:`full_param_state` handed out (a
        checkpoint load wrote into them). Local."""
        for b in self.zero.buckets:
            for shard, fulls in self._full:
                if shard is b.shard:
                    for key, full in fulls.items():
                        self.state[b.shard][key].copy_(b.slice_of(full))
        self._full = []
