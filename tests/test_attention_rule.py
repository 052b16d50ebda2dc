"""The native nn.MultiheadAttention rule against the float64 per-sample loop, every option,
both ways: projections captured in the forward, and in a re-run of it."""
import copy
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from norms_truth import assert_clipping_matches, assert_norms_match
from torch import nn
from torch.overrides import TorchFunctionMode

import per_sample_hooks as psh
from ground_truth import (
    assert_matches_loop,
    hooked_grads,
    loop_grads_of,
    loop_tolerance,
    weighted_square,
)
from per_sample_hooks.quantities import weighted_sum
from per_sample_hooks.rules import attention as attention_rule
from per_sample_hooks.rules.attention import MultiheadAttentionRule, captured
from per_sample_hooks.rules.fallback import call_grad1

HEADS = "heads"  # a [B * heads, L, S] mask: sample i owns rows heads*i ... heads*i + heads - 1


class Attention(nn.Module):
    """MultiheadAttention then a Linear head; the loss may also see the attention weights."""

    def __init__(self, embed=6, heads=2, **options):
        super().__init__()
        self.attention = nn.MultiheadAttention(embed, heads, **options)
        self.head = nn.Linear(embed, 2)

    def forward(self, q, k, v, key_padding_mask=None, attn_mask=None, need_weights=True,
                average=True, is_causal=False):
        out, weights = self.attention(q, k, v, key_padding_mask=key_padding_mask,
                                      attn_mask=attn_mask, need_weights=need_weights,
                                      average_attn_weights=average, is_causal=is_causal)
        return self.head(out), weights


def attention_loss(dim, use_weights=True):
    def loss_fn(output):
        out, weights = output
        loss = weighted_square(out.movedim(dim, 0))
        return loss if weights is None or not use_weights else loss + weighted_square(weights)
    return loss_fn


