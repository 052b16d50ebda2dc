from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import assert_norms_match, hooked_backward
from test_conv import Reused as ReusedConv
from test_conv import ReusedWide3d, SeedCNNWithLoss, conv_setups
from torch import nn

import per_sample_hooks as psh
import per_sample_hooks.norms as norms_module
from ground_truth import seeded, sum_of_outputs
from per_sample_hooks import forms
from per_sample_hooks.forms import ghost
from per_sample_hooks.quantities import norms_squared
from per_sample_hooks.rules import conv as conv_rule
from per_sample_hooks.rules.embedding import token_rows

METHODS = ["outer", "ghost", "materialize"]


@contextmanager
def chunk_elements(elements):
    """Force the ghost / materialize paths to work in chunks of this many elements."""
    old = ghost.CHUNK_ELEMENTS
    ghost.CHUNK_ELEMENTS = elements
    try:
        yield
    finally:
        ghost.CHUNK_ELEMENTS = old


def _shapes_for(method, draw):
    """(T, d, p) for which Linear's automatic choice is ``method``."""
    if method == "outer":
        return 1, draw(st.integers(1, 6)), draw(st.integers(1, 6))
    if method == "ghost":
        t = draw(st.integers(2, 3))
        return t, draw(st.integers(2 * t + 1, 8)), draw(st.integers(2 * t + 1, 8))
    t = draw(st.integers(3, 6))
    return t, draw(st.integers(1, 3)), draw(st.integers(1, 3))


@settings(max_examples=30, deadline=None)
@given(method=st.sampled_from(METHODS), data=st.data(), batch=st.integers(1, 5),
       bias=st.booleans(), loss_type=st.sampled_from(["mean", "sum"]),
       chunk=st.sampled_from([1, 7, 1 << 20]))
def test_linear_norms_each_path(method, data, batch, bias, loss_type, chunk):
    t, d, p = _shapes_for(method, data.draw)
    assert ghost.choose_method(t, d, p) == method
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, p, bias=bias), nn.Tanh(), nn.Linear(p, 2, bias=bias))
    leading = (t,) if t > 1 or data.draw(st.booleans()) else ()
    with chunk_elements(chunk):
        assert_norms_match(model, [torch.randn(batch, *leading, d)], loss_type=loss_type)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), groups=st.integers(1, 3), t=st.integers(1, 5),
       d=st.integers(1, 5), p=st.integers(1, 5), chunk=st.sampled_from([1, 5, 1 << 20]),
       block=st.sampled_from([1, 2, 3, 64]))
def test_weight_norm_methods_agree_with_materialized(batch, groups, t, d, p, chunk, block):
    torch.manual_seed(1)
    acts = torch.randn(batch, groups, t, d, dtype=torch.double)
    grads = torch.randn(batch, groups, t, p, dtype=torch.double)
    expected = torch.einsum("bgtp,bgtd->bgpd", grads, acts).flatten(1).pow(2).sum(1)
    old_block, ghost.GHOST_BLOCK = ghost.GHOST_BLOCK, block
    assert len(ghost.position_blocks(t)) == -(-t // block)
    with chunk_elements(chunk):
        for method in ["ghost", "materialize"] + (["outer"] if t == 1 else []):
            got = ghost.weight_norms_squared(acts, grads, method)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    ghost.GHOST_BLOCK = old_block
    bias = ghost.bias_norms_squared(grads)
    torch.testing.assert_close(bias, grads.sum(2).flatten(1).pow(2).sum(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["ghost", "materialize"])
def test_weight_norms_of_no_positions_are_zero(method, dtype):
    """T = 0 (an empty sequence): zeros from every method (the ghost norm's row of Gram
    blocks is empty)."""
    acts, grads = torch.randn(3, 2, 0, 4, dtype=dtype), torch.randn(3, 2, 0, 5, dtype=dtype)
    got = ghost.weight_norms_squared(acts, grads, method)
    torch.testing.assert_close(got, torch.zeros(3, dtype=dtype), rtol=0, atol=0)


def test_seed_003_mlp_sum_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 10))
    assert_norms_match(model, [torch.randn(16, 10)], sum_of_outputs, loss_type="sum")


