"""Per-group (per-layer) clipping thresholds and groups of rows (each group's gradient the mean
of its rows'), against the float64 loop over rows: every layer family, float32 and float64,
mean and sum losses, tied parameters; the deprecated ``max_norm``."""
import copy
import warnings

import pytest
import torch
from models import LSTMClassifier, TiedLanguageModel, TimmLikeViT, TransformerClassifier
from norms_truth import assert_clipping_matches, assert_grouped_clipping_matches, hooked_backward
from torch import nn

import per_sample_hooks as psh
from ground_truth import sum_of_outputs
from per_sample_hooks import norms as norms_module
from per_sample_hooks.forms import ghost
from per_sample_hooks.rules import conv as conv_rule

UNEQUAL = torch.tensor([7, 3, 7, 5, 3, 7])  # groups of sizes 3, 2, 1, not contiguous
DTYPES = [torch.float64, torch.float32]
KEEP = [0.0, 1e9]  # the clipped sum from the forms, from the kept (groups') gradients


def mlp(positions: bool) -> tuple[nn.Module, list]:
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    return model, [torch.randn(6, 3, 5) if positions else torch.randn(6, 5)]


def cnn() -> tuple[nn.Module, list]:
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.GroupNorm(1, 3),
                          nn.ReLU(), nn.Conv2d(3, 4, 2, groups=1), nn.Flatten(),
                          nn.Linear(4 * 2 * 2, 3))
    return model, [torch.randn(6, 2, 6, 6)]


def conv_transpose() -> tuple[nn.Module, list]:
    model = nn.Sequential(nn.ConvTranspose1d(2, 3, 3, stride=2), nn.LayerNorm(9), nn.Tanh(),
                          nn.Conv1d(3, 2, 3))
    return model, [torch.randn(6, 2, 4)]


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 4, padding_idx=0)
        self.bag = nn.EmbeddingBag(11, 4, mode="mean")
        self.head = nn.Linear(4, 2)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).sum(1) + self.bag(tokens))


def tokens_model() -> tuple[nn.Module, list]:
    tokens = torch.randint(0, 11, (6, 5))
    tokens[0, :2] = tokens[2, :2]  # two rows of one group hit the same embedding rows
    return Tokens(), [tokens]


class Fallback(nn.Module):
    """A layer without a rule (nn.Bilinear: the torch.func fallback) and PReLU."""

    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(4, 4, 3)
        self.prelu = nn.PReLU(3)

    def forward(self, x):
        return self.prelu(self.bilinear(x, x.flip(1)))


def fallback() -> tuple[nn.Module, list]:
    return Fallback(), [torch.randn(6, 4)]


def recurrent() -> tuple[nn.Module, list]:
    return LSTMClassifier(vocab=20, dim=4, hidden=3, classes=2), [torch.randint(0, 20, (6, 5))]


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.gru(x)[0])


def gru() -> tuple[nn.Module, list]:
    return GRUHead(), [torch.randn(6, 4, 3)]


def transformer() -> tuple[nn.Module, list]:
    model = TransformerClassifier(vocab=20, dim=8, heads=2, ff=12, length=6, classes=3)
    padding = torch.zeros(6, 6, dtype=torch.bool)
    padding[2, 4:] = True
    return model, [torch.randint(0, 20, (6, 6)), padding]


def tied() -> tuple[nn.Module, list]:
    return TiedLanguageModel(vocab=13, dim=8, heads=2, length=5), [torch.randint(0, 13, (6, 5))]


def vit() -> tuple[nn.Module, list]:
    return TimmLikeViT(d=8, heads=2, depth=1, image=8, classes=3), [torch.randn(6, 3, 8, 8)]


def batchnorm_eval() -> tuple[nn.Module, list]:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model[1].running_mean.normal_()
    return model.eval(), [torch.randn(6, 4)]


FAMILIES = {"linear": lambda: mlp(False), "linear_positions": lambda: mlp(True), "conv": cnn,
            "conv_transpose_layernorm": conv_transpose, "embedding_bag": tokens_model,
            "fallback": fallback, "lstm": recurrent, "gru": gru, "attention": transformer,
            "tied": tied, "raw_parameters_vit": vit, "batchnorm_eval": batchnorm_eval}


def build(family: str) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    return FAMILIES[family]()


