"""``shardkit bench`` machinery (not timings): one tiny case through the method, its
correctness check failing on one rank only, the JSON / markdown / plot outputs and their schema,
the registry and the command-line floor on rounds."""

import json
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, world_group, world_size
from shardkit.bench import CASES, Record, Settings, write_outputs
from shardkit.bench._method import agree, same_bits, time_interleaved
from shardkit.cli.main import build_parser
from shardkit.comm import all_reduce_forward


def _tiny_case(pg, settings):
    """all_reduce of 16 floats against the bare call, checked, then timed."""
    x = torch.arange(16, dtype=torch.float32) + rank()
    buf = torch.empty_like(x)
    fns = {"shardkit": lambda: all_reduce_forward(x, pg), "bare": lambda: dist.all_reduce(buf.copy_(x), group=pg)}
    want = sum(torch.arange(16, dtype=torch.float32) + r for r in range(world_size()))
    agree([] if same_bits(fns["shardkit"](), want) else ["all_reduce != sum"], pg, "tiny")
    rec = Record(
        "tiny",
        dict(bytes=x.nbytes, label="16 floats"),
        world_size(),
        time_interleaved(fns, pg, settings),
        busbw={k: (x.nbytes, 2 * (world_size() - 1) / world_size()) for k in fns},
        checked="bitwise sum",
    )
    return [rec.ratio("shardkit/bare", "shardkit", "bare", 10.0)]


@pytest.mark.world(2, timeout=60)
def test_one_tiny_case_writes_the_schema():
    settings = Settings(rounds=40, warmup=5)
    (rec,) = _tiny_case(world_group(), settings)
    assert set(rec.times_s) == {"shardkit", "bare"} and all(len(v) == 40 for v in rec.times_s.values())
    assert all(t > 0 for v in rec.times_s.values() for t in v)
    # The ratios are the per-round quotients of the recorded times (max over ranks: equal on all).
    assert rec.ratios["shardkit/bare"][0] == [a / b for a, b in zip(rec.times_s["shardkit"], rec.times_s["bare"])]
    seen = [None] * world_size()
    dist.all_gather_object(seen, rec.times_s, group=world_group())
    assert seen[0] == seen[1]
    if rank() != 0:
        return
    env = dict(
        date="d",
        machine="m",
        processor="p",
        cpus=2,
        python="3",
        torch=torch.__version__,
        transformers="t",
        backend="gloo (CPU)",
        command="shardkit bench --cases tiny",
        load_average=None,
    )
    with tempfile.TemporaryDirectory() as out:
        doc = write_outputs([dict(rec.to_json(), suite="tiny")], dict(rounds=40, warmup=5, quick=False), env, out)
        assert sorted(os.listdir(out)) == ["bench.json", "bench.md", "bench_busbw.png", "bench_ratios.png"]
        with open(os.path.join(out, "bench.json")) as f:
            saved = json.load(f)
        with open(os.path.join(out, "bench.md")) as f:
            table = f.read()
    assert doc["schema"] == saved["schema"] == 1
    assert set(saved) == {"schema", "environment", "settings", "summary", "records", "skipped"}
    assert saved["skipped"] == [] and "Skipped" not in table
    (row,) = saved["summary"]
    assert set(row) == {"case", "label", "nproc", "params", "ms", "ratios", "busbw_GBps", "checked"}
    q = row["ratios"]["shardkit/bare"]
    assert set(q) == {"p10", "q1", "median", "q3", "p90", "goal", "met"}
    assert q["p10"] <= q["q1"] <= q["median"] <= q["q3"] <= q["p90"] and q["goal"] == 10.0
    assert q["met"] == (q["median"] <= 10.0)
    assert row["busbw_GBps"]["bare"] == pytest.approx(64 / (row["ms"]["bare"] / 1e3) * 1.0 / 1e9)
    (record,) = saved["records"]
    assert set(record) == {"case", "params", "nproc", "times_s", "ratios", "busbw", "checked", "suite"}
    assert "| tiny | 2 | 64 B 16 floats | shardkit/bare |" in table


@pytest.mark.world(2, timeout=30)
def test_a_check_failing_on_one_rank_raises_on_every_rank():
    """Every rank raises the same text, naming the failing rank and its failure."""
    with pytest.raises(AssertionError, match=r"^t: 1 of 2 ranks failed: rank 1: wrong$"):
        agree(["wrong"] if rank() == 1 else [], world_group(), "t")


def test_registry_and_command_line():
    assert {
        "collectives",
        "all_to_all",
        "p2p",
        "pipeline_bubble",
        "ring",
        "ulysses",
        "spatial_conv",
        "vocab_loss",
        "tp_step",
    } <= set(CASES)
    for spec in CASES.values():
        import importlib

        assert callable(getattr(importlib.import_module(spec.module, "shardkit.bench"), spec.function))
    args = build_parser().parse_args(["bench", "--quick", "--cases", "p2p", "--out", "x"])
    assert args.quick and args.cases == "p2p" and args.rounds == 40 and args.warmup == 5
    with pytest.raises(SystemExit, match="--rounds >= 40"):
        args.func(build_parser().parse_args(["bench", "--rounds", "10"]))
    with pytest.raises(SystemExit, match="unknown bench case"):
        args.func(build_parser().parse_args(["bench", "--cases", "nope", "--out", tempfile.mkdtemp()]))


def test_bench_help_is_plain_text_with_one_case_a_line(capsys):
    """Issue 32, item 3: ``bench --help`` showed the module's reST (double backquotes, roles)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["bench", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ") and "``" not in text and not re.search(r":(mod|func|class|data|attr):`", text)
    lines = text.splitlines()
    for name in CASES:
        assert any(line.startswith(f"  {name}: ") for line in lines), name  # one case a line, as written
    assert "--quick" in text and "on 2 cores" in " ".join(text.split())  # (argparse wraps help lines)
