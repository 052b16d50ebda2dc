from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, sum_of_outputs
from per_sample_hooks.rules import conv as conv_rule

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
PADDING_MODES = ["zeros", "reflect", "replicate", "circular"]


@st.composite
def conv_setups(draw, dims):
    """A convolution with every option drawn, and an input size it accepts."""
    groups = draw(st.sampled_from([1, 2, 3]))
    in_channels = groups * draw(st.integers(1, 2))
    out_channels = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 4 if dims < 3 else 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = 1 if kind == "same" else tuple(draw(st.integers(1, 3)) for _ in range(dims))
    if kind == "int":
        padding = draw(st.integers(0, 2))
        pads = [(padding, padding)] * dims
    elif kind == "tuple":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
        pads = [(p, p) for p in padding]
    elif kind == "same":
        padding = "same"
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pads = [(t // 2, t - t // 2) for t in totals]
    else:
        padding, pads = "valid", [(0, 0)] * dims
    padding_mode = draw(st.sampled_from(PADDING_MODES))
    sizes = []
    for (left, right), k, d in zip(pads, kernel, dilation):
        smallest = max(1, d * (k - 1) + 1 - left - right, max(left, right) + 1)
        sizes.append(draw(st.integers(smallest, smallest + (3 if dims < 3 else 1))))
    conv = CONVS[dims](in_channels, out_channels, kernel, stride=stride, padding=padding,
                       dilation=dilation, groups=groups, bias=draw(st.booleans()),
                       padding_mode=padding_mode)
    batch = draw(st.integers(1, 3))
    return conv, (batch, in_channels, *sizes)


def forced_method(grouped):
    """Force the grouped-convolution method (True) or im2col + GEMM (False) on every shape."""
    return mock.patch.object(conv_rule, "prefers_grouped_convolution", lambda module: grouped)


@pytest.mark.parametrize("grouped", [False, True], ids=["im2col", "grouped"])
@pytest.mark.parametrize("dims", [1, 2, 3])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), loss_type=st.sampled_from(["mean", "sum"]))
def test_conv_every_option(grouped, dims, data, loss_type):
    conv, shape = data.draw(conv_setups(dims))
    torch.manual_seed(0)
    with forced_method(grouped):
        assert_matches_loop(nn.Sequential(conv, nn.Tanh()), [torch.randn(shape)],
                            loss_type=loss_type)


class ReusedWide3d(nn.Module):
    """A 3d conv with 8 input channels per group (the grouped method), called twice."""

    def __init__(self, groups):
        super().__init__()
        self.conv = nn.Conv3d(16, 16, 3, padding=1, stride=(1, 2, 1), groups=groups,
                              padding_mode="replicate")

    def forward(self, x):
        return self.conv(torch.tanh(self.conv(x)))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_conv3d_many_channels_uses_grouped_method(groups, loss_type):
    model = ReusedWide3d(groups)
    assert conv_rule.prefers_grouped_convolution(model.conv)
    assert not conv_rule.prefers_grouped_convolution(nn.Conv2d(64, 64, 3))
    torch.manual_seed(0)
    assert_matches_loop(model, [torch.randn(2, 16, 3, 4, 3)], loss_type=loss_type)


class KeywordInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x):
        return self.conv(input=x)


def test_input_passed_by_keyword():
    torch.manual_seed(0)
    assert_matches_loop(KeywordInput(), [torch.randn(3, 2, 5, 5)])


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("multiplier", [1, 3])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_depthwise_with_channel_multiplier(dims, multiplier, loss_type):
    torch.manual_seed(0)
    conv = CONVS[dims](4, 4 * multiplier, 3, padding=1, groups=4)
    assert_matches_loop(nn.Sequential(conv, nn.Tanh()), [torch.randn(3, 4, *[5] * dims)],
                        loss_type=loss_type)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("padding_mode", PADDING_MODES)
def test_same_even_kernel_asymmetric_padding(dims, padding_mode):
    torch.manual_seed(0)
    conv = CONVS[dims](2, 3, 4, padding="same", dilation=1, padding_mode=padding_mode)
    assert_matches_loop(nn.Sequential(conv, nn.Tanh()), [torch.randn(2, 2, *[5] * dims)])


