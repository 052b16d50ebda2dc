"""Every per-sample quantity of a layer whose per-sample gradients were formed when its output
gradient arrived (``OutputEdges(model, form_on_arrival=True)``): the captured input and output
gradient were dropped then, so everything comes from those ``[B, *param.shape]`` tensors
(written as captured, without the loss scale).
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from ..errors import UnsupportedModuleError
from .base import KeptGrads, Rule, contract_samples
from .ghost import sum_of_squares


def flat_samples(per_sample: Tensor) -> Tensor:
    """``[B, *shape] -> [B, n]``."""
    return per_sample.reshape(per_sample.shape[0], -1)


class FormedRule(Rule):
    """The rule of one step of one layer: ``per_sample[name]`` ``[B, *param.shape]`` holds
    the layer's per-sample gradients of one backward pass, as captured."""

    def __init__(self, per_sample: Mapping[str, Tensor]):
        self.per_sample = per_sample

    def batch_size(self, module: nn.Module, call: Call) -> int:
        return next(iter(self.per_sample.values())).shape[0]

    def grad1(self, module: nn.Module, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        for name, target in out.items():
            torch.mul(self.per_sample[name], scale, out=target)

    def norms_squared(self, module: nn.Module, calls: Sequence[Call], scale: float,
                      names: Sequence[str], keep: KeptGrads | None = None
                      ) -> dict[str, Tensor]:
        return {n: sum_of_squares(self.per_sample[n]).mul_(scale * scale) for n in names}

    def weighted_sum(self, module: nn.Module, calls: Sequence[Call], weights: Tensor,
                     out: dict[str, Tensor], keep: KeptGrads | None = None) -> None:
        for name, target in out.items():
            contract_samples(target, self.per_sample[name], weights)


    def sum_squared_grads(self, module: nn.Module, calls: Sequence[Call], scale: float,
                          params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {n: self.per_sample[n].square().sum(0).mul_(scale * scale) for n in params}

    def gram(self, module: nn.Module, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> Tensor:
        total = None
        for name in params:
            flat = flat_samples(self.per_sample[name])
            total = flat @ flat.t() if total is None else total.addmm_(flat, flat.t())
        return total.mul_(scale * scale)

    def hess(self, module: nn.Module, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        result = {}
        for name in params:
            flat = flat_samples(self.per_sample[name])
            result[name] = torch.mm(flat.t(), flat).mul_(scale)
        return result

    def kfac(self, module: nn.Module, calls: Sequence[Call], scale: float, approx: str,
             spare: MutableMapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        raise UnsupportedModuleError(
            f"Kronecker factors are not available for this {type(module).__name__}: its "
            "per-sample gradients were formed when its output gradient arrived "
            "(OutputEdges(model, form_on_arrival=True), as DPSGD does) and its input and "
            "output gradient were dropped. Run an ordinary loss.backward(), or an "
            "OutputEdges without form_on_arrival, before compute_kfac")