def to_double(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def sample(x, spec, i, heads):
    if spec is None or not isinstance(x, torch.Tensor):
        return x
    if spec == HEADS:
        return x[heads * i: heads * (i + 1)]
    return x.narrow(spec, i, 1)


@contextmanager
def recomputing(recompute=True):
    """Models hooked inside capture nothing in the attention's forward (as under
    torch.compile): every call is captured in a re-run of it."""
    if not recompute:
        yield
        return
    with mock.patch.object(MultiheadAttentionRule, "watch", lambda *args: None):
        yield


def capture_paths(model, inputs, loss_fn, **hook_options):
    """Per attention call of one hooked forward and backward: whether its projections were
    captured (and serve its per-sample gradients)."""
    state = psh.add_hooks(model, **hook_options)
    try:
        loss_fn(model(*inputs)).sum().backward()
        return [captured(call) is not None for module, calls in state.calls.items()
                if isinstance(module, nn.MultiheadAttention) for call in calls]
    finally:
        psh.remove_hooks(model)


def assert_matches(model, inputs, specs, loss_fn, loss_type="mean", heads=2, recompute=False,
                   **hook_options):
    """``compute_grad1`` against the float64 loop; input ``j``'s samples are at ``specs[j]``
    (None: shared, HEADS: a per-sample block of rows). Also: attention handled by its rule,
    its projections captured unless ``recompute``."""
    model = model.double()
    inputs = [to_double(x) for x in inputs]
    with recomputing(recompute):
        got = hooked_grads(model, inputs, loss_fn, loss_type, **hook_options)
        paths = capture_paths(model, inputs, loss_fn, **hook_options)
    expect_captured = [not recompute for m in model.modules()
                       if isinstance(m, nn.MultiheadAttention)]
    assert paths and set(paths) == set(expect_captured)
    batch = inputs[0].shape[specs[0]]
    expected = loop_grads_of(model, ([sample(x, s, i, heads) for x, s in zip(inputs, specs)]
                                     for i in range(batch)), loss_fn)
    assert got.keys() == expected.keys()
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return got


def assert_native(model):
    """Every MultiheadAttention is hooked with its rule, as a unit; out_proj is not hooked."""
    state = psh.add_hooks(model)
    try:
        found = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        assert found
        for m in found:
            assert isinstance(state.rules[m], MultiheadAttentionRule)
            assert m in state.units and m.out_proj not in state.modules
    finally:
        psh.remove_hooks(model)


@settings(max_examples=60, deadline=None)
@given(batch_first=st.booleans(), batch=st.integers(1, 3), length=st.integers(1, 4),
       source=st.integers(1, 4), kind=st.sampled_from(["self", "cross", "kv_dims"]),
       bias=st.booleans(), add_bias_kv=st.booleans(), add_zero_attn=st.booleans(),
       mask=st.sampled_from([None, "bool", "float", "bool3", "float3", "causal"]),
       padding=st.sampled_from([None, "bool", "float"]), need_weights=st.booleans(),
       use_weights=st.booleans(), average=st.booleans(),
       loss_type=st.sampled_from(["mean", "sum"]), recompute=st.booleans())
# is_causal without need_weights: the fused path's own top-left mask also hides the appended
# bias_k from the first queries (attn_mask would not)
@example(batch_first=False, batch=2, length=1, source=1, kind="self", bias=False,
         add_bias_kv=True, add_zero_attn=False, mask="causal", padding=None, need_weights=False,
         use_weights=False, average=False, loss_type="mean", recompute=False)
def test_every_option(batch_first, batch, length, source, kind, bias, add_bias_kv,
                      add_zero_attn, mask, padding, need_weights, use_weights, average,
                      loss_type, recompute):
    torch.manual_seed(0)
    heads, embed = 2, 6
    kdim, vdim = (5, 3) if kind == "kv_dims" else (embed, embed)
    if kind == "self":
        source = length
    model = Attention(embed, heads, batch_first=batch_first, kdim=kdim, vdim=vdim, bias=bias,
                      add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    dim = 0 if batch_first else 1

    def shape(n, d):
        return (batch, n, d) if batch_first else (n, batch, d)

    q = torch.randn(shape(length, embed))
    if kind == "self":
        k = v = q
    else:
        k, v = torch.randn(shape(source, kdim)), torch.randn(shape(source, vdim))
    attn_mask, is_causal = None, False
    if mask in ("bool", "causal"):
        attn_mask = torch.rand(length, source) < 0.3
        if mask == "causal":
            attn_mask = torch.ones(length, source, dtype=torch.bool).triu(1)
            is_causal = True
        attn_mask[:, 0] = False
    elif mask == "float":
        attn_mask = torch.randn(length, source)
    elif mask == "bool3":
        attn_mask = torch.rand(batch * heads, length, source) < 0.3
        attn_mask[..., 0] = False
    elif mask == "float3":
        attn_mask = torch.randn(batch * heads, length, source)
    key_padding_mask = None
    if padding == "bool":
        key_padding_mask = torch.rand(batch, source) < 0.3
        key_padding_mask[:, 0] = False
    elif padding == "float":
        key_padding_mask = torch.randn(batch, source)
    inputs = [q, k, v, key_padding_mask, attn_mask, need_weights, average, is_causal]
    specs = [dim, dim, dim, 0, HEADS if mask in ("bool3", "float3") else None, None, None, None]
    assert_matches(model, inputs, specs, attention_loss(dim, use_weights), loss_type,
                   recompute=recompute, batch_dim={"head": dim})
    assert_native(model)


def test_self_attention_weights_unused_and_default_need_weights():
    """need_weights=True (the default) with the weights not in the loss: their captured
    gradient is absent, not the one flowing into the output through the softmax."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 4, batch_first=True)

        def forward(self, x):
            return self.attention(x, x, x, average_attn_weights=False)[0]

    assert_matches_loop(Model(), [torch.randn(4, 5, 8)])


class WeightsOnly(nn.Module):
    """Attention-map supervision: only the attention weights reach the loss."""

    def __init__(self, batch_first):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x):
        return self.attention(x, x, x, average_attn_weights=False)[1].flatten(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_first", [True, False])
def test_only_the_attention_weights_in_the_loss(batch_first, dtype):
    """The output's gradient never arrives: it raised 'stack expects a non-empty TensorList';
    now ``out_proj``'s per-sample gradients are zero and the in-projection's the loop's."""
    torch.manual_seed(0)
    model = WeightsOnly(batch_first).to(dtype)
    x = torch.randn(3, 5, 8, dtype=dtype)
    expected = loop_grads_of(copy.deepcopy(model).double(),
                             ([x[i:i + 1].double() if batch_first else
                               x[i:i + 1].double().transpose(0, 1)] for i in range(3)),
                             weighted_square)
    with psh.add_hooks(model):
        weighted_square(model(x if batch_first else x.transpose(0, 1))).mean().backward()
        psh.compute_grad1(model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))


class Reused(nn.Module):
    """One attention module called twice: self-attention, then cross-attention on memory."""

    def __init__(self, **options):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True, **options)
        self.head = nn.Linear(4, 3)

    def forward(self, x, memory):
        kv = x if x.shape[-1] == memory.shape[-1] else x[..., :memory.shape[-1]]
        h = self.attention(x, kv, kv, need_weights=False)[0]  # self-attention if it can
        out, weights = self.attention(torch.tanh(h), memory, memory)
        return self.head(out), weights


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("options", [{}, {"add_bias_kv": True, "add_zero_attn": True},
                                     {"kdim": 3, "vdim": 3, "bias": False}])
