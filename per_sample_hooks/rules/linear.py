"""nn.Linear with any leading dims: input ``[B, *, d]``, output ``[B, *, p]``.

With ``A = input.reshape(B, T, d)`` and ``G = grad_output.reshape(B, T, p)``:
per-sample weight gradient ``G_b^T A_b`` (``[B, p, d]``), bias ``G_b.sum(T)``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from ..unseen import Probe
from .base import Rule, register_rule


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
        return
    if scale != 1:
        if column.shape[1] <= row.shape[2]:
            column = column * scale
        else:
            row = row * scale
    torch.mul(column, row, out=out)


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
        for i, call in enumerate(calls):
            grads = flatten_positions(call.backprop())
            if weight is not None:
                acts = flatten_positions(call.activation())
                add_outer_products(weight, grads, acts, scale, i > 0)
            if bias is not None:
                add_position_sums(bias, grads, scale, i > 0)

    def probe(self, module: nn.Linear, calls: Sequence[Call], probes: Mapping[str, Probe],
              scale: float, out: Mapping[str, Tensor] | None = None
              ) -> dict[str, tuple[Tensor, Tensor]]:
        """``u^T (sum_b G_b^T A_b) v = sum_{b,t} (G u)(A v)``: ``O(B T (p + d))``."""
        result: dict[str, tuple[Tensor, Tensor]] = {}
        for call in calls:
            grads = call.backprop()
            grads = grads.reshape(-1, grads.shape[-1])  # [B*T, p]
            for name, (u, v) in probes.items():
                if name == "weight":
                    acts = call.activation()
                    terms = (u @ grads.t()) * (v @ acts.reshape(-1, acts.shape[-1]).t())
                else:  # bias [p] seen as [p, 1]
                    terms = (u @ grads.t()) * v
                value, rounding = terms.sum(-1), terms.abs().sum(-1)
                if name in result:
                    value, rounding = value + result[name][0], rounding + result[name][1]
                result[name] = (value, rounding)
        return result
