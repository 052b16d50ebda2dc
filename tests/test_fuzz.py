"""Fuzzing: hypothesis builds random models from every supported layer family (random widths,
kernel options, nesting, reuse, frozen parameters) and random batches, and checks
``compute_grad1``, ``compute_norms`` and ``clip_grads`` against the float64 per-sample loop.

Profiles (environment variable ``PSH_FUZZ``):
- unset / ``ci``: ``CI_EXAMPLES`` examples per model family (bounded: ~30 s in all on the
  2-core CI machine);
- ``long``: ``LONG_EXAMPLES`` per family, for a run on demand:
  ``PSH_FUZZ=long pytest tests/test_fuzz.py``; hypothesis prints any failing model spec.
  ``PSH_FUZZ_EXAMPLES=N`` sets the number of examples per family directly. The ``ci`` profile
  is derandomized (the same examples every run); ``long`` draws new ones each run.
"""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from norms_truth import loop_clipped
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, weighted_square

CI_EXAMPLES = 12
LONG_EXAMPLES = 400
PROFILE = os.environ.get("PSH_FUZZ", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"PSH_FUZZ must be 'ci' or 'long', got {PROFILE!r}")
EXAMPLES = int(os.environ.get("PSH_FUZZ_EXAMPLES", 0)) or (
    LONG_EXAMPLES if PROFILE == "long" else CI_EXAMPLES)
FUZZ = settings(max_examples=EXAMPLES,
                deadline=None, derandomize=PROFILE == "ci",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

ACTIVATIONS = [nn.Tanh, nn.GELU, nn.Sigmoid, lambda: nn.ReLU(inplace=True), nn.Identity]


class Twice(nn.Module):
    """Reuse: the same module applied twice (``f(f(x))``), contributions add up."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.tanh(self.inner(x)))


class Residual(nn.Module):
    """Reuse across branches: ``x + f(x) + 0.5 f(2x)``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x) + 0.5 * self.inner(2 * x)


class RecurrentHead(nn.Module):
    def __init__(self, rnn: nn.RNNBase, head: nn.Module):
        super().__init__()
        self.rnn, self.head = rnn, head

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out if self.rnn.batch_first else out.transpose(0, 1))


def nest(draw, layers: list[nn.Module]) -> nn.Module:
    """Group a random contiguous run of ``layers`` into a nested Sequential."""
    if len(layers) > 2 and draw(st.booleans()):
        i = draw(st.integers(0, len(layers) - 2))
        j = draw(st.integers(i + 2, len(layers)))
        layers = layers[:i] + [nn.Sequential(*layers[i:j])] + layers[j:]
    return nn.Sequential(*layers)


def freeze_some(draw, model: nn.Module) -> None:
    params = list(model.parameters())
    frozen = draw(st.lists(st.booleans(), min_size=len(params), max_size=len(params)))
    if all(frozen):
        frozen[0] = False
    for p, f in zip(params, frozen):
        if f and draw(st.integers(0, 3)) == 0:  # freeze about one in four of those drawn
            p.requires_grad_(False)


@st.composite
def dense_models(draw):
    """Linear stacks on ``[B, *, d]``: random widths, biases, activations, reuse, nesting."""
    width = first = draw(st.integers(1, 5))
    leading = draw(st.lists(st.integers(1, 3), max_size=2))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["linear", "twice", "residual"]))
        if kind == "linear":
            out = draw(st.integers(1, 5))
            layers.append(nn.Linear(width, out, bias=draw(st.booleans())))
            width = out
        else:
            inner = nn.Linear(width, width, bias=draw(st.booleans()))
            layers.append(Twice(inner) if kind == "twice" else Residual(inner))
        layers.append(draw(st.sampled_from(ACTIVATIONS))())
    return nest(draw, layers), (*leading, first)


