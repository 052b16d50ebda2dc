"""The ground truth every rule is tested against: one plain-autograd pass per sample, float64."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

import per_sample_hooks as psh

LossFn = Callable[[object], Tensor]  # model output -> per-sample losses [B]


def seeded(seed: int) -> torch.Generator:
    """A generator on the default device (``PSH_TEST_DEVICE``, see conftest.py), seeded."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def loop_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances against the float64 loop: exact in float64; within float32
    rounding otherwise."""
    return dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)


def sum_of_outputs(output: Tensor) -> Tensor:
    """Per-sample loss: sum of every output entry of the sample (batch first)."""
    return output.reshape(output.shape[0], -1).sum(1)


def weighted_square(output: Tensor) -> Tensor:
    """A loss with non-uniform output gradients, so that a wrong pairing cannot pass."""
    flat = output.reshape(output.shape[0], -1)
    weights = torch.linspace(-1.0, 2.0, flat.shape[1], dtype=flat.dtype)
    return (flat.pow(2) * weights + flat * weights.flip(0)).sum(1)


def take(x: object, i: int, batch_dim: int = 0) -> object:
    if isinstance(x, Tensor):
        return x.narrow(batch_dim, i, 1)
    return x


def loop_grads(model: nn.Module, inputs: Sequence[object], loss_fn: LossFn,
               batch_size: int, batch_dim: int = 0) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: gradient of each sample's own loss, one backward per sample."""
    return loop_grads_of(model, ([take(x, i, batch_dim) for x in inputs]
                                 for i in range(batch_size)), loss_fn)


def loop_grads_of(model: nn.Module, samples: Iterable[Sequence[object]], loss_fn: LossFn
                  ) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}`` over the trainable parameters, one backward per sample;
    ``samples`` gives the inputs of each sample in turn (a parameter it does not use: zeros)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_sample = {n: [] for n in params}
    for sample in samples:
        loss = loss_fn(model(*sample)).sum()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            per_sample[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in per_sample.items()}


def hooked_grads(model: nn.Module, inputs: Sequence[object], loss_fn: LossFn,
                 loss_type: str = "mean", **hook_options) -> dict[str, Tensor]:
    """``{name: p.grad1}`` from one hooked forward and backward of the whole batch; also checks
    that ``grad1`` reduces to ``p.grad``."""
    psh.add_hooks(model, **hook_options)
    try:
        model.zero_grad(set_to_none=True)
        losses = loss_fn(model(*inputs))
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        psh.compute_grad1(model, loss_type=loss_type)
        result = {}
        for n, p in model.named_parameters():
            if not p.requires_grad:
                assert not hasattr(p, "grad1"), f"frozen {n} got grad1"
                continue
            reduced = p.grad1.mean(0) if loss_type == "mean" else p.grad1.sum(0)
            expected = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(reduced, expected, rtol=1e-9, atol=1e-10)
            result[n] = p.grad1.clone()
        return result
    finally:
        psh.remove_hooks(model)


def assert_matches_loop(model: nn.Module, inputs: Sequence[object],
                        loss_fn: LossFn = weighted_square, loss_type: str = "mean",
                        rtol: float = 1e-9, atol: float = 1e-10,
                        batch_dim: int = 0, **hook_options) -> dict[str, Tensor]:
    """Compare ``compute_grad1`` with the float64 per-sample loop on every trainable parameter."""
    model = model.double()
    inputs = [x.double() if isinstance(x, Tensor) and x.is_floating_point() else x for x in inputs]
    batch_size = next(x for x in inputs if isinstance(x, Tensor)).shape[batch_dim]
    got = hooked_grads(model, inputs, loss_fn, loss_type, batch_dim=batch_dim, **hook_options)
    expected = loop_grads(model, inputs, loss_fn, batch_size, batch_dim)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return got


def assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    """Every entry of ``model``'s state dict equals ``reference``'s, bit for bit."""
    for (name, kept), (_, before) in zip(model.state_dict().items(),
                                         reference.state_dict().items()):
        assert torch.equal(kept, before), name
