"""The torch.func fallback (custom layers, batch_dim per module) and attention and transformer
layers inside whole models (their native rule is tested in test_attention_rule.py)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import (
    assert_clipping_matches,
    assert_norms_match,
    hooked_backward,
    loop_clipped,
    loop_norms,
)
from test_recurrent_cells import Decoder, decoder_loss, expected_grads, initial_state, make_cell
from torch import nn

import per_sample_hooks as psh
from ground_truth import (
    assert_matches_loop,
    assert_same_state,
    hooked_grads,
    loop_grads,
    loop_grads_of,
    loop_tolerance,
    weighted_square,
)
from per_sample_hooks.rules.attention import MultiheadAttentionRule
from per_sample_hooks.rules.fallback import without_cudnn


def seq_first_loss(output):
    """``weighted_square`` of a ``[L, B, ...]`` output (batch at dim 1)."""
    return weighted_square(output.movedim(1, 0))


def assert_matches_loop_dims(model, inputs, dims, loss_fn=seq_first_loss, loss_type="mean",
                             **hook_options):
    """Like ``assert_matches_loop`` with the batch of input ``j`` at ``dims[j]`` (None: shared);
    the hooks get their own ``batch_dim`` option."""
    model = model.double()
    inputs = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
    got = hooked_grads(model, inputs, loss_fn, loss_type, **hook_options)
    batch = inputs[0].shape[dims[0]]
    expected = loop_grads_of(model, ([x if d is None else x.narrow(d, i, 1)
                                      for x, d in zip(inputs, dims)] for i in range(batch)),
                             loss_fn)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{n}: {m}")


def assert_seq_first_matches(model, inputs, loss_fn=seq_first_loss, **hook_options):
    """Inputs ``[L, B, ...]``: the loop slices dim 1."""
    assert_matches_loop_dims(model, inputs, [1] * len(inputs), loss_fn, **hook_options)


class LayerScale(nn.Module):
    """CaiT / ConvNeXt layer scale: a raw per-channel parameter."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x * self.gamma


class LearnedPositions(nn.Module):
    def __init__(self, length, dim):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(length, dim))

    def forward(self, x):
        return x + self.positions[: x.shape[1]]


class Gated(nn.Module):
    """Raw parameters, a child module called normally, two inputs, keyword and non-tensor
    arguments, and a nested output."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.proj = nn.Linear(d, d)

    def forward(self, x, y, *, power=2, offset=None, tag="x"):
        assert tag == "x"
        h = self.proj(x) * torch.sigmoid(y * self.scale) ** power
        if offset is not None:
            h = h + offset
        return {"h": h, "extra": (h.sum(-1), [None, torch.tanh(h)])}


@pytest.mark.parametrize("units", [(), ("1", "3")])
def test_raw_parameters_layer_scale_and_positions(units):
    """Leaves with raw parameters: followed by default, the fallback's units by ``units=``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), LearnedPositions(5, 6), nn.Tanh(), LayerScale(6),
                          nn.Linear(6, 3))
    for loss_type in ["mean", "sum"]:
        assert_matches_loop(model, [torch.randn(4, 5, 4)], loss_type=loss_type, units=units)


def test_shorter_sequence_than_positions():
    torch.manual_seed(0)
    model = nn.Sequential(LearnedPositions(7, 3), nn.Linear(3, 2))
    assert_matches_loop(model, [torch.randn(3, 4, 3)])


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_several_inputs_kwargs_nested_outputs(loss_type):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gated = Gated(4)

        def forward(self, x, y):
            out = self.gated(x, y, power=3, offset=torch.ones(4), tag="x")
            return out["h"] ** 2 + out["extra"][0][..., None] + out["extra"][1][1]

    assert_matches_loop(Model(), [torch.randn(5, 3, 4), torch.randn(5, 3, 4)],
                        loss_type=loss_type)


@pytest.mark.parametrize("units", [(), ("scale",)])
def test_unit_reused_and_partly_frozen(units):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = LayerScale(4)
            self.gated = Gated(4)
            self.gated.proj.bias.requires_grad_(False)

        def forward(self, x):
            h = self.scale(x)
            h = self.gated(h, x)["h"]
            return self.scale(torch.tanh(h)) + self.gated(h, h)["h"]

    assert_matches_loop(Model(), [torch.randn(6, 4)], units=units)