@st.composite
def conv_models(draw):
    """One or two (transposed) convolutions of 1, 2 or 3 dims with random kernel, stride,
    padding, dilation, groups and bias, then a Linear head."""
    dims = draw(st.sampled_from([1, 2, 2, 3]))
    size = draw(st.integers(3, {1: 9, 2: 6, 3: 4}[dims]))
    channels = draw(st.integers(1, 4))
    shape = (channels, *([size] * dims))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 2))):
        transposed = draw(st.booleans())
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if channels % g == 0]))
        out = groups * draw(st.integers(1, 2))
        kernel = draw(st.integers(1, 3))
        stride = draw(st.integers(1, 2))
        dilation = draw(st.integers(1, 2))
        padding = draw(st.integers(0, 1))
        cls = ({1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d} if transposed
               else {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d})[dims]
        options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                       bias=draw(st.booleans()))
        if transposed and stride > 1:
            options["output_padding"] = draw(st.integers(0, 1))
        layers.append(cls(channels, out, kernel, **options))
        layers.append(draw(st.sampled_from(ACTIVATIONS))())
        channels = out
    try:
        with torch.no_grad():
            features = nn.Sequential(*layers)(torch.zeros(1, *shape)).numel()
    except RuntimeError:  # output too small for the kernel, invalid output_padding, ...
        assume(False)
    assume(0 < features <= 400)
    layers += [nn.Flatten(), nn.Linear(features, draw(st.integers(1, 3)))]
    return nest(draw, layers), shape


@st.composite
def recurrent_models(draw):
    cls = draw(st.sampled_from([nn.RNN, nn.LSTM, nn.GRU]))
    features, hidden = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    options = dict(num_layers=draw(st.integers(1, 2)), bias=draw(st.booleans()),
                   batch_first=draw(st.booleans()), bidirectional=draw(st.booleans()))
    if cls is nn.LSTM and hidden > 1 and draw(st.booleans()):
        options["proj_size"] = draw(st.integers(1, hidden - 1))
    rnn = cls(features, hidden, **options)
    out = options.get("proj_size") or hidden
    head = nn.Linear(out * (2 if options["bidirectional"] else 1), 2)
    length = draw(st.integers(1, 4))
    return RecurrentHead(rnn, head), (length, features), options["batch_first"]


def check_everything(model: nn.Module, x: torch.Tensor, loss_type: str, max_norm: float,
                     batch_dim: int = 0) -> None:
    """compute_grad1, compute_norms and clip_grads of one hooked backward vs the float64 loop.

    ``batch_dim`` is where the batch is in ``x`` (1 for a sequence-first RNN, whose rule knows
    its layout); the model's output is batch first."""
    model, x = model.double(), x.double()
    batch = x.shape[batch_dim]
    psh.add_hooks(model)
    try:
        model.zero_grad(set_to_none=True)
        losses = weighted_square(model(x))
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        norms = psh.compute_norms(model, loss_type=loss_type)
        psh.compute_grad1(model, loss_type=loss_type)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if p.requires_grad:
                reduced = p.grad1.mean(0) if loss_type == "mean" else p.grad1.sum(0)
                expected = torch.zeros_like(p) if p.grad is None else p.grad
                torch.testing.assert_close(reduced, expected, rtol=1e-9, atol=1e-10)
            else:
                assert not hasattr(p, "grad1"), f"frozen {n} got grad1"
        clip_norms = psh.clip_grads(model, max_norm, loss_type=loss_type)
        clipped = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                   for n, p in model.named_parameters() if p.requires_grad}
    finally:
        psh.remove_hooks(model)
    expected = loop_grads(model, [x], weighted_square, batch, batch_dim)
    assert grad1.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(grad1[n], expected[n], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"grad1 {n}: {m}")
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, total, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(clip_norms, total, rtol=1e-9, atol=1e-10)
    for n, g in loop_clipped(expected, total, max_norm, loss_type).items():
        torch.testing.assert_close(clipped[n], g, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"clipped {n}: {m}")


common = dict(batch=st.integers(1, 4), loss_type=st.sampled_from(["mean", "sum"]),
              max_norm=st.sampled_from([1e-3, 0.3, 1e3]), seed=st.integers(0, 2**16))


@FUZZ
@given(spec=dense_models(), data=st.data(), **common)
def test_fuzz_dense(spec, data, batch, loss_type, max_norm, seed):
    model, shape = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    check_everything(model, torch.randn(batch, *shape), loss_type, max_norm)


@FUZZ
@given(spec=conv_models(), data=st.data(), **common)
def test_fuzz_conv(spec, data, batch, loss_type, max_norm, seed):
    model, shape = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    check_everything(model, torch.randn(batch, *shape), loss_type, max_norm)


@FUZZ
@given(spec=recurrent_models(), data=st.data(), **common)
def test_fuzz_recurrent(spec, data, batch, loss_type, max_norm, seed):
    model, (length, features), batch_first = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    if batch_first:
        check_everything(model, torch.randn(batch, length, features), loss_type, max_norm)
    else:
        check_everything(model, torch.randn(length, batch, features), loss_type, max_norm,
                         batch_dim=1)
