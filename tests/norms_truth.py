"""Ground truth for norms and clipping: the float64 per-sample loop of ``ground_truth``."""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

import per_sample_hooks as psh
from ground_truth import LossFn, loop_grads, weighted_square
from per_sample_hooks.clipping import thresholds
from per_sample_hooks.forms.groups import row_groups


def as_double(model: nn.Module, inputs: Sequence[object]) -> tuple[nn.Module, list[object]]:
    return model.double(), [x.double() if isinstance(x, Tensor) and x.is_floating_point() else x
                            for x in inputs]


def loop_norms(model: nn.Module, inputs: Sequence[object], loss_fn: LossFn, loss_type: str
               ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """(total norms [B], per-parameter norms, per-sample grads) from the per-sample loop.

    ``loss_type`` does not change per-sample gradients (``d l_i / d p``) and is unused; it is in
    the signature so that call sites read alike."""
    del loss_type
    batch = next(x for x in inputs if isinstance(x, Tensor)).shape[0]
    grads = loop_grads(model, inputs, loss_fn, batch)
    per_param = {n: g.flatten(1).norm(dim=1) for n, g in grads.items()}
    total = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    return total, per_param, grads


def loop_clipped(grads: dict[str, Tensor], total: Tensor, max_norm: float, loss_type: str
                 ) -> dict[str, Tensor]:
    coefficients = (max_norm / (total + 1e-6)).clamp(max=1)
    clipped = {n: torch.einsum("b,b...->...", coefficients, g) for n, g in grads.items()}
    if loss_type == "mean":
        clipped = {n: g / len(total) for n, g in clipped.items()}
    return clipped


def hooked_backward(model: nn.Module, inputs: Sequence[object], loss_fn: LossFn = weighted_square,
                    loss_type: str = "mean", **hook_options) -> None:
    """Hook ``model`` (left hooked) and run one forward and backward of the whole batch."""
    psh.add_hooks(model, **hook_options)
    model.zero_grad(set_to_none=True)
    losses = loss_fn(model(*inputs))
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()


def assert_norms_match(model: nn.Module, inputs: Sequence[object],
                       loss_fn: LossFn = weighted_square, loss_type: str = "mean",
                       rtol: float = 1e-9, atol: float = 1e-10) -> Tensor:
    """compute_norms (total and per parameter) against the loop, and against compute_grad1."""
    model, inputs = as_double(model, inputs)
    try:
        hooked_backward(model, inputs, loss_fn, loss_type)
        total = psh.compute_norms(model, loss_type=loss_type)
        per_param = psh.compute_norms(model, loss_type=loss_type, per_param=True)
        psh.compute_grad1(model, loss_type=loss_type)
        from_grad1 = {n: p.grad1.flatten(1).norm(dim=1) for n, p in model.named_parameters()
                      if p.requires_grad}
    finally:
        psh.remove_hooks(model)
    expected_total, expected_per_param, _ = loop_norms(model, inputs, loss_fn, loss_type)
    torch.testing.assert_close(total, expected_total, rtol=rtol, atol=atol)
    assert per_param.keys() == expected_per_param.keys()
    for n in per_param:
        torch.testing.assert_close(per_param[n], expected_per_param[n], rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(per_param[n], from_grad1[n], rtol=rtol, atol=atol)
    return total


def assert_clipping_matches(model: nn.Module, inputs: Sequence[object], max_grad_norm: float,
                            loss_fn: LossFn = weighted_square, loss_type: str = "mean",
                            rtol: float = 1e-9, atol: float = 1e-10) -> Tensor:
    """clip_grads' p.grad against the loop's clipped mean / sum; returns the norms."""
    model, inputs = as_double(model, inputs)
    try:
        hooked_backward(model, inputs, loss_fn, loss_type)
        norms = psh.clip_grads(model, max_grad_norm, loss_type=loss_type)
        got = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
               for n, p in model.named_parameters() if p.requires_grad}
        frozen_grads = [p.grad for p in model.parameters() if not p.requires_grad]
    finally:
        psh.remove_hooks(model)
    assert all(g is None for g in frozen_grads), "a frozen parameter got a gradient"
    total, _, grads = loop_norms(model, inputs, loss_fn, loss_type)
    torch.testing.assert_close(norms, total, rtol=rtol, atol=atol)
    expected = loop_clipped(grads, total, max_grad_norm, loss_type)
    assert got.keys() == expected.keys()
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return norms


def assert_float32_matches(model: nn.Module, inputs: Sequence[object], max_norm: float,
                           loss_fn: LossFn = weighted_square, loss_type: str = "mean",
                           rtol: float = 1e-4, atol: float = 1e-5, **hook_options) -> None:
    """A float32 ``model``'s grad1, per-parameter norms and clip_grads' p.grad within float32
    rounding of the float64 loop (run on a float64 copy; ``model`` stays float32), hooked with
    ``hook_options``."""
    reference, reference_inputs = as_double(copy.deepcopy(model), inputs)
    total, per_param, grads = loop_norms(reference, reference_inputs, loss_fn, loss_type)
    clipped = loop_clipped(grads, total, max_norm, loss_type)
    tolerance = dict(rtol=rtol, atol=atol)
    try:
        hooked_backward(model, inputs, loss_fn, loss_type, **hook_options)
        norms = psh.compute_norms(model, loss_type=loss_type, per_param=True)
        psh.compute_grad1(model, loss_type=loss_type)
        for n, p in model.named_parameters():
            assert p.grad1.dtype == torch.float32
            torch.testing.assert_close(p.grad1.double(), grads[n], **tolerance)
            torch.testing.assert_close(norms[n].double(), per_param[n], **tolerance)
        psh.remove_hooks(model)
        hooked_backward(model, inputs, loss_fn, loss_type, **hook_options)
        clip_norms = psh.clip_grads(model, max_norm, loss_type=loss_type)
        torch.testing.assert_close(clip_norms.double(), total, **tolerance)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.double(), clipped[n], **tolerance)
    finally:
        psh.remove_hooks(model)


