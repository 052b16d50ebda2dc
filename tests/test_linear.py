import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ground_truth import assert_matches_loop, sum_of_outputs


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), d=st.integers(1, 6), p=st.integers(1, 6),
       leading=st.lists(st.integers(1, 3), max_size=2), bias=st.booleans(),
       loss_type=st.sampled_from(["mean", "sum"]))
def test_linear_any_leading_dims(batch, d, p, leading, bias, loss_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, p, bias=bias), nn.Tanh(), nn.Linear(p, 3, bias=bias))
    assert_matches_loop(model, [torch.randn(batch, *leading, d)], loss_type=loss_type)


def test_seed_003_mlp_sum_of_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 10))
    assert_matches_loop(model, [torch.randn(16, 10)], sum_of_outputs, loss_type="sum")


class Reused(nn.Module):
    """One Linear applied three times, once on a transformed input: contributions add up."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.lin(h) + self.lin(x * 2)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_reuse_sums_contributions(loss_type):
    torch.manual_seed(0)
    assert_matches_loop(Reused(), [torch.randn(6, 3, 4)], loss_type=loss_type)


def test_frozen_parameters_get_no_grad1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    assert_matches_loop(model, [torch.randn(7, 5)])


def test_inplace_relu_after_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    assert_matches_loop(model, [torch.randn(7, 5)])


def test_unused_branch_gets_zero_grad1():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            self.unused(x)
            return self.used(x)

    assert_matches_loop(TwoHeads(), [torch.randn(4, 3)])


def test_batch_dim_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    assert_matches_loop(model, [torch.randn(6, 4, 5)], batch_dim=1,
                        loss_fn=lambda out: (out.movedim(1, 0) ** 2).flatten(1).sum(1))
