"""A tiny pretrained-style checkpoint for tests: SmolLM2's shape (9 query / 3 key-value heads, tied
embeddings) at toy sizes, saved with ``save_pretrained`` next to a byte-level BPE tokenizer
trained on the standard library's ``os.py``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

EOS = "<|endoftext|>"
SIZES = dict(
    hidden_size=36,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=64,
)


def byte_level_bpe():
    """A byte-level BPE (GPT-2 pre-tokenization, 400 tokens) trained on ``os.py``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([Path(os.__file__).read_text()], trainer)
    return tok


def save_tokenizer(path: Path) -> Path:
    """Write the byte-level BPE tokenizer alone (no config.json, no weights) into ``path``."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token=EOS).save_pretrained(path)
    return path


def save_tiny_llama(path: Path, **sizes: int) -> Path:
    """Write the tiny tied-embedding Llama checkpoint and its tokenizer into ``path`` (``sizes``
    override :data:`SIZES`, e.g. ``num_hidden_layers=4``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), eos_token=EOS)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, **{**SIZES, **sizes}
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path
