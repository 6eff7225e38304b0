"""The gradient norm's sums of squares (one process; the sharded and pipelined cases run in the parity tests)."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshfit.train.grad_norm import _CHUNK, clip_grad_norm, grad_squares


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        params.append(p)
    return params


def _clip(squares, max_norm: float) -> torch.Tensor:
    """One rank alone: its weighted squares are the vote's sum."""
    return clip_grad_norm(squares, max_norm, squares.weighted())


def test_the_norm_matches_fp64_over_rows_and_tails() -> None:
    torch.manual_seed(0)
    # Several rows plus a tail, a tensor shorter than one row, and a 2-D weight.
    grads = [torch.randn(3 * _CHUNK + 123), torch.randn(77), torch.randn(300, 1000)]
    exact = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    total = _clip(grad_squares(_params(*grads)), max_norm=0.0)
    assert abs(float(total) - exact) / exact < 1e-6


def test_a_long_tensor_stays_accurate_where_one_fp32_norm_drifts() -> None:
    torch.manual_seed(0)
    grad = torch.rand(40 * 2**20) * 1e-3  # positive values: every rounding error has the same sign
    exact = float(grad.double().square().sum().sqrt())
    single = float(torch.linalg.vector_norm(grad))
    ours = float(_clip(grad_squares(_params(grad)), max_norm=0.0))
    assert abs(ours - exact) / exact < 1e-6
    assert abs(single - exact) / exact > 10 * abs(ours - exact) / exact


def test_16_bit_gradients_accumulate_in_fp32() -> None:
    torch.manual_seed(0)
    grad = torch.randn(5 * _CHUNK).bfloat16()
    exact = float(grad.double().square().sum().sqrt())
    assert abs(float(_clip(grad_squares(_params(grad)), max_norm=0.0)) - exact) / exact < 1e-5


def test_clipping_scales_every_gradient_by_one_coefficient() -> None:
    a, b = torch.full((10,), 3.0), torch.full((2 * _CHUNK,), 4.0)
    params = _params(a.clone(), b.clone())
    norm = float((a.square().sum() + b.square().sum()).sqrt())
    total = _clip(grad_squares(params), max_norm=1.0)
    assert abs(float(total) - norm) / norm < 1e-6
    for p, before in zip(params, (a, b), strict=True):
        torch.testing.assert_close(p.grad, before / norm, rtol=1e-5, atol=0)


def test_reading_the_coefficient_gives_the_same_gradients_and_norm() -> None:
    # Below max_norm the read-back path skips multiplying by 1; above it, it scales as the other path does.
    torch.manual_seed(0)
    for max_norm in (1e6, 0.5):
        grads = [torch.randn(2 * _CHUNK + 7), torch.randn(5)]
        plain, read = _params(*[g.clone() for g in grads]), _params(*[g.clone() for g in grads])
        one, other = grad_squares(plain), grad_squares(read)
        assert torch.equal(clip_grad_norm(one, max_norm, one.weighted()),
                           clip_grad_norm(other, max_norm, other.weighted(), read=True))
        for a, b, g in zip(plain, read, grads, strict=True):
            assert torch.equal(a.grad, b.grad) and torch.equal(a.grad, g) == (max_norm > 1e3)


def test_each_group_counts_once_over_the_ranks_that_hold_it() -> None:
    # A plain gradient is held whole by every rank of its pipeline stage: summed over those 4 ranks, each
    # one's share adds up to the gradient's own sum of squares.
    grad = torch.randn(3 * _CHUNK + 5)
    squares = grad_squares(_params(grad), stage_ranks=4)
    assert squares.local[0][1] == 4
    torch.testing.assert_close(4 * squares.weighted(), grad.double().square().sum(), rtol=1e-6, atol=0)


def test_a_nan_or_inf_anywhere_is_not_finite_and_finite_gradients_are() -> None:
    assert grad_squares(_params(torch.ones(2 * _CHUNK + 5), torch.ones(3))).finite()
    for where in (0, _CHUNK + 1, 2 * _CHUNK + 2):  # in a row, in another row, in the tail
        grad = torch.ones(2 * _CHUNK + 5)
        grad[where] = float("nan") if where % 2 == 0 else float("inf")
        assert not grad_squares(_params(grad, torch.ones(3))).finite()
    assert grad_squares([nn.Parameter(torch.ones(3))]).finite()  # no gradient yet


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_fixed_number_of_operators_per_tensor_whatever_its_size() -> None:
    # Dry runs (meshfit verify) take the norm of a whole model's fake gradients: per-row pieces would make
    # hundreds of thousands of fake tensors for an 8B model.
    counts = []
    for numel in (5 * _CHUNK + 3, 2**31 + 3):
        with FakeTensorMode():
            params = _params(torch.empty(numel))
            with _CountOps() as ops:
                squares = grad_squares(params)
        assert squares.local[0][0].shape == ()
        counts.append(ops.calls)
    assert counts[0] == counts[1] < 40
