"""Gemma 2 as a trainer family: ``shardkit train --model-path`` on a Gemma 2 checkpoint passes ``--verify``.

The checkpoint (a tiny random ``Gemma2ForCausalLM`` saved with ``save_pretrained`` here) carries
every Gemma 2 trait: a sliding window shorter than the training sequence on alternate layers
(``layer_types``), an attention logit softcap small enough to bite at these score sizes, the
final logit softcap, ``query_pre_attn_scalar`` different from the head dim, the sandwich norms
and tied embeddings. The reference (every degree 1) is transformers' own Gemma 2 forward with
its eager attention (the float32 round trips of its softmax and RMSNorm taken out for float64:
``keep_float64``, checked against transformers' unpatched forward below); the cp layouts apply
the window and the cap inside ring / Ulysses / USP attention on global positions, the tp layouts
cut the scaled embedding by vocabulary rows, the pipeline's last stage applies the final cap.
float64, relative 1e-9 on every loss, gradient norm and final parameter (``result["parity"]``).
"""

import os
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
from harness.pretrained import save_tokenizer
from harness.tiers import tiered
from shardkit import ShardkitError, export_hf
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import train

WINDOW = 6  # < seq_len 16: the sliding layers hide keys
SOFTCAP = 0.5  # attention logit cap that bites (Gemma 2 ships 50.0)
FINAL_SOFTCAP = 2.0  # final logit cap that bites (Gemma 2 ships 30.0)
SIZES = dict(
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    query_pre_attn_scalar=16,  # scale 1/4, not head_dim's 1/sqrt(8)
    max_position_embeddings=64,
)


def _config(vocab: int, **over):
    from transformers import Gemma2Config

    kw = dict(
        vocab_size=vocab,
        sliding_window=WINDOW,
        attn_logit_softcapping=SOFTCAP,
        final_logit_softcapping=FINAL_SOFTCAP,
        tie_word_embeddings=True,
        **SIZES,
    )
    return Gemma2Config(**{**kw, **over})


def _save_gemma2(path: Path) -> None:
    from transformers import Gemma2ForCausalLM, PreTrainedTokenizerFast

    save_tokenizer(path)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(path))
    torch.manual_seed(0)
    config = _config(vocab)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = Gemma2ForCausalLM(config)
    _bite(model)
    model.save_pretrained(path)


