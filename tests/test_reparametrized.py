"""Weights computed from parameters by torch's reparametrizations (``parametrizations.weight_norm``,
``spectral_norm``, ``orthogonal``, a user's ``register_parametrization``, the deprecated
``weight_norm`` / ``spectral_norm`` hooks) and a parameter added to a built-in layer: the module
is one unit of the torch.func fallback (per_sample_hooks/reparametrized.py), exact against the
float64 per-sample loop, in float32 and float64; a spectral norm in training mode keeps the
power-iteration vectors of the step's forward. Before, the deprecated hooks gave silently wrong
``grad1`` and norms (the Linear rule wrote bias-shaped rows into ``weight_g`` / ``weight_v``),
and a parametrized layer was refused with advice that could not work."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from norms_truth import loop_clipped, loop_norms
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

import per_sample_hooks as psh
from ground_truth import loop_tolerance, seeded, weighted_square
from per_sample_hooks.errors import PerSampleHooksError, UnsupportedModuleError


class Exp(nn.Module):
    """A user's parametrization: a positive weight."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight.exp()


def user_parametrization(module: nn.Module) -> nn.Module:
    parametrize.register_parametrization(module, "weight", Exp())
    return module


KINDS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "user": user_parametrization,
    "deprecated weight_norm": torch.nn.utils.weight_norm,
    "deprecated spectral_norm": torch.nn.utils.spectral_norm,
}

LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    # name: (layer, sample shape, features after flattening its output)
    "linear": (lambda: nn.Linear(4, 3), (2, 4), 6),
    "conv2d": (lambda: nn.Conv2d(2, 3, 3, padding=1, groups=1), (2, 4, 4), 48),
}
BATCH = 5


