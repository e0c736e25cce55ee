"""Issue 19, the training side of a shared machine: rows 2 (training), 5, 9 and 11 (all but the
truncated ``.metadata`` and the garbage manifest, which the checkpoint tests own).

* row 2, non-finite training: ``--lr 1e9`` and a NaN parameter on one rank stop the run with one
  :class:`~shardkit.errors.NonFiniteError` on every rank naming the step, nothing non-finite is
  applied and ``latest`` still names the last finite save; ``--skip-nonfinite 1`` skips one
  poisoned step (not applied) and trains on; ``--lr``/``--max-norm`` must be finite.
* row 5, the token cache: a file planted at the old shared ``<tempdir>/shardkit-tokens`` path and
  a tampered entry of the new per-user cache are never trained on; a cache folder that is not
  private is not used.
* row 9, one source of data: every rank trains on global rank 0's stream even when the files
  differ between the ranks' views; a FIFO, a broken symlink or an unreadable file in ``--data`` is
  a ShardkitError naming it before launch (and on every rank after it, never a hang).
* row 11, validation before launch: NaN/inf lr and max-norm, seeds outside [0, 2**63 - 1], sizes
  and ``--nproc`` beyond this machine, a binary TOML file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from shardkit import ShardkitError
from shardkit.cli.main import build_parser
from shardkit.cli.train import config_from_args
from shardkit.errors import NonFiniteError
from shardkit.train import limits
from shardkit.train.config import TrainConfig, validate_config

SMALL = dict(seq_len=16, batch_size=4, layers=1, hidden_size=32, intermediate_size=64)


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


def _agreed(message: str | None) -> list:
    """Every rank's error message (None: no error), on every rank."""
    out: list = [None] * world_size()
    dist.all_gather_object(out, message)
    return out


# ---- row 2: non-finite steps -------------------------------------------------------------------


@pytest.mark.world(2, timeout=120)
def test_lr_1e9_stops_naming_the_step_and_latest_stays_finite():
    from shardkit.checkpoint import latest_checkpoint
    from shardkit.train.run import train

    root = shared_tmpdir("shardkit-nonfinite-")
    try:
        cfg = validate_config(
            TrainConfig(**SMALL, lr=1e9, steps=6, checkpoint_dir=root, save_every=1), world_size=world_size()
        )
        message = None
        try:
            train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        except NonFiniteError as e:
            message = str(e)
        messages = _agreed(message)
        assert messages[0] is not None and len(set(messages)) == 1, messages
        step = int(re.match(r"step (\d+): the global loss", messages[0]).group(1))
        assert step >= 2 and "not applied" in messages[0] and "--skip-nonfinite" in messages[0]
        if rank() == 0:  # the save before the failing step is the latest; nothing after it
            assert latest_checkpoint(root).endswith(f"step_{step - 1:08d}")
            assert not [n for n in os.listdir(root) if n.startswith("step_") and int(n[5:]) >= step]
    finally:
        remove_shared_dir(root)


def _built(cfg):
    from shardkit.train.config import parallel_dims
    from shardkit.train.run import build_parallel_model, build_task, build_train_model

    device = torch.device("cpu")
    mesh = parallel_dims(cfg).build_mesh("cpu")
    task = build_task(cfg, device)
    pm, loss_scale = build_parallel_model(build_train_model(cfg), mesh, cfg, task, device)
    return pm, task, loss_scale


