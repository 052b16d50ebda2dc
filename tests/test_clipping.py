import copy
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import (
    assert_clipping_matches,
    assert_float32_matches,
    assert_norms_match,
    hooked_backward,
    loop_clipped,
    loop_norms,
)
from test_conv import Reused as ReusedConv
from test_conv import SeedCNNWithLoss, conv_setups
from test_norms import CONV_PATHS, Reused
from torch import nn

import per_sample_hooks as psh
from ground_truth import weighted_square
from per_sample_hooks import norms as norms_module
from per_sample_hooks import quantities
from per_sample_hooks.forms import ghost
from per_sample_hooks.quantities import KeptGrads
from per_sample_hooks.rules.linear import LinearRule

KEEP_FRACTIONS = [0.0, norms_module.KEEP_FRACTION, 1e9]  # never, default, always


@contextmanager
def keep_fraction(fraction):
    """clip_grads keeps materialized per-sample gradients up to this fraction of the captures."""
    old = norms_module.KEEP_FRACTION
    norms_module.KEEP_FRACTION = fraction
    try:
        yield
    finally:
        norms_module.KEEP_FRACTION = old


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 5), t=st.sampled_from([1, 2, 5]), d=st.integers(1, 6),
       p=st.integers(1, 6), bias=st.booleans(), loss_type=st.sampled_from(["mean", "sum"]),
       max_norm=st.sampled_from([1e-3, 0.5, 1e6]), keep=st.sampled_from(KEEP_FRACTIONS))
def test_linear_clipped_sum(batch, t, d, p, bias, loss_type, max_norm, keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, p, bias=bias), nn.Tanh(), nn.Linear(p, 2, bias=bias))
    leading = (t,) if t > 1 else ()
    with keep_fraction(keep):
        assert_clipping_matches(model, [torch.randn(batch, *leading, d)], max_norm,
                                loss_type=loss_type)


