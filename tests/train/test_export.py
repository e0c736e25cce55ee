"""Export to Hugging Face (issue 23, item 1): ``shardkit export`` / :func:`shardkit.export_hf` and
``shardkit train --save-hf``.

A tiny float32 model is trained for 2 steps at a parallel layout with ``--checkpoint-dir``; the
save is exported and ``AutoModelForCausalLM.from_pretrained`` of the export must give the logits
of a one-process model loaded from the same save by the trainer's resume path to 1e-6. The
pipeline and MoE saves are exported too (the experts gathered whole), and a fine-tuned
``--model-path`` checkpoint goes back to its own config class with its tokenizer. Bad input is
one :class:`~shardkit.ShardkitError` naming what is wrong.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError, export_hf
from shardkit.checkpoint import MANIFEST, latest_checkpoint, load_train_state
from shardkit.cli.main import main
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model, train
from shardkit.train.trainer import make_optimizer

BASE = dict(seq_len=16, batch_size=4, dtype="float32", layers=2, lr=1e-2, steps=2)


def _cfg(**kw) -> TrainConfig:
    cfg = validate_config(TrainConfig(**{**BASE, **kw}), world_size=world_size())
    check_checkpoint_dir(cfg)
    return cfg


def _run(**kw):
    return train(_cfg(**kw), "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _hf(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def _one_process_model_from(save: str, cfg: TrainConfig):
    """Collective over the world: on every rank, the unparallelized model of ``cfg`` loaded from
    ``save`` by the trainer's own resume path (each rank reads every tensor whole)."""
    pm, _ = build_parallel_model(build_train_model(cfg), None, cfg, None, torch.device("cpu"))
    task = build_task(cfg, torch.device("cpu"))
    extra = {"data_generator": task.sampler.gen.get_state(), "torch_rng": torch.get_rng_state()}
    load_train_state(save, pm, make_optimizer(pm.module, cfg.lr), extra)
    return pm.module.eval()


@pytest.mark.world(4, timeout=240)
def test_export_of_a_tp2_dp2_save_gives_the_logits_of_the_save_in_one_process():
    root = shared_tmpdir("shardkit-export-")
    try:
        cfg = _cfg(tp=2, dp_replicate=2, checkpoint_dir=os.path.join(root, "ckpt"))
        train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        save = latest_checkpoint(cfg.checkpoint_dir)
        reference = _one_process_model_from(save, cfg)
        if rank() == 0:
            out = os.path.join(root, "hf")
            assert main(["export", "--checkpoint-dir", cfg.checkpoint_dir, "--out", out]) == 0
            exported = _hf(out)
            assert type(exported).__name__ == "LlamaForCausalLM" and exported.dtype == torch.float32
            x = _tokens(256)
            with torch.no_grad():
                want, got = reference(x).logits, exported(x).logits
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
            assert not torch.equal(reference.model.norm.weight, torch.ones(64))  # it trained
            assert "byte-level" in Path(out, "README.md").read_text()  # no tokenizer: says so
            assert not any(n.startswith("tokenizer") for n in os.listdir(out))
    finally:
        remove_shared_dir(root)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize(
    "layout",
    [dict(tp=1, pp=2, dp_replicate=2, microbatches=2), dict(model="moe", ep=2, tp=2, dp_replicate=2)],
    ids=["pp=2 x dp=2", "moe ep=2 (tp=2 x dp=2)"],
)
def test_export_of_pp_and_moe_saves_equals_the_runs_save_hf(layout):
    # two independent gathers of the same trained model: DCP's chunks read back whole by export,
    # and the trainer's gather_full_parameters behind --save-hf
    root = shared_tmpdir("shardkit-export-")
    try:
        ckpt, live, out = (os.path.join(root, n) for n in ("ckpt", "live", "hf"))
        _run(checkpoint_dir=ckpt, save_hf=live, **layout)
        if rank() == 0:
            export_hf(ckpt, out)
            exported, saved = _hf(out), _hf(live)
            state = exported.state_dict()
            assert state.keys() == saved.state_dict().keys()
            for name, t in saved.state_dict().items():
                assert torch.equal(state[name], t), name
            if layout.get("model") == "moe":  # every expert, whole
                experts = state["model.layers.0.mlp.experts.gate_up_proj"]
                assert experts.shape[0] == exported.config.num_experts == 4
            x = _tokens(256)
            with torch.no_grad():
                assert torch.equal(exported(x).logits, saved(x).logits)
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=240)
def test_a_fine_tuned_model_path_exports_to_its_config_class_with_its_tokenizer():
    from transformers import AutoTokenizer

    from harness.pretrained import save_tiny_llama

    root = shared_tmpdir("shardkit-export-")
    try:
        source, ckpt, out = (os.path.join(root, n) for n in ("source", "ckpt", "hf"))
        if rank() == 0:
            save_tiny_llama(Path(source))
        torch.distributed.barrier()
        data = str(Path(torch.__file__).parent / "functional.py")
        _run(model_path=source, data=data, tp=1, dp_replicate=2, checkpoint_dir=ckpt)
        if rank() == 0:
            export_hf(ckpt, out, step=2)
            config = json.loads(Path(out, "config.json").read_text())
            original = json.loads(Path(source, "config.json").read_text())
            assert config["architectures"] == original["architectures"] == ["LlamaForCausalLM"]
            assert config["tie_word_embeddings"] is True and config["vocab_size"] == original["vocab_size"]
            exported, before = _hf(out), _hf(source)
            assert type(exported.config) is type(before.config)
            assert not torch.equal(exported.model.norm.weight, before.model.norm.weight)  # fine-tuned
            text = "def walk(top):\n    return os.path.join(top, name)"
            assert (
                AutoTokenizer.from_pretrained(out)(text).input_ids
                == AutoTokenizer.from_pretrained(source)(text).input_ids
            )
    finally:
        remove_shared_dir(root)