@pytest.mark.world(4, timeout=120)
def test_nan_parameter_on_one_rank_stops_every_rank_at_step_1():
    from shardkit.train.run import run_training

    cfg = validate_config(TrainConfig(**SMALL, steps=3), world_size=world_size())  # tp=2 x dp=2
    pm, task, loss_scale = _built(cfg)
    if rank() == 1:  # one rank's shard only: the global values carry it to every rank
        with torch.no_grad():
            next(p for n, p in pm.module.named_parameters() if "mlp" in n).view(-1)[0] = math.nan
    message = None
    try:
        run_training(pm, task, cfg, loss_scale)
    except NonFiniteError as e:
        message = str(e)
    messages = _agreed(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert messages[0].startswith("step 1: the global loss (nan) and gradient norm (nan) are not finite")


class _PoisonOnce:
    """The task, with the logits of one step (1-based) made NaN on global rank 0 only."""

    def __init__(self, task, step: int) -> None:
        self.task, self.step, self.calls = task, step, 0

    def __getattr__(self, name):
        return getattr(self.task, name)

    def forward(self, module, inputs):
        self.calls += 1
        logits = self.task.forward(module, inputs)
        return logits * math.nan if self.calls == self.step and rank() == 0 else logits


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("allowed", [0, 1])
def test_skip_nonfinite_skips_a_poisoned_step_without_applying_it(allowed):
    from shardkit.train.run import run_training

    cfg = validate_config(TrainConfig(**SMALL, steps=4, skip_nonfinite=allowed, tp=1), world_size=world_size())
    pm, task, loss_scale = _built(cfg)
    params = []

    def keep(step, loss):
        params.append([p.detach().clone() for p in pm.module.parameters()])

    from shardkit.train.metrics import MetricsLog

    folder = tempfile.mkdtemp(prefix="shardkit-metrics-")  # rank 0 writes the metrics
    metrics = MetricsLog(folder, "tokens", cfg.seq_len, cfg.batch_size, torch.device("cpu"), tensorboard=False)
    message = run = None
    try:
        run = run_training(
            pm, _PoisonOnce(task, 2), cfg, loss_scale, on_step=keep, metrics=metrics if rank() == 0 else None
        )
    except NonFiniteError as e:
        message = str(e)
    lines = [json.loads(line) for line in Path(metrics.path).read_text().splitlines()] if rank() == 0 else None
    shutil.rmtree(folder)
    messages = _agreed(message)
    if rank() == 0:  # the step that stopped the run is recorded too, as not applied
        assert [m["skipped"] for m in lines] == ([False, True] if allowed == 0 else [False, True, False, False])
    if allowed == 0:
        assert messages[0] is not None and len(set(messages)) == 1 and messages[0].startswith("step 2: the global loss")
        return
    assert messages == [None] * world_size()
    assert run["skipped_steps"] == [2]
    assert math.isnan(run["losses"][1]) and all(math.isfinite(v) for i, v in enumerate(run["losses"]) if i != 1)
    # step 2 changed nothing; steps 3 and 4 trained on, every parameter finite
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1]))
    assert not all(torch.equal(a, b) for a, b in zip(params[1], params[2]))
    assert all(bool(torch.isfinite(p).all()) for p in params[-1])


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--lr", "nan"], r"--lr must be a finite number > 0, got nan"),
        (["--lr", "inf"], r"--lr must be a finite number > 0, got inf"),
        (["--max-norm", "nan"], r"--max-norm must be a finite number >= 0"),
        (["--max-norm", "inf"], r"--max-norm must be a finite number >= 0"),
    ],
)
def test_lr_and_max_norm_must_be_finite(argv, match):
    with pytest.raises(ShardkitError, match=match):
        config_from_args(_args(*argv))


def test_toml_inf_lr_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("lr = inf\n")
    with pytest.raises(ShardkitError, match="--lr must be a finite number"):
        config_from_args(_args("--config", str(path)))


