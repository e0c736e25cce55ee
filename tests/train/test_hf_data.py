"""``--data hf:NAME[:SPLIT]`` (issue 32, item 2): a Hugging Face dataset from a save_to_disk folder
or the local datasets cache, offline, each row's --data-column a document exactly as a JSONL line's
field is: the same tokens and the same training losses as the same text given as a JSONL file."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError
from shardkit._optional import MissingExtraError
from shardkit.cli.main import main
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.corpus import read_corpus
from shardkit.train.hf_data import hf_documents, parse_hf

pytest.importorskip("datasets")  # the test extra installs it: CI runs these for real

BODIES = [f"def g{i}(y):\n    return y + {i}  # row {i}\n" for i in range(12)] + ["", "tail ü\n"]


def _save(folder: Path, splits: bool = False) -> Path:
    """A tiny dataset written with save_to_disk: one Dataset, or a DatasetDict train/validation."""
    from datasets import Dataset, DatasetDict

    rows = Dataset.from_dict({"id": list(range(len(BODIES))), "body": BODIES})
    (DatasetDict({"train": rows, "validation": rows.select([0, 1])}) if splits else rows).save_to_disk(str(folder))
    return folder


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": i, "body": b}) + "\n" for i, b in enumerate(BODIES)))
    return path


def test_parse_hf():
    assert parse_hf("corpus.jsonl") is None and parse_hf(None) is None
    assert parse_hf("hf:user/name") == ("user/name", None)
    assert parse_hf("hf:user/name:validation") == ("user/name", "validation")
    with pytest.raises(ShardkitError, match="give a dataset"):
        parse_hf("hf:")
    with pytest.raises(ShardkitError, match="empty SPLIT"):
        parse_hf("hf:user/name:")


def test_a_folder_with_a_colon_is_a_name_whole(tmp_path):
    folder = tmp_path / "a:b"
    folder.mkdir()
    assert parse_hf(f"hf:{folder}") == (str(folder), None)


def test_the_rows_are_the_documents_of_the_jsonl_stream(tmp_path):
    folder = _save(tmp_path / "ds")
    from_hf = read_corpus(TrainConfig(data=f"hf:{folder}", data_column="body"))
    from_jsonl = read_corpus(TrainConfig(data=str(_jsonl(tmp_path / "c.jsonl")), data_column="body"))
    assert torch.equal(from_hf.tokens, from_jsonl.tokens) and from_hf.doc_sizes == from_jsonl.doc_sizes
    assert bytes(from_hf.tokens.tolist()) == "".join(BODIES).encode()
    assert from_hf.doc_sizes == tuple(len(b.encode()) for b in BODIES)


def test_a_tokenizer_encodes_the_rows_as_the_jsonl_lines(tmp_path):
    from harness.pretrained import save_tokenizer

    tok = str(save_tokenizer(tmp_path / "tok"))
    folder = _save(tmp_path / "ds")
    data = _jsonl(tmp_path / "c.jsonl")
    cfgs = [TrainConfig(data=d, data_column="body", tokenizer=tok) for d in (f"hf:{folder}", str(data))]
    hf, jsonl = (read_corpus(c).tokens for c in cfgs)
    assert hf.dtype == torch.int32 and hf.numel() > len(BODIES) and torch.equal(hf, jsonl)


def test_splits_of_a_dataset_dict(tmp_path):
    folder = _save(tmp_path / "dd", splits=True)
    assert len(hf_documents(str(folder), None, "body")) == len(BODIES)  # default: train
    assert hf_documents(str(folder), "validation", "body") == [b.encode() for b in BODIES[:2]]
    with pytest.raises(ShardkitError, match=r"no split 'test'; the folder holds 'train', 'validation'"):
        hf_documents(str(folder), "test", "body")
    with pytest.raises(ShardkitError, match="holds one Dataset"):
        hf_documents(str(_save(tmp_path / "one")), "train", "body")


def test_a_byte_budget_drops_the_row_it_would_cut(tmp_path):
    folder = str(_save(tmp_path / "ds"))
    first = len(BODIES[0].encode())
    assert hf_documents(folder, None, "body", max_bytes=first + 5) == [BODIES[0].encode()]


def _no_launch(monkeypatch):
    import shardkit.cli.launch as cli_launch

    monkeypatch.setattr(cli_launch, "launch_local", lambda *a, **k: pytest.fail("launched"))


def test_a_missing_column_fails_before_launch_listing_the_columns(tmp_path, capsys, monkeypatch):
    _no_launch(monkeypatch)
    folder = _save(tmp_path / "ds")
    assert main(["train", "--data", f"hf:{folder}", "--steps", "1", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert f"--data hf:{folder}: no column 'text' (--data-column text); the dataset's columns: 'id', 'body'" in err


def test_a_name_neither_folder_nor_cached_says_how_to_fetch_it(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ShardkitError, match=r"neither a save_to_disk folder nor a dataset in the local datasets cache"):
        hf_documents("nobody/nothing", None, "text")


def test_without_datasets_the_error_names_the_extra(hide_module, tmp_path):
    hide_module("datasets")
    with pytest.raises(MissingExtraError, match=r"pip install 'shardkit\[datasets\]'"):
        hf_documents(str(tmp_path), None, "text")


def _cache_entry(tmp_path: Path, name: str) -> Path:
    """What an online ``load_dataset("me/tiny")`` leaves in the datasets cache, made offline: a
    parquet build prepared by datasets' own builder, placed at ``<cache>/me___tiny/default/0.0.0/
    <hash>/`` with its Arrow files named after the dataset (``tiny-train.arrow``)."""
    import datasets

    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"body": BODIES}).to_parquet(str(parquet))
    builder = datasets.load_dataset_builder("parquet", data_files={"train": str(parquet)}, cache_dir=str(tmp_path))
    builder.download_and_prepare()
    cache = tmp_path / "cache"
    entry = cache / name.replace("/", "___") / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(builder.cache_dir, entry)
    for arrow in entry.glob("parquet-*.arrow"):
        arrow.rename(entry / arrow.name.replace("parquet-", name.split("/")[-1] + "-"))
    return cache


def test_a_dataset_from_the_local_cache(tmp_path, monkeypatch):
    import datasets

    cache = _cache_entry(tmp_path, "me/tiny")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    assert hf_documents("me/tiny", None, "body") == [b.encode() for b in BODIES]
    assert hf_documents("me/tiny", "train", "body")[:1] == [BODIES[0].encode()]


@pytest.mark.world(2, timeout=300)
def test_two_steps_from_a_dataset_match_the_same_text_as_jsonl():
    """tp 2, rank 0 reads and broadcasts: the losses of 2 steps from ``hf:FOLDER`` equal (bitwise)
    those from the JSONL file of the same rows, and so do the gradient norms."""
    from shardkit.train.run import train

    root = shared_tmpdir("shardkit-hfdata-")
    try:
        if rank() == 0:
            _save(Path(root, "ds"))
            _jsonl(Path(root, "c.jsonl"))
        torch.distributed.barrier()
        results = []
        for data in (f"hf:{root}/ds", f"{root}/c.jsonl"):
            cfg = TrainConfig(
                seq_len=16, batch_size=4, dtype="float32", layers=1, steps=2, tp=2, data=data, data_column="body",
            )  # fmt: skip
            results.append(train(validate_config(cfg, world_size=world_size()), "gloo", torch.device("cpu"),
                                 time.perf_counter(), False))  # fmt: skip
    finally:
        remove_shared_dir(root)
    if rank() == 0:
        hf, jsonl = results
        assert len(hf["losses"]) == 2 and hf["losses"] == jsonl["losses"]
        assert hf["grad_norms"] == jsonl["grad_norms"]