class Reused(nn.Module):
    """One conv applied three times, once on a transformed input: contributions add up."""

    def __init__(self, dims):
        super().__init__()
        self.conv = CONVS[dims](3, 3, 3, padding=1, padding_mode="reflect", groups=3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        return self.conv(h) + self.conv(x * 2)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_reuse_sums_contributions(dims, loss_type):
    torch.manual_seed(0)
    assert_matches_loop(Reused(dims), [torch.randn(3, 3, *[4] * dims)], loss_type=loss_type)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_frozen_parameter_gets_no_grad1(frozen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2), nn.ReLU(), nn.Conv2d(4, 3, 2))
    getattr(model[0], frozen).requires_grad_(False)
    got = assert_matches_loop(model, [torch.randn(3, 2, 7, 7)])
    kept = "bias" if frozen == "weight" else "weight"
    assert f"0.{frozen}" not in got and f"0.{kept}" in got


class SeedCNNWithLoss(nn.Module):
    """The CNN of seed 001 with its cross-entropy per sample, so the loop can feed targets."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x, targets):
        return nn.functional.cross_entropy(self.net(x), targets, reduction="none")


def test_seed_001_cnn_cross_entropy():
    torch.manual_seed(0)
    inputs = [torch.randn(3, 1, 28, 28), torch.tensor([3, 1, 7])]
    assert_matches_loop(SeedCNNWithLoss(), inputs, lambda losses: losses)


def test_channels_last_input_and_inplace_relu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(4, 2, 3, stride=2))
    x = torch.randn(3, 3, 6, 6).double().to(memory_format=torch.channels_last)
    assert_matches_loop(model, [x], sum_of_outputs, loss_type="sum")


def test_unbatched_input_is_refused():
    conv = nn.Conv2d(2, 3, 3)
    with psh.add_hooks(conv):
        conv(torch.randn(2, 5, 5)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="batched input"):
            psh.compute_grad1(conv)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_patches_reproduce_the_forward_in_weight_layout(dims):
    """patches @ weight_group^T is the convolution: the unfolded form matches the layout."""
    torch.manual_seed(0)
    conv = CONVS[dims](6, 4, 3, stride=2, padding=2, dilation=2, groups=2,
                       padding_mode="circular").double()
    x = torch.randn(2, 6, *[7] * dims, dtype=torch.float64)
    y = conv(x)
    patches = psh.conv_patches(conv, x)
    groups, per_group = conv.groups, conv.out_channels // conv.groups
    assert patches.shape == (2, groups, y[0, 0].numel(), 3 * 3 ** dims)
    weight = conv.weight.reshape(groups, per_group, -1)
    rebuilt = torch.einsum("bgtk,gok->bgot", patches, weight).reshape(y.shape[:2] + (-1,))
    torch.testing.assert_close(rebuilt + conv.bias[:, None], y.flatten(2))
    grads = psh.conv_output_grads(conv, y)
    assert grads.shape == (2, groups, y[0, 0].numel(), per_group)
    torch.testing.assert_close(grads.transpose(2, 3).reshape(y.shape), y)


def test_patch_chunks_cover_the_batch(monkeypatch):
    """Several chunks of samples (tiny chunk size) give the same exact result."""
    monkeypatch.setattr(conv_rule, "PATCH_CHUNK_ELEMENTS", 50)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Tanh(), nn.Conv2d(4, 2, 2))
    assert_matches_loop(model, [torch.randn(5, 2, 6, 6)])


def test_buffers_reused_across_steps_and_smaller_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh()).double()
    with psh.add_hooks(model):
        for batch in (4, 4, 2):
            x = torch.randn(batch, 2, 5, 5, dtype=torch.float64)
            model.zero_grad()
            model(x).sum().backward()
            psh.compute_grad1(model, loss_type="sum")
            for p in model.parameters():
                assert p.grad1.shape == (batch, *p.shape)
                torch.testing.assert_close(p.grad1.sum(0), p.grad)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_weight_factors_give_per_sample_gradients(dims):
    """left^T @ right per sample and group, viewed as the weight, is the loop's gradient."""
    torch.manual_seed(0)
    conv = CONVS[dims](6, 4, 2, stride=2, padding=1, groups=2, padding_mode="reflect").double()
    x = torch.randn(3, 6, *[4] * dims, dtype=torch.float64)
    y = conv(x)
    grad_output = torch.randn_like(y)
    left, right = psh.conv_weight_factors(conv, x, grad_output)
    per_sample = torch.einsum("bgtp,bgtq->bgpq", left, right).reshape(3, *conv.weight.shape)
    for b in range(3):
        expected, = torch.autograd.grad(conv(x[b:b + 1]), conv.weight, grad_output[b:b + 1])
        torch.testing.assert_close(per_sample[b], expected)
