import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop
from per_sample_hooks.rules import conv as conv_rule

TRANSPOSED = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def output_extent(size, kernel, stride, padding, dilation, output_padding=0):
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


@st.composite
def transposed_setups(draw, dims):
    """A transposed convolution with every option drawn, and an input size it accepts."""
    groups = draw(st.sampled_from([1, 2, 3]))
    in_channels = groups * draw(st.integers(1, 2))
    out_channels = groups * draw(st.integers(1, 2))
    kernel, stride, padding, dilation, output_padding, sizes = [], [], [], [], [], []
    for _ in range(dims):
        k, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
        p = draw(st.integers(0, 2))
        op = draw(st.integers(0, max(s, d) - 1))
        size = draw(st.integers(1, 4 if dims < 3 else 3))
        assume(output_extent(size, k, s, p, d, op) >= 1)
        for values, value in zip((kernel, stride, padding, dilation, output_padding, sizes),
                                 (k, s, p, d, op, size)):
            values.append(value)
    conv = TRANSPOSED[dims](in_channels, out_channels, kernel, stride=stride, padding=padding,
                            output_padding=output_padding, dilation=dilation, groups=groups,
                            bias=draw(st.booleans()))
    batch = draw(st.integers(1, 3))
    return conv, (batch, in_channels, *sizes)


@pytest.mark.parametrize("dims", [1, 2, 3])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), loss_type=st.sampled_from(["mean", "sum"]))
def test_conv_transpose_every_option(dims, data, loss_type):
    conv, shape = data.draw(transposed_setups(dims))
    torch.manual_seed(0)
    assert_matches_loop(nn.Sequential(conv, nn.Tanh()), [torch.randn(shape)], loss_type=loss_type)


class Upsample(nn.Module):
    """A transposed conv called with an explicit ``output_size`` (as in a U-Net decoder)."""

    def __init__(self, dims, output_size):
        super().__init__()
        self.up = TRANSPOSED[dims](4, 2, 3, stride=3, padding=1, groups=2)
        self.output_size = output_size

    def forward(self, x):
        return torch.tanh(self.up(x, output_size=self.output_size))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("extra", [0, 1, 2])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_explicit_output_size(dims, extra, loss_type):
    torch.manual_seed(0)
    size = output_extent(3, 3, 3, 1, 1) + extra
    model = Upsample(dims, [size] * dims)
    assert_matches_loop(model, [torch.randn(2, 4, *[3] * dims)], loss_type=loss_type)


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 3, 2, stride=2, groups=3)

    def forward(self, x):
        return self.up(torch.tanh(self.up(x))).mean((2, 3)) + self.up(x * 2).mean((2, 3))


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_reuse_sums_contributions(loss_type):
    torch.manual_seed(0)
    assert_matches_loop(Reused(), [torch.randn(3, 3, 3, 3)], loss_type=loss_type)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_frozen_parameter_gets_no_grad1(frozen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(2, 4, 3, stride=2), nn.ReLU(),
                          nn.ConvTranspose2d(4, 1, 2))
    getattr(model[0], frozen).requires_grad_(False)
    got = assert_matches_loop(model, [torch.randn(3, 2, 3, 3)])
    kept = "bias" if frozen == "weight" else "weight"
    assert f"0.{frozen}" not in got and f"0.{kept}" in got


def test_generator_like_stack():
    """A DCGAN-style decoder: conv transposes with stride 2, padding 1, output_padding 1."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(6, 3, 3, stride=2, padding=1, output_padding=1), nn.Tanh())
    assert_matches_loop(model, [torch.randn(4, 4, 2, 2)])


def test_patch_chunks_cover_the_batch(monkeypatch):
    monkeypatch.setattr(conv_rule, "PATCH_CHUNK_ELEMENTS", 40)
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose1d(2, 4, 3, stride=2, groups=2), nn.Tanh())
    assert_matches_loop(model, [torch.randn(5, 2, 4)])


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_unfolded_form_gives_the_weight_gradient(dims):
    """inputs^T @ patches per group is the summed weight gradient, in the weight's layout."""
    torch.manual_seed(0)
    conv = TRANSPOSED[dims](4, 6, 3, stride=2, padding=1, output_padding=1, dilation=1,
                            groups=2).double()
    x = torch.randn(2, 4, *[3] * dims, dtype=torch.float64)
    y = conv(x)
    grad_output = torch.randn_like(y)
    y.backward(grad_output)
    inputs = psh.conv_transpose_inputs(conv, x)
    patches = psh.conv_transpose_patches(conv, grad_output, x.shape[2:])
    assert inputs.shape == (2, 2, 3 ** dims, 2)
    assert patches.shape == (2, 2, 3 ** dims, 3 * 3 ** dims)
    per_sample = torch.einsum("bgti,bgtk->bgik", inputs, patches)
    torch.testing.assert_close(per_sample.sum(0).reshape(conv.weight.shape), conv.weight.grad)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_weight_factors_give_per_sample_gradients(dims):
    """left^T @ right per sample and group, viewed as the weight, is the loop's gradient."""
    torch.manual_seed(0)
    conv = TRANSPOSED[dims](4, 6, 3, stride=2, padding=2, output_padding=1, dilation=2,
                            groups=2).double()
    x = torch.randn(3, 4, *[3] * dims, dtype=torch.float64)
    y = conv(x)
    grad_output = torch.randn_like(y)
    left, right = psh.conv_transpose_weight_factors(conv, x, grad_output)
    per_sample = torch.einsum("bgtp,bgtq->bgpq", left, right).reshape(3, *conv.weight.shape)
    for b in range(3):
        expected, = torch.autograd.grad(conv(x[b:b + 1]), conv.weight, grad_output[b:b + 1])
        torch.testing.assert_close(per_sample[b], expected)


def test_unbatched_input_is_refused():
    conv = nn.ConvTranspose1d(2, 3, 3)
    with psh.add_hooks(conv):
        conv(torch.randn(2, 5)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="batched input"):
            psh.compute_grad1(conv)
