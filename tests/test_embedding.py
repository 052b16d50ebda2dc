"""nn.Embedding and nn.EmbeddingBag against the float64 per-sample loop: grad1, norms, clipping."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import TiedLanguageModel
from norms_truth import (
    assert_clipping_matches,
    assert_norms_match,
    hooked_backward,
    loop_clipped,
    loop_norms,
)
from torch import nn

import per_sample_hooks as psh
from ground_truth import (
    assert_matches_loop,
    loop_grads,
    loop_tolerance,
    seeded,
    weighted_square,
)
from per_sample_hooks.rules import default_registry, fallback

LOSS_TYPES = st.sampled_from(["mean", "sum"])


class Embed(nn.Module):
    """Embedding on indices ``[B, *]``, then a Linear (non-uniform output gradients)."""

    def __init__(self, vocab: int, dim: int, **options):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, **options)
        self.lin = nn.Linear(dim, 2)

    def forward(self, tokens):
        return self.lin(torch.tanh(self.emb(tokens)))


class EmbedTwice(Embed):
    """The embedding called twice in one forward (reuse): contributions add up."""

    def forward(self, tokens):
        shifted = (tokens + 1) % self.emb.num_embeddings
        return self.lin(torch.tanh(self.emb(tokens)) * self.emb(shifted))


class Bags(nn.Module):
    """EmbeddingBag on bags given as padded rows ``[B, L]`` with lengths ``[B]``: with
    ``flat=True`` the bags go in as one 1-D input with offsets (each bag a sample), else as the
    2-D input itself (lengths unused)."""

    def __init__(self, vocab: int, dim: int, flat: bool, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, **options)
        self.flat = flat

    def forward(self, tokens, lengths, weights=None):
        if not self.flat:
            return self.bag(tokens, per_sample_weights=weights)
        keep = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        return self.bag(tokens[keep], offsets, None if weights is None else weights[keep])


def test_rules_are_native():
    for layer in (nn.Embedding(3, 2), nn.EmbeddingBag(3, 2)):
        rule = default_registry.lookup(layer)
        assert rule is not None and not isinstance(rule, fallback.FallbackRule)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), shape=st.lists(st.integers(1, 3), max_size=2),
       vocab=st.integers(1, 6), dim=st.integers(1, 4), padding=st.sampled_from([None, 0, -1]),
       twice=st.booleans(), loss_type=LOSS_TYPES)
def test_embedding(batch, shape, vocab, dim, padding, twice, loss_type):
    torch.manual_seed(0)
    model = (EmbedTwice if twice else Embed)(vocab, dim, padding_idx=padding)
    tokens = torch.randint(vocab, (batch, *shape))
    got = assert_matches_loop(model, [tokens], loss_type=loss_type)
    if padding is not None:  # the padding row gets no gradient
        assert not got["emb.weight"][:, padding].any()


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_embedding_frozen(loss_type):
    torch.manual_seed(0)
    model = Embed(5, 3)
    model.emb.weight.requires_grad_(False)
    got = assert_matches_loop(model, [torch.randint(5, (4, 3))], loss_type=loss_type)
    assert "emb.weight" not in got and "lin.weight" in got


def test_embedding_tied_to_output_layer_through_a_module():
    """The table is also the output layer's weight (a Linear called as a module)."""
    torch.manual_seed(0)
    assert_matches_loop(TiedLanguageModel(vocab=11, dim=8, heads=2, length=5),
                        [torch.randint(11, (3, 5))], loss_fn=weighted_square)


def test_embedding_batch_dim_one():
    torch.manual_seed(0)
    assert_matches_loop(Embed(6, 3), [torch.randint(6, (4, 3))], batch_dim=1,
                        loss_fn=lambda out: (out.movedim(1, 0) ** 2).flatten(1).sum(1))


def test_embedding_max_norm_is_exact():
    """max_norm renormalizes the hit rows in place during the forward. The loop runs on an
    untouched copy, so it renormalizes sample by sample; the gradients still agree."""
    torch.manual_seed(0)
    model = Embed(6, 4, max_norm=0.5).double()
    with torch.no_grad():
        model.emb.weight.mul_(3)
    fresh = copy.deepcopy(model)
    tokens = torch.randint(6, (5, 3))
    assert (fresh.emb.weight[tokens.unique()].norm(dim=1) > 0.5).all()
    psh.add_hooks(model)
    weighted_square(model(tokens)).mean().backward()
    psh.compute_grad1(model)
    got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    psh.remove_hooks(model)
    assert (model.emb.weight[tokens.unique()].norm(dim=1) <= 0.5).all()  # renormalized
    expected = loop_grads(fresh, [tokens], weighted_square, 5)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10)