def halves(model: nn.Module) -> list:
    """Two parameter groups by name: the first half of the trainable parameters, the rest."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [(names[:len(names) // 2], 0.05), (names[len(names) // 2:], 0.2)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("groups", [UNEQUAL, 2], ids=["ids", "K2"])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("keep", KEEP, ids=["forms", "kept"])
def test_groups_of_rows_every_family(family, groups, loss_type, dtype, keep, monkeypatch):
    monkeypatch.setattr(norms_module, "KEEP_FRACTION", keep)
    model, inputs = build(family)
    norms = assert_grouped_clipping_matches(model, inputs, 0.1, groups, sum_of_outputs,
                                            loss_type, dtype)
    assert len(norms) == 3 and bool((norms > 0.1).any())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("keep", KEEP, ids=["forms", "kept"])
def test_per_group_thresholds_every_family(family, loss_type, dtype, keep, monkeypatch):
    monkeypatch.setattr(norms_module, "KEEP_FRACTION", keep)
    model, inputs = build(family)
    assert_grouped_clipping_matches(model, inputs, halves(model), None, sum_of_outputs,
                                    loss_type, dtype)


@pytest.mark.parametrize("family", ["conv", "attention", "tied", "embedding_bag"])
def test_per_group_thresholds_with_groups_of_rows(family):
    model, inputs = build(family)
    assert_grouped_clipping_matches(model, inputs, halves(model), UNEQUAL, sum_of_outputs)


@pytest.mark.parametrize("groups", [UNEQUAL, 3], ids=["ids", "K3"])
def test_chunked_conv_patches_of_groups(groups, monkeypatch):
    """Convolution patches built a few groups at a time (their rows gathered from a span)."""
    monkeypatch.setattr(ghost, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(conv_rule, "PATCH_CHUNK_ELEMENTS", 64)
    model, inputs = build("conv")
    assert_grouped_clipping_matches(model, inputs, 0.1, groups, sum_of_outputs)


@pytest.mark.parametrize("family", ["conv", "linear", "embedding_bag"])
def test_joint_groups_without_rows_are_zero_and_leave_the_others_unchanged(family,
                                                                         monkeypatch):
    """``JointGroups(ids, count)`` with groups 1 and 4 empty (convolution patches built a few
    groups at a time, some spans holding no row): one norm per id, the empty ones 0, the others
    those of the same groups numbered without gaps; sum loss: the same clipped sum."""
    monkeypatch.setattr(ghost, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(conv_rule, "PATCH_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(norms_module, "KEEP_FRACTION", 0.0)  # norms from the forms
    model, inputs = build(family)
    numbered, compact = torch.tensor([0, 2, 0, 3, 2, 0]), torch.tensor([0, 1, 0, 2, 1, 0])
    results = []
    for groups in (psh.JointGroups(numbered, 5), psh.JointGroups(compact)):
        hooked_backward(model, inputs, sum_of_outputs, "sum")
        try:
            norms = psh.clip_grads(model, 0.1, "sum", groups=groups)
            results.append((norms, [p.grad.clone() for p in model.parameters()]))
        finally:
            psh.remove_hooks(model)
    (with_count, grads), (without, expected) = results
    assert with_count.shape == (5,) and bool((with_count[[1, 4]] == 0).all())
    torch.testing.assert_close(with_count[[0, 2, 3]], without, rtol=1e-6, atol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_per_layer_selectors_by_name_module_and_parameter():
    """Names (of parameters or modules), modules, parameters and iterables select alike; the
    tied weight is one parameter, selected under either name."""
    model, inputs = build("tied")
    def by_module(m):
        return [(m.embedding, 0.1), (m.block, 0.3), (m.positions, 0.2)]

    def by_parameter(m):
        return [([m.embedding.weight], 0.1), (m.block.parameters(), 0.3),
                (m.positions.positions, 0.2)]
    by_name = {"out.weight": 0.1, "block": 0.3, "positions.positions": 0.2}
    results = [assert_grouped_clipping_matches(model, inputs, spec, None, sum_of_outputs)
               for spec in (by_module, by_name, by_parameter)]
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])


def test_per_group_clipping_differs_from_flat_and_one_group_equals_it():
    """Guard: the groups change the result; one group of everything is flat clipping."""
    model, inputs = build("linear")
    hooked_backward(model, inputs, sum_of_outputs)
    psh.clip_grads(model, [(model.parameters(), 0.1)])
    one_group = [p.grad.clone() for p in model.parameters()]
    psh.remove_hooks(model)
    hooked_backward(model, inputs, sum_of_outputs)
    psh.clip_grads(model, 0.1)
    flat = [p.grad.clone() for p in model.parameters()]
    psh.remove_hooks(model)
    hooked_backward(model, inputs, sum_of_outputs)
    psh.clip_grads(model, [(model[0], 0.1), (model[2], 0.1)])
    per_layer = [p.grad.clone() for p in model.parameters()]
    psh.remove_hooks(model)
    for a, b in zip(one_group, flat):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.allclose(a, b) for a, b in zip(per_layer, flat))


@pytest.mark.parametrize("spec, error, message", [
    (lambda m: [(m[0], 0.1)], ValueError, r"2\.weight, 2\.bias in no max_grad_norm group"),
    (lambda m: [(m[0], 0.1), (m, 0.2)], ValueError, "'0.weight' is in max_grad_norm groups 0 "
                                                     "and 1"),
    (lambda m: {"nope": 0.1}, ValueError, "names 'nope', which is neither"),
    (lambda m: [(m[0], -1.0), (m[2], 1.0)], ValueError, "max_grad_norm of group 0 must be > 0"),
    (lambda m: [(m[1], 0.1), (m, 1.0)], ValueError, "group 0 .* holds no trainable parameter"),
    (lambda m: [(nn.Linear(2, 2), 0.1)], ValueError, "not a parameter of the model"),
    (lambda m: [0.5, 1.0], ValueError, r"\(parameters, threshold\) pairs"),
    (lambda m: [(3, 0.5)], TypeError, "selected by a parameter or module name"),
])
def test_bad_groups_of_parameters(spec, error, message):
    model, inputs = build("linear")
    hooked_backward(model, inputs, sum_of_outputs)
    try:
        with pytest.raises(error, match=message):
            psh.clip_grads(model, spec(model))
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("groups, error, message", [
    (4, ValueError, "groups=4 consecutive rows must divide the batch of 6 rows"),
    (0, ValueError, "groups=0"),
    (torch.zeros(5, dtype=torch.long), ValueError, r"groups must .* one group id per row \(6 "
                                                   r"rows\), got dtype torch.int64, shape \(5,\)"),
    (torch.zeros(6), ValueError, "groups must be a 1-D integer tensor"),
    (True, TypeError, "groups must be an int K"),
    ([0, 0, 1, 1, 2, 2], TypeError, "groups must be an int K .* got list"),
    (psh.JointGroups(torch.tensor([0, 0, 1, 1, 3, 3]), 3), ValueError,
     r"JointGroups\(ids, count=3\) needs ids in 0..2, got ids from 0 to 3"),
    (psh.JointGroups(2, 3), TypeError, r"JointGroups\(ids, count\) takes a \[batch\] tensor"),
    (psh.JointGroups(torch.zeros(6, dtype=torch.long), 0), TypeError,
     r"JointGroups\(ids, count\) .* a positive int count, got Tensor and 0"),
])
def test_bad_groups_of_rows(groups, error, message):
    model, inputs = build("linear")
    hooked_backward(model, inputs, sum_of_outputs)
    try:
        with pytest.raises(error, match=f"clip_grads: {message}"):
            psh.clip_grads(model, 1.0, groups=groups)
    finally:
        psh.remove_hooks(model)


def test_groups_as_a_numpy_integer_or_a_0_dim_tensor():
    """As max_grad_norm takes them: the same as the int (they were refused)."""
    import numpy as np
    model, inputs = build("linear")
    results = []
    for groups in (3, np.int64(3), torch.tensor(3)):
        hooked_backward(model, inputs, sum_of_outputs)
        try:
            results.append(psh.clip_grads(model, 1.0, groups=groups))
        finally:
            psh.remove_hooks(model)
    for got in results[1:]:
        torch.testing.assert_close(got, results[0], rtol=0, atol=0)


def test_batchnorm_in_training_mode_is_still_refused_with_groups():
    """Batch statistics mix the rows of different groups: refused as without groups."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    hooked_backward(model, [torch.randn(6, 4)], sum_of_outputs)
    try:
        with pytest.raises(psh.PerSampleHooksError, match="BatchNorm"):
            psh.clip_grads(model, 1.0, groups=2)
    finally:
        psh.remove_hooks(model)