class Reused(nn.Module):
    """One Linear applied three times: the norm of the summed contribution (cross terms)."""

    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(self.lin(h) + self.lin(x * 2))


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(6, 4), (6, 3, 4), (5, 2, 8)])
def test_reuse_includes_cross_terms(loss_type, shape):
    torch.manual_seed(0)
    total = assert_norms_match(Reused(shape[-1]), [torch.randn(*shape)], loss_type=loss_type)
    assert total.shape == (shape[0],)


def test_reuse_differs_from_sum_of_norms():
    """Guard that the reuse test can fail: summing per-call norms gives another number."""
    torch.manual_seed(0)
    model = Reused().double()
    x = torch.randn(5, 4, dtype=torch.double)
    hooked_backward(model, [x])
    total = psh.compute_norms(model, per_param=True)["lin.weight"]
    state = psh.add_hooks(model)
    calls = state.calls[model.lin]
    rule = state.rules[model.lin]
    separate = sum(norms_squared(rule, model.lin, [c], 5.0, ["weight"])["weight"].sqrt()
                   for c in calls)
    psh.remove_hooks(model)
    assert not torch.allclose(total, separate)


def test_frozen_parameters_are_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    assert_norms_match(model, [torch.randn(7, 5)])
    model = model.double()
    hooked_backward(model, [torch.randn(7, 5, dtype=torch.double)])
    assert set(psh.compute_norms(model, per_param=True)) == {"0.weight", "2.bias"}
    psh.remove_hooks(model)


def test_unused_branch_has_zero_norm():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            self.unused(x)
            return self.used(x)

    model = TwoHeads().double()
    hooked_backward(model, [torch.randn(4, 3, dtype=torch.double)])
    norms = psh.compute_norms(model, per_param=True)
    psh.remove_hooks(model)
    assert torch.equal(norms["unused.weight"], torch.zeros(4, dtype=torch.double))
    torch.manual_seed(0)
    assert_norms_match(TwoHeads(), [torch.randn(4, 3)])


def test_batch_dim_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 4, 5, dtype=torch.double)
    hooked_backward(model, [x], loss_fn=lambda out: (out ** 2).sum(), loss_type="sum",
                    batch_dim=1)
    norms = psh.compute_norms(model, loss_type="sum")
    psh.compute_grad1(model, loss_type="sum")
    expected = torch.cat([p.grad1.flatten(1) for p in model.parameters()], 1).norm(dim=1)
    psh.remove_hooks(model)
    assert norms.shape == (4,)
    torch.testing.assert_close(norms, expected, rtol=1e-9, atol=1e-12)