class Recurrence(nn.Module):
    """A cell called once per time step: ``h = tanh(proj(x_t) + scale * h)``."""

    def __init__(self, d):
        super().__init__()
        self.cell = Gated(d)

    def forward(self, x):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(x[:, t], h)["h"])
        return h


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_called_in_a_loop_gives_one_summed_form_per_parameter(dtype):
    """A unit called at each of T time steps: norms and clipping match the loop, and its
    forms are one dense sum per parameter (one ``[B, *p]`` held, not T)."""
    torch.manual_seed(0)
    model, x = Recurrence(4).to(dtype), torch.randn(5, 6, 4, dtype=dtype)
    reference = copy.deepcopy(model).double()
    hooked_backward(model, [x], units=["cell"])
    state = psh.add_hooks(model)  # (hooked already: its state)
    try:
        calls = list(state.calls[model.cell])
        names = ["scale", "proj.weight", "proj.bias"]
        forms = psh.FallbackRule().forms(model.cell, calls, names)
        norms = psh.compute_norms(model)
        clipped = psh.clip_grads(model, max_grad_norm=0.5)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    assert len(calls) == 6 and {n: len(f) for n, f in forms.items()} == dict.fromkeys(names, 1)
    total, _, per_sample = loop_norms(reference, [x.double()], weighted_square, "mean")
    tolerance = loop_tolerance(dtype)
    torch.testing.assert_close(norms.double(), total, **tolerance)
    torch.testing.assert_close(clipped.double(), total, **tolerance)
    expected = loop_clipped(per_sample, total, 0.5, "mean")
    for n, g in grads.items():
        torch.testing.assert_close(g.double(), expected[n], **tolerance,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_unit_children_are_not_hooked_and_is_supported():
    """A module with raw parameters and a child: by default the child keeps its rule (the raw
    parameters' uses are followed, tests/test_raw_parameters.py); made a unit (units=), the
    child is inside it. A leaf with raw parameters is followed too, re-run by the fallback
    where it cannot be (not a unit either way)."""
    model = nn.Sequential(Gated(3), nn.Linear(3, 2), LayerScale(2))
    state = psh.add_hooks(model)
    try:
        assert state.units == set()
        assert model[0].proj in state.modules and model[0] in state.modules
        assert type(state.rules[model[2]]).__name__ == "RawUsesOrFallbackRule"
    finally:
        psh.remove_hooks(model)
    state = psh.add_hooks(model, units=["0", "2"])
    try:
        assert state.units == {model[0], model[2]}
        assert model[0].proj not in state.modules and model[1] in state.modules
    finally:
        psh.remove_hooks(model)
    assert psh.is_supported(model[0]) and psh.is_supported(model[0], fallback=False)
    assert psh.is_supported(model[2]) and not psh.is_supported(model[2], fallback=False)
    assert psh.is_supported(model[1], fallback=False)


def test_fallback_off_raises_unsupported():
    model = nn.Sequential(nn.Linear(3, 3), LayerScale(3))
    with pytest.raises(psh.UnsupportedModuleError, match=r"'1' of type LayerScale.*gamma"):
        psh.add_hooks(model, fallback=False)
    assert not hasattr(model, "_per_sample_hooks")


def test_dropout_in_unit_refused_in_training_only(monkeypatch):
    """Attention re-run (its projections not captured in the forward, as under
    torch.compile), dropout in training: refused."""
    monkeypatch.setattr(MultiheadAttentionRule, "watch", lambda *args: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True,
                                                add_bias_kv=True))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = model[0]

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    wrapper = Wrapper()
    psh.add_hooks(wrapper)
    try:
        wrapper(torch.randn(3, 2, 4)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="'attention'.*dropout"):
            psh.compute_grad1(wrapper)
    finally:
        psh.remove_hooks(wrapper)
    wrapper.eval()
    assert_matches_loop(wrapper, [torch.randn(3, 2, 4)])


class Attention(nn.Module):
    """MultiheadAttention followed by a Linear; the loss sees both the output and the weights."""

    def __init__(self, batch_first, kdim, vdim, add_bias_kv, add_zero_attn, bias):
        super().__init__()
        self.attention = nn.MultiheadAttention(
            6, 2, batch_first=batch_first, kdim=kdim, vdim=vdim, add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn, bias=bias)
        self.head = nn.Linear(6, 2)

    def forward(self, q, k, v, key_padding_mask=None, attn_mask=None, need_weights=True,
                average=True):
        out, weights = self.attention(q, k, v, key_padding_mask=key_padding_mask,
                                      attn_mask=attn_mask, need_weights=need_weights,
                                      average_attn_weights=average)
        return self.head(out), weights


@settings(max_examples=25, deadline=None)
@given(batch_first=st.booleans(), batch=st.integers(1, 4), length=st.integers(1, 4),
       source=st.integers(1, 4), kv_dims=st.booleans(), add_bias_kv=st.booleans(),
       add_zero_attn=st.booleans(), bias=st.booleans(),
       mask=st.sampled_from([None, "bool", "float", "heads"]), padding=st.booleans(),
       need_weights=st.booleans(), average=st.booleans(),
       loss_type=st.sampled_from(["mean", "sum"]))
