"""The one compatibility shim for c10d names that moved between torch releases.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (FutureWarning) in
favour of ``all_gather_single`` / ``reduce_scatter_single``; GPU environments still run older
torch (2.11 seen) that only has the old names. Same semantics, so pick whichever exists.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
