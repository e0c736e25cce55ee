"""Every tensor- and expert-parallel style against every common module type: it works, or it is refused.

The table of docs/guides/tensor.md ("Which style takes which module"), checked on 2 ranks: a
style either applies and gives the one-process result on its layout contract (checked here for
the replicated styles, whose contract is "the same module on this rank's data"; the sharding
styles' parity is in test_style_embedding.py, test_user_plans.py and test_apply_tp.py), or raises
a ``ShardkitError`` on every rank naming the style and the module type (and so never shards a
module in a way its forward does not follow, as ``ColwiseParallel`` on an ``nn.Embedding`` once
did).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.helpers import world_group
from shardkit import ShardkitError
from shardkit.expert_parallel.styles import EpDispatchExperts, EpRouter, GroupedGemm
from shardkit.tensor_parallel import (
    ColwiseParallel,
    EmbeddingParallel,
    MlaKvAProjParallel,
    MoeIdentityExpert,
    MoeTensorParallelExperts,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    Replicate,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    SequenceParallel,
)

MODULES = {
    "Linear": lambda: nn.Linear(8, 6),
    "Embedding": lambda: nn.Embedding(10, 6),
    "LayerNorm": lambda: nn.LayerNorm(6),
    "Conv2d": lambda: nn.Conv2d(2, 4, 3),
}
STYLES = {
    "ColwiseParallel": ColwiseParallel,
    "RowwiseParallel": lambda: RowwiseParallel(input_layouts=Replicate()),
    "PackedColwiseParallel": PackedColwiseParallel,
    "PackedRowwiseParallel": PackedRowwiseParallel,
    "EmbeddingParallel": EmbeddingParallel,
    "SequenceParallel": SequenceParallel,
    "ReplicatedWithGradAllReduce": ReplicatedWithGradAllReduce,
    "PrepareModuleInput": PrepareModuleInput,
    "PrepareModuleOutput": PrepareModuleOutput,
    "MlaKvAProjParallel": MlaKvAProjParallel,
    "MoeTensorParallelExperts": MoeTensorParallelExperts,
    "MoeIdentityExpert": MoeIdentityExpert,
    "GroupedGemm": GroupedGemm,
    "EpDispatchExperts": EpDispatchExperts,
    "EpRouter": EpRouter,
}
# style -> module types it applies to (the rest must be refused)
APPLIES = {
    "ColwiseParallel": {"Linear", "Embedding"},
    "RowwiseParallel": {"Linear", "Embedding"},
    "PackedColwiseParallel": {"Linear"},
    "PackedRowwiseParallel": {"Linear"},
    "EmbeddingParallel": {"Embedding"},
    "SequenceParallel": set(MODULES),
    "ReplicatedWithGradAllReduce": set(MODULES),
    "PrepareModuleInput": set(MODULES),
    "PrepareModuleOutput": set(MODULES),
}
# the message names the style (or its plan string) and the module type
NAMES = {
    "MlaKvAProjParallel": "mla_kv_a_proj",
    "GroupedGemm": "grouped_gemm",
    "EpDispatchExperts": "ep_dispatch_experts",
    "EpRouter": "ep_router",
}


def _style(name: str):
    return STYLES[name]()


@pytest.mark.combinations  # each style meets each module type on its own path (applied or refused) (ms a case)
@pytest.mark.world(2)
@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("style", list(STYLES))
def test_every_style_on_every_module_type_applies_or_is_refused(style, module):
    if module in APPLIES.get(style, set()):
        _style(style).apply(MODULES[module](), world_group())
        return
    with pytest.raises(ShardkitError) as err:
        _style(style).apply(MODULES[module](), world_group())
    message = str(err.value)
    assert NAMES.get(style, style) in message, message
    # the router and MLA styles name what the model lacks (a sibling experts module, qk_rope_head_dim)
    assert style in {"MlaKvAProjParallel", "EpRouter"} or module in message, message


@pytest.mark.world(2)
@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("style", ["SequenceParallel", "ReplicatedWithGradAllReduce"])
def test_replicated_styles_sum_the_gradients_of_each_ranks_own_data(style, module):
    """Each rank runs the module on its own half of the batch: output as one process, parameter
    gradients summed over the ranks (the one-process gradient of the whole batch)."""
    torch.manual_seed(0)
    ref = MODULES[module]().double()
    mod = _style(style).apply(copy.deepcopy(ref), world_group())
    g = torch.Generator().manual_seed(1)
    x = {
        "Linear": torch.randn(4, 8, generator=g),
        "Embedding": torch.randint(0, 10, (4, 3), generator=g),
        "LayerNorm": torch.randn(4, 6, generator=g),
        "Conv2d": torch.randn(4, 2, 5, 5, generator=g),
    }[module]
    x = x.double() if x.is_floating_point() else x
    ref(x).pow(2).sum().backward()
    r = torch.distributed.get_rank()
    mine = x[2 * r : 2 * r + 2]
    out = mod(mine)
    torch.testing.assert_close(out, ref(mine), rtol=1e-12, atol=1e-12)
    out.pow(2).sum().backward()
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
