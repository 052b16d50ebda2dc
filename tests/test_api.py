"""The public verbs: hook life cycle, capture switches, the open registry, persistent buffers,
and a clear error for each bad use."""
import copy
import io
import pickle
import warnings
from functools import partial

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import (
    assert_matches_loop,
    loop_grads,
    loop_tolerance,
    sum_of_outputs,
    weighted_square,
)
from per_sample_hooks.capture import STATE_ATTRIBUTE
from per_sample_hooks.dp import DPSGD, OutputEdges


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 3))


def step(model: nn.Module, x: torch.Tensor, loss_type: str = "mean") -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = model(x)
    losses = out.sum(1)
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()
    return out


def hook_counts(model: nn.Module) -> list[tuple[int, int, int, int]]:
    return [(len(m._forward_hooks), len(m._forward_hooks_with_kwargs), len(m._forward_pre_hooks),
             len(m._backward_hooks)) for m in model.modules()]


def snapshot(model: nn.Module) -> dict:
    """Everything hooks could leave behind on a model."""
    return {
        "hooks": hook_counts(model),
        "module attributes": [sorted(vars(m)) for m in model.modules()],
        "parameter attributes": [sorted(vars(p)) for p in model.parameters()],
    }


# ----------------------------------------------------------------------------- life cycle

def test_add_hooks_twice_changes_nothing():
    model = mlp()
    first = psh.add_hooks(model)
    counts = hook_counts(model)
    assert psh.add_hooks(model) is first
    assert hook_counts(model) == counts
    step(model, torch.randn(6, 5))
    psh.compute_grad1(model)
    assert model[0].weight.grad1.shape == (6, 4, 5)
    psh.remove_hooks(model)


def test_remove_hooks_leaves_the_model_exactly_as_before():
    model = mlp()
    before = snapshot(model)
    psh.add_hooks(model)
    assert hook_counts(model) != before["hooks"]
    step(model, torch.randn(6, 5))
    psh.compute_grad1(model)
    psh.remove_hooks(model)
    assert snapshot(model) == before
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    assert STATE_ATTRIBUTE not in vars(model)
    psh.remove_hooks(model)  # a second removal, or one on a model never hooked, is a no-op
    psh.remove_hooks(mlp())
    # and the model can be hooked again
    assert_matches_loop(model, [torch.randn(4, 5)])


def test_context_manager_removes_hooks():
    model = mlp()
    before = snapshot(model)
    with psh.add_hooks(model) as state:
        assert isinstance(state, psh.HookState)
        step(model, torch.randn(3, 5))
        psh.compute_grad1(model)
        assert model[2].bias.grad1.shape == (3, 3)
    assert snapshot(model) == before


def test_context_manager_removes_hooks_on_error():
    model = mlp()
    before = snapshot(model)
    with pytest.raises(KeyError), psh.add_hooks(model):
        raise KeyError("boom")
    assert snapshot(model) == before


def test_hooks_change_neither_outputs_nor_grad():
    plain, hooked = mlp(), mlp()
    x = torch.randn(7, 5)
    psh.add_hooks(hooked)
    out_plain, out_hooked = step(plain, x), step(hooked, x)
    assert torch.equal(out_plain, out_hooked)
    for p, q in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(p.grad, q.grad)
    psh.compute_grad1(hooked)
    for p, q in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(p.grad, q.grad)
    psh.remove_hooks(hooked)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_user_tensor_hooks_on_captured_outputs_run_and_come_off(dtype):
    """The library adds its hooks on captured outputs without handles: the user's own hooks on
    the same tensors (before the library's, on a tensor the library hooks again, and after)
    still run once per backward and come off with their handles; grad1 is unchanged."""
    model = mlp().to(dtype)
    x = torch.randn(6, 5, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], lambda out: out.sum(1), 6)
    seen = []
    handles = []

    def user_forward_hook(module, args, output):  # registered after add_hooks: runs after ours
        handles.append(output.register_hook(lambda g: seen.append("after")))

    psh.add_hooks(model)
    model[2].register_forward_hook(user_forward_hook)
    for round_ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(x)
        if round_ == 1:
            for handle in handles:
                handle.remove()
        handles.append(out.register_hook(lambda g: seen.append("on output")))
        out.sum(1).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n],
                                       **({} if dtype == torch.float32 else
                                          {"rtol": 1e-12, "atol": 1e-12}))
    assert seen == ["after", "on output", "on output"]
    handles[-1].remove()
    assert len(out._backward_hooks) == 1  # the library's own, which lives with the graph



class OutputGradientHooked(nn.Module):
    """A user's hook on a hooked layer's output, registered in the forward after the layer ran
    (a gradient reversal, a schedule's scale, a weight per sample): autograd goes on with
    the gradient it leaves. ``tokens``: the layer sees ``[B, 16, d]`` (its output is a view;
    DPSGD forms its per-sample gradients on arrival); ``conv``: a Conv1d (formed too)."""

    def __init__(self, change, tokens: bool, conv: bool = False):
        super().__init__()
        self.l1 = nn.Conv1d(4, 6, 3, padding=1) if conv else nn.Linear(4, 6)
        self.l2 = nn.Linear(6, 3)
        self.change, self.tokens, self.conv = change, tokens, conv

    def forward(self, x):
        h = self.l1(x.transpose(1, 2)).transpose(1, 2) if self.conv else self.l1(x)
        weights = 1 + x.flatten(1)[:, 0].abs()  # (each sample's own)
        h.register_hook(partial(self.change, weights=weights.view(-1, *[1] * (h.dim() - 1))))
        out = self.l2(torch.tanh(h))
        return out.sum(1) if self.tokens else out


def reversed_gradient(g, weights):
    return -0.5 * g


def halved_in_place(g, weights):
    g.mul_(0.5)


