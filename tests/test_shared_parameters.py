"""A parameter shared by several hooked modules (tied input and output embeddings, one Linear's
weight used by two): its per-sample gradient is the sum of the modules' forms, so its norms
carry the cross terms; norms, clipping and DPSGD against the float64 loop, float32 and
float64, mean and sum losses."""
import copy

import pytest
import torch
from models import TiedLanguageModel
from norms_truth import assert_clipping_matches, assert_norms_match
from torch import Tensor, nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_tolerance, seeded


class TiedLinears(nn.Module):
    """Two Linear modules with one weight (Outer forms of both: joined)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Scaled(nn.Module):
    """A module with no rule (the torch.func fallback: Dense forms) that uses an embedding's
    table: ``h @ table^T * scale``."""

    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.table = table
        self.scale = nn.Parameter(torch.tensor([0.7]))

    def forward(self, h):
        return h @ self.table.t() * self.scale


class TiedToFallback(nn.Module):
    """Embedding (Rows) tied to a fallback unit (Dense) and a Linear (Outer): three kinds."""

    def __init__(self, vocab=11, dim=5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = Scaled(self.embedding.weight)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embedding.weight

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.embedding(tokens)))
        return self.head(h) + self.out(h)


class HeldByAnUncalledModule(nn.Module):
    """BART's word embeddings: a table held by a module never called (``shared``) and by the
    two that are (the encoder's embedding, the output layer)."""

    def __init__(self, vocab=9, dim=4):
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.embed = nn.Embedding(vocab, dim)
        self.embed.weight = self.shared.weight
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.shared.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


def cases():
    g = seeded(0)
    return {
        "linears": (TiedLinears, lambda: [torch.randn(5, 3, 4, generator=g)]),
        "embedding-and-output": (lambda: TiedLanguageModel(vocab=13, dim=8, heads=2, length=5),
                                 lambda: [torch.randint(0, 13, (4, 5), generator=g)]),
        "three-kinds": (TiedToFallback, lambda: [torch.randint(0, 11, (4, 6), generator=g)]),
        "held-by-an-uncalled-module": (HeldByAnUncalledModule,
                                       lambda: [torch.randint(0, 9, (4, 3), generator=g)]),
    }


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("case", list(cases()))
def test_norms_and_clipping_of_a_shared_parameter(case, loss_type):
    make, inputs = cases()[case]
    torch.manual_seed(1)
    model, x = make(), inputs()
    assert_matches_loop(model, x, loss_type=loss_type)
    assert_norms_match(model, x, loss_type=loss_type)
    assert_clipping_matches(model, x, max_grad_norm=0.3, loss_type=loss_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dpsgd_on_tied_embeddings(dtype):
    """DPSGD's output-edge backward (a formed-on-arrival Linear among them) and release of
    records, twice: the update is the loop's clipped mean."""
    torch.manual_seed(2)
    model = TiedLanguageModel(vocab=13, dim=8, heads=2, length=5).to(dtype)
    tokens = torch.randint(0, 13, (4, 5))
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=0.4, dataset_size=40, batch_size=4, accountant=None)
    reference = TiedLanguageModel(vocab=13, dim=8, heads=2, length=5).double()
    for _ in range(2):
        reference.load_state_dict(model.state_dict())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        dp.zero_grad()
        dp.backward(model(tokens).pow(2).sum((1, 2)).mean())
        dp.step()
        expected = clipped_mean(reference, tokens, 0.4)
        for n, p in model.named_parameters():
            torch.testing.assert_close((before[n] - p.detach()).double(), expected[n],
                                       **({"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64
                                          else {"rtol": 1e-4, "atol": 1e-6}))
    dp.close()
    psh.remove_hooks(model)


def clipped_mean(model, tokens, max_norm):
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(model(tokens[i:i + 1]).pow(2).sum(), list(params.values()))
            for i in range(len(tokens))]
    norms = torch.stack([torch.cat([g.flatten() for g in row]).norm() for row in rows])
    factors = (max_norm / (norms + 1e-6)).clamp(max=1)
    return {n: sum(f * row[k] for f, row in zip(factors, rows)) / len(rows)
            for k, n in enumerate(params)}


def per_sample_jacobians(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """``{name: [B, outputs, numel]}``: each sample's output (flattened) differentiated by each
    parameter, one sample at a time in float64; a tied parameter stands for all its uses."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def output(values: dict[str, Tensor], sample: Tensor) -> Tensor:
        return torch.func.functional_call(model, values, (sample,)).flatten()
    rows = [torch.func.jacrev(output)(params, x[i:i + 1]) for i in range(len(x))]
    return {n: torch.stack([row[n].flatten(1) for row in rows]) for n in params}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("case", list(cases()))
def test_second_moments_of_a_shared_parameter(case, loss_type, dtype):
    """Fisher diagonal, variance, Gram and empirical Fisher blocks after an ordinary backward,
    and the Gauss-Newton blocks and diagonal after backprop_hess, of a parameter of several
    modules (each pass's forms of its modules summed): against the float64 per-sample
    loop."""
    make, inputs = cases()[case]
    torch.manual_seed(1)
    model, (x,) = make().to(dtype), inputs()
    x = x.to(dtype) if x.is_floating_point() else x
    twin = copy.deepcopy(model).double()
    wide = x.double() if x.is_floating_point() else x
    jacobians = per_sample_jacobians(twin, wide)
    outputs = torch.cat([twin(wide[i:i + 1]) for i in range(len(x))]).flatten(1).detach()
    # per-sample loss 0.5 |out|^2: gradient J^T out; Gauss-Newton J^T J
    loop = {n: torch.einsum("bon,bo->bn", j, outputs) for n, j in jacobians.items()}
    scale = 1 / len(x) if loss_type == "mean" else 1.0

    def close(got: Tensor, want: Tensor, name: str) -> None:  # float32: to its largest entry
        tolerance = loop_tolerance(dtype) if dtype == torch.float64 else \
            dict(rtol=1e-4, atol=1e-6 * float(want.abs().max()))
        torch.testing.assert_close(got.double(), want, **tolerance, msg=name)
    reduce = torch.mean if loss_type == "mean" else torch.sum
    with psh.add_hooks(model):
        results = {}
        for compute in ("fisher", "variance", "gram", "hess"):
            reduce(0.5 * model(x).flatten(1).square().sum(1)).backward()
            if compute == "fisher":
                results[compute] = psh.compute_fisher_diag(model, loss_type)
            elif compute == "variance":
                results[compute] = psh.compute_grad_variance(model, loss_type)
            elif compute == "gram":
                results[compute] = psh.compute_gram(model, loss_type)
            else:
                psh.compute_hess(model, loss_type)
                results[compute] = {n: p.hess for n, p in model.named_parameters()}
        psh.backprop_hess(model(x).flatten(1), "LeastSquares", loss_type=loss_type)
        psh.compute_hess(model, loss_type)
        gauss_newton = {n: p.hess for n, p in model.named_parameters()}
        psh.backprop_hess(model(x).flatten(1), "LeastSquares", loss_type=loss_type)
        diagonal = psh.compute_fisher_diag(model, loss_type)
    assert results["fisher"].keys() == dict(model.named_parameters()).keys()
    for n, g in loop.items():
        shape = dict(model.named_parameters())[n].shape
        for got, want in [(results["fisher"][n], g.square().sum(0).view(shape)),
                          (results["variance"][n], g.var(0, unbiased=False).view(shape)),
                          (results["hess"][n], g.t() @ g * scale),
                          (gauss_newton[n], torch.einsum("bon,bom->nm", jacobians[n],
                                                         jacobians[n]) * scale),
                          (diagonal[n], jacobians[n].square().sum((0, 1)).view(shape))]:
            close(got, want, n)
    flat = torch.cat(list(loop.values()), 1)
    close(results["gram"], flat @ flat.t(), "gram")
    psh.remove_hooks(model)
