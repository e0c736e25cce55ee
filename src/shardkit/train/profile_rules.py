"""``--profile-steps A:B``, ``--profile-dir`` and ``--memory-snapshot`` checked without torch.

The launcher refuses a bad window, a missing output folder or a memory snapshot on CPU ranks
before ``import torch`` (issue 32); :mod:`.profiling` records on every rank what these allow.
"""

from __future__ import annotations

import os

from ..errors import ShardkitError
from .config_file import check_writable
from .options import TrainConfig

__all__ = ["parse_profile_steps", "profile_window", "profile_dir", "check_profile_options"]


def parse_profile_steps(text: str, steps: int) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)``: the 1-based steps ``A..B`` (both included) of a ``steps``-step run.

    Raises:
        ShardkitError: not two ints ``1 <= A <= B <= steps`` joined by ``:``.
    """
    parts = str(text).split(":")
    try:
        a, b = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        a, b = 0, 0
    if not 1 <= a <= b <= steps:
        raise ShardkitError(
            f"--profile-steps must be A:B with 1 <= A <= B <= --steps {steps} (1-based steps, both "
            f"included), got {text!r}"
        )
    return a, b


def profile_window(cfg: TrainConfig) -> tuple[int, int] | None:
    """The 1-based steps profiled (``--profile-steps``) or whose allocations a memory snapshot
    records (``--memory-snapshot`` alone: every step); None when neither is asked."""
    if cfg.profile_steps is not None:
        return parse_profile_steps(cfg.profile_steps, cfg.steps)
    return (1, cfg.steps) if cfg.memory_snapshot else None


def profile_dir(cfg: TrainConfig) -> str | None:
    """Where the traces and snapshots go: ``--profile-dir``, else ``--report DIR/profile``."""
    if cfg.profile_dir is not None:
        return cfg.profile_dir
    return os.path.join(cfg.report, "profile") if cfg.report is not None else None


def check_profile_options(cfg: TrainConfig, world_size: int | None) -> None:
    """The profiling flags against each other and the launch (pure but for the folder probe).

    Args:
        cfg: the merged configuration.
        world_size: the torchrun world's size, None for the local launch (CPU ranks with gloo).

    Raises:
        ShardkitError: a bad ``--profile-steps``; ``--profile-dir`` alone; profiling with no
            folder to write to; ``--memory-snapshot`` on the local launch, whose ranks are CPU
            processes (the snapshot is the CUDA caching allocator's history).
    """
    window = profile_window(cfg)
    if window is None:
        if cfg.profile_dir is not None:
            raise ShardkitError("--profile-dir: give --profile-steps A:B or --memory-snapshot (what to write there)")
        return
    if cfg.memory_snapshot and world_size is None:
        raise ShardkitError(
            "--memory-snapshot records the CUDA caching allocator: it needs CUDA ranks (torchrun on GPUs); "
            "this local launch runs CPU ranks with gloo (--profile-steps A:B profiles CPU ranks)"
        )
    folder = profile_dir(cfg)
    if folder is None:
        flag = "--profile-steps" if cfg.profile_steps is not None else "--memory-snapshot"
        raise ShardkitError(
            f"{flag} writes one file per rank: give --report DIR (into DIR/profile) or --profile-dir DIR"
        )
    check_writable("--profile-dir" if cfg.profile_dir is not None else "--report", folder)
