"""nn.Linear with any leading dims: input ``[B, *, d]``, output ``[B, *, p]``.

With ``A = input.reshape(B, T, d)`` and ``G = grad_output.reshape(B, T, p)``:
per-sample weight gradient ``G_b^T A_b`` (``[B, p, d]``), bias ``G_b.sum(T)``.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from ..capture import Call
from ..forms import Form, one_group
from ..forms.core import write_one_position
from .base import WEIGHT_AND_BIAS, Rule, refuse_unbatched, register_rule


def flatten_positions(t: Tensor) -> Tensor:
    """``[B, *, f] -> [B, T, f]`` with ``T`` the product of the middle dims (a view if possible)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], t.shape[1:-1].numel(), t.shape[-1])  # -1: ambiguous if empty


@register_rule(nn.Linear)
class LinearRule(Rule):
    needs_parameter_values = False  # shapes only: runs on FSDP2 shards
    parameter_names = WEIGHT_AND_BIAS
    kronecker = True

    def check(self, module: nn.Linear, calls: Sequence[Call], name: str) -> None:
        refuse_unbatched(module, calls, name, 1)

    def grad1(self, module: nn.Linear, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """One call on ``[B, f]``: the products ``forms.write`` makes of :meth:`forms`, made
        directly (the same operations, without building the forms: Python overhead is most of
        a small layer's time); otherwise from the forms."""
        if len(calls) == 1:
            grads = calls[0].backprop()
            acts = calls[0].activation() if "weight" in out else None
            if grads.dim() == 2 and (acts is None or acts.dim() == 2):  # one position
                for name, target in out.items():
                    write_one_position(target, grads, acts if name == "weight" else None, scale)
                return
        super().grad1(module, calls, scale, out)

    def forms(self, module: nn.Linear, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Per call: the weight ``Outer(G, A)``, the bias ``Outer(G)``; positions are the
        leading dims (``[B, T, f]``, one group)."""
        result: dict[str, list[Form]] = {name: [] for name in names}
        for call in calls:
            grads = flatten_positions(call.backprop())
            acts = flatten_positions(call.activation()) if "weight" in result else None
            for name, parts in result.items():
                parts.append(one_group(grads, acts if name == "weight" else None))
        return result
