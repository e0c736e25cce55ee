"""Type aliases shared by the public signatures."""

from __future__ import annotations

from typing import TypeAlias

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Group"]

Group: TypeAlias = ProcessGroup | DeviceMesh
"""What every ``group`` argument accepts: a ``ProcessGroup`` or a 1-D ``DeviceMesh`` (a submesh
such as ``mesh["tp"]``). There is no default: shardkit never falls back to the world group."""
