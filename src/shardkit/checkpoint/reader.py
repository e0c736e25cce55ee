"""Read a shardkit checkpoint without running anything it holds: DCP's ``.metadata`` through an
allow-list unpickler, every item's bytes checked against the manifest's SHA-256 as it is read.

DCP stores its ``.metadata`` as a pickle, and ``pickle.load`` calls whatever global a file
names: a planted ``.metadata`` runs code as the user who loads it. :func:`read_metadata`
unpickles with a :class:`pickle.Unpickler` whose ``find_class`` admits only the classes a DCP
metadata file is made of (DCP's metadata dataclasses, its file-system ``_StorageInfo``,
``torch.Size``, dtypes, layouts, memory formats, ``pathlib`` paths) and refuses any other global
before it is looked up (torch's values are read from its namespace, never through ``getattr``,
which imports submodules). Before unpickling, :func:`.pickle_scan.scan_pickle` bounds the work
(no shared containers, no deep nesting); after it, :func:`.metadata_check.check_metadata`
checks every field before anything hashes, allocates or reads with it: tensor metadata only
(shardkit never writes DCP "bytes" items, which DCP loads with
``torch.load(weights_only=False)``), every item in a regular file of the save's own directory
(no link out of it), every size within those files' bytes.

:class:`VerifiedReader` is DCP's ``FileSystemReader`` with the already-checked metadata and the
manifest's checksums: ``read_data`` reads each stored item's byte range once, compares its hash
(a flipped bit, a NaN written over a value, a truncated file are all refused, naming the item)
and only then deserializes the tensor (``torch.load(weights_only=True)``) into the planner's
targets.

Source: Python's documented way of restricting globals (``pickle`` docs, "Restricting
Globals"); DCP's storage-reader interface (``read_metadata`` / ``read_data``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from ..errors import ShardkitError
from .metadata_check import check_metadata
from .paths import regular_file_inside
from .pickle_scan import MAX_BYTES, scan_pickle

__all__ = ["METADATA", "read_metadata", "item_key", "VerifiedReader", "sha256"]

METADATA = ".metadata"

_DCP = "torch.distributed.checkpoint"
# (module, name) of every global a DCP metadata pickle is made of; nothing else is looked up.
_ALLOWED = {
    *(
        (f"{_DCP}.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name, from torch's own table
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global is refused before it is imported."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        # torch.float32, torch.strided, torch.contiguous_format: read from torch's own namespace,
        # never through getattr (torch's module __getattr__ imports the submodule a name names,
        # e.g. torch._inductor, before anything could refuse it)
        value = vars(torch).get(name) if module == "torch" and isinstance(name, str) else None
        if isinstance(value, _TORCH_VALUES):
            return value
        raise ShardkitError(
            f"{self._path} is not a DCP metadata file: it names the global {module}.{name}, "
            "which a checkpoint's metadata never holds (refused, nothing of it was run)"
        )


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def item_key(index: MetadataIndex) -> str:
    """``fqn@o0,o1,...``: one stored item (a chunk of a tensor at its global offsets)."""
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset or ())}"


def _describe(key: str) -> str:
    fqn, _, offsets = key.rpartition("@")
    return f"item {fqn} at chunk offset [{offsets.replace(',', ', ')}]"


def read_metadata(path: str, expected_sha256: str | None) -> Metadata:
    """The DCP metadata of the save at ``path``, unpickled through the allow-list.

    Args:
        path: one save's directory.
        expected_sha256: the manifest's hash of ``.metadata`` (checked before unpickling), or
            None for a file not covered by a manifest.

    Raises:
        ShardkitError: unreadable, not a regular file inside ``path`` or over
            :data:`.pickle_scan.MAX_BYTES`, a hash that differs, a pickle whose unpickling would
            cost more than linear work (a shared container, deep nesting:
            :func:`.pickle_scan.scan_pickle`), a global outside the allow-list, a truncated or
            malformed pickle, bytes items, a field of the wrong type or beyond the save's files
            (:func:`.metadata_check.check_metadata`), or an item outside ``path``.
    """
    file = os.path.join(path, METADATA)
    size = regular_file_inside(path, file, "metadata file")
    if size > MAX_BYTES:
        raise ShardkitError(f"{file} holds {size} bytes, more than a DCP metadata file's {MAX_BYTES}: refused unread")
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ShardkitError(f"cannot read {file}: {exc.strerror or exc}") from None
    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise ShardkitError(
            f"{file} differs from the save's manifest (SHA-256 mismatch): changed or damaged since the save"
        )
    scan_pickle(data, file)  # bounded work: no shared containers, no deep nesting (linear in the file)
    try:
        metadata = _MetadataUnpickler(data, file).load()
    except ShardkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or garbage pickle raises many types
        raise ShardkitError(f"{file} is truncated or not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    check_metadata(metadata, file, path)
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file-system reader over checked metadata, verifying each item's bytes as it reads.

    Args:
        path: one save's directory.
        metadata: from :func:`read_metadata`.
        checksums: ``{item_key: sha256 hex}`` from the manifest; None: a save of an earlier
            shardkit, read without verification (still ``weights_only``).
    """

    def __init__(self, path: str, metadata: Metadata, checksums: dict[str, str] | None) -> None:
        super().__init__(path)
        self._dir = path
        self._metadata = metadata
        self._checksums = checksums

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata  # read once, through the allow-list, before DCP started

    def read_data(self, plan, planner) -> Future:
        by_item: dict = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise ShardkitError(f"{self._dir}: a pickled item {req.storage_index.fqn!r} was requested; refused")
            by_item.setdefault(req.storage_index, []).append(req)
        # Items are read and hashed on torch.get_num_threads() threads (file reads and hashlib
        # release the GIL), a window of that many at a time so that at most that many items'
        # bytes are held; each is then deserialized and copied into its targets in order.
        indices = list(by_item)
        workers = max(1, min(torch.get_num_threads(), len(indices)))
        with ThreadPoolExecutor(workers, thread_name_prefix="shardkit-verify") as pool:
            for start in range(0, len(indices), workers):
                window = indices[start : start + workers]
                for index, data in zip(window, pool.map(self._verified_bytes, window)):
                    self._copy_out(
                        index,
                        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True),
                        by_item[index],
                        planner,
                    )
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _copy_out(self, index: MetadataIndex, tensor: torch.Tensor, reqs: list, planner) -> None:
        """The requested pieces of one stored item into the planner's targets."""
        for req in reqs:
            piece = tensor
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                piece = piece.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.shape != piece.shape:
                raise ShardkitError(
                    f"{self._dir}: {_describe(item_key(index))} gives {list(piece.shape)}, the "
                    f"load expects {list(target.shape)}"
                )
            target.copy_(piece)
            planner.commit_tensor(req, target)

    def _verified_bytes(self, index: MetadataIndex) -> bytes:
        """The stored bytes of one item, once they matched the manifest."""
        info = self.storage_data[index]
        key, file = item_key(index), os.path.join(self._dir, info.relative_path)
        regular_file_inside(self._dir, file, "data file")  # again: a link may have been planted since
        expected = None if self._checksums is None else self._checksums.get(key)
        if expected is None and self._checksums is not None:
            raise ShardkitError(f"{self._dir}: {_describe(key)} has no checksum in the manifest")
        with open(file, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise ShardkitError(
                f"{file}: {_describe(key)} is truncated: {len(data)} of its {info.length} bytes "
                f"at offset {info.offset} are there"
            )
        if expected is not None and sha256(data) != expected:
            raise ShardkitError(
                f"{file}: {_describe(key)} differs from its checksum in the manifest (SHA-256 "
                "mismatch): the saved bytes changed since the save"
            )
        return data
