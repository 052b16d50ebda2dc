"""The rule interface and the open registry of rules.

A rule holds all the per-sample math of one layer family. It receives the module, the list of
its captured :class:`~per_sample_hooks.capture.Call` records (one per call of the module in the
forward pass; contributions of several calls add up) and a ``scale`` (the batch size for a mean
loss, 1 for a sum loss), and knows nothing about hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..capture import Call
from ..unseen import Probe, project, project_samples


class KeptGrads:
    """Per-sample gradients a rule may keep from :meth:`Rule.norms_squared` for
    :meth:`Rule.weighted_sum` within one step (DP clipping), up to ``budget`` elements in all.

    ``buffer_for(module, name, param, batch)`` supplies the storage (persistent buffers, reused
    across steps). A rule that materializes a parameter's per-sample gradients anyway asks
    :meth:`reserve`; when granted, it writes them *as captured* (``scale=1``) and
    ``weighted_sum`` contracts them with the weights instead of recomputing them.
    """

    def __init__(self, budget: int, buffer_for: Callable[[nn.Module, str, Tensor, int], Tensor]):
        self.budget = budget
        self._buffer_for = buffer_for
        self._kept: dict[tuple[int, str], Tensor] = {}

    def reserve(self, module: nn.Module, name: str, batch: int) -> Tensor | None:
        """A ``[batch, *param.shape]`` buffer to fill, or None when over the budget."""
        param = module._parameters[name]
        size = batch * param.numel()
        if size > self.budget:
            return None
        self.budget -= size
        buffer = self._buffer_for(module, name, param, batch)
        self._kept[(id(module), name)] = buffer
        return buffer

    def get(self, module: nn.Module, name: str) -> Tensor | None:
        return self._kept.get((id(module), name))


class Rule:
    """Per-sample math for one layer family.

    Subclasses implement :meth:`grad1`; quantities with a cheaper exact path override the
    defaults that derive them from :meth:`grad1`.
    """

    #: Also hook modules of this family that have no trainable parameter (for checks such as
    #: BatchNorm's batch statistics, which mix samples for every layer below).
    observe_without_parameters: bool = False

    def grad1(self, module: nn.Module, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """Write per-sample gradients into ``out[name]`` (shape ``[B, *param.shape]``).

        ``out`` holds a buffer for each trainable direct parameter the caller wants; its contents
        are undefined on entry and must be fully overwritten. ``scale`` multiplies every result.
        """
        raise NotImplementedError

    def batch_size(self, module: nn.Module, call: Call) -> int:
        """The batch size of one call; override for inputs ``Call.batch_size`` cannot read
        (a ``PackedSequence``, a batch that is not at ``batch_dim`` by the module's own layout)."""
        return call.batch_size

    def norms_squared(self, module: nn.Module, calls: Sequence[Call], scale: float,
                      names: Sequence[str], keep: KeptGrads | None = None
                      ) -> dict[str, Tensor]:
        """``{name: [B]}``: squared L2 norm of each sample's gradient of each parameter in
        ``names``, i.e. of exactly what :meth:`grad1` writes (``scale`` included, so squared).

        Default: materialize one parameter at a time (into ``keep``'s buffer when granted,
        else a temporary that is freed), reduce.
        """
        result = {}
        batch = self.batch_size(module, calls[0])
        for name in names:
            param = module._parameters[name]
            kept = keep.reserve(module, name, batch) if keep is not None else None
            per_sample = param.new_empty((batch, *param.shape)) if kept is None else kept
            self.grad1(module, calls, 1.0, {name: per_sample})
            result[name] = torch.linalg.vector_norm(per_sample.reshape(batch, -1),
                                                    dim=1).square_().mul_(scale * scale)
            del per_sample
        return result

    def weighted_sum(self, module: nn.Module, calls: Sequence[Call], weights: Tensor,
                     out: dict[str, Tensor], keep: KeptGrads | None = None) -> None:
        """Write ``sum_b weights[b] * grad1_b`` into ``out[name]`` (shape ``param.shape``).

        ``grad1_b`` is the per-sample gradient *as captured*, i.e. :meth:`grad1` with
        ``scale=1``: for a mean loss it carries the loss's ``1/B``, so the caller folds any loss
        scale into ``weights`` (clipping a mean loss passes the clipping coefficients as they
        are and gets ``(1/B) sum_b c_b g_b``). ``out`` is fully overwritten.

        Default: contract the gradients kept by :meth:`norms_squared` in ``keep``, or
        materialize one parameter at a time into a temporary, contract, free it.
        """
        for name, target in out.items():
            per_sample = keep.get(module, name) if keep is not None else None
            if per_sample is None:
                param = module._parameters[name]
                per_sample = param.new_empty((len(weights), *param.shape))
                self.grad1(module, calls, 1.0, {name: per_sample})
            contract_samples(target, per_sample, weights)
            del per_sample

    def probe(self, module: nn.Module, calls: Sequence[Call], probes: Mapping[str, Probe],
              scale: float, out: Mapping[str, Tensor] | None = None
              ) -> dict[str, tuple[Tensor, Tensor]]:
        """Random projections of the batch-summed contributions (unscaled, as autograd sums
        them) of ``calls`` to each parameter in ``probes``, with their rounding scales; used to
        detect parameter uses no hook sees (see :mod:`per_sample_hooks.unseen`).

        Default: from the per-sample gradients in ``out`` when given (written by :meth:`grad1`
        with ``scale``; one read of them), else one re-run of the module's forward and backward
        on the whole batch. Rules override it with something cheaper from the captured pairs.
        """
        if out is not None and all(n in out for n in probes):
            result = {}
            for n, probe in probes.items():
                value, rounding = project_samples(out[n], probe)
                result[n] = (value / scale, rounding / scale)
            return result
        return {n: (value, value.abs()) for n, value in rerun_projection(module, calls, probes)
                .items()}

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        """Raise :class:`~per_sample_hooks.errors.PerSampleHooksError` if the captured calls
        cannot give exact per-sample quantities (``name`` is the module's path)."""


def contract_samples(out: Tensor, per_sample: Tensor, weights: Tensor) -> None:
    """``out = sum_b weights[b] * per_sample[b]`` (``per_sample [B, *out.shape]``), one ``mv``."""
    flat = per_sample.reshape(len(weights), -1)
    if out.is_contiguous():
        torch.mv(flat.t(), weights.to(flat.dtype), out=out.view(-1))
    else:
        out.copy_((weights.to(flat.dtype) @ flat).view(out.shape))

def rerun_projection(module: nn.Module, calls: Sequence[Call], probes: Mapping[str, Probe]
                     ) -> dict[str, Tensor]:
    """Projections of the batch-summed parameter gradients of ``calls``, from one re-run of the
    module's forward (inside ``torch.func.vjp``, so that hooks do not record it) per call."""
    params = dict(module.named_parameters())
    weights = {n: params[n].detach() for n in probes}
    totals: dict[str, Tensor] = {}
    for call in calls:
        leaves = [j for j, passes in enumerate(call.grads) if passes]
        grads = [sum(call.grads[j][1:], call.grads[j][0]) for j in leaves]

        def forward(w: dict[str, Tensor], call: Call = call, leaves: list = leaves) -> list:
            output = torch.func.functional_call(module, w, call.args, call.kwargs)
            flat = tree_flatten(output)[0]
            return [flat[j] for j in leaves]

        _, vjp = torch.func.vjp(forward, weights)
        (result,) = vjp(grads)
        for n, g in result.items():
            value = project(g.reshape(probes[n][0].shape[1], -1), probes[n])
            totals[n] = value if n not in totals else totals[n] + value
    return totals


R = TypeVar("R", bound=Rule)


class RuleRegistry:
    """Maps module types to rules. A subclass that keeps its parent's ``forward`` shares the
    parent's rule; one that overrides ``forward`` needs a rule of its own."""

    def __init__(self) -> None:
        self._rules: dict[type, Rule] = {}

    def register(self, module_type: type, rule: Rule) -> None:
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise TypeError(f"register_rule expects an nn.Module subclass, got {module_type!r}")
        if not isinstance(rule, Rule):
            raise TypeError(f"register_rule expects a Rule instance or subclass, got {rule!r}")
        self._rules[module_type] = rule

    def lookup(self, module: nn.Module) -> Rule | None:
        module_type = type(module)
        rule = self._rules.get(module_type)
        if rule is not None:
            return rule
        for base in module_type.__mro__[1:]:
            if base in self._rules and getattr(base, "forward", None) is module_type.forward:
                return self._rules[base]
        return None


default_registry = RuleRegistry()
"""The registry ``add_hooks`` uses; built-in rules register here when the package is imported."""


def register_rule(module_type: type, registry: RuleRegistry = default_registry
                  ) -> Callable[[type[R] | R], type[R] | R]:
    """Class decorator registering a :class:`Rule` for ``module_type``::

        @register_rule(MyLayer)
        class MyLayerRule(Rule):
            def grad1(self, module, calls, scale, out): ...

    Also accepts a rule instance: ``register_rule(MyLayer)(MyLayerRule())``.
    """
    def decorator(rule: type[R] | R) -> type[R] | R:
        registry.register(module_type, rule() if isinstance(rule, type) else rule)
        return rule
    return decorator
