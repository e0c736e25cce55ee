"""The ``--model`` names and their one-line summaries, without the models.

:mod:`.specs` builds one spec per name from here; the command line's flags (``shardkit train
--help``) read the names and summaries from here, so that listing them imports no torch.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["MODEL_SUMMARIES"]

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
