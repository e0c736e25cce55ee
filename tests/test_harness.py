"""Tests of the persistent-world harness: world tests on every rank, and the World API itself."""

from __future__ import annotations

import os
import time
import types
import zlib

import pytest
import torch
import torch.distributed as dist

import harness.helpers as harness_helpers
from harness.helpers import all_true, get_mesh, rank, subgroup, world_group, world_size
from harness.limits import load_stretch, patient
from harness.world import World

# ------------------------------------------------------------------ world tests (on every rank)


@pytest.mark.world(2)
def test_all_reduce_of_ranks():
    t = torch.tensor([rank()], dtype=torch.int64)
    dist.all_reduce(t, group=world_group())
    assert t.item() == 1


@pytest.mark.world(3)
def test_reseed_gives_identical_random_numbers():
    assert world_size() == 3
    nodeid = "tests/test_harness.py::test_reseed_gives_identical_random_numbers"
    assert torch.initial_seed() == zlib.crc32(nodeid.encode())  # seeded from the test's id
    x = torch.rand(16)
    gathered = [torch.empty_like(x) for _ in range(3)]
    dist.all_gather(gathered, x)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.world(4)
def test_mesh_2x2_submeshes():
    mesh = get_mesh((2, 2), ("dp", "tp"))
    r = rank()
    assert mesh["dp"].size() == 2 and mesh["tp"].size() == 2
    # tp is the inner dimension: its ranks are adjacent.
    assert mesh["tp"].get_local_rank() == r % 2
    assert mesh["dp"].get_local_rank() == r // 2
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == [r - r % 2, r - r % 2 + 1]
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == [r % 2, r % 2 + 2]
    assert get_mesh((2, 2), ("dp", "tp")) is mesh  # cached per worker


@pytest.mark.world(4)
def test_subgroup_and_all_true():
    group = subgroup((1, 2))
    if rank() in (1, 2):
        t = torch.tensor([float(rank())])
        dist.all_reduce(t, group=group)
        assert t.item() == 3.0
    assert all_true(True)
    assert not all_true(rank() != 3)


@pytest.mark.world(4)
def test_subgroup_asked_for_other_ranks_on_some_ranks_raises_on_every_rank():
    """Ranks 0-1 ask for (0, 1) while 2-3 ask for (2, 3): torch would give both groups one name
    and their pairs could cross-connect; the helper refuses before any group is made."""
    mine = (1, 0) if rank() < 2 else (3, 2)  # keys no other test asks for: not cached in this world
    with pytest.raises(AssertionError, match="the ranks asked for different groups"):
        subgroup(mine)
    assert mine not in harness_helpers._SUBGROUPS


@pytest.mark.world(2)
@pytest.mark.parametrize("size", [0, 5])
def test_parametrized_args_reach_every_rank(size):
    t = torch.full((size,), float(rank() + 1))
    dist.all_reduce(t)
    assert t.shape == (size,) and bool((t == 3.0).all())


@pytest.mark.world(1)
def test_world_of_one():
    assert (rank(), world_size()) == (0, 1)


_PIDS_BEFORE: list[int] = []  # filled inside the ranks; the pytest process never touches it


@pytest.mark.world(2)
def test_every_rank_raises_the_expected_error():
    _PIDS_BEFORE[:] = [os.getpid()]
    with pytest.raises(ValueError, match="same on every rank"):
        raise ValueError(f"same on every rank (rank {rank()})")


@pytest.mark.world(2)
def test_world_still_works_after_expected_errors():
    if _PIDS_BEFORE:  # empty when run alone: then there is no previous test to compare with
        assert _PIDS_BEFORE == [os.getpid()]  # a passing test does not respawn the world
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 2.0))


# ------------------------------------------------- task bodies for the World API tests below
# Not collected (no test_ prefix): World.run imports this file in each rank and calls them.


def task_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def task_report():
    """A body that reports a value (as the bad-input catalogue's rank records do)."""
    return {"rank": dist.get_rank(), "sum": dist.get_world_size() * 3}


def task_raise_on_rank1():
    if dist.get_rank() == 1:
        raise RuntimeError("only rank 1 fails")


def task_hang_on_rank1():
    if dist.get_rank() == 1:
        time.sleep(100)


def task_exit_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)


def task_seed(out_path):
    torch.save(torch.rand(4), f"{out_path}.{dist.get_rank()}")


# ------------------------------------------------ World API tests (in the pytest process)


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.shutdown()


def test_world_api_ok(world2):
    result = world2.run(__file__, "task_all_reduce")
    assert result.ok, result.failure_message()


