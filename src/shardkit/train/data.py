"""Real text for ``shardkit train``: byte-level tokens and deterministic batches.

Byte-level tokenization (token = byte value, vocab 256) needs no tokenizer files, so any text
works offline. The default corpus is the Python standard library's own source tree, which ships
with every Python installation. Only regular files are read (:func:`read_regular`): a FIFO would
block the reader forever, a device never ends.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ShardkitError
from .hf_data import check_hf, parse_hf

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that make tensors: the file checks here (paths, regular
# files, JSONL lines) run in the launcher before `import torch` (issue 32), so a bad --data fails fast.

__all__ = [
    "VOCAB_SIZE",
    "stdlib_files",
    "corpus_files",
    "check_files",
    "check_corpus",
    "read_regular",
    "read_documents",
    "file_documents",
    "load_tokens",
    "BatchSampler",
    "held_out_start",
    "HeldOutBatches",
]

VOCAB_SIZE = 256
# Third-party code lives under the stdlib folder but is not the standard library.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files (``os.path.dirname(os.__file__)``), sorted.

    Walks with pruning: descending into ``site-packages`` (gigabytes of third-party code) and
    filtering afterwards costs seconds.
    """
    root = os.path.dirname(os.__file__)
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        out += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def corpus_files(path: str | None) -> list[Path]:
    """Files of the corpus: the stdlib for None, the file itself, or a folder's files (sorted).

    Hidden files and folders (``.git``, ...) are skipped.

    Raises:
        ShardkitError: ``path`` does not exist or holds no files.
    """
    if path is None:
        return stdlib_files()
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ShardkitError(f"--data: {path} is neither a file nor a folder")
    out = []
    for folder, dirs, files in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [Path(folder, f) for f in files if not f.startswith(".")]
    if not out:
        raise ShardkitError(f"--data: folder {path} holds no files")
    return sorted(out)


_KINDS = {
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISDIR: "a directory",
}


def _regular_stat(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS.items() if test(st.st_mode)), "not a regular file")
        raise ShardkitError(f"--data: {path} is {kind}; only regular files are read")


def _open_regular(path: Path) -> int:
    """An fd of ``path`` opened for reading without blocking, checked to be a regular file."""
    try:
        _regular_stat(path, os.stat(path))  # before open: opening a socket fails, a FIFO would block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        what = "is a broken symbolic link" if os.path.islink(path) else "does not exist (any more)"
        raise ShardkitError(f"--data: {path} {what}") from None
    except OSError as e:
        raise ShardkitError(f"--data: cannot read {path}: {e.strerror}") from e
    try:
        _regular_stat(path, os.fstat(fd))  # the file opened is the one checked (no swap in between)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_files(files: list[Path]) -> None:
    """Every file is a regular file this process can open for reading (nothing is read).

    Raises:
        ShardkitError: naming the first file that is not (a FIFO, socket, device, broken symbolic
            link, or a file without read permission).
    """
    for f in files:
        os.close(_open_regular(f))


def check_corpus(path: str | None, column: str, seq_len: int) -> int | None:
    """The ``--data`` corpus as the launcher checks it (stat, open and JSONL/Parquet parsing only,
    no torch): every file regular and readable, every ``*.jsonl`` line and ``*.parquet`` row a
    document with ``column``, at least ``seq_len`` bytes in all. Returns that byte count; None
    for ``hf:NAME`` (:func:`.hf_data.check_hf`: the dataset, split and column; its text is
    counted by the ranks, which all raise the same error when it is too short).

    Raises:
        ShardkitError: naming the file (and line) or the sizes at fault.
    """
    if parse_hf(path) is not None:  # a Hugging Face dataset: its package, split and column
        assert path is not None
        check_hf(path, column)
        return None
    files = corpus_files(path)
    check_files(files)
    for f in files:  # a bad JSONL line or a Parquet file without pyarrow: fails here, naming it
        if f.suffix.lower() in (".jsonl", ".parquet"):
            file_documents(f, None, column)
    size = sum(f.stat().st_size for f in files)
    if size < seq_len:
        raise ShardkitError(f"--data: the corpus has {size} bytes (tokens), fewer than --seq-len {seq_len}")
    return size


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The first ``limit`` bytes of ``path`` (None: all), read only if it is a regular file.

    Raises:
        ShardkitError: as :func:`check_files`, or the read fails (the message has the errno text).
    """
    fd = _open_regular(path)
    try:
        with open(fd, "rb", closefd=False) as fh:
            return fh.read() if limit is None else fh.read(limit)
    except OSError as e:
        raise ShardkitError(f"--data: cannot read {path}: {e.strerror}") from e
    finally:
        os.close(fd)


def read_documents(files: list[Path], max_bytes: int | None = None, column: str = "text") -> list[bytes]:
    """The documents of the files in order (:func:`file_documents`), stopping after ``max_bytes``
    bytes read in all (None: everything)."""
    docs: list[bytes] = []
    total = 0
    for f in files:
        limit = None if max_bytes is None else max_bytes - total
        if limit is not None and limit <= 0:
            break
        docs += file_documents(f, limit, column)
        total += min(f.stat().st_size, limit) if limit is not None else f.stat().st_size
    return docs


def file_documents(path: Path, limit: int | None, column: str) -> list[bytes]:
    """The documents of one corpus file read up to ``limit`` bytes (None: all): the file itself;
    for ``*.jsonl`` the text field ``column`` (``--data-column``) of every non-blank line, as
    UTF-8 (a line cut by ``limit`` is dropped); for ``*.parquet`` the column of every row (read
    whole, with pyarrow).

    Raises:
        ShardkitError: as :func:`read_regular`; a JSONL line that is not JSON, not an object, or
            has no text field ``column`` (naming ``file:line``); a Parquet file without pyarrow
            installed or without the column.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_documents(path, read_regular(path), column)
    blob = read_regular(path, limit)
    if suffix != ".jsonl":
        return [blob]
    lines = blob.split(b"\n")
    if limit is not None and limit < path.stat().st_size:
        lines = lines[:-1]  # the last line was cut by the byte cap
    return [_jsonl_text(path, n, line, column) for n, line in enumerate(lines, 1) if line.strip()]