def build(kind: str, layer: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    make, _, features = LAYERS[layer]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated ones say so
        first = KINDS[kind](make())
    return nn.Sequential(first, nn.Tanh(), nn.Flatten(), nn.Linear(features, 2)).to(dtype)


def batch(layer: str, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(BATCH, *LAYERS[layer][1], generator=seeded(1)).to(dtype)


def hooked_quantities(model: nn.Module, x: Tensor, loss_type: str, max_norm: float
                      ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """One hooked step: ``(grad1, per-parameter norms, clipped p.grad)``; asserts that the
    step's buffers (power-iteration vectors) are left as the forward left them."""
    state = psh.add_hooks(model)
    try:
        assert [state.modules[u][0] for u in state.units] == ["0"]
        model.zero_grad(set_to_none=True)
        losses = weighted_square(model(x))
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        psh.compute_grad1(model, loss_type=loss_type)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters()}
        norms = psh.compute_norms(model, loss_type=loss_type, per_param=True)
        psh.clip_grads(model, max_norm, loss_type=loss_type)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        for n, b in model.named_buffers():
            torch.testing.assert_close(b, buffers[n], rtol=0, atol=0, msg=f"{n} changed")
    finally:
        psh.remove_hooks(model)
    return grad1, norms, clipped


def assert_quantities_match(got: tuple[dict[str, Tensor], ...], truth: nn.Module, x: Tensor,
                            loss_type: str, max_norm: float, dtype: torch.dtype) -> None:
    """Against the float64 loop of ``truth`` in eval mode (a spectral norm then uses the
    vectors its training-mode forward updated, without iterating again), within the rounding
    of ``dtype``."""
    grad1, norms, clipped = got
    close = loop_tolerance(dtype)
    total, per_param, grads = loop_norms(truth.eval(), [x.double()], weighted_square, loss_type)
    expected_clipped = loop_clipped(grads, total, max_norm, loss_type)
    assert grad1.keys() == grads.keys()
    for n in grads:
        message = f"{n}: {{}}"
        torch.testing.assert_close(grad1[n].double(), grads[n], **close,
                                   msg=lambda m, s=message: s.format(m))
        torch.testing.assert_close(norms[n].double(), per_param[n], **close)
        torch.testing.assert_close(clipped[n].double(), expected_clipped[n], **close)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_reparametrized_layer_is_a_unit_and_exact(kind: str, layer: str, training: bool,
                                                     loss_type: str) -> None:
    model, x = build(kind, layer).train(training), batch(layer)
    got = hooked_quantities(model, x, loss_type, max_norm=0.05)
    assert_quantities_match(got, model, x, loss_type, 0.05, torch.float64)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_float32_within_rounding_of_the_float64_loop(kind: str, layer: str) -> None:
    model, x = build(kind, layer, torch.float32).train(), batch(layer, torch.float32)
    got = hooked_quantities(model, x, "mean", max_norm=0.05)
    truth = build(kind, layer)
    truth.load_state_dict(model.state_dict())  # the vectors this step's forward left
    assert all(g.dtype == torch.float32 for g in got[0].values())
    assert_quantities_match(got, truth, x, "mean", 0.05, torch.float32)


@pytest.mark.parametrize("kind", ["weight_norm", "deprecated weight_norm"])
def test_without_the_fallback_a_reparametrized_layer_is_refused(kind: str) -> None:
    model = build(kind, "linear")
    cause = "is parametrized" if kind == "weight_norm" else "weight_g, weight_v"
    with pytest.raises(UnsupportedModuleError, match=rf"'0' .*{cause}.*fallback=True"):
        psh.add_hooks(model, fallback=False)
    model[0].requires_grad_(False)  # frozen: nothing to compute, so nothing refused
    with psh.add_hooks(model, fallback=False) as state:
        assert not state.units


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["weight_norm", "deprecated weight_norm"])
def test_a_layer_reparametrized_after_add_hooks_is_refused_then_exact(kind: str,
                                                                       dtype: torch.dtype) -> None:
    x = batch("linear", dtype)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)).to(dtype)
    psh.add_hooks(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KINDS[kind](plain[0])
    weighted_square(plain(x)).mean().backward()
    cause = "is parametrized" if kind == "weight_norm" else "weight_g, weight_v"
    with pytest.raises(PerSampleHooksError, match=rf"'0' .*{cause}.* since add_hooks"):
        psh.compute_grad1(plain)
    psh.remove_hooks(plain)  # as the message says: the next step is exact
    got = hooked_quantities(plain, x, "mean", max_norm=0.05)
    truth = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KINDS[kind](truth[0])
    truth.load_state_dict(plain.state_dict())
    assert_quantities_match(got, truth, x, "mean", 0.05, dtype)


def test_a_frozen_reparametrized_layer_keeps_its_rule() -> None:
    model, x = build("spectral_norm", "conv2d"), batch("conv2d")
    model[0].requires_grad_(False)
    with psh.add_hooks(model) as state:
        assert not state.units
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
    _, _, grads = loop_norms(model.eval(), [x], weighted_square, "mean")
    assert got.keys() == grads.keys() == {"3.weight", "3.bias"}
    for n in got:
        torch.testing.assert_close(got[n], grads[n], **loop_tolerance(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_parameter_added_to_a_layer_makes_it_a_unit(dtype: torch.dtype) -> None:
    """Also a subclass that keeps Linear's forward: its extra parameter is unused (zeros)."""
    class Extra(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 3)
            self.unused = nn.Parameter(torch.ones(2))

    torch.manual_seed(0)
    model = nn.Sequential(Extra(), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)).to(dtype)
    x = batch("linear", dtype)
    got = hooked_quantities(model, x, "mean", max_norm=0.05)
    assert got[0]["0.unused"].abs().max() == 0
    truth = nn.Sequential(Extra(), nn.Tanh(), nn.Flatten(), nn.Linear(6, 2)).double()
    truth.load_state_dict(model.state_dict())
    assert_quantities_match(got, truth, x, "mean", 0.05, dtype)


class Recurrent(nn.Module):
    """An LSTM or GRU (whose parameter names depend on its layers and directions) with a
    weight-normed recurrent weight."""

    def __init__(self, rnn: type[nn.RNNBase], kind: str) -> None:
        super().__init__()
        self.rnn = rnn(3, 4, num_layers=2, batch_first=True, bidirectional=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated ones say so
            KINDS[kind](self.rnn, "weight_hh_l1_reverse")
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["weight_norm", "deprecated weight_norm"])
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_a_reparametrized_recurrent_layer_is_a_unit(rnn: type[nn.RNNBase], kind: str,
                                                    dtype: torch.dtype) -> None:
    """The deprecated weight_norm's weight_hh_l1_reverse_g and _v were left to the recurrent
    rule, which never wrote their grad1 (uninitialized memory returned; norms crashed)."""
    torch.manual_seed(0)
    model = Recurrent(rnn, kind).to(dtype)
    x = torch.randn(BATCH, 4, 3, generator=seeded(2)).to(dtype)
    state = psh.add_hooks(model)
    try:
        assert [state.modules[u][0] for u in state.units] == ["rnn"]
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    grads = loop_norms(model.double(), [x.double()], weighted_square, "mean")[2]
    assert got.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(got[n], grads[n], **loop_tolerance(dtype), msg=n)


class UsedTwice(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.square = KINDS[kind](nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.square(torch.tanh(self.square(x))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["spectral_norm", "deprecated spectral_norm"])
def test_a_spectral_norm_called_twice_in_training_mode_is_refused(kind: str,
                                                                   dtype: torch.dtype) -> None:
    """Each call iterates: the re-run had the second call's vectors for both (float32: 1e-4
    off, no error; float64: refused as batch dependence). In eval mode: exact."""
    model = UsedTwice(kind).to(dtype)
    x = torch.randn(BATCH, 6, generator=seeded(2)).to(dtype)
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(PerSampleHooksError, match=r"'square' \(\w+\) was called 2 times in "
                           r"the step with a spectral norm in training mode"):
            psh.compute_grad1(model)
    model.eval().zero_grad()
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    grads = loop_norms(model.double(), [x.double()], weighted_square, "mean")[2]
    for n in grads:
        torch.testing.assert_close(got[n], grads[n], **loop_tolerance(dtype), msg=n)


class Attention(nn.Module):
    """nn.MultiheadAttention (whose rule covers its out_proj) with a weight-normed out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        parametrizations.weight_norm(self.attention.out_proj)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attention(x, x, x)[0]).flatten(1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_parametrization_below_a_rule_that_covers_children(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Attention().to(dtype)
    x = torch.randn(BATCH, 3, 4, generator=seeded(2)).to(dtype)
    with psh.add_hooks(model) as state:
        assert [state.modules[u][0] for u in state.units] == ["attention"]
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    truth = Attention().double()
    truth.load_state_dict(model.state_dict())
    _, _, grads = loop_norms(truth, [x.double()], weighted_square, "mean")
    assert got.keys() == grads.keys()
    for n in got:
        torch.testing.assert_close(got[n].double(), grads[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("kind", ["weight_norm", "deprecated weight_norm"])
def test_reparametrized_after_add_hooks_is_not_formed_on_arrival(kind: str) -> None:
    """``OutputEdges(form_on_arrival=True)`` (DPSGD's backward, on a step the unseen-use check
    does not compare) leaves such a layer's record alone (its rule would write into buffers of
    ``weight_g``'s shape: a RuntimeError inside the backward), and the ``compute_*`` call
    refuses it as above."""
    from per_sample_hooks.dp import OutputEdges
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2), nn.Flatten(), nn.Linear(32, 2)).double()
    x = torch.randn(BATCH, 16, 4, generator=seeded(3)).double()
    psh.add_hooks(model, check_unseen=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            KINDS[kind](model[0])
        OutputEdges(model, form_on_arrival=True).backward(weighted_square(model(x)).mean())
        with pytest.raises(PerSampleHooksError, match=r"'0' .* since add_hooks"):
            psh.clip_grads(model, 1.0)
    finally:
        psh.remove_hooks(model)
