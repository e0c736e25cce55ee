"""``--save-hf`` and the router bias ``--moe-bias-update-rate`` learns: refused, never dropped.

The bias (DeepSeek-V3's ``e_score_correction_bias``, a buffer the trainer adds to each router)
is added to the scores that pick the experts. transformers' Qwen3-MoE and DeepSeek-V2 routers,
the MoE families shardkit trains, have no slot for it: an export would load into a model that
routes without it, and the exported logits would differ from the trained model's with no error.
The first test shows that on a router of each family (the logits of a transformers model
loaded from the trained state differ, and the bias is the one key it cannot take); the others
pin the refusal, made before launch on every rank (a pure function of the flags).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
import torch

from harness.tiny_lm import tiny_decoder, token_ids
from shardkit import export_hf
from shardkit.checkpoint import latest_checkpoint
from shardkit.errors import ShardkitError
from shardkit.expert_parallel.router import BIAS_BUFFER, install_balanced_router
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

BIAS_SIZES = dict(hidden_size=16, intermediate_size=32, layers=2, heads=2, kv_heads=1, seq_len=8, experts=4)


@pytest.mark.parametrize("model", ["moe", "mla"])
def test_a_transformers_model_has_no_slot_for_the_bias_and_routes_otherwise(model):
    trained = tiny_decoder(model, **BIAS_SIZES).eval()
    routers = [m for n, m in trained.named_modules() if n.endswith("mlp.gate")]
    assert routers
    for router in routers:
        install_balanced_router(router, bias_rate=1e-3)
        with torch.no_grad():  # a learned bias that moves the choice: expert e gets e / 2
            getattr(router, BIAS_BUFFER).copy_(torch.arange(router.num_experts, dtype=torch.float32) / 2)
    exported = tiny_decoder(model, **BIAS_SIZES).eval()  # the transformers class, same config
    _, unexpected = exported.load_state_dict(trained.state_dict(), strict=False)
    assert sorted(unexpected) == sorted(n for n, _ in trained.named_buffers() if n.endswith(BIAS_BUFFER))
    ids = token_ids(2, 8, vocab=exported.config.vocab_size)
    with torch.no_grad():
        with_bias = (exported(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max().item()
        for router in routers:
            getattr(router, BIAS_BUFFER).zero_()
        # with a zero bias the routing is the same: the only difference was the bias (the balanced
        # router's softmax and transformers' round apart, about 1e-10 here)
        without = (exported(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max().item()
    assert with_bias > 1e-3 and without < 1e-8, (with_bias, without)


def _cfg(tmp_path, **flags) -> TrainConfig:
    return TrainConfig(model="moe", tp=1, steps=1, seq_len=8, batch_size=2, dtype="float64", **flags)


def test_save_hf_with_the_bias_update_is_refused_before_launch(tmp_path):
    cfg = _cfg(tmp_path, moe_bias_update_rate=1e-3, save_hf=str(tmp_path / "hf"))
    with pytest.raises(ShardkitError, match="--save-hf with --moe-bias-update-rate: the router bias"):
        validate_config(cfg, world_size=1)
    assert not (tmp_path / "hf").exists()


def test_the_other_balancing_flags_and_the_bias_alone_still_pass(tmp_path):
    # z-loss and the sequence loss change the weights only (exported); the bias without --save-hf stays
    validate_config(_cfg(tmp_path, moe_z_loss=1e-3, moe_seq_aux_loss=1e-3, save_hf=str(tmp_path / "hf")), world_size=1)
    validate_config(_cfg(tmp_path, moe_bias_update_rate=1e-3), world_size=1)


@pytest.mark.world(1, timeout=240)
def test_export_of_a_save_trained_with_the_bias_is_refused():
    # the bias lives in the save (train/moe_bias/*, for --resume); `shardkit export` must not
    # drop it silently either
    root = tempfile.mkdtemp(prefix="shardkit-biasexport-")
    try:
        _refused_export(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _refused_export(root: str) -> None:
    cfg = validate_config(
        TrainConfig(
            model="moe",
            tp=1,
            steps=1,
            seq_len=8,
            batch_size=2,
            dtype="float64",
            layers=2,
            moe_bias_update_rate=1e-3,
            checkpoint_dir=os.path.join(root, "ckpt"),
            save_every=1,
        ),
        world_size=1,
    )
    check_checkpoint_dir(cfg)
    train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    save = latest_checkpoint(cfg.checkpoint_dir)
    with pytest.raises(ShardkitError, match="moe-bias-update-rate"):
        export_hf(save, os.path.join(root, "hf"))
    assert not os.path.exists(os.path.join(root, "hf"))
