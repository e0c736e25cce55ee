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

from harness.helpers import SMALL_CORPUS, rank, remove_shared_dir, shared_tmpdir, world_size
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
        data = SMALL_CORPUS
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


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "moe", "mla", "gemma2"])
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


# --- issue 31 item 4: an export as safe as a resume -------------------------------------------


def _tiny_llama(seed: int = 0):
    """A small transformers Llama (about 60 kB of float32 weights), its tensors and description."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.checkpoint.hf_writer import hf_description

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    return {k: v.detach().clone() for k, v in model.named_parameters()}, hf_description(model, None)


def _nothing_model_like(parent: Path, name: str = "hf") -> None:
    """No ``name`` and no partial directory of it in ``parent``."""
    assert not os.path.lexists(parent / name)
    assert not [n for n in os.listdir(parent) if n.startswith(f".{name}.")], os.listdir(parent)


def test_write_hf_refuses_non_finite_weights_naming_the_key(tmp_path):
    # resume refuses a save holding NaN; export wrote it as a model with rc 0
    from shardkit.checkpoint.hf_writer import write_hf

    tensors, hf = _tiny_llama()
    tensors["model.layers.0.mlp.up_proj.weight"][3, 1] = float("nan")
    tensors["lm_head.weight"][0, 0] = float("-inf")
    with pytest.raises(
        ShardkitError,
        match=r"export: the save holds non-finite values \(NaN or inf\) in model.layers.0.mlp.up_proj.weight, "
        r"lm_head.weight: refused",
    ):
        write_hf(tmp_path / "hf", tensors, hf, "the save")
    _nothing_model_like(tmp_path)


def test_write_hf_io_errors_are_one_error_with_the_path_and_nothing_left(tmp_path):
    import resource
    import signal

    from shardkit.checkpoint.hf_writer import write_hf

    tensors, hf = _tiny_llama()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ShardkitError, match=r"'.*dangling' is a symbolic link to '.*nowhere', which does not exist"):
        write_hf(dangling, tensors, hf, "the save")
    (tmp_path / "file").write_text("")
    with pytest.raises(ShardkitError, match=r"cannot write the model to '.*file/hf': Not a directory \(.*file\)"):
        write_hf(tmp_path / "file" / "hf", tensors, hf, "the save")
    # a full disk, for real: the kernel refuses writes beyond RLIMIT_FSIZE (EFBIG) while config.json fits
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
    try:
        with pytest.raises(
            ShardkitError, match=r"cannot write the model to '.*hf': .*File too large.*nothing was left"
        ):
            write_hf(tmp_path / "hf", tensors, hf, "the save")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, xfsz)
    _nothing_model_like(tmp_path)  # before: config.json alone, which looks like a model
    assert write_hf(tmp_path / "hf", tensors, hf, "the save") == str(tmp_path / "hf")  # the retry is not blocked


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_write_hf_into_a_read_only_directory_is_one_error(tmp_path):
    from shardkit.checkpoint.hf_writer import write_hf

    tensors, hf = _tiny_llama()
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ShardkitError, match=r"cannot write the model to '.*ro/hf': Permission denied"):
        write_hf(tmp_path / "ro" / "hf", tensors, hf, "the save")


def test_a_killed_exports_leftover_is_removed_and_a_live_ones_kept(tmp_path):
    import socket
    import subprocess

    from shardkit.checkpoint.hf_writer import write_hf

    tensors, hf = _tiny_llama()
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name, pid in ((".hf.partial-killed", gone.pid), (".hf.partial-live", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / ".shardkit-export-writer").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    write_hf(tmp_path / "hf", tensors, hf, "the save")
    assert sorted(os.listdir(tmp_path)) == [".hf.partial-live", "hf"]
    assert ".shardkit-export-writer" not in os.listdir(tmp_path / "hf")
    assert oct((tmp_path / "hf").stat().st_mode & 0o777) != oct(0o700)  # not the private mode of the partial dir


def test_sigterm_during_export_leaves_nothing_at_out_and_the_retry_works(tmp_path, monkeypatch, capsys):
    import signal

    import shardkit.cli.export as cli_export
    from shardkit.checkpoint import hf_writer

    tensors, hf = _tiny_llama()
    monkeypatch.setattr(cli_export, "find_save", lambda root, step: f"{root}/step_00000003", raising=False)
    monkeypatch.setattr(cli_export, "read_manifest", lambda save: {"step": 3}, raising=False)
    monkeypatch.setattr(
        cli_export,
        "export_hf",
        lambda save, out, step=None, allow_unverified=False: hf_writer.write_hf(out, tensors, hf, save),
    )
    write_tokenizer = hf_writer._write_tokenizer

    def terminated_midway(*args):  # the weights are written, the tokenizer not yet: SIGTERM arrives
        os.kill(os.getpid(), signal.SIGTERM)
        return write_tokenizer(*args)

    got = []  # without shardkit's handler the test must survive the signal (and then fail)
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append("ignored"))
    try:
        monkeypatch.setattr(hf_writer, "_write_tokenizer", terminated_midway)
        out = tmp_path / "hf"
        assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(out)]) == 143
        assert "stopped by SIGTERM; nothing was written" in capsys.readouterr().err
        _nothing_model_like(tmp_path)
        monkeypatch.setattr(hf_writer, "_write_tokenizer", write_tokenizer)
        assert main(["export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(out)]) == 0
        assert f"wrote step 3 ({tmp_path / 'ck'}/step_00000003) to {out}" in capsys.readouterr().out
        assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(out))
        assert signal.getsignal(signal.SIGTERM) is not cli_export._raise_terminated  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == []


@pytest.mark.world(1, timeout=120)
def test_the_export_command_refuses_a_save_with_nan_weights_and_prints_the_step():
    # a save that went through (checksums and all) with a NaN weight: resume refuses it, and so must
    # export; a good save's export says which step it wrote
    import contextlib
    import io
    from unittest import mock

    from harness.tiny_lm import tiny_decoder
    from shardkit.checkpoint import save_train_state
    from shardkit.checkpoint.hf_writer import hf_description
    from shardkit.parallelize import parallelize

    root = shared_tmpdir("shardkit-export-")
    try:
        model = tiny_decoder(dtype="float32")
        pm = parallelize(model, None)
        hf = hf_description(model, None)
        optimizer = make_optimizer(pm.module, 1e-3)
        good = save_train_state(os.path.join(root, "good"), pm, optimizer, 4, {}, hf=hf)
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
        with mock.patch("shardkit.checkpoint.saves.nonfinite_keys", return_value=[]):  # a save that got past
            save_train_state(os.path.join(root, "bad"), pm, optimizer, 4, {}, hf=hf)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            bad_rc = main(["export", "--checkpoint-dir", os.path.join(root, "bad"), "--out", os.path.join(root, "x")])
            good_rc = main(["export", "--checkpoint-dir", os.path.join(root, "good"), "--out", os.path.join(root, "y")])
        assert bad_rc == 2, err.getvalue()
        assert "non-finite values (NaN or inf) in model.layers.1.self_attn.o_proj.weight: refused" in err.getvalue()
        assert not os.path.exists(os.path.join(root, "x"))
        assert good_rc == 0 and f"wrote step 4 ({good})" in out.getvalue(), (out.getvalue(), err.getvalue())
    finally:
        remove_shared_dir(root)
