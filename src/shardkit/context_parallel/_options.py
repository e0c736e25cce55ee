"""The attention variants every context-parallel layout takes: sliding window, logit softcap, returned lse.

One normalized form, :class:`Variant`, checked once at the API boundary, so that ring (zigzag and
contiguous), Ulysses, USP and packed documents mean the same thing by each option:

* **Window** (flash-attn's ``window_size=(left, right)``): query ``i`` sees key ``j`` iff
  ``i - left <= j <= i + right``, a negative bound meaning unbounded; with ``causal`` also
  ``j <= i`` (flash-attn sets ``right = 0`` under causal masking). Positions are global (within a
  packed document they differ from the in-document positions by the same offset on both sides).
  Hugging Face's ``sliding_window=W`` (Mistral, Qwen2/3, Gemma 2: ``masking_utils``'s
  ``kv_idx > q_idx - W`` on top of the causal mask; its flash path passes ``(W - 1, W - 1)``) is
  ``window=(W - 1, W - 1)``: the query and the ``W - 1`` keys before it.
* **Softcap** (Gemma 2's ``attn_logit_softcapping``): ``scores = softcap * tanh(scores / softcap)``
  on the scaled scores, before the mask and the softmax. ``0`` or None is off (flash-attn's
  ``softcap=0.0``).
* **lse**: the natural log-sum-exp of each query row's (capped, masked, scaled) scores.

Source: Dao, flash-attention ``flash_attn_func`` (``window_size``, ``softcap``); Gemma Team,
"Gemma 2" (2024), section 2 (logit soft-capping); Beltagy et al., "Longformer" (2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ShardkitError, ShardkitTypeError

__all__ = ["Variant", "variant", "visible"]


@dataclass(frozen=True)
class Variant:
    """Normalized options: ``window`` ``(left, right)`` with ``-1`` unbounded (``right = 0`` when
    causal) or None when it hides nothing beyond the causal mask; ``softcap`` > 0 or None."""

    window: tuple[int, int] | None = None
    softcap: float | None = None
    return_lse: bool = False

    @property
    def agreed(self) -> tuple:
        """The fields as the check mode's agreement compares them (ints, floats, None)."""
        return (self.window, self.softcap, self.return_lse)

    @property
    def plain(self) -> bool:
        """No window and no softcap: the fused paths of every layout apply unchanged."""
        return self.window is None and self.softcap is None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def variant(op: str, causal: bool, window=None, sliding_window=None, softcap=None, return_lse=False) -> Variant:
    """Check and normalize the variant arguments of ``op`` (a local check: pure in the arguments).

    Raises:
        ShardkitError: ``window`` not two ints >= -1, ``sliding_window`` not an int >= 1, both
            given, ``softcap`` negative or not finite.
        ShardkitTypeError: ``return_lse`` not a bool, ``softcap`` not a number.
    """
    if window is not None and sliding_window is not None:
        raise ShardkitError(f"{op}: pass window=(left, right) or sliding_window=W, not both")
    if sliding_window is not None:
        if not _int(sliding_window) or sliding_window < 1:
            raise ShardkitError(
                f"{op}: sliding_window must be an int >= 1 (keys i - W < j <= i), got {sliding_window!r}"
            )
        window = (sliding_window - 1, sliding_window - 1)
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(_int(w) and w >= -1 for w in window):
            raise ShardkitError(f"{op}: window must be (left, right), two ints >= -1 (-1: unbounded), got {window!r}")
        left, right = int(window[0]), 0 if causal else int(window[1])
        window = None if left < 0 and right < 0 else (left, right)
        if causal and left < 0:  # (-1, 0) under causal masking is the causal mask itself
            window = None
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise ShardkitTypeError(f"{op}: softcap must be a number or None, got {softcap!r}")
        if not math.isfinite(softcap) or softcap < 0:
            raise ShardkitError(f"{op}: softcap must be finite and >= 0 (0: off), got {softcap!r}")
        softcap = float(softcap) if softcap > 0 else None
    if not isinstance(return_lse, bool):
        raise ShardkitTypeError(f"{op}: return_lse must be a bool, got {return_lse!r}")
    return Variant(window, softcap, return_lse)


def visible(gq: torch.Tensor, gk: torch.Tensor, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """Boolean ``[len(gq), len(gk)]``: True where query position ``gq[i]`` sees key position ``gk[j]``
    (same document assumed): causal ``j <= i`` and the window's bounds."""
    d = gk[None, :] - gq[:, None]  # key minus query position
    keep = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    left, right = window if window is not None else (-1, -1)
    if causal:
        keep &= d <= 0
    if left >= 0:
        keep &= d >= -left
    if right >= 0:
        keep &= d <= right
    return keep
