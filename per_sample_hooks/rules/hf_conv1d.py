"""Hugging Face transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``): a Linear
with the weight transposed, ``weight [nx, nf]`` (in, out), ``bias [nf]``; input ``[B, *, nx]``,
output ``[B, *, nf]``.

With ``A = input.reshape(B, T, nx)`` and ``G = grad_output.reshape(B, T, nf)``: per-sample
weight gradient ``A_b^T G_b`` (``[B, nx, nf]``), bias ``G_b.sum(T)``.

Registered by name, so that importing per_sample_hooks does not import transformers.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..capture import Call
from ..forms import Form, one_group
from .base import WEIGHT_AND_BIAS, Rule, refuse_unbatched, register_rule
from .linear import flatten_positions


@register_rule("transformers.pytorch_utils:Conv1D")
class HFConv1DRule(Rule):
    needs_parameter_values = False  # shapes only: runs on FSDP2 shards
    parameter_names = WEIGHT_AND_BIAS
    kronecker = True
    weight_transposed = True  # KFAC factors of the weight as [nf, nx], a Linear's layout

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        refuse_unbatched(module, calls, name, 1)

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Per call: the weight ``Outer(A, G)`` (roles swapped: ``[nx, nf]``), the bias
        ``Outer(G)``; positions are the leading dims (``[B, T, f]``, one group)."""
        result: dict[str, list[Form]] = {name: [] for name in names}
        for call in calls:
            acts, grads = flatten_positions(call.activation()), flatten_positions(call.backprop())
            for name, parts in result.items():
                parts.append(one_group(acts, grads) if name == "weight" else one_group(grads, None))
        return result
