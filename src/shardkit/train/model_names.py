"""The ``--model`` names and their one-line summaries, without the models.

:mod:`.specs` builds one spec per name from here; the command line's flags (``shardkit train
--help``) read the names and summaries from here, so that listing them imports no torch.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["MODEL_SUMMARIES", "READS_CORPUS"]

MODEL_SUMMARIES = MappingProxyType(
    {
        "llama": "Llama (GQA)",
        "qwen2": "Qwen2 (GQA, q/k/v biases)",
        "qwen3": "Qwen3 (GQA, q/k norms)",
        "moe": "Qwen3-MoE (routed experts, top-2)",
        "mla": "DeepSeek-V2 (multi-head latent attention + MoE)",
        "conv-ae": "a convolutional autoencoder on a real photo, sharded with --spatial / --spatial-h",
    }
)
"""``--model`` name -> its summary (``--help``), in the order ``--help`` lists them."""

READS_CORPUS = MappingProxyType({name: name != "conv-ae" for name in MODEL_SUMMARIES})
"""``--model`` name -> whether it trains on the text corpus (``--data``): the spec's
``reads_corpus``, here so that the launcher checks ``--data`` before importing torch."""
