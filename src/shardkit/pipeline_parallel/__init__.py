"""Pipeline parallelism: transfers between stages (this tier); schedules and stages come later.

Every function takes the pipeline group explicitly (a ``ProcessGroup``, a 1-D ``DeviceMesh``,
or a list of them for a stage with several neighbours); stage = group rank.
"""

from .p2p import (
    P2PWork,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_backward,
    send_backward_recv_forward,
    send_forward,
    send_forward_recv_backward,
    send_forward_recv_forward,
)

__all__ = [
    "P2PWork",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
]
