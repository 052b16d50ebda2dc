"""A layer's per-sample norms and weighted sums, from its rule's forms, written once for every
rule: what ``compute_norms``, ``clip_grads``, the curvature calls and the unseen-use check ask
of a layer besides its per-sample gradients.

A rule only describes its layer (``Rule.forms``, or ``Rule.grad1`` for a rule without forms,
whose per-sample gradients are then its dense form); the math of each quantity is in
:mod:`per_sample_hooks.forms`. What is here decides, per parameter, between the forms and the
per-sample gradients a step keeps for a second use (:class:`KeptGrads`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn

from . import forms
from .capture import Call
from .forms import contract_samples, sum_of_squares
from .rules.base import Rule, describes_forms, written_grad1


class KeptGrads:
    """Per-sample gradients kept from :func:`norms_squared` for :func:`weighted_sum` within one
    step (DP clipping), up to ``budget`` elements in all.

    ``buffer_for(module, name, param, batch)`` supplies the storage (persistent buffers, reused
    across steps). Where a parameter's per-sample gradients are materialized anyway,
    :meth:`reserve` is asked; when granted, they are written *as captured* (``scale=1``) and
    ``weighted_sum`` contracts them with the weights instead of recomputing them.
    """

    def __init__(self, budget: int, buffer_for: Callable[[nn.Module, str, Tensor, int], Tensor],
                 per_module: dict[int, int] | None = None):
        self.budget = budget
        self._buffer_for = buffer_for
        self._kept: dict[tuple[int, str], Tensor] = {}
        self.per_module = per_module  # a budget per id(module) instead of ``budget``

    def reserve(self, module: nn.Module, name: str, batch: int) -> Tensor | None:
        """A ``[batch, *param.shape]`` buffer to fill, or None when over the budget."""
        param = module.get_parameter(name)
        size = batch * param.numel()
        left = self.budget if self.per_module is None else self.per_module.get(id(module), 0)
        if size > left:
            return None
        if self.per_module is None:
            self.budget -= size
        else:
            self.per_module[id(module)] = left - size
        buffer = self._buffer_for(module, name, param, batch)
        self._kept[(id(module), name)] = buffer
        return buffer

    def get(self, module: nn.Module, name: str) -> Tensor | None:
        return self._kept.get((id(module), name))

    @classmethod
    def holding(cls, tensors: Mapping[tuple[int, str], Tensor]) -> KeptGrads:
        """Per-sample gradients already written, keyed by ``(id(module), name)``; no budget."""
        kept = cls(0, lambda *args: None)
        kept._kept.update(tensors)
        return kept


def norms_squared(rule: Rule, module: nn.Module, calls: Sequence[Call], scale: float,
                  names: Sequence[str], keep: KeptGrads | None = None) -> dict[str, Tensor]:
    """``{name: [B]}``: squared L2 norm of each sample's gradient of each parameter in
    ``names``, i.e. of exactly what ``rule.grad1`` writes (``scale`` included, so squared).

    From the forms (``forms.norms_squared``); where that materializes per-sample gradients
    anyway, or building the forms again would re-run the layer (``Rule.forms_rerun``), into
    ``keep``'s buffer when granted (for :func:`weighted_sum`), written by ``rule.grad1`` when
    the rule has one of its own and its forms do not re-run the layer."""
    result = {}
    batch = rule.batch_size(module, calls[0])
    own_grad1 = type(rule).grad1 is not Rule.grad1
    if not describes_forms(rule):  # grad1 only: materialize, into keep when granted
        per_sample = {}
        for name in names:
            param = module.get_parameter(name)
            kept = keep.reserve(module, name, batch) if keep is not None else None
            per_sample[name] = param.new_empty((batch, *param.shape)) if kept is None else kept
        # one run of the rule for all of them, as Rule.forms builds its dense forms
        written_grad1(rule, module, calls, 1.0, per_sample)
        return {name: sum_of_squares(t).mul_(scale * scale) for name, t in per_sample.items()}
    for name, parts in rule.forms(module, calls, names).items():
        kept = keep.reserve(module, name, batch) if keep is not None and (
            rule.forms_rerun or forms.materializes(parts)) else None
        if kept is not None:
            if own_grad1 and not rule.forms_rerun:  # it writes them better than its forms
                written_grad1(rule, module, calls, 1.0, {name: kept})
            else:  # (not a second re-run of the layer)
                forms.write(kept, parts, 1.0)
            squared = sum_of_squares(kept)
        else:
            squared = forms.norms_squared(parts, batch)
        result[name] = squared.mul_(scale * scale)
    return result


def weighted_sum(rule: Rule, module: nn.Module, calls: Sequence[Call], weights: Tensor,
                 out: dict[str, Tensor], keep: KeptGrads | None = None) -> None:
    """Write ``sum_b weights[b] * grad1_b`` into ``out[name]`` (shape ``param.shape``).

    ``grad1_b`` is the per-sample gradient *as captured*, i.e. ``rule.grad1`` with
    ``scale=1``: for a mean loss it carries the loss's ``1/B``, so the caller folds any loss
    scale into ``weights`` (clipping a mean loss passes the clipping coefficients as they are
    and gets ``(1/B) sum_b c_b g_b``). ``out`` is fully overwritten.

    A contraction of the gradients :func:`norms_squared` kept in ``keep``, else one product
    per form (``forms.weighted_sum``).
    """
    rest = []
    for name, target in out.items():
        kept = keep.get(module, name) if keep is not None else None
        if kept is None:
            rest.append(name)
        else:
            contract_samples(target, kept, weights)
    if rest:
        for name, parts in rule.forms(module, calls, rest).items():
            forms.weighted_sum(out[name], parts, weights)


__all__ = ["KeptGrads", "norms_squared", "weighted_sum"]
