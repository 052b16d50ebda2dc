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
