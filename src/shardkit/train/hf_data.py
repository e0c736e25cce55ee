"""``--data hf:NAME[:SPLIT]``: a Hugging Face ``datasets`` dataset as the training text, offline.

NAME is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
``load_from_disk``), or else a dataset name (``user/name``) found in the local ``datasets``
cache (``HF_DATASETS_CACHE``, where an earlier online ``load_dataset(NAME)`` left it; read with
``load_dataset`` in offline mode). Nothing is downloaded: the training processes may have no
network, and a job that silently starts a multi-gigabyte download on rank 0 while the other
ranks wait is worse than an error saying to fetch it first.

SPLIT defaults to ``train``; a folder holding a single ``Dataset`` has no splits (give none).
Each row's ``--data-column`` field (default ``text``) is a document, exactly as a JSONL line's
field is (:func:`.data.file_documents`): the same text gives the same byte tokens, or the same
tokenizer ids, as the JSONL file. Rows are streamed from the memory-mapped Arrow files in
batches (never the whole table in Python at once), on global rank 0 only, as the corpus files
are (:mod:`.corpus`); a tokenizer run stops at the same byte budget
(:data:`~shardkit.train.tokens.DEFAULT_MAX_BYTES`), counted in text bytes.

No torch here: the launcher's check (:func:`check_hf`) runs before ``import torch``. It imports
``datasets`` (pyarrow, not torch), opens the split and checks the column.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from .._optional import require
from ..errors import ShardkitError

__all__ = ["HF_PREFIX", "parse_hf", "open_split", "hf_documents", "check_hf"]

HF_PREFIX = "hf:"
"""The ``--data`` prefix of a Hugging Face dataset."""
DEFAULT_SPLIT = "train"
# Rows per Arrow batch read: large enough that the per-batch overhead vanishes, small enough
# that a batch of long documents stays a few MB.
_BATCH_ROWS = 1024


def parse_hf(data: str | None) -> tuple[str, str | None] | None:
    """``(NAME, SPLIT or None)`` of ``--data hf:NAME[:SPLIT]``; None for any other ``--data``.

    An existing folder is NAME whole (a path may hold a colon); otherwise the last ``:`` starts
    SPLIT.

    Raises:
        ShardkitError: ``hf:`` with no NAME, or an empty SPLIT.
    """
    if data is None or not data.startswith(HF_PREFIX):
        return None
    rest = data[len(HF_PREFIX) :]
    name, split = rest, None
    if not Path(rest).is_dir() and ":" in rest:
        name, split = rest.rsplit(":", 1)
        if not split:
            raise ShardkitError(f"--data {data}: empty SPLIT after ':' (hf:NAME[:SPLIT], e.g. hf:{name}:train)")
    if not name:
        raise ShardkitError(f"--data {data}: give a dataset: hf:NAME[:SPLIT] (a save_to_disk folder or a cached name)")
    return name, split


def _datasets() -> Any:
    """The ``datasets`` module in offline mode, quiet (no progress bars or cache notes)."""
    require(["datasets"], "shardkit train --data hf:NAME")
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when datasets / huggingface_hub are first imported
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets = importlib.import_module("datasets")  # optional: import_module keeps mypy off its stubs
    datasets.config.HF_HUB_OFFLINE = True  # already imported before (a test, a notebook): read per call
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def open_split(name: str, split: str | None) -> Any:
    """The ``datasets.Dataset`` of NAME's SPLIT (see the module note), memory-mapped.

    Raises:
        MissingExtraError: ``datasets`` is not installed (``pip install 'shardkit[datasets]'``).
        ShardkitError: NAME is neither a ``save_to_disk`` folder nor in the local cache; the
            split does not exist (naming those that do); a split given for a single ``Dataset``.
    """
    datasets = _datasets()
    where = f"--data hf:{name}"
    if Path(name).is_dir():
        try:
            loaded = datasets.load_from_disk(name)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ShardkitError(f"{where}: not a folder written by save_to_disk ({e})") from None
        if isinstance(loaded, datasets.DatasetDict):
            chosen = split or DEFAULT_SPLIT
            if chosen not in loaded:
                raise ShardkitError(f"{where}: no split {chosen!r}; the folder holds {', '.join(map(repr, loaded))}")
            return loaded[chosen]
        if split is not None and split != (str(loaded.split) if loaded.split is not None else None):
            raise ShardkitError(
                f"{where}:{split}: the folder holds one Dataset, not a DatasetDict of splits: drop ':{split}'"
            )
        return loaded
    try:
        return datasets.load_dataset(name, split=split or DEFAULT_SPLIT)
    except ValueError as e:  # datasets' "Unknown split" names the splits there are
        if "split" in str(e).lower():
            raise ShardkitError(f"{where}: {e}") from None
        failure: Exception = e
    except (ConnectionError, FileNotFoundError) as e:  # not cached: offline mode refuses the hub
        failure = e
    raise ShardkitError(
        f"{where}: neither a save_to_disk folder nor a dataset in the local datasets cache "
        f"({datasets.config.HF_DATASETS_CACHE}); shardkit reads offline: fetch it first with "
        f"`python -c \"import datasets; datasets.load_dataset('{name}')\"` or save_to_disk it ({failure})"
    ) from None


def _check_column(dataset: Any, name: str, column: str) -> None:
    if column not in dataset.column_names:
        raise ShardkitError(
            f"--data hf:{name}: no column {column!r} (--data-column {column}); the dataset's columns: "
            f"{', '.join(map(repr, dataset.column_names))}"
        )


def hf_documents(name: str, split: str | None, column: str, max_bytes: int | None = None) -> list[bytes]:
    """The documents of NAME's SPLIT: each row's ``column`` as UTF-8, in row order, streamed.

    Args:
        name: the dataset's name or folder, as :func:`parse_hf` returns it.
        split: the split, as :func:`parse_hf` returns it.
        column: the text column (``--data-column``).
        max_bytes: stop before the first row that would take the text past this many bytes
            (None: every row), as a JSONL line cut by the byte cap is dropped.

    Raises:
        ShardkitError: as :func:`open_split`; no such column (listing the columns); a row whose
            value is not a string (naming the row).
    """
    dataset = open_split(name, split)
    _check_column(dataset, name, column)
    docs: list[bytes] = []
    total, row = 0, 0
    for batch in dataset.select_columns([column]).iter(batch_size=_BATCH_ROWS):
        for value in batch[column]:
            if not isinstance(value, str):
                raise ShardkitError(
                    f"--data hf:{name}: row {row}: column {column!r} holds {type(value).__name__}, not text"
                )
            doc = value.encode()
            if max_bytes is not None and total + len(doc) > max_bytes:
                return docs
            docs.append(doc)
            total, row = total + len(doc), row + 1
    return docs


def check_hf(data: str, column: str) -> int:
    """The launcher's check of ``--data hf:...`` (before ``import torch``): the package, the
    dataset, the split and the column. Returns the number of rows (their text is not read).

    Raises:
        MissingExtraError, ShardkitError: as :func:`open_split` and :func:`hf_documents`.
    """
    parsed = parse_hf(data)
    assert parsed is not None, data
    dataset = open_split(*parsed)
    _check_column(dataset, parsed[0], column)
    return len(dataset)