def test_multihead_attention(batch_first, batch, length, source, kv_dims, add_bias_kv,
                             add_zero_attn, bias, mask, padding, need_weights, average, loss_type):
    torch.manual_seed(0)
    kdim, vdim = (5, 3) if kv_dims else (6, 6)
    model = Attention(batch_first, kdim, vdim, add_bias_kv, add_zero_attn, bias)
    shape = (lambda n, d: (batch, n, d)) if batch_first else (lambda n, d: (n, batch, d))
    q, k, v = torch.randn(shape(length, 6)), torch.randn(shape(source, kdim)), \
        torch.randn(shape(source, vdim))
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(length, source) < 0.3
        attn_mask[:, 0] = False
    elif mask == "float":
        attn_mask = torch.randn(length, source)
    elif mask == "heads":
        attn_mask = torch.randn(batch * 2, length, source)
    key_padding_mask = None
    if padding:
        key_padding_mask = torch.rand(batch, source) < 0.3
        key_padding_mask[:, 0] = False
    dim = 0 if batch_first else 1

    def loss_fn(output):
        out, weights = output
        loss = weighted_square(out.movedim(dim, 0))
        return loss if weights is None else loss + weighted_square(weights)

    inputs = [q, k, v, key_padding_mask, attn_mask, need_weights, average]
    model = model.double()
    inputs = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
    got = hooked_grads(model, inputs, loss_fn, loss_type, batch_dim={"head": dim})

    def take(i):
        sample = [q.narrow(dim, i, 1), k.narrow(dim, i, 1), v.narrow(dim, i, 1)]
        sample = [x.double() for x in sample]
        sample.append(None if key_padding_mask is None else key_padding_mask[i:i + 1])
        if attn_mask is not None and attn_mask.dim() == 3:
            sample.append(inputs[4][2 * i: 2 * i + 2])
        else:
            sample.append(inputs[4])
        return sample + [need_weights, average]

    params = dict(model.named_parameters())
    for i in range(batch):
        loss = loss_fn(model(*take(i))).sum()
        expected = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), expected):
            g = torch.zeros_like(p) if g is None else g
            torch.testing.assert_close(got[n][i], g, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("units", [(), ("layer",)], ids=["rules", "unit"])
def test_transformer_encoder_layer(norm_first, batch_first, mode, units):
    """Its layers' rules, or the layer as one unit (whose layout reads batch_first from its
    attention: torch 2.15's layer has none of its own)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                       batch_first=batch_first, norm_first=norm_first)
    layer.train(mode == "train")
    batch, length = 3, 4
    x = torch.randn(batch, length, 8) if batch_first else torch.randn(length, batch, 8)
    src_mask = nn.Transformer.generate_square_subsequent_mask(length)
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, -1] = True

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x, padding):
            return self.layer(x, src_mask=src_mask.to(x.dtype), src_key_padding_mask=padding)

    if batch_first:
        assert_matches_loop(Model(), [x, padding], units=units)
    else:
        assert_matches_loop_dims(Model(), [x, padding], [1, 0], batch_dim=1, units=units)


def test_batch_dim_mapping_nearest_entry_wins():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(3, 4), LayerScale(4))
            self.out = nn.Linear(4, 2)

        def forward(self, x):  # x [T, B, 3]
            return self.out(self.inner(x).transpose(0, 1))

    model = Model()
    assert_seq_first_matches(model, [torch.randn(4, 3, 3)],
                             loss_fn=weighted_square, batch_dim={"inner": 1})
    state = psh.add_hooks(model, batch_dim={model.inner: 1, "inner.1": 1})
    try:
        assert state.modules[model.inner[0]][1] == 1 and state.modules[model.out][1] == 0
    finally:
        psh.remove_hooks(model)
    with pytest.raises(ValueError, match="'nope'"):
        psh.add_hooks(model, batch_dim={"nope": 1})


class AttentionThenHead(nn.Module):
    """MultiheadAttention (its forward uses ``out_proj.weight`` functionally) and a Linear."""

    def __init__(self, freeze_in_proj: bool):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)
        if freeze_in_proj:
            self.att.in_proj_weight.requires_grad_(False)
            self.att.in_proj_bias.requires_grad_(False)

    def forward(self, x):
        return self.head(self.att(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("freeze_in_proj", [False, True])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_attention_norms_and_clipping(freeze_in_proj, loss_type):
    """Norms and clipping of a fallback unit (qualified parameter names such as
    'out_proj.weight'); with in_proj frozen the attention is still one unit (out_proj is used
    outside its own forward), not a Linear rule that would miss that use."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4)
    assert_matches_loop(AttentionThenHead(freeze_in_proj), [x], loss_type=loss_type)
    assert_norms_match(AttentionThenHead(freeze_in_proj), [x], loss_type=loss_type)
    assert_clipping_matches(AttentionThenHead(freeze_in_proj), [x], 0.5, loss_type=loss_type)


# --- recurrent layers inside a unit ------------------------------------------------------------

class Encoder(nn.Module):
    """A recurrent layer and a Linear on its outputs (a unit by ``units=``), as a wrapper around
    an encoder would be; ``learned_h0``: the initial state is a parameter of the wrapper."""

    def __init__(self, kind: str, batch_first: bool, learned_h0: bool = False, **options):
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 4, batch_first=batch_first, **options)
        directions = 2 if self.rnn.bidirectional else 1
        out = getattr(self.rnn, "proj_size", 0) or 4
        self.lin = nn.Linear(out * directions, 2)
        self.h0 = (nn.Parameter(torch.randn(self.rnn.num_layers * directions, 1, out))
                   if learned_h0 else None)

    def forward(self, x):
        if self.h0 is None:
            y, _ = self.rnn(x)
        else:
            batch = x.shape[0 if self.rnn.batch_first else 1]
            h0 = self.h0.expand(-1, batch, -1).contiguous()  # cuDNN takes no strided hx
            if isinstance(self.rnn, nn.LSTM):
                h0 = (h0, x.new_zeros(h0.shape[0], batch, self.rnn.hidden_size))
            y, _ = self.rnn(x, h0)
        return self.lin(torch.tanh(y))


class Encoded(nn.Module):
    def __init__(self, *args, **options):
        super().__init__()
        self.enc = Encoder(*args, **options)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        return self.head(self.enc(x))


RECURRENT_VARIANTS = {
    "plain": {},
    "bidirectional_2_layers": dict(bidirectional=True, num_layers=2),
    "learned_h0": dict(learned_h0=True),
    "eval": {},
}


@pytest.mark.parametrize("variant", list(RECURRENT_VARIANTS))
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_layer_in_unit(variant, kind, batch_first, dtype):
    """An RNN/GRU/LSTM inside a unit (units=): grad1 and norms as the float64 loop (once: the
    layer's own zeros initial state, not batched under vmap, was written in place ('output with
    shape [1, 4] doesn't match the broadcast shape'), and the float32 LSTM's oneDNN kernel,
    run under compute_grad1's no_grad, kept no workspace for its backward)."""
    with without_cudnn(variant == "eval"):
        check_recurrent_layer_in_unit(variant, kind, batch_first, dtype)


def check_recurrent_layer_in_unit(variant, kind, batch_first, dtype):
    torch.manual_seed(0)
    model = Encoded(kind, batch_first, **RECURRENT_VARIANTS[variant]).to(dtype)
    model.train(variant != "eval")
    dim = 0 if batch_first else 1
    x = torch.randn(5, 4, 3, dtype=dtype)
    x = x if batch_first else x.transpose(0, 1).contiguous()

    def loss_fn(output):
        return weighted_square(output.movedim(dim, 0))

    psh.add_hooks(model, units=["enc"], batch_dim=dim)
    try:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        loss_fn(model(x)).mean().backward()
        norms = psh.compute_norms(model).double()
    finally:
        psh.remove_hooks(model)
    model = model.double()
    expected = loop_grads_of(model, ([x.double().narrow(dim, i, 1)] for i in range(5)), loss_fn)
    assert got.keys() == expected.keys()
    # float32: cuDNN's GRU rounds its outputs to ~1e-5 (an H100), which the head's inherit
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, **tolerance, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(norms, torch.cat([g.flatten(1) for g in expected.values()], 1)
                               .norm(dim=1), **tolerance)


