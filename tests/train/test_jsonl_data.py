"""JSONL and Parquet text columns for ``--data`` (issue 23, item 5): each line's (row's)
``--data-column`` field is a document; a bad line is refused before launch naming ``file:line``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError
from shardkit.cli.main import main
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.corpus import read_corpus
from shardkit.train.data import file_documents
from shardkit.train.run import train
from shardkit.train.tokens import token_stream

BODIES = [f"def f{i}(x):\n    return x * {i}  # line {i}\n" for i in range(12)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_launch(monkeypatch):
    import shardkit.cli.launch as cli_launch

    monkeypatch.setattr(cli_launch, "launch_local", lambda *a, **k: pytest.fail("launched"))


@pytest.mark.world(2, timeout=240)
def test_a_jsonl_column_trains_packed_at_tp2_and_verifies():
    root = shared_tmpdir("shardkit-jsonl-")
    try:
        data = Path(root, "corpus.jsonl")
        if rank() == 0:
            _jsonl(data, [{"id": i, "body": b} for i, b in enumerate(BODIES)])
        torch.distributed.barrier()
        cfg = TrainConfig(
            seq_len=16, batch_size=4, dtype="float32", layers=2, steps=2, tp=2, packed=True, verify=True,
            data=str(data), data_column="body",
        )  # fmt: skip
        train(validate_config(cfg, world_size=world_size()), "gloo", torch.device("cpu"), time.perf_counter(), False)
    finally:
        remove_shared_dir(root)


def test_the_lines_are_the_documents_of_the_byte_stream(tmp_path):
    data = _jsonl(tmp_path / "c.jsonl", [{"text": b} for b in BODIES[:3]])
    (tmp_path / "c.jsonl").write_text(data.read_text() + "\n   \n")  # blank lines are no documents
    corpus = read_corpus(TrainConfig(data=str(data)))
    assert corpus.doc_sizes == tuple(len(b.encode()) for b in BODIES[:3])
    assert bytes(corpus.tokens.tolist()) == "".join(BODIES[:3]).encode()


def test_a_byte_cap_drops_the_line_it_cuts(tmp_path):
    data = _jsonl(tmp_path / "c.jsonl", [{"text": b} for b in BODIES[:3]])
    first = len(data.read_text().split("\n")[0]) + 1
    assert file_documents(data, first + 5, "text") == [BODIES[0].encode()]


def test_a_tokenizer_encodes_the_lines_as_documents(tmp_path):
    from transformers import AutoTokenizer

    from harness.pretrained import save_tokenizer

    tok = str(save_tokenizer(tmp_path / "tok"))
    data = _jsonl(tmp_path / "c.jsonl", [{"t": b} for b in BODIES[:2]])
    tokens = token_stream(tok, [data], flag="--tokenizer", column="t").tolist()
    t = AutoTokenizer.from_pretrained(tok)
    expected = [*t(BODIES[0], add_special_tokens=False).input_ids, t.eos_token_id]
    assert tokens == expected + t(BODIES[1], add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("second", "why"), [("{not json", "not a JSON line"), ('{"body": "x"}', "no text field 'text'"), ("[1]", "list")]
)
def test_a_bad_line_fails_before_launch_naming_file_and_line(tmp_path, capsys, monkeypatch, second, why):
    _no_launch(monkeypatch)
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"text": "x" * 64}) + "\n" + second + "\n")
    assert main(["train", "--data", str(data), "--steps", "1", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2:" in err and why in err


def test_data_column_picks_the_field_and_is_named_when_missing(tmp_path):
    data = _jsonl(tmp_path / "c.jsonl", [{"body": "abc", "text": "zz"}])
    assert file_documents(data, None, "body") == [b"abc"]
    with pytest.raises(ShardkitError, match=r"c\.jsonl:1: no text field 'title' \(--data-column title\)"):
        file_documents(data, None, "title")


def test_parquet_without_pyarrow_says_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    data = tmp_path / "c.parquet"
    data.write_bytes(b"PAR1")
    with pytest.raises(ShardkitError, match="pip install pyarrow"):
        file_documents(data, None, "text")
