"""nn.Linear with any leading dims: input ``[B, *, d]``, output ``[B, *, p]``.

With ``A = input.reshape(B, T, d)`` and ``G = grad_output.reshape(B, T, p)``:
per-sample weight gradient ``G_b^T A_b`` (``[B, p, d]``), bias ``G_b.sum(T)``.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from .base import Rule, hess_from_grad1, register_rule, split_passes
from .forms import Form, Outer
from .kronecker import Approx, input_factor, output_factor


def flatten_positions(t: Tensor) -> Tensor:
    """``[B, *, f] -> [B, T, f]`` with ``T`` the product of the middle dims (a view if possible)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


@register_rule(nn.Linear)
class LinearRule(Rule):
    def forms(self, module: nn.Linear, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Per call: the weight ``Outer(G, A)``, the bias ``Outer(G)``; positions are the
        leading dims (``[B, T, f]``, one group)."""
        result: dict[str, list[Form]] = {name: [] for name in names}
        for call in calls:
            grads = flatten_positions(call.backprop()).unsqueeze(1)
            for name, parts in result.items():
                acts = flatten_positions(call.activation()).unsqueeze(1) \
                    if name == "weight" else None
                parts.append(Outer(grads, acts))
        return result

    # ---------------------------------------------------------------- curvature

    def kfac(self, module: nn.Linear, calls: Sequence[Call], scale: float, approx: Approx,
             spare: MutableMapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``A [d(+1), d(+1)]``, ``G [p, p]``; leading dims are positions (see ``kronecker``)."""
        ones = module.bias is not None and module.bias.requires_grad
        acts = [flatten_positions(c.activation()).unsqueeze(1) for c in calls]
        passes = [[flatten_positions(c.backprop()).unsqueeze(1) for c in pass_calls]
                  for pass_calls in split_passes(calls)]
        a = input_factor([acts], acts[0].shape[0], ones, approx, spare)
        return a[0], output_factor(passes, scale, approx, spare)[0]

    def hess(self, module: nn.Linear, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Exact Gauss-Newton blocks (positions summed inside each sample) from grad1."""
        return hess_from_grad1(self, module, calls, scale, params)

    def sum_squared_grads(self, module: nn.Linear, calls: Sequence[Call], scale: float,
                          params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One call on ``[B, d]``: ``(G^2)^T (A^2)`` per pass (nothing materialized); else the
        default (materialize, square, free)."""
        if len(calls) != 1 or calls[0].activation().dim() != 2:
            return super().sum_squared_grads(module, calls, scale, params)
        squared_acts = calls[0].activation().square() if "weight" in params else None
        result: dict[str, Tensor] = {}
        for grads in calls[0].backprops():
            squared = grads.square()
            for name in params:
                term = squared.t() @ squared_acts if name == "weight" else squared.sum(0)
                result[name] = term if name not in result else result[name].add_(term)
        return {name: total.mul_(scale * scale) for name, total in result.items()}

    def gram(self, module: nn.Linear, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> Tensor:
        """``(A A^T) * (G G^T)`` summed over position pairs (ghost Gram) when cheaper than
        materializing; one position: the plain Hadamard product of the two ``[B, B]`` Grams."""
        acts = torch.cat([flatten_positions(c.activation()) for c in calls], dim=1)
        batch, positions, d = acts.shape
        p = module.out_features
        ghost_cost = batch * positions * positions * (d + p)
        if positions > 1 and ((batch * positions) ** 2 > GHOST_GRAM_ELEMENTS
                              or ghost_cost > (positions + batch) * p * d):
            return super().gram(module, calls, scale, params)
        flat_acts = acts.reshape(batch * positions, d)
        act_gram = flat_acts @ flat_acts.t() if "weight" in params else None
        total = None
        for pass_calls in split_passes(calls):
            grads = torch.cat([flatten_positions(c.backprop()) for c in pass_calls], dim=1)
            terms = []
            if act_gram is not None:
                flat = grads.reshape(batch * positions, p)
                pairs = (flat @ flat.t()).mul_(act_gram)
                terms.append(pairs.view(batch, positions, batch, positions).sum((1, 3)))
            if "bias" in params:
                sums = grads.sum(1)
                terms.append(sums @ sums.t())
            for term in terms:
                total = term if total is None else total.add_(term)
        return total.mul_(scale * scale)


GHOST_GRAM_ELEMENTS = 1 << 22
"""Largest ``(B T)^2`` position-pair Gram the ghost Gram forms; beyond it, materialize."""
