"""Checkpoint IO: training checkpoints, tensor-parallel DCP saves and Hugging Face safetensors loads.

* :func:`save_train_state` / :func:`load_train_state`: DCP saves of model, optimizer, step, data
  position and RNG that resume on any layout, one versioned directory per save with a manifest
  written last (:mod:`.train_state`).
* :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`: shardkit's own DCP
  checkpoint of a tensor-parallel model, loadable at any tp size (:mod:`.dcp`).
* :func:`load_sharded`: a Hugging Face safetensors checkpoint (full weights) read straight into a
  tensor-parallel model, each rank reading only its slices (:mod:`.safetensors`).
* :func:`export_hf`: a training save, of any layout, written back as a Hugging Face model
  directory (config, safetensors shards, tokenizer) (:mod:`.export`).
"""

from .dcp import load_sharded_checkpoint, save_sharded_checkpoint
from .export import export_hf
from .meta import materialize_meta
from .safetensors import load_sharded
from .safetensors_file import SafetensorsCheckpoint
from .train_state import MANIFEST, latest_checkpoint, load_train_state, save_train_state

__all__ = [
    "save_train_state",
    "load_train_state",
    "latest_checkpoint",
    "MANIFEST",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "load_sharded",
    "SafetensorsCheckpoint",
    "materialize_meta",
    "export_hf",
]