def test_module_called_twice(options, loss_type, recompute):
    torch.manual_seed(0)
    memory_dim = options.get("kdim", 4)
    inputs = [torch.randn(4, 3, 4), torch.randn(4, 5, memory_dim)]
    assert_matches(Reused(**options), inputs, [0, 0], attention_loss(0), loss_type,
                   recompute=recompute)


@pytest.mark.parametrize("frozen, bias_kv", [
    (frozen, bias_kv) for frozen in ["in_proj", "out_proj", "out_proj.bias", "bias_k",
                                     "all_but_bias_v", "all_but_bias_v_or_in_proj_bias",
                                     "separate_q_v"]
    for bias_kv in [True, False] if bias_kv or frozen not in ("bias_k", "all_but_bias_v")])
def test_frozen_parameters(frozen, bias_kv):
    torch.manual_seed(0)
    separate = frozen == "separate_q_v"
    model = Attention(4, 2, batch_first=True, add_bias_kv=bias_kv, kdim=3 if separate else None)
    attention = model.attention
    names = {"in_proj": ["in_proj_weight", "in_proj_bias"],
             "out_proj": ["out_proj.weight", "out_proj.bias"],
             "out_proj.bias": ["out_proj.bias"], "bias_k": ["bias_k"],
             "all_but_bias_v": [n for n, _ in attention.named_parameters() if n != "bias_v"],
             "all_but_bias_v_or_in_proj_bias": [n for n, _ in attention.named_parameters()
                                                if n not in ("bias_v", "in_proj_bias")],
             "separate_q_v": ["q_proj_weight", "v_proj_weight"]}[frozen]
    for n in names:
        attention.get_parameter(n).requires_grad_(False)
    q = torch.randn(3, 4, 4)
    kv = torch.randn(3, 5, 3) if separate else torch.randn(3, 5, 4)
    inputs = [q, kv, torch.randn(3, 5, 4)]
    got = assert_matches(model, inputs, [0, 0, 0], attention_loss(0))
    assert not set(names) & {n.removeprefix("attention.") for n in got}


def test_several_backward_passes_sum():
    """Two backward passes of one forward: grad1 is the per-sample gradient of their sum."""
    torch.manual_seed(0)
    model = Attention(6, 3, batch_first=True, add_zero_attn=True).double()
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    psh.add_hooks(model)
    try:
        out, weights = model(x, x, x)
        weighted_square(out).mean().backward(retain_graph=True)
        weighted_square(weights).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    params = dict(model.named_parameters())
    for i in range(3):
        out, weights = model(x[i:i + 1], x[i:i + 1], x[i:i + 1])
        loss = weighted_square(out).sum() + weighted_square(weights).sum()
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_encoder_layer(norm_first, batch_first, recompute):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                       batch_first=batch_first, norm_first=norm_first)
    batch, length = 3, 4
    src_mask = nn.Transformer.generate_square_subsequent_mask(length)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, padding):
            causal = padding is None  # with a padding mask: an explicit mask and padding
            return self.layer(x, src_mask=src_mask.to(x.dtype), src_key_padding_mask=padding,
                              is_causal=causal)

    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, -1] = True
    dim = 0 if batch_first else 1
    for pad in (None, padding):
        x = torch.randn(batch, length, 8) if batch_first else torch.randn(length, batch, 8)
        assert_matches(Model(), [x, pad], [dim, 0],
                       lambda out: weighted_square(out.movedim(dim, 0)), recompute=recompute,
                       batch_dim=dim)
    assert_native(Model())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_decoder_layer(norm_first, batch_first, recompute):
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                       batch_first=batch_first, norm_first=norm_first)
    batch, length, source = 3, 4, 5
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(length)
    memory_padding = torch.zeros(batch, source, dtype=torch.bool)
    memory_padding[0, -2:] = True

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, tgt, memory, memory_padding):
            return self.layer(tgt, memory, tgt_mask=tgt_mask.to(tgt.dtype),
                              memory_key_padding_mask=memory_padding, tgt_is_causal=True)

    dim = 0 if batch_first else 1
    shape = (lambda n: (batch, n, 8)) if batch_first else (lambda n: (n, batch, 8))
    assert_matches(Model(), [torch.randn(shape(length)), torch.randn(shape(source)),
                             memory_padding], [dim, dim, 0],
                   lambda out: weighted_square(out.movedim(dim, 0)), "sum", recompute=recompute,
                   batch_dim=dim)


