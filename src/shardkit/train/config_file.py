"""The options file and the paths of ``shardkit train``, read and checked without torch.

:func:`load_toml` (unknown keys, wrong types), :func:`merge_config` (defaults < file < flags) and
:func:`check_writable` (an output folder that can be written) import neither torch nor the
library's packages, so the command reports a bad ``--config`` or output path before any
``import torch`` (issue 32). :mod:`.config` runs them as part of its checks.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import fields
from pathlib import Path

from ..errors import ShardkitError
from .options import TrainConfig

__all__ = ["load_toml", "merge_config", "check_writable", "check_output_dirs"]

_FIELDS = {f.name: f for f in fields(TrainConfig)}
_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool}


def _type_name(field) -> str:
    return str(field.type).split(" ")[0]  # "int | None" -> "int"


def load_toml(path: str | Path) -> dict:
    """Read a TOML file of ``shardkit train`` options (keys are option names with underscores).

    Raises:
        ShardkitError: the file is missing or not valid TOML, has an unknown key or a value of
            the wrong type.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ShardkitError(f"--config: cannot read {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself, outside TOMLDecodeError
        raise ShardkitError(f"--config: {path} is not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except tomllib.TOMLDecodeError as e:
        raise ShardkitError(f"--config: {path} is not valid TOML: {e}") from e
    for key, value in data.items():
        if key not in _FIELDS or key == "config":
            known = ", ".join(k for k in _FIELDS if k != "config")
            raise ShardkitError(f"--config: unknown key {key!r} in {path} (known keys: {known})")
        want = _TYPES[_type_name(_FIELDS[key])]
        if isinstance(value, bool) and want is not bool or not isinstance(value, want):
            raise ShardkitError(f"--config: {key} in {path} must be {_type_name(_FIELDS[key])}, got {value!r}")
    return data


def merge_config(file_values: dict, cli_values: dict) -> TrainConfig:
    """Defaults, overridden by ``file_values``, overridden by the flags that were given.

    Args:
        file_values: keys/values from :func:`load_toml` (may be empty).
        cli_values: parsed flags; a value of None means "not given on the command line".
    """
    merged = {**file_values, **{k: v for k, v in cli_values.items() if v is not None and k in _FIELDS}}
    return dataclasses.replace(TrainConfig(), **merged)


def check_writable(flag: str, folder: str) -> None:
    """``folder`` exists as a writable directory, or can be created (checked before launch, so a
    run never trains for nothing and then fails to write its results)."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ShardkitError(f"{flag} {folder}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ShardkitError(f"{flag} {folder}: {probe} is not writable")


def check_output_dirs(cfg: TrainConfig) -> None:
    """``--report`` and ``--checkpoint-dir``, where given, can be written (:func:`check_writable`).

    Raises:
        ShardkitError: naming the flag and the path at fault.
    """
    for flag, folder in (("--report", cfg.report), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if folder is not None:
            check_writable(flag, folder)
