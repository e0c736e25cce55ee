"""The planner's pipeline schedules: closed forms against the dependency simulator on the real
tables, peak activations against the tables, the schedule rules against the table functions,
the search over schedules and ``shardkit plan --schedule/--virtual-stages/--json`` (one
process: no world)."""

import json

import pytest

from shardkit import Cluster, ModelShape, ParallelDims, ShardkitError, StepOptions, estimate_step, plan_layouts
from shardkit._rules import SCHEDULE_CHUNKS
from shardkit.cli.main import main
from shardkit.pipeline_parallel.tables import SCHEDULES
from shardkit.plan import pipeline
from shardkit.plan.activations import BlockLayout, block_saved_bytes
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.pipeline import closed_makespan, peak_chunks, pipeline_cost, step_costs
from shardkit.plan.rules import check_schedule, schedule_rule

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _sizes(name, ps=(2, 3, 4, 5)):
    """Every (p, v, m) of ``ps``, v 1..4 and m 1..3p that the schedule's table function accepts."""
    for p in ps:
        for v in range(1, 5):
            for m in range(1, 3 * p + 1):
                try:
                    SCHEDULES[name].build(p, v, m)
                except ShardkitError:
                    continue
                yield p, v, m


def _closed_applies(name, p, m):
    return m >= {"zbv": p + 2, "zb-h1": p, "interleaved-zb": p}.get(name, 1)


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("x", [0.0, 0.3])  # P2P seconds per transfer, in units of a chunk's forward
def test_closed_forms_equal_the_simulator(name, x):
    costs = step_costs(1.0, x)
    checked = 0
    for p, v, m in _sizes(name):
        if not _closed_applies(name, p, m):
            continue
        simulated = pipeline._simulated(name, p, v, m, tuple(sorted(costs.items())))[0]
        assert closed_makespan(name, p, v, m, costs) == pytest.approx(simulated), (name, p, v, m)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_shaped_closed_form_is_not_claimed_for_unequal_input_gradients(name):
    # with I != F the V-shaped closed form does not hold: the planner simulates those tables
    costs = {"F": 1.0, "I": 1.5, "W": 0.5, "B": 2.0}
    p, v, m = 4, 2, 10
    simulated = pipeline._simulated(name, p, v, m, tuple(sorted(costs.items())))[0]
    zb_form = m * v * 3.0 + (p - 1) * 2.0
    assert simulated != pytest.approx(zb_form)
    assert closed_makespan(name, p, v, m, costs) == pytest.approx(simulated)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_peak_closed_forms_equal_the_tables(name, monkeypatch):
    monkeypatch.setattr(pipeline, "SIMULATE_LIMIT", 0)  # every size through the closed forms
    for p, v, m in _sizes(name):
        counted = pipeline._table_peaks(name, p, v, m)
        assert [peak_chunks(name, p, v, m, r) for r in range(p)] == list(counted), (name, p, v, m)


@pytest.mark.parametrize(
    "name, v, bubble",
    [
        ("1f1b", 1, 3 / 11),  # (p - 1) / (m + p - 1), p = 4, m = 8
        ("gpipe", 1, 3 / 11),
        ("interleaved-1f1b", 2, 3 / 19),  # (p - 1) / (v m + p - 1)
        ("looped-bfs", 2, 3 / 19),
        ("zb-h1", 1, 3 / 27),  # (p - 1) / (3 m + p - 1) at F = I = W
        ("zbv", 2, 3 / 51),  # (p - 1) / (6 m + p - 1)
        ("interleaved-zb", 2, 3 / 51),  # (p - 1) / (3 v m + p - 1): ZB-H1's over v chunks
        ("dualpipev", 2, 3 / 51),
    ],
)
def test_bubble_per_schedule_simulated_and_closed(name, v, bubble, monkeypatch):
    simulated = pipeline_cost(name, 4, v, 8, f=0.01, x=0.002)
    assert simulated.simulated and simulated.bubble == pytest.approx(bubble)
    monkeypatch.setattr(pipeline, "SIMULATE_LIMIT", 0)
    closed = pipeline_cost(name, 4, v, 8, f=0.01, x=0.002)
    assert not closed.simulated
    assert (closed.makespan, closed.bubble, closed.peak) == pytest.approx(
        (simulated.makespan, simulated.bubble, simulated.peak)
    )


def test_rule_refuses_exactly_what_the_tables_refuse():
    for name, spec in SCHEDULES.items():
        for p in range(2, 7):
            for v in range(1, 5):
                for m in range(1, 3 * p + 1):
                    try:
                        spec.build(p, v, m)
                        builds = True
                    except ShardkitError:
                        builds = False
                    assert (schedule_rule(name, p, v, m, layers=p * v) is None) == builds, (name, p, v, m)