def _jsonl_text(path: Path, n: int, line: bytes, column: str) -> bytes:
    try:
        row = json.loads(line)
    except ValueError as e:  # json.JSONDecodeError and bad UTF-8 alike
        raise ShardkitError(f"--data: {path}:{n}: not a JSON line ({e})") from None
    text = row.get(column) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise ShardkitError(
            f"--data: {path}:{n}: no text field {column!r} (--data-column {column}); the line holds "
            f"{'keys ' + ', '.join(map(repr, row)) if isinstance(row, dict) else type(row).__name__}"
        )
    return text.encode()


def _parquet_documents(path: Path, blob: bytes, column: str) -> list[bytes]:
    try:  # optional: import_module keeps the type check free of pyarrow's stubs
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ShardkitError(f"--data: reading the Parquet file {path} needs pyarrow: pip install pyarrow") from None
    try:
        values = pq.read_table(io.BytesIO(blob), columns=[column]).column(column).to_pylist()
    except (KeyError, ValueError, OSError) as e:
        raise ShardkitError(f"--data: {path}: cannot read the column {column!r} (--data-column): {e}") from None
    return [v.encode() for v in values if isinstance(v, str) and v]


def load_tokens(files: list[Path], max_bytes: int | None = None) -> torch.Tensor:
    """Concatenate the files' bytes into one token stream.

    Args:
        files: read in this order.
        max_bytes: stop after this many bytes (None: read everything).

    Returns:
        ``[N]`` uint8 tensor of token ids (byte values, vocab 256).

    Raises:
        ShardkitError: a file is not a regular readable file (:func:`read_regular`).
    """
    import torch

    buf = bytearray(b"".join(read_documents(files, max_bytes)))
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


class BatchSampler:
    """Random windows of the token stream, the same sequence of global batches on every rank.

    A ``torch.Generator`` seeded with ``seed`` draws ``batch_size`` window starts per step, so a
    run with one process (the ``--verify`` reference) sees exactly the batches of a parallel run.

    Args:
        tokens: ``[N]`` token stream.
        seq_len: window length ``S``.
        batch_size: rows per global batch ``B``.
        seed: generator seed.

    Raises:
        ShardkitError: the stream is shorter than one window.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        import torch

        if tokens.numel() < seq_len:
            raise ShardkitError(f"--data: the corpus has {tokens.numel()} tokens, fewer than --seq-len {seq_len}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len)

    def next_batch(self) -> torch.Tensor:
        """The next global batch: ``[B, S]`` int64 token ids."""
        import torch

        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (self.batch_size,), generator=self.gen)
        return self.tokens[starts[:, None] + self._offsets].long()


def held_out_start(n_tokens: int, seq_len: int) -> int:
    """Where the held-out split of a stream of ``n_tokens`` begins (pure): its last tenth, at
    least one window of ``seq_len``. Training draws only from ``[0, start)``, validation only
    from ``[start, n_tokens)``.

    Raises:
        ShardkitError: the stream cannot hold one window for each part.
    """
    held = max(seq_len, n_tokens // 10)
    if n_tokens - held < seq_len:
        raise ShardkitError(
            f"--eval-every: the corpus has {n_tokens} tokens; holding out {held} for validation leaves "
            f"fewer than --seq-len {seq_len} to train on (give more --data or a shorter --seq-len)"
        )
    return n_tokens - held


class HeldOutBatches:
    """The validation batches: ``batches`` global batches ``[B, S]`` of windows spread evenly
    over the held-out tokens, the same at every evaluation and on every rank (no generator is
    drawn, so evaluating changes nothing in training).

    Args:
        tokens: ``[N]`` held-out token stream (at least ``seq_len``).
        seq_len: as the training batches.
        batch_size: as the training batches.
        batches: ``K``, batches per evaluation (``--eval-batches``).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, batches: int) -> None:
        self.tokens, self.seq_len, self.batch_size, self.count = tokens, seq_len, batch_size, batches

    def batches(self) -> list[torch.Tensor]:
        """``K`` batches ``[B, S]`` of int64 ids."""
        import torch

        windows = self.count * self.batch_size
        last = self.tokens.numel() - self.seq_len  # the last start of a whole window
        starts = torch.arange(windows, dtype=torch.int64) * last // max(1, windows - 1)
        ids = self.tokens[starts[:, None] + torch.arange(self.seq_len)].long()
        return list(ids.split(self.batch_size))