def rows_weighted(g, weights):  # (linear: B times a sample's share is its own gradient)
    return g * weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layer", ["linear", "tokens", "conv"])
@pytest.mark.parametrize("change", [reversed_gradient, halved_in_place, rows_weighted])
def test_a_users_hook_changing_an_output_gradient_is_followed(change, layer, dtype):
    """The library's hook on the output ran before the user's, so it captured the gradient
    before the change, while autograd gave the layer's parameters the changed one: grad1,
    norms and clipping silently off by the hook's factor (refused on a checked float64 step,
    as a use outside the forward; not caught on unchecked steps). Each later hook is
    followed: exact against the float64 loop over three steps (the default check's unchecked
    ones included), and a DPSGD step (noise 0) over three batches, the backwards after the
    first stopping at the outputs, is the loop's (the conv's and the token Linear's
    per-sample gradients, formed on arrival, were formed before the user's hook ran: not while
    a later hook follows)."""
    torch.manual_seed(0)
    model = OutputGradientHooked(change, layer != "linear", layer == "conv").to(dtype)
    reference = copy.deepcopy(model).double()
    shape = (6, 4) if layer == "linear" else (6, 16, 4)
    tolerance = loop_tolerance(dtype)
    psh.add_hooks(model)
    try:
        for _ in range(3):
            x = torch.randn(*shape, dtype=dtype)
            model.zero_grad(set_to_none=True)
            weighted_square(model(x)).mean().backward()
            norms = psh.compute_norms(model)
            psh.compute_grad1(model)
            expected = loop_grads(reference, [x.double()], weighted_square, 6)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1.double(), expected[n], **tolerance)
            flat = torch.cat([g.flatten(1) for g in expected.values()], 1)
            torch.testing.assert_close(norms.double(), flat.norm(dim=1), **tolerance)
    finally:
        psh.remove_hooks(model)
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=0.3, dataset_size=12, batch_size=6, accountant=None)
    try:
        for _ in range(3):
            x = torch.randn(*shape, dtype=dtype)
            reference.load_state_dict(model.state_dict())
            expected = loop_grads(reference, [x.double()], weighted_square, 6)
            flat = torch.cat([g.flatten(1) for g in expected.values()], 1)
            factor = (0.3 / (flat.norm(dim=1) + 1e-6)).clamp(max=1.0)
            before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            dp.zero_grad()
            dp.backward(weighted_square(model(x)).mean())
            dp.step()
            for n, p in model.named_parameters():
                step = torch.einsum("b,b...->...", factor, expected[n]) / 6
                torch.testing.assert_close(p.detach().double(), before[n] - step, **tolerance)
    finally:
        dp.close()
        psh.remove_hooks(model)


def steer(module, args, output):  # activation steering: a new output
    return output * 2.0 - 0.5


def scale_in_place(module, args, output):
    output.mul_(1.5)


def doubled_input(module, args):  # a forward pre-hook: new arguments
    return (args[0] * 2.0,)


def register(module, hook):
    if hook is doubled_input:
        return module.register_forward_pre_hook(hook)
    return module.register_forward_hook(hook)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("user_hook", [steer, scale_in_place, doubled_input])