def test_singleton_groups_equal_rows_and_uniform_groups_equal_the_mean_loss():
    """Groups of one row are the rows (equal to clip_grads without groups); with no clipping
    and equal groups the clipped mean is the loss's gradient."""
    model, inputs = build("conv")
    ids = torch.arange(6).flip(0)
    assert_grouped_clipping_matches(model, inputs, 0.1, ids, sum_of_outputs)
    assert_clipping_matches(copy.deepcopy(model), inputs, 0.1, sum_of_outputs)
    model = model.double()
    x = inputs[0].double()
    hooked_backward(model, [x], sum_of_outputs)
    psh.clip_grads(model, 1e9, groups=3)
    clipped = [p.grad.clone() for p in model.parameters()]
    psh.remove_hooks(model)
    model.zero_grad()
    sum_of_outputs(model(x)).mean().backward()
    for got, expected in zip(clipped, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected)


def test_max_norm_is_deprecated_and_still_works():
    model, inputs = build("linear")
    hooked_backward(model, inputs, sum_of_outputs)
    with pytest.warns(DeprecationWarning, match="max_norm is deprecated, use max_grad_norm") \
            as caught:
        old = psh.clip_grads(model, max_norm=0.1)
    assert caught[0].filename == __file__  # points at the caller
    old_grads = [p.grad.clone() for p in model.parameters()]
    psh.remove_hooks(model)
    hooked_backward(model, inputs, sum_of_outputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = psh.clip_grads(model, max_grad_norm=0.1)
    torch.testing.assert_close(old, new, rtol=0, atol=0)
    for a, p in zip(old_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=0)
    with pytest.raises(TypeError, match="pass max_grad_norm only"):
        psh.clip_grads(model, 0.1, max_norm=0.1)
    psh.remove_hooks(model)


def test_distributed_max_norm_is_deprecated():
    """The deprecation comes before the process-group check (none is initialized here)."""
    model = nn.Linear(2, 2)
    with pytest.warns(DeprecationWarning, match="distributed.clip_grads: max_norm is "
                                                "deprecated"), \
            pytest.raises(psh.PerSampleHooksError, match="not initialized"):
        psh.distributed.clip_grads(model, max_norm=1.0)
    with pytest.raises(TypeError, match="missing the clipping threshold"):
        psh.distributed.clip_grads(model)
