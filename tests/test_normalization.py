"""Normalization layers against the float64 per-sample loop: LayerNorm, RMSNorm, GroupNorm,
InstanceNorm*d, BatchNorm*d in eval mode; BatchNorm with batch statistics refused."""
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import assert_clipping_matches, assert_norms_match, hooked_backward
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop
from per_sample_hooks.rules import default_registry, fallback, normalization

LOSS_TYPES = st.sampled_from(["mean", "sum"])


def randomize(norm: nn.Module) -> nn.Module:
    """Non-trivial affine parameters and running statistics (not 1, 0)."""
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return norm


def around(norm: nn.Module, last: int) -> nn.Module:
    """A Linear on the last dim before the norm (its input gradient matters), tanh after."""
    return nn.Sequential(nn.Linear(last, last), randomize(norm), nn.Tanh())


class Twice(nn.Module):
    """The norm applied twice in one forward: contributions add up."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = randomize(norm)

    def forward(self, x):
        return self.norm(torch.sin(self.norm(x)) * x)


def without_bias(layer: nn.Module, bias: bool) -> nn.Module:
    """``layer`` as its class's ``bias=False`` makes it (a None bias), when not ``bias``: also
    on a torch whose batch, instance and group norms take no ``bias`` argument (2.11)."""
    if not bias:
        layer.register_parameter("bias", None)
    return layer


def batch_norm(dims: int, channels: int, bias: bool = True, **options) -> nn.Module:
    return without_bias({1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](
        channels, **options), bias)


def instance_norm(dims: int, channels: int, bias: bool = True, **options) -> nn.Module:
    return without_bias({1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims](
        channels, **options), bias)


def test_rules_are_native():
    for layer in (nn.LayerNorm(3), nn.RMSNorm(3), nn.GroupNorm(1, 2), nn.InstanceNorm2d(2),
                  nn.BatchNorm1d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2)):
        rule = default_registry.lookup(layer)
        assert rule is not None and not isinstance(rule, fallback.FallbackRule), layer


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), leading=st.lists(st.integers(1, 3), max_size=2),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=2),
       affine=st.booleans(), bias=st.booleans(), rms=st.booleans(),
       eps=st.sampled_from([None, 1e-3]), loss_type=LOSS_TYPES)
def test_layer_and_rms_norm(batch, leading, shape, affine, bias, rms, eps, loss_type):
    torch.manual_seed(0)
    if rms:
        norm = nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
    else:
        norm = nn.LayerNorm(shape, eps=eps or 1e-5, elementwise_affine=affine, bias=bias)
    x = torch.randn(batch, *leading, *shape)
    assert_matches_loop(around(norm, shape[-1]), [x], loss_type=loss_type)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), groups=st.integers(1, 3), per_group=st.integers(1, 3),
       spatial=st.lists(st.integers(1, 3), max_size=2), bias=st.booleans(),
       loss_type=LOSS_TYPES)
def test_group_norm(batch, groups, per_group, spatial, bias, loss_type):
    torch.manual_seed(0)
    channels = groups * per_group
    if channels * max(1, torch.Size(spatial).numel()) == groups:  # one value per group
        spatial = [2]
    x = torch.randn(batch, channels, *spatial)
    norm = without_bias(nn.GroupNorm(groups, channels), bias)
    assert_matches_loop(around(norm, x.shape[-1]), [x], loss_type=loss_type)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), dims=st.integers(1, 3), channels=st.integers(1, 3),
       size=st.integers(2, 3), track=st.booleans(), train=st.booleans(), bias=st.booleans(),
       loss_type=LOSS_TYPES)
def test_instance_norm(batch, dims, channels, size, track, train, bias, loss_type):
    torch.manual_seed(0)
    norm = instance_norm(dims, channels, affine=True, track_running_stats=track, bias=bias)
    model = around(norm, size).train(train)
    assert_matches_loop(model, [torch.randn(batch, channels, *[size] * dims)],
                        loss_type=loss_type)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), dims=st.integers(1, 3), channels=st.integers(1, 3),
       spatial=st.integers(0, 3), bias=st.booleans(), loss_type=LOSS_TYPES)
def test_batch_norm_eval(batch, dims, channels, spatial, bias, loss_type):
    torch.manual_seed(0)
    if dims > 1:
        spatial = max(spatial, 1)
    shape = [] if dims == 1 and spatial == 0 else [spatial or 1] * dims
    norm = batch_norm(dims, channels, bias=bias)
    x = torch.randn(batch, channels, *shape)
    model = around(norm, x.shape[-1]).eval()
    assert_matches_loop(model, [x], loss_type=loss_type)


def test_sync_batch_norm_eval():
    torch.manual_seed(0)
    model = around(nn.SyncBatchNorm(3), 4).eval()
    assert_matches_loop(model, [torch.randn(5, 3, 4)])


NORMS = {
    "layer": (lambda: nn.LayerNorm(4), (3, 2, 4)),
    "layer_2d": (lambda: nn.LayerNorm((2, 4)), (3, 2, 4)),
    "layer_no_bias": (lambda: nn.LayerNorm(4, bias=False), (3, 4)),
    "rms": (lambda: nn.RMSNorm(4), (3, 2, 4)),
    "group": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    "instance1d": (lambda: nn.InstanceNorm1d(2, affine=True), (3, 2, 4)),
    "instance2d_running": (lambda: nn.InstanceNorm2d(2, affine=True, track_running_stats=True)
                           .eval(), (3, 2, 3, 4)),
    "batch1d_flat": (lambda: nn.BatchNorm1d(4).eval(), (3, 4)),
    "batch1d": (lambda: nn.BatchNorm1d(2).eval(), (3, 2, 4)),
    "batch2d": (lambda: nn.BatchNorm2d(2).eval(), (3, 2, 3, 4)),
}


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_reuse(kind, loss_type):
    torch.manual_seed(0)
    make, shape = NORMS[kind]
    assert_matches_loop(Twice(make()).train(make().training), [torch.randn(*shape)],
                        loss_type=loss_type)


@pytest.mark.parametrize("kind", list(NORMS))
def test_frozen_weight_trainable_bias(kind):
    torch.manual_seed(0)
    make, shape = NORMS[kind]
    norm = make()
    model = around(norm, shape[-1]).train(norm.training)
    norm.weight.requires_grad_(False)
    got = assert_matches_loop(model, [torch.randn(*shape)])
    assert "1.weight" not in got
    assert ("1.bias" in got) == (getattr(norm, "bias", None) is not None)


@pytest.mark.parametrize("kind", list(NORMS))
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_norms_and_clipping(kind, loss_type):
    torch.manual_seed(0)
    make, shape = NORMS[kind]
    norm = make()
    model = around(norm, shape[-1]).train(norm.training)
    x = torch.randn(*shape)
    assert_norms_match(model, [x], loss_type=loss_type)
    assert_clipping_matches(model, [x], 0.3, loss_type=loss_type)
    reused = Twice(make()).train(norm.training)
    assert_norms_match(reused, [x], loss_type=loss_type)
    assert_clipping_matches(reused, [x], 0.3, loss_type=loss_type)


def test_norms_and_clipping_frozen_weight():
    torch.manual_seed(0)
    model = around(nn.GroupNorm(2, 4), 3)
    model[1].weight.requires_grad_(False)
    x = torch.randn(4, 4, 3)
    assert_norms_match(model, [x])
    assert_clipping_matches(model, [x], 0.2)


def test_pure_functions():
    """The per-sample sums of the two layouts against their definitions."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 4, 5, 2, dtype=torch.double), torch.randn(3, 4, 5, 2,
                                                                    dtype=torch.double)
    weight, bias = normalization.sums_channels_first(x, g)
    torch.testing.assert_close(weight, torch.einsum("bc...,bc...->bc", x, g))
    torch.testing.assert_close(bias, g.sum((2, 3)))
    weight, bias = normalization.sums_channels_last(x, g, 10)
    torch.testing.assert_close(weight, (x * g).sum(1).reshape(3, 10))
    torch.testing.assert_close(bias, g.sum(1).reshape(3, 10))


