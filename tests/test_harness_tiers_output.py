"""The matrix tier's rule and the ranks' buffered output (issue 32, item 4)."""

from __future__ import annotations

import itertools
import os
import sys
import types

import pytest

from harness.tiers import covering, edge_and_sample, mark_matrix
from harness.world import World, WorldPool, WorldResult

# ------------------------------------------------------------ one case per value of each argument


def test_the_covering_set_of_a_product_holds_every_value_once_at_least():
    params = [dict(a=a, b=b, c=c) for a, b, c in itertools.product(range(4), "xyz", (True, False))]
    kept = covering(params)
    assert len(kept) == 4  # the longest argument's values, not 4 x 3 x 2
    for name, values in (("a", range(4)), ("b", "xyz"), ("c", (True, False))):
        assert {params[i][name] for i in kept} == set(values), name


def test_the_covering_set_keeps_cases_whose_values_are_all_their_own():
    # e.g. (load, cores, stretch) rows: every row is a path of its own
    params = [dict(load=0.5, stretch=1.0), dict(load=10.0, stretch=5.0), dict(load=400.0, stretch=10.0)]
    assert covering(params) == [0, 1, 2]
    assert covering([dict(layout=dict(tp=2)), dict(layout=dict(tp=2))]) == [0]  # equal dicts: one path


class _Item:
    def __init__(self, function: str, params: dict, marks=()) -> None:
        self.path, self.originalname, self.name = "tests/t.py", function, function
        self.callspec = types.SimpleNamespace(params=params)
        self.marks = set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None

    def add_marker(self, mark) -> None:
        self.marks.add(mark.name)


def test_mark_matrix_moves_the_rest_of_each_product_to_the_matrix_and_slow_tiers():
    product = [_Item("test_p", dict(dtype=d, size=s)) for d in ("f32", "f64") for s in (0, 1, 7)]
    every = [_Item("test_all", dict(dtype=d, size=s), marks={"combinations"}) for d in ("f32", "f64") for s in (0, 1)]
    tiered = [_Item("test_t", dict(tp=t), marks={"slow"} if t > 2 else ()) for t in (2, 4, 8)]
    plain = _Item("test_plain", {})
    assert mark_matrix([*product, *every, *tiered, plain]) == 3
    quick = [i.callspec.params for i in product if "matrix" not in i.marks]
    assert len(quick) == 3 and {q["dtype"] for q in quick} == {"f32", "f64"} and {q["size"] for q in quick} == {0, 1, 7}
    assert all(i.marks >= {"matrix", "slow"} for i in product if "matrix" in i.marks)
    assert not any("matrix" in i.marks for i in [*every, *tiered, plain])


def test_edge_cases_stay_quick_and_the_sample_of_their_grid_is_the_matrix_tier():
    edge, sample = [dict(k=1), dict(k=3)], [dict(k=2), dict(k=5), dict(k=7)]
    params = edge_and_sample(edge, sample, ["e1", "e3", "s2", "s5", "s7"])
    assert [p.values for p in params] == [(c,) for c in edge + sample]
    assert [sorted(m.name for m in p.marks) for p in params] == [[], [], *[["matrix", "slow"]] * 3]
    for bad in ((edge, sample, ["e1"]), ([], sample, ["s2", "s5", "s7"])):
        with pytest.raises(ValueError, match="edge_and_sample"):
            edge_and_sample(*bad)


# ------------------------------------------------------------- rank output: only with a failure


def task_print(word):
    print(f"py {word}")
    sys.stderr.write(f"err {word}\n")
    os.write(2, f"fd {word}\n".encode())  # C++ output (gloo, TORCH_WARN) takes this path


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.shutdown()


def test_what_the_ranks_print_comes_back_with_its_task_only(world2):
    first = world2.run(__file__, "task_print", {"word": "one"})
    assert first.ok, first.failure_message()
    assert {r: sorted(text.splitlines()) for r, text in first.output.items()} == {
        r: ["err one", "fd one", "py one"] for r in range(2)
    }
    second = world2.run(__file__, "task_print", {"word": "two"})
    lines = sorted(second.output_text().splitlines())
    assert "one" not in second.output_text()
    assert lines == [f"[rank {r}] {kind} two" for r in range(2) for kind in ("err", "fd", "py")]


def test_a_world_test_puts_the_ranks_output_into_its_captured_output(monkeypatch, capsys):
    import conftest  # here, not at the top: the world's ranks load this module too

    printed = {0: "a warning\n", 1: "partial line"}
    results = [
        WorldResult(2, 60.0, outcomes={0: ("ok",), 1: ("ok",)}, output=printed),
        WorldResult(2, 60.0, outcomes={0: ("ok",), 1: ("error", "E", "m", "tb")}, output=printed),
    ]
    monkeypatch.setattr(conftest._POOL, "get", lambda n: types.SimpleNamespace(run=lambda *a, **k: results.pop(0)))
    item = types.SimpleNamespace(
        get_closest_marker=lambda name: pytest.mark.world(2).mark,
        cls=None,
        _fixtureinfo=types.SimpleNamespace(argnames=()),
        funcargs={},
        path="x.py",
        originalname="test_x",
        nodeid="x.py::test_x",
        module=types.SimpleNamespace(__name__="x"),
    )
    assert conftest.pytest_pyfunc_call(item) is True
    with pytest.raises(pytest.fail.Exception, match="rank 1 of 2 failed first"):
        conftest.pytest_pyfunc_call(item)
    # Captured, not printed: pytest shows a test's captured output when it fails (or with -rP).
    assert capsys.readouterr().out == "[rank 0] a warning\n[rank 1] partial line\n" * 2


def test_the_pool_shuts_every_world_down_cleanly_side_by_side():
    pool = WorldPool()
    procs = []
    for n in (1, 2):
        world = pool.get(n)
        result = world.run(__file__, "task_print", {"word": "bye"})
        assert result.ok, result.failure_message()
        procs += world._procs
    pool.shutdown()
    # every rank left its process group and returned (exit code 0), none was killed (-9)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert pool.get(1)._procs == []  # a fresh world object: the next run would spawn it anew
