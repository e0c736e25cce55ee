"""LossScale: the pipeline's last-stage loss, bound to its model after the stage is built."""

import pytest
import torch

from shardkit import ShardkitError
from shardkit.train.trainer import LossScale


class _Task:
    def loss_sum(self, logits, labels, pm):
        return (logits - labels).sum() * pm["weight"]


def test_bound_loss_uses_the_model_and_the_scale():
    loss = LossScale(_Task())
    with pytest.raises(ShardkitError, match="no model bound"):
        loss(torch.ones(2), torch.zeros(2))
    loss.bind({"weight": 3.0})
    loss.scale = 0.5
    assert loss(torch.ones(2), torch.zeros(2)).item() == 3.0


def test_the_old_holder_list_still_works_and_warns():
    holder: list = [None]
    with pytest.warns(DeprecationWarning, match=r"LossScale\(task\) and loss.bind\(pm\)"):
        loss = LossScale(_Task(), holder)
    holder[0] = {"weight": 2.0}  # filled after the stage is built, as before
    assert loss(torch.ones(3), torch.zeros(3)).item() == 6.0