@pytest.mark.parametrize("registered", ["before", "after"])
@pytest.mark.parametrize("layer", [0, 3], ids=["linear", "unit"])
def test_a_user_forward_hook_changing_a_layers_output_either_side_of_add_hooks(
        layer, registered, user_hook, dtype):
    """The library's forward hook runs first (registered with prepend): it sees the layer's
    own output whether the user's hook that changes it was registered before add_hooks or
    after, on a layer with a rule or a torch.func unit. Registered before, grad1 was taken at
    the changed output (50% off, silent in float32). A unit's re-run is its forward alone, on
    the arguments it got: the hooks that changed them, or its output, not run again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), ScaledMLP.Scale()
                          ).to(dtype)
    x = torch.randn(6, 5, dtype=dtype)
    reference = copy.deepcopy(model).double()
    register(reference[layer], user_hook)
    expected = loop_grads(reference, [x.double()], weighted_square, 6)
    if registered == "before":
        register(model[layer], user_hook)
    with psh.add_hooks(model, check_unseen="always", units=["3"]):
        if registered == "after":
            register(model[layer], user_hook)
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("substitute", ["leaf", "computed", "clone"])
def test_a_module_run_with_other_tensors_in_place_of_its_parameters_is_refused(substitute,
                                                                               dtype):
    """torch.func.functional_call with fast weights (a new leaf), a hypernetwork's output or a
    clone in place of a weight: the hooks would give the registered parameter the substitute's
    per-sample gradients (for a leaf, one autograd gives no gradient at all: silent). Refused,
    naming the module and the parameter; the next step, called with the model's own
    parameters, is exact."""
    model = mlp().to(dtype)
    x = torch.randn(6, 5, dtype=dtype)
    weight = model[2].weight
    substitutes = {"leaf": lambda: weight.detach().clone().requires_grad_(),
                   "computed": lambda: torch.tanh(model[0].weight[:3, :4]),
                   "clone": weight.clone}
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], sum_of_outputs, 6)
    with psh.add_hooks(model):
        out = torch.func.functional_call(model, {"2.weight": substitutes[substitute]()}, (x,))
        out.sum(1).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"compute_grad1: '2' ran with a "
                           r"tensor in place of its parameter 'weight' \(torch.func"):
            psh.compute_grad1(model)
        model.zero_grad(set_to_none=True)
        torch.func.functional_call(model, dict(model.named_parameters()), (x,)
                                   ).sum(1).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


def test_second_order_meta_learning_is_refused_for_its_graph_of_gradients():
    """MAML: an inner step with create_graph=True, fast weights computed from it, an outer
    forward and backward. Refused naming create_graph (the cause), not the forward after the
    backward or the fast weights that come of it; the next plain step is exact."""
    model = mlp().double()
    x, x_outer = torch.randn(6, 5, dtype=torch.double), torch.randn(6, 5, dtype=torch.double)
    expected = loop_grads(copy.deepcopy(model), [x], sum_of_outputs, 6)
    with psh.add_hooks(model):
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(model(x).square().sum(), list(params.values()),
                                    create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
        torch.func.functional_call(model, fast, (x_outer,)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"create_graph=True: a gradient "
                           r"penalty, meta-learning"):
            psh.compute_grad1(model)
        model.zero_grad(set_to_none=True)
        step(model, x)
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, expected[n], rtol=1e-10, atol=1e-12)


def test_a_global_forward_hook_is_warned_of_once():
    """A global forward hook runs before the library's on every module, and what it returns
    cannot be told from the module's own output: a warning, once per hooked model."""
    model = mlp()
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        with psh.add_hooks(model), pytest.warns(UserWarning, match="a global forward hook"):
            for _ in range(2):
                step(model, torch.randn(4, 5))
                psh.compute_grad1(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with psh.add_hooks(model):
                handle.remove()
                step(model, torch.randn(4, 5))
                psh.compute_grad1(model)
    finally:
        handle.remove()


class ScaledMLP(nn.Module):
    """Linear, Tanh, Linear and a module with no rule (a fallback unit)."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

        def forward(self, x):
            return x * self.w

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        self.scale = self.Scale()

    def forward(self, x):
        return self.scale(self.body(x))


def roundtrip(model: nn.Module, how: str) -> nn.Module:
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    return copy.deepcopy(model)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
@pytest.mark.parametrize("extra", ["none", "output_edges", "dpsgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hooked_model_saves_and_loads_unhooked(how, extra, dtype):
    """A hooked model (with its records, and an OutputEdges or a DPSGD on it) pickles (its hooks
    were closures: "Can't pickle local object"); the copy is not hooked, computes as the
    original, and hooked in turn gives exact grad1."""
    torch.manual_seed(0)
    model = ScaledMLP().to(dtype)
    state = psh.add_hooks(model)
    x = torch.randn(6, 5, dtype=dtype)
    if extra == "output_edges":
        edges = OutputEdges(model)
        edges.backward(model(x).sum())
    elif extra == "dpsgd":
        DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
              max_grad_norm=1.0, dataset_size=10, batch_size=6, accountant=None)
        model(x).sum().backward()
    else:
        step(model, x)
    psh.compute_grad1(model)
    model(x)  # a forward's records too (and OutputEdges' recorded edges)
    loaded = roundtrip(model, how)
    assert loaded.__dict__.get(STATE_ATTRIBUTE) is None
    with pytest.raises(psh.PerSampleHooksError, match="has no per_sample_hooks"):
        psh.compute_grad1(loaded)
    # not hooked: runs as the original, records nothing anywhere
    recorded = [list(calls) for calls in state.calls.values()]
    out_loaded = step(loaded, x)
    assert [list(calls) for calls in state.calls.values()] == recorded
    out_model = step(model, x)
    assert torch.equal(out_loaded, out_model)
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p.grad, q.grad)
    psh.remove_hooks(model)
    # and it can be hooked
    x = torch.randn(5, 5, dtype=dtype)
    psh.add_hooks(loaded)
    try:
        step(loaded, x)
        psh.compute_grad1(loaded)
        got = {n: p.grad1.clone() for n, p in loaded.named_parameters()}
    finally:
        psh.remove_hooks(loaded)
    reference = ScaledMLP().double()
    reference.load_state_dict(loaded.state_dict())
    expected = loop_grads(reference, [x.double()], sum_of_outputs, 5)
    assert got.keys() == expected.keys()
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for n, g in expected.items():
        torch.testing.assert_close(got[n].double(), g, **tolerance, msg=lambda m, n=n: f"{n}: {m}")


# ----------------------------------------------------------------------------- switches

NOTHING_CAPTURED = "no output gradient was captured"


def test_disable_and_enable_one_model():
    model, other = mlp(), mlp(1)
    psh.add_hooks(model)
    psh.add_hooks(other)
    try:
        psh.disable_hooks(model)
        step(model, torch.randn(4, 5))
        step(other, torch.randn(4, 5))
        with pytest.raises(psh.PerSampleHooksError, match=NOTHING_CAPTURED):
            psh.compute_grad1(model)
        psh.compute_grad1(other)  # the other model kept capturing
        psh.enable_hooks(model)
        step(model, torch.randn(4, 5))
        psh.compute_grad1(model)
        assert model[0].weight.grad1.shape == (4, 4, 5)
    finally:
        psh.remove_hooks(model)
        psh.remove_hooks(other)


def test_disable_and_enable_all_models():
    models = [mlp(0), mlp(1)]
    for m in models:
        psh.add_hooks(m)
    try:
        psh.disable_hooks()
        for m in models:
            step(m, torch.randn(4, 5))
            with pytest.raises(psh.PerSampleHooksError, match=NOTHING_CAPTURED):
                psh.compute_grad1(m)
        psh.enable_hooks()
        for m in models:
            step(m, torch.randn(4, 5))
            psh.compute_grad1(m)
    finally:
        psh.enable_hooks()
        for m in models:
            psh.remove_hooks(m)


def test_clear_backprops_forgets_the_step():
    model = mlp()
    psh.add_hooks(model)
    step(model, torch.randn(4, 5))
    psh.clear_backprops(model)
    with pytest.raises(psh.PerSampleHooksError, match=NOTHING_CAPTURED):
        psh.compute_grad1(model)
    # a forward without compute_* in between would otherwise mix two batches
    step(model, torch.randn(4, 5))
    psh.clear_backprops(model)
    x = torch.randn(4, 5)
    step(model, x)
    psh.compute_grad1(model)
    expected = loop_grads(model, [x], lambda out: out.sum(1), 4)
    torch.testing.assert_close(model[0].weight.grad1, expected["0.weight"])
    psh.remove_hooks(model)


def test_no_grad_forward_is_not_captured():
    model = mlp()
    psh.add_hooks(model)
    with torch.no_grad():
        model(torch.randn(9, 5))
    x = torch.randn(4, 5)
    step(model, x)
    psh.compute_grad1(model)
    assert model[0].weight.grad1.shape[0] == 4
    psh.remove_hooks(model)


def test_is_supported():
    assert psh.is_supported(nn.Linear(2, 3))
    assert psh.is_supported(nn.Linear(2, 3, bias=False))
    assert psh.is_supported(nn.Bilinear(2, 2, 3))  # by the torch.func fallback
    assert not psh.is_supported(nn.Bilinear(2, 2, 3), fallback=False)
    assert not psh.is_supported(nn.ReLU())  # no parameters: nothing to compute


# ----------------------------------------------------------------------------- registry

class Affine(nn.Module):
    """``y = x * scale + shift`` over the last dim: a layer the library does not know."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale + self.shift


@psh.register_rule(Affine)
class AffineRule(psh.Rule):
    """The README's worked example: Affine's per-sample gradients as forms."""

    def forms(self, module, calls, names):
        result = {name: [] for name in names}              # only trainable parameters
        for call in calls:                                 # one form per call, summed
            x, g = call.activation(), call.backprop()      # [B, ..., d], batch first
            x, g = x.reshape(len(x), -1, x.shape[-1]), g.reshape(len(g), -1, g.shape[-1])
            forms = {"scale": psh.Dense((g * x).sum(1)),   # [B, d]
                     "shift": psh.Outer(g.unsqueeze(1))}   # sum over positions of g
            for name in names:
                result[name].append(forms[name])
        return result


class AffineByGrad1(Affine):
    """The same layer with a rule that writes per-sample gradients only (no forms)."""

    def forward(self, x):
        return x * self.scale + self.shift


@psh.register_rule(AffineByGrad1)
class AffineGrad1Rule(psh.Rule):
    def grad1(self, module, calls, scale, out):
        for i, call in enumerate(calls):
            x, g = call.activation(), call.backprop()
            x, g = x.reshape(len(x), -1, x.shape[-1]), g.reshape(len(g), -1, g.shape[-1])
            parts = {"scale": (g * x).sum(1), "shift": g.sum(1)}
            for name, buf in out.items():
                if i == 0:
                    torch.mul(parts[name], scale, out=buf)  # the first call writes
                else:
                    buf.add_(parts[name], alpha=scale)       # later calls accumulate


class UsesAffineTwice(nn.Module):
    def __init__(self, layer=Affine):
        super().__init__()
        self.affine = layer(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.affine(torch.tanh(self.lin(self.affine(x))))


@pytest.mark.parametrize("layer", [Affine, AffineByGrad1])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 4)])
def test_register_rule_worked_example(layer, loss_type, shape):
    """A user rule's forms (or its grad1 alone) give grad1, norms and clipping."""
    from norms_truth import assert_clipping_matches, assert_norms_match
    torch.manual_seed(0)
    assert psh.is_supported(layer(3))
    x = torch.randn(*shape)
    assert_matches_loop(UsesAffineTwice(layer), [x], loss_type=loss_type)
    assert_norms_match(UsesAffineTwice(layer), [x], loss_type=loss_type)
    assert_clipping_matches(UsesAffineTwice(layer), [x], 0.3, loss_type=loss_type)


