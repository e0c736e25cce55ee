"""One source of training data: global rank 0 reads the corpus, every rank receives its tokens.

Every rank draws the same global batches from the token stream, so every rank must hold the
same stream. Ranks that each read the files themselves can disagree: a file growing during
start-up gave tp ranks streams of different lengths (issue 19). Here only global rank 0 reads
(and tokenizes, with ``--model-path``); it broadcasts a header (error length, token count,
document count), then the tokens and the document sizes, so the other ranks hold exactly its
stream. An error while reading is broadcast instead and raised as the same
:class:`~shardkit.ShardkitError` on every rank.

Only regular files are read: :func:`.data.read_regular` refuses a FIFO (whose ``open`` would
block every rank forever), a socket, a device, a broken symbolic link or an unreadable file,
naming the file; :func:`.data.check_files` runs the same checks in the launching process before
any rank starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import ShardkitError
from . import data
from .hf_data import hf_documents, parse_hf
from .pretrained import check_tokenizer, load_tokenizer, read_config
from .tokens import DEFAULT_MAX_BYTES, encode_documents, token_stream, user_cache_dir

if TYPE_CHECKING:
    from .options import TrainConfig

__all__ = ["Corpus", "read_corpus", "shared_corpus", "one_source"]


@dataclass(frozen=True)
class Corpus:
    """A token stream and its documents.

    Attributes:
        tokens: ``[N]`` token ids: uint8 byte values, or int32 tokenizer ids (``--model-path``).
        doc_sizes: tokens of every document (corpus file, JSONL line or Parquet row) in stream order, summing to ``N``;
            empty when the documents are not tracked (tokenizer streams: ``--packed`` refuses them).
    """

    tokens: torch.Tensor
    doc_sizes: tuple[int, ...] = ()


def read_corpus(cfg: TrainConfig) -> Corpus:
    """The token stream of a ``TrainConfig``, read in this process: byte ids of the ``--data``
    files, or their encoding by ``--model-path``'s or ``--tokenizer``'s tokenizer (through the per-user cache).
    ``--data hf:NAME[:SPLIT]``: the dataset's rows, each a document as a JSONL line is (:mod:`.hf_data`)."""
    hf = parse_hf(cfg.data)
    if hf is not None:
        return _hf_corpus(cfg, *hf)
    files = data.corpus_files(cfg.data)
    if cfg.tokenizer is not None:
        return Corpus(
            token_stream(cfg.tokenizer, files, cache_dir=user_cache_dir(), flag="--tokenizer", column=cfg.data_column)
        )
    if cfg.model_path is None:
        docs = data.read_documents(files, column=cfg.data_column)
        raw = bytearray(b"".join(docs))
        tokens = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return Corpus(tokens, tuple(len(d) for d in docs))
    # the checkpoint's own tokenizer (byte ids would scramble a pretrained vocabulary)
    check_tokenizer(load_tokenizer(cfg.model_path), read_config(cfg.model_path))
    return Corpus(token_stream(cfg.model_path, files, cache_dir=user_cache_dir(), column=cfg.data_column))


def _hf_corpus(cfg: TrainConfig, name: str, split: str | None) -> Corpus:
    """:func:`read_corpus` of ``--data hf:NAME[:SPLIT]``: the rows' bytes, or their tokens."""
    source = cfg.model_path if cfg.tokenizer is None else cfg.tokenizer
    if source is None:
        docs = hf_documents(name, split, cfg.data_column)
        raw = bytearray(b"".join(docs))
        tokens = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return Corpus(tokens, tuple(len(d) for d in docs))
    flag = "--model-path" if cfg.tokenizer is None else "--tokenizer"
    if cfg.tokenizer is None:
        check_tokenizer(load_tokenizer(source), read_config(source))
    docs = hf_documents(name, split, cfg.data_column, DEFAULT_MAX_BYTES)
    return Corpus(encode_documents(source, docs, user_cache_dir(), flag, f"--data hf:{name}"))


def shared_corpus(cfg: TrainConfig, device: torch.device) -> Corpus:
    """:func:`read_corpus` on global rank 0, the same stream on every rank (collective over the world)."""
    dtype = torch.int32 if cfg.model_path is not None or cfg.tokenizer is not None else torch.uint8
    return one_source(lambda: read_corpus(cfg), dtype, device)


def one_source(read: Callable[[], Corpus], dtype: torch.dtype, device: torch.device) -> Corpus:
    """``read()`` on global rank 0, its result on every rank (no collective without a world).

    Broadcasts over the world: an int64 header ``[error bytes, N, documents]``, then the error
    text (raised on every rank as a ShardkitError) or the ``[N]`` tokens and the document sizes.
    The tensors travel on ``device`` (NCCL needs them there); the result is on the CPU.

    Args:
        read: reads the corpus; called on global rank 0 only.
        dtype: the tokens' dtype (every rank must know it to receive them).
        device: this rank's device.

    Raises:
        ShardkitError: ``read`` failed on rank 0 (the same message on every rank; on rank 0
            chained to its own exception).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return read()
    first = dist.get_rank() == 0
    corpus, error, failure = None, b"", None
    if first:
        try:
            corpus = read()
            if corpus.tokens.dtype != dtype:
                raise ShardkitError(f"corpus: read {corpus.tokens.dtype} tokens, expected {dtype}")
        except Exception as exc:  # every failure reaches the other ranks, which would wait forever
            failure = exc
            text = (
                str(exc)
                if isinstance(exc, ShardkitError)
                else (f"global rank 0 could not read the training data: {type(exc).__name__}: {exc}")
            )
            error = text.encode()[:65536]
    header = torch.zeros(3, dtype=torch.int64, device=device)
    if first:
        header[0] = len(error)
        if corpus is not None:
            header[1], header[2] = corpus.tokens.numel(), len(corpus.doc_sizes)
    dist.broadcast(header, src=0)
    n_error, n_tokens, n_docs = header.tolist()
    if n_error:
        buf = (
            torch.frombuffer(bytearray(error), dtype=torch.uint8).to(device)
            if first
            else torch.empty(n_error, dtype=torch.uint8, device=device)
        )
        dist.broadcast(buf, src=0)
        if isinstance(failure, ShardkitError) and len(str(failure).encode()) == n_error:
            raise failure  # the message every other rank raises
        raise ShardkitError(bytes(buf.cpu().tolist()).decode(errors="replace")) from failure
    tokens = corpus.tokens.to(device) if corpus is not None else torch.empty(n_tokens, dtype=dtype, device=device)
    sizes = torch.tensor(corpus.doc_sizes if corpus is not None else [0] * n_docs, dtype=torch.int64, device=device)
    if n_tokens:
        dist.broadcast(tokens, src=0)
    if n_docs:
        dist.broadcast(sizes, src=0)
    return corpus if corpus is not None else Corpus(tokens.cpu(), tuple(sizes.tolist()))
