"""Edges of the batch: B = 1, B = 0, batch sizes and input shapes that change between steps,
forwards that must capture nothing, and several forward / backward passes in one step.

Gradient accumulation, the documented behaviour:
- several forwards before one backward (the same samples seen twice): contributions add up;
- several backward passes on one forward (``retain_graph=True``): their gradients add up;
- several forward+backward pairs before one ``compute_*`` (micro-batches): refused with a
  :class:`PerSampleHooksError` naming the module (rows of different micro-batches would be
  added sample by sample). Call ``compute_*`` after each backward and keep (clone) what you
  need; the step that was refused is dropped, the next forward starts a new one.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_grads, weighted_square


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(12, 3)).double()


def hooked_step(model: nn.Module, x: torch.Tensor, loss_type: str = "mean"
                ) -> dict[str, torch.Tensor]:
    """One step of a model that stays hooked; returns clones of ``grad1``."""
    model.zero_grad(set_to_none=True)
    losses = weighted_square(model(x))
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()
    psh.compute_grad1(model, loss_type=loss_type)
    return {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 loop, with the hooks (if any) paused so it leaves no capture behind."""
    hooked = "_per_sample_hooks" in model.__dict__
    if hooked:
        psh.disable_hooks(model)
    try:
        return loop_grads(model, [x], weighted_square, len(x))
    finally:
        if hooked:
            psh.enable_hooks(model)


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("make, shape", [(mlp, (5,)), (cnn, (2, 5, 5))])
def test_batch_of_one(make, shape, loss_type):
    assert_matches_loop(make(), [torch.randn(1, *shape)], loss_type=loss_type)


@pytest.mark.parametrize("make, shape", [(mlp, (5,)), (mlp, (4, 5)), (cnn, (2, 5, 5))])
def test_empty_batch_gives_empty_results(make, shape):
    model = make()
    with psh.add_hooks(model):
        model(torch.randn(0, *shape, dtype=torch.float64)).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        for p in model.parameters():
            assert p.grad1.shape == (0, *p.shape) and p.grad1.dtype == p.dtype
        norms = psh.compute_norms(model, loss_type="sum")
        assert norms.shape == (0,)
        per_param = psh.compute_norms(model, loss_type="sum", per_param=True)
        assert per_param.keys() == dict(model.named_parameters()).keys()
        assert all(v.shape == (0,) for v in per_param.values())
        assert psh.clip_grads(model, 1.0, loss_type="sum").shape == (0,)
        for p in model.parameters():  # the clipped sum over no sample
            assert p.grad.shape == p.shape and not p.grad.any()


@pytest.mark.parametrize("verb", ["compute_gram", "compute_fisher_diag", "compute_grad_variance",
                                  "compute_kfac", "compute_hess"])
@pytest.mark.parametrize("make, shape", [(mlp, (5,)), (cnn, (2, 5, 5))])
def test_empty_batch_is_refused_by_second_moments_and_the_next_step_is_clean(make, shape, verb):
    """Each refuses ``B = 0`` by name (the convolution's and the norms' rules crashed on a
    reshape of 0 elements); the next step is exact."""
    model = make()
    with psh.add_hooks(model):
        model(torch.randn(0, *shape, dtype=torch.float64)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match=rf"{verb}: the step's batch is empty"):
            getattr(psh, verb)(model)
        x = torch.randn(3, *shape, dtype=torch.float64)
        assert_same(hooked_step(model, x), reference(model, x))


def test_smaller_final_batch_then_larger_again():
    model = mlp()
    with psh.add_hooks(model):
        first = model[0].weight
        sizes = [8, 8, 3, 8, 11, 1, 11]
        pointers = []
        for batch in sizes:
            x = torch.randn(batch, 5, dtype=torch.float64)
            got = hooked_step(model, x)
            assert first.grad1.shape == (batch, 6, 5)
            assert_same(got, reference(model, x))
            pointers.append(first.grad1.data_ptr())
        # smaller batches are views of the buffer in place; a larger one reallocates
        assert pointers[0] == pointers[1] == pointers[2] == pointers[3]
        assert pointers[4] == pointers[5] == pointers[6] != pointers[0]


def test_sequence_length_changes_between_steps():
    model = mlp()
    with psh.add_hooks(model):
        for length in [4, 1, 7, 2]:
            x = torch.randn(3, length, 5, dtype=torch.float64)
            assert_same(hooked_step(model, x, "sum"), reference(model, x))


def test_image_size_changes_between_steps():
    model = cnn()
    with psh.add_hooks(model):
        for size in [5, 8, 3, 6]:
            x = torch.randn(4, 2, size, size + 1, dtype=torch.float64)
            assert_same(hooked_step(model, x), reference(model, x))


def captured_calls(model: nn.Module) -> int:
    state = model.__dict__["_per_sample_hooks"]
    return sum(len(calls) for calls in state.calls.values())


def test_no_grad_and_inference_forwards_capture_nothing():
    model = mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    with psh.add_hooks(model):
        with torch.no_grad():
            model(x)
        model.eval()
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(x)
        assert captured_calls(model) == 0
        with pytest.raises(psh.PerSampleHooksError, match="no output gradient"):
            psh.compute_grad1(model)


