"""Helpers for test bodies that run inside a rank of a test world (``@pytest.mark.world(n)``).

Every rank runs every world test, in the same order, so anything collective here (creating a
mesh or a subgroup) happens in the same order on all ranks; that is what makes caching the
result per worker process safe. A world is respawned after any failed test, and after a passing
one once its ranks hold too many process groups (``worker.MAX_GROUPS``); either clears these caches.

Property tests with hypothesis run on every rank in lockstep. All ranks must draw the same
examples and take the same path through hypothesis, so nothing may depend on time or on a
database, and pass/fail must be agreed before asserting::

    @pytest.mark.world(2)
    @settings(derandomize=True, database=None, deadline=None, max_examples=25,
              suppress_health_check=list(HealthCheck))   # health checks time things
    @given(n=st.integers(0, 9))
    def test_roundtrip(n):
        ok = bool(torch.equal(roundtrip(n), reference(n)))   # compute, do not assert yet
        assert all_true(ok)    # every rank fails (and shrinks) together, or none does

An assertion that fails on one rank only would send the ranks down different hypothesis paths
(one shrinking, the others moving on) and their collectives out of step.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "SMALL_CORPUS",
    "all_true",
    "get_mesh",
    "rank",
    "remove_shared_dir",
    "shared_tmpdir",
    "subgroup",
    "world_group",
    "world_size",
]

_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
_SUBGROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def world_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    return dist.group.WORLD


def rank() -> int:
    """This process's global rank."""
    return dist.get_rank()


# One 90 KB file of text (torch's functional module) for trainer runs whose claims are not about
# the data: the default corpus (the standard library, 31 MB) is read by rank 0 and broadcast to
# every rank, a third of a small run's CPU (docs/design.md, Testing).
SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def world_size() -> int:
    """The number of ranks in the world."""
    return dist.get_world_size()


def get_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A CPU DeviceMesh of ``shape`` with dimension ``names``, created once per worker.

    Creating a mesh creates process groups, which is collective: every rank must call this with
    the same arguments at the same point of a test. Cached because groups are costly to create
    and gloo ranks hold them for the life of the world.
    """
    key = (tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


def subgroup(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """``dist.new_group(list(ranks))``, created once per worker.

    ``new_group`` is collective over the WORLD, members or not: every rank must call this with
    the same ``ranks`` at the same point of a test, even ranks outside ``ranks`` (they get a
    group they are not a member of, as ``new_group`` returns them). A rank that asks for other
    ranks raises on every rank: torch would name both groups alike, their ranks would publish
    their addresses under the same store keys, and pairs could connect across the two groups
    (a test did this: it passed, and hung one of five full runs in session 28).
    """
    key = tuple(ranks)
    if key not in _SUBGROUPS:
        asked = _gather_ranks(key)
        if any(a != key for a in asked):
            raise AssertionError(
                f"subgroup(): the ranks asked for different groups ({dict(enumerate(asked))}); "
                "new_group is collective over the world: create every group on every rank"
            )
        _SUBGROUPS[key] = dist.new_group(list(key))
    return _SUBGROUPS[key]


def _gather_ranks(key: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's ``key`` (an all-gather of ranks padded with -1)."""
    n = dist.get_world_size()
    mine = torch.full((n,), -1, dtype=torch.int64)
    mine[: len(key)] = torch.tensor(key, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine)
    return [tuple(int(r) for r in t if r >= 0) for t in out]


def all_true(flag: bool) -> bool:
    """Whether ``flag`` is true on every rank (an all-reduce MIN over the world).

    Collective: call it on every rank, including those whose check passed.
    """
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def shared_tmpdir(prefix: str) -> str:
    """A fresh directory made by rank 0, its name broadcast to the world (collective).

    Starts with a patient barrier (gloo's monitored_barrier takes its own timeout): on a busy
    machine the ranks can reach a test far apart (e.g. still importing transformers), more than
    the test process group's timeout.
    """
    dist.monitored_barrier(timeout=timedelta(seconds=150))
    box = [tempfile.mkdtemp(prefix=prefix) if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def remove_shared_dir(path: str) -> None:
    """Collective: once every rank is done with ``path``, rank 0 deletes it."""
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
