"""Grouped GEMM of the local experts against the per-expert loop it replaced (one process).

Reference: a loop of :func:`expert_forward` over the experts (what ``grouped_experts_forward``
ran before), on the same rows, weights and output cotangent. Compared: output, input gradient
and every parameter gradient. float64 (the padded ``bmm`` path) to rtol 1e-12; float32 through
``torch._grouped_mm`` (this CPU build runs it) and ``bmm`` to rtol 1e-5. Uneven counts with
experts of 0 rows, one expert taking every row, and no rows at all; gated / ungated, biases,
transposed weights, a model's own ``_apply_gate``, and Qwen3-MoE's experts module.
"""

import subprocess
import sys

import pytest
import torch
from torch import nn

from shardkit import ShardkitError
from shardkit._grouped_gemm import ExpertGroups, grouped_mm_supported
from shardkit.expert_parallel import expert_forward, grouped_experts_forward

COUNTS = [[3, 0, 5, 1, 0], [0, 0, 9, 0, 0], [0, 0, 0, 0, 0], [2, 2, 2, 2, 2], [1, 0, 0, 0, 7]]


class _Experts(nn.Module):
    """A transformers-style experts module with every layout option (own test double)."""

    def __init__(self, e=5, h=16, i=8, *, gate=True, bias=False, transposed=False, own_gate=False, dtype=torch.float64):
        super().__init__()
        self.num_experts, self.has_gate, self.has_bias, self.is_transposed = e, gate, bias, transposed
        first = 2 * i if gate else i
        shape1, shape2 = ((e, h, first), (e, i, h)) if transposed else ((e, first, h), (e, h, i))
        gen = torch.Generator().manual_seed(5)
        name = "gate_up_proj" if gate else "up_proj"
        setattr(self, name, nn.Parameter(torch.randn(shape1, generator=gen, dtype=dtype) * 0.5))
        self.down_proj = nn.Parameter(torch.randn(shape2, generator=gen, dtype=dtype) * 0.5)
        if bias:
            setattr(self, name + "_bias", nn.Parameter(torch.randn(e, first, generator=gen, dtype=dtype)))
            self.down_proj_bias = nn.Parameter(torch.randn(e, h, generator=gen, dtype=dtype))
        self.act_fn = nn.SiLU()
        if own_gate:  # an interleaved gate/up layout with a clamp, as some models override it
            self._apply_gate = lambda h: torch.sigmoid(h[..., ::2]) * h[..., 1::2].clamp(-2, 2)


def _loop(module, x, counts):
    outs, off = [], 0
    for e, n in enumerate(counts):
        outs.append(expert_forward(module, e, x.narrow(0, off, n)))
        off += n
    return torch.cat(outs)