def test_the_torch_free_chunk_ranges_are_the_registrys():
    # shardkit._rules keeps its own copy (the launcher checks schedules before import torch)
    assert list(SCHEDULE_CHUNKS) == list(SCHEDULES)
    assert {n: (s.v_min, s.v_max) for n, s in SCHEDULES.items()} == dict(SCHEDULE_CHUNKS)


@pytest.mark.parametrize(
    "args, match",
    [
        (("zb", 2, 1, 4, 8), "--schedule must be one of"),
        (("zbv", 2, 3, 4, 8), r"--schedule zbv needs --virtual-stages 2, got 3"),
        (("interleaved-1f1b", 2, 1, 4, 8), r"needs --virtual-stages >= 2, got 1"),
        (("1f1b", 1, 2, 4, 8), r"--virtual-stages 2 needs --pp > 1"),
        (("interleaved-1f1b", 4, 2, 6, 64), r"microbatches must be a multiple of pp .* got 6"),
        (("dualpipev", 4, 2, 6, 64), r"microbatches must be >= 2 x pp = 8, got 6"),
        (("looped-bfs", 4, 4, 4, 15), r"15 decoder layers cannot fill 16 chunks"),
    ],
)
def test_check_schedule_names_the_limit(args, match):
    assert schedule_rule(*args) is not None
    with pytest.raises(ShardkitError, match=match):
        check_schedule(*args)


def test_planner_refuses_with_the_shared_rule():
    shape = ModelShape.from_config(TINY)
    opts = StepOptions(seq_len=16, global_batch=12, microbatches=6, schedule="interleaved-1f1b", virtual_stages=2)
    why = schedule_rule("interleaved-1f1b", 4, 2, 6, shape.layers)
    with pytest.raises(ShardkitError) as err:
        estimate_step(shape, ParallelDims(pp=4), opts, Cluster(gpus=4, gpus_per_node=4))
    assert why is not None and str(err.value).endswith(why)


@pytest.mark.parametrize(("schedule", "v", "refused"), [("zb-h1", 1, False), ("interleaved-zb", 2, True)])
def test_pp_tp_stages_run_one_chunk_schedules_in_the_planner_as_in_the_trainer(schedule, v, refused):
    shape = ModelShape.from_config(TINY)
    opts = StepOptions(seq_len=16, global_batch=4, microbatches=4, schedule=schedule, virtual_stages=v)
    dims, cluster = ParallelDims(pp_tp=(2, 1), world_size=3), Cluster(gpus=3, gpus_per_node=3)
    if refused:
        with pytest.raises(ShardkitError, match="--pp-tp stages hold one chunk each"):
            estimate_step(shape, dims, opts, cluster)
    else:
        assert estimate_step(shape, dims, opts, cluster).options.schedule == schedule


def test_virtual_stages_shrink_the_bubble_and_v_shape_moves_the_logits():
    shape = ModelShape.from_config(TINY)
    cluster = Cluster(gpus=4, gpus_per_node=4)
    base = StepOptions(seq_len=16, global_batch=8, microbatches=8, dtype="float32")
    one = estimate_step(shape, ParallelDims(pp=4), base, cluster)
    opts = StepOptions(seq_len=16, global_batch=8, microbatches=8, dtype="float32", schedule="interleaved-1f1b")
    two = estimate_step(shape, ParallelDims(pp=4), StepOptions(**{**opts.__dict__, "virtual_stages": 2}), cluster)
    assert two.bubble == pytest.approx(3 / 19) and one.bubble == pytest.approx(3 / 11)
    zbv = StepOptions(**{**base.__dict__, "schedule": "zbv", "virtual_stages": 2})
    logits = 16 * 256 * 4 * 2  # b S V float32, and its gradient
    first, last = (memory_per_rank(shape, ParallelDims(pp=4), zbv, s)["activations"] for s in (0, 3))
    per_chunk = block_saved_bytes(shape, BlockLayout(rows=1, seq_len=16), "none", 4)  # one layer per chunk
    assert first == pytest.approx(per_chunk * peak_chunks("zbv", 4, 2, 8, 0) + logits)
    assert last == pytest.approx(per_chunk * peak_chunks("zbv", 4, 2, 8, 3))


def test_ranking_includes_schedules():
    shape = ModelShape.from_config(TINY)
    opts = StepOptions(seq_len=64, global_batch=16, dtype="float32")
    cluster = Cluster(gpus=8, gpus_per_node=4)
    ranked = plan_layouts(shape, cluster, opts, top=1000)
    piped = {(e.options.schedule, e.options.virtual_stages) for e in ranked if e.dims.pp > 1}
    assert piped >= {("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved-1f1b", 2)}
    assert all(e.dims.pp * e.options.virtual_stages <= shape.layers for e in ranked)
    assert [e.step_s for e in ranked] == sorted(e.step_s for e in ranked)
    only = plan_layouts(shape, cluster, opts, top=1000, schedules=[("interleaved-1f1b", 2)])
    assert {(e.options.schedule, e.options.virtual_stages) for e in only if e.dims.pp > 1} == {("interleaved-1f1b", 2)}


