"""Mixed precision and dtypes.

Under ``torch.autocast(device_type=..., dtype=torch.bfloat16)`` (the CPU, or the GPU with
``PSH_TEST_DEVICE=cuda``: the same tolerances hold on both) a hooked module sees and
returns bfloat16 tensors while its parameters stay float32. The captured inputs and output
gradients are converted to the parameters' dtype before any rule runs, so per-sample
quantities come out in float32, computed in float32 from the bfloat16 values of the forward and
backward. Documented tolerance: against the float32 per-sample loop *without* autocast, each
parameter's per-sample gradients (and the norms) agree to a relative Frobenius error below
``AUTOCAST_RTOL`` = 2e-2 (bfloat16 keeps 8 significant bits, relative rounding 2^-8 ~ 4e-3 per
operation; a few layers compound it) beyond the error autocast itself makes there: that of
autograd's own per-sample gradients, a loop under the same autocast. That own error is at
most 1.1e-2 on the CPU (ours 9.4e-3), but 5.6e-2 on the CNN's first convolution on an H100
(cuDNN's bfloat16 kernels), where ours are within 4.4e-3 of autograd's. bfloat16 parameters
give bfloat16 results within ``BF16_RTOL`` = 2e-2 of the float64 loop on the same
(bfloat16-valued) weights beyond the error of autograd's own bfloat16 loop there.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import TimmLikeViT
from torch import Tensor, nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_grads, weighted_square
from per_sample_hooks import norms as norms_module

AUTOCAST_RTOL = 2e-2
DEVICE_TYPE = torch.get_default_device().type
BF16_RTOL = 2e-2


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((got.double() - expected).norm() / expected.norm().clamp_min(1e-12))


def assert_within_precision(got: dict, exact: dict, autograd_own: dict, tolerance: float,
                            norms: torch.Tensor | None = None) -> None:
    """Each parameter's per-sample gradients ``got`` (and the per-sample ``norms``, if given)
    within ``tolerance`` (relative Frobenius) of the ``exact`` loop's, beyond the error that
    autograd's own per-sample gradients in the same precision (``autograd_own``) make there."""
    for n in exact:
        own = relative_error(autograd_own[n], exact[n])
        error = relative_error(got[n], exact[n])
        assert error < tolerance + own, \
            f"{n}: relative error {error:.2e}, autograd's own in this precision {own:.2e}"
    if norms is not None:
        expected, own = (torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
                         for grads in (exact, autograd_own))
        assert relative_error(norms, expected) < tolerance + relative_error(own, expected)


class Reused(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def models() -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return [
        ("mlp", nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), (6,)),
        ("tokens", nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)), (5, 6)),
        ("reuse", Reused(), (4, 6)),
        ("cnn", nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
                              nn.Linear(4 * 3 * 3, 3)), (2, 5, 5)),
        ("vit", TimmLikeViT(), (3, 8, 8)),  # raw parameters followed in bfloat16 ops
    ]