def _bite(model) -> None:
    """Weights at which every trait shows: the 1-centred norm weights (0 at init) get values, so a
    dropped ``1 + w`` shows, and q/k projections large enough that the scores reach the cap."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(20.0)


def _train(root: str, **layout):
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
    return train(validate_config(cfg, world_size=world_size()), "gloo", torch.device("cpu"), time.perf_counter(), False)


LAYOUTS = {
    "ring x fsdp": dict(cp_ring=2, dp_shard=2),
    "ulysses x tp": dict(cp_ulysses=2, tp=2),
    "usp": dict(cp_ring=2, cp_ulysses=2),
    "tp-sp x dp": dict(tp=2, dp_replicate=2, sequence_parallel=True),
    "pp x tp": dict(pp=2, tp=2, microbatches=2),
}
# quick: usp runs both cp attentions (ring across, Ulysses inside) with the window and the cap;
# pp x tp runs the vocab-parallel scaled embedding and the last stage's final cap
QUICK = ["usp", "pp x tp"]


@pytest.mark.world(4, timeout=300)
@pytest.mark.parametrize("layout", tiered(LAYOUTS, QUICK))
def test_gemma2_checkpoint_matches_one_process(layout):
    root = shared_tmpdir("shardkit-gemma2-")
    try:
        if rank() == 0:
            _save_gemma2(Path(root))
        torch.distributed.barrier()
        result = _train(root, **layout)
        if rank() == 0:
            parity = result["parity"]
            assert parity["passed"] and parity["tolerance"] == 1e-9, parity
            assert result["layout"]["model"] == "gemma2"
    finally:
        remove_shared_dir(root)


@pytest.mark.slow  # a write_hf round trip of the family is in the quick tier (test_export.py)
@pytest.mark.world(4, timeout=300)
def test_gemma2_save_hf_equals_the_export_of_its_checkpoint():
    # --save-hf (the trainer's gather of the ring x FSDP2 run) and shardkit export of the DCP save
    # (its chunks read back whole): one trained Gemma 2, its traits and tied head kept
    from transformers import AutoModelForCausalLM, Gemma2ForCausalLM

    root = shared_tmpdir("shardkit-gemma2-")
    try:
        source, ckpt, live, out = (os.path.join(root, n) for n in ("source", "ckpt", "live", "hf"))
        if rank() == 0:
            _save_gemma2(Path(source))
        torch.distributed.barrier()
        _train(source, cp_ring=2, dp_shard=2, checkpoint_dir=ckpt, save_hf=live)
        if rank() == 0:
            export_hf(ckpt, out)
            exported, saved, before = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (out, live, source))
            assert type(saved) is Gemma2ForCausalLM and saved.lm_head.weight is saved.model.embed_tokens.weight
            for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
                assert getattr(saved.config, key) == getattr(before.config, key), key
            assert saved.config.layer_types == before.config.layer_types
            state = exported.state_dict()
            for name, t in saved.state_dict().items():
                assert torch.equal(state[name], t), name
            assert not torch.equal(saved.model.norm.weight, before.model.norm.weight)  # it trained
            x = torch.randint(0, saved.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                assert torch.equal(exported(x).logits, saved(x).logits)
    finally:
        remove_shared_dir(root)


def test_keep_float64_gemma2_is_transformers_forward_without_its_float32_roundings():
    """The reference the ``--verify`` runs above compare with: transformers' own Gemma 2 eager
    forward (unpatched, its softmax and norms rounding to float32) to float32 rounding, while
    each Gemma 2 trait moves the logits by far more than that."""
    from transformers import Gemma2ForCausalLM

    from shardkit.train.model import keep_float64

    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))

    def logits(patched: bool, **over):
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(_config(97, attn_implementation="eager", **over)).double().eval()
        _bite(model)
        if patched:
            keep_float64(model)
        with torch.no_grad():
            return model(ids).logits

    ours, theirs = logits(True), logits(False)
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert 0 < rel < 1e-6, rel  # float32 roundings removed, nothing else
    for over in (
        dict(sliding_window=64),
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=8),
    ):
        other = logits(True, **over)
        assert ((other - ours).norm() / ours.norm()).item() > 1e-3, over


@pytest.mark.parametrize(
    "flags,match",
    [
        (dict(cp_ring=2, cp_layout="stripe"), r"stripe.*sliding window"),
        (dict(packed=True), r"--packed.*gemma2"),
    ],
    ids=["stripe with a window", "packed"],
)
def test_what_gemma2_cannot_take_is_refused_before_launch(flags, match):
    cfg = TrainConfig(model="gemma2", seq_len=16, batch_size=2, layers=2, tp=1, **flags)
    with pytest.raises(ShardkitError, match=match):
        validate_config(cfg, world_size=2 if flags.get("cp_ring") else 1)


@pytest.mark.slow  # one more layout of the same hooks (the quick tier has the checkpoint's)
@pytest.mark.world(4, timeout=300)
def test_builtin_gemma2_from_flags_matches_one_process():
    # --model gemma2 without a checkpoint: the family's config at the flags' sizes (window
    # seq_len / 2 on the sliding layers, both softcaps, tied embeddings), ring x tp
    from shardkit.train.lm_families import GEMMA2
    from shardkit.train.model import hf_config

    cfg = validate_config(
        TrainConfig(model="gemma2", steps=2, seq_len=16, batch_size=2, dtype="float64", verify=True, cp_ring=2, tp=2),
        world_size=world_size(),
    )
    _, config = hf_config(cfg, GEMMA2)
    assert config.sliding_window == 8 and "sliding_attention" in config.layer_types
    assert config.tie_word_embeddings and config._attn_implementation == "eager"
    assert config.query_pre_attn_scalar != config.head_dim
    result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
    if rank() == 0:
        parity = result["parity"]
        assert parity["passed"] and parity["tolerance"] == 1e-9, parity
