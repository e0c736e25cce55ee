"""The training token stream of a pretrained checkpoint: the corpus encoded by its own tokenizer.

Byte ids 0-255 (train/data.py's ``load_tokens``) only suit a model trained from scratch on bytes:
fed to a pretrained model they index the wrong embedding rows. :func:`token_stream` encodes the
corpus with the checkpoint's tokenizer into one 1-D int32 stream, which
:class:`~shardkit.train.data.BatchSampler` windows unchanged (its batches are ``.long()``).

The trainer reads and encodes on global rank 0 only and broadcasts the stream
(:mod:`.corpus`). With ``cache_dir`` (the trainer's: :func:`user_cache_dir`) the stream is stored
under a key that hashes the *content* of every input (the corpus bytes actually read, the
tokenizer's files, the stream format, the transformers version), so a second run reads it back
instead of loading the tokenizer and encoding again. The cache is private to the user (0700,
owned by them, else not used) and every entry carries the sha256 of its tokens, checked on read:
an entry that does not match is ignored and rewritten, never trained on.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import ShardkitError
from .data import file_documents, read_regular
from .pretrained import (
    TOKENIZER_FILES,
    check_tokenizer,
    load_text_tokenizer,
    load_tokenizer,
    read_config,
    resolve_checkpoint,
    tokenizer_source,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TOKENIZER_FILES",
    "check_checkpoint_tokenizer",
    "corpus_prefix",
    "encode_documents",
    "encode_files",
    "token_stream",
    "user_cache_dir",
]

# 4 MiB of Python source is 1.2M SmolLM2 tokens, encoded in 4-9 s on the shared 2 cores, and far
# more than a fine-tuning run of a few hundred small batches reads.
DEFAULT_MAX_BYTES = 4 << 20
# Checkpoint files that hold weights only: they cannot change the tokens, and hashing them
# (hundreds of MB) would cost more than the cache saves. A GGUF file holds its tokenizer: hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")
# Bump when the stream's layout (document separator, dtype) changes: old cache entries go stale.
_FORMAT = "tokens-v2"


def check_checkpoint_tokenizer(model_path: str | Path) -> None:
    """Before launch: ``--model-path``'s tokenizer loads and its ids fit the model's embedding.

    A GGUF file carries its tokenizer in its metadata (read by the workers; its parse takes
    seconds). A checkpoint directory is checked here, in the launching process, so that a
    directory of weights alone fails in a second with what to do, not inside every worker with
    transformers' hint to install sentencepiece.

    Raises:
        ShardkitError: as :func:`~shardkit.train.pretrained.load_tokenizer` and
            :func:`~shardkit.train.pretrained.check_tokenizer`; the directory has none of
            :data:`TOKENIZER_FILES`.
    """
    source = resolve_checkpoint(model_path)
    if source.gguf_file is not None:
        return
    if not any((source.directory / name).is_file() for name in TOKENIZER_FILES):
        raise ShardkitError(
            f"--model-path: {model_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); the "
            "text is encoded with the checkpoint's own tokenizer: copy its tokenizer files from the model's "
            f"original repository into {source.directory}, e.g. `hf download REPO tokenizer.json "
            f"tokenizer_config.json --local-dir {source.directory}`"
        )
    check_tokenizer(load_tokenizer(model_path), read_config(model_path))


def corpus_prefix(files: list[Path], max_bytes: int | None) -> list[tuple[Path, int]]:
    """The files to read and how many bytes of each: the shortest prefix of ``files`` (in order)
    holding ``max_bytes`` bytes, the last one cut. Sizes come from ``stat``, not from reading."""
    out: list[tuple[Path, int]] = []
    total = 0
    for f in files:
        try:
            size = f.stat().st_size
        except OSError as e:
            raise ShardkitError(f"--data: cannot read {f}: {e.strerror}") from e
        if max_bytes is not None and total + size >= max_bytes:
            out.append((f, max_bytes - total))
            return out
        out.append((f, size))
        total += size
    return out


def encode_files(parts: list[tuple[Path, int]], tokenizer) -> torch.Tensor:
    """Encode each file's first bytes as one document; documents are joined by the EOS token.

    Args:
        parts: ``(file, n_bytes)`` pairs, as :func:`corpus_prefix` returns (regular files only:
            :func:`.data.read_regular`).
        tokenizer: a transformers tokenizer.

    Returns:
        ``[N]`` int32 token ids (see :func:`_encode`).

    Raises:
        ShardkitError: a file is not a regular readable file; the vocabulary does not fit int32.
    """
    return _encode([read_regular(f, n) for f, n in parts], tokenizer)


def _encode(blobs: list[bytes], tokenizer) -> torch.Tensor:
    """Each blob decoded as UTF-8 (invalid bytes, e.g. a multi-byte character cut by the byte cap,
    become U+FFFD) and encoded without special tokens: a file is a document, so no token spans
    two files, and the EOS between them is the document boundary the model was trained with.
    One batch call (the Rust tokenizer parallelizes it; its result does not depend on the thread
    count)."""
    if len(tokenizer) > torch.iinfo(torch.int32).max:
        raise ShardkitError(f"tokenizer vocabulary of {len(tokenizer)} tokens does not fit int32 token ids")
    texts = [t for t in (b.decode("utf-8", errors="replace") for b in blobs) if t]
    if not texts:
        return torch.empty(0, dtype=torch.int32)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i, doc in enumerate(encoded):
        if i and eos is not None:
            ids.append(eos)
        ids.extend(doc)
    return torch.tensor(ids, dtype=torch.int32)


def user_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/shardkit`` (``~/.cache/shardkit`` when unset or relative), created 0700.

    Returns None, after a note on stderr, when the folder cannot be created or is not private:
    not a directory of this user (a symbolic link, another owner), or writable by its group or by
    others. Without a private folder the stream is encoded afresh rather than read from a place
    another user could have written.
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    try:
        root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    except RuntimeError as e:  # no home directory known
        print(f"shardkit train: note: no token cache: {e}", file=sys.stderr)
        return None
    path = root / "shardkit"
    why = _not_private(path)
    if why is None:
        return path
    print(f"shardkit train: note: token cache {path} not used: {why}; encoding without a cache", file=sys.stderr)
    return None


def _not_private(path: Path) -> str | None:
    """Why ``path`` (created 0700 if missing) is not a private folder of this user; None if it is."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return e.strerror or str(e)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory (a symbolic link?)"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_key(model_path: str | Path, blobs: list[bytes], flag: str = "--model-path") -> str:
    """sha256 of the stream's inputs by content: format, transformers version, the tokenizer's
    files (every checkpoint or tokenizer-folder file but weights), and the corpus bytes read."""
    import transformers

    h = hashlib.sha256(f"{_FORMAT}\0{transformers.__version__}\0".encode())
    for f in tokenizer_source(model_path, flag).files():
        if f.suffix not in _WEIGHT_SUFFIXES:
            h.update(f"{f.name}\0{_sha256_file(f)}\0".encode())
    for blob in blobs:
        h.update(f"{len(blob)}\0{hashlib.sha256(blob).hexdigest()}\0".encode())
    return h.hexdigest()