@pytest.mark.parametrize("index", range(len(models())), ids=[m[0] for m in models()])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_autocast_bfloat16_forward(index, loss_type):
    _, model, shape = models()[index]
    torch.manual_seed(1)
    x = torch.randn(7, *shape)
    expected = loop_grads(model, [x], weighted_square, len(x))  # float32, no autocast
    with psh.add_hooks(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=DEVICE_TYPE, dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16  # autocast did run the layers in bfloat16
        losses = weighted_square(out.float())
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        norms = psh.compute_norms(model, loss_type=loss_type)
        psh.compute_grad1(model, loss_type=loss_type)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            assert p.grad1.dtype == p.dtype == torch.float32, n
            reduced = p.grad1.mean(0) if loss_type == "mean" else p.grad1.sum(0)
            assert relative_error(reduced, p.grad) < AUTOCAST_RTOL, n
        psh.clip_grads(model, max_grad_norm=0.5, loss_type=loss_type)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with torch.autocast(device_type=DEVICE_TYPE, dtype=torch.bfloat16):
        autocast_loop = loop_grads(model, [x], lambda out: weighted_square(out.float()), len(x))
    assert norms.dtype == torch.float32
    assert_within_precision(got, expected, autocast_loop, AUTOCAST_RTOL, norms)


def test_autocast_captures_are_not_kept_in_float32_twice():
    """The conversion happens once per step, in the records: a second compute_* finds the
    records already in the parameters' dtype."""
    _, model, shape = models()[0]
    with psh.add_hooks(model) as state:
        with torch.autocast(device_type=DEVICE_TYPE, dtype=torch.bfloat16):
            out = model(torch.randn(4, *shape))
        out.float().sum().backward()
        psh.compute_grad1(model)
        calls = [c for cs in state.calls.values() for c in cs]
        assert all(not c.has_other_float_dtype(torch.float32) for c in calls)
        first = model[0].weight.grad1.clone()
        psh.compute_grad1(model)
        torch.testing.assert_close(model[0].weight.grad1, first, rtol=0, atol=0)


@pytest.mark.parametrize("index", range(len(models())), ids=[m[0] for m in models()])
def test_float64_parameters(index):
    _, model, shape = models()[index]
    got = assert_matches_loop(model, [torch.randn(5, *shape)], loss_type="sum")
    assert all(g.dtype == torch.float64 for g in got.values())


@pytest.mark.parametrize("index", range(len(models())), ids=[m[0] for m in models()])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_bfloat16_parameters(index, loss_type):
    _, model, shape = models()[index]
    model = model.bfloat16()
    torch.manual_seed(2)
    x = torch.randn(6, *shape).bfloat16()
    with psh.add_hooks(model):
        losses = weighted_square(model(x).float())
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        norms = psh.compute_norms(model, loss_type=loss_type)
        psh.compute_grad1(model, loss_type=loss_type)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
        assert all(g.dtype == torch.bfloat16 for g in got.values())
        assert norms.dtype == torch.float32  # (second moments of bfloat16: float32)
    bfloat16_loop = loop_grads(model, [x], lambda out: weighted_square(out.float()), len(x))
    model64 = model.double()  # the same bfloat16-valued weights, exactly, in float64
    expected = loop_grads(model64, [x.double()], weighted_square, len(x))
    assert_within_precision(got, expected, bfloat16_loop, BF16_RTOL, norms)


class Recurrent(nn.Module):
    def __init__(self, layer: type[nn.RNNBase]):
        super().__init__()
        self.rnn, self.out = layer(6, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def inside_autocast_models() -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    torch.manual_seed(3)
    return [*models(), ("gru", Recurrent(nn.GRU), (4, 6)), ("lstm", Recurrent(nn.LSTM), (4, 6)),
            ("norm", nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)), (9, 6)),
            ("image", nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(),
                                    nn.Linear(2 * 12 * 12, 3)), (1, 12, 12))]


def quantities_of_a_step(model: nn.Module, x: torch.Tensor, inside: bool) -> dict[str, object]:
    """Each verb's result after a forward under bfloat16 autocast, its backward and the verb
    run ``inside`` the same ``torch.autocast`` block or after it; two DPSGD updates (noise 0,
    the per-sample gradients of the layers on many positions formed during its backward) of a
    copy of ``model``."""
    def autocast_backward(net: nn.Module, call, backward=Tensor.backward) -> object:
        with torch.autocast(DEVICE_TYPE, torch.bfloat16):
            losses = weighted_square(net(x).float())
            if inside:
                backward(losses.mean())
                return call()
        backward(losses.mean())
        return call()

    got: dict[str, object] = {}
    with psh.add_hooks(model):
        verbs = {"norms": lambda: psh.compute_norms(model, per_param=True),
                 "grad1": lambda: psh.compute_grad1(model) or
                 {n: p.grad1 for n, p in model.named_parameters()},
                 "clipped": lambda: psh.clip_grads(model, 0.3) is not None and
                 {n: p.grad for n, p in model.named_parameters()},
                 "fisher": lambda: psh.compute_fisher_diag(model),
                 "gram": lambda: psh.compute_gram(model),
                 "kfac": lambda: list(psh.compute_kfac(model, unsupported="skip").values())}
        for name, verb in verbs.items():
            model.zero_grad(set_to_none=True)
            got[name] = autocast_backward(model, verb)
    private = copy.deepcopy(model)
    psh.add_hooks(private, check_unseen=False)  # every step's backward an edge backward
    optimizer = torch.optim.SGD(private.parameters(), lr=1.0)
    dp = psh.DPSGD(private, optimizer, noise_multiplier=0.0, max_grad_norm=0.3,
                   dataset_size=100, batch_size=len(x))
    for _ in range(2):
        optimizer.zero_grad()
        autocast_backward(private, dp.step, dp.backward)
    got["dpsgd"] = dict(private.named_parameters())
    dp.close()
    psh.remove_hooks(private)
    return got


