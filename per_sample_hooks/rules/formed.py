"""Every per-sample quantity of a layer whose per-sample gradients were formed when its output
gradient arrived (``OutputEdges(model, form_on_arrival=True)``): the captured input and output
gradient were dropped then, so everything comes from those ``[B, *param.shape]`` tensors
(written as captured, without the loss scale).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor, nn

from ..capture import Call
from ..forms import Dense, Form
from .base import Rule


class FormedRule(Rule):
    """The rule of one step of one layer: ``per_sample[name]`` ``[B, *param.shape]`` holds
    the layer's per-sample gradients of one backward pass, as captured."""

    def __init__(self, per_sample: Mapping[str, Tensor]):
        self.per_sample = per_sample

    def batch_size(self, module: nn.Module, call: Call) -> int:
        return next(iter(self.per_sample.values())).shape[0]

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        return {n: [Dense(self.per_sample[n])] for n in names}