@pytest.mark.parametrize("mode", ["RNN_TANH", "LSTM", "GRU"])
@pytest.mark.parametrize("given_state", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_cell_in_unit(mode, given_state, dtype):
    """A module stepping a cell, made a unit: the cell's own zeros initial state is batched
    in the re-run as an RNN's (it was written in place, 'output with shape [1, 16] doesn't
    match the broadcast shape [3, 1, 16]'), and a given LSTMCell state, a tuple ``(h, c)``,
    is split by sample (it was handed whole to every sample, 'Input batch size 1 doesn't
    match hidden0 batch size 3')."""
    torch.manual_seed(0)
    model = Decoder(make_cell(mode, 3, 4)).to(dtype)
    x = torch.randn(3, 4, 3, dtype=dtype)
    state = initial_state(mode, 3, 4, dtype) if given_state else None
    expected = expected_grads(model, x, state, decoder_loss(True))
    with psh.add_hooks(model, units=[""], check_unseen="always"):
        decoder_loss(True)(model(x, state)).mean().backward()
        psh.compute_grad1(model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_with_tensors_inside_container_arguments(dtype):
    """Tensors inside a tuple, list or dict argument are split by sample where batched and
    shared where not, one by one, as top-level tensors are."""
    torch.manual_seed(0)

    class Unit(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.randn(3))

        def forward(self, x, extra):
            gate, shared = extra["pair"]
            return self.lin(x) * gate + shared * self.scale + extra["more"][0].sum()

    model = Unit().to(dtype)
    x, gate = torch.randn(4, 3, dtype=dtype), torch.randn(4, 3, dtype=dtype)
    shared, more = torch.randn(3, dtype=dtype), [torch.randn(2, dtype=dtype)]
    expected = loop_grads_of(copy.deepcopy(model).double(),
                             ([x[i:i + 1].double(), {"pair": (gate[i:i + 1].double(),
                                                              shared.double()),
                                                     "more": [more[0].double()]}]
                              for i in range(4)), weighted_square)
    with psh.add_hooks(model, units=[""], check_unseen="always"):
        weighted_square(model(x, {"pair": (gate, shared), "more": more})).mean().backward()
        psh.compute_grad1(model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))
            torch.testing.assert_close(p.grad1.mean(0), p.grad, **loop_tolerance(dtype))


def test_recurrent_dropout_in_unit_refused_in_training_only():
    """Dropout between the layers of an RNN in a unit draws a new mask in the re-run: refused
    in training mode, exact in eval mode."""
    torch.manual_seed(0)
    model = Encoded("LSTM", True, num_layers=2, dropout=0.5).double()
    psh.add_hooks(model, units=["enc"])
    try:
        model(torch.randn(3, 4, 3, dtype=torch.double)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError,
                           match=r"Encoder, a unit .*dropout in training mode \(rnn, LSTM\)"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)
    model.eval()
    with without_cudnn():
        assert_matches_loop(model, [torch.randn(3, 4, 3)], units=["enc"])


class Packing(Encoder):
    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        y, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                   total_length=x.shape[1])
        return self.lin(y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_sequence_in_unit_is_re_run_one_sample_at_a_time(dtype):
    """pack_padded_sequence inside a unit: lengths that differ by sample cannot be vmapped;
    each sample is packed with its own length by the loop over samples (plain autograd, which
    packing needs), with the warning; exact against the float64 loop."""
    torch.manual_seed(0)
    model = Packing("GRU", True)
    x, lengths = torch.randn(3, 4, 3), torch.tensor([4, 2, 1], device="cpu")
    expected = loop_grads(copy.deepcopy(model).double(), [x.double(), lengths],
                          weighted_square, 3)
    model, x = model.to(dtype), x.to(dtype)
    psh.add_hooks(model, units=[""])
    try:
        weighted_square(model(x, lengths)).mean().backward()
        with pytest.warns(UserWarning, match="Packing, a unit of the torch.func fallback, is "
                          "re-run one sample at a time"):
            psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
    finally:
        psh.remove_hooks(model)


class Branches(nn.Module):
    """A forward that branches on a value over the whole batch: each sample alone may take
    the other branch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_whose_forward_depends_on_the_batch_is_refused_with_the_cause(dtype):
    """``if x.sum() > 0`` cannot be vmapped, and one sample at a time (sample 0 alone takes
    the other branch) gives other outputs than the batch: refused naming the unit and why,
    not a silently wrong number; the next step is clean."""
    model = nn.Sequential(Branches(), nn.Linear(3, 2)).to(dtype)
    x = torch.randn(4, 3, dtype=dtype).abs()
    x[0] = -x[0]  # the batch's sum stays > 0
    psh.add_hooks(model, units=["0"])
    try:
        model(x).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'0' \(Branches\), a unit of the "
                           r"torch.func fallback, gives sample 0 another output 0 when re-run "
                           r"alone, one at a time \(vmap cannot batch it\), .*depends on the "
                           r"batch"):
            psh.compute_grad1(model)
        psh.remove_hooks(model)
        # every sample on the batch's branch: its Linear's rule is exact
        assert_matches_loop(model, [x.abs()], loss_fn=lambda out: out.sum(1))
    finally:
        psh.remove_hooks(model)


class TopOneExperts(nn.Module):
    """A mixture of experts as transformers' eager experts route tokens: each token to the
    expert its gate scores highest, the rows of each expert gathered with ``nonzero`` (a
    shape that depends on the values: vmap cannot batch it)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        scores = self.gate(tokens).softmax(-1)
        weight, choice = scores.max(-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if len(rows):
                out.index_add_(0, rows, expert(tokens[rows]) * weight[rows, None])
        return out.reshape(x.shape)


class Swish(torch.autograd.Function):
    """An autograd.Function of the old style (``forward(ctx, ...)``, no ``setup_context``),
    which torch.func cannot transform (PhiMoE's router is one)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        sigmoid = torch.sigmoid(x)
        return grad * (sigmoid + x * sigmoid * (1 - sigmoid))


class SwishUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Swish.apply(self.lin(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("unit", [TopOneExperts, SwishUnit])
def test_a_unit_vmap_cannot_batch_is_re_run_one_sample_at_a_time(unit, dtype):
    """Data-dependent routing in a unit, or an autograd.Function torch.func cannot transform:
    exact against the float64 loop, re-run one sample at a time with a warning that says so;
    norms follow."""
    torch.manual_seed(0)
    model = nn.Sequential(unit(), nn.Linear(4, 2))
    x = torch.randn(5, 6, 4)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    model, x = model.to(dtype), x.to(dtype)
    tolerance = loop_tolerance(dtype)
    psh.add_hooks(model, units=["0"], check_unseen="always")
    try:
        weighted_square(model(x)).mean().backward()
        with pytest.warns(UserWarning, match=rf"'0' \({unit.__name__}\), a unit of the torch.func "
                          "fallback, is re-run one sample at a time"):
            psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **tolerance)
        total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            norms = psh.compute_norms(model)
        torch.testing.assert_close(norms.double(), total, **tolerance)
    finally:
        psh.remove_hooks(model)


class CentredLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y - y.mean(0, keepdim=True)  # couples the samples


class FrequencyScaledLookup(nn.Module):
    """A raw embedding table read with ``scale_grad_by_freq``: outputs per sample, but its
    backward divides by token counts over the batch."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return F.embedding(ids, self.table, scale_grad_by_freq=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_whose_backward_couples_the_samples_is_refused(dtype):
    """The fallback's re-run per sample divides by each sample's own token counts, the
    batch's backward by the batch's: the rows do not sum to the gradient. Refused in float32
    too (it was silently 245% off the gradient there), naming scale_grad_by_freq; nn.Embedding
    with it is refused by its rule."""
    torch.manual_seed(0)
    ids = torch.zeros(6, 5, dtype=torch.long)
    ids[:, :3] = torch.randint(0, 10, (6, 3))
    model = nn.Sequential(FrequencyScaledLookup(), nn.Linear(4, 3)).to(dtype)
    psh.add_hooks(model)
    try:
        model(ids).square().sum((1, 2)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"parameter '0.table': the "
                           r"per-sample gradients of '0' do not sum .*scale_grad_by_freq=False"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)


class NoisyLinear(nn.Module):
    """Stochastic depth (timm's ``DropPath``: no ``nn.Dropout`` to be told by type)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        keep = (torch.rand(x.shape[0], 1, dtype=x.dtype) > 0.5).to(x.dtype)
        return x + self.lin(x) * keep * 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("unit", [CentredLinear, NoisyLinear])
def test_a_unit_whose_re_run_gives_other_outputs_is_refused(unit, dtype):
    """A unit that centres over the batch (per-sample gradients undefined) or draws random
    numbers (the re-run would not draw the step's): vmap runs it, and each sample's output
    differs from the batch's. Refused in float32 too, where the sum of the per-sample gradients
    cannot tell (rounding of a saturated softmax is as large), naming the unit and the cause;
    the next step, with the unit's module evaluated in a way that is per sample, is clean."""
    torch.manual_seed(0)
    model = nn.Sequential(unit(), nn.Linear(4, 1)).to(dtype)
    psh.add_hooks(model, units=["0"])
    try:
        model(torch.randn(6, 4, dtype=dtype)).square().sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=rf"'0' \({unit.__name__}\), a "
                           r"unit of the torch.func fallback, gives sample \d another output 0 "
                           r"when re-run alone, (under torch.func.vmap|one at a time).*depends "
                           r"on the batch .* or draws random numbers"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)
    model[0].forward = model[0].lin.forward  # per sample: exact
    assert_matches_loop(model, [torch.randn(6, 4)], units=["0"])


class ScaledInPlace(nn.Module):
    """Changes its unit's output in place after the unit's forward (or not: ``in_place``)."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.block = nn.Sequential(nn.Linear(4, 5), nn.Softplus())  # saves its input only
        self.head = nn.Linear(5, 2)
        self.unit_calls = 0
        self.block.register_forward_pre_hook(lambda *_: setattr(self, "unit_calls",
                                                                self.unit_calls + 1))

    def forward(self, x):
        y = self.block(x)
        return self.head(y.mul_(3.0) if self.in_place else y * 3.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unit_outputs_are_compared_with_the_kept_ones_or_a_re_run(dtype):
    """The re-run's outputs are compared with those the unit's forward gave (kept, no extra
    forward: the unit runs twice a step, the forward and the vmapped re-run), or, where the
    model changed them in place since, with a batched forward (three runs); exact both ways."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=dtype)
    for in_place, runs in [(False, 2), (True, 3)]:
        model = ScaledInPlace(in_place).to(dtype)
        expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
        psh.add_hooks(model, units=["block"])
        try:
            weighted_square(model(x)).mean().backward()
            model.unit_calls = 0
            psh.compute_grad1(model)
            assert model.unit_calls == runs - 1  # after the forward
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1.double(), expected[n],
                                           **loop_tolerance(dtype))
        finally:
            psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_batch_norm_with_batch_statistics_in_a_unit_is_refused(dtype, track_running_stats):
    """BatchNorm in training mode (or without running statistics) inside a unit mixes the
    samples as it does outside one: refused with the BatchNorm rule's message, in float32 too
    (where the check cannot tell); in eval mode the unit is exact."""
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(3, track_running_stats=track_running_stats)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(2, 3, 3), norm), nn.Flatten(),
                          nn.Linear(12, 1)).to(dtype)
    x = torch.randn(4, 2, 4, 4, dtype=dtype)
    psh.add_hooks(model, units=["0"])
    try:
        model(x).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'0.1' \(BatchNorm2d\) normalizes "
                           r"with batch statistics"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)
    if track_running_stats:
        assert_matches_loop(model.eval(), [x], units=["0"])


