"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not): the forward that
the backward recomputes is not a second micro-batch. Reentrant checkpointing runs the forward
without grad and records the recomputed call, whose outputs receive the gradients;
non-reentrant records the forward's call and the recomputed one receives none. Every quantity
against the float64 per-sample loop (taken without checkpointing), float32 and float64, over
steps the unseen-use check compares and steps it does not. Before, every step was refused as
"a forward pass after a backward pass"."""
from __future__ import annotations

import pytest
import torch
from norms_truth import loop_clipped, loop_norms
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import per_sample_hooks as psh
from ground_truth import loop_tolerance, seeded, weighted_square
from per_sample_hooks.dp import OutputEdges


class Checkpointed(nn.Module):
    """A Linear, then a block (Linear, LayerNorm, Tanh, Linear) under checkpointing, then a
    head; ``reentrant=None`` runs the block plainly (the loop's ground truth)."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(3, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        if self.reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


def truth(model: Checkpointed, x: Tensor, loss_type: str) -> tuple[Tensor, dict, dict]:
    """(total norms, per-parameter norms, per-sample gradients) of the loop, in float64,
    without checkpointing (reentrant checkpointing refuses ``autograd.grad``)."""
    reentrant, model.reentrant = model.reentrant, None
    try:
        return loop_norms(model.double(), [x.double()], weighted_square, loss_type)
    finally:
        model.reentrant = reentrant


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_steps_are_exact(reentrant: bool, dtype: torch.dtype, loss_type: str
                                      ) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(dtype)
    x = torch.randn(5, 3, generator=seeded(1)).to(dtype)
    with psh.add_hooks(model):
        for _ in range(4):  # the first steps are compared by the unseen-use check, later ones not
            model.zero_grad(set_to_none=True)
            losses = weighted_square(model(x))
            (losses.mean() if loss_type == "mean" else losses.sum()).backward()
            psh.compute_grad1(model, loss_type=loss_type)
            grad1 = {n: p.grad1.clone() for n, p in model.named_parameters()}
            norms = psh.compute_norms(model, loss_type=loss_type, per_param=True)
            psh.clip_grads(model, 0.1, loss_type=loss_type)
            clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
    total, per_param, grads = truth(model, x, loss_type)
    expected_clipped = loop_clipped(grads, total, 0.1, loss_type)
    assert grad1.keys() == grads.keys()
    close = loop_tolerance(dtype)
    for n in grads:
        torch.testing.assert_close(grad1[n].double(), grads[n], **close)
        torch.testing.assert_close(norms[n].double(), per_param[n], **close)
        torch.testing.assert_close(clipped[n].double(), expected_clipped[n], **close)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_output_edge_backward_through_checkpointing(reentrant: bool, dtype: torch.dtype) -> None:
    """``OutputEdges`` (DPSGD's backward) runs a backward to given tensors, which reentrant
    checkpointing refuses. Once the model showed it (a recomputed call got a gradient, in an
    ordinary backward) it takes an ordinary backward; if its first backward is an edge
    backward, that step is refused with what to do and the next one is exact. Non-reentrant
    checkpointing keeps the edge backward."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(dtype)
    x = torch.randn(5, 3, generator=seeded(1)).to(dtype)
    with psh.add_hooks(model, check_unseen=False) as state:
        edges = OutputEdges(model)
        if reentrant:
            with pytest.raises(psh.PerSampleHooksError, match="reentrant activation "
                               "checkpointing .* this step is lost.*use_reentrant=False"):
                edges.backward(weighted_square(model(x)).mean())
            assert state.reentrant_checkpointing
        for _ in range(2):
            edges.backward(weighted_square(model(x)).mean())
            psh.compute_grad1(model)
            assert all(p.grad is None for p in model.parameters()) != reentrant
            grad1 = {n: p.grad1.clone() for n, p in model.named_parameters()}
    _, _, grads = truth(model, x, "mean")
    for n in grads:
        torch.testing.assert_close(grad1[n].double(), grads[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_output_edge_backward_when_every_trainable_layer_is_checkpointed(dtype: torch.dtype
                                                                       ) -> None:
    """Only the reentrant-checkpointed block trains (peft's prepare_model_for_kbit_training):
    its layers run again in the backward, none was recorded in the forward, and DPSGD's
    backward was refused ('run the forward pass with grad enabled first'). It is an ordinary
    backward now, exact on its first step."""
    torch.manual_seed(0)
    model = Checkpointed(True).to(dtype)
    model.embed.requires_grad_(False)
    model.head.requires_grad_(False)
    x = torch.randn(5, 3, generator=seeded(1)).to(dtype)
    with psh.add_hooks(model):
        edges = OutputEdges(model)  # (an input that needs a gradient: enable_input_require_grads)
        edges.backward(weighted_square(model(x.requires_grad_())).mean())
        psh.compute_grad1(model)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
    _, _, grads = truth(model, x, "mean")
    assert grad1.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(grad1[n].double(), grads[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_curvature_passes_through_checkpointing(dtype: torch.dtype) -> None:
    """``backprop_hess``'s passes leave ``.grad`` alone (``torch.autograd.grad``): through
    non-reentrant checkpointing ``compute_hess`` and ``compute_kfac`` equal those of the same
    model without it; reentrant checkpointing refuses such a backward, and so does
    ``backprop_hess``, saying what to use."""
    x = torch.randn(5, 3, generator=seeded(2)).to(dtype)
    results = {}
    for reentrant in (None, False):
        torch.manual_seed(0)
        model = Checkpointed(reentrant).to(dtype)
        with psh.add_hooks(model):
            psh.backprop_hess(model(x), "LeastSquares")
            psh.compute_hess(model)
            curvature = [p.hess.clone() for p in model.parameters()]
            psh.backprop_hess(model(x), "CrossEntropy")
            kronecker = psh.compute_kfac(model).kronecker
            assert len(kronecker) == 4  # every Linear
            curvature += [t.clone() for pair in kronecker.values() for t in pair]
        results[reentrant] = curvature
    for plain, checkpointed in zip(results[None], results[False], strict=True):
        torch.testing.assert_close(checkpointed, plain, **loop_tolerance(dtype))
    torch.manual_seed(0)
    model = Checkpointed(True).to(dtype)
    with psh.add_hooks(model):
        with pytest.raises(psh.PerSampleHooksError, match="backprop_hess: the model uses "
                           "reentrant activation checkpointing.*use_reentrant=False"):
            psh.backprop_hess(model(x), "LeastSquares")
        # the refused step is over: the next ordinary one is not taken for its second micro-batch
        model(x).square().sum().backward()
        psh.compute_grad1(model, loss_type="sum")
