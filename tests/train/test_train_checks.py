"""``shardkit train --checks``: the same trainer in shardkit's check mode, switched on for the run only.

Runs :func:`shardkit.train.run.train` on the default layout (tp=2 x dp=2, sequence parallel) in a
persistent gloo world with ``checks=True`` and ``--verify``: the check mode must not change a
single number (float64 parity with one process at 1e-9), must really run (the ledger holds the
metadata all-gathers of phase ``check``), and must be off again afterwards.
"""

import time

import pytest
import torch

from harness.helpers import rank, world_size
from shardkit.comm import checks_enabled
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", verify=True, layers=2, lr=1e-3)


@pytest.mark.world(4)
def test_train_with_checks_keeps_parity_and_really_checks():
    cfg = validate_config(TrainConfig(**SMALL, checks=True), world_size=world_size())
    assert not checks_enabled()
    result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    assert not checks_enabled()  # on for the run only
    if rank() != 0:
        assert result is None
        return
    assert result["parity"]["passed"] and result["parity"]["max_param_rel_diff"] <= 1e-9, result["parity"]
    checked = [row for row in result["ledger"] if row["phase"] == "check"]
    assert checked and all(row["op"] == "metadata_all_gather" for row in checked)
    assert result["config"]["checks"] is True


def test_checks_flag_parses():
    from shardkit.cli.main import build_parser
    from shardkit.cli.train import config_from_args

    assert config_from_args(build_parser().parse_args(["train", "--checks"])).checks is True
    assert config_from_args(build_parser().parse_args(["train"])).checks is False
