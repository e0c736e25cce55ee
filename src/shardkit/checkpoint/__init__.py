"""Training checkpoints: DCP saves of model, optimizer, step, data position and RNG that resume
on any layout, one versioned directory per save with a manifest written last."""

from .train_state import MANIFEST, latest_checkpoint, load_train_state, save_train_state

__all__ = ["save_train_state", "load_train_state", "latest_checkpoint", "MANIFEST"]