def test_evaluation_between_steps_does_not_disturb_the_next_step():
    """An eval-mode forward with grad enabled is captured (per-sample gradients in eval mode are
    supported), but calls that receive no gradient are ignored by compute_*."""
    model = mlp()
    with psh.add_hooks(model):
        hooked_step(model, torch.randn(6, 5, dtype=torch.float64))
        model.eval()
        model(torch.randn(9, 5, dtype=torch.float64))  # validation forward, no backward
        with torch.no_grad():
            model(torch.randn(2, 5, dtype=torch.float64))
        model.train()
        x = torch.randn(6, 5, dtype=torch.float64)
        assert_same(hooked_step(model, x), reference(model, x))


def test_several_forwards_before_one_backward_add_up():
    """Two forwards of the same samples (two views), one loss: per-sample contributions add."""
    model = mlp()
    x = torch.randn(5, 5, dtype=torch.float64)

    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x) + 0.5 * self.net(2 * x).flip(1)

    expected = loop_grads(TwoViews(), [x], weighted_square, 5)
    with psh.add_hooks(model):
        out = model(x) + 0.5 * model(2 * x).flip(1)
        weighted_square(out).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        got = {f"net.{n}": p.grad1.clone() for n, p in model.named_parameters()}
    assert_same(got, expected)


def test_several_backward_passes_on_one_forward_add_up():
    model = mlp()
    x = torch.randn(5, 5, dtype=torch.float64)
    second = lambda out: (out.sin() * torch.arange(3.0, dtype=out.dtype)).sum(1)  # noqa: E731
    both = lambda out: weighted_square(out) + second(out)  # noqa: E731
    expected = loop_grads(model, [x], both, 5)
    with psh.add_hooks(model):
        out = model(x)
        weighted_square(out).sum().backward(retain_graph=True)
        second(out).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    assert_same(got, expected)


@pytest.mark.parametrize("second_batch", [4, 6])
def test_micro_batches_without_compute_in_between_are_refused(second_batch):
    model = mlp()
    with psh.add_hooks(model):
        for batch in (4, second_batch):
            weighted_square(model(torch.randn(batch, 5, dtype=torch.float64))).sum().backward()
        for compute in (psh.compute_grad1, psh.compute_norms):
            with pytest.raises(psh.PerSampleHooksError, match=r"'0' ran a forward pass after a "
                               r"backward.*micro-batch"):
                compute(model)
        # the refused step is dropped: the next one is exact
        x = torch.randn(3, 5, dtype=torch.float64)
        assert_same(hooked_step(model, x), reference(model, x))


def test_documented_accumulation_pattern_equals_the_concatenated_batch():
    """compute_grad1 after each micro-batch, clone, concatenate: the per-sample gradients of the
    whole batch (sum loss: exactly; mean loss per micro-batch: grad1 is d l_i / dp either way)."""
    model = mlp()
    x = torch.randn(7, 5, dtype=torch.float64)
    expected = reference(model, x)
    with psh.add_hooks(model):
        parts = [hooked_step(model, chunk) for chunk in x.split([3, 3, 1])]
    got = {n: torch.cat([part[n] for part in parts]) for n in expected}
    assert_same(got, expected)


def test_documented_accumulation_of_norms_and_clipped_sums():
    """DP with micro-batches: compute_norms per micro-batch, concatenated, are the norms of the
    whole batch; clip_grads(loss_type="sum") per micro-batch, summed by the user and divided by
    the whole batch size, is clip_grads of the whole batch (mean)."""
    model = mlp()
    x = torch.randn(7, 5, dtype=torch.float64)
    with psh.add_hooks(model):
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).mean().backward()
        whole_norms = psh.compute_norms(model)
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).mean().backward()
        psh.clip_grads(model, 0.05)
        whole = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms, summed = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for chunk in x.split([3, 3, 1]):
            model.zero_grad(set_to_none=True)
            weighted_square(model(chunk)).sum().backward()
            norms.append(psh.compute_norms(model, loss_type="sum"))
            model.zero_grad(set_to_none=True)
            weighted_square(model(chunk)).sum().backward()
            psh.clip_grads(model, 0.05, loss_type="sum")
            for n, p in model.named_parameters():
                summed[n] += p.grad
    assert bool((whole_norms > 0.05).any())
    torch.testing.assert_close(torch.cat(norms), whole_norms, rtol=1e-9, atol=1e-12)
    assert_same({n: g / len(x) for n, g in summed.items()}, whole)


def test_clear_backprops_between_micro_batches_keeps_only_the_last():
    model = mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    with psh.add_hooks(model):
        weighted_square(model(torch.randn(6, 5, dtype=torch.float64))).sum().backward()
        psh.clear_backprops(model)
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).sum().backward()
        psh.compute_grad1(model, loss_type="sum")
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    assert_same(got, reference(model, x))


class TwiceThenInplaceRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return torch.relu_(self.lin(torch.tanh(self.lin(x))))


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("shape", [(4, 5), (4, 3, 5), (4, 1, 2, 5)])
def test_inplace_op_on_a_linear_output_that_is_a_view(shape, reuse):
    """Linear on [B, *, d] returns a reshaped view of its matmul; an in-place op on it rebases
    the view's history (found by the fuzzer: the gradient was lost, and with reuse the
    per-sample gradients were silently those of one call only)."""
    torch.manual_seed(0)
    model = TwiceThenInplaceRelu() if reuse else nn.Sequential(nn.Linear(5, 4),
                                                               nn.ReLU(inplace=True))
    assert_matches_loop(model, [torch.randn(*shape)], loss_type="sum")
