"""Experts over data-parallel replicas (issue 33 item 4): ``ep`` borrowing ``dp_replicate`` ranks.

DeepSeek-V3 runs EP 64 across its ZeRO-1 data-parallel ranks. Here ``ep`` takes whole
``dp_shard x cp x tp`` blocks of consecutive replicas; the experts' gradients are summed over the
ranks holding the same experts (``edp``, smaller than the replicas, or none), the dense ones over
every replica, and the global norm counts each expert shard once. Each case runs the trainer in
float64 against one process (``--verify``: every loss, gradient norm and final parameter to
relative 1e-9; an expert gradient summed over the wrong group, or a shard counted twice in the
norm, fails by far more), and the ledger shows the token all-to-all on a group that spans
replicas. A save at ep over replicas resumes at another expert layout with the same losses.
"""

import time

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.tiers import tiered
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

CORPUS = SMALL_CORPUS
SMALL = dict(steps=2, seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, model="moe", data=CORPUS)


def _train(**overrides) -> dict | None:
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    check_checkpoint_dir(cfg)
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


LAYOUTS = {
    "ep=4 over dp_replicate=4 (experts whole, no edp)": (dict(tp=1, ep=4), 4, 1),
    "ep=2 over dp_replicate=4 (edp=2)": (dict(tp=1, ep=2), 2, 2),
    "ep=4 over tp=2 x dp_replicate=2, zero 1 (DeepSeek-V3's shape)": (dict(tp=2, ep=4, zero=1), 4, 1),
    "mla: ep=4 over tp=2 (SP) x dp_replicate=2": (dict(model="mla", tp=2, ep=4, sequence_parallel=True), 4, 1),
    "ep=4 over dp_shard=2 x dp_replicate=2 (HSDP, experts whole)": (dict(tp=1, dp_shard=2, ep=4), 4, 1),
    "pp=2 x dp_replicate=2, ep=2 over the replicas, zero 2": (dict(tp=1, pp=2, ep=2, microbatches=2, zero=2), 2, 1),
}
QUICK = (
    "ep=2 over dp_replicate=4 (edp=2)",
    "ep=4 over tp=2 x dp_replicate=2, zero 1 (DeepSeek-V3's shape)",
)


@pytest.mark.world(4, timeout=150)
@pytest.mark.parametrize("overrides, ep, edp", tiered(LAYOUTS, QUICK))
def test_ep_over_replicas_matches_one_process(overrides, ep, edp):
    result = _train(verify=True, **overrides)
    if rank() != 0:
        return
    parity = result["parity"]
    assert parity["passed"] and parity["max_param_rel_diff"] <= 1e-9, parity
    for a, b in zip(result["grad_norms"], result["reference_grad_norms"]):
        assert abs(a - b) <= 1e-12 * b
    dispatch = [r for r in result["ledger"] if r["api"] == "token_dispatch"]
    assert dispatch and {r["group_size"] for r in dispatch} == {ep}, dispatch
    experts = [r for r in result["ledger"] if r["api"] == "expert_grads"]
    assert {r["group_size"] for r in experts} == ({edp} if edp > 1 else set()), experts


@pytest.mark.slow  # the quick tier resumes experts over edp on another layout in test_resume.py
@pytest.mark.world(4, timeout=240)
def test_ep_over_replicas_checkpoint_resumes_on_another_expert_layout():
    root = shared_tmpdir("shardkit-ep-replicas-")
    try:
        first, second = dict(tp=2, ep=4, zero=1), dict(tp=1, dp_shard=4, ep=2)
        # 1 step saved, 2 resumed: the second resumed loss follows a step of the loaded AdamW state
        full = _train(steps=3, **first)
        _train(steps=1, checkpoint_dir=root, **first)
        resumed = _train(steps=3, checkpoint_dir=root, resume=True, **second)
        if rank() == 0:
            assert resumed["first_step"] == 1
            for a, b in zip(resumed["losses"], full["losses"][1:], strict=True):
                assert abs(a - b) <= 1e-12 * abs(b), (resumed["losses"], full["losses"])
    finally:
        remove_shared_dir(root)