# ---- row 5: the token cache ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from harness.pretrained import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def lm_cfg(checkpoint, tmp_path, monkeypatch):
    """A --model-path configuration on a two-file corpus; the system temp dir and the user's
    cache dir are private folders of this test."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    (data / "b.txt").write_text("class A:\n    pass\n" * 40)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return validate_config(
        TrainConfig(model_path=str(checkpoint), data=str(data), nproc=1, tp=1, seq_len=16, batch_size=2)
    )


def _true_stream(cfg) -> torch.Tensor:
    from shardkit.train.data import corpus_files
    from shardkit.train.tokens import token_stream

    return token_stream(cfg.model_path, corpus_files(cfg.data))  # no cache


def _old_key(model_path: str, files: list[Path]) -> str:
    """The cache file name of the old shared cache: computable by anyone from stat()."""
    import transformers

    from shardkit.train.pretrained import resolve_checkpoint
    from shardkit.train.tokens import DEFAULT_MAX_BYTES, corpus_prefix

    parts = corpus_prefix(files, DEFAULT_MAX_BYTES)
    h = hashlib.sha256(f"tokens-v1\0{transformers.__version__}\0{DEFAULT_MAX_BYTES}\0".encode())
    for f in resolve_checkpoint(model_path).files() + [f for f, _ in parts]:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for _, n in parts:
        h.update(f"{n}\0".encode())
    return h.hexdigest()[:32]


def test_planted_file_at_the_old_shared_path_is_not_trained_on(lm_cfg):
    from shardkit.train.data import corpus_files
    from shardkit.train.run import build_task

    planted = Path(tempfile.gettempdir()) / "shardkit-tokens"
    planted.mkdir()
    old_name = f"{_old_key(lm_cfg.model_path, corpus_files(lm_cfg.data))}.pt"
    torch.save(torch.full((80_000,), 7, dtype=torch.int32), planted / old_name)
    task = build_task(lm_cfg, torch.device("cpu"))
    assert torch.equal(task.sampler.tokens, _true_stream(lm_cfg))


def test_tampered_or_garbage_cache_entry_is_ignored_and_rewritten(lm_cfg, monkeypatch):
    from shardkit.train import tokens as tokens_mod
    from shardkit.train.run import build_task

    truth = _true_stream(lm_cfg)
    build_task(lm_cfg, torch.device("cpu"))  # fills the cache
    folder = Path(os.environ["XDG_CACHE_HOME"]) / "shardkit"
    entries = list(folder.glob("*.pt"))
    assert len(entries) == 1 and (os.stat(folder).st_mode & 0o777) == 0o700
    loads = []
    real_load = tokens_mod.load_tokenizer
    monkeypatch.setattr(tokens_mod, "load_tokenizer", lambda path: loads.append(path) or real_load(path))
    entry = torch.load(entries[0], weights_only=True)
    entry["tokens"] = torch.full_like(entry["tokens"], 7)  # its stored hash no longer matches
    torch.save(entry, entries[0])
    assert torch.equal(build_task(lm_cfg, torch.device("cpu")).sampler.tokens, truth) and len(loads) == 1
    entries[0].write_bytes(b"not a torch file")
    assert torch.equal(build_task(lm_cfg, torch.device("cpu")).sampler.tokens, truth) and len(loads) == 2
    # rewritten: the next run is a verified hit
    assert torch.equal(build_task(lm_cfg, torch.device("cpu")).sampler.tokens, truth) and len(loads) == 2


@pytest.mark.parametrize("how", ["group-writable", "another owner"])
def test_a_cache_folder_that_is_not_private_is_not_used(lm_cfg, capsys, how):
    from shardkit.train.run import build_task

    folder = Path(os.environ["XDG_CACHE_HOME"]) / "shardkit"
    folder.mkdir(parents=True, mode=0o700)
    if how == "group-writable":
        os.chmod(folder, 0o770)
    elif os.geteuid() == 0:
        os.chown(folder, 65534, 65534)
    else:
        pytest.skip("only root can give the folder to another user")  # not counted as a pass
    assert torch.equal(build_task(lm_cfg, torch.device("cpu")).sampler.tokens, _true_stream(lm_cfg))
    assert "not used" in capsys.readouterr().err and not list(folder.iterdir())


# ---- row 9: one source of data -------------------------------------------------------------------


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("packed", [False, True])
def test_every_rank_trains_on_rank_0s_stream_when_the_files_change(packed):
    """Each rank sees the corpus file at another moment (rank r: r x 100 bytes appended); every
    rank must still hold global rank 0's stream and documents."""
    from shardkit.train import data
    from shardkit.train.run import build_task

    folder = shared_tmpdir("shardkit-onesource-")
    try:
        base = b"print('hello world')\n" * 20
        mine = Path(folder, f"seen_by_{rank()}.py")
        mine.write_bytes(base + b"#" * (100 * rank()))
        if rank() == 0:
            Path(folder, "other.py").write_bytes(b"x = 1\n" * 10)
        dist.barrier()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(data, "corpus_files", lambda path: [Path(folder, "other.py"), mine])
            cfg = validate_config(TrainConfig(**SMALL, data=folder, packed=packed, tp=1), world_size=world_size())
            task = build_task(cfg, torch.device("cpu"))
        tokens = task.sampler.tokens
        seen = [None] * world_size()
        dist.all_gather_object(
            seen,
            (
                hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
                tokens.numel(),
                task.sampler.starts.tolist() if packed else None,
            ),
        )
        assert len(set(map(str, seen))) == 1, seen
        assert tokens.numel() == 60 + len(base)  # rank 0's view: nothing appended
    finally:
        remove_shared_dir(folder)


