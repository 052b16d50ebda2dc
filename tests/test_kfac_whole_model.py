"""compute_kfac on whole models: Kronecker factors with a diagonal A for nn.Embedding, the
curvature diagonal for every other layer without Kronecker structure, and psh.optim.KFAC
preconditioning every parameter, against the float64 per-sample / per-token loop.

Truth: one plain-autograd pass per sample (and per backward seed) in float64, the modules'
inputs and output gradients read there by forward hooks, the factors built from them with
explicit one-hot matrices; the preconditioned step against explicit solves.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from models import TransformerClassifier
from torch import Tensor, nn

import per_sample_hooks as psh
from per_sample_hooks.curvature import KFACFactors
from per_sample_hooks.errors import UnsupportedModuleError
from per_sample_hooks.optim import KFAC

DT = torch.float64
Seed = Callable[[Tensor], Tensor]  # one sample's output -> the scalar a backward starts from


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-9, "atol": 1e-12} if dtype == DT else {"rtol": 1e-4, "atol": 1e-6}


def loop_records(model: nn.Module, samples: Sequence[tuple], seeds: Callable[[Tensor], list],
                 modules: Sequence[nn.Module]) -> dict[nn.Module, list[list[list[tuple]]]]:
    """``records[module][i][k]``: for sample ``i`` and backward seed ``k``, one
    ``(input, d seed / d output)`` per call of ``module``, from one forward per sample."""
    records: dict[nn.Module, list] = {m: [] for m in modules}
    outputs: dict[nn.Module, list] = {}

    def keep(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        outputs[module].append((inputs[0].detach(), output))

    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        for sample in samples:
            for m in modules:
                outputs[m] = []
            scalars = seeds(model(*sample))
            for m in modules:
                records[m].append([])
            for scalar in scalars:
                tensors = [out for m in modules for _, out in outputs[m]]
                grads = torch.autograd.grad(scalar, tensors, retain_graph=True,
                                            allow_unused=True)
                grads = iter(grads)
                for m in modules:
                    records[m][-1].append([(x, next(grads)) for x, _ in outputs[m]])
    finally:
        for handle in handles:
            handle.remove()
    return records


def embedding_truth(records: list, num_rows: int, padding_idx: int | None, scale: float,
                    approx: str) -> tuple[Tensor, Tensor]:
    """``(A [V, V], G [d, d])`` of an Embedding from explicit one-hot matrices: the rows of
    sample ``i`` are its non-padding tokens of every call, ``X_ik`` their output gradients in
    seed ``k``; ``scale`` is ``1/N`` (mean loss) or 1."""
    batch = len(records)
    onehots, grads = [], []
    for per_seed in records:
        tokens = torch.cat([x.reshape(-1) for x, _ in per_seed[0]])
        keep = tokens != (-1 if padding_idx is None else padding_idx)
        onehots.append(F.one_hot(tokens[keep], num_rows).to(DT))
        grads.append([torch.cat([g.reshape(-1, g.shape[-1]) for _, g in calls])[keep]
                      for calls in per_seed])
    if approx == "expand":
        entries = sum(len(e) for e in onehots)
        a = sum(e.t() @ e for e in onehots) / entries
        g = scale * sum(x.t() @ x for per_seed in grads for x in per_seed)
    else:
        shares = [e.sum(0) / len(e) for e in onehots if len(e)]
        a = sum(torch.outer(s, s) for s in shares) / batch
        g = scale * sum(torch.outer(x.sum(0), x.sum(0)) for per_seed in grads for x in per_seed)
    return a, g


class Tagger(nn.Module):
    """Embedding (called ``calls`` times, positions concatenated) + LayerNorm + Linear: an
    output per token."""

    def __init__(self, padding_idx: int | None = None, calls: int = 1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(7, 4, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)
        self.calls = calls

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.cat([self.embedding((tokens + k) % 7) for k in range(self.calls)], 1)
        return self.head(self.norm(h))


def token_loss(output: Tensor, labels: Tensor) -> Tensor:
    """Per-sample loss ``[B]``: cross-entropy summed over the sample's tokens."""
    return F.cross_entropy(output.flatten(0, 1), labels.flatten(), reduction="none") \
        .view(labels.shape).sum(1)


def hooked_kfac(model: nn.Module, tokens: Tensor, labels: Tensor, loss_type: str,
                **options) -> KFACFactors:
    with psh.add_hooks(model):
        losses = token_loss(model(tokens), labels)
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        return psh.compute_kfac(model, loss_type=loss_type, **options)


# ----------------------------------------------------------------------------- Embedding