def _run(module, fn, counts, dtype):
    n, h = sum(counts), 16
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    c = torch.randn(n, h, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    module.zero_grad(set_to_none=True)
    x.requires_grad_(True)
    y = fn(module, x, counts)
    (y * c).sum().backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _assert_same(got, ref, rtol):
    (y, gx, grads), (ry, rgx, rgrads) = got, ref
    pairs = [("out", y, ry), ("x.grad", gx, rgx)] + [(n, grads[n], rgrads[n]) for n in rgrads]
    for name, a, b in pairs:
        assert a is not None, f"{name}: no gradient (every expert must take part in backward)"
        assert a.shape == b.shape, name
        scale = b.abs().max().item() if b.numel() else 0.0
        err = (a - b).abs().max().item() if b.numel() else 0.0
        assert err <= rtol * max(scale, 1e-30) or err == 0.0, (name, err, scale)


LAYOUTS = {
    "gated": {},
    "ungated_bias": {"gate": False, "bias": True},
    "transposed_bias": {"transposed": True, "bias": True},
    "own_gate": {"own_gate": True},
}


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_float64_bmm_equals_loop(layout, counts):
    module = _Experts(**LAYOUTS[layout])
    ref = _run(module, _loop, counts, torch.float64)
    got = _run(module, lambda m, x, c: grouped_experts_forward(m, x, c, 16), counts, torch.float64)
    _assert_same(got, ref, 1e-12)
    for name, p in module.named_parameters():  # an expert without rows: gradient exactly zero
        for e, n in enumerate(counts):
            if n == 0:
                assert torch.count_nonzero(p.grad[e]) == 0, (name, e)


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("path", ["grouped_mm", "bmm"])
@pytest.mark.parametrize("layout", ["gated", "transposed_bias"])
def test_float32_paths_equal_loop(layout, path, counts):
    assert grouped_mm_supported("cpu", torch.float32), "this torch build's CPU _grouped_mm is the case under test"
    module = _Experts(**LAYOUTS[layout], dtype=torch.float32)
    ref = _run(module, _loop, counts, torch.float32)
    got = _run(module, lambda m, x, c: grouped_experts_forward(m, x, c, 16, path=path), counts, torch.float32)
    _assert_same(got, ref, 1e-5)


def test_path_choice():
    """grouped_mm where the kernel runs and strides are 16-byte multiples; bmm otherwise."""
    cpu = torch.device("cpu")
    assert ExpertGroups([1, 2], cpu, torch.float32, (16, 8)).path == "grouped_mm"
    assert ExpertGroups([1, 2], cpu, torch.bfloat16, (16, 8)).path == "grouped_mm"
    assert ExpertGroups([1, 2], cpu, torch.float64, (16, 8)).path == "bmm"  # the kernel has no float64
    assert ExpertGroups([1, 2], cpu, torch.float32, (16, 6)).path == "bmm"  # 24-byte rows
    assert not grouped_mm_supported("cpu", torch.float64)


def test_qwen3_moe_experts_module():
    """transformers' own Qwen3-MoE experts module (its parameters, act_fn) through both paths."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=2)
    module = Qwen3MoeExperts(cfg).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype) * 0.5)
    counts = COUNTS[0]
    ref = _run(module, _loop, counts, torch.float64)
    _assert_same(_run(module, lambda m, x, c: grouped_experts_forward(m, x, c, 16), counts, torch.float64), ref, 1e-12)
    module.float()
    ref = _run(module, _loop, counts, torch.float32)
    got = _run(module, lambda m, x, c: grouped_experts_forward(m, x, c, 16), counts, torch.float32)
    _assert_same(got, ref, 1e-5)


def test_bad_path_and_module():
    module = _Experts()
    with pytest.raises(ShardkitError, match="path must be"):
        grouped_experts_forward(module, torch.zeros(1, 16, dtype=torch.float64), [1, 0, 0, 0, 0], 16, path="loop")
    with pytest.raises(ShardkitError, match="does not run torch.float64"):
        grouped_experts_forward(module, torch.zeros(1, 16, dtype=torch.float64), [1, 0, 0, 0, 0], 16, path="grouped_mm")
    with pytest.raises(ShardkitError, match="down_proj"):
        grouped_experts_forward(nn.Linear(2, 2), torch.zeros(1, 2), [1], 2)


def test_no_local_experts():
    out = grouped_experts_forward(_Experts(e=0), torch.zeros(0, 16, dtype=torch.float64), [], 16)
    assert out.shape == (0, 16)


@pytest.mark.slow  # about 30 s of compiling on the shared 2-core machine
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_under_torch_compile(dtype):
    """Tracing runs _grouped_mm's meta function, which takes bfloat16 only: float32 takes the bmm
    path there (the eager CPU kernel would have run it), bfloat16 the grouped kernel."""
    module = _Experts(dtype=dtype)
    counts = COUNTS[0]
    compiled = torch.compile(lambda m, x, c: grouped_experts_forward(m, x, c, 16), backend="aot_eager")
    ref = _run(module, _loop, counts, dtype)
    got = _run(module, compiled, counts, dtype)
    _assert_same(got, ref, 1e-5 if dtype == torch.float32 else 2e-2)
    torch._dynamo.reset()


@pytest.mark.slow  # a fresh interpreter importing shardkit and torch (3.5 core-s)
def test_importing_shardkit_loads_no_dynamo_until_the_probe_runs():
    # The probe is kept out of compiled graphs lazily: the launcher's checks import the planner
    # (and with it this module) and never need Dynamo, about 0.6 core-s of every launch.
    code = (
        "import sys; import shardkit.train.checkpoint_dir, shardkit.tensor_parallel; "
        "before = 'torch._dynamo' in sys.modules; "
        "from shardkit._grouped_gemm import grouped_mm_supported; import torch; "
        "ok = grouped_mm_supported('cpu', torch.float32); "
        "print(before, ok, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"], done.stdout + done.stderr