def test_register_rule_frozen_parameter():
    torch.manual_seed(0)
    model = UsesAffineTwice()
    model.affine.shift.requires_grad_(False)
    assert_matches_loop(model, [torch.randn(5, 4)])


class ShapeSlip(psh.Rule):
    """AffineGrad1Rule with a bug: it writes ``scale``'s rows summed over the features, which
    ``torch.mul(out=)`` resizes its output to instead of refusing."""

    def grad1(self, module, calls, scale, out):
        x, g = calls[0].activation(), calls[0].backprop()
        rows = {"scale": (g * x).sum(-1, keepdim=True), "shift": g}
        for name, buf in out.items():
            torch.mul(rows[name], scale, out=buf)


SLIPPED = (r"ShapeSlip.grad1 left the buffer of AffineByGrad1's parameter 'scale' with shape "
           r"\(5, 1\), not \(5, 4\)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_user_rule_that_resizes_its_buffer_is_refused(dtype):
    """Before, grad1 had the wrong shape and the norms and the clipped sums were silently
    wrong (the unseen-use check compared a contraction of the resized buffer)."""
    registry = psh.RuleRegistry()
    psh.register_rule(AffineByGrad1, registry)(ShapeSlip)
    model = nn.Sequential(nn.Linear(4, 4), AffineByGrad1(4)).to(dtype)
    psh.add_hooks(model, registry=registry)
    try:
        for verb in (psh.compute_grad1, psh.compute_norms, partial(psh.clip_grads,
                                                                    max_grad_norm=1.0)):
            model(torch.randn(5, 4, dtype=dtype)).sum().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's own: "output ... was resized"
                with pytest.raises(psh.PerSampleHooksError, match=SLIPPED):
                    verb(model)
    finally:
        psh.remove_hooks(model)


def test_register_rule_rejects_non_modules_and_non_rules():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        psh.register_rule(int)(AffineRule)
    with pytest.raises(TypeError, match="Rule instance or subclass"):
        psh.register_rule(Affine)(object)


def test_private_registry_leaves_the_default_alone():
    class Doubler(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    registry = psh.RuleRegistry()
    psh.register_rule(Doubler, registry)(AffineRule)
    assert psh.is_supported(Doubler(2, 2), registry)
    # overrides forward: Linear's rule does not apply, only the fallback would
    assert not psh.is_supported(Doubler(2, 2), fallback=False)


def test_register_rule_by_name():
    """A type named ``"module.path:ClassName"`` (an optional package's layer, registered without
    importing it) matches that class and its subclasses that keep its forward; a rule
    registered for the type itself takes precedence."""
    class Shifted(Affine):
        pass

    class Overridden(Shifted):
        def forward(self, x):
            return super().forward(x) * 2

    registry = psh.RuleRegistry()
    assert registry.lookup(Shifted(2)) is None
    psh.register_rule(f"{__name__}:{Shifted.__qualname__}", registry)(AffineGrad1Rule)
    by_name = registry.lookup(Shifted(2))
    assert isinstance(by_name, AffineGrad1Rule)
    assert registry.lookup(type("Sub", (Shifted,), {})(2)) is by_name
    assert registry.lookup(Overridden(2)) is None
    psh.register_rule(Shifted, registry)(AffineRule)
    assert isinstance(registry.lookup(Shifted(2)), AffineRule)
    with pytest.raises(TypeError, match="module.path:ClassName"):
        psh.register_rule("Shifted", registry)(AffineRule)


def test_register_rule_by_predicate():
    """A predicate on module classes recognizes layers whatever their names, asked after the
    types and names; anything else that is not callable is refused."""
    class Shifted(Affine):
        pass

    registry = psh.RuleRegistry()
    psh.register_rule(lambda cls: cls.forward is Affine.forward, registry)(AffineGrad1Rule)
    matched = registry.lookup(Shifted(2))
    assert isinstance(matched, AffineGrad1Rule)
    assert registry.lookup(type("Other", (Affine,), {"forward": lambda self, x: x})(2)) is None
    assert registry.lookup(nn.Linear(2, 2)) is None
    psh.register_rule(f"{__name__}:{Shifted.__qualname__}", registry)(AffineRule)
    assert isinstance(registry.lookup(Shifted(2)), AffineRule)
    assert registry.lookup(Affine(2)) is matched
    with pytest.raises(TypeError, match="predicate on module classes"):
        psh.register_rule(3, registry)(AffineRule)


# ----------------------------------------------------------------------------- buffers

def test_buffers_persist_across_steps_and_serve_a_smaller_last_batch():
    model = mlp().double()
    psh.add_hooks(model)
    pointers = None
    for batch in (8, 8, 5):
        x = torch.randn(batch, 5, dtype=torch.float64)
        step(model, x, "sum")
        psh.compute_grad1(model, loss_type="sum")
        now = [p.grad1.data_ptr() for p in model.parameters()]
        assert pointers is None or now == pointers
        pointers = now
        psh.disable_hooks(model)  # the per-sample loop must not be captured
        expected = loop_grads(model, [x], sum_of_outputs, batch)
        psh.enable_hooks(model)
        for name, p in model.named_parameters():
            assert p.grad1.shape == (batch, *p.shape)
            torch.testing.assert_close(p.grad1, expected[name], rtol=1e-9, atol=1e-10)
    psh.remove_hooks(model)


def test_new_step_starts_by_itself_after_compute():
    model = mlp().double()
    psh.add_hooks(model)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(3 + seed, 5, dtype=torch.float64)
        step(model, x)
        psh.compute_grad1(model)
        torch.testing.assert_close(model[2].weight.grad1.mean(0), model[2].weight.grad)
    psh.remove_hooks(model)


# ----------------------------------------------------------------------------- bad use

def test_error_compute_before_backward():
    model = mlp()
    psh.add_hooks(model)
    with pytest.raises(psh.PerSampleHooksError) as before_forward:
        psh.compute_grad1(model)
    model(torch.randn(3, 5))
    with pytest.raises(psh.PerSampleHooksError) as before_backward:
        psh.compute_grad1(model)
    for error in (before_forward, before_backward):
        message = str(error.value)
        assert "compute_grad1" in message and NOTHING_CAPTURED in message
        assert "loss.backward()" in message
    psh.remove_hooks(model)


def test_error_compute_without_hooks():
    with pytest.raises(psh.PerSampleHooksError, match=r"Sequential has no per_sample_hooks: call "
                       r"per_sample_hooks.add_hooks\(model\)"):
        psh.compute_grad1(mlp())


def test_error_unsupported_module_names_path_type_and_register_rule():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.Bilinear(3, 3, 2)))
    with pytest.raises(psh.UnsupportedModuleError) as error:
        psh.add_hooks(model, fallback=False)
    message = str(error.value)
    assert "'1.1'" in message and "Bilinear" in message
    assert "register_rule(Bilinear)" in message
    assert "weight, bias" in message and "freeze" in message
    assert STATE_ATTRIBUTE not in vars(model)  # nothing half-installed
    assert hook_counts(model) == [(0, 0, 0, 0)] * len(list(model.modules()))
    # frozen, it is no longer a problem
    model[1][1].requires_grad_(False)
    with psh.add_hooks(model, fallback=False):
        pass


