"""nn.Linear with any leading dims: input ``[B, *, d]``, output ``[B, *, p]``.

With ``A = input.reshape(B, T, d)`` and ``G = grad_output.reshape(B, T, p)``:
per-sample weight gradient ``G_b^T A_b`` (``[B, p, d]``), bias ``G_b.sum(T)``.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from .base import KeptGrads, Rule, contract_samples, hess_from_grad1, register_rule, split_passes
from .ghost import (
    bias_norms_squared,
    concat_positions,
    sum_of_squares,
    weight_norms_squared,
    weighted_bias_sum,
    weighted_weight_sum,
)
from .kronecker import Approx, input_factor, output_factor


def flatten_positions(t: Tensor) -> Tensor:
    """``[B, *, f] -> [B, T, f]`` with ``T`` the product of the middle dims (a view if possible)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def add_outer_products(out: Tensor, grads: Tensor, acts: Tensor, scale: float, accumulate: bool
                       ) -> None:
    """``out[b] (+)= scale * grads[b]^T @ acts[b]`` for ``grads [B,T,p]``, ``acts [B,T,d]``.

    Written straight into ``out`` (``[B, p, d]``); nothing is zero-filled or copied. With one
    position a broadcast product beats ``bmm`` (whose inner dim would be 1) several times over;
    the scale goes on the smaller operand.
    """
    if grads.shape[1] != 1:
        torch.baddbmm(out, grads.transpose(1, 2), acts, beta=1 if accumulate else 0, alpha=scale,
                      out=out)
        return
    column, row = grads.transpose(1, 2), acts  # [B, p, 1], [B, 1, d]
    if accumulate:
        out.addcmul_(column, row, value=scale)
    else:
        write_outer_products(out, column, row, scale)


def write_outer_products(out: Tensor, column: Tensor, row: Tensor, scale: float) -> None:
    """``out = scale * column * row`` for ``column [B, p, 1]``, ``row [B, 1, d]``; the scale
    goes on the smaller operand."""
    if scale != 1:
        if column.shape[1] <= row.shape[2]:
            column = column * scale
        else:
            row = row * scale
    torch.mul(column, row, out=out)


def write_one_position(weight: Tensor | None, bias: Tensor | None, grads: Tensor, acts: Tensor,
                       scale: float) -> None:
    """Per-sample gradients of one call on a ``[B, d]`` input (``grads [B, p]``), written into
    ``weight [B, p, d]`` and ``bias [B, p]`` (either may be None) with the fewest ops."""
    if weight is not None:
        write_outer_products(weight, grads.unsqueeze(2), acts.unsqueeze(1), scale)
    if bias is not None:
        if scale != 1:
            torch.mul(grads, scale, out=bias)
        else:
            bias.copy_(grads)


def add_position_sums(out: Tensor, grads: Tensor, scale: float, accumulate: bool) -> None:
    """``out[b] (+)= scale * grads[b].sum(positions)`` for ``grads [B, T, p]``."""
    if grads.shape[1] == 1:
        summed = grads.squeeze(1)
    elif accumulate:
        summed = grads.sum(1)
    else:
        summed = torch.sum(grads, 1, out=out)
    if accumulate:
        out.add_(summed, alpha=scale)
    elif scale != 1:
        torch.mul(summed, scale, out=out)
    elif summed is not out:
        out.copy_(summed)



@register_rule(nn.Linear)
class LinearRule(Rule):
    def grad1(self, module: nn.Linear, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        weight, bias = out.get("weight"), out.get("bias")
        if len(calls) == 1 and calls[0].backprop().dim() == 2:  # the common case, fewest ops
            write_one_position(weight, bias, calls[0].backprop(), calls[0].activation(), scale)
            return
        for i, call in enumerate(calls):
            grads = flatten_positions(call.backprop())
            if weight is not None:
                acts = flatten_positions(call.activation())
                add_outer_products(weight, grads, acts, scale, i > 0)
            if bias is not None:
                add_position_sums(bias, grads, scale, i > 0)

    def norms_squared(self, module: nn.Linear, calls: Sequence[Call], scale: float,
                      names: Sequence[str], keep: KeptGrads | None = None
                      ) -> dict[str, Tensor]:
        """Exact squared norms of the summed contribution of all calls (see ``ghost``); with
        several positions, the weight's per-sample gradients go into ``keep`` when granted."""
        grads = concat_positions([flatten_positions(c.backprop()).unsqueeze(1) for c in calls])
        result = {}
        if "weight" in names:
            batch, _, positions, _ = grads.shape
            kept = keep.reserve(module, "weight", batch) if keep and positions > 1 else None
            if kept is not None:
                self.grad1(module, calls, 1.0, {"weight": kept})
                squared = sum_of_squares(kept)
            else:
                acts = concat_positions(
                    [flatten_positions(c.activation()).unsqueeze(1) for c in calls])
                squared = weight_norms_squared(acts, grads)
            result["weight"] = squared.mul_(scale * scale)
        if "bias" in names:
            result["bias"] = bias_norms_squared(grads).mul_(scale * scale)
        return result

    def weighted_sum(self, module: nn.Linear, calls: Sequence[Call], weights: Tensor,
                     out: dict[str, Tensor], keep: KeptGrads | None = None) -> None:
        """``sum_b weights[b] grad1_b`` (captured scale): from the kept per-sample gradients,
        else one matmul per call with the weights folded in."""
        weight, bias = out.get("weight"), out.get("bias")
        kept = keep.get(module, "weight") if keep is not None else None
        if weight is not None and kept is not None:
            contract_samples(weight, kept, weights)
            weight = None
        for i, call in enumerate(calls):
            grads = flatten_positions(call.backprop()).unsqueeze(1)
            if weight is not None:
                acts = flatten_positions(call.activation()).unsqueeze(1)
                weighted_weight_sum(weight, acts, grads, weights, accumulate=i > 0)
            if bias is not None:
                weighted_bias_sum(bias, grads, weights, accumulate=i > 0)


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
