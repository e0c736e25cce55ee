"""The training token stream of a pretrained checkpoint: the corpus encoded by its own tokenizer.

Byte ids 0-255 (cli/data.py's ``load_tokens``) only suit a model trained from scratch on bytes:
fed to a pretrained model they index the wrong embedding rows. :func:`token_stream` encodes the
corpus with the checkpoint's tokenizer into one 1-D int32 stream, which
:class:`~shardkit.cli.data.BatchSampler` windows unchanged (its batches are ``.long()``).

Every rank gets the same stream: encoding is deterministic, and the files read depend only on
their sizes and ``max_bytes``. With ``cache_dir`` the stream is stored under a key of every
input (corpus files, checkpoint files, ``max_bytes``, transformers version), so a second run,
or a second rank, reads it back instead of loading the tokenizer and encoding again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from ..errors import ShardkitError
from .pretrained import load_tokenizer, resolve_checkpoint

__all__ = ["DEFAULT_MAX_BYTES", "corpus_prefix", "encode_files", "token_stream"]

# 4 MiB of Python source is 1.2M SmolLM2 tokens, encoded in 4-9 s on the shared 2 cores, and far
# more than a fine-tuning run of a few hundred small batches reads.
DEFAULT_MAX_BYTES = 4 << 20
# Bump when the stream's layout (document separator, dtype) changes: old cache entries go stale.
_FORMAT = "tokens-v1"


def corpus_prefix(files: list[Path], max_bytes: int | None) -> list[tuple[Path, int]]:
    """The files to read and how many bytes of each: the shortest prefix of ``files`` (in order)
    holding ``max_bytes`` bytes, the last one cut. Sizes come from ``stat``, not from reading."""
    out: list[tuple[Path, int]] = []
    total = 0
    for f in files:
        size = f.stat().st_size
        if max_bytes is not None and total + size >= max_bytes:
            out.append((f, max_bytes - total))
            return out
        out.append((f, size))
        total += size
    return out


def encode_files(parts: list[tuple[Path, int]], tokenizer) -> torch.Tensor:
    """Encode each file's first bytes as one document; documents are joined by the EOS token.

    Each file is decoded as UTF-8 (invalid bytes, e.g. a multi-byte character cut by the byte
    cap, become U+FFFD) and encoded without special tokens: a file is a document, so no token
    spans two files, and the EOS between them is the document boundary the model was trained
    with. Files are encoded in one batch call (the Rust tokenizer parallelizes it; its result
    does not depend on the thread count).

    Args:
        parts: ``(file, n_bytes)`` pairs, as :func:`corpus_prefix` returns.
        tokenizer: a transformers tokenizer.

    Returns:
        ``[N]`` int32 token ids.

    Raises:
        ShardkitError: the tokenizer's vocabulary does not fit int32.
    """
    if len(tokenizer) > torch.iinfo(torch.int32).max:
        raise ShardkitError(f"tokenizer vocabulary of {len(tokenizer)} tokens does not fit int32 token ids")
    texts = []
    for f, n in parts:
        with open(f, "rb") as fh:
            texts.append(fh.read(n).decode("utf-8", errors="replace"))
    texts = [t for t in texts if t]
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


def _cache_key(model_path: str | Path, parts: list[tuple[Path, int]], max_bytes: int | None) -> str:
    import transformers

    h = hashlib.sha256(f"{_FORMAT}\0{transformers.__version__}\0{max_bytes}\0".encode())
    # Path, size and modification time identify a file without reading it (the GGUF is 100 MB).
    for f in resolve_checkpoint(model_path).files() + [f for f, _ in parts]:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for _, n in parts:
        h.update(f"{n}\0".encode())
    return h.hexdigest()[:32]


def token_stream(
    model_path: str | Path,
    files: list[Path],
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    cache_dir: str | Path | None = None,
) -> torch.Tensor:
    """The corpus encoded by the checkpoint's own tokenizer, the same on every rank.

    Args:
        model_path: a checkpoint directory or GGUF file (see :func:`~shardkit.cli.pretrained.
            load_tokenizer`).
        files: corpus files in order (``cli.data.corpus_files``).
        max_bytes: read at most this many bytes of the corpus (None: all of it; the stdlib is
            32 MB: about 8x the default cap).
        cache_dir: where to store / find the encoded stream (created if missing); None: no cache.
            Writes are atomic (temporary file + rename), so ranks sharing the folder never read
            a partial file.

    Returns:
        ``[N]`` int32 token ids, each below ``len(tokenizer)``.

    Raises:
        ShardkitError: as :func:`~shardkit.cli.pretrained.load_tokenizer`; the corpus encodes to
            no tokens.
    """
    parts = corpus_prefix(files, max_bytes)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{_cache_key(model_path, parts, max_bytes)}.pt"
        if path.is_file():
            return torch.load(path, weights_only=True)
    tokens = encode_files(parts, load_tokenizer(model_path))
    if tokens.numel() == 0:
        raise ShardkitError(f"--data: the corpus ({len(files)} files) encodes to no tokens")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(tokens, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return tokens