@pytest.mark.world(2, timeout=60)
def test_a_fifo_read_after_launch_is_the_same_error_on_every_rank():
    """The FIFO appears after the launcher's check (only rank 0 reads): no rank blocks on it."""
    from shardkit.train import data
    from shardkit.train.run import build_task

    folder = shared_tmpdir("shardkit-fifo-")
    try:
        if rank() == 0:
            os.mkfifo(Path(folder, "pipe"))
        dist.barrier()
        message = None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(data, "corpus_files", lambda path: [Path(folder, "pipe")])
            try:
                build_task(validate_config(TrainConfig(**SMALL, tp=1), world_size=world_size()), torch.device("cpu"))
            except ShardkitError as e:
                message = str(e)
        messages = _agreed(message)
        assert messages[0] is not None and len(set(messages)) == 1, messages
        assert "pipe is a FIFO; only regular files are read" in messages[0]
    finally:
        remove_shared_dir(folder)


@pytest.mark.world(3)
def test_any_failure_of_the_reader_is_one_shardkit_error_on_every_rank():
    from shardkit.train.corpus import one_source

    def read():
        raise RuntimeError("disk on fire")

    message = None
    try:
        one_source(read, torch.uint8, torch.device("cpu"))
    except ShardkitError as e:
        message = str(e)
    messages = _agreed(message)
    assert messages == ["global rank 0 could not read the training data: RuntimeError: disk on fire"] * 3, messages


def _data_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "good.py").write_text("x = 1\n" * 100)
    return folder


def test_fifo_in_data_folder_fails_before_launch(tmp_path):
    folder = _data_folder(tmp_path)
    os.mkfifo(folder / "pipe")
    with pytest.raises(ShardkitError, match=r"--data: .*pipe is a FIFO; only regular files are read"):
        config_from_args(_args("--data", str(folder)))


def test_broken_symlink_in_data_folder_fails_before_launch(tmp_path):
    folder = _data_folder(tmp_path)
    (folder / "gone.py").symlink_to(tmp_path / "missing.py")
    with pytest.raises(ShardkitError, match=r"--data: .*gone.py is a broken symbolic link"):
        config_from_args(_args("--data", str(folder)))


def test_unreadable_file_in_data_folder_fails_before_launch(tmp_path, monkeypatch):
    folder = _data_folder(tmp_path)
    secret = folder / "secret.py"
    secret.write_text("y = 2\n")
    if os.geteuid() == 0:  # root opens any file: the refusal the kernel would give is simulated
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if Path(path) == secret:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    else:
        secret.chmod(0)
    with pytest.raises(ShardkitError, match=r"--data: cannot read .*secret.py: Permission denied"):
        config_from_args(_args("--data", str(folder)))


