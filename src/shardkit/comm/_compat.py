"""The one compatibility shim for c10d names that moved between torch releases.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (FutureWarning) in
favour of ``all_gather_single`` / ``reduce_scatter_single``; GPU environments still run older
torch (2.11 seen) that only has the old names. Same semantics, so pick whichever exists.

Point-to-point: torch >= 2.7 addresses peers by group rank (``P2POp(..., group_peer=)``,
``isend(..., group_dst=)``); older releases take only the global rank. shardkit passes group
ranks everywhere and translates them here, once, with ``dist.get_global_rank`` where needed.

Timeouts: a subgroup gets the backend's default timeout (30 minutes for gloo), not the world's;
:func:`world_timeout` reads the world's from its backend's private options, so that every group
of a run can be given it.

Launch: ``LaunchConfig(shutdown_timeout=)`` (how long the elastic agent waits for a worker that
ignores the forwarded signal before SIGKILL) is absent from older torch (2.11 seen), whose agent
always waits 30 s; :func:`launch_config` passes it where it exists.

FSDP2: shardkit runs FSDP2's end-of-backward callback outside a backward (the zero-bubble ``W``
step's reduction, :func:`shardkit.data_parallel.microbatches.reduce_outside_autograd`). From torch
2.15 that callback reads the backward's finalization mode (manual or automatic), which a backward
sets when it starts; :func:`fsdp_end_of_backward` sets it the same way when no backward did.

Attention: torch < 2.13's CPU ``scaled_dot_product_attention`` dies with SIGFPE on an empty head
dim (seen on 2.11: a rank of a Ulysses group that holds no heads); :func:`sdpa` builds such an
empty output without the kernel.

transformers (the ``hf`` extra, floor 5.17): the model's own plans changed shape across the
supported releases, and shardkit reads them only through :func:`hf_tp_plan` / :func:`hf_ep_plan`,
which give every release the form of the newest:

* from 5.21 the base model's tensor-parallel plan shards ``embed_tokens`` on the vocabulary
  (``embedding_rowwise``) unless the plan names it; older releases leave the embedding whole.
* from 5.19 ``base_model_ep_plan`` sends tokens to their experts (``ep_dispatch_experts`` on the
  experts module); older releases ship Hugging Face's earlier all-reduce form (``ep_router`` on
  the router, ``moe_tp_experts`` on the experts), which names the same experts modules.

Memory snapshots: the CUDA caching allocator's history (``--memory-snapshot``) is recorded and
dumped through torch's private ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``
(the API of https://pytorch.org/docs/stable/torch_cuda_memory.html, which torchtitan uses too);
:func:`record_memory_history` / :func:`dump_memory_snapshot` are shardkit's only calls of them.

Nothing here imports transformers: the version is read from the installed distribution.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "all_gather_single",
    "reduce_scatter_single",
    "isend",
    "irecv",
    "p2p_op",
    "world_timeout",
    "world_timeout_options",
    "release",
    "TORCH_RELEASE",
    "transformers_release",
    "launch_config",
    "fsdp_end_of_backward",
    "sdpa",
    "hf_tp_plan",
    "hf_ep_plan",
    "record_memory_history",
    "dump_memory_snapshot",
]

# Allocation events kept by --memory-snapshot (torchtitan's default): enough for a few steps of a
# large model, a bounded host buffer however many steps are recorded.
MEMORY_HISTORY_ENTRIES = 100_000


def record_memory_history(enabled: bool) -> None:
    """Start (``True``) or stop the CUDA caching allocator's history, with stack traces."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=MEMORY_HISTORY_ENTRIES)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator's snapshot and recorded history to ``path`` (a pickle for
    https://pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


def current_autograd_node():
    """The autograd node whose backward is running on this thread (None outside a backward):
    what a deferred weight-gradient closure is keyed by (``pipeline_parallel.weight_defer``)."""
    return torch._C._current_autograd_node()


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``"2.11.0+cu130"`` -> ``(2, 11)``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return int(m[1]), int(m[2])


TORCH_RELEASE = release(torch.__version__)


@functools.cache
def transformers_release() -> tuple[int, int] | None:
    """The installed transformers' ``(major, minor)``, or None when it is not installed."""
    try:
        return release(importlib.metadata.version("transformers"))
    except importlib.metadata.PackageNotFoundError:
        return None


all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GROUP_PEER = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters
_GROUP_DST = "group_dst" in inspect.signature(dist.isend).parameters


def isend(tensor: torch.Tensor, pg: dist.ProcessGroup, group_dst: int):
    """``dist.isend`` to group rank ``group_dst`` of ``pg``."""
    if _GROUP_DST:
        return dist.isend(tensor, group=pg, group_dst=group_dst)
    return dist.isend(tensor, dst=dist.get_global_rank(pg, group_dst), group=pg)


def irecv(tensor: torch.Tensor, pg: dist.ProcessGroup, group_src: int):
    """``dist.irecv`` from group rank ``group_src`` of ``pg``."""
    if _GROUP_DST:
        return dist.irecv(tensor, group=pg, group_src=group_src)
    return dist.irecv(tensor, src=dist.get_global_rank(pg, group_src), group=pg)


def p2p_op(send: bool, tensor: torch.Tensor, pg: dist.ProcessGroup, group_peer: int) -> dist.P2POp:
    """A ``dist.P2POp`` (for ``batch_isend_irecv``) with group rank ``group_peer`` of ``pg``."""
    op = dist.isend if send else dist.irecv
    if _GROUP_PEER:
        return dist.P2POp(op, tensor, group=pg, group_peer=group_peer)
    return dist.P2POp(op, tensor, peer=dist.get_global_rank(pg, group_peer), group=pg)


def world_timeout():
    """The default process group's timeout (a ``timedelta``), which every group of a run shares
    (torch's subgroups otherwise get the backend's default, 30 minutes for gloo, whatever the
    world was created with); None when the backend's options cannot be read."""
    world = dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(world) == "nccl" else "cpu")
    try:
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None  # a backend without readable options: keep torch's default