def test_default_rule_path_materializes_one_parameter():
    """A rule with only grad1 gets norms and weighted sums from the base-class defaults."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x * self.w

    registry = psh.RuleRegistry()
    registry.register(nn.Linear, psh.rules.default_registry.lookup(nn.Linear(1, 1)))

    class ScaleRule(psh.Rule):
        def grad1(self, module, calls, scale, out):
            for i, call in enumerate(calls):
                g = (call.backprop() * call.activation()).flatten(1, -2).sum(1) * scale
                out["w"].copy_(g) if i == 0 else out["w"].add_(g)

    registry.register(Scale, ScaleRule())
    torch.manual_seed(0)
    model = nn.Sequential(Scale(), nn.Linear(3, 2)).double()
    x = torch.randn(5, 2, 3, dtype=torch.double)
    psh.add_hooks(model, registry=registry)
    model(x).pow(2).sum().backward()
    norms = psh.compute_norms(model, loss_type="sum", per_param=True)
    psh.compute_grad1(model, loss_type="sum")
    for name, p in model.named_parameters():
        torch.testing.assert_close(norms[name], p.grad1.flatten(1).norm(dim=1))
    psh.remove_hooks(model)


def test_without_backward_raises():
    model = nn.Linear(3, 2)
    psh.add_hooks(model)
    with torch.no_grad():
        model(torch.randn(4, 3))
    with pytest.raises(psh.PerSampleHooksError, match="backward"):
        psh.compute_norms(model)
    psh.remove_hooks(model)


def test_non_finite_norms_name_the_samples():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    psh.add_hooks(model)
    x = torch.randn(5, 3)
    x[3, 0] = float("inf")
    model(x).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match=r"indices 3\b"):
        psh.compute_norms(model)
    psh.remove_hooks(model)


# ---- convolutions: the Linear paths per group on the unfolded form ----

CONV_PATHS = {  # (conv, input shape) whose single call takes the named path
    "outer": (lambda: nn.Conv2d(2, 3, 3), (3, 2, 3, 3)),
    "ghost": (lambda: nn.Conv2d(3, 8, 3, groups=1), (3, 3, 4, 4)),
    "ghost-groups": (lambda: nn.Conv1d(4, 8, 5, groups=2, padding=1), (3, 4, 4)),
    "materialize": (lambda: nn.Conv2d(2, 2, 2, stride=1, padding=1, padding_mode="reflect"),
                    (3, 2, 5, 5)),
    "materialize-depthwise": (lambda: nn.Conv2d(3, 6, 3, groups=3, dilation=2), (2, 3, 7, 7)),
}


def _conv_method(conv, shape):
    out = conv(torch.randn(shape))
    positions = out[0, 0].numel()
    return ghost.choose_method(positions, conv.weight[0].numel(), conv.out_channels // conv.groups)


@pytest.mark.parametrize("path", CONV_PATHS)
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 1 << 20])
def test_conv_norms_each_path(path, loss_type, chunk):
    make, shape = CONV_PATHS[path]
    torch.manual_seed(0)
    conv = make()
    assert _conv_method(conv, shape) == path.split("-")[0]
    old = conv_rule.PATCH_CHUNK_ELEMENTS
    conv_rule.PATCH_CHUNK_ELEMENTS = chunk
    try:
        with chunk_elements(chunk):
            assert_norms_match(nn.Sequential(conv, nn.Tanh()), [torch.randn(shape)],
                               loss_type=loss_type)
    finally:
        conv_rule.PATCH_CHUNK_ELEMENTS = old


@pytest.mark.parametrize("groups", [1, 2])
def test_wide_3d_conv_keeps_gradients_of_its_grouped_method(groups, monkeypatch):
    """A 3d conv whose grad1 is the grouped convolution writes the per-sample gradients its
    norms keep for clipping with that grad1 (not the forms' patches), exactly."""
    grouped = []
    method = conv_rule.add_grouped_conv_weight_grads
    monkeypatch.setattr(conv_rule, "add_grouped_conv_weight_grads",
                        lambda *args: grouped.append(1) or method(*args))
    monkeypatch.setattr(norms_module, "KEEP_FRACTION", 100.0)  # keep everything
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 4, 3, dtype=torch.double)
    model = ReusedWide3d(groups).double()
    hooked_backward(model, [x])
    psh.compute_norms(model)
    psh.remove_hooks(model)
    assert grouped
    assert_norms_match(model, [x])


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dims=st.sampled_from([1, 2]), loss_type=st.sampled_from(["mean", "sum"]))
def test_conv_norms_every_option(data, dims, loss_type):
    conv, shape = data.draw(conv_setups(dims))
    torch.manual_seed(0)
    assert_norms_match(nn.Sequential(conv, nn.Tanh()), [torch.randn(shape)],
                       loss_type=loss_type)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_conv_reuse(loss_type):
    torch.manual_seed(0)
    assert_norms_match(ReusedConv(2), [torch.randn(3, 3, 4, 4)], loss_type=loss_type)


def test_seed_001_cnn():
    torch.manual_seed(0)
    inputs = [torch.randn(3, 1, 28, 28), torch.tensor([3, 1, 7])]
    assert_norms_match(SeedCNNWithLoss(), inputs, lambda losses: losses)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 4), t=st.integers(1, 6), vocab=st.integers(1, 5),
       d=st.integers(1, 4), padding=st.booleans())
def test_embedding_rows_norms_and_weighted_sum_against_dense(batch, t, vocab, d, padding):
    torch.manual_seed(2)
    tokens = torch.randint(vocab, (batch, t))
    grads = torch.randn(batch, t, d, dtype=torch.double)
    padding_idx = 0 if padding else None
    one_hot = torch.nn.functional.one_hot(tokens, vocab).double()
    if padding:
        one_hot[..., 0] = 0
    dense = torch.einsum("btv,btd->bvd", one_hot, grads)  # per-sample table gradients
    rows = [token_rows(tokens, grads, padding_idx, vocab)]  # the Embedding rule's form
    got = forms.norms_squared(rows, batch)
    torch.testing.assert_close(got, dense.flatten(1).pow(2).sum(1), rtol=1e-10, atol=1e-12)
    weights = torch.rand(batch, dtype=torch.double)
    out = torch.full((vocab, d), float("nan"), dtype=torch.double)
    forms.weighted_sum(out, rows, weights)
    torch.testing.assert_close(out, torch.einsum("b,bvd->vd", weights, dense))