@pytest.mark.parametrize("index", range(len(inside_autocast_models())),
                         ids=[m[0] for m in inside_autocast_models()])
def test_verbs_inside_autocast_as_after_it(index):
    """A step whose backward and ``compute_*`` (and DPSGD's step) run inside the ``with
    torch.autocast(...)`` block gives exactly what they give after it: the library's math runs
    outside autocast (before, a recurrent layer's crashed there, and the others' ran in
    bfloat16, 2e-3 from these)."""
    _, model, shape = inside_autocast_models()[index]
    torch.manual_seed(4)
    x = torch.randn(7, *shape)
    after = quantities_of_a_step(copy.deepcopy(model), x, inside=False)
    inside = quantities_of_a_step(copy.deepcopy(model), x, inside=True)
    torch.testing.assert_close(inside, after, rtol=0, atol=0)


class Residual(nn.Module):
    """``x + f(x)``: its output stays float32 under autocast, f's rounded in bfloat16;
    ``centered``: minus the batch's mean (a forward that depends on the batch)."""

    def __init__(self, centered: bool = False):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 6)
        self.centered = centered

    def forward(self, x):
        y = x + self.b(torch.relu(self.norm(self.a(x))))
        return y - y.mean(0) if self.centered else y


def test_a_unit_whose_output_stays_float32_under_autocast():
    """A unit of the torch.func fallback run under bfloat16 autocast is compared with its
    re-run by a re-run of the batch (outside autocast, as the samples'), not by the forward's
    output, which rounding in bfloat16 put 1e-3 away (refused as depending on the batch
    before): accepted within the autocast tolerance, and a unit that does depend on the batch
    still refused."""
    torch.manual_seed(5)
    model = nn.Sequential(Residual(), nn.Linear(6, 3))
    x = torch.randn(7, 6)
    expected = loop_grads(model, [x], weighted_square, len(x))
    with psh.add_hooks(model, units=[model[0]]):
        with torch.autocast(DEVICE_TYPE, torch.bfloat16):
            out = model(x)
        weighted_square(out.float()).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    with torch.autocast(DEVICE_TYPE, torch.bfloat16):
        autocast_loop = loop_grads(model, [x], lambda out: weighted_square(out.float()), len(x))
    assert_within_precision(got, expected, autocast_loop, AUTOCAST_RTOL, norms)

    model[0].centered = True
    with psh.add_hooks(model, units=[model[0]]):
        with torch.autocast(DEVICE_TYPE, torch.bfloat16):
            out = model(x)
        weighted_square(out.float()).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match="depends on the batch"):
            psh.compute_grad1(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_grad_scaler_scales_per_sample_quantities_by_its_scale(dtype):
    """``torch.amp.GradScaler`` multiplies the loss by its scale S before the backward, so the
    captured output gradients, ``grad1`` and the norms are S times the step's (the library
    cannot see S): ``grad1 / S`` is exact, and ``clip_grads(model, max_grad_norm * S)`` followed
    by ``scaler.step(optimizer)`` (which unscales ``p.grad``) steps with the clipped mean at
    ``max_grad_norm``, as the README says."""
    from norms_truth import loop_clipped, loop_norms
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    x = torch.randn(6, 4, dtype=dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    reference.load_state_dict(model.state_dict())
    total, _, grads = loop_norms(reference, [x.double()], weighted_square, "mean")
    scaler = torch.amp.GradScaler(DEVICE_TYPE, init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    tolerance = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else {}
    with psh.add_hooks(model):
        scaler.scale(weighted_square(model(x)).mean()).backward()
        scale = scaler.get_scale()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close((p.grad1 / scale).double(), grads[n], **tolerance)
        norms = psh.clip_grads(model, 0.1 * scale)
        torch.testing.assert_close((norms / scale).double(), total, **tolerance)
        scaler.step(optimizer)
        scaler.update()
    clipped = loop_clipped(grads, total, 0.1, "mean")
    for n, p in model.named_parameters():
        torch.testing.assert_close((before[n] - p.detach()).double(), clipped[n], **tolerance)


class HalfRange(nn.Module):
    """A Linear on raw pixel-scale inputs (``|a|^2`` beyond float16's 65504), one on
    positions and an embedding: the squares of float16 norms and second moments leave its
    range where the per-sample gradients do not."""

    def __init__(self):
        super().__init__()
        self.pixels, self.tokens = nn.Linear(64, 3), nn.Embedding(10, 3)
        self.mix = nn.Linear(3, 2)

    def forward(self, x, ids):
        return self.mix(torch.tanh(self.pixels(x)[:, None] + self.tokens(ids))).sum(1)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0], ids=["underflow", "unit", "overflow"])
def test_float16_norms_and_second_moments_are_squared_in_float32(scale, monkeypatch):
    """float16 forms are squared in float32: compute_norms and clip_grads against the float64
    loop, the Fisher diagonal and the Gram (float32 results) against float16's own grad1
    squared in float64, within float16's rounding. In float16 the norms were 0 (|g|^2
    underflows: no clipping) or refused as not finite (|a|^2 overflows), the Fisher diagonal
    and the Gram NaN or inf."""
    torch.manual_seed(0)
    model = HalfRange()
    x, ids = torch.rand(6, 64) * 255, torch.randint(0, 10, (6, 4))
    weights = torch.tensor([1.0, -2.0]) * scale
    expected = loop_grads(model.double(), [x.double(), ids], lambda out: out @ weights.double(),
                          6)
    truth = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    model.half()
    for keep in (0.0, 1e9):  # norms from the forms, from kept per-sample gradients
        monkeypatch.setattr(norms_module, "KEEP_FRACTION", keep)
        with psh.add_hooks(model):
            (model(x.half(), ids).float() @ weights).sum().backward()
            norms = psh.compute_norms(model, loss_type="sum")
            fisher = psh.compute_fisher_diag(model, loss_type="sum")
            gram = psh.compute_gram(model, loss_type="sum")
            psh.compute_grad1(model, loss_type="sum")
            grad1 = {n: p.grad1.double() for n, p in model.named_parameters()}
            clipped = psh.clip_grads(model, float(truth.median()), loss_type="sum")
        model.zero_grad(set_to_none=True)
        flat = torch.cat([g.flatten(1) for g in grad1.values()], 1)
        assert gram.dtype == torch.float32 and all(f.dtype == torch.float32
                                                   for f in fisher.values())
        torch.testing.assert_close(norms.double(), truth, rtol=2e-2, atol=0)
        torch.testing.assert_close(clipped.double(), truth, rtol=2e-2, atol=0)
        torch.testing.assert_close(gram.double(), flat @ flat.T, rtol=1e-2, atol=0)
        for n, g in grad1.items():
            torch.testing.assert_close(fisher[n].double(), g.square().sum(0), rtol=1e-2,
                                       atol=1e-3 * float(g.square().sum(0).max()))


def test_float16_kfac_factors_and_optimizer_are_in_float32():
    """compute_kfac of a float16 model (inputs of pixel scale: ``a a^T`` beyond 65504) gave
    inf factors with no error, and psh.optim.KFAC's first step then blamed divergence. The
    factors and the curvature diagonals are float32, within float16's rounding of those of
    the same (float16-valued) weights in float64; KFAC's running state stays float32."""
    torch.manual_seed(0)
    x, ids = torch.rand(6, 64) * 255, torch.randint(0, 10, (6, 4))
    weights = torch.tensor([1.0, -2.0])
    half = HalfRange()
    with torch.no_grad():
        half.pixels.weight.mul_(1e-3)  # its tanh not saturated (float16's is then 1 exactly)
    half.half()
    wide = copy.deepcopy(half).double()
    factors = {}
    for model, dtype in ((half, torch.float16), (wide, torch.float64)):
        with psh.add_hooks(model):
            (model(x.to(dtype), ids).double() @ weights.double()).mean().backward()
            factors[dtype] = psh.compute_kfac(model)
            model.zero_grad(set_to_none=True)
    for pair, expected in zip(factors[torch.float16].values(),
                              factors[torch.float64].values()):
        for got, truth in zip(pair, expected):
            assert got.dtype == torch.float32 and bool(got.isfinite().all())
            torch.testing.assert_close(got.double(), truth, rtol=1e-2,
                                       atol=1e-3 * float(truth.abs().max()))
    # KFAC's step: its running state float32, its direction the float64 preconditioning of
    # the float16 gradient by those factors (the direction itself is ill-conditioned, rank-6
    # factors of 65 columns: compared with the float64 model's it differs by float16's rounding
    # of the gradient outside the inputs' span, divided by the damping alone; a damping of
    # the factors' scale keeps float32's rounding of the eigenvectors out of that span too)
    preconditioner = psh.optim.KFAC(half, damping=100.0, kl_clip=None)
    (half(x.half(), ids).double() @ weights.double()).mean().backward()
    gradient = torch.cat([half.pixels.weight.grad, half.pixels.bias.grad[:, None]], 1).double()
    preconditioner.step()
    assert all(t.dtype == torch.float32 for pair in preconditioner.factors.values() for t in pair)
    a, g = preconditioner.factors[half.pixels]
    expected = psh.optim.precondition(gradient[None], psh.optim.eigen_of(a.double(), g.double()),
                                      100.0)[0]
    got = torch.cat([half.pixels.weight.grad, half.pixels.bias.grad[:, None]], 1).double()
    assert bool(got.isfinite().all())
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_parameters_are_refused(dtype):
    """The layers' rules gave complex per-sample gradients without autograd's conjugate
    (grad1.mean(0) != p.grad), and the unseen-use check crashed in loss.backward(). Refused by
    add_hooks; a model cast to complex after add_hooks runs its backward and is refused by
    compute_*, and once cast back its next step is exact against the float64 loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with pytest.raises(psh.PerSampleHooksError, match=rf"add_hooks: parameter '0.weight' is "
                       rf"{str(dtype)[6:]}: per-sample gradients of complex parameters are not "
                       r"supported.*torch.func"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (complex modules are a new feature of torch)
            psh.add_hooks(copy.deepcopy(model).to(dtype))
    x = torch.randn(5, 4)
    psh.add_hooks(model, check_unseen="always")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.to(dtype)
    model(x.to(dtype)).abs().square().sum(1).mean().backward()
    with pytest.raises(psh.PerSampleHooksError, match=r"parameter '0.weight' is complex"):
        psh.compute_norms(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the imaginary parts, zero, are dropped)
        model.to(torch.float64)
    model.zero_grad(set_to_none=True)
    expected = loop_grads(copy.deepcopy(model), [x.double()], weighted_square, 5)
    weighted_square(model(x.double())).mean().backward()
    psh.compute_grad1(model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, expected[n], rtol=1e-9, atol=1e-10)