def world_timeout_options():
    """Backend options carrying :func:`world_timeout`, for every subgroup a mesh creates; None
    when it cannot be read (torch's default then applies)."""
    from torch._C._distributed_c10d import Backend

    timeout = world_timeout()
    if timeout is None:
        return None
    backend = dist.get_backend(dist.group.WORLD)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        options = Backend.Options(backend, timeout)
    return options


def launch_config(**kwargs):
    """``torch.distributed.launcher.api.LaunchConfig(**kwargs)``, without ``shutdown_timeout`` on a
    torch whose ``LaunchConfig`` has none (2.11: its agent waits a fixed 30 s instead)."""
    from torch.distributed.launcher.api import LaunchConfig  # imported when a launch needs it

    if "shutdown_timeout" not in inspect.signature(LaunchConfig).parameters:
        kwargs.pop("shutdown_timeout", None)
    return LaunchConfig(**kwargs)


def fsdp_end_of_backward(state) -> None:
    """Run FSDP2's end-of-backward callback (``FSDPState._root_post_backward_final_callback``) on the
    root's ``state`` now. torch >= 2.15 asserts the backward's finalization mode was chosen, which
    its backward does when it starts (from ``set_manual_backward_finalization``, off by default):
    outside a backward it is chosen here the same way. Older torch has no such mode."""
    ctx = state._state_ctx
    if hasattr(ctx, "manual_backward_finalization_active") and ctx.manual_backward_finalization_active is None:
        ctx.manual_backward_finalization_active = ctx.manual_backward_finalization
    state._root_post_backward_final_callback()


# torch < 2.13: F.scaled_dot_product_attention on CPU raises SIGFPE (the process dies) when the
# head dim of [B, N, S, D] is 0; seen on 2.11, fixed by 2.13 (2.12 not checked).
_SDPA_EMPTY_CRASHES = TORCH_RELEASE < (2, 13)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (``[B, N, S, D]``); on torch < 2.13 an
    empty output (zero batch, heads or queries) is made by plain matmuls instead, still attached to
    ``q, k, v`` for autograd (their gradients are empty too)."""
    if _SDPA_EMPTY_CRASHES and 0 in (*q.shape[:-1], v.shape[-1]):
        return q @ k.transpose(-2, -1) @ v  # [B, N, S_q, Dv] with no elements: masks and scale are moot
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# transformers 5.21 added the input-embedding rule to the base model's plan.
_HF_EMBEDDING_RULE = (5, 21)
# transformers 5.19 moved base_model_ep_plan from the ep_router / moe_tp_experts form to dispatch.
_HF_EP_DISPATCH = (5, 19)


def hf_tp_plan(model: nn.Module) -> dict | None:
    """A transformers model's own tensor-parallel plan (``model.tp_plan``, a copy), with the
    ``embed_tokens: embedding_rowwise`` rule transformers >= 5.21 adds to it: on an older release
    it is added the same way (when the base model has a plan, its ``embed_tokens`` is an
    ``nn.Embedding`` and the plan does not name it). None when the model has no plan."""
    plan = getattr(model, "tp_plan", None)
    if not plan:
        return None
    plan = dict(plan)
    hf = transformers_release()
    if hf is None or hf >= _HF_EMBEDDING_RULE:
        return plan
    name = getattr(model, "base_model_prefix", "")
    base = getattr(model, name, None) if name else None
    base, prefix = (base, f"{name}.") if isinstance(base, nn.Module) else (model, "")
    key = f"{prefix}embed_tokens"
    own = getattr(base, "_tp_plan", None) or {}
    if not own or "embed_tokens" in own or key in plan:
        return plan
    if not isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        return plan
    # where the base model's rules start (transformers puts the rule first among them)
    keys = list(plan)
    at = next((i for i, k in enumerate(keys) if not prefix or k.startswith(prefix)), len(keys))
    items = list(plan.items())
    return dict(items[:at] + [(key, "embedding_rowwise")] + items[at:])


def hf_ep_plan(config) -> dict | None:
    """A transformers config's ``base_model_ep_plan`` (a copy), in the form transformers >= 5.19
    ships: on an older release, whose plans use Hugging Face's earlier all-reduce expert
    parallelism (``ep_router`` on the router, ``moe_tp_experts`` on its sibling experts, and no
    ``ep_dispatch_experts``), the router rules are dropped and the experts rules become
    ``ep_dispatch_experts`` (the parameter rules, ``grouped_gemm``, are the same in both). None
    when the config has no EP plan."""
    ep = getattr(config, "base_model_ep_plan", None)
    if not ep:
        return None
    hf, styles = transformers_release(), set(ep.values())
    # the earlier form: routers and tensor-parallel experts, no dispatch (a plan that mixes them is
    # someone's own choice, kept as it is)
    earlier = {"ep_router", "moe_tp_experts"} <= styles and "ep_dispatch_experts" not in styles
    if hf is None or hf >= _HF_EP_DISPATCH or not earlier:
        return dict(ep)
    return {k: "ep_dispatch_experts" if v == "moe_tp_experts" else v for k, v in ep.items() if v != "ep_router"}