def test_world_api_returned_values(world2):
    result = world2.run(__file__, "task_report")
    assert result.ok, result.failure_message()
    assert result.outcomes == {r: ("ok", {"rank": r, "sum": 6}) for r in range(2)}
    assert world2.run(__file__, "task_all_reduce").outcomes == {0: ("ok",), 1: ("ok",)}  # None: nothing added


def test_world_api_error_on_one_rank(world2):
    result = world2.run(__file__, "task_raise_on_rank1")
    assert result.failed and not result.hang
    message = result.failure_message()
    assert message.startswith("rank 1 of 2 failed first; its traceback:")
    assert "in task_raise_on_rank1" in message and "RuntimeError: only rank 1 fails" in message
    assert message.splitlines()[-1] == "other ranks: rank 0 ok"
    starts = world2.starts
    assert world2.run(__file__, "task_all_reduce").ok  # respawned, and works
    assert world2.starts == starts + 1


def test_world_api_hang(world2):
    begin = time.monotonic()
    result = world2.run(__file__, "task_hang_on_rank1", timeout=3)
    # the 3 s wall limit, not the 100 s sleep (about 4 s when quiet; 60 holds on a loaded machine)
    assert 3 <= time.monotonic() - begin < 60
    assert result.hang and result.missing == [1]
    message = result.failure_message()
    assert message.startswith("HANG: rank(s) [1] of 2 did not report within 3 s")
    assert "other ranks: rank 0 ok" in message
    assert "in task_hang_on_rank1" in message  # the hung rank's stack, from faulthandler
    starts = world2.starts
    assert world2.run(__file__, "task_all_reduce").ok
    assert world2.starts == starts + 1


def test_world_api_rank_dies(world2):
    begin = time.monotonic()
    result = world2.run(__file__, "task_exit_on_rank0")
    # noticed by polling, not by the 60 s wall limit (0.5 s when quiet; 30 holds on a loaded machine)
    assert time.monotonic() - begin < 30
    assert result.outcomes[0] == ("died", 3)
    assert result.failure_message().startswith("rank 0 died with exit code 3")
    assert world2.run(__file__, "task_all_reduce").ok


def test_world_api_seed_follows_nodeid(world2, tmp_path):
    def draws(nodeid, name):
        out = str(tmp_path / name)
        assert world2.run(__file__, "task_seed", {"out_path": out}, nodeid=nodeid).ok
        return [torch.load(f"{out}.{r}") for r in range(2)]

    a, b, c = draws("x::a", "a"), draws("x::a", "b"), draws("x::b", "c")
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0])  # same test: same numbers
    assert not torch.equal(a[0], c[0])  # another test: other numbers


@pytest.mark.parametrize(("load", "cores", "stretch"), [(0.5, 2, 1.0), (2.0, 2, 1.0), (10.0, 2, 5.0), (400.0, 2, 10.0)])
def test_wall_limits_stretch_with_the_load(monkeypatch, load, cores, stretch):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert load_stretch() == stretch and patient(60) == 60 * stretch


def test_a_world_test_limit_is_stretched_by_the_load(monkeypatch):
    import conftest

    seen = {}

    class _World:
        def run(self, *args, timeout, **kwargs):
            seen["timeout"] = timeout
            return types.SimpleNamespace(skipped=False, ok=True)

    item = types.SimpleNamespace(
        get_closest_marker=lambda name: pytest.mark.world(2, timeout=30).mark,
        cls=None,
        _fixtureinfo=types.SimpleNamespace(argnames=()),
        funcargs={},
        path="x.py",
        originalname="test_x",
        nodeid="x.py::test_x",
        module=types.SimpleNamespace(__name__="x"),
    )
    monkeypatch.setattr(conftest._POOL, "get", lambda n: _World())
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0, 10.0, 10.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert conftest.pytest_pyfunc_call(item) is True and seen["timeout"] == 150


# ------------------------------------------------------------------ the quick and slow tiers


def test_tiered_marks_every_case_but_the_quick_ones_slow():
    from harness.tiers import tiered

    params = tiered({"a": dict(tp=2), "b": (dict(pp=2), "x"), "c": dict(tp=4)}, ("b",))
    assert [p.id for p in params] == ["a", "b", "c"]
    assert [p.values for p in params] == [(dict(tp=2),), (dict(pp=2), "x"), (dict(tp=4),)]
    assert [[m.name for m in p.marks] for p in params] == [["slow"], [], ["slow"]]


@pytest.mark.parametrize("quick", [(), ("a", "typo")])
def test_tiered_refuses_an_empty_or_unknown_quick_tier(quick):
    from harness.tiers import tiered

    with pytest.raises(ValueError, match="non-empty subset"):
        tiered({"a": 1, "b": 2}, quick)
