"""Per-sample gradients formed as output gradients arrive (``OutputEdges(form_on_arrival=True)``,
what ``DPSGD`` uses): every quantity against the float64 per-sample loop, which layers are
formed, and the refusals."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import loop_clipped, loop_norms
from torch import nn

import per_sample_hooks as psh
from per_sample_hooks.capture import get_state
from per_sample_hooks.dp import OutputEdges
from per_sample_hooks.errors import PerSampleHooksError, UnsupportedModuleError
from per_sample_hooks.step import form_on_arrival


class Mixed(nn.Module):
    """Formed: the LayerNorm, the narrow Linear over many positions, the conv over a large
    image. Kept as records: the wide Linear on ``[B, d]``, the embedding (its per-sample table
    is larger than its record) and the Linear called twice."""

    def __init__(self, positions: int, d: int):
        super().__init__()
        self.embed = nn.Embedding(11, d)
        self.norm = nn.LayerNorm(d)
        self.narrow = nn.Linear(d, 2)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.twice = nn.Linear(2, 2)
        self.head = nn.Linear(2 + 2 * positions, 3)

    def forward(self, tokens, image):
        h = self.narrow(torch.tanh(self.norm(self.embed(tokens))))  # [B, T, 2]
        h = self.twice(torch.tanh(self.twice(h)))
        c = self.conv(image).flatten(2).mean(2)  # [B, 2]
        return self.head(torch.cat([c, h.flatten(1)], 1))


FORMED = {"norm", "narrow", "conv"}


def make_case(batch: int, positions: int, d: int, seed: int = 0):
    torch.manual_seed(seed)
    model = Mixed(positions, d).double()
    inputs = [torch.randint(11, (batch, positions)),
              torch.randn(batch, 1, 2 * positions, 2 * positions, dtype=torch.double)]
    return model, inputs


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(1) + out[:, 0]


def edges_without_check(model: nn.Module) -> OutputEdges:
    """An edge backward on every step: the unseen-use check (which would make a checked step's
    backward an ordinary one) is off; its schedule is tested in test_dp."""
    psh.add_hooks(model, check_unseen=False)
    return OutputEdges(model, form_on_arrival=True)


def formed_backward(model: nn.Module, inputs: list, loss_type: str) -> OutputEdges:
    edges = edges_without_check(model)
    losses = loss_fn(model(*inputs))
    edges.backward(losses.mean() if loss_type == "mean" else losses.sum())
    return edges


def formed_names(model: nn.Module) -> set[str]:
    state = get_state(model)
    return {state.modules[m][0] for m, calls in state.calls.items()
            if any(c.per_sample is not None for c in calls)}


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 5), positions=st.integers(6, 9), d=st.integers(3, 6),
       loss_type=st.sampled_from(["mean", "sum"]), max_norm=st.sampled_from([0.05, 1e3]))
def test_norms_clipping_and_grad1_equal_the_loop(batch, positions, d, loss_type, max_norm):
    model, inputs = make_case(batch, positions, d)
    total, per_param, grads = loop_norms(model, inputs, loss_fn, loss_type)
    expected = loop_clipped(grads, total, max_norm, loss_type)
    for _ in range(2):  # a second step reuses the buffers
        formed_backward(model, inputs, loss_type)
        assert formed_names(model) == FORMED
        norms = psh.compute_norms(model, loss_type=loss_type, per_param=True)
        clipped_norms = psh.clip_grads(model, max_norm, loss_type=loss_type)
        psh.compute_grad1(model, loss_type=loss_type)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, grads[n], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(norms[n], per_param[n], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(p.grad, expected[n], rtol=1e-10, atol=1e-12)
            p.grad = None
        torch.testing.assert_close(clipped_norms, total, rtol=1e-10, atol=1e-12)
    psh.remove_hooks(model)


def test_formed_records_hold_no_input_and_second_moments_are_exact():
    model, inputs = make_case(4, 7, 5)
    _, _, grads = loop_norms(model, inputs, loss_fn, "mean")
    formed_backward(model, inputs, "mean")
    state = get_state(model)
    for module, calls in state.calls.items():
        if state.modules[module][0] in FORMED:
            (call,) = calls
            assert call.args == () and not any(call.grads)
    fisher = psh.compute_fisher_diag(model)
    gram = psh.compute_gram(model)
    psh.compute_hess(model, unsupported="skip")
    for n, p in model.named_parameters():
        torch.testing.assert_close(fisher[n], grads[n].square().sum(0))
        if n.split(".")[0] in FORMED:
            flat = grads[n].flatten(1)
            torch.testing.assert_close(p.hess, flat.t() @ flat / len(flat))
    flat = torch.cat([g.flatten(1) for g in grads.values()], 1)
    torch.testing.assert_close(gram, flat @ flat.t())


def test_kfac_is_refused_for_formed_layers_only():
    layer = nn.Linear(2, 1).double()
    edges = edges_without_check(layer)
    edges.backward(layer(torch.randn(3, 20, 2, dtype=torch.double)).sum())
    with pytest.raises(UnsupportedModuleError, match="form_on_arrival"):
        psh.compute_kfac(layer)
    model, inputs = make_case(3, 6, 4)
    formed_backward(model, inputs, "mean")
    kept = psh.compute_kfac(model, unsupported="skip")
    assert {get_state(model).modules[m][0] for m in kept} == {"twice", "head"}



def test_another_pass_after_forming_is_refused():
    model, inputs = make_case(3, 6, 4)
    state = psh.add_hooks(model)
    loss = loss_fn(model(*inputs)).mean()
    state.listeners.on_gradient = lambda module, call: form_on_arrival(state, module, call)
    loss.backward(retain_graph=True)
    state.listeners.on_gradient = None
    loss.backward()
    with pytest.raises(PerSampleHooksError, match="another gradient"):
        psh.compute_norms(model)


def test_unformable_calls_keep_their_records():
    """Batch statistics and an input changed in place: not formed, refused as usual."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(),
                          nn.Linear(2 * 36, 2)).double()
    edges = edges_without_check(model)
    edges.backward(model(torch.randn(3, 1, 8, 8, dtype=torch.double)).sum())
    assert formed_names(model) == {"0"}  # the conv; the BatchNorm is not formed
    with pytest.raises(PerSampleHooksError, match="batch statistics"):
        psh.compute_norms(model)

    layer = nn.LayerNorm(4).double()
    edges = edges_without_check(layer)
    x = torch.randn(3, 9, 4, dtype=torch.double, requires_grad=True)
    y = x * 1
    out = layer(y)
    y.mul_(2)  # the captured input changes after the forward: autograd refuses first
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edges.backward(out.pow(2).sum())
    assert not formed_names(layer)
    with pytest.raises(PerSampleHooksError):
        psh.compute_norms(layer)


