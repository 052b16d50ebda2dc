"""Fuzzing: hypothesis builds random models from every supported layer family (Linear, Conv /
ConvTranspose 1-3d, RNN/LSTM/GRU, Embedding, LayerNorm, RMSNorm, GroupNorm, InstanceNorm,
BatchNorm in eval mode, MultiheadAttention (its native rule; ``PSH_FUZZ_ATTENTION=0`` leaves it
out); random widths, kernel options,
nesting, reuse, frozen parameters) and random batches, and checks ``compute_grad1``,
``compute_norms``, ``clip_grads`` (after an ordinary backward, and after DPSGD's backward that forms
per-sample gradients on arrival), the second moments (``compute_fisher_diag``,
``compute_grad_variance``, ``compute_gram``), ``compute_hess`` (Linear and conv layers) and
(Linear layers) ``compute_kfac`` ("expand" and "reduce") against the float64 per-sample
loop; then the Fisher diagonal,
Gram matrix, ``compute_hess`` and ``compute_kfac`` after ``backprop_hess`` (several backward
passes; every other example's passes to the hooked outputs only, ``edges=``) against the loop's
per-sample Jacobian rows.

Profiles, registered in ``tests/conftest.py`` and picked by ``PSH_FUZZ_PROFILE``:
- ``ci`` (default): ``FUZZ_PROFILES["ci"]`` examples per test, derandomized (the same examples
  every run), bounded for the 2-core CI machine;
- ``long``, on demand, new examples every run; hypothesis prints any failing model spec::

      PSH_FUZZ_PROFILE=long python -m pytest tests/test_fuzz.py -q --hypothesis-show-statistics

``PSH_FUZZ_EXAMPLES=N`` overrides the number of examples per test in either profile.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
from conftest import FUZZ_PROFILE
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from models import AppliedTwice
from norms_truth import loop_clipped
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, weighted_square
from per_sample_hooks.curvature import compute_kfac
from per_sample_hooks.dp import OutputEdges

FUZZ = settings(settings.get_profile(FUZZ_PROFILE),
                **({"max_examples": int(os.environ["PSH_FUZZ_EXAMPLES"])}
                   if os.environ.get("PSH_FUZZ_EXAMPLES") else {}))

ACTIVATIONS = [nn.Tanh, nn.GELU, nn.Sigmoid, lambda: nn.ReLU(inplace=True), nn.Identity]


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
            layers.append(AppliedTwice(inner) if kind == "twice" else Residual(inner))
        layers.append(draw(st.sampled_from(ACTIVATIONS))())
        if draw(st.integers(0, 2)) == 0:
            layers.append(draw(feature_norms(width)))
    return nest(draw, layers), (*leading, first)


@st.composite
def feature_norms(draw, width: int):
    """A norm over the last dim: LayerNorm (width > 1: over one feature its output is constant)
    or RMSNorm (eps 1e-5: the default float64 eps amplifies rounding of near-zero inputs by
    ~1e8, past any fixed tolerance), affine or not, with or without bias."""
    if width > 1 and draw(st.booleans()):
        return nn.LayerNorm(width, elementwise_affine=draw(st.booleans()),
                            bias=draw(st.booleans()))
    return nn.RMSNorm(width, eps=1e-5, elementwise_affine=draw(st.booleans()))


@st.composite
def channel_norms(draw, channels: int, dims: int):
    """GroupNorm, InstanceNorm (affine) or BatchNorm in eval mode (running statistics)."""
    kind = draw(st.sampled_from(["group", "instance", "batch"]))
    if kind == "group":
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if channels % g == 0]))
        return nn.GroupNorm(groups, channels, affine=draw(st.booleans()))
    cls = ({1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d} if kind == "instance"
           else {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d})[dims]
    norm = cls(channels, affine=True)
    if kind == "batch":
        with torch.no_grad():
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
        norm.eval()
    return norm


ATTENTION_IN_POOL = os.environ.get("PSH_FUZZ_ATTENTION", "1") == "1"
"""MultiheadAttention is in the pool (``PSH_FUZZ_ATTENTION=0`` takes it out, to fuzz the other
layers faster). It was out while it went through the fallback, whose norms raised a KeyError on
``out_proj.weight`` (fixed, tested in test_fallback.py)."""


class Attention(nn.Module):
    """Self-attention (``nn.MultiheadAttention``, its native rule)."""

    def __init__(self, width: int, heads: int, bias: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, bias=bias, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


@st.composite
def token_models(draw):
    """Embedding of token ids, then attention / Linear / norms on ``[B, T, d]``."""
    vocabulary, width = draw(st.integers(2, 7)), draw(st.sampled_from([2, 4, 6]))
    layers: list[nn.Module] = [nn.Embedding(vocabulary, width,
                                            padding_idx=draw(st.sampled_from([None, 0])))]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["attention", "linear", "norm"] if ATTENTION_IN_POOL
                                    else ["linear", "norm"]))
        if kind == "attention":
            layers.append(Attention(width, draw(st.sampled_from([1, 2])), draw(st.booleans())))
        elif kind == "linear":
            layers += [nn.Linear(width, width), draw(st.sampled_from(ACTIVATIONS))()]
        else:
            layers.append(draw(feature_norms(width)))
    layers.append(nn.Linear(width, draw(st.integers(1, 3))))
    return nest(draw, layers), vocabulary, draw(st.integers(1, 4))


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
        if draw(st.integers(0, 2)) == 0:
            layers.append(draw(channel_norms(out, dims)))
        layers.append(draw(st.sampled_from(ACTIVATIONS))())
        channels = out
    try:
        with torch.no_grad():
            probe = nn.Sequential(*layers)
            probe.train(False)
            # one sample, as the per-sample loop runs it: GroupNorm refuses a group of one value
            features = probe(torch.zeros(1, *shape))[0].numel()
    except (RuntimeError, ValueError):  # output too small for the kernel or norm, ...
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
                     batch_dim: int = 0, edges: bool = False) -> None:
    """compute_grad1, compute_norms, clip_grads, the second moments, compute_hess and
    compute_kfac (Linear layers) of one hooked backward vs the float64 loop; then the same
    curvature after ``backprop_hess`` (:func:`check_gauss_newton`, ``edges``: its passes to the
    hooked outputs only).

    ``batch_dim`` is where the batch is in ``x`` (1 for a sequence-first RNN, whose rule knows
    its layout); the model's output is batch first."""
    model = model.double()
    x = x.double() if x.is_floating_point() else x  # token ids stay integers
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
        moments = second_moments(model, loss_type)
        kfac = hooked_kfac(model, loss_type)
        clip_norms = psh.clip_grads(model, max_norm, loss_type=loss_type)
        clipped = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                   for n, p in model.named_parameters() if p.requires_grad}
        formed = formed_step(model, x, loss_type, max_norm)
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
    formed_grad1, formed_norms, formed_clip_norms, formed_clipped = formed
    torch.testing.assert_close(formed_norms, total, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(formed_clip_norms, total, rtol=1e-9, atol=1e-10)
    for n, g in loop_clipped(expected, total, max_norm, loss_type).items():
        torch.testing.assert_close(formed_grad1[n], expected[n], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"formed grad1 {n}: {m}")
        torch.testing.assert_close(formed_clipped[n], g, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"formed clipped {n}: {m}")
    check_second_moments(moments, expected, loss_type)
    assert_kfac_close(kfac, loop_kfac(model, x, loss_type, batch_dim))
    check_gauss_newton(model, x, batch_dim, edges, loss_type)


def hess_blocks(model: nn.Module, loss_type: str) -> dict[str, torch.Tensor]:
    """``p.hess`` of the Linear and conv layers (others skipped), taken off the parameters."""
    psh.compute_hess(model, loss_type, unsupported="skip")
    hess = {}
    for n, p in model.named_parameters():
        if hasattr(p, "hess"):
            hess[n] = p.hess.clone()
            del p.hess
    return hess


def second_moments(model: nn.Module, loss_type: str) -> tuple:
    """Fisher diagonal, gradient variance, Gram matrix and ``p.hess`` of the step the hooks
    captured."""
    fisher = {n: t.clone() for n, t in psh.compute_fisher_diag(model, loss_type).items()}
    variance = {n: t.clone() for n, t in psh.compute_grad_variance(model, loss_type).items()}
    gram = psh.compute_gram(model, loss_type).clone()
    return fisher, variance, gram, hess_blocks(model, loss_type)


def check_second_moments(moments: tuple, expected: dict[str, torch.Tensor],
                         loss_type: str) -> None:
    """:func:`second_moments` against the per-sample gradients of the float64 loop."""
    fisher, variance, gram, hess = moments
    assert variance.keys() == expected.keys()
    for n, g in expected.items():
        # E[g^2] - E[g]^2: where the samples' gradients agree (variance 0) the cancellation
        # leaves a few ulps of E[g^2] (1e-10 absolute of a second moment of 1.6e6)
        second = float(g.square().mean(0).max())
        torch.testing.assert_close(variance[n], g.var(0, unbiased=False), rtol=1e-9,
                                   atol=1e-10 + 64 * torch.finfo(g.dtype).eps * second,
                                   msg=lambda m, n=n: f"variance {n}: {m}")
    check_pass_moments(fisher, gram, hess, {n: g.unsqueeze(1) for n, g in expected.items()},
                       loss_type, "")


def check_pass_moments(fisher: dict, gram: torch.Tensor, hess: dict,
                       rows: dict[str, torch.Tensor], loss_type: str, label: str) -> None:
    """Fisher diagonal, Gram matrix and ``p.hess`` against per-sample, per-pass gradient rows
    ``J [B, K, *p]`` (``K`` backward passes): ``sum_ik J^2``, ``sum_k <J_ik, J_jk>``,
    ``sum_ik J J^T`` (``1/N`` of it for the mean)."""
    flat = {n: j.flatten(2) for n, j in rows.items()}
    assert fisher.keys() == rows.keys()
    for n, j in rows.items():
        torch.testing.assert_close(fisher[n], j.square().sum((0, 1)), rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{label}fisher diag {n}: {m}")
    everything = torch.cat(list(flat.values()), 2)
    torch.testing.assert_close(gram, torch.einsum("ikp,jkp->ij", everything, everything),
                               rtol=1e-9, atol=1e-10)
    mean = everything.shape[0] if loss_type == "mean" else 1
    for n, block in hess.items():
        torch.testing.assert_close(block, torch.einsum("ikp,ikq->pq", flat[n], flat[n]) / mean,
                                   rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{label}hess {n}: {m}")


def formed_step(model: nn.Module, x: torch.Tensor, loss_type: str, max_norm: float) -> tuple:
    """DPSGD's step on a hooked model: the output-edge backward forming per-sample gradients on
    arrival, then grad1, norms and clipping with the records released."""
    edges = OutputEdges(model, form_on_arrival=True)
    try:
        model.zero_grad(set_to_none=True)
        losses = weighted_square(model(x))
        edges.backward(losses.mean() if loss_type == "mean" else losses.sum())
        norms = psh.compute_norms(model, loss_type=loss_type)
        psh.compute_grad1(model, loss_type=loss_type)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
        clip_norms = psh.clip_grads(model, max_norm, loss_type=loss_type, release_records=True)
        clipped = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                   for n, p in model.named_parameters() if p.requires_grad}
    finally:
        edges.remove()
    return grad1, norms, clip_norms, clipped


def loop_kfac(model: nn.Module, x: torch.Tensor, loss_type: str, batch_dim: int = 0,
              objectives: Callable[[torch.Tensor], list[torch.Tensor]] | None = None
              ) -> dict[str, dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]]:
    """``{"expand": factors, "reduce": factors}`` of every Linear with a trainable weight whose
    output reaches the loss, one forward per sample and one plain backward per objective (the
    convention of ``per_sample_hooks.curvature``, with a 1 appended to ``a`` for a trainable
    bias and ``x = dl_i/dz``; a sample's calls add their positions ``T``): expand
    ``A = 1/(N T) sum_{i,t} a a^T``, ``G = 1/N sum_{i,k,t} x x^T``; reduce
    ``A = 1/(N T^2) sum_i (sum_t a)(sum_t a)^T``, ``G = 1/N sum_{i,k} (sum_t x)(sum_t x)^T``,
    with ``k`` the objectives (backward passes); ``loss_type="sum"`` drops the ``1/N`` of
    ``G``. ``objectives(output)``: the scalars of one sample's passes; default its
    ``weighted_square`` loss."""
    objectives = objectives or (lambda output: [weighted_square(output).sum()])
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
    sums = {approx: {m: [0.0, 0.0] for m in linears} for approx in ("expand", "reduce")}
    positions = dict.fromkeys(linears, 0)  # per sample
    records: list[tuple[nn.Module, torch.Tensor, list]] = []

    def hook(module, args, output):
        a = args[0].reshape(-1, module.in_features)
        if module.bias is not None and module.bias.requires_grad:
            a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        output = output.clone()
        grads: list = []
        output.register_hook(grads.append)
        records.append((module, a, grads))
        return output

    handles = [m.register_forward_hook(hook) for m in linears]
    batch = x.shape[batch_dim]
    try:
        for i in range(batch):
            records.clear()
            scalars = objectives(model(x.narrow(batch_dim, i, 1)))
            for k, scalar in enumerate(scalars):
                if scalar.requires_grad:
                    scalar.backward(retain_graph=k < len(scalars) - 1)
            summed: dict[nn.Module, list] = {}  # a summed over calls and positions, g per pass
            for module, a, grads in records:
                if not grads:
                    continue
                expand = sums["expand"][module]
                expand[0] = expand[0] + a.T @ a
                part = summed.setdefault(module, [0.0, [0.0] * len(grads)])
                part[0] = part[0] + a.sum(0)
                for k, grad in enumerate(grads):
                    g = grad.reshape(-1, module.out_features)
                    expand[1] = expand[1] + g.T @ g
                    part[1][k] = part[1][k] + g.sum(0)
                if i == 0:
                    positions[module] += len(a)
            for module, (a, gs) in summed.items():
                reduce = sums["reduce"][module]
                reduce[0] = reduce[0] + torch.outer(a, a)
                reduce[1] = reduce[1] + sum(torch.outer(g, g) for g in gs)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    scale = batch if loss_type == "mean" else 1
    divisors = {"expand": lambda t: batch * t, "reduce": lambda t: batch * t * t}
    return {approx: {m: (a / divisors[approx](positions[m]), g / scale)
                     for m, (a, g) in factors.items() if positions[m]}
            for approx, factors in sums.items()}


def hooked_kfac(model: nn.Module, loss_type: str) -> dict[str, dict]:
    """``compute_kfac`` of the step for both approximations (Linear layers), cloned."""
    return {approx: {m: (a.clone(), g.clone()) for m, (a, g) in
                     compute_kfac(model, approx, loss_type, unsupported="skip").items()
                     if isinstance(m, nn.Linear)}
            for approx in ("expand", "reduce")}


def assert_kfac_close(got: dict[str, dict], expected: dict[str, dict]) -> None:
    for approx, factors in expected.items():
        assert got[approx].keys() == factors.keys(), approx
        for module, (a, g) in factors.items():
            torch.testing.assert_close(got[approx][module][0], a, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, x=approx: f"A {x}: {m}")
            torch.testing.assert_close(got[approx][module][1], g, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, x=approx: f"G {x}: {m}")


def check_gauss_newton(model: nn.Module, x: torch.Tensor, batch_dim: int, edges: bool,
                       loss_type: str) -> None:
    """After ``backprop_hess(output, "LeastSquares", loss_type=loss_type)`` (the output
    flattened to ``[B, o]``: one pass per column; ``edges``: passes to the hooked outputs only),
    the Fisher diagonal, Gram matrix, ``p.hess`` (Linear and conv layers) and KFAC factors
    (Linear) against the float64 loop's per-sample Jacobian rows ``J_ik = dy_ik/dp``:
    ``sum_ik J^2``, ``sum_k <J_ik, J_jk>``, ``sum_ik J J^T`` (``1/N`` of it for the mean)."""
    psh.add_hooks(model)
    recorder = OutputEdges(model) if edges else None
    try:
        output = model(x)
        psh.backprop_hess(output.reshape(output.shape[0], -1), "LeastSquares",
                          loss_type=loss_type, edges=recorder)
        fisher = {n: t.clone() for n, t in psh.compute_fisher_diag(model, loss_type).items()}
        gram = psh.compute_gram(model, loss_type).clone()
        hess = hess_blocks(model, loss_type)
        kfac = hooked_kfac(model, loss_type)
    finally:
        if recorder is not None:
            recorder.remove()
        psh.remove_hooks(model)
    batch, columns = x.shape[batch_dim], output[0].numel()
    rows = [loop_grads(model, [x], lambda out, k=k: out.reshape(out.shape[0], -1)[:, k], batch,
                       batch_dim) for k in range(columns)]
    jacobian = {n: torch.stack([r[n] for r in rows], 1) for n in rows[0]}  # [B, o, *p]
    check_pass_moments(fisher, gram, hess, jacobian, loss_type, "GN ")
    assert_kfac_close(kfac, loop_kfac(model, x, loss_type, batch_dim,
                                      lambda out: list(out.flatten())))


common = dict(batch=st.integers(1, 4), loss_type=st.sampled_from(["mean", "sum"]),
              max_norm=st.sampled_from([1e-3, 0.3, 1e3]), seed=st.integers(0, 2**16))


def check_feedforward(spec, data, batch, loss_type, max_norm, seed):
    """A ``(model, input shape without batch)`` spec, some parameters frozen, on a random
    batch."""
    model, shape = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    check_everything(model, torch.randn(batch, *shape), loss_type, max_norm,
                     edges=seed % 2 == 0)


@FUZZ
@given(spec=dense_models(), data=st.data(), **common)
def test_fuzz_dense(spec, data, batch, loss_type, max_norm, seed):
    check_feedforward(spec, data, batch, loss_type, max_norm, seed)


@FUZZ
@given(spec=conv_models(), data=st.data(), **common)
def test_fuzz_conv(spec, data, batch, loss_type, max_norm, seed):
    check_feedforward(spec, data, batch, loss_type, max_norm, seed)


@FUZZ
@given(spec=recurrent_models(), data=st.data(), **common)
def test_fuzz_recurrent(spec, data, batch, loss_type, max_norm, seed):
    model, (length, features), batch_first = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    if batch_first:
        check_everything(model, torch.randn(batch, length, features), loss_type, max_norm,
                         edges=seed % 2 == 0)
    else:
        check_everything(model, torch.randn(length, batch, features), loss_type, max_norm,
                         batch_dim=1, edges=seed % 2 == 0)


@FUZZ
@given(spec=token_models(), data=st.data(), **common)
def test_fuzz_tokens(spec, data, batch, loss_type, max_norm, seed):
    model, vocabulary, length = spec
    torch.manual_seed(seed)
    freeze_some(data.draw, model)
    check_everything(model, torch.randint(0, vocabulary, (batch, length)), loss_type, max_norm,
                     edges=seed % 2 == 0)