# --- BatchNorm with batch statistics is refused ---------------------------------------------

def named_model(norm: nn.Module) -> nn.Module:
    """``features.1`` is the norm."""
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Linear(4, 4), norm, nn.ReLU()), head=nn.Linear(4, 2)))


def expect_refusal(model: nn.Module, x: torch.Tensor, path: str, kind: str, why: str,
                   verbs=(psh.compute_grad1, psh.compute_norms)) -> str:
    messages = []
    for verb in (*verbs, lambda m: psh.clip_grads(m, 1.0)):
        hooked_backward(model, [x])
        try:
            with pytest.raises(psh.PerSampleHooksError) as info:
                verb(model)
        finally:
            psh.remove_hooks(model)
        message = str(info.value)
        assert f"'{path}' ({kind})" in message
        assert why in message and "mix the samples" in message
        assert "model.eval()" in message and "nn.GroupNorm" in message
        messages.append(message)
    return messages[0]


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_training_is_refused(affine):
    torch.manual_seed(0)
    model = named_model(nn.BatchNorm1d(4, affine=affine)).double()
    message = expect_refusal(model, torch.randn(6, 4, dtype=torch.double), "features.1",
                             "BatchNorm1d", "training mode")
    print(message)


def test_batch_norm_without_running_stats_is_refused_in_eval():
    model = named_model(nn.BatchNorm1d(4, track_running_stats=False)).eval().double()
    expect_refusal(model, torch.randn(6, 4, dtype=torch.double), "features.1", "BatchNorm1d",
                   "track_running_stats=False")


def test_first_batch_norm_without_affine_is_refused():
    """Its output does not require grad (no call is recorded); it still mixes the samples."""
    model = nn.Sequential(OrderedDict(norm=nn.BatchNorm2d(2, affine=False),
                                      conv=nn.Conv2d(2, 3, 2))).double()
    expect_refusal(model, torch.randn(4, 2, 3, 3, dtype=torch.double), "norm", "BatchNorm2d",
                   "training mode")


def test_sync_batch_norm_training_is_refused():
    model = named_model(nn.SyncBatchNorm(4)).double()
    expect_refusal(model, torch.randn(6, 4, dtype=torch.double), "features.1", "SyncBatchNorm",
                   "training mode")


def test_batch_norm_without_affine_in_eval_is_fine():
    torch.manual_seed(0)
    model = named_model(randomize(nn.BatchNorm1d(4, affine=False))).eval()
    assert_matches_loop(model, [torch.randn(5, 4)])


def test_instance_norm_without_batch_dim_is_refused():
    model = nn.InstanceNorm1d(3, affine=True)
    psh.add_hooks(model)
    try:
        model(torch.randn(3, 5)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="without a batch dim"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)