@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("padding_idx, calls", [(None, 1), (0, 1), (None, 2)])
@pytest.mark.parametrize("dtype", [DT, torch.float32])
def test_embedding_factors_match_the_token_loop(approx: str, loss_type: str,
                                                padding_idx: int | None, calls: int,
                                                dtype: torch.dtype) -> None:
    """``(a, G)`` against one-hot matrices of the loop's tokens and output gradients: for
    expand ``A`` is exactly diagonal, for reduce ``a`` is the diagonal of its ``A``; repeated
    tokens, padding (no entry), and a module called twice (positions add up)."""
    torch.manual_seed(0)
    batch, length = 5, 6
    model = Tagger(padding_idx, calls).to(DT)
    tokens = torch.randint(0, 7, (batch, length))
    tokens[0, :2] = 3  # a repeated token
    tokens[1, -3:] = 0  # padding when padding_idx is 0
    labels = torch.randint(0, 3, (batch, length * calls))
    per_sample = [loop_records(model, [(tokens[i:i + 1],)],
                               lambda out, i=i: [token_loss(out, labels[i:i + 1])[0]],
                               [model.embedding])[model.embedding][0] for i in range(batch)]
    scale = 1 / batch if loss_type == "mean" else 1.0
    a_full, g_expected = embedding_truth(per_sample, 7, padding_idx, scale, approx)
    if approx == "expand":
        assert torch.equal(a_full, torch.diag(a_full.diagonal()))  # one-hot: diagonal
    factors = hooked_kfac(copy.deepcopy(model).to(dtype), tokens, labels, loss_type,
                          approx=approx)
    assert isinstance(factors, psh.KFACFactors)
    (module, (a, g)), = factors.embeddings.items()
    assert isinstance(module, nn.Embedding) and a.shape == (7,) and g.shape == (4, 4)
    assert a.dtype == g.dtype == dtype
    torch.testing.assert_close(a, a_full.diagonal().to(dtype), **tolerance(dtype))
    torch.testing.assert_close(g, g_expected.to(dtype), **tolerance(dtype))
    if padding_idx is not None:
        assert a[padding_idx] == 0


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_embedding_factors_after_backprop_hess_sum_the_passes(approx: str) -> None:
    """Gauss-Newton factors: ``G`` sums every pass (LeastSquares, one per output), ``a``
    counts the tokens once."""
    torch.manual_seed(1)
    batch, length, outputs = 4, 5, 3
    model = nn.Sequential(nn.Embedding(6, 4), nn.Tanh(), nn.Flatten(),
                          nn.Linear(4 * length, outputs)).to(DT)
    tokens = torch.randint(0, 6, (batch, length))
    per_sample = [loop_records(model, [(tokens[i:i + 1],)],
                               lambda out: [out[0, k] for k in range(outputs)],
                               [model[0]])[model[0]][0] for i in range(batch)]
    a_full, g_expected = embedding_truth(per_sample, 6, None, 1 / batch, approx)
    with psh.add_hooks(model):
        psh.backprop_hess(model(tokens), "LeastSquares")
        a, g = psh.compute_kfac(model, approx=approx).embeddings[model[0]]
    torch.testing.assert_close(a, a_full.diagonal(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_expected, rtol=1e-12, atol=1e-14)


def test_embedding_kron_is_the_exact_block_for_one_token() -> None:
    """One sample, one token, Embedding -> Linear -> LeastSquares (linear in the table):
    ``kron(diag(a), G)`` is the exact Hessian of the table flattened row-major."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(3, 2)).to(DT)
    tokens, target = torch.tensor([[3]]), torch.randn(1, 2, dtype=DT)
    with psh.add_hooks(model):
        psh.backprop_hess(model(tokens), "LeastSquares")
        a, g = psh.compute_kfac(model).embeddings[model[0]]

    def loss(table: Tensor) -> Tensor:
        out = torch.func.functional_call(model, {"0.weight": table}, (tokens,))
        return 0.5 * (out - target).pow(2).sum()
    hessian = torch.autograd.functional.hessian(loss, model[0].weight.detach()).reshape(15, 15)
    torch.testing.assert_close(torch.kron(torch.diag(a), g), hessian, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- diagonals

class Mixed(nn.Module):
    """Every kind of layer: Embedding, learned positions (the fallback), transformer encoder
    layers (attention units, LayerNorm, Linear), GroupNorm, RMSNorm, EmbeddingBag, a Linear
    with a frozen weight and a trainable bias, the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TransformerClassifier(vocab=11, dim=8, heads=2, ff=12, layers=1,
                                          length=6, classes=8)
        self.group = nn.GroupNorm(2, 8)
        self.rms = nn.RMSNorm(8)
        self.bag = nn.EmbeddingBag(11, 8, mode="mean")
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.group(self.body(tokens).unsqueeze(2)).squeeze(2)
        return self.head(torch.tanh(self.frozen(self.rms(h) + self.bag(tokens))))


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [DT, torch.float32])
def test_default_covers_every_parameter_and_diagonals_match_the_loop(loss_type: str,
                                                                     dtype: torch.dtype) -> None:
    """Default ``compute_kfac``: Kronecker factors for the Linear layers, ``(a, G)`` for the
    Embedding, and for every other trainable parameter its curvature diagonal, which is
    ``1/N sum_i g_i^2`` (mean loss; ``sum_i g_i^2`` for a sum) of the float64 loop's
    per-sample gradients, and ``diag(p.hess)``."""
    torch.manual_seed(3)
    batch = 5
    reference = Mixed().to(DT)
    tokens, labels = torch.randint(0, 11, (batch, 6)), torch.randint(0, 3, (batch,))
    loop = {n: [] for n, p in reference.named_parameters() if p.requires_grad}
    params = [p for p in reference.parameters() if p.requires_grad]
    for i in range(batch):
        loss = F.cross_entropy(reference(tokens[i:i + 1]), labels[i:i + 1])
        for n, g in zip(loop, torch.autograd.grad(loss, params)):
            loop[n].append(g)
    scale = 1 / batch if loss_type == "mean" else 1.0
    model = copy.deepcopy(reference).to(dtype)
    names = {m: n for n, m in model.named_modules()}
    with psh.add_hooks(model):
        losses = F.cross_entropy(model(tokens), labels, reduction="none")
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        factors = psh.compute_kfac(model, loss_type=loss_type)
    layer = model.body.encoder.layers[0]  # its attention is one unit, out_proj included
    assert set(factors) == {model.head, model.body.head, layer.linear1, layer.linear2}
    assert set(factors.embeddings) == {model.body.embedding}
    assert factors.skipped == []
    covered = [f"{names[m]}.weight" for m in factors.embeddings]
    for m in factors.kronecker:
        covered += [f"{names[m]}.{n}" for n, p in m.named_parameters() if p.requires_grad]
    for m, diagonals in factors.diagonal.items():
        covered += [f"{names[m]}.{n}" for n in diagonals]
        for n, diagonal in diagonals.items():
            expected = torch.stack(loop[f"{names[m]}.{n}"]).square().sum(0) * scale
            torch.testing.assert_close(diagonal, expected.to(dtype), **tolerance(dtype),
                                       msg=lambda text, n=f"{names[m]}.{n}": f"{n}: {text}")
    assert sorted(covered) == sorted(loop)  # every trainable parameter, once
    assert list(factors.diagonal[model.frozen]) == ["bias"]
    assert {"body.positions", "group", "rms", "bag", "body.encoder.layers.0.self_attn"} <= \
        {names[m] for m in factors.diagonal}
    with psh.add_hooks(model):  # the diagonal is diag(p.hess), the scale of the factors
        losses = F.cross_entropy(model(tokens), labels, reduction="none")
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        psh.compute_hess(model, loss_type=loss_type)
        for m, diagonals in factors.diagonal.items():
            for n, diagonal in diagonals.items():
                torch.testing.assert_close(diagonal.flatten(), m.get_parameter(n).hess.diagonal(),
                                           **tolerance(dtype))