class AttentionThenHead(nn.Module):
    def __init__(self, frozen=None, **options):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True, **options)
        self.head = nn.Linear(4, 3)
        for name, p in self.att.named_parameters():
            if frozen is not None and name.startswith(frozen):
                p.requires_grad_(False)

    def forward(self, x):
        out, weights = self.att(x, x, x, average_attn_weights=False)
        return self.head(out) + weights.sum((1, 3)).unsqueeze(-1)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("frozen,options", [(None, {}), ("in_proj", {}), ("out_proj", {}),
                                            (None, {"add_bias_kv": True, "kdim": 4, "vdim": 4}),
                                            (None, {"add_bias_kv": True, "kdim": 3, "vdim": 2})])
def test_norms_and_clipping(frozen, options, loss_type):
    torch.manual_seed(0)
    if options.get("kdim") == 3:  # separate projections: key and value of their own widths
        class Model(AttentionThenHead):
            def forward(self, x):
                out, weights = self.att(x, x[..., :3], x[..., 1:3], average_attn_weights=False)
                return self.head(out) + weights.sum((1, 3)).unsqueeze(-1)
    else:
        Model = AttentionThenHead
    x = torch.randn(5, 3, 4)
    assert_matches_loop(Model(frozen, **options), [x], loss_type=loss_type)
    assert_norms_match(Model(frozen, **options), [x], loss_type=loss_type)
    assert_clipping_matches(Model(frozen, **options), [x], 0.5, loss_type=loss_type)


@pytest.mark.parametrize("bias_kv", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hooked_sum_equals_autograd_and_no_false_alarm(dtype, bias_kv):
    """The rule's weighted sum with unit weights (the unseen-use check's hooked sum) equals
    autograd's batch-summed gradient; grad1, norms and clipping, each checked, raise no
    unseen-use alarm (captured, bias_k / bias_v included)."""
    torch.manual_seed(0)
    model = AttentionThenHead(None, add_bias_kv=bias_kv, add_zero_attn=True).to(dtype)
    x = torch.randn(6, 5, 4, dtype=dtype)
    state = psh.add_hooks(model, check_unseen="always")
    try:
        weighted_square(model(x)).mean().backward()
        calls = [c for c in state.calls[model.att] if c.has_grads]
        assert [captured(c) is not None for c in calls] == [True]
        params = dict(model.att.named_parameters())
        out = {n: torch.full_like(p, float("nan")) for n, p in params.items()}
        weighted_sum(MultiheadAttentionRule(), model.att, calls, torch.ones(6, dtype=dtype),
                     out)
        tolerance = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(out[n], p.grad, msg=lambda m, n=n: f"{n}: {m}",
                                       **tolerance)
        psh.compute_norms(model)
        model.zero_grad()
        weighted_square(model(x)).mean().backward()
        psh.clip_grads(model, 1.0)
        model.zero_grad()
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        assert model.att.out_proj.weight.grad1.shape == (6, 4, 4)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_in_training_refused_when_not_captured(dtype):
    """Dropout in training: a call whose projections were not captured in its forward (as
    under torch.compile) would be re-run with other random masks: refused; in eval mode it is
    exact. Captured (bias_k / bias_v included), it is exact in training too."""
    torch.manual_seed(0)
    model = Attention(4, 2, batch_first=True, dropout=0.5, add_bias_kv=True).to(dtype)
    x = torch.randn(3, 2, 4, dtype=dtype)
    with recomputing(), psh.add_hooks(model):
        weighted_square(model(x, x, x)[0]).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="'attention'.*dropout=0.5"):
            psh.compute_grad1(model)
    with psh.add_hooks(model):
        losses = weighted_square(model(x, x, x)[0])
        losses.mean().backward(retain_graph=True)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4,
                                                                                 atol=1e-5)
    for n, g in same_forward_grads(model, losses).items():
        torch.testing.assert_close(got[n], g, msg=lambda m, n=n: f"{n}: {m}", **tolerance)
    model.eval()
    assert_matches(model, [x, x, x], [0, 0, 0], attention_loss(0))