def test_error_mismatched_batch_sizes():
    model = mlp()
    psh.add_hooks(model)
    out_a, out_b = model(torch.randn(8, 5)), model(torch.randn(5, 5))  # no clear in between
    (out_a.sum() + out_b.sum()).backward()
    with pytest.raises(psh.PerSampleHooksError) as error:
        psh.compute_grad1(model)
    message = str(error.value)
    assert "disagree on the batch size" in message
    assert "8 (at '0')" in message and "5 (at '0')" in message
    assert "clear_backprops(model)" in message and "batch_dim" in message
    psh.remove_hooks(model)


def test_error_input_modified_in_place_after_forward():
    model = mlp()
    psh.add_hooks(model)
    x = torch.randn(4, 5)
    step(model, x)
    x.mul_(2)  # e.g. the data buffer reused for the next batch before compute_grad1
    with pytest.raises(psh.PerSampleHooksError) as error:
        psh.compute_grad1(model)
    message = str(error.value)
    assert "input of '0' (Linear)" in message and "modified in place" in message
    assert "clone" in message
    psh.remove_hooks(model)


@pytest.mark.parametrize("loss_type", ["avg", "Mean", None])
def test_error_bad_loss_type(loss_type):
    model = mlp()
    psh.add_hooks(model)
    step(model, torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"compute_grad1: loss_type must be 'mean' or 'sum', got "
                       + repr(loss_type)):
        psh.compute_grad1(model, loss_type=loss_type)
    psh.remove_hooks(model)