def test_skip_and_raise() -> None:
    """``unsupported="skip"`` lists what it left out; ``"raise"`` names the layer; the
    Embedding has factors under every choice; a frozen weight's trainable bias is refused by
    ``"raise"``."""
    torch.manual_seed(4)
    model = Tagger().to(DT)
    model.head.weight.requires_grad_(False)
    tokens, labels = torch.randint(0, 7, (3, 4)), torch.randint(0, 3, (3, 4))
    skipped = hooked_kfac(model, tokens, labels, "mean", unsupported="skip")
    assert dict(skipped) == {} and set(skipped.embeddings) == {model.embedding}
    assert skipped.diagonal == {}
    assert sorted(skipped.skipped) == ["head.bias", "norm.bias", "norm.weight"]
    with pytest.raises(UnsupportedModuleError, match=r"'norm'.*not available for LayerNorm "
                                                     r"\(weight, bias\).*unsupported='diagonal'"):
        hooked_kfac(model, tokens, labels, "mean", unsupported="raise")
    model.norm.requires_grad_(False)
    with pytest.raises(UnsupportedModuleError, match=r"'head'.*\(bias\): its weight is frozen"):
        hooked_kfac(model, tokens, labels, "mean", unsupported="raise")
    with pytest.raises(ValueError, match="unsupported must be one of"):
        hooked_kfac(model, tokens, labels, "mean", unsupported="ignore")