def test_dropout_refused_when_unfrozen_after_the_forward():
    """A parameter frozen in a captured forward and unfrozen before the compute call is not in
    any captured product: with dropout in training its recompute would draw other masks."""
    torch.manual_seed(0)
    model = Attention(4, 2, batch_first=True, dropout=0.5)
    x = torch.randn(3, 2, 4)
    inner = next(m for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    inner.out_proj.weight.requires_grad_(False)
    with psh.add_hooks(model):
        weighted_square(model(x, x, x)[0]).sum().backward()
        inner.out_proj.weight.requires_grad_(True)
        with pytest.raises(psh.PerSampleHooksError, match="dropout=0.5.*unfrozen"):
            psh.compute_grad1(model)


def same_forward_grads(model, losses):
    """``{name: [B, *p.shape]}``: each sample's loss differentiated through the same forward
    (its dropout masks): the per-sample gradients of a model whose samples do not interact."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = [torch.autograd.grad(loss, list(params.values()), retain_graph=True)
            for loss in losses]
    return {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(params)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_first", [False, True])
def test_dropout_in_training_captured_exact(batch_first, dtype):
    """Dropout in training (attention and the layer's own): the captured projections are those
    of the step's forward, so grad1 is exact; truth: each sample's loss through the same
    forward."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(8, 2, dim_feedforward=12, dropout=0.3,
                                       batch_first=batch_first).to(dtype)
    dim = 0 if batch_first else 1
    shape = (lambda n: (3, n, 8)) if batch_first else (lambda n: (n, 3, 8))
    tgt, memory = torch.randn(shape(4), dtype=dtype), torch.randn(shape(5), dtype=dtype)
    psh.add_hooks(layer, batch_dim=dim)
    try:
        losses = weighted_square(layer(tgt, memory).movedim(dim, 0))
        losses.mean().backward(retain_graph=True)
        psh.compute_grad1(layer)
        got = {n: p.grad1.clone() for n, p in layer.named_parameters()}
    finally:
        psh.remove_hooks(layer)
    expected = same_forward_grads(layer, losses)
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4,
                                                                                 atol=1e-5)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, msg=lambda m, n=n: f"{n}: {m}", **tolerance)


def test_unbatched_query_refused():
    model = nn.Sequential(nn.MultiheadAttention(4, 2))
    x = torch.randn(3, 4)
    psh.add_hooks(model)
    try:
        model[0](x, x, x)[0].sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="unbatched"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)


class Encoder(nn.Module):
    """Two encoder layers (or a decoder layer on a memory) on a float input that needs no
    gradient, mean-pooled, then a head."""

    def __init__(self, batch_first, decoder=False):
        super().__init__()
        options = dict(dim_feedforward=12, dropout=0.0, batch_first=batch_first)
        if decoder:
            self.body = nn.TransformerDecoderLayer(8, 2, **options)
        else:
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, **options), 2,
                                              enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)
        self.dim = 1 if batch_first else 0  # the sequence dim

    def forward(self, x, padding, memory=None):
        if memory is None:
            h = self.body(x, src_key_padding_mask=padding)
        else:
            h = self.body(x, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(
                x.shape[self.dim], dtype=x.dtype), tgt_is_causal=True,
                memory_key_padding_mask=padding)
        return self.head(h.mean(self.dim))


def encoder_inputs(batch_first, decoder, dtype=torch.float32):
    torch.manual_seed(1)
    shape = (lambda n: (5, n, 8)) if batch_first else (lambda n: (n, 5, 8))
    padding = torch.zeros(5, 6, dtype=torch.bool)
    padding[2, -2:] = True
    x = torch.randn(shape(4) if decoder else shape(6), dtype=dtype)
    return [x, padding] + ([torch.randn(shape(6), dtype=dtype)] if decoder else [])