def test_errors_leave_the_model_usable():
    model = mlp().double()
    psh.add_hooks(model)
    step(model, torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError):
        psh.compute_grad1(model, loss_type="avg")
    x = torch.randn(3, 5, dtype=torch.float64)
    psh.clear_backprops(model)
    step(model, x, "sum")
    psh.compute_grad1(model, loss_type="sum")
    expected = loop_grads(model, [x], sum_of_outputs, 3)
    torch.testing.assert_close(model[0].weight.grad1, expected["0.weight"])
    psh.remove_hooks(model)



@pytest.mark.parametrize("refused", [
    lambda m: psh.clip_grads(m, -1.0), lambda m: psh.clip_grads(m, [(m[0].weight, 1.0)]),
    lambda m: psh.compute_kfac(m, approx="Expand"),
    lambda m: psh.compute_hess(m, unsupported="ignore")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_refused_argument_does_not_poison_the_next_step(refused, dtype):
    """A verb refusing its arguments (a negative threshold, a parameter in no group, an unknown
    approximation) after the step's backward ends the step, as other refusals do: the next,
    corrected step was refused as a second micro-batch."""
    model, x = mlp().to(dtype), torch.randn(5, 5, dtype=dtype)
    with psh.add_hooks(model):
        step(model, x)
        with pytest.raises(ValueError):
            refused(model)
        step(model, x, "sum")
        psh.compute_grad1(model, loss_type="sum")
        expected = loop_grads(copy.deepcopy(model).double(), [x.double()], sum_of_outputs, 5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


def refuse(model: nn.Module, refusal: str, dtype: torch.dtype) -> None:
    """One step of ``model`` (Linear, BatchNorm1d, Tanh, Linear) that compute_* refuses."""
    x = torch.randn(6, 5, dtype=dtype)
    model.train(refusal == "batchnorm_training")  # batch statistics mix the samples
    model.zero_grad(set_to_none=True)
    if refusal == "batch_sizes":  # two batches of different sizes in one step
        (model(x).sum() + model(x[:4]).sum()).backward()
    elif refusal == "create_graph":  # a gradient penalty
        x.requires_grad_(True)
        out = model(x).sum()
        (gradient,) = torch.autograd.grad(out, x, create_graph=True)
        (out + gradient.pow(2).sum()).backward()
    else:
        model(x).sum().backward()
    if refusal == "in_place":
        x.mul_(2)


@pytest.mark.parametrize("refusal", ["batchnorm_training", "batch_sizes", "in_place",
                                     "create_graph"])
@pytest.mark.parametrize("refused_by", ["compute_grad1", "compute_norms", "clip_grads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_refused_step_does_not_poison_the_next(refusal, refused_by, dtype):
    """After a refusal, the next forward starts a new step (it was taken for a second
    micro-batch of the refused step: 'ran a forward pass after a backward pass')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    model = model.to(dtype)
    with torch.no_grad():  # running statistics away from (0, 1)
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    psh.add_hooks(model)
    try:
        refuse(model, refusal, dtype)
        compute = {"compute_grad1": psh.compute_grad1, "compute_norms": psh.compute_norms,
                   "clip_grads": lambda m: psh.clip_grads(m, 1.0)}[refused_by]
        with pytest.raises(psh.PerSampleHooksError):
            compute(model)
        model.eval()
        x = torch.randn(5, 5, dtype=dtype)
        step(model, x)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    reference = model.double()
    expected = loop_grads(reference, [x.double()], sum_of_outputs, 5)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for n, g in expected.items():
        torch.testing.assert_close(got[n].double(), g, **tolerance, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("frozen_body", [False, True])
@pytest.mark.parametrize("check_unseen", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gradient_penalty_is_refused_whatever_the_check(check_unseen, dtype, frozen_body):
    """A loss with a gradient in it (``create_graph=True``): before, the check reported "a
    gradient term that no hook sees" on the steps it compared, and without it grad1 was off by
    about 100% of its largest entry, with no error. ``frozen_body``: only the last Linear is
    trainable (a linear probe), whose output gradient in the penalty's backward is its seed,
    a constant that does not require grad: that backward was not noticed, grad1 off by 3x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    model[0].requires_grad_(not frozen_body)
    x = torch.randn(4, 3, dtype=dtype, requires_grad=True)
    with psh.add_hooks(model, check_unseen=check_unseen):
        for _ in range(3):  # steps the default check does not compare too
            out = model(x)
            (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.sum() + (gradient.pow(2).sum(1) - 1).pow(2).sum()).backward()
            with pytest.raises(psh.PerSampleHooksError, match="compute_grad1: a backward pass "
                               "of this step built the graph of its gradients"):
                psh.compute_grad1(model)


@pytest.mark.parametrize("transform", ["hessian", "jacrev"])
@pytest.mark.parametrize("check_unseen", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_model_in_a_torch_func_transform_of_the_loss_is_refused(transform, check_unseen,
                                                                     dtype):
    """A PINN's loss with the Laplacian (or Jacobian) of the hooked model taken by
    ``torch.func`` inside it: calls in transforms are not recorded, and the steps the check
    did not compare gave grad1 up to 3x off with no error. Refused on every step, naming the
    module; the same transform under torch.no_grad() (a value the loss does not
    differentiate) is no refusal and the step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    single = lambda point: model(point.unsqueeze(0)).squeeze()  # noqa: E731
    derivative = {"hessian": lambda x: torch.func.vmap(torch.func.hessian(single))(x)
                  .diagonal(dim1=-2, dim2=-1).sum(-1),
                  "jacrev": lambda x: torch.func.vmap(torch.func.jacrev(single))(x).sum(-1)
                  }[transform]
    x = torch.randn(4, 2, dtype=dtype)
    with psh.add_hooks(model, check_unseen=check_unseen):
        for _ in range(3):  # steps the default check does not compare too
            ((derivative(x) + model(x).squeeze(-1)) ** 2).mean().backward()
            with pytest.raises(psh.PerSampleHooksError, match=r"compute_grad1: '0' was called "
                               r"inside a torch.func transform .* torch.no_grad\(\)"):
                psh.compute_grad1(model)
        model.zero_grad()
        with torch.no_grad():
            target = derivative(x)
        ((target + model(x).squeeze(-1)) ** 2).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model).double()
    for i in range(4):  # each sample's loss with its target, in float64
        sample_loss = (target[i].double() + reference(x[i:i + 1].double()).squeeze()) ** 2
        grads = torch.autograd.grad(sample_loss, list(reference.parameters()))
        for (n, _), g in zip(reference.named_parameters(), grads):
            torch.testing.assert_close(got[n][i].double(), g, **loop_tolerance(dtype))


def test_positions_before_the_batch_are_refused_with_the_fix():
    """Positions looked up as ``[1, T]`` before any module saw the batch cannot be told from a
    batch of one: refused with the fix."""
    class Positional(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(7, 3), nn.Embedding(5, 3)

        def forward(self, ids):
            positions = self.positions(torch.arange(ids.shape[1])[None])
            return (self.tokens(ids) + positions).sum()

    model = Positional()
    psh.add_hooks(model)
    model(torch.randint(7, (2, 5))).backward()
    with pytest.raises(psh.PerSampleHooksError, match=r"2 \(at 'tokens'\), 1 \(at 'positions'\)"
                                                      r".*arange\(T\)\.expand\(B, -1\)"):
        psh.compute_grad1(model)


def test_frozen_modules_record_nothing_until_unfrozen():
    """A module with no trainable parameter holds neither input nor output gradient (a frozen
    layer under LoRA); unfrozen, it is recorded again; a frozen BatchNorm in training mode is
    still observed (its batch statistics mix the samples of every layer below)."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    model[2].requires_grad_(False)
    state = psh.add_hooks(model)
    x = torch.randn(6, 5)
    model(x).sum().backward()
    assert state.calls[model[0]] and not state.calls[model[2]]
    psh.compute_grad1(model)
    assert model[0].weight.grad1.shape == (6, 4, 5) and not hasattr(model[2].weight, "grad1")
    model[2].requires_grad_(True)
    model(x).sum().backward()
    assert state.calls[model[2]]
    psh.compute_grad1(model)
    assert model[2].weight.grad1.shape == (6, 3, 4)
    psh.remove_hooks(model)

    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    model[1].requires_grad_(False)
    psh.add_hooks(model)
    model(x).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="batch statistics"):
        psh.compute_grad1(model)
    psh.remove_hooks(model)


class LearnedScale(nn.Module):
    """A learned scale: parameters of its own, no rule, no children (a peft adapter's DoRA
    magnitude vector)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return x * self.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_module_frozen_at_add_hooks_without_a_rule_is_exact_once_unfrozen(dtype):
    """Frozen when add_hooks ran and unfrozen later (peft's set_adapter flips DoRA magnitudes),
    a learned scale (no rule: its raw uses followed) records nothing while frozen, and once
    unfrozen its grad1 and the norms are the loop's. Before, it was not hooked: it had no grad1
    and compute_norms silently lacked its term."""
    torch.manual_seed(0)
    middle = LearnedScale(4)
    model = nn.Sequential(nn.Linear(3, 4), middle, nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    x = torch.randn(5, 3, dtype=dtype)
    middle.requires_grad_(False)
    state = psh.add_hooks(model)
    try:
        weighted_square(model(x)).mean().backward()
        assert not state.calls[middle]
        psh.compute_grad1(model)
        middle.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    finally:
        psh.remove_hooks(model)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    assert got.keys() == expected.keys()
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, **loop_tolerance(dtype))
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms.double(), total, **loop_tolerance(dtype))


class HalvedShift(AffineRule):
    """AffineRule with a wrong formula: ``shift``'s per-sample gradients halved."""

    def forms(self, module, calls, names):
        result = super().forms(module, calls, names)
        if "shift" in result:
            result["shift"] = [psh.Outer(form.grads / 2) for form in result["shift"]]
        return result


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_user_rule_whose_rows_do_not_sum_to_the_gradient_is_refused(dtype):
    """Before, the check's confirmation took the rules' gap to the recomputed gradient for
    rounding (the module sees every use), and grad1 was silently half of the truth; in
    float32 it still did, where the recomputation determines the gradient."""
    registry = psh.RuleRegistry()
    psh.register_rule(Affine, registry)(HalvedShift)
    model = nn.Sequential(nn.Linear(4, 4), Affine(4)).to(dtype)
    psh.add_hooks(model, registry=registry)
    try:
        model(torch.randn(5, 4, dtype=dtype)).square().sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"parameter '1.shift': the per-sample "
                           r"gradients of '1' do not sum to the gradient .*its formula is wrong"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_autograd_grad_over_every_parameter_and_a_restricted_backward(dtype):
    """``torch.autograd.grad(loss, params)`` (no ``.grad`` written) gives the ``grad1`` of
    ``loss.backward()``, exact against the loop, norms and checks included. A backward
    restricted to the last layer (``inputs=``) never reaches the first: its rows are zeros, as
    the README says (the hooks cannot tell it from an output the loss does not use)."""
    model, x = mlp().to(dtype), torch.randn(6, 5, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 6)
    with psh.add_hooks(model, check_unseen="always"):
        torch.autograd.grad(weighted_square(model(x)).mean(), list(model.parameters()))
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            assert p.grad is None
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
        weighted_square(model(x)).mean().backward(inputs=[model[2].weight])
        psh.compute_grad1(model)
        assert model[0].weight.grad is None and not model[0].weight.grad1.any()
        torch.testing.assert_close(model[2].weight.grad1.double(), expected["2.weight"],
                                   **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_input_gradients_taken_as_the_readme_says(dtype):
    """An input-gradient pass on the step's graph after its compute_*, or on a forward of its
    own followed by clear_backprops: the next steps are exact. Taken before the step's
    backward it adds to it, as the README says (doubled here, the same loss twice)."""
    model, x = mlp().to(dtype), torch.randn(5, 5, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)

    def exact(factor: float = 1.0) -> None:
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), factor * expected[n],
                                       **loop_tolerance(dtype))

    with psh.add_hooks(model, check_unseen=False):
        inputs = x.clone().requires_grad_()
        loss = weighted_square(model(inputs)).mean()
        loss.backward(retain_graph=True)
        psh.compute_grad1(model)
        exact()
        torch.autograd.grad(loss, inputs)  # after the compute_* call
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        exact()
        torch.autograd.grad(weighted_square(model(inputs)).sum(), inputs)  # own forward
        psh.clear_backprops(model)
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        exact()
        loss = weighted_square(model(inputs)).mean()
        torch.autograd.grad(loss, inputs, retain_graph=True)  # before the step's backward
        loss.backward()
        psh.compute_grad1(model)
        exact(2.0)


def test_add_hooks_again_with_other_options_is_refused():
    """A hooked model given other options (the units= a refusal advised) returned the old state,
    silently ignoring them; the next step was refused with the same advice. Refused now; the
    same options, or none (DPSGD's own call), give the state."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    state = psh.add_hooks(model, units=["0"])
    try:
        assert psh.add_hooks(model) is state
        assert psh.add_hooks(model, units=[model[0]]) is state
        for options, named in ((dict(units=["2"]), "units"), (dict(batch_dim=1), "batch_dim"),
                               (dict(check_unseen="always"), "check_unseen")):
            with pytest.raises(psh.PerSampleHooksError, match=rf"add_hooks: Sequential is "
                               rf"hooked already, with another {named} than asked now.*"
                               r"remove_hooks\(model\) first"):
                psh.add_hooks(model, **options)
        assert psh.add_hooks(model) is state and model[0] in state.units
    finally:
        psh.remove_hooks(model)
    assert model[2] in psh.add_hooks(model, units=["2"]).units
    psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("enabled_again", ["before the backward", "before compute", "never"])
def test_a_forward_with_the_hooks_disabled_after_a_step_is_refused(enabled_again, dtype):
    """After a step, a forward and backward with the hooks disabled: every compute_* gave the
    earlier step's results (grad1 150% off p.grad, no error). Refused, saying the hooks were
    disabled; the next step, hooks on, is exact."""
    torch.manual_seed(0)
    model = mlp().to(dtype)
    with psh.add_hooks(model):
        model(torch.randn(6, 5, dtype=dtype)).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        model.zero_grad()
        psh.disable_hooks(model)
        out = model(torch.randn(6, 5, dtype=dtype))
        if enabled_again == "before the backward":
            psh.enable_hooks(model)
        out.sum().backward()
        if enabled_again == "before compute":
            psh.enable_hooks(model)
        with pytest.raises(psh.PerSampleHooksError, match=r"compute_norms: the hooked modules "
                           r"ran with their hooks disabled \(disable_hooks\) since the step"):
            psh.compute_norms(model, loss_type="sum")
        psh.enable_hooks(model)
        model.zero_grad()
        x = torch.randn(6, 5, dtype=dtype)
        model(x).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        expected = loop_grads(copy.deepcopy(model).double(), [x.double()],
                              lambda out: out.sum(1), 6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


def test_a_gradient_hook_on_a_parameter_is_warned_of_once():
    """``p.register_hook`` changes ``.grad`` after autograd computed it, which the per-sample
    quantities do not follow (silent on the steps the check does not run): warned of once,
    naming the parameter; the check's own hooks are not the user's."""
    torch.manual_seed(0)
    model = mlp()
    with psh.add_hooks(model, check_unseen="always"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(torch.randn(6, 5)).sum().backward()
            psh.compute_grad1(model, loss_type="sum")
        handle = model[0].weight.register_hook(lambda g: g * 2)
        for step in range(2):
            model.zero_grad()
            model(torch.randn(6, 5)).sum().backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(psh.PerSampleHooksError, match=r"'0.weight'.*passes "
                                   r"through a hook registered on it \(p.register_hook\)"):
                    psh.compute_grad1(model, loss_type="sum")
            assert [str(w.message).split(":")[1] for w in caught] == \
                ([" parameter '0.weight' has a gradient hook (p.register_hook)"] if step == 0
                 else [])
        handle.remove()