def loop_grouped_clipping(grads: dict[str, Tensor], group_of: dict[str, int],
                          limits: Sequence[float], rows: Tensor | None, loss_type: str
                          ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """(total norms [G], per-parameter norms, clipped mean / sum) of groups of rows: each
    group's gradient the mean of its rows' (``rows`` group ids; None: every row its own),
    parameter group ``group_of[name]`` clipped to ``limits[group_of[name]]``."""
    batch = next(iter(grads.values())).shape[0]
    ids = torch.arange(batch) if rows is None else rows
    _, inverse, sizes = torch.unique(ids, return_inverse=True, return_counts=True)
    grouped = {}
    for n, g in grads.items():
        summed = g.new_zeros(len(sizes), *g.shape[1:]).index_add_(0, inverse.to(g.device), g)
        grouped[n] = summed / sizes.to(g).view(-1, *[1] * (g.dim() - 1))
    flat = {n: g.flatten(1) for n, g in grouped.items()}
    total = torch.cat(list(flat.values()), 1).norm(dim=1)
    coefficients = []
    for k, limit in enumerate(limits):
        norm = torch.cat([flat[n] for n in flat if group_of[n] == k], 1).norm(dim=1)
        coefficients.append((limit / (norm + 1e-6)).clamp(max=1))
    clipped = {n: torch.einsum("b,b...->...", coefficients[group_of[n]], g)
               for n, g in grouped.items()}
    if loss_type == "mean":
        clipped = {n: g / len(sizes) for n, g in clipped.items()}
    return total, {n: f.norm(dim=1) for n, f in flat.items()}, clipped


def assert_grouped_clipping_matches(model: nn.Module, inputs: Sequence[object],
                                    max_grad_norm: object, groups: Tensor | int | None,
                                    loss_fn: LossFn = weighted_square, loss_type: str = "mean",
                                    dtype: torch.dtype = torch.float64, **hook_options) -> Tensor:
    """clip_grads(max_grad_norm, groups=) and compute_norms(groups=) of a ``dtype`` copy of
    ``model`` against the float64 loop over rows, reduced to groups (float32: within its
    rounding). ``max_grad_norm`` may be a function of the model (the copy) giving it.
    Returns the norms."""
    reference, reference_inputs = as_double(copy.deepcopy(model), inputs)
    model = copy.deepcopy(model).to(dtype)
    inputs = [x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x
              for x in inputs]
    if callable(max_grad_norm):
        max_grad_norm = max_grad_norm(model)
    limits = thresholds(model, max_grad_norm, "test")
    group_of = {n: limits.group(p) for n, p in model.named_parameters() if p.requires_grad}
    batch = next(x for x in inputs if isinstance(x, Tensor)).shape[0]
    rows = None if groups is None else row_groups(groups, batch, "test").ids
    grads = loop_grads(reference, reference_inputs, loss_fn, batch)
    total, per_param, clipped = loop_grouped_clipping(grads, group_of, limits.values, rows,
                                                      loss_type)
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else \
        dict(rtol=1e-4, atol=1e-5)
    try:
        hooked_backward(model, inputs, loss_fn, loss_type, **hook_options)
        got_per_param = psh.compute_norms(model, loss_type, per_param=True, groups=groups)
        norms = psh.clip_grads(model, limits, loss_type, groups=groups)
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    finally:
        psh.remove_hooks(model)
    torch.testing.assert_close(norms.double(), total, **tolerance)
    assert got_per_param.keys() == per_param.keys() == got.keys()
    for n in got:
        torch.testing.assert_close(got_per_param[n].double(), per_param[n], **tolerance,
                                   msg=lambda m, n=n: f"norm of {n}: {m}")
        torch.testing.assert_close(got[n].double(), clipped[n], **tolerance,
                                   msg=lambda m, n=n: f"clipped {n}: {m}")
    return norms


class RecordingAccountant:
    """An accountant for DPSGD tests: records each step's ``(noise_multiplier, sample_rate)``;
    its "epsilon" is the number of steps."""

    def __init__(self):
        self.history = []

    def step(self, *, noise_multiplier, sample_rate):
        self.history.append((noise_multiplier, sample_rate))

    def get_epsilon(self, delta):
        return float(len(self.history))