def _cancelling_positions(rel: float, dtype: torch.dtype, batch=4, positions=64, width=256,
                          vocab=8):
    """Inputs ``[B, T, d]`` of repeated tokens and output gradients ``[B, T, p]`` whose sum over
    each token's positions is ``rel`` of its parts, in sample 0 (a model near its minimum): its
    weight gradient ``G^T A`` is ``rel`` of what unrelated positions give."""
    g = seeded(5)
    tokens = torch.randint(vocab, (batch, positions), generator=g)
    x = torch.randn(vocab, width, generator=g, dtype=torch.float64)[tokens]
    grads = torch.randn(batch, positions, width, generator=g, dtype=torch.float64)
    for v in range(vocab):
        at = (tokens[0] == v).nonzero().flatten()
        grads[0, at] -= grads[0, at].mean(0) * (1 - rel)
    return x.to(dtype), grads.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rel", [1e-2, 1e-4, 1e-5])
def test_ghost_norms_of_positions_that_cancel(rel, dtype):
    """The ghost norm adds ``T^2`` products of either sign: where a sample's positions cancel,
    it was mostly rounding in float32 (1.3% off at 1e-3, negative, a NaN norm, at 1e-4; a
    clipping that left the sample above ``max_grad_norm``) and in bfloat16 (20-130% off at
    1e-2): such samples are recomputed, and bfloat16 forms widened. Against float64."""
    from per_sample_hooks.forms.ghost import choose_method
    x, grads = _cancelling_positions(rel, dtype)
    assert choose_method(x.shape[1], x.shape[2], grads.shape[2]) == "ghost"
    layer = nn.Linear(256, 256, bias=False).to(dtype)
    psh.add_hooks(layer)
    (layer(x) * grads).sum().backward()
    norms = psh.compute_norms(layer, loss_type="sum")
    truth = torch.einsum("btp,btd->bpd", grads.double(), x.double()).flatten(1).norm(dim=1)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(norms.double(), truth, rtol=tolerance, atol=0)
    psh.remove_hooks(layer)


@pytest.mark.parametrize("rel", [1e-3, 1e-5])
def test_tied_uses_whose_gradients_cancel(rel):
    """A table used by an Embedding and a Linear (tied) whose two gradients nearly cancel:
    their norms plus twice their inner product was mostly rounding (10% off at 1e-3, 0 or NaN
    at 1e-5); such samples are materialized. float32 against float64."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(6, 8)
            self.head = nn.Linear(8, 6, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids, h):
            return self.embed(ids), self.head(h)

    model = Tied()
    ids = torch.randint(6, (3, 5))
    h = torch.randn(3, 5, 8)
    emb_out, head_out = model(ids, h)
    head_grad = torch.randn(3, 5, 6)
    # the embedding's gradient: minus the head's, plus rel of it
    head_part = torch.einsum("btv,btd->bvd", head_grad, h)
    emb_grad = torch.zeros(3, 5, 8)
    for b in range(3):  # spread -(1 - rel) * head_part[b] over the sample's tokens
        for v in range(6):
            at = (ids[b] == v).nonzero().flatten()
            if len(at):
                emb_grad[b, at] = -(1 - rel) * head_part[b, v] / len(at)
    del emb_out, head_out
    psh.add_hooks(model)
    emb_out, head_out = model(ids, h)
    ((emb_out * emb_grad).sum() + (head_out * head_grad).sum()).backward()
    norms = psh.compute_norms(model, loss_type="sum")
    psh.compute_grad1(model, loss_type="sum")
    truth = model.embed.weight.grad1.double().flatten(1).norm(dim=1)
    psh.remove_hooks(model)
    expected = torch.stack([(torch.zeros(6, 8, dtype=torch.float64).index_add_(
        0, ids[b], emb_grad[b].double()) + torch.einsum("tv,td->vd", head_grad[b].double(),
                                                         h[b].double())).norm()
        for b in range(3)])
    torch.testing.assert_close(truth, expected, rtol=1e-3, atol=0)  # (grad1: materialized)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-3, atol=0)