class FromCount(nn.Module):
    """Called with an int only: no tensor to read the batch from."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, count: int):
        return self.lin(torch.ones(count, 3, dtype=self.lin.weight.dtype))


class CountsTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.source, self.out = FromCount(), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(x + self.source(x.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_called_with_no_tensor_is_refused_naming_it(dtype):
    """A unit called with no tensor input cannot be split by sample: refused naming it and the
    fix; its parent as the unit is exact."""
    torch.manual_seed(0)
    model, x = CountsTheBatch().to(dtype), torch.randn(4, 3, dtype=dtype)
    with psh.add_hooks(model, units=["source"]):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"FromCount, handled by the torch.func "
                           r"fallback, was called with no tensor input .*units="):
            psh.compute_grad1(model)
    model.zero_grad(set_to_none=True)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 4)
    with psh.add_hooks(model, units=[""]):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


class ReturnsItsLoss(nn.Module):
    """A model that computes its own (batch-mean) loss when given labels, as transformers'
    models do, first in its outputs."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.body(x)))
        if labels is None:
            return (logits,)
        return nn.functional.cross_entropy(logits, labels), logits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_that_computes_the_batch_loss_is_refused_naming_it(dtype):
    """The whole model as the unit, called with labels: its scalar loss was refused as 'an
    output without a batch dim ... pass batch_dim ... position ids'. Now it names the loss
    inside the unit; the loss outside (the model called without labels) is exact."""
    torch.manual_seed(0)
    model, x, y = ReturnsItsLoss().to(dtype), torch.randn(5, 3, dtype=dtype), torch.arange(5) % 2
    with psh.add_hooks(model, units=[""]):
        model(x, labels=y)[0].backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"ReturnsItsLoss: output 0 is a scalar "
                           r"that reaches the loss.*without labels"):
            psh.compute_norms(model)
    model.zero_grad(set_to_none=True)
    grads = {}  # the float64 loop: sample i's loss, with its labels, by the model itself
    for i in range(5):
        reference = copy.deepcopy(model).double()
        reference(x[i:i + 1].double(), labels=y[i:i + 1])[0].backward()
        for n, p in reference.named_parameters():
            grads.setdefault(n, []).append(p.grad)
    with psh.add_hooks(model, units=[""]):
        nn.functional.cross_entropy(model(x)[0], y).backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), torch.stack(grads[n]),
                                       **loop_tolerance(dtype))


