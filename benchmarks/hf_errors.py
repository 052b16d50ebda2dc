"""Errors against the float64 per-sample loop on tiny transformers / peft models (the cases of
``tests/test_transformers.py``): for each model and dtype, the largest ``|ours - loop|`` over
parameters and samples relative to the largest loop value of the model, for ``compute_grad1``,
``compute_norms``, ``clip_grads``, the gradient of a ``DPSGD`` step (its second step, an
output-edge backward; no noise) and the curvature diagonal that ``compute_kfac`` gives the
layers without Kronecker factors (normalization layers, raw parameters: against the loop's
``(1/B) sum_b g_b^2``). README's table of real models comes from it::

    python -m benchmarks.hf_errors [gpt2 bert llama vit clip-vision gpt2-lora]
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

import torch
from torch import Tensor

import per_sample_hooks as psh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
import test_transformers as cases  # noqa: E402
from norms_truth import loop_clipped  # noqa: E402


def relative(got: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Over the model's largest loop value (a key bias, zero in exact arithmetic, would make a
    ratio per parameter meaningless)."""
    scale = max(float(e.abs().max()) for e in expected.values())
    return max(float((g.double() - expected[n]).abs().max()) for n, g in got.items()) / scale


def clipped_reference(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    total = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    return loop_clipped(grads, total, max_norm, "mean")


def errors(name: str, dtype: torch.dtype, max_norm: float = 0.5) -> list[float]:
    model, batch = cases.build(name, dtype)
    twin = copy.deepcopy(model)
    cases.hooked_step(model, batch)
    psh.compute_grad1(model)
    grad1 = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
    norms = psh.compute_norms(model)
    psh.clip_grads(model, max_norm)
    clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    cases.hooked_step(model, batch)
    factors = psh.compute_kfac(model)
    names = {id(p): n for n, p in model.named_parameters()}
    diagonals = {names[id(module.get_parameter(local))]: value
                 for module, entries in factors.diagonal.items()
                 for local, value in entries.items()}
    psh.remove_hooks(model)
    expected = cases.loop_grads(copy.deepcopy(twin), batch)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)

    params = {n: p for n, p in twin.named_parameters() if p.requires_grad}
    dp = psh.DPSGD(twin, torch.optim.SGD(params.values(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=max_norm, dataset_size=10 * cases.B, batch_size=cases.B,
                   accountant=None)
    for _ in range(2):
        before = {n: p.detach().double().clone() for n, p in params.items()}
        dp.zero_grad()
        dp.backward(cases.loss_of(twin, batch))
        dp.step()
    used = {n: p.grad for n, p in params.items()}
    at_step = cases.loop_grads_at(twin, batch, before)
    dp.close()
    psh.remove_hooks(twin)
    # the empirical-Fisher diagonal of a mean loss, (1/B) sum_b g_b^2 (= diag of p.hess)
    fisher = {n: expected[n].square().mean(0) for n in diagonals}
    return [relative(grad1, expected), float(((norms.double() - total).abs() / total).max()),
            relative(clipped, clipped_reference(expected, max_norm)),
            relative(used, clipped_reference(at_step, max_norm)),
            relative(diagonals, fisher) if diagonals else float("nan")]


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"{'model':12} {'dtype':8} {'grad1':>9} {'norms':>9} {'clip':>9} {'DPSGD':>9} "
          f"{'kfac diag':>9}")
    for name in sys.argv[1:] or list(cases.MODELS):
        for dtype in (torch.float64, torch.float32):
            row = " ".join(f"{e:9.1e}" for e in errors(name, dtype))
            print(f"{name:12} {str(dtype)[6:]:8} {row}")


if __name__ == "__main__":
    main()
