"""A safetensors checkpoint read lazily, slice by slice: :class:`SafetensorsCheckpoint`.

Source: safetensors' lazy ``safe_open`` / ``get_slice`` reads.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from typing import Any

import torch

from ..errors import ShardkitError

__all__ = ["SafetensorsCheckpoint"]

# safetensors' dtype codes (its file format's "dtype" field)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class SafetensorsCheckpoint:
    """A safetensors checkpoint (one file or an index of shards) read lazily, slice by slice.

    Args:
        path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``, or
            one ``.safetensors`` file.

    Attributes:
        bytes_read: bytes of tensor data returned by :meth:`read` so far (file dtype).

    Raises:
        ShardkitError: no checkpoint at ``path``, or an index naming a missing file.

    Use as a context manager (or call :meth:`close`) to release the memory maps.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open  # optional dependency (the hf extra)

        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, _INDEX)
            if os.path.isfile(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.isfile(os.path.join(path, _SINGLE)):
                files = None
                single = os.path.join(path, _SINGLE)
            else:
                raise ShardkitError(f"load_sharded: {path} has neither {_SINGLE} nor {_INDEX}")
        elif os.path.isfile(path):
            files, single = None, path
        else:
            raise ShardkitError(f"load_sharded: no checkpoint at {path}")
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}  # safetensors' safe_open handles
        self._open = lambda file: (
            self._handles.get(file)
            or self._handles.setdefault(file, self._stack.enter_context(safe_open(file, framework="pt", device="cpu")))
        )
        if files is None:
            files = {k: single for k in self._open(single).keys()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise ShardkitError(f"load_sharded: the index of {path} names a missing file {file}")
        self._files = files
        self.bytes_read = 0

    def keys(self) -> set[str]:
        return set(self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self._files[key]).get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype of ``key`` (None for a safetensors type torch lacks)."""
        return _DTYPES.get(self._open(self._files[key]).get_slice(key).get_dtype())

    def read(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The block ``box`` (a ``(start, stop)`` per dim) of tensor ``key``; only it is read."""
        handle = self._open(self._files[key])
        if not box:  # a 0-dim tensor has no slice
            out = handle.get_tensor(key)
        else:
            out = handle.get_slice(key)[tuple(slice(a, b) for a, b in box)]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