def _tokens_hash(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.contiguous().numpy().tobytes()).hexdigest()


def _read_entry(path: Path, key: str) -> torch.Tensor | None:
    """The tokens of a cache entry, or None when it is missing or fails any check (another key,
    not a regular file of this user, not int32 ``[N]``, or tokens that do not match its hash)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            entry = torch.load(f, weights_only=True)
        except Exception:  # a truncated or foreign file: a miss, rewritten below
            return None
    if not isinstance(entry, dict) or entry.get("format") != _FORMAT or entry.get("key") != key:
        return None
    tokens = entry.get("tokens")
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int32 or tokens.dim() != 1:
        return None
    return tokens if entry.get("sha256") == _tokens_hash(tokens) else None


def _write_entry(path: Path, key: str, tokens: torch.Tensor) -> None:
    """Atomic: a temporary file (0600, mkstemp) renamed over the entry."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with open(fd, "wb") as f:
            torch.save({"format": _FORMAT, "key": key, "sha256": _tokens_hash(tokens), "tokens": tokens}, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def token_stream(
    model_path: str | Path,
    files: list[Path],
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    cache_dir: str | Path | None = None,
    flag: str = "--model-path",
    column: str = "text",
) -> torch.Tensor:
    """The corpus encoded by the checkpoint's own tokenizer (or ``--tokenizer``'s).

    Args:
        model_path: a checkpoint directory or GGUF file (see :func:`~shardkit.train.pretrained.
            load_tokenizer`); with ``flag`` ``"--tokenizer"`` a tokenizer directory or GGUF file.
        files: corpus files in order (``train.data.corpus_files``); regular files only.
        max_bytes: read at most this many bytes of the corpus (None: all of it; the stdlib is
            32 MB: about 8x the default cap).
        cache_dir: a private folder (:func:`user_cache_dir`) where entries are stored and found
            by the content key; None: no cache. The corpus is read once: the bytes hashed into
            the key are the bytes encoded.
        flag: the option ``model_path`` came from (``--model-path`` or ``--tokenizer``).
        column: the text field of ``*.jsonl`` / ``*.parquet`` files (:func:`.data.file_documents`):
            each line or row is a document.

    Returns:
        ``[N]`` int32 token ids, each below ``len(tokenizer)``.

    Raises:
        ShardkitError: as :func:`~shardkit.train.pretrained.load_tokenizer`; a file is not a
            regular readable file; the corpus encodes to no tokens.
    """
    blobs = [doc for f, n in corpus_prefix(files, max_bytes) for doc in file_documents(f, n, column)]
    return encode_documents(model_path, blobs, cache_dir, flag, f"the corpus ({len(files)} files)")


def encode_documents(
    model_path: str | Path,
    blobs: list[bytes],
    cache_dir: str | Path | None = None,
    flag: str = "--model-path",
    what: str = "the corpus",
) -> torch.Tensor:
    """Documents (already read: :func:`token_stream`'s files, or ``--data hf:``'s rows) encoded by
    ``model_path``'s tokenizer, through the cache: the second half of :func:`token_stream`, with
    its arguments, result and errors (``what`` names the documents in the no-token error)."""
    path = key = None
    if cache_dir is not None:
        key = _cache_key(model_path, blobs, flag)
        path = Path(cache_dir) / f"{key}.pt"
        cached = _read_entry(path, key)
        if cached is not None:
            return cached
    tokenizer = load_tokenizer(model_path) if flag == "--model-path" else load_text_tokenizer(model_path, flag)
    tokens = _encode(blobs, tokenizer)
    if tokens.numel() == 0:
        raise ShardkitError(f"--data: {what} encodes to no tokens")
    if path is not None and key is not None:
        _write_entry(path, key, tokens)
    return tokens