def sparse_grad1(check_unseen: bool) -> None:
    torch.manual_seed(0)
    model = Embed(7, 3, sparse=True, padding_idx=1).double()
    tokens = torch.randint(7, (4, 3))
    psh.add_hooks(model, check_unseen=check_unseen)
    try:
        weighted_square(model(tokens)).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        got = model.emb.weight.grad1.clone()
        assert model.emb.weight.grad.is_sparse
        torch.testing.assert_close(got.sum(0), model.emb.weight.grad.to_dense())
    finally:
        psh.remove_hooks(model)
    expected = loop_grads(model, [tokens], weighted_square, 4)["emb.weight"].to_dense()
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_embedding_sparse():
    sparse_grad1(check_unseen=False)


def test_embedding_sparse_with_unseen_check():
    sparse_grad1(check_unseen=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clipping_keeps_a_sparse_gradient_sparse(dtype):
    """Embedding(sparse=True): clip_grads leaves p.grad sparse, as autograd gave it (SparseAdam
    takes no dense gradient), equal to the float64 loop's clipped mean, and zero on an empty
    (Poisson) batch. DPSGD's p.grad is
    dense on every step, its first (checked: an ordinary backward, sparse gradients) too,
    in one batch or two micro-batches, and equal to the loop's without noise."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return Embed(7, 3, sparse=True, padding_idx=1).to(dtype)

    model, tokens = build(), torch.randint(7, (6, 3), generator=seeded(1))
    reference = Embed(7, 3, padding_idx=1).double()  # dense gradients for the loop
    reference.load_state_dict(model.state_dict())
    total, _, grads = loop_norms(reference, [tokens], weighted_square, "mean")
    expected = loop_clipped(grads, total, 0.5, "mean")
    tolerance = loop_tolerance(dtype)
    hooked_backward(model, [tokens])
    try:
        psh.clip_grads(model, max_grad_norm=0.5)
        assert model.emb.weight.grad.is_sparse
        torch.testing.assert_close(model.emb.weight.grad.to_dense().double(),
                                   expected["emb.weight"], **tolerance)
        torch.optim.SparseAdam([model.emb.weight]).step()
        model.zero_grad(set_to_none=True)
        model(tokens[:0]).sum().backward()
        assert len(psh.clip_grads(model, max_grad_norm=0.5)) == 0
        assert model.emb.weight.grad.is_sparse and not model.emb.weight.grad.to_dense().any()
        torch.optim.SparseAdam([model.emb.weight]).step()
    finally:
        psh.remove_hooks(model)
    for noise, micro_batches in [(0.0, 1), (0.0, 2), (1.0, 1)]:
        model = build()
        dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0),
                       noise_multiplier=noise, max_grad_norm=0.5, dataset_size=60, batch_size=6,
                       accountant=None)
        try:
            for _ in range(2):  # (lr 0: the same step twice, the second not checked)
                dp.zero_grad()
                for part in tokens.chunk(micro_batches):
                    dp.backward(weighted_square(model(part)).mean())
                    if micro_batches > 1:
                        dp.accumulate()
                dp.step()
                assert not model.emb.weight.grad.is_sparse
                if noise == 0:
                    torch.testing.assert_close(model.emb.weight.grad.double(),
                                               expected["emb.weight"], **tolerance)
        finally:
            dp.close()
            psh.remove_hooks(model)


@pytest.mark.parametrize("make", [lambda: Embed(5, 3, scale_grad_by_freq=True),
                                  lambda: Bags(5, 3, flat=False, scale_grad_by_freq=True)])
def test_scale_grad_by_freq_is_refused(make):
    model = make().double()
    inputs = [torch.randint(5, (4, 3))] + ([] if isinstance(model, Embed) else
                                           [torch.full((4,), 3)])
    hooked_backward(model, inputs)
    try:
        with pytest.raises(psh.PerSampleHooksError, match="scale_grad_by_freq=True"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)


# --- EmbeddingBag ----------------------------------------------------------------------------

def bag_inputs(batch: int, length: int, vocab: int, weighted: bool, empty: bool,
               generator: torch.Generator) -> list:
    tokens = torch.randint(vocab, (batch, length), generator=generator)
    lengths = torch.randint(0 if empty else 1, length + 1, (batch,), generator=generator)
    inputs = [tokens, lengths]
    if weighted:
        inputs.append(torch.randn(batch, length, generator=generator, dtype=torch.double))
    return inputs


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 4), vocab=st.integers(1, 6),
       dim=st.integers(1, 3), mode=st.sampled_from(["sum", "mean", "max"]),
       flat=st.booleans(), last=st.booleans(), padding=st.sampled_from([None, 0]),
       weighted=st.booleans(), loss_type=LOSS_TYPES)
def test_embedding_bag(batch, length, vocab, dim, mode, flat, last, padding, weighted,
                       loss_type):
    torch.manual_seed(0)
    weighted = weighted and mode == "sum"
    model = Bags(vocab, dim, flat, mode=mode, padding_idx=padding,
                 include_last_offset=last and flat)
    inputs = bag_inputs(batch, length, vocab, weighted, empty=flat,
                        generator=seeded(batch * 7 + length))
    got = assert_matches_loop(model, inputs, loss_type=loss_type)
    if padding is not None:
        assert not got["bag.weight"][:, padding].any()


def test_embedding_bag_empty_bags():
    torch.manual_seed(0)
    for mode in ("sum", "mean", "max"):
        model = Bags(5, 3, flat=True, mode=mode)
        inputs = [torch.randint(5, (4, 3)), torch.tensor([2, 0, 3, 0])]
        got = assert_matches_loop(model, inputs)
        assert not got["bag.weight"][[1, 3]].any()


# --- norms and clipping ----------------------------------------------------------------------

CASES = {
    "embedding": (lambda: Embed(6, 3), lambda g: [torch.randint(6, (4, 5), generator=g)]),
    "embedding_padding_3d": (lambda: Embed(6, 3, padding_idx=2),
                             lambda g: [torch.randint(6, (4, 2, 3), generator=g)]),
    "embedding_twice": (lambda: EmbedTwice(4, 3, padding_idx=0),
                        lambda g: [torch.randint(4, (5, 4), generator=g)]),
    "bag_sum_weighted": (lambda: Bags(6, 3, flat=False, mode="sum", padding_idx=1),
                         lambda g: bag_inputs(4, 5, 6, True, False, g)),
    "bag_mean_flat": (lambda: Bags(6, 3, flat=True, mode="mean", padding_idx=1),
                      lambda g: bag_inputs(4, 5, 6, False, True, g)),
    "bag_max_flat": (lambda: Bags(6, 3, flat=True, mode="max", include_last_offset=True),
                     lambda g: bag_inputs(4, 5, 6, False, True, g)),
    "bag_max": (lambda: Bags(6, 3, flat=False, mode="max"),
                lambda g: bag_inputs(4, 5, 6, False, False, g)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_norms_and_clipping(case, loss_type):
    torch.manual_seed(0)
    make, inputs = CASES[case]
    model, x = make(), inputs(seeded(3))
    assert_norms_match(model, x, loss_type=loss_type)
    for max_norm in (1e-3, 0.3, 1e6):
        assert_clipping_matches(model, x, max_norm, loss_type=loss_type)


def test_norms_and_clipping_frozen_embedding():
    torch.manual_seed(0)
    model = Embed(6, 3)
    model.emb.weight.requires_grad_(False)
    x = [torch.randint(6, (4, 5))]
    assert_norms_match(model, x)
    assert_clipping_matches(model, x, 0.1)



def test_sparse_use_outside_the_module_is_reported():
    """The unseen-use check compares sparse gradients too: a functional sparse lookup of the
    table outside its module is still caught."""
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 3, sparse=True)

        def forward(self, tokens):
            return self.emb(tokens) + F.embedding(tokens.flip(1), self.emb.weight, sparse=True)

    torch.manual_seed(0)
    model = Outside().double()
    with psh.add_hooks(model):
        weighted_square(model(torch.randint(7, (4, 3)))).sum().backward()
        assert model.emb.weight.grad.is_sparse
        with pytest.raises(psh.PerSampleHooksError, match="'emb.weight'"):
            psh.compute_grad1(model, loss_type="sum")


# --- no token per sample -----------------------------------------------------------------------

class EmbedSummed(nn.Module):
    """Embedding of ``tokens [B, T]`` summed over the T tokens, added to a dense input: with
    T = 0 the table gets no gradient and the Linear still does."""

    def __init__(self, vocab: int, dim: int, **options):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, **options)
        self.lin = nn.Linear(dim, 2)

    def forward(self, tokens, x):
        return self.lin(torch.tanh(x + self.emb(tokens).sum(1)))


def no_token_cases():
    return {
        "embedding": (lambda: EmbedSummed(5, 3),
                      lambda dtype: [torch.zeros(4, 0, dtype=torch.long),
                                     torch.randn(4, 3, dtype=dtype)]),
        "embedding_padding": (lambda: EmbedSummed(5, 3, padding_idx=1),
                              lambda dtype: [torch.zeros(4, 0, dtype=torch.long),
                                             torch.randn(4, 3, dtype=dtype)]),
        # 1-D input with offsets, every bag empty (a 2-D [B, 0] input is refused by torch)
        "bag_max_all_empty": (lambda: Bags(5, 3, flat=True, mode="max"),
                              lambda dtype: [torch.zeros(4, 3, dtype=torch.long),
                                             torch.zeros(4, dtype=torch.long)]),
        "bag_mean_all_empty": (lambda: Bags(5, 3, flat=True, mode="mean"),
                               lambda dtype: [torch.zeros(4, 3, dtype=torch.long),
                                              torch.zeros(4, dtype=torch.long)]),
    }


@pytest.mark.parametrize("case", list(no_token_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_token_per_sample(case, dtype):
    """Inputs with no token per sample ([B, 0], B > 0): zero table gradients [B, V, d], zero
    norms and a working clip_grads, all as the float64 loop (once: 'cannot reshape tensor of 0
    elements')."""
    torch.manual_seed(0)
    make, inputs = no_token_cases()[case]
    model, x = make().to(dtype), inputs(dtype)
    table = next(n for n, p in model.named_parameters() if p.dim() == 2 and p.shape[0] == 5)
    reference = copy.deepcopy(model).double()
    x64 = [t.double() if t.is_floating_point() else t for t in x]
    expected = loop_grads(reference, x64, weighted_square, 4)
    expected_norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    try:
        hooked_backward(model, x)
        psh.compute_grad1(model)
        params = dict(model.named_parameters())
        assert params[table].grad1.shape == (4, 5, 3)
        assert not params[table].grad1.any()
        for n, g in expected.items():
            torch.testing.assert_close(params[n].grad1.double(), g, **tolerance)
        hooked_backward(model, x)
        norms = psh.compute_norms(model)
        torch.testing.assert_close(norms.double(), expected_norms, **tolerance)
        hooked_backward(model, x)
        clipped = psh.clip_grads(model, max_grad_norm=0.1)
        torch.testing.assert_close(clipped.double(), expected_norms, **tolerance)
        coefficients = (0.1 / (expected_norms + 1e-6)).clamp(max=1)
        for n, g in expected.items():
            torch.testing.assert_close(params[n].grad.double(),
                                       torch.einsum("b,b...->...", coefficients, g) / 4,
                                       **tolerance)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_last_offset_short_of_the_input_is_refused(mode, dtype):
    """``include_last_offset=True`` with offsets ending before the input's end: the tokens after
    it are in no bag by torch's documentation, in the last by its CPU kernel. Refused, naming
    the layer (before: mode sum silently dropped them from the per-sample gradients, mode mean
    was refused blaming a rule)."""
    bag = nn.EmbeddingBag(7, 3, mode=mode, include_last_offset=True).to(dtype)
    indices, offsets = torch.tensor([1, 2, 4, 5, 6, 3]), torch.tensor([0, 2, 4])
    with psh.add_hooks(bag):
        bag(indices, offsets).square().sum(1).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'EmbeddingBag' \(EmbeddingBag, "
                           r"include_last_offset=True\) got offsets ending at 4 for 6 indices"):
            psh.compute_grad1(bag)


class StepEmbedded(nn.Module):
    """A per-step embedding looked up by a 0-dim index (``[d]``) or, as the refusal says, by
    ``index.unsqueeze(0)`` (``[1, d]``: broadcast over the batch)."""

    def __init__(self, dim: int, unsqueezed: bool):
        super().__init__()
        self.inp, self.step, self.out = nn.Linear(3, dim), nn.Embedding(3, dim), nn.Linear(dim, 2)
        self.unsqueezed = unsqueezed

    def forward(self, x):
        h = self.inp(x)
        for t in range(2):
            index = torch.tensor(t)
            h = torch.tanh(h + self.step(index.unsqueeze(0) if self.unsqueezed else index))
        return self.out(h)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("unsqueezed", [False, True])
@pytest.mark.parametrize("dim", [4, 6])
def test_a_lookup_of_a_0_dim_index_broadcast_over_the_batch(dim, unsqueezed, dtype):
    """``emb(torch.tensor(t))`` gives one row ``[d]``, no batch (an IndexError inside the rule
    where ``d`` was the batch size, else refused as positions merged into the batch): followed
    to where the model broadcasts it over the batch; ``index.unsqueeze(0)``, ``[1, d]``, is
    expanded over the batch. Both exact against the loop."""
    torch.manual_seed(0)
    model, x = StepEmbedded(dim, unsqueezed).to(dtype), torch.randn(4, 3, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()],
                          lambda out: out.square().sum(1), 4)
    with psh.add_hooks(model):
        model(x).square().sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
