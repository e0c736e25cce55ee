"""Catalogue cases of pipeline P2P transfers (stage = rank of the pipeline group, R = 2 or 3).

Dynamic transfers negotiate shape and dtype; static ones declare ``shape=``/``dtype=`` on both
ends. Misuse (both stages send, both receive, the wrong direction) belongs to the check mode's
P2P agreement.
"""

from __future__ import annotations

import torch
from bad_input_cases_comm import coords
from bad_input_rank import Registry, rank, world

from shardkit.pipeline_parallel import recv_backward, recv_forward, send_backward, send_forward

CASES = Registry(__name__)
X = (2, 3)


def _fwd(send_kw=None, recv_kw=None, shape=X, dtype=torch.float64, want_shape=X):
    """Stage 0 sends ``coords(*shape)`` forward, stage 1 receives it; stage 1 returns what it got."""
    g = world()
    x = coords(*shape, dtype=dtype)
    if rank() == 0:
        send_forward(x, g, **(send_kw or {}))
        return 0, 0
    got = recv_forward(g, **(recv_kw or {}))
    return got, coords(*want_shape, dtype=dtype)


def _chain(n):
    """Every stage receives from the previous one (except the first) and sends to the next."""
    g = world()
    x = coords(*X) if rank() == 0 else recv_forward(g) + 1
    if rank() < n - 1:
        send_forward(x, g)
    return x, coords(*X) + rank()


CASES.add("p2p_forward_dynamic_control", 2, "send_forward/recv_forward", "control", lambda: _fwd())
CASES.add(
    "p2p_forward_static_control",
    2,
    "send_forward/recv_forward",
    "control",
    lambda: _fwd({"shape": X, "dtype": torch.float64}, {"shape": X, "dtype": torch.float64}),
)
CASES.add(
    "p2p_forward_batched_control",
    2,
    "send_forward/recv_forward",
    "control",
    lambda: _fwd({"batched": True}, {"batched": True}),
)
CASES.add("p2p_forward_noncontiguous_control", 2, "send_forward/recv_forward", "control", lambda: _fwd_noncontig())
CASES.add("p2p_chain_control_r3", 3, "send_forward/recv_forward", "control", lambda: _chain(3))
CASES.add("p2p_chain_control_r4", 4, "send_forward/recv_forward", "control", lambda: _chain(4))


def _fwd_noncontig():
    g = world()
    if rank() == 0:
        send_forward(coords(3, 2).t(), g)
        return 0, 0
    return recv_forward(g), coords(3, 2).t()


def _backward_control():
    g = world()
    if rank() == 1:
        send_backward(coords(*X), g)
        return 0, 0
    return recv_backward(g), coords(*X)


CASES.add("p2p_backward_dynamic_control", 2, "send_backward/recv_backward", "control", _backward_control)
_STATIC = {"shape": X, "dtype": torch.float64}
CASES.add(
    "p2p_static_shape_mismatch",
    2,
    "send_forward/recv_forward",
    "shape",
    lambda: _fwd(_STATIC, {"shape": (3, 2), "dtype": torch.float64}),
)
CASES.add(
    "p2p_static_numel_mismatch",
    2,
    "send_forward/recv_forward",
    "shape",
    lambda: _fwd(_STATIC, {"shape": (2, 4), "dtype": torch.float64}),
)
CASES.add(
    "p2p_static_dtype_mismatch",
    2,
    "send_forward/recv_forward",
    "dtype",
    lambda: _fwd(_STATIC, {"shape": X, "dtype": torch.float32}),
)
CASES.add(
    "p2p_sender_tensor_not_its_declaration",
    2,
    "send_forward",
    "shape",
    lambda: _fwd({"shape": (4, 3), "dtype": torch.float64}, {"shape": (4, 3), "dtype": torch.float64}),
)
CASES.add("p2p_static_vs_dynamic", 2, "send_forward/recv_forward", "arg", lambda: _fwd(_STATIC, {}))
CASES.add("p2p_dynamic_vs_static", 2, "send_forward/recv_forward", "arg", lambda: _fwd({}, _STATIC))
CASES.add("p2p_batched_vs_ordered", 2, "send_forward/recv_forward", "arg", lambda: _fwd({"batched": True}, {}))
CASES.add("p2p_recv_static_without_dtype", 2, "recv_forward", "arg", lambda: _fwd(_STATIC, {"shape": X}))
CASES.add("p2p_send_not_a_tensor", 2, "send_forward", "local", lambda: _send_not_tensor())


def _send_not_tensor():
    g = world()
    if rank() == 0:
        send_forward([1.0, 2.0], g)
        return 0, 0
    return recv_forward(g), None


def _both(fn0, fn1):
    g = world()
    (fn0 if rank() == 0 else fn1)(g)
    return None, None


CASES.add(
    "p2p_both_stages_send",
    2,
    "send_forward/send_backward",
    "op",
    lambda: _both(lambda g: send_forward(coords(*X), g), lambda g: send_backward(coords(*X), g)),
)
CASES.add(
    "p2p_both_stages_receive",
    2,
    "recv_forward/recv_backward",
    "op",
    lambda: _both(lambda g: recv_forward(g), lambda g: recv_backward(g)),
)
CASES.add(
    "p2p_wrong_direction",
    2,
    "send_forward/recv_backward",
    "op",
    lambda: _both(lambda g: send_forward(coords(*X), g), lambda g: recv_backward(g)),
)
CASES.add(
    "p2p_last_stage_sends_forward",
    2,
    "send_forward",
    "arg",
    lambda: _both(lambda g: recv_forward(g), lambda g: send_forward(coords(*X), g)),
)
