"""A parameter shared by several hooked modules (tied input and output embeddings, one Linear's
weight used by two): its per-sample gradient is the sum of the modules' forms, so its norms
carry the cross terms; norms, clipping and DPSGD against the float64 loop, float32 and
float64, mean and sum losses."""
import pytest
import torch
from models import TiedLanguageModel
from norms_truth import assert_clipping_matches, assert_norms_match
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, seeded


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


def test_second_moments_of_a_shared_parameter_are_refused():
    model = TiedLinears()
    psh.add_hooks(model)
    model(torch.randn(4, 3, 4)).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="tied weights across modules.*"
                       "compute_norms, clip_grads and DPSGD do"):
        psh.compute_fisher_diag(model)
    psh.remove_hooks(model)
