"""The hooked sum the unseen-use check compares (each rule's weighted sum with unit weights,
and for rules with forms the projection of the sum of their forms) equals autograd's own
gradient (float64, tight), and every compute_* function refuses a parameter used outside its
module."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import per_sample_hooks as psh
from per_sample_hooks.forms import project_sum
from per_sample_hooks.quantities import weighted_sum
from per_sample_hooks.rules.base import describes_forms
from per_sample_hooks.unseen import matrix_shape, project


def assert_hooked_sums_match_autograd(model, inputs, reuse=1):
    """Hook ``model`` (float64), run ``reuse`` forwards into one loss, backward; each hooked
    rule's weighted sum of its calls with unit weights equals ``p.grad``."""
    model = model.double()
    state = psh.add_hooks(model)
    torch.manual_seed(1)
    loss = sum((model(*inputs) * torch.randn_like(model(*inputs).detach())).sum()
               for _ in range(reuse))
    model.zero_grad()
    loss.backward()
    for module, (name, _) in state.modules.items():
        calls = [c for c in state.calls[module] if c.has_grads]
        params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        out = {n: torch.full_like(p, float("nan")) for n, p in params.items()}
        batch = state.rules[module].batch_size(module, calls[0])
        weighted_sum(state.rules[module], module, calls, torch.ones(batch, dtype=torch.double),
                     out)
        for n, p in params.items():
            assert p.grad.abs().sum() > 0
            torch.testing.assert_close(out[n], p.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"{name}.{n}")
        rule = state.rules[module]
        if describes_forms(rule):  # what the check compares for such rules: the projection
            for n, parts in rule.forms(module, calls, list(params)).items():
                probe = tuple(torch.randn(3, k, dtype=torch.double)
                              for k in matrix_shape(params[n].shape))
                torch.testing.assert_close(project_sum(parts, probe),
                                           project(params[n].grad, probe), rtol=1e-10,
                                           atol=1e-12, msg=f"{name}.{n} projected")
    psh.remove_hooks(model)


conv_types = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_conv_hooked_sum_matches_autograd(data):
    dims = data.draw(st.sampled_from([1, 2, 3]))
    groups = data.draw(st.sampled_from([1, 2, 4]))
    cin = groups * data.draw(st.integers(1, 2))
    cout = groups * data.draw(st.integers(1, 3))
    kernel = data.draw(st.integers(1, 3))
    padding = data.draw(st.sampled_from([0, 1, "same", "valid"]))
    stride = 1 if padding == "same" else data.draw(st.integers(1, 2))
    dilation = data.draw(st.integers(1, 2))
    mode = data.draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    if mode != "zeros" and padding in (0, "valid"):
        mode = "zeros"
    size = data.draw(st.integers(5, 7)) if dims < 3 else 5
    conv = conv_types[dims](cin, cout, kernel, stride=stride, padding=padding,
                            dilation=dilation, groups=groups, padding_mode=mode,
                            bias=data.draw(st.booleans()))
    x = torch.randn(3, cin, *([size] * dims), dtype=torch.double)
    assert_hooked_sums_match_autograd(nn.Sequential(conv), [x], reuse=data.draw(st.integers(1, 2)))


@pytest.mark.parametrize("shape", [(4, 5), (4, 3, 5), (4, 2, 3, 5)])
@pytest.mark.parametrize("reuse", [1, 2])
def test_linear_hooked_sum_matches_autograd(shape, reuse):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2, bias=False))
    assert_hooked_sums_match_autograd(model, [torch.randn(*shape, dtype=torch.double)], reuse)


class TiedClassifier(nn.Module):
    """A conv feature extractor whose first kernel is also used functionally (unseen)."""

    def __init__(self, unseen: bool):
        super().__init__()
        self.unseen = unseen
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 16, 4)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        if self.unseen:
            h = h + F.conv2d(x, self.conv.weight, padding=1)
        return self.fc(h.flatten(1))


def tied_step(unseen: bool, hess: bool = False):
    torch.manual_seed(0)
    model = TiedClassifier(unseen).double()
    psh.add_hooks(model)
    out = model(torch.randn(5, 1, 4, 4, dtype=torch.double))
    if hess:
        psh.backprop_hess(out, "CrossEntropy")
    else:
        F.cross_entropy(out, torch.tensor([0, 1, 2, 3, 0])).backward()
    return model


CHECKED = {
    "compute_grad1": lambda m: psh.compute_grad1(m),
    "compute_norms": lambda m: psh.compute_norms(m),
    "clip_grads": lambda m: psh.clip_grads(m, max_grad_norm=1.0),
    "compute_fisher_diag": lambda m: psh.compute_fisher_diag(m),
    "compute_grad_variance": lambda m: psh.compute_grad_variance(m),
    "compute_gram": lambda m: psh.compute_gram(m),
    "compute_kfac": lambda m: psh.compute_kfac(m),
    "compute_hess": lambda m: psh.compute_hess(m),
}