# ----------------------------------------------------------------------------- KFAC

def test_kfac_step_preconditions_every_parameter() -> None:
    """Embedding + LayerNorm + Linear, one KFAC step: each parameter's new gradient is the
    explicit solve with the factors built from the float64 token loop: ``(kron(G, A) +
    lambda I)^-1 vec([W | b])`` for the Linear, ``(kron(diag(a), G) + lambda I)^-1 vec(table)``
    for the Embedding, ``grad / (D + lambda)`` for the LayerNorm; nothing is left to the
    optimizer and nothing is warned."""
    torch.manual_seed(5)
    batch, length, damping = 4, 3, 0.1
    model = Tagger().to(DT)
    tokens, labels = torch.randint(0, 7, (batch, length)), torch.randint(0, 3, (batch, length))
    per_sample = [loop_records(model, [(tokens[i:i + 1],)],
                               lambda out, i=i: [token_loss(out, labels[i:i + 1])[0]],
                               [model.embedding, model.head]) for i in range(batch)]
    a_embedding, g_embedding = embedding_truth(
        [r[model.embedding][0] for r in per_sample], 7, None, 1 / batch, "expand")
    acts = torch.cat([torch.cat([x.reshape(-1, 4), torch.ones(length, 1, dtype=DT)], 1)
                      for r in per_sample for x, _ in r[model.head][0][0]])
    outs = torch.cat([g.reshape(-1, 3) for r in per_sample for _, g in r[model.head][0][0]])
    a_head, g_head = acts.t() @ acts / (batch * length), outs.t() @ outs / batch
    loop = {n: [] for n, _ in model.named_parameters()}
    for i in range(batch):
        loss = token_loss(model(tokens[i:i + 1]), labels[i:i + 1])[0]
        for n, g in zip(loop, torch.autograd.grad(loss, list(model.parameters()))):
            loop[n].append(g)
    diagonal = {n: torch.stack(loop[n]).square().sum(0) / batch
                for n in ("norm.weight", "norm.bias")}

    precond = KFAC(model, damping=damping, factor_decay=0.0, kl_clip=None)
    token_loss(model(tokens), labels).mean().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precond.step()
    assert precond.left_to_optimizer == {}

    def solve(curvature: Tensor, grad: Tensor) -> Tensor:
        eye = torch.eye(len(curvature), dtype=DT)
        return torch.linalg.solve(curvature + damping * eye, grad.reshape(-1)).view(grad.shape)
    head = solve(torch.kron(g_head, a_head),
                 torch.cat([before["head.weight"], before["head.bias"][:, None]], 1))
    torch.testing.assert_close(model.head.weight.grad, head[:, :-1])
    torch.testing.assert_close(model.head.bias.grad, head[:, -1])
    torch.testing.assert_close(model.embedding.weight.grad, solve(
        torch.kron(torch.diag(a_embedding.diagonal()), g_embedding), before["embedding.weight"]))
    for n in ("norm.weight", "norm.bias"):
        torch.testing.assert_close(model.get_parameter(n).grad,
                                   before[n] / (diagonal[n] + damping))
    clone = Tagger().to(DT)  # the state round-trips with every kind of block
    clone.load_state_dict(model.state_dict())
    other = KFAC(clone)
    other.load_state_dict(precond.state_dict())
    assert {other.names[m] for m in other.embeddings} == {"embedding"}
    assert {(other.names[m], n) for m, n in other.diagonals} == \
        {("norm", "weight"), ("norm", "bias")}
    assert {other.names[m] for m in other.eigen} == {"embedding", "head"}
    tokens = torch.randint(0, 7, (batch, length))
    for net, preconditioner in ((model, precond), (clone, other)):
        net.zero_grad()
        token_loss(net(tokens), labels).mean().backward()
        preconditioner.step()  # no new eigendecomposition: the loaded ones are used
    for (n, p), q in zip(model.named_parameters(), clone.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


# ----------------------------------------------------------------------------- GPT-2

def tiny_gpt2(dtype: torch.dtype) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()  # eval: no dropout


def gpt2_loss(model: nn.Module, ids: Tensor, positions: bool = True) -> Tensor:
    """Mean next-token cross-entropy, computed in the model's dtype. ``positions``: pass the
    position ids ``[B, T]``; GPT-2's default ids are ``[1, T]``, broadcast over the batch, which
    the hooks expand to the batch (``add_hooks(broadcast=True)``)."""
    position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1) if positions else None
    logits = model(ids, position_ids=position_ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("dtype", [DT, torch.float32])
def test_gpt2_default_compute_kfac(dtype: torch.dtype) -> None:
    """A tiny random GPT-2, by default: Kronecker factors for ``lm_head`` and the Conv1D
    projections, ``(a, G)`` for the token and position tables, diagonals for LayerNorm,
    nothing skipped; the tables' factors and the diagonals against the float64 loop (every
    sample has T tokens, so the mean over tokens is the mean of the samples' losses); the tied
    ``wte`` / ``lm_head`` weight has a factor pair per module."""
    batch, length = 3, 8
    reference = tiny_gpt2(DT)
    ids = torch.randint(0, 50, (batch, length))
    wte, wpe = reference.transformer.wte, reference.transformer.wpe
    per_sample = [loop_records(reference, [(ids[i:i + 1],)],
                               lambda out, i=i: [F.cross_entropy(
                                   out.logits[0, :-1], ids[i, 1:])],
                               [wte, wpe]) for i in range(batch)]
    params = dict(reference.named_parameters())
    loop = {n: [] for n in params}
    for i in range(batch):
        for n, g in zip(params, torch.autograd.grad(gpt2_loss(reference, ids[i:i + 1]),
                                                    list(params.values()))):
            loop[n].append(g)
    model = copy.deepcopy(reference).to(dtype)
    names = {m: n for n, m in model.named_modules()}
    with psh.add_hooks(model):
        gpt2_loss(model, ids).backward()
        factors = psh.compute_kfac(model)
    assert {type(m).__name__ for m in factors} == {"Conv1D", "Linear"}
    assert len(factors) == 9 and model.lm_head in factors
    assert model.lm_head.weight is model.transformer.wte.weight
    assert {names[m] for m in factors.embeddings} == {"transformer.wte", "transformer.wpe"}
    assert factors.skipped == []
    assert {type(m).__name__ for m in factors.diagonal} == {"LayerNorm"}
    covered = {"lm_head.weight", "transformer.wte.weight", "transformer.wpe.weight",
               *(f"{names[m]}.{n}" for m in factors for n in ("weight", "bias")
                 if m is not model.lm_head)}
    for m, diagonals in factors.diagonal.items():
        for n, diagonal in diagonals.items():
            name = f"{names[m]}.{n}"
            covered.add(name)
            expected = torch.stack(loop[name]).square().sum(0) / batch
            torch.testing.assert_close(diagonal, expected.to(dtype), **tolerance(dtype),
                                       msg=lambda text, name=name: f"{name}: {text}")
    assert covered == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules())
    for name, table in (("transformer.wte", wte), ("transformer.wpe", wpe)):
        a_full, g_expected = embedding_truth([r[table][0] for r in per_sample],
                                             table.num_embeddings, None, 1 / batch, "expand")
        a, g = factors.embeddings[modules[name]]
        torch.testing.assert_close(a, a_full.diagonal().to(dtype), **tolerance(dtype))
        torch.testing.assert_close(g, g_expected.to(dtype), **tolerance(dtype))
    with psh.add_hooks(model):
        gpt2_loss(model, ids).backward()
        with pytest.raises(UnsupportedModuleError, match="LayerNorm|Conv1D"):
            psh.compute_kfac(model, unsupported="raise")
    with psh.add_hooks(model):  # GPT-2's own [1, T] position ids: the same factors
        gpt2_loss(model, ids, positions=False).backward()
        for got, want in zip(psh.compute_kfac(model).tensors(), factors.tensors(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12 if dtype == DT else 1e-5,
                                       atol=1e-14 if dtype == DT else 1e-7)


def test_gpt2_kfac_step_leaves_the_tied_weight_to_the_optimizer() -> None:
    """``psh.optim.KFAC`` on GPT-2: every parameter is preconditioned except the weight that
    ``wte`` and ``lm_head`` share, which is left as it is, reported and warned about."""
    model = tiny_gpt2(DT)
    ids = torch.randint(0, 50, (3, 8))
    precond = KFAC(model, damping=1e-3)
    gpt2_loss(model, ids).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match=r"transformer\.wte\.weight"):
        precond.step()
    (name, why), = precond.left_to_optimizer.items()
    assert name == "transformer.wte.weight"
    assert "'lm_head' and 'transformer.wte'" in why
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]) == (n == name), n
    eigen = precond.eigen  # the excluded blocks do not make every step decompose again
    gpt2_loss(model, ids).backward()
    precond.step()
    assert precond.eigen is eigen
