"""The pipeline guide's table of every schedule x {train, eval, forward-only, FSDP2, AC,
``--pp-tp``, custom Functions}: the cells no other file covers for every schedule, and a check of
the table itself against the registry, the shared ``--pp-tp`` rule and the tests it names.

* Forward-only without targets (``train=False``, ``return_outputs=True``, no targets): the last
  stage's outputs bitwise equal to one process's forward, no loss, no gradient.
* Custom Functions: a ``LinearFunc`` whose backward adds the weight gradient into ``.grad`` itself,
  either at once or deferred to ``W`` (DualPipe's pattern), on every schedule; parameter
  gradients against one process's (float64, 1e-12, ``scale_grads=False``: the sum).
"""

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.helpers import all_true, rank, world_group, world_size
from harness.pipe_models import mse
from shardkit._rules import pp_tp_chunks_rule
from shardkit.pipeline_parallel import PipelineStage, defer, deferring, run_schedule
from shardkit.pipeline_parallel.steps import global_chunk
from shardkit.pipeline_parallel.tables import SCHEDULES

H, M = 4, 4
GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "pipeline.md"


def _v(name):
    return max(SCHEDULES[name].v_min, 2 if name == "looped-bfs" else 1)


def _m(name):
    return 2 * world_size() if name == "dualpipev" else M


class _LinearFunc(torch.autograd.Function):
    """``x @ w.T``; its backward adds ``w``'s gradient into ``w.grad`` (deferred to W if asked)."""

    defer_to_w = True

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors

        def add():
            g = gy.flatten(0, -2).T @ x.flatten(0, -2)
            w.grad = g if w.grad is None else w.grad + g

        defer(add) if _LinearFunc.defer_to_w and deferring() else add()
        return gy @ w, None


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H, dtype=torch.float64) / 2)

    def forward(self, x):
        return torch.tanh(_LinearFunc.apply(x, self.w))


def _setup(name):
    """The full model (``p v`` blocks, one seed), this rank's chunks and their global indices."""
    p, r, v = world_size(), rank(), _v(name)
    torch.manual_seed(17)
    full = nn.Sequential(*[_Block() for _ in range(p * v)])
    held = [global_chunk(SCHEDULES[name].placement, r, c, p) for c in range(v)]
    mine = [copy.deepcopy(full[g]) for g in held]
    stage = PipelineStage(mine, world_group(), placement=SCHEDULES[name].placement, loss_fn=mse)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3, H, generator=gen, dtype=torch.float64) for _ in range(_m(name))]
    ts = [torch.randn(2, 3, H, generator=gen, dtype=torch.float64) for _ in range(_m(name))]
    return full, stage, mine, held, xs, ts


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_forward_only_without_targets_every_schedule(name):
    full, stage, mine, _, xs, _ = _setup(name)
    got = run_schedule(stage, name, xs, None, num_microbatches=len(xs), train=False, return_outputs=True)
    ok = got.losses is None and all(q.grad is None for mod in mine for q in mod.parameters())
    if stage.is_last:
        with torch.no_grad():
            ok &= all(torch.equal(a, full(x)) for a, x in zip(got.outputs, xs, strict=True))
    else:
        ok &= got.outputs is None
    assert all_true(ok), (name, rank())


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize("defer_to_w", [True, False], ids=["deferred", "written"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_custom_function_writing_grad_every_schedule(name, defer_to_w):
    _LinearFunc.defer_to_w = defer_to_w
    full, stage, mine, held, xs, ts = _setup(name)
    for x, t in zip(xs, ts):
        mse(full(x), t).backward()  # the sum of the microbatch losses
    run_schedule(stage, name, xs, ts, num_microbatches=len(xs), scale_grads=False)
    ok = all(
        torch.allclose(mod.w.grad, full[g].w.grad, rtol=1e-12, atol=1e-12) for mod, g in zip(mine, held, strict=True)
    )
    assert all_true(ok), (name, defer_to_w, rank())


HEADER = "| schedule (placement, `v`) | train |"
COLUMNS = ["train", "eval", "forward-only", "FSDP2", "AC", "`--pp-tp`", "custom Functions"]


def _matrix() -> tuple[list[str], dict[str, dict[str, str]], str]:
    """The guide's schedule table: its columns, schedule name -> {column: cell}, and the
    paragraph under it (the tests that back the cells)."""
    text = GUIDE.read_text()
    lines = text[text.index(HEADER) :].split("\n\n")[0].splitlines()
    columns = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[re.match(r"`([^`]+)`", cells[0]).group(1)] = dict(zip(columns, cells[1:], strict=True))
    return columns, rows, text[text.index(HEADER) :].split("\n\n")[1]


def test_the_guides_schedule_table_matches_the_code_and_names_existing_tests():
    """Every schedule of the registry has a row; its ``--pp-tp`` cell says "refused" exactly where
    the shared rule refuses (the schedule needs ``v > 1``), every other cell "runs"; the tests
    named under the table exist."""
    columns, rows, below = _matrix()
    assert columns == COLUMNS and list(rows) == list(SCHEDULES)
    for name, cells in rows.items():
        refused = pp_tp_chunks_rule((2, 1), name, SCHEDULES[name].v_min) is not None
        assert cells["`--pp-tp`"].startswith("refused" if refused else "runs"), (name, cells)
        assert all(c.startswith("runs") for k, c in cells.items() if k != "`--pp-tp`"), (name, cells)
    named = set(re.findall(r"`(test_\w+)`", below))
    tests = Path(__file__).parents[1].rglob("test_*.py")
    defined = {t for f in tests for t in re.findall(r"def (test_\w+)", f.read_text())}
    assert len(named) >= 10 and named <= defined, named - defined