@pytest.mark.parametrize("function", sorted(CHECKED))
def test_every_function_refuses_an_unseen_use(function):
    CHECKED[function](tied_step(unseen=False))  # no false alarm
    model = tied_step(unseen=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(psh.PerSampleHooksError, match=r"parameter 'conv\.weight' has a "
                                                      r"gradient term that no hook sees"):
        CHECKED[function](model)
    for n, p in model.named_parameters():  # raised before anything was written
        assert torch.equal(p.grad, grads[n])


@pytest.mark.parametrize("function", ["compute_kfac", "compute_hess", "compute_fisher_diag"])
def test_curvature_after_backprop_hess_refuses_an_unseen_use(function):
    CHECKED[function](tied_step(unseen=False, hess=True))
    with pytest.raises(psh.PerSampleHooksError, match=r"'conv\.weight'"):
        CHECKED[function](tied_step(unseen=True, hess=True))


@pytest.mark.parametrize("norm, shape", [
    (lambda: nn.LayerNorm(5), (4, 3, 5)),
    (lambda: nn.LayerNorm((3, 5)), (4, 3, 5)),
    (lambda: nn.RMSNorm((3, 5)), (4, 2, 3, 5)),
    (lambda: nn.GroupNorm(2, 4), (4, 4, 3)),
    (lambda: nn.InstanceNorm2d(4, affine=True), (4, 4, 3, 3)),
    (lambda: nn.BatchNorm1d(4).eval(), (4, 4, 3)),
])
@pytest.mark.parametrize("reuse", [1, 2])
def test_normalization_hooked_sum_matches_autograd(norm, shape, reuse):
    torch.manual_seed(0)
    layer = norm()
    for p in layer.parameters():  # away from the default ones/zeros
        p.data.normal_()
    assert_hooked_sums_match_autograd(nn.Sequential(layer),
                                      [torch.randn(*shape, dtype=torch.double)], reuse)


transposed_types = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_conv_transpose_hooked_sum_matches_autograd(data):
    dims = data.draw(st.sampled_from([1, 2, 3]))
    groups = data.draw(st.sampled_from([1, 2]))
    cin = groups * data.draw(st.integers(1, 2))
    cout = groups * data.draw(st.integers(1, 3))
    stride = data.draw(st.integers(1, 3))
    dilation = data.draw(st.integers(1, 2))
    kernel = data.draw(st.integers(1, 3))
    conv = transposed_types[dims](  # padding crops a 1-wide kernel's output to nothing
        cin, cout, kernel, stride=stride,
        padding=data.draw(st.integers(0, 1)) if kernel > 1 else 0, dilation=dilation,
        groups=groups,
        output_padding=data.draw(st.integers(0, min(stride, dilation) - 1)),
        bias=data.draw(st.booleans()))
    x = torch.randn(3, cin, *([data.draw(st.integers(2, 4))] * dims), dtype=torch.double)
    assert_hooked_sums_match_autograd(nn.Sequential(conv), [x], reuse=data.draw(st.integers(1, 2)))


def test_bias_before_a_normalization_is_no_false_alarm():
    """A bias followed by InstanceNorm gets a gradient that is zero in exact arithmetic: float32
    rounding on both sides must not look like an unseen use (found by the long fuzz)."""
    for seed in range(100):
        torch.manual_seed(seed)
        dtype = (torch.float32, torch.float64)[seed % 2]
        for conv in (nn.ConvTranspose1d(1, 1, 1), nn.Conv1d(1, 1, 1)):
            model = nn.Sequential(conv, nn.InstanceNorm1d(1, affine=True), nn.Tanh(),
                                  nn.Flatten(), nn.Linear(3, 1)).to(dtype)
            psh.add_hooks(model)
            x = torch.randn(2, 1, 3, dtype=dtype) * 10 ** (seed % 5 - 2)
            model(x).square().mean().backward()
            psh.compute_grad1(model)
            psh.compute_norms(model)


class Shift(nn.Module):
    """A custom layer with raw parameters (a fallback unit); ``leak`` also uses ``shift``
    outside its forward."""

    def __init__(self):
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.randn(1, 1)), nn.Parameter(torch.randn(1, 1))

    def forward(self, x):
        return x * self.scale + self.shift


class ShiftThenNorm(nn.Module):
    def __init__(self, leak: bool):
        super().__init__()
        self.leak = leak
        self.shift = Shift()
        self.norm = nn.InstanceNorm1d(1, affine=True)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        y = self.head(torch.tanh(self.norm(self.shift(x))).flatten(1))
        return y + self.shift.shift.sum() if self.leak else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fallback_shift_before_a_normalization_is_no_false_alarm(dtype):
    """The shift's gradient cancels exactly (the normalization removes it): what is left is
    rounding on both sides, in float64 too; a real unseen use of it is still reported."""
    for seed in range(20):
        torch.manual_seed(seed)
        x = torch.randn(2, 1, 3, dtype=dtype) * 10 ** (seed % 5 - 2)
        for leak in (False, True):
            model = ShiftThenNorm(leak).to(dtype)
            psh.add_hooks(model)
            model(x).square().mean().backward()
            if leak:
                with pytest.raises(psh.PerSampleHooksError, match=r"'shift\.shift'"):
                    psh.compute_grad1(model)
            else:
                psh.compute_grad1(model)