def _fake_save(root: Path, step: int, manifest: dict) -> None:
    save = root / f"step_{step:08d}"
    save.mkdir(parents=True)
    (save / MANIFEST).write_text(json.dumps(manifest))
    (root / "latest").write_text(save.name)


def test_export_refuses_a_missing_dir_no_save_and_a_step_not_found(tmp_path):
    with pytest.raises(ShardkitError, match=r"--checkpoint-dir '.*nowhere' does not exist"):
        export_hf(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardkitError, match=r"--checkpoint-dir '.*empty' holds no complete save"):
        export_hf(tmp_path / "empty", tmp_path / "out")
    _fake_save(tmp_path / "ckpt", 2, {"step": 2})
    with pytest.raises(ShardkitError, match=r"--step 5: .* holds no save at step 5; its saves: steps 2"):
        export_hf(tmp_path / "ckpt", tmp_path / "out", step=5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ShardkitError, match=r"--out '.*full' is not empty"):
        export_hf(tmp_path / "ckpt", tmp_path / "full")


def test_export_refuses_conv_ae_and_saves_without_a_hugging_face_config(tmp_path):
    _fake_save(tmp_path / "conv", 1, {"step": 1, "model": {"model": "conv-ae", "dtype": "float32"}})
    with pytest.raises(ShardkitError, match=r"a save of --model conv-ae, which has no Hugging Face form"):
        export_hf(tmp_path / "conv", tmp_path / "out")
    _fake_save(tmp_path / "old", 1, {"step": 1, "model": {"model": "llama", "dtype": "float32", "hidden_size": 64}})
    with pytest.raises(ShardkitError, match=r"does not say which Hugging Face model it holds"):
        export_hf(tmp_path / "old", tmp_path / "out")
    with pytest.raises(ShardkitError, match=r"--save-hf: --model conv-ae has no Hugging Face form"):
        validate_config(TrainConfig(model="conv-ae", save_hf=str(tmp_path / "hf")), world_size=1)


def test_the_export_command_says_what_is_wrong_in_one_line(tmp_path, capsys):
    assert main(["export", "--checkpoint-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit export: error: ") and "does not exist" in err and err.count("\n") == 1


def test_write_hf_refuses_missing_and_foreign_tensors_and_a_vanished_tokenizer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.checkpoint.hf_writer import hf_description, write_hf

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    tensors = {k: v.detach() for k, v in model.named_parameters()}
    hf = hf_description(model, None)
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    with pytest.raises(
        ShardkitError, match=r"1 parameter\(s\) of the LlamaForCausalLM are not in the save: model.norm"
    ):
        write_hf(tmp_path / "a", missing, hf, "the save")
    with pytest.raises(ShardkitError, match=r"1 tensor\(s\) of the save are not parameters of the LlamaForCausalLM"):
        write_hf(tmp_path / "b", {**tensors, "model.extra.weight": torch.zeros(2)}, hf, "the save")
    with pytest.raises(ShardkitError, match=r"--model-path .*gone, which no longer exists"):
        write_hf(tmp_path / "c", tensors, {**hf, "model_path": str(tmp_path / "gone")}, "the save")
    assert not any((tmp_path / n).exists() for n in "abc")  # nothing written before the checks passed
    assert write_hf(tmp_path / "d", tensors, hf, "the save") == str(tmp_path / "d")
    assert LlamaForCausalLM.from_pretrained(tmp_path / "d").model.norm.weight.equal(tensors["model.norm.weight"])


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "moe", "mla"])
def test_every_decoder_family_round_trips_through_write_hf(name, tmp_path):
    # the trainer's own model of each family (its config as the registry builds it), written and
    # read back by transformers: the same class and the same logits
    from shardkit.checkpoint.hf_writer import hf_description, write_hf

    cfg = validate_config(TrainConfig(**{**BASE, "model": name, "tp": 1}), world_size=1)
    model = build_train_model(cfg).eval()
    write_hf(tmp_path, {k: v.detach() for k, v in model.named_parameters()}, hf_description(model, None), "a run")
    exported = _hf(tmp_path)
    assert type(exported) is type(model)
    x = _tokens(256)
    with torch.no_grad():
        assert torch.equal(exported(x).logits, model(x).logits)
