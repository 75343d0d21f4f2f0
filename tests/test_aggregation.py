"""The pure helpers of runtime/aggregation.py and runtime/optim.py, by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysplit.runtime.aggregation import average_optimizer_states, average_states, finish_average, weighted_sum
from raysplit.config import OptimizerConfig
from raysplit.runtime.optim import make_optimizer, round_lr


def test_average_states_weights_and_rounds_integer_buffers():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(6)}
    out = average_states([a, b], [1.0, 2.0])
    torch.testing.assert_close(out["w"], torch.tensor([3.0, 6.0]))  # (1*[1,2] + 2*[4,8]) / 3
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 5  # (3 + 12) / 3


def test_partial_sums_then_finish_equal_one_weighted_average():
    states = [{"w": torch.tensor([float(i), 2.0 * i]), "n": torch.tensor(i)} for i in range(1, 5)]
    weights = [1.0, 3.0, 2.0, 4.0]
    parts = [weighted_sum(states[:2], weights[:2]), weighted_sum(states[2:], weights[2:])]  # two workers
    packed = [{k: v.numpy() for k, v in p.items()} for p in parts]
    out = finish_average(packed, sum(weights), states[0])
    want = average_states(states, weights)
    torch.testing.assert_close(out["w"], want["w"])
    assert out["n"].dtype == torch.int64 and int(out["n"]) == int(want["n"]) == 3  # 29/10 rounds to 3


def test_optimizer_state_average_momentum_and_none_for_plain_sgd():
    def opt_with_momentum(buf):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = make_optimizer([p], OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
        p.grad = torch.tensor(buf)
        opt.step()  # first step: momentum buffer = grad
        return opt.state_dict()

    merged = average_optimizer_states([opt_with_momentum([1.0, 0.0]), opt_with_momentum([0.0, 3.0])], [3.0, 1.0])
    torch.testing.assert_close(merged["state"][0]["momentum_buffer"], torch.tensor([0.75, 0.75]))
    plain = make_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerConfig(name="sgd", lr=0.1)).state_dict()
    assert average_optimizer_states([plain, plain], [1.0, 1.0]) is None


def test_round_lr_decays_to_its_floor():
    assert [round_lr(OptimizerConfig(lr=1.0, decay=0.5, min_lr=0.2), r) for r in range(4)] == pytest.approx(
        [1.0, 0.5, 0.25, 0.2])
    assert np.isclose(round_lr(OptimizerConfig(lr=0.3), 10), 0.3)