def test_dpsgd_forms_on_unchecked_steps():
    """DPSGD's edge backward forms; its clipped step equals one after loss.backward()."""
    from per_sample_hooks.dp import DPSGD
    results = []
    for use_dp_backward in (False, True):
        model, inputs = make_case(4, 6, 4)
        psh.add_hooks(model, check_unseen=False)
        dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                   max_grad_norm=0.1, dataset_size=16, batch_size=4, accountant=None)
        dp.zero_grad()
        losses = loss_fn(model(*inputs))
        if use_dp_backward:
            dp.backward(losses.mean())
            assert formed_names(model) == FORMED
        else:
            losses.mean().backward()
        dp.privatize()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in results[0]:
        torch.testing.assert_close(results[1][n], results[0][n], rtol=1e-10, atol=1e-12)


def test_a_layer_used_twice_is_formed_neither_time_and_stays_exact():
    torch.manual_seed(0)
    norm = nn.LayerNorm(3).double()
    model = nn.Sequential(norm, nn.Tanh(), norm).double()
    x = torch.randn(4, 10, 3, dtype=torch.double)
    total, _, _ = loop_norms(model, [x], lambda out: out.pow(2).sum((1, 2)), "mean")
    edges = OutputEdges(model, form_on_arrival=True)
    edges.backward(model(x).pow(2).sum((1, 2)).mean())
    assert not formed_names(model)
    torch.testing.assert_close(psh.compute_norms(model), total)


def test_released_records_give_the_same_clipping_and_refuse_a_second_read():
    model, inputs = make_case(4, 7, 5)
    total, _, grads = loop_norms(model, inputs, loss_fn, "sum")
    expected = loop_clipped(grads, total, 0.1, "sum")
    for _ in range(2):  # the next step captures afresh
        formed_backward(model, inputs, "sum")
        norms = psh.clip_grads(model, 0.1, loss_type="sum", release_records=True)
        torch.testing.assert_close(norms, total)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=1e-10, atol=1e-12)
            p.grad = None
        state = get_state(model)
        assert not state.storage.held(step_only=True)
        assert all(c.args == () and not any(c.grads) and c.per_sample is None
                   for calls in state.calls.values() for c in calls)
        with pytest.raises(PerSampleHooksError, match="release_records"):
            psh.compute_norms(model)


def test_sequence_first_layers_are_formed_exactly():
    """batch_dim=1 ([T, B, d] inputs): the formed per-sample gradients take the batch from the
    module's own layout."""
    from ground_truth import loop_grads
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2), nn.Tanh()).double()
    x = torch.randn(12, 4, 3, dtype=torch.double)  # [T, B, d]
    loss_fn = lambda out: out.pow(2).sum((0, 2))  # noqa: E731  per sample: [B]
    psh.add_hooks(model, batch_dim=1, check_unseen=False)
    edges = OutputEdges(model, form_on_arrival=True)
    edges.backward(loss_fn(model(x)).sum())
    assert formed_names(model) == {"0", "1"}
    norms = psh.compute_norms(model, loss_type="sum", per_param=True)
    psh.compute_grad1(model, loss_type="sum")
    got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    psh.remove_hooks(model)
    expected = loop_grads(model, [x], lambda out: loss_fn(out), 4, batch_dim=1)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g)
        torch.testing.assert_close(norms[n], g.flatten(1).norm(dim=1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_leaves_with_raw_parameters_formed_or_kept_stay_exact(dtype):
    """A leaf with raw parameters whose call is re-run by the torch.func fallback is formed on
    arrival (the re-run inside the backward); one whose uses are followed keeps its record
    (its watched sites' gradients arrive after its output's)."""
    from test_raw_parameters import EinsumNorm, HandNorm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), EinsumNorm(6), nn.Tanh(), HandNorm(6),
                          nn.Linear(6, 2)).to(dtype)
    inputs = [torch.randn(4, 5, 3, dtype=dtype)]

    def loss_of(out):
        return loss_fn(out.flatten(1))

    total, _, grads = loop_norms(copy.deepcopy(model).double(), [inputs[0].double()], loss_of,
                                 "mean")
    expected = loop_clipped(grads, total, 0.5, "mean")
    edges = edges_without_check(model)
    edges.backward(loss_of(model(*inputs)).mean())
    assert {"1"} <= formed_names(model) and "3" not in formed_names(model)
    psh.clip_grads(model, 0.5)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else \
        dict(rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[n], **tolerance, msg=n)
    psh.remove_hooks(model)