def _plan(tmp_path, capsys, *extra):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    argv = ["plan", "--config", str(config), "--gpus", "8", "--gpus-per-node", "4", "--seq-len", "64"]
    code = main([*argv, "--global-batch", "16", "--plot", str(tmp_path / "p.png"), *extra])
    return code, capsys.readouterr()


def test_plan_json_lists_the_ranked_layouts(tmp_path, capsys):
    code, out = _plan(
        tmp_path, capsys, "--json", "--top", "5", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
        "--compare", "pp=4,dp_replicate=2",
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out.out)
    assert len(rows) == 6 and rows[-1]["given"] and not any(r["given"] for r in rows[:-1])
    for key in ("layout", "schedule", "virtual_stages", "step_s", "mfu", "bubble", "memory_gib"):
        assert all(key in r for r in rows)
    given = rows[-1]
    assert (given["layout"], given["schedule"], given["virtual_stages"]) == (
        "pp=4 x dp_replicate=2",
        "interleaved-1f1b",
        2,
    )
    shape, cluster = ModelShape.from_config(TINY), Cluster(gpus=8, gpus_per_node=4)
    opts = StepOptions(seq_len=64, global_batch=16, microbatches=8, schedule="interleaved-1f1b", virtual_stages=2)
    est = estimate_step(shape, ParallelDims(pp=4, dp_replicate=2), opts, cluster)
    assert given["step_s"] == pytest.approx(est.step_s) and given["bubble"] == pytest.approx(est.bubble)
    assert given["memory_gib"] == pytest.approx(est.memory["total"] / 2**30) and given["mfu"] == pytest.approx(est.mfu)
    assert [r["step_s"] for r in rows[:-1]] == sorted(r["step_s"] for r in rows[:-1])
    assert all(r["schedule"] == "interleaved-1f1b" for r in rows[:-1] if "pp=" in r["layout"])


def test_plan_refuses_a_bad_schedule_and_v(tmp_path, capsys):
    code, out = _plan(tmp_path, capsys, "--schedule", "zbv", "--virtual-stages", "3")
    assert code == 2 and "--schedule zbv needs --virtual-stages 2, got 3" in out.out


def test_the_old_schedules_name_still_works_and_warns():
    from shardkit.pipeline_parallel.schedules import one_f_one_b_schedule
    from shardkit.plan import options

    with pytest.warns(DeprecationWarning, match="shardkit.pipeline_parallel.tables.SCHEDULES"):
        old = options.SCHEDULES
    assert set(old) == {"1f1b", "gpipe"} and old["1f1b"] is one_f_one_b_schedule


def test_p2p_rows_cross_every_rank_boundary_v_times_and_the_v_turn_is_local():
    from shardkit.plan.collectives import merged, step_collectives

    shape, dims = ModelShape.from_config(TINY), ParallelDims(pp=4, world_size=4)
    act = 1 * 16 * 64 * 4 + 160  # one microbatch's [b, S, H] float32 and its header

    def p2p(schedule, v, stage):
        opts = StepOptions(16, 8, 8, "float32", schedule=schedule, virtual_stages=v)
        rows = merged(step_collectives(shape, dims, opts, stage))
        return {(k[0], k[2]): (c, s + r) for k, (c, s, r) in rows.items() if k[1] == "p2p"}

    # interleaved v = 2: stage 0 receives into chunk 4 only (chunk 0 takes the data) and sends
    # from chunks 0 and 4; the last stage the mirror; 8 microbatches per channel, 9 messages
    assert p2p("interleaved-1f1b", 2, 0) == {
        ("send", "forward"): (2 * 9, 2 * 8 * act),
        ("recv", "backward"): (2 * 9, 2 * 8 * act),
        ("recv", "forward"): (9, 8 * act),
        ("send", "backward"): (9, 8 * act),
    }
    assert p2p("interleaved-1f1b", 2, 3)[("send", "forward")] == (9, 8 * act)
    # the V: the middle stages talk both ways on both chunks, the ends on one (stage 3 turns
    # chunk 3 into chunk 4 locally, stage 0 holds the data and the loss)
    for stage, n in ((0, 1), (1, 2), (2, 2), (3, 1)):
        assert p2p("zbv", 2, stage) == {
            (op, phase): (n * 9, n * 8 * act) for op in ("send", "recv") for phase in ("forward", "backward")
        }, stage
    # and the V's ends: stage 0 holds the embedding and the head, stage 3 neither
    v0, v3 = (
        memory_per_rank(shape, dims, StepOptions(16, 8, 8, "float32", schedule="zbv", virtual_stages=2), s)
        for s in (0, 3)
    )
    assert v0["params"] > v3["params"]