class InvertibleConv(nn.Module):
    """Glow's invertible 1x1 convolution: a raw weight in ``F.conv2d`` (the fallback), and its
    log-determinant: per sample ``[B]`` (``per_sample``), or once for all samples as glow
    implementations return it (``H * W * slogdet``, a scalar)."""

    def __init__(self, per_sample: bool, channels: int = 3):
        super().__init__()
        self.per_sample = per_sample
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(channels, channels))[0])

    def forward(self, x):
        y = nn.functional.conv2d(x, self.weight[:, :, None, None])
        logdet = x.shape[2] * x.shape[3] * torch.linalg.slogdet(self.weight)[1]
        return y, (logdet.expand(x.shape[0]) if self.per_sample else logdet)


class Flow(nn.Module):
    def __init__(self, per_sample: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.mix = InvertibleConv(per_sample)

    def forward(self, x):
        y, logdet = self.mix(torch.tanh(self.conv(x)))
        return 0.5 * y.square().flatten(1).sum(1) - logdet  # each sample's negative log-lik.


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_with_a_per_sample_log_determinant_and_a_shared_one(dtype):
    """A unit whose output is ``[B]`` (crashed in the check of its re-run with an IndexError):
    exact against the float64 loop, grad1, norms and clipping. Its log-determinant as one
    scalar for all samples is refused with the advice to expand it to the batch."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 4, dtype=dtype)
    model = Flow(per_sample=False).to(dtype)
    with psh.add_hooks(model):
        model(x).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'mix' \(InvertibleConv\): output 1 "
                           r"is a scalar .*expanded to the batch inside the module"):
            psh.compute_grad1(model)
    model.mix.per_sample = True
    with psh.add_hooks(model):
        model(x).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], lambda out: out, 5)
    for n, grads in expected.items():
        torch.testing.assert_close(got[n], grads, **loop_tolerance(dtype))
    if dtype == torch.float64:
        assert_norms_match(model, [x], loss_fn=lambda out: out)
        assert_clipping_matches(model, [x], max_grad_norm=0.5, loss_fn=lambda out: out)


class MergedForTheForward(nn.Module):
    """Merges a low-rank update into its frozen weight for each forward and takes it out again
    by replacing the parameter, as peft's LoRA on ``MultiheadAttention`` does, and counts its
    calls in a buffer."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.down, self.up = nn.Parameter(torch.randn(2, 4)), nn.Parameter(torch.randn(4, 2))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        delta = self.up @ self.down
        merged = self.base.weight.detach() + delta
        del self.base.weight
        self.base.weight = merged
        y = self.base(x)
        del self.base.weight
        self.base.weight = nn.Parameter(merged.detach() - delta.detach(), requires_grad=False)
        return torch.tanh(y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_re_run_leaves_the_units_parameters_and_buffers_as_they_were(dtype):
    """The fallback's re-run of a unit whose forward replaces its frozen weight and counts its
    calls in a buffer: exact against the loop, and after it the weight and the count are those
    the step's own forward left (the re-run used to leave the weight it computed under vmap,
    and a count of one more per re-run)."""
    torch.manual_seed(0)
    model = nn.Sequential(MergedForTheForward(), nn.Linear(4, 2)).to(dtype)
    x = torch.randn(5, 4, dtype=dtype)
    reference = copy.deepcopy(model)
    weighted_square(reference(x)).mean()
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    with psh.add_hooks(model, units=["0"]):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad1.double(), expected[n],
                                           **loop_tolerance(dtype))
    assert_same_state(model, reference)


class Decaying(nn.Module):
    """Changes a frozen parameter in place in its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(0.5)
        return self.lin(x) * self.scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("unit", ["0", ""])
def test_a_unit_that_changes_a_parameter_in_place_is_refused_naming_it(unit, dtype):
    """Named by the unit's path and, below it, the changing module's (it named the class
    only: five such modules of one class could not be told apart)."""
    model = nn.Sequential(Decaying(), nn.Linear(4, 2)).to(dtype)
    whose = "its forward" if unit else r"the forward of its '0' \(Decaying\)"
    with psh.add_hooks(model, units=[unit]):
        model(torch.randn(3, 4, dtype=dtype)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=rf"a unit of the torch.func fallback: "
                           rf"{whose} changes the parameter 'scale' in place"):
            psh.compute_grad1(model)


class RunningScale(nn.Module):
    """Updates a buffer at each call from its weight (a weight observer's moving range) and
    divides by it: no statistic over the batch, but a state each call moves."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("range", torch.ones(()))
        self.observing = True

    def forward(self, x):
        if self.observing:
            with torch.no_grad():
                self.range.mul_(0.5).add_(self.lin.weight.abs().max() * 0.5)
        return self.lin(x) / self.range


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_whose_forward_updates_a_state_is_refused_naming_the_state(dtype):
    """A unit that moves a buffer at each call (torch.ao's fake quantization with its observer
    on): re-run from the state the batch's forward left, each sample gets another output. The
    refusal names the buffer and says to freeze the state (it blamed the batch or random
    numbers and advised model.eval(), which does not stop an observer); the buffer is as the
    forward left it, and frozen, the unit is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(RunningScale(), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    psh.add_hooks(model, units=["0"])
    try:
        model(torch.randn(5, 4, dtype=dtype)).square().sum().backward()
        left = model[0].range.clone()
        with pytest.raises(psh.PerSampleHooksError, match=r"'0' \(RunningScale\), a unit .* "
                           r"its re-runs changed its buffers 'range' in place: .* Freeze that "
                           r"state .*disable_observer"):
            psh.compute_grad1(model)
        assert torch.equal(model[0].range, left)
    finally:
        psh.remove_hooks(model)
    model[0].observing = False
    assert_matches_loop(model, [torch.randn(5, 4)], units=["0"])


@pytest.mark.parametrize("fused", [True, False])
def test_torch_ao_quantization_aware_training_with_observers_on_and_frozen(fused):
    """torch.ao's eager QAT (``prepare_qat``; its fake quantization runs in float32 only):
    with the observers on, once the weights moved, the qat layers as units are refused naming
    their observers' buffers (train mode; the fused fake quantization writes them with no new
    version: its re-runs left them moved), or the output observer's buffer changed after the
    forward (eval mode, which does not stop the observers); with the observers frozen
    (``disable_observer``) every quantity is exact against the loop at the same state."""
    ao = pytest.importorskip("torch.ao.quantization")
    torch.manual_seed(0)
    model = nn.Sequential(ao.QuantStub(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3),
                          ao.DeQuantStub())
    model.qconfig = ao.get_default_qat_qconfig("x86") if fused else ao.default_qat_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao.prepare_qat(model, inplace=True)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    psh.add_hooks(model, units=["1", "3"])
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step < 2:
                psh.clear_backprops(model)
                optimizer.step()
                continue
            state = {n: b.clone() for n, b in model.named_buffers()}
            with pytest.raises(psh.PerSampleHooksError, match=r"'1' \(Linear\), a unit .*its "
                               r"re-runs changed its buffers 'weight_fake_quant\..*disable_obs"):
                psh.compute_grad1(model)
            for n, b in model.named_buffers():
                assert torch.equal(b, state[n]), n
        model.eval()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'1' \(Linear\).*(re-runs changed "
                           r"its buffers|was changed in place after the forward .*fake "
                           r"quantization).*disable_observer"):
            psh.compute_grad1(model)
        model.train().apply(ao.disable_observer)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    expected = {n: [] for n, p in model.named_parameters()}
    for i in range(8):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                    list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            expected[n].append(g)
    for n, g in got.items():
        torch.testing.assert_close(g, torch.stack(expected[n]), rtol=1e-4, atol=1e-6)
    flat = torch.cat([torch.stack(g).flatten(1) for g in expected.values()], 1)
    torch.testing.assert_close(norms, flat.norm(dim=1), rtol=1e-4, atol=1e-6)


class BatchNormByFormula(nn.BatchNorm2d):
    """Eval-mode BatchNorm2d written out: the ground truth's, since torch's CPU kernel is wrong
    for the loop's one-sample gradients below."""

    def forward(self, x):
        shape = (1, -1, 1, 1)
        scale = self.weight / (self.running_var + self.eps).sqrt()
        return (x - self.running_mean.view(shape)) * scale.view(shape) + self.bias.view(shape)


class ValueBranch(nn.Sequential):
    def forward(self, x):
        x = self[0](x)
        if x.sum() > -1e9:  # a branch on values: vmap cannot batch it (the loop over samples)
            x = x * 1
        return self[1](x)


class PatchEmbedding(nn.Module):
    """Conv + eval BatchNorm, flattened to tokens (timm XCiT's ConvPatchEmbed): the gradient
    reaching the BatchNorm is a channels-last view, and one sample's has the batch stride C."""

    def __init__(self, stem: type[nn.Sequential], norm: type[nn.BatchNorm2d]):
        super().__init__()
        self.proj = stem(nn.Conv2d(3, 4, 3, 2, 1, bias=False), norm(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.proj(x).flatten(2).transpose(1, 2)[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("units", [["proj"], [""]])
@pytest.mark.parametrize("stem", [nn.Sequential, ValueBranch])
def test_a_unit_with_an_eval_batch_norm_under_a_channels_last_gradient(stem, units, dtype):
    """Re-run under vmap and one sample at a time (where torch's batch_norm backward misreads
    such a gradient: per-sample gradients 170% off, refused by the sum check as coupling)."""
    torch.manual_seed(0)
    model = PatchEmbedding(stem, nn.BatchNorm2d).eval()
    with torch.no_grad():
        norm = model.proj[1]
        norm.running_mean.normal_(), norm.running_var.uniform_(0.5, 2), norm.weight.normal_()
    truth = PatchEmbedding(stem, BatchNormByFormula).double().eval()
    truth.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    expected = loop_grads(truth, [x.double()], weighted_square, 4)
    model, x = model.to(dtype), x.to(dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "PatchEmbedding|ValueBranch, a unit")
        with psh.add_hooks(model, units=units):
            weighted_square(model(x)).mean().backward()
            psh.compute_grad1(model)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad1.double(), expected[name],
                                           **loop_tolerance(dtype))


class Neighbours(nn.Module):
    """A graph layer: each node's row plus its neighbour's, by an index into the rows of the
    whole batch (not split by sample)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, edges):
        h = self.lin(x)
        return h + torch.zeros_like(h).index_add_(0, edges[1], h[edges[0]])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_unit_indexing_rows_of_other_samples_is_refused_naming_the_index(dtype):
    """Its re-run one sample at a time indexes past the sample's one row: refused naming the
    unit and an index not split by sample, where it raised a bare IndexError."""
    torch.manual_seed(0)
    model = Neighbours().to(dtype)
    x, edges = torch.randn(4, 3, dtype=dtype), torch.tensor([[0, 1, 2, 3, 1], [1, 0, 3, 2, 2]])
    with psh.add_hooks(model, units=[""]):
        model(x, edges).square().sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"Neighbours, a unit of the torch.func "
                           r"fallback, could not be re-run per sample.*IndexError.*An index "
                           r"among its inputs that is not split by sample"):
            psh.compute_norms(model)


class AdapterAtInit(nn.Module):
    """LoRA at its initialisation: ``B = 0``, so the dropout before ``A`` changes no output and
    only a refusal where it is called can tell that the re-run drew another mask (``B``'s
    per-sample gradients depend on it). ``called=False``: the dropout is held, never called
    (peft's ``lora.Embedding``)."""

    def __init__(self, called: bool):
        super().__init__()
        self.base, self.called, self.drop = nn.Linear(3, 3), called, nn.Dropout(0.5)
        self.A, self.B = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.zeros(3, 2))

    def forward(self, x):
        return self.base(x) + (self.drop(x) if self.called else x) @ self.A.T @ self.B.T


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_units_dropout_is_refused_where_its_forward_calls_it(dtype):
    torch.manual_seed(0)
    model = AdapterAtInit(called=True).to(dtype).train()
    with psh.add_hooks(model, units=[""]):
        weighted_square(model(torch.randn(4, 3, dtype=dtype))).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"AdapterAtInit, a unit .* calls "
                           r"dropout in training mode \(drop, Dropout\)"):
            psh.compute_grad1(model)
    model = AdapterAtInit(called=False).to(dtype).train()
    assert_matches_loop(model, [torch.randn(4, 3)], units=[""], **loop_tolerance(dtype))


class ConvertsInForward(nn.Module):
    """Switch Transformers' router: ``self.sub = self.sub.to(self.dtype)`` in every forward."""

    def __init__(self):
        super().__init__()
        self.pre, self.sub = nn.Linear(5, 4), nn.Linear(4, 3)
        self.dtype: torch.dtype | None = None  # (None: the model's)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        self.sub = self.sub.to(self.dtype or self.pre.weight.dtype)
        return self.sub(h) * h[:, :3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_a_unit_that_converts_a_child_in_its_forward(frozen, dtype):
    """Module.to in a unit's forward assigns `param.data = param.to(...)`, which under
    torch.func gave a frozen parameter (swapped in as a plain tensor) a wrapper's storage-less
    body: the next read of it was a segmentation fault (compute_grad1, and compute_norms of a
    tied parameter, on Switch Transformers); a trainable one sent the unit to the loop over
    samples with a warning. A conversion that changes nothing now does nothing in the re-run:
    vmapped, exact against the float64 loop; a real one is refused naming the module."""
    torch.manual_seed(0)
    model = nn.Sequential(ConvertsInForward(), nn.Linear(3, 2)).to(dtype)
    model[0].sub.requires_grad_(not frozen)
    x = torch.randn(6, 5, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 6)
    truth = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    with psh.add_hooks(model, units=["0"]), warnings.catch_warnings():
        warnings.simplefilter("error")  # (no loop over samples)
        weighted_square(model(x)).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
        torch.testing.assert_close(norms.double(), truth, **loop_tolerance(dtype))
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).mean().backward()
        model[0].dtype = torch.float16 if dtype == torch.float32 else torch.float32
        with pytest.raises(psh.PerSampleHooksError, match=r"Linear: its forward converts its "
                           r"parameter 'weight'.*Convert the model before the step's forward"):
            psh.compute_grad1(model)


class EarlyExit(nn.Module):
    """The deep path run on the samples its cheap head is not confident about, ``x[keep]``."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 4)
        self.deep = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        self.threshold = 0.0

    def forward(self, x):
        first = self.head(x)
        keep = first.softmax(-1).amax(-1) < self.threshold
        out = first.clone()
        if keep.any():
            out[keep] = self.deep(x[keep])
        return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_early_exit_on_some_rows_is_refused_with_what_works(dtype):
    """The deep path seeing some of the samples' rows was refused with the generic message
    (clear_backprops, batch_dim, position ids); it names the module, the rows and two ways
    that work, one of which, the model as a unit, is then exact against the float64 loop."""
    torch.manual_seed(0)
    model, x = EarlyExit().to(dtype), torch.randn(8, 6, dtype=dtype)
    confidence = model.head(x).softmax(-1).amax(-1).sort().values
    model.threshold = float(confidence[2] + confidence[3]) / 2  # 3 of the 8 go deeper
    reference = copy.deepcopy(model).double()
    with psh.add_hooks(model):
        model(x).square().sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'deep.0' saw 3 rows, fewer than "
                           r"the 8 samples.*torch.where.*one unit"):
            psh.compute_grad1(model, loss_type="sum")
    model.zero_grad()
    with psh.add_hooks(model, units=[""]):
        model(x).square().sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    for i in range(8):
        grads = torch.autograd.grad(reference(x[i:i + 1].double()).square().sum(),
                                    list(reference.parameters()), allow_unused=True)
        for (n, p), g in zip(reference.named_parameters(), grads):
            want = torch.zeros_like(p) if g is None else g
            torch.testing.assert_close(got[n][i].double(), want, **loop_tolerance(dtype))
