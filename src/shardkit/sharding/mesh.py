"""Parallel layout of a job: degrees per axis, validated, turned into named DeviceMeshes.

shardkit keeps no module-level process groups. A job describes its layout once with
:class:`ParallelDims`; :meth:`ParallelDims.build_mesh` is the only place that creates process
groups for it (:mod:`.groups`), and every layer, collective and transform takes its (sub)mesh
explicitly from the :class:`ParallelMesh` (``mesh["tp"]``, ``mesh["dp_cp"]``). The axes and
flattened views are listed in :mod:`.axes`.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from ..comm._group import resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from .axes import AXES, EP_BORROW
from .groups import build_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "ParallelMesh"]


_T = TypeVar("_T")


def _last_release_keywords(cls: type[_T]) -> type[_T]:
    """Accept the keywords the last release renamed, on top of the dataclass's ``__init__``.

    ``dp=`` means what ``dp_replicate=`` means now (replicas whose gradients are all-reduced; the
    release before had no sharded data parallelism): it works, with a ``DeprecationWarning``.
    ``cp=`` has no single replacement (the attention kind is now a mesh dim), so it raises.

    Raises:
        ShardkitTypeError: ``cp=``; ``dp=`` together with ``dp_replicate=``.
    """
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "cp" in kwargs:
            raise ShardkitTypeError(
                f"ParallelDims(cp={kwargs['cp']!r}): cp was split in the last release; pass cp_ring= (zigzag ring "
                "attention) or cp_ulysses= (Ulysses all-to-all), or both (USP); ParallelDims.cp and the mesh's 'cp' "
                "view are their product"
            )
        if "dp" in kwargs:
            if "dp_replicate" in kwargs:
                raise ShardkitTypeError("ParallelDims: dp= is the old name of dp_replicate=; pass dp_replicate= only")
            warnings.warn(
                "ParallelDims(dp=) is deprecated: use dp_replicate= (replicas, gradients all-reduced; dp_shard= "
                "shards them with FSDP2); dp= will be removed in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            kwargs["dp_replicate"] = kwargs.pop("dp")
        init(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)  # noqa: B010 (mypy refuses assigning to a method)
    return cls


@_last_release_keywords
@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every parallel axis of one job.

    Args:
        dp_replicate: data-parallel replicas (DDP-style: full gradients all-reduced; HSDP's
            replicate dim when ``dp_shard > 1``).
        dp_shard: data-parallel ranks that shard parameters, gradients and optimizer state
            (FSDP2 ``fully_shard``; ZeRO-3).
        pp: pipeline stages.
        cp_ring: context-parallel ranks of zigzag ring attention.
        cp_ulysses: context-parallel ranks of Ulysses all-to-all attention (both > 1: USP).
        spatial: ranks sharing each frame of a convolutional model along its last dim (W; halo
            exchange).
        spatial_h: ranks sharing each frame along H; with ``spatial > 1`` too, each rank holds
            one H x W tile (``mesh["spatial_h", "spatial"]``).
        tp: tensor-parallel ranks (Megatron TP, optionally with sequence parallelism).
        ep: expert-parallel ranks, borrowed from ``dp_shard x cp_ring x cp_ulysses x tp``
            (must divide that product), or from whole such blocks of several ``dp_replicate``
            replicas (a multiple of it dividing ``dp_replicate`` times it); 1 keeps experts
            tensor-parallel over ``tp``.
        pp_tp: a tp size per pipeline stage (MindSpeed-MM "VTP", e.g. ``(2, 1, 1)``): stages
            of different sizes are not a rectangle, so this layout composes with
            ``dp_replicate`` only (``tp`` stays 1, ``pp`` is ``len(pp_tp)``, and the world is
            ``dp_replicate x sum(pp_tp)``).
        world_size: when given, the product of the degrees must equal it.

    The last release's ``dp=`` still works as ``dp_replicate=`` (``DeprecationWarning``); its
    ``cp=`` raises ``ShardkitTypeError`` naming ``cp_ring=`` and ``cp_ulysses=``.

    Raises:
        ShardkitTypeError: a degree is not an int; ``cp=`` (see above).
        ShardkitError: a degree is < 1; the product is not ``world_size``; ``ep`` does not
            divide the ranks it borrows from, or is combined with ``spatial`` or ``spatial_h`` > 1. The message
            names every degree.

    Example:
        >>> dims = ParallelDims(dp_replicate=2, tp=2)
        >>> mesh = dims.build_mesh("cpu")      # inside a 4-rank world
        >>> mesh["tp"].size(), mesh["dp_cp"].size()
        (2, 2)

    Source: torchtitan ``ParallelDims`` (mesh order, flattened views, ep borrowing dp x cp (x tp));
    Megatron-LM's expert-data-parallel groups.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1
    spatial_h: int = 1
    spatial: int = 1
    tp: int = 1
    ep: int = 1
    pp_tp: tuple[int, ...] | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        if self.pp_tp is not None:
            self._check_pp_tp()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("world_size", "pp_tp"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ShardkitTypeError(f"ParallelDims: {f.name} must be an int, got {value!r}")
            if value < 1:
                raise ShardkitError(f"ParallelDims: {f.name} must be >= 1, got {value} ({self._describe()})")
        if self.world_size is not None and self.product != self.world_size:
            raise ShardkitError(
                f"ParallelDims: {self._describe()} multiply to {self.product}, but the world size is {self.world_size}"
            )
        if self.ep > 1:
            borrow = self.ep_borrow
            if self.spatial > 1 or self.spatial_h > 1:
                raise ShardkitError(
                    f"ParallelDims: ep={self.ep} with spatial={self.spatial}, spatial_h={self.spatial_h}: "
                    "expert parallelism "
                    "is for mixture-of-experts models, spatial for convolutional ones"
                )
            # ep inside each replica's dp_shard x cp x tp ranks, or whole blocks of them across
            # dp_replicate replicas (DeepSeek-V3's EP 64 over its data-parallel ranks)
            if borrow % self.ep and (self.ep % borrow or self.dp_replicate % (self.ep // borrow)):
                raise ShardkitError(
                    f"ParallelDims: ep={self.ep} must divide dp_shard x cp_ring x cp_ulysses x tp = {borrow}, "
                    f"or be a multiple of it that divides dp_replicate x {borrow} = {self.dp_replicate * borrow} "
                    f"(the ranks expert parallelism borrows; {self._describe()})"
                )

    def _check_pp_tp(self) -> None:
        sizes = self.pp_tp
        if (
            not isinstance(sizes, tuple)
            or len(sizes) < 2
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in sizes)
        ):
            raise ShardkitError(f"ParallelDims: pp_tp must be a tuple of at least 2 ints >= 1, got {sizes!r}")
        others = {
            a: getattr(self, a) for a in ("dp_shard", "cp_ring", "cp_ulysses", "spatial_h", "spatial", "tp", "ep")
        }
        if any(v != 1 for v in others.values()) or self.pp not in (1, len(sizes)):
            raise ShardkitError(
                f"ParallelDims: pp_tp={sizes} (stages of different tp sizes are not a rectangular mesh) composes "
                f"with dp_replicate only; got {self._describe()}"
            )
        object.__setattr__(self, "pp", len(sizes))

    def _describe(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("world_size", "pp_tp")}
        text = ", ".join(f"{k}={v}" for k, v in shown.items())
        return text if self.pp_tp is None else f"{text}, pp_tp={self.pp_tp}"

    @property
    def degrees(self) -> dict[str, int]:
        """Degree of every mesh axis, outermost first (``ep`` is not a mesh axis: it borrows)."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def product(self) -> int:
        """The number of ranks the layout needs."""
        if self.pp_tp is not None:
            return self.dp_replicate * sum(self.pp_tp)
        return math.prod(self.degrees.values())

    @property
    def dp(self) -> int:
        """Data-parallel degree ``dp_replicate x dp_shard`` (the batch is split this many ways)."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp(self) -> int:
        """Context-parallel degree ``cp_ring x cp_ulysses``."""
        return self.cp_ring * self.cp_ulysses

    @property
    def cp_mode(self) -> str | None:
        """``"usp"`` (both cp degrees > 1), ``"ring"``, ``"ulysses"``, or None without cp."""
        if self.cp_ring > 1 and self.cp_ulysses > 1:
            return "usp"
        if self.cp_ring > 1:
            return "ring"
        return "ulysses" if self.cp_ulysses > 1 else None

    @property
    def ep_borrow(self) -> int:
        """Ranks expert parallelism may borrow from: ``dp_shard x cp_ring x cp_ulysses x tp``."""
        return math.prod(getattr(self, a) for a in EP_BORROW)

    def active_axes(self) -> list[str]:
        """Axes with degree > 1, outermost first (``ep`` last when > 1)."""
        return [axis for axis, d in self.degrees.items() if d > 1] + (["ep"] if self.ep > 1 else [])

    def describe(self) -> str:
        """A one-line layout such as ``"dp_replicate=2 x tp=2"`` (``"single process"`` when all 1)."""
        active = [f"{axis}={getattr(self, axis)}" for axis in self.active_axes()]
        if self.pp_tp is not None:
            active.insert(1 if self.dp_replicate > 1 else 0, f"pp_tp={','.join(map(str, self.pp_tp))}")
        return " x ".join(active) if active else "single process"

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """Build the named meshes of this layout: every axis, the flattened views, the expert mesh.

        Must be called collectively by every rank of the default process group. Every subgroup
        gets the world's timeout (a subgroup created with torch's default would wait 30 minutes
        in a disagreement instead of failing as fast as the world does).

        Returns:
            A :class:`ParallelMesh`: ``mesh["tp"]``, ``mesh["dp_cp"]``, ``mesh["ep"]`` ... are
            1-D ``DeviceMesh`` es (:data:`AXES`, :data:`FLAT_VIEWS`, and with ``ep > 1`` the
            expert dims ``ep`` and ``edp``; with ``dp_shard > 1`` and ``dp_replicate > 1`` the 2-D ``hsdp``
            mesh ``(dp_replicate, dp_shard_cp)``). Only dims of size > 1 exist (a size-1 dim is
            the identity: ``mesh.size(name)`` is 1 and ``mesh.local_rank(name)`` 0 for it).

        Raises:
            ShardkitError: the process group is not initialized, or its size is not the product.
        """
        if not dist.is_initialized():
            raise ShardkitError("ParallelDims.build_mesh: torch.distributed is not initialized")
        world = dist.get_world_size()
        if self.product != world:
            raise ShardkitError(
                f"ParallelDims.build_mesh: {self._describe()} multiply to {self.product}, but the world size is {world}"
            )
        root, views = build_groups(self.degrees, self.ep, self.pp_tp, device_type)
        return ParallelMesh(self, root, views)


class ParallelMesh:
    """The meshes of one :class:`ParallelDims` layout, by name (built by :meth:`ParallelDims.build_mesh`).

    ``mesh[name]`` is a 1-D ``DeviceMesh``: an axis of :data:`AXES` (a slice of the root mesh),
    a flattened view of :data:`FLAT_VIEWS`, or, with ``ep > 1``, ``"ep"`` (the ranks a token
    all-to-all spans) and ``"edp"`` (the ranks holding the same experts: expert gradients are
    reduced over it). ``mesh[a, b]`` is a multi-dim slice of the root mesh (e.g. USP's
    ``mesh["cp_ring", "cp_ulysses"]``). The flattened views are kept here rather than sliced
    from the root mesh, as torch asks of their users.

    Attributes:
        dims: the layout.
        root: the root ``DeviceMesh`` with dims :data:`AXES`.
    """

    def __init__(self, dims: ParallelDims, root: DeviceMesh | None, views: dict[str, Any]) -> None:
        self.dims, self.root, self._views = dims, root, views
        self._axis_names: dict[str, str] | None = None

    def axis_of(self, group_name: str | None) -> str:
        """The mesh axis or view whose process group is named ``group_name`` on this rank.

        Axes come before the flattened views that are the same group (with ``cp = 1``, ``dp``
        and ``dp_cp`` are the ``dp_replicate`` group itself); the default group is ``"world"``;
        a group of no mesh name (or None) is ``"other"``. Used to show a CommLedger by axis
        (:attr:`shardkit.CommRecord.group_name`).
        """
        if self._axis_names is None:
            self._axis_names = self._group_names()
        return self._axis_names.get(group_name, "other") if group_name is not None else "other"

    def _group_names(self) -> dict[str, str]:
        table: dict[str, str] = {}
        names = [n for n in (*AXES, "ep", "edp") if not self._absent(n)] + [n for n in self._views if n != "stages"]
        for name in names:
            try:
                pg = resolve_group(self[name], "ParallelMesh").pg
            except ShardkitError:
                continue  # a multi-dim view (hsdp) is not one group
            table.setdefault(pg.group_name, name)
        if "hsdp" in self._views:  # its own 2-D mesh: FSDP2's all-reduce and sharding groups
            hsdp = self._views["hsdp"]
            table.setdefault(hsdp.get_group(0).group_name, "dp_replicate")
            table.setdefault(hsdp.get_group(1).group_name, "dp_shard" if self.dims.cp == 1 else "dp_shard_cp")
        if "stages" in self._views:  # pp_tp: the replica's group carries the stage-to-stage P2P
            table.setdefault(resolve_group(self._views["stages"].group, "ParallelMesh").pg.group_name, "pp")
        world = dist.group.WORLD
        if world is not None:
            table.setdefault(world.group_name, "world")
        return table

    @property
    def device_type(self) -> str:
        """The root mesh's device type; ShardkitError for a layout without one (every degree 1,
        or ``pp_tp``)."""
        if self.root is None:
            raise ShardkitError(f"ParallelMesh.device_type: {self.dims.describe()} has no root DeviceMesh")
        return self.root.device_type

    def __getitem__(self, name: str | tuple[str, ...]) -> Any:
        if isinstance(name, tuple) and self.root is not None:
            return self.root[name]
        if name in self._views:
            return self._views[name]
        if name in AXES and self.root is not None and name in (self.root.mesh_dim_names or ()):
            return self.root[name]
        raise ShardkitError(
            f"ParallelMesh: no mesh named {name!r} in layout {self.dims.describe()}; known: "
            f"{list(AXES if self.root is not None else ()) + list(self._views)}"
        )

    def _absent(self, name: str) -> bool:
        """A dim this layout does not build because it is size 1 (no group: the identity)."""
        if name in self._views:
            return False
        return self.root is None or name not in (self.root.mesh_dim_names or ())

    def size(self, name: str) -> int:
        """Ranks in ``mesh[name]`` (1 for a dim the layout does not have)."""
        return 1 if self._absent(name) else resolve_group(self[name], "ParallelMesh").size

    def local_rank(self, name: str) -> int:
        """This rank's coordinate in ``mesh[name]`` (0 for a dim the layout does not have)."""
        return 0 if self._absent(name) else resolve_group(self[name], "ParallelMesh").rank
