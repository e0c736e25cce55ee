"""``--zero``'s refusals (one clear ShardkitError before any worker starts, or on every rank from
``parallelize``, a pure function of the layout) and ``shardkit plan --zero``."""

import json

import pytest
import transformers

from shardkit import ParallelDims, ShardkitError, StepOptions
from shardkit.cli.main import main
from shardkit.parallelize.fake_world import count_rank
from shardkit.train.config import TrainConfig, validate_config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(zero=1, dp_shard=2, tp=1, nproc=4), r"--zero 1 with --dp-shard 2: FSDP2 already shards"),
        (dict(zero=3, nproc=4), r"--zero must be 0 \(off\), 1 \(optimizer state\) or 2"),
        (dict(zero=True, nproc=4), r"--zero must be 0"),
        (dict(model="conv-ae", zero=1, nproc=4, seq_len=2), r"--zero 1 with --model conv-ae"),
    ],
)
def test_bad_zero_options_are_refused_before_launch(overrides, match):
    with pytest.raises(ShardkitError, match=match):
        validate_config(TrainConfig(**overrides))


def test_parallelize_refuses_zero_over_fsdp2():
    # the fake world runs parallelize itself: the refusal is the layout's, the same on every rank
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256
    )
    with pytest.raises(ShardkitError, match=r"parallelize: zero=2 with dp_shard=4"):
        count_rank(config, ParallelDims(dp_shard=4), 0, StepOptions(zero=2))


def test_plan_zero_ranks_replicated_layouts_with_sharded_state(tmp_path, capsys):
    config = tmp_path / "config.json"
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    config.write_text(json.dumps(dict(model_type="llama", vocab_size=256, num_key_value_heads=2, **sizes)))
    args = ["plan", "--config", str(config), "--gpus", "16", "--global-batch", "16", "--json", "--top", "500"]
    assert main([*args, "--zero", "1"]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = {(r["layout"], r["schedule"], r["virtual_stages"]): r for r in json.loads(capsys.readouterr().out)}
    assert zero and all("dp_shard" not in r["layout"] for r in zero)
    replicated = [r for r in zero if "dp_replicate" in r["layout"]]
    assert replicated
    for r in replicated:  # the optimizer state is split over the replicas: less memory, same layout
        assert r["memory_gib"] < plain[(r["layout"], r["schedule"], r["virtual_stages"])]["memory_gib"]
    # the fake world counts ZeRO's slices as the plan does
    dry = ["plan", "--config", str(config), "--gpus", "16", "--global-batch", "16", "--zero", "2"]
    assert main([*dry, "--dry-run", "tp=2,pp=2,dp_replicate=4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) > 2 and all(line.split(" | ")[-1] == "0.00%" for line in out[2:]), out