@pytest.mark.parametrize("path", ["captured", "re-run", "fallback"])
@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_float32_against_float64_loop(batch_first, decoder, path, monkeypatch):
    """float32 grad1 of encoder and decoder layers (masks, padding, causal) against the float64
    per-sample loop, their attention captured in the forward, captured in a re-run of it (the
    forward's capture off, as under torch.compile), or re-run by the fallback (as with
    bias_k / bias_v)."""
    torch.manual_seed(0)
    model = Encoder(batch_first, decoder)
    inputs = encoder_inputs(batch_first, decoder)
    dim = 0 if batch_first else 1
    specs = [dim, 0, dim][:len(inputs)]
    batch_dim = {"body": dim}
    fallback_calls = []
    if path != "captured":
        monkeypatch.setattr(MultiheadAttentionRule, "watch", lambda *args: None)
        rerun = attention_rule.rerun_captured if path == "re-run" else lambda *args: (None, [])
        monkeypatch.setattr(attention_rule, "rerun_captured", rerun)
        monkeypatch.setattr(attention_rule, "call_grad1", lambda *args: fallback_calls.append(
            args[0]) or call_grad1(*args))
    assert set(capture_paths(model, inputs, weighted_square, batch_dim=batch_dim)) == \
        {path == "captured"}
    psh.add_hooks(model, batch_dim=batch_dim)
    try:
        weighted_square(model(*inputs)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    reference = copy.deepcopy(model).double()
    expected = loop_grads_of(reference, ([sample(to_double(x), s, i, 2)
                                          for x, s in zip(inputs, specs)] for i in range(5)),
                             weighted_square)
    for n, g in expected.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[n].double(), g, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")
    assert len(fallback_calls) == (2 if path == "fallback" else 0)  # two attention calls


@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_output_edges_backward_captured(batch_first, decoder):
    """``OutputEdges(model).backward(loss)``: no parameter gradient, the projections' output
    gradients captured all the same (their edges are recorded, though the input needs no
    gradient), grad1 exact against the float64 loop."""
    from per_sample_hooks.dp import OutputEdges
    torch.manual_seed(0)
    model = Encoder(batch_first, decoder).double()
    inputs = [to_double(x) for x in encoder_inputs(batch_first, decoder)]
    dim = 0 if batch_first else 1
    state = psh.add_hooks(model, batch_dim={"body": dim}, check_unseen=False)
    try:
        edges = OutputEdges(model)
        edges.backward(weighted_square(model(*inputs)).mean())
        assert all(p.grad is None for p in model.parameters())
        calls = [c for m, cs in state.calls.items() if isinstance(m, nn.MultiheadAttention)
                 for c in cs]
        assert calls and all(captured(c) is not None for c in calls)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    specs = [dim, 0, dim][:len(inputs)]
    expected = loop_grads_of(model, ([sample(x, s, i, 2) for x, s in zip(inputs, specs)]
                                     for i in range(5)), weighted_square)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{n}: {m}")


class Scaled(nn.Module):
    """A raw parameter around an attention child: its uses followed by the raw-uses mode,
    suspended while the attention (captured) runs."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(8))
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return x + self.gamma * self.attention(x, x, x, need_weights=False)[0]


class Names(TorchFunctionMode):
    """A user's torch-function mode: records the names of the functions it is handed."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_raw_parameter_parent_and_a_user_s_mode():
    """Inside a module whose raw parameters are followed, the attention is captured; under a
    user's own torch-function mode it is not (the mode is handed the functional forward whole,
    as without hooks) and is recomputed; exact both ways."""
    torch.manual_seed(0)
    model = Scaled().double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    assert capture_paths(model, [x], weighted_square) == [True]
    assert_matches(model, [x], [0], weighted_square)
    mode = Names()
    with mode:
        assert capture_paths(model, [x], weighted_square) == [False]
        assert "multi_head_attention_forward" in mode.seen and "linear" not in mode.seen
        got = hooked_grads(model, [x], weighted_square)
    expected = loop_grads_of(model, ([x[i:i + 1]] for i in range(4)), weighted_square)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-10)
