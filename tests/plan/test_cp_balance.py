"""The planner's load balance of the ring cp layouts against the block plan the ring runs.

``layout_rank_work`` (arithmetic on the layouts' ranges) must give every rank exactly the visible
causal (query, key) pairs of :func:`rank_work` (the blocks each rank computes, counted mask by
mask), for even and uneven sequences; the balances are the measured figures (zigzag 1.000,
stripe ~1.001, contiguous 1.50 / 1.75 / 1.875 at R = 2, 4, 8), and ``shardkit plan`` prints them.
"""

import json

import pytest

from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit.cli.main import main
from shardkit.context_parallel._ring_plan import rank_work
from shardkit.plan.cp_balance import CP_LAYOUTS, balance_lines, layout_balance, layout_rank_work


@pytest.mark.combinations  # each (layout, R, S) is its own arithmetic
@pytest.mark.parametrize("layout", CP_LAYOUTS)
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("seq_len", [64, 100])
def test_rank_work_equals_the_block_plan(layout, ranks, seq_len):
    assert layout_rank_work(seq_len, ranks, layout) == rank_work(layout, (0, seq_len), ranks, causal=True)


def test_balances_are_the_measured_ones():
    seq = 8192
    for ranks, contiguous in ((2, 1.5), (4, 1.75), (8, 1.875)):
        assert layout_balance(seq, ranks, "zigzag") == 1.0
        assert 1.0 < layout_balance(seq, ranks, "stripe") < 1.001  # about 1 + (R - 1) / S
        assert layout_balance(seq, ranks, "contiguous") == pytest.approx(contiguous, abs=1e-3)
    assert balance_lines(seq, [1, 1]) == []
    lines = balance_lines(seq, [4, 2, 4, 1])
    assert len(lines) == 3 and "cp_ring=2: zigzag 1.000" in lines[1] and "contiguous 1.750" in lines[2]


def test_plan_prints_and_writes_the_balance(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    args = ["plan", "--config", str(config), "--gpus", "4", "--gpus-per-node", "4", "--seq-len", "64"]
    args += ["--global-batch", "8", "--top", "2", "--compare", "cp_ring=4", "--plot", str(tmp_path / "p.png")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ring cp layouts at seq 64" in out and "cp_ring=4: zigzag 1.000, stripe 1.046, contiguous 1.738" in out
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    given = [r for r in rows if r["given"]]
    assert given and given[0]["cp_layout_balance"]["contiguous"] == layout_balance(64, 4, "contiguous")
    assert all("cp_layout_balance" not in r for r in rows if "cp_ring" not in r["layout"])