# ---- row 11: validation before launch ------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--seed", str(2**63)], r"--seed must be in \[0, 2\*\*63 - 1\], got 9223372036854775808"),
        (["--seed", "-1"], r"--seed must be in \[0, 2\*\*63 - 1\]"),
        (["--skip-nonfinite", "-1"], r"--skip-nonfinite must be >= 0"),
        (["--hidden-size", str(2**40), "--heads", "4"], r"--hidden-size must be <= 2\*\*31 - 1"),
        (["--batch-size", "4000000"], r"--batch-size 4000000 --seq-len 128 .* more than this machine's memory"),
        (["--seq-len", "4000000"], r"--seq-len 4000000 .* more than this machine's memory"),
        (["--hidden-size", "65536"], r"--hidden-size 65536 .* more than this machine's memory"),
        (["--layers", "1000000"], r"--layers 1000000 .* more than this machine's memory"),
        (["--intermediate-size", "100000000"], r"--intermediate-size 100000000 .* more than this machine's memory"),
        (
            ["--nproc", "64", "--tp", "1", "--batch-size", "64"],
            r"--nproc 64: a local launch starts at most max\(8, 4 x CPUs\) ranks: 8 on this machine \(2 CPUs\)",
        ),
    ],
)
def test_sizes_and_seeds_beyond_the_machine_fail_before_launch(argv, match, monkeypatch):
    monkeypatch.setattr(limits, "_cpus", lambda: 2)
    monkeypatch.setattr(limits, "_host_memory", lambda: 16 << 30)
    with pytest.raises(ShardkitError, match=match):
        config_from_args(_args(*argv))


def test_binary_toml_is_a_clear_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xff\xfe\x00binary\x80")
    with pytest.raises(ShardkitError, match="--config: .*run.toml is not valid TOML: not UTF-8"):
        config_from_args(_args("--config", str(path)))


README_RUNS = [
    "",
    "--dp-shard 2 --cp-ring 2 --tp 2 --nproc 8 --verify",
    "--pp 2 --tp 2 --cp-ring 2 --microbatches 2 --nproc 8 --seq-len 64 --verify",
    "--model moe --dp-shard 4 --tp 1 --ep 4 --verify",
    "--pp 3 --pp-tp 2,1,1 --layers 3 --verify",
    "--model conv-ae --spatial-h 2 --spatial 2 --verify",
    "--model mla --ep 2",
]


@pytest.mark.parametrize("argv", README_RUNS)
def test_readme_runs_fit_a_small_machine(argv, monkeypatch):
    """The README's commands pass the machine limits of a 2-CPU, 4 GiB machine."""
    monkeypatch.setattr(limits, "_cpus", lambda: 2)
    monkeypatch.setattr(limits, "_host_memory", lambda: 4 << 30)
    config_from_args(_args(*argv.split()))


def test_smollm2_fine_tuning_fits_an_8_gib_machine(tmp_path, monkeypatch):
    """SmolLM2-135M's config in the README's fine-tuning run (tp 2 x dp 2, 4 x 64 tokens)."""
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = validate_config(TrainConfig(model_path=str(tmp_path), tp=2, seq_len=64, batch_size=4))
    monkeypatch.setattr(limits, "_host_memory", lambda: 8 << 30)
    limits.check_machine(cfg, local_launch=True)
    monkeypatch.setattr(limits, "_host_memory", lambda: 2 << 30)
    with pytest.raises(ShardkitError, match="more than this machine's memory"):
        limits.check_machine(cfg, local_launch=True)


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3", "moe", "mla"])
def test_the_limits_model_shape_is_the_built_models(model):
    from shardkit.plan import ModelShape
    from shardkit.train.model import hf_config
    from shardkit.train.specs import model_spec

    cfg = validate_config(TrainConfig(model=model, nproc=4))
    assert limits.builtin_shape(cfg) == ModelShape.from_config(hf_config(cfg, model_spec(cfg.model).family)[1])
