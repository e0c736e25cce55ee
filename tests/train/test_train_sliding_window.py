"""``shardkit train --model-path`` on a Qwen2 checkpoint with sliding-window layers: cp > 1 passes ``--verify``.

The checkpoint's config carries ``use_sliding_window``, ``sliding_window`` shorter than the
training sequence and ``layer_types`` with a sliding layer, so the window hides keys. The
reference (every degree 1) runs transformers' SDPA with transformers' sliding-window mask; the cp
runs apply the window inside ring / Ulysses / USP attention on global positions. float64,
relative 1e-9 on every loss, gradient norm and final parameter (``result["parity"]``).
"""

import time
from pathlib import Path

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.pretrained import SIZES, save_tokenizer
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

WINDOW = 6  # < seq_len 16


def _save_qwen2(path: Path) -> None:
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    save_tokenizer(path)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(path))
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        **{**SIZES, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32},
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    Qwen2ForCausalLM(config).save_pretrained(path)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize(
    "layout",
    [dict(cp_ring=2, dp_shard=2), dict(cp_ulysses=2, tp=2), dict(cp_ring=2, cp_ulysses=2)],
    ids=["ring x fsdp", "ulysses x tp", "usp"],
)
def test_sliding_window_checkpoint_matches_one_process(layout):
    root = shared_tmpdir("shardkit-sliding-")
    try:
        if rank() == 0:
            _save_qwen2(Path(root))
        torch.distributed.barrier()
        cfg = TrainConfig(
            model_path=root,
            data=SMALL_CORPUS,
            steps=2,
            seq_len=16,
            batch_size=2,
            dtype="float64",
            verify=True,
            lr=1e-3,
            **layout,
        )
        result = train(
            validate_config(cfg, world_size=world_size()),
            "gloo",
            torch.device("cpu"),
            time.perf_counter(),
            progress=False,
        )
        if rank() == 0:
            parity = result["parity"]
            assert parity["passed"] and parity["tolerance"] == 1e-9, parity
            assert result["layout"]["model"] == "qwen2"
    finally:
        remove_shared_dir(root)
