"""batch_hessian: per-sample Hessians [B, *S, *S] against torch.autograd.functional.hessian
run once per sample, float64."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.functional import hessian

from per_sample_hooks import batch_hessian


def looped(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.stack([hessian(fn, xi) for xi in x])


def mlp(d: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1)).double()


def test_quadratic_is_q_for_every_sample():
    """Seed 004: 0.5 x^T Q x per sample -> Q for each of the 32 samples, [32, 10, 10]."""
    torch.manual_seed(0)
    root = torch.randn(10, 10, dtype=torch.float64)
    q = root.T @ root
    x = torch.randn(32, 10, dtype=torch.float64)
    h = batch_hessian(lambda s: 0.5 * s @ q @ s, x)
    assert h.shape == (32, 10, 10)
    torch.testing.assert_close(h, q.expand(32, 10, 10))


@pytest.mark.parametrize("batched", [False, True])
def test_mlp_tanh_matches_loop(batched):
    net = mlp()
    x = torch.randn(7, 10, dtype=torch.float64)
    one = lambda s: net(s).squeeze(-1)  # noqa: E731  ([d] -> [], and [B, d] -> [B])
    h = batch_hessian(one, x, batched=batched)
    assert h.shape == (7, 10, 10)
    torch.testing.assert_close(h, looped(one, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batched", [False, True])
def test_sample_shape_kept(batched):
    """Samples [3, 4]: Hessians [B, 3, 4, 3, 4]."""
    torch.manual_seed(1)
    w = torch.randn(4, 4, dtype=torch.float64)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    if batched:
        fn = lambda b: torch.tanh(b @ w).pow(2).sum((1, 2))  # noqa: E731
    else:
        fn = lambda s: torch.tanh(s @ w).pow(2).sum()  # noqa: E731
    h = batch_hessian(fn, x, batched=batched)
    assert h.shape == (5, 3, 4, 3, 4)
    torch.testing.assert_close(h, looped(lambda s: torch.tanh(s @ w).pow(2).sum(), x))


def test_batched_fn_need_not_support_vmap():
    """batched=True calls fn on the whole batch: .item() inside is fine."""
    net = mlp(4)
    x = torch.randn(6, 4, dtype=torch.float64)

    def fn(b):
        assert b.shape[0] == 6  # the batch, not one vmapped sample
        return net(b).squeeze(-1)
    torch.testing.assert_close(batch_hessian(fn, x, batched=True),
                               looped(lambda s: net(s).squeeze(-1), x))


def test_batched_fn_must_return_one_value_per_sample():
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"must return \[B\]"):
        batch_hessian(lambda b: b.pow(2).sum(), x, batched=True)


def test_float32_close_to_float64():
    net = mlp()
    x = torch.randn(4, 10, dtype=torch.float64)
    ref = batch_hessian(lambda s: net(s).squeeze(-1), x)
    net32 = net.float()
    h = batch_hessian(lambda s: net32(s).squeeze(-1), x.float())
    assert h.dtype == torch.float32
    torch.testing.assert_close(h.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batched", [False, True])
def test_chunks_give_the_same_result(batched):
    net = mlp(3)
    x = torch.randn(7, 3, dtype=torch.float64)
    one = lambda s: net(s).squeeze(-1)  # noqa: E731
    torch.testing.assert_close(batch_hessian(one, x, batched=batched, chunk_size=3),
                               batch_hessian(one, x, batched=batched))