def test_clipping_is_active():
    """Guard: with a small max_norm the result differs from the unclipped gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(6, 4, dtype=torch.double)
    hooked_backward(model, [x])
    plain = [p.grad.clone() for p in model.parameters()]
    norms = psh.clip_grads(model, 0.1)
    psh.remove_hooks(model)
    assert (norms > 0.1).all()
    total = torch.cat([g.flatten() for g in plain]).norm()
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped <= 0.1 + 1e-12 < total


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(6, 4), (6, 3, 4)])
@pytest.mark.parametrize("keep", KEEP_FRACTIONS)
def test_reuse(loss_type, shape, keep):
    torch.manual_seed(0)
    with keep_fraction(keep):
        assert_clipping_matches(Reused(), [torch.randn(*shape)], 0.3, loss_type=loss_type)


def test_frozen_parameters_keep_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    assert_clipping_matches(model, [torch.randn(7, 5)], 0.2)


class Grad1Only(psh.Rule):
    """The Linear's per-sample gradients from a rule without forms: its quantities are taken
    from the materialized per-sample gradients (``quantities``' other path)."""

    def grad1(self, module, calls, scale, out):
        LinearRule().grad1(module, calls, scale, out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("keep", [False, True])
def test_quantities_of_a_grad1_only_rule_match_the_forms(keep, dtype):
    """Norms and weighted sums of a rule with forms and of a grad1-only rule (materialized,
    into kept buffers or not): alike, and those of the float64 per-sample loop."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(dtype)
    x = torch.randn(5, 2, 4, dtype=dtype)
    _, per_param, grads = loop_norms(copy.deepcopy(model).double(), [x.double()],
                                     weighted_square, "mean")
    hooked_backward(model, [x])
    state = psh.add_hooks(model)
    calls, names = state.calls[model], ["weight", "bias"]
    weights = torch.rand(5, dtype=dtype)
    results = []
    for rule in (LinearRule(), Grad1Only()):
        kept = KeptGrads(10**6, lambda m, n, p, b: p.new_empty((b, *p.shape))) if keep else None
        out = {n: torch.full_like(p, float("nan")) for n, p in model.named_parameters()}
        squared = quantities.norms_squared(rule, model, calls, 5.0, names, kept)
        quantities.weighted_sum(rule, model, calls, weights, out, kept)
        results.append((squared, out))
    psh.remove_hooks(model)
    (forms_norms, forms_sums), (dense_norms, dense_sums) = results
    same = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    loop = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for n in names:
        torch.testing.assert_close(dense_sums[n], forms_sums[n], **same)
        torch.testing.assert_close(dense_norms[n], forms_norms[n], **same)
        # captured per-sample gradients of a mean loss carry 1/B; norms_squared's scale 5 = B
        expected_sum = (weights.double().view(-1, *[1] * (grads[n].dim() - 1)) * grads[n]
                        ).sum(0) / 5
        torch.testing.assert_close(forms_sums[n].double(), expected_sum, **loop)
        torch.testing.assert_close(forms_norms[n].double(), per_param[n] ** 2, **loop)
    assert forms_norms["weight"].abs().min() > 0


def test_materialize_path_with_small_chunks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3))
    assert ghost.choose_method(6, 2, 2) == "materialize"
    old = ghost.CHUNK_ELEMENTS
    ghost.CHUNK_ELEMENTS = 3
    try:
        assert_clipping_matches(model, [torch.randn(5, 6, 2)], 0.05)
    finally:
        ghost.CHUNK_ELEMENTS = old


def test_zeroed_grad_of_unreached_module_stays_zero():
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    psh.add_hooks(model)
    model["unused"].weight.grad = torch.zeros(2, 3)
    model["unused"](torch.randn(4, 3))
    model["used"](torch.randn(4, 3)).sum().backward()
    psh.clip_grads(model, 1.0)
    psh.remove_hooks(model)
    assert torch.equal(model["unused"].weight.grad, torch.zeros(2, 3))
    assert model["unused"].bias.grad is None


def assert_clipped_as_the_loop(model: nn.Module, grads: dict, total: torch.Tensor) -> None:
    """Each ``p.grad`` the float64 loop's clipped mean (threshold 0.5), within float32's
    rounding for a float32 model."""
    float32 = next(model.parameters()).dtype == torch.float32
    tolerance = dict(rtol=1e-5, atol=1e-6) if float32 else {}
    for n, want in loop_clipped(grads, total, 0.5, "mean").items():
        torch.testing.assert_close(model.get_parameter(n).grad.double(), want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gradient_sharing_memory_with_a_captured_one_is_not_written_into(dtype):
    """clip_grads writes each layer's clipped sum into its ``p.grad``, unless that shares its
    memory with a captured gradient (a later sum still reads it): at B = 1 a bias's gradient
    is the captured output gradient's only row, here handed to ``p.grad`` as a view of it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    x = torch.randn(1, 3, dtype=dtype)
    total, _, grads = loop_norms(copy.deepcopy(model).double(), [x.double()], weighted_square,
                                 "mean")
    hooked_backward(model, [x])
    state = psh.capture.get_state(model)
    try:
        for layer in (model[0], model[2]):
            (captured,) = state.calls[layer][0].grads[0]
            layer.bias.grad = captured[0]  # the same values, in the captured memory
        psh.clip_grads(model, 0.5)
    finally:
        psh.remove_hooks(model)
    assert_clipped_as_the_loop(model, grads, total)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_layer_added_after_add_hooks_is_refused_until_hooked_again(dtype):
    """A layer appended after ``add_hooks`` is not hooked: clip_grads (and every compute_*)
    refuses its parameter by name and says to hook the model again; hooked again, the
    clipping is the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).to(dtype)
    x = torch.randn(5, 3, dtype=dtype)
    psh.add_hooks(model)
    model.append(nn.Linear(4, 2).to(dtype))
    try:
        for refused in (partial(psh.clip_grads, max_grad_norm=0.5), psh.compute_norms,
                        psh.compute_grad1):
            weighted_square(model(x)).mean().backward()
            with pytest.raises(psh.PerSampleHooksError, match=r"parameter '2.weight' belongs "
                               r"to no hooked module.*added to the model after add_hooks. Hook "
                               r"the model again"):
                refused(model)
            model.zero_grad()
        psh.remove_hooks(model)
        total, _, grads = loop_norms(copy.deepcopy(model).double(), [x.double()],
                                     weighted_square, "mean")
        hooked_backward(model, [x])
        psh.clip_grads(model, 0.5)
    finally:
        psh.remove_hooks(model)
    assert_clipped_as_the_loop(model, grads, total)


def test_without_backward_raises():
    model = nn.Linear(3, 2)
    psh.add_hooks(model)
    model(torch.randn(4, 3))
    with pytest.raises(psh.PerSampleHooksError, match="backward"):
        psh.clip_grads(model, 1.0)
    psh.remove_hooks(model)


@pytest.mark.parametrize("max_norm", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_bad_max_norm(max_norm):
    model = nn.Linear(3, 2)
    psh.add_hooks(model)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match="max_grad_norm"):
        psh.clip_grads(model, max_norm)
    with pytest.raises(TypeError, match="missing the clipping threshold max_grad_norm"):
        psh.clip_grads(model)
    psh.remove_hooks(model)


def clip_with(max_norm: object, dtype: torch.dtype) -> None:
    """clip_grads(model, max_norm) on a float ``dtype`` model against the float64 loop clipped
    at ``float(max_norm)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    x = torch.randn(5, 3, dtype=dtype)
    reference = copy.deepcopy(model).double()
    total, _, grads = loop_norms(reference, [x.double()], lambda out: out.pow(2).sum(1), "mean")
    expected = loop_clipped(grads, total, float(max_norm), "mean")
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    try:
        hooked_backward(model, [x], lambda out: out.pow(2).sum(1))
        norms = psh.clip_grads(model, max_norm)
        torch.testing.assert_close(norms.double(), total, **tolerance)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.double(), expected[n], **tolerance)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("max_norm", [0.5, 1, torch.tensor(0.5), torch.tensor([0.5]),
                                      torch.tensor(0.5, dtype=torch.float64), torch.tensor(1)],
                         ids=["float", "int", "tensor0d", "tensor1", "tensor64", "int_tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_norm_real_scalars(max_norm, dtype):
    """Any real scalar is a max_norm (tensors were refused: 'must be a finite number > 0')."""
    clip_with(max_norm, dtype)


@pytest.mark.parametrize("kind", ["float32", "float64", "int64", "array0d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_norm_numpy_scalars(kind, dtype):
    np = pytest.importorskip("numpy")
    max_norm = np.array(0.5) if kind == "array0d" else getattr(np, kind)(1 if kind == "int64"
                                                                          else 0.5)
    clip_with(max_norm, dtype)


@pytest.mark.parametrize("max_norm, message", [
    (-1.0, "max_grad_norm must be > 0, got -1.0"),
    (0, "max_grad_norm must be > 0, got 0.0"),
    (torch.tensor(-0.5), "max_grad_norm must be > 0, got -0.5"),
    (float("nan"), "max_grad_norm must be finite, got nan"),
    (float("inf"), "max_grad_norm must be finite, got inf"),
    (torch.tensor(float("nan")), "max_grad_norm must be finite, got nan"),
    (True, "max_grad_norm must be a real number, not bool"),
    (torch.tensor(True), "max_grad_norm must be a real number, not bool"),
    (1j, "max_grad_norm must be a real number, not complex"),
    (torch.tensor(0.5 + 0j), "max_grad_norm must be a real number, not complex"),
    (torch.tensor([0.5, 1.0]), "max_grad_norm must be one number, got 2 of them"),
    ("1", "max_grad_norm must be a real number"),
])
def test_bad_max_norm_messages(max_norm, message):
    assert_refused(max_norm, message)


def assert_refused(max_norm, message):
    model = nn.Linear(3, 2)
    psh.add_hooks(model)
    model(torch.randn(4, 3)).sum().backward()
    try:
        with pytest.raises(ValueError, match=f"^clip_grads: {message}"):
            psh.clip_grads(model, max_norm)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("max_norm, message", [
    ("nan", "max_grad_norm must be finite, got nan"),
    ("inf", "max_grad_norm must be finite, got inf"),
    ("bool", "max_grad_norm must be a real number, not bool"),
    ("complex", "max_grad_norm must be a real number, not complex"),
])
def test_bad_numpy_max_norm_messages(max_norm, message):
    np = pytest.importorskip("numpy")
    value = {"nan": np.float32("nan"), "inf": np.float64("inf"), "bool": np.bool_(True),
             "complex": np.complex128(0.5)}[max_norm]
    assert_refused(value, message)


def test_non_finite_norms_name_the_samples_and_leave_grads():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    psh.add_hooks(model)
    x = torch.randn(6, 3)
    x[1, 0], x[4, 2] = float("nan"), float("inf")
    model(x).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match=r"2 sample\(s\) \(indices 1, 4\)"):
        psh.clip_grads(model, 1.0)
    psh.remove_hooks(model)


def test_parameter_outside_hooked_modules_is_refused():
    class Extra(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.lin2 = nn.Linear(2, 2)

        def forward(self, x):  # lin2's weight is used outside lin2's forward
            return self.lin(x) @ self.lin2.weight

    model = Extra()
    psh.add_hooks(model)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="'weight' of 'lin2'.*outside"):
        psh.clip_grads(model, 1.0)
    psh.remove_hooks(model)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("keep", KEEP_FRACTIONS)
def test_conv_each_path(loss_type, keep):
    for make, shape in CONV_PATHS.values():
        torch.manual_seed(0)
        with keep_fraction(keep):
            assert_clipping_matches(nn.Sequential(make(), nn.Tanh()), [torch.randn(shape)],
                                    0.05, loss_type=loss_type)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dims=st.sampled_from([1, 2, 3]), loss_type=st.sampled_from(["mean", "sum"]))
def test_conv_every_option(data, dims, loss_type):
    conv, shape = data.draw(conv_setups(dims))
    torch.manual_seed(0)
    assert_clipping_matches(nn.Sequential(conv, nn.Tanh()), [torch.randn(shape)], 0.1,
                            loss_type=loss_type)


@pytest.mark.parametrize("keep", KEEP_FRACTIONS)
def test_conv_reuse(keep):
    torch.manual_seed(0)
    with keep_fraction(keep):
        assert_clipping_matches(ReusedConv(2), [torch.randn(3, 3, 4, 4)], 0.1)


def test_conv_channels_last_and_seed_001_cnn():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),
                          nn.Conv2d(4, 2, 3, stride=2))
    x = torch.randn(3, 3, 6, 6).double().to(memory_format=torch.channels_last)
    assert_clipping_matches(model, [x], 0.1)
    inputs = [torch.randn(3, 1, 28, 28), torch.tensor([3, 1, 7])]
    assert_clipping_matches(SeedCNNWithLoss(), inputs, 0.5, lambda losses: losses)


@pytest.mark.parametrize("keep, kept", [(0.0, False), (1e9, True)])
def test_keeping_materialized_grads_is_used(keep, kept):
    """Guard that the KEEP_FRACTIONS grids exercise both ways of forming the clipped sum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2))
    with keep_fraction(keep):
        state = psh.add_hooks(model)
        model(torch.randn(4, 2, 4, 4)).sum().backward()
        psh.clip_grads(model, 0.1)
        names = {name for _, name in state.storage.held(step_only=True)}
        psh.remove_hooks(model)
    assert ("kept weight" in names) == kept


def positions_model() -> nn.Sequential:
    """A LayerNorm (dense forms) and a Linear with a bias over 5 positions, then a head."""
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(15, 2))


@pytest.mark.parametrize("keep, kept", [(0.0, set()), (norms_module.KEEP_FRACTION, {
    ("0", "kept weight"), ("0", "kept bias"), ("1", "kept bias")})])
def test_dense_forms_and_position_biases_are_kept(keep, kept):
    """The norms form a LayerNorm's per-sample gradients (dense) and a bias's sums over
    positions anyway: within the default budget they are kept, so that the clipped sum
    contracts them instead of forming them again; exact either way."""
    torch.manual_seed(0)
    model, x = positions_model(), torch.randn(6, 5, 4)
    with keep_fraction(keep):
        state = psh.add_hooks(model)
        model(x).sum().backward()
        psh.clip_grads(model, 0.1)
        modules = {m: n for n, m in model.named_children()}
        names = {(modules[m], name) for m, name in state.storage.held(step_only=True)}
        psh.remove_hooks(model)
    assert names & {("0", "kept weight"), ("0", "kept bias"), ("1", "kept bias")} == kept
    with keep_fraction(keep):
        assert_clipping_matches(positions_model(), [x], 0.1)
        assert_float32_matches(positions_model(), [x], 0.1)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w


class ScaleRule(psh.Rule):
    """A rule with grad1 only: norms and clipping come from the base-class defaults."""

    def grad1(self, module, calls, scale, out):
        for i, call in enumerate(calls):
            g = (call.backprop() * call.activation()).flatten(1, -2).sum(1) * scale
            out["w"].copy_(g) if i == 0 else out["w"].add_(g)


@pytest.mark.parametrize("keep", KEEP_FRACTIONS)
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_default_rule_clipping(keep, loss_type):
    psh.register_rule(Scale)(ScaleRule())
    torch.manual_seed(0)
    model = nn.Sequential(Scale(), nn.Linear(3, 2))
    with keep_fraction(keep):
        assert_clipping_matches(model, [torch.randn(5, 2, 3)], 0.2, loss_type=loss_type)


def test_conv_input_by_keyword():
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 2)

        def forward(self, x):
            return torch.tanh(self.conv(input=x))

    torch.manual_seed(0)
    assert_clipping_matches(Keyword(), [torch.randn(3, 2, 4, 4)], 0.1)


@pytest.mark.parametrize("keep", KEEP_FRACTIONS)
def test_conv_transpose_through_the_default_rule_methods(keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(2, 4, 3, stride=2, groups=2), nn.Tanh(),
                          nn.Conv2d(4, 2, 2))
    with keep_fraction(keep):
        assert_clipping_matches(model, [torch.randn(3, 2, 3, 3)], 0.1)
    assert_norms_match(model, [torch.randn(3, 2, 3, 3)], loss_type="sum")
