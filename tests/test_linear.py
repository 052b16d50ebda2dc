import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_grads, loop_tolerance, sum_of_outputs


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


def unbatched_layers() -> dict:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.pytorch_utils import Conv1D
    return {"Linear": (nn.Linear(3, 3), [3]), "Conv1D": (Conv1D(3, 3), [3]),
            "LayerNorm": (nn.LayerNorm([2, 3]), [2, 3]), "RMSNorm": (nn.RMSNorm(3), [3]),
            "LlamaRMSNorm": (LlamaRMSNorm(3), [3])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layer", ["Linear", "Conv1D", "LayerNorm", "RMSNorm", "LlamaRMSNorm"])
def test_an_input_without_batch_dim_is_refused_and_the_next_step_is_exact(layer, dtype):
    """A layer that works on the last dims, given only those (torch runs it as one unbatched
    sample), is refused naming it (it was a reshape error, "shape '[3, -1, 3]' is invalid");
    the next, batched step is exact."""
    torch.manual_seed(0)
    module, shape = unbatched_layers()[layer]
    model = nn.Sequential(module).to(dtype)
    x = torch.randn(4, *shape, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], sum_of_outputs, 4)
    with psh.add_hooks(model):
        model(x[0]).pow(2).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'0' .* without a batch dim"):
            psh.compute_grad1(model)
        model.zero_grad()
        sum_of_outputs(model(x)).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))
