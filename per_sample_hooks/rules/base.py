"""The rule interface and the open registry of rules.

A rule holds all the per-sample math of one layer family. It receives the module, the list of
its captured :class:`~per_sample_hooks.capture.Call` records (one per call of the module in the
forward pass; contributions of several calls add up) and a ``scale`` (the batch size for a mean
loss, 1 for a sum loss), and knows nothing about hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TypeVar

from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError, UnsupportedModuleError
from . import forms
from .forms import Dense, Form, contract_samples
from .ghost import sum_of_squares


class KeptGrads:
    """Per-sample gradients a rule may keep from :meth:`Rule.norms_squared` for
    :meth:`Rule.weighted_sum` within one step (DP clipping), up to ``budget`` elements in all.

    ``buffer_for(module, name, param, batch)`` supplies the storage (persistent buffers, reused
    across steps). A rule that materializes a parameter's per-sample gradients anyway asks
    :meth:`reserve`; when granted, it writes them *as captured* (``scale=1``) and
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


class Rule:
    """Per-sample math for one layer family.

    A rule describes each parameter's per-sample gradient as forms (:meth:`forms`; see
    :mod:`.forms`), from which every quantity is computed; or, for a layer with no such
    structure, writes the per-sample gradients (:meth:`grad1`), which are then its dense form.
    A rule may override a quantity it computes better than its forms do.
    """

    #: Also hook modules of this family that have no trainable parameter (for checks such as
    #: BatchNorm's batch statistics, which mix samples for every layer below).
    observe_without_parameters: bool = False

    #: :meth:`grad1` also writes the trainable parameters of the module's children, under
    #: qualified names (``out_proj.weight``): for a forward that uses a child's weights without
    #: calling the child (``nn.MultiheadAttention``). ``add_hooks`` then treats the module as a
    #: unit, as it does fallback units: its descendants are not hooked, its parameters are
    #: ``unit_parameters(module)`` and its outputs are isolated copies.
    covers_children: bool = False

    #: :meth:`forms` re-runs part of the layer (attention, recurrence): a caller that holds
    #: the layer's per-sample gradients already reads those instead.
    forms_rerun: bool = False

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """``{name: forms}`` for each parameter in ``names``: its per-sample gradient, as
        captured (no loss scale), is the sum of the forms (one or more per call).

        Default, for a rule that defines :meth:`grad1` only: its per-sample gradients, dense."""
        if type(self).grad1 is Rule.grad1:
            raise NotImplementedError(f"{type(self).__name__} defines neither forms nor grad1")
        batch = self.batch_size(module, calls[0])
        out = {n: module.get_parameter(n).new_empty((batch, *module.get_parameter(n).shape))
               for n in names}
        self.grad1(module, calls, 1.0, out)
        return {n: [Dense(t)] for n, t in out.items()}

    def grad1(self, module: nn.Module, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """Write per-sample gradients into ``out[name]`` (shape ``[B, *param.shape]``).

        ``out`` holds a buffer for each trainable direct parameter the caller wants; its contents
        are undefined on entry and must be fully overwritten. ``scale`` multiplies every result.
        Default: from :meth:`forms`.
        """
        for name, parts in self.forms(module, calls, list(out)).items():
            forms.write(out[name], parts, scale)

    def batch_size(self, module: nn.Module, call: Call) -> int:
        """The batch size of one call; override for inputs ``Call.batch_size`` cannot read
        (a ``PackedSequence``, a batch that is not at ``batch_dim`` by the module's own layout)."""
        return call.batch_size

    def norms_squared(self, module: nn.Module, calls: Sequence[Call], scale: float,
                      names: Sequence[str], keep: KeptGrads | None = None
                      ) -> dict[str, Tensor]:
        """``{name: [B]}``: squared L2 norm of each sample's gradient of each parameter in
        ``names``, i.e. of exactly what :meth:`grad1` writes (``scale`` included, so squared).

        From the forms (:func:`.forms.norms_squared`); where that materializes per-sample
        gradients anyway, or building the forms again would re-run the layer
        (:attr:`forms_rerun`), into ``keep``'s buffer when granted (for :meth:`weighted_sum`)."""
        result = {}
        batch = self.batch_size(module, calls[0])
        if type(self).forms is Rule.forms:  # only grad1: materialize, into keep when granted
            for name in names:
                param = module.get_parameter(name)
                kept = keep.reserve(module, name, batch) if keep is not None else None
                per_sample = param.new_empty((batch, *param.shape)) if kept is None else kept
                self.grad1(module, calls, 1.0, {name: per_sample})
                result[name] = sum_of_squares(per_sample).mul_(scale * scale)
            return result
        for name, parts in self.forms(module, calls, names).items():
            kept = keep.reserve(module, name, batch) if keep is not None and (
                self.forms_rerun or forms.materializes(parts)) else None
            if kept is not None:
                if type(self).grad1 is Rule.grad1:
                    forms.write(kept, parts, 1.0)
                else:  # the rule writes them better than its forms do
                    self.grad1(module, calls, 1.0, {name: kept})
                squared = sum_of_squares(kept)
            else:
                squared = forms.norms_squared(parts, batch)
            result[name] = squared.mul_(scale * scale)
        return result

    def weighted_sum(self, module: nn.Module, calls: Sequence[Call], weights: Tensor,
                     out: dict[str, Tensor], keep: KeptGrads | None = None) -> None:
        """Write ``sum_b weights[b] * grad1_b`` into ``out[name]`` (shape ``param.shape``).

        ``grad1_b`` is the per-sample gradient *as captured*, i.e. :meth:`grad1` with
        ``scale=1``: for a mean loss it carries the loss's ``1/B``, so the caller folds any loss
        scale into ``weights`` (clipping a mean loss passes the clipping coefficients as they
        are and gets ``(1/B) sum_b c_b g_b``). ``out`` is fully overwritten.

        A contraction of the gradients kept by :meth:`norms_squared` in ``keep``, else one
        product per form (:func:`.forms.weighted_sum`).
        """
        rest = []
        for name, target in out.items():
            kept = keep.get(module, name) if keep is not None else None
            if kept is None:
                rest.append(name)
            else:
                contract_samples(target, kept, weights)
        if rest:
            for name, parts in self.forms(module, calls, rest).items():
                forms.weighted_sum(out[name], parts, weights)

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        """Raise :class:`~per_sample_hooks.errors.PerSampleHooksError` if the captured calls
        cannot give exact per-sample quantities (``name`` is the module's path)."""

    # ---------------------------------------------------------------- curvature
    # ``calls`` may hold several backward passes (``Call.backprops``): one per row of the loss
    # Hessian's square root after ``backprop_hess``, one after an ordinary backward. Curvature
    # sums over passes; ``scale`` is the batch size (mean loss) or 1 (sum loss), so that
    # ``scale * captured`` is the per-sample quantity in the units of ``grad1``.

    def kfac(self, module: nn.Module, calls: Sequence[Call], scale: float, approx: str,
             spare: MutableMapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Kronecker factors ``(A, G)`` of the layer (see :mod:`per_sample_hooks.curvature`
        for the layout and scaling contract). ``spare``: the caller's storage for this module,
        kept across steps, from which factors nobody holds any more are reused. No default: a
        layer needs a matrix view of its weight for Kronecker factors to make sense."""
        raise UnsupportedModuleError(
            f"Kronecker factors (kfac) are not available for {type(module).__name__}: its rule "
            f"{type(self).__name__} defines no kfac method (built in: Linear, Conv1d/2d/3d)")

    def hess(self, module: nn.Module, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: [n, n]}`` (``n = param.numel()``): the Gauss-Newton block of the reduced
        loss for each parameter, from the captured passes. No default; rules whose
        :meth:`grad1` is exact per pass opt in with ``return hess_from_grad1(self, ...)``."""
        raise UnsupportedModuleError(
            f"Hessian blocks (hess) are not available for {type(module).__name__}: its rule "
            f"{type(self).__name__} defines no hess method (built in: Linear, Conv1d/2d/3d)")

    def sum_squared_grads(self, module: nn.Module, calls: Sequence[Call], scale: float,
                          params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``{name: param.shape}``: ``sum_i sum_passes grad1_i^2`` (per-sample gradients of
        each pass, ``scale`` included). Default: materialize one parameter at a time, free."""
        result = {}
        for name, _, pass_grads in _materialized_passes(self, module, calls, params):
            total = None
            for per_sample in pass_grads:
                squared = per_sample.square().sum(0)
                total = squared if total is None else total.add_(squared)
            result[name] = total.mul_(scale * scale)
        return result

    def gram(self, module: nn.Module, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> Tensor:
        """``[B, B]``: ``sum_params sum_passes <grad1_i, grad1_j>`` (``scale`` included).
        Default: materialize one parameter at a time, one matmul, free."""
        total = None
        for _, batch, pass_grads in _materialized_passes(self, module, calls, params):
            for per_sample in pass_grads:
                flat = per_sample.reshape(batch, -1)
                total = flat @ flat.t() if total is None else total.addmm_(flat, flat.t())
        return total.mul_(scale * scale)


def describes_forms(rule: Rule) -> bool:
    """Whether ``rule`` gives its forms itself (not by materializing its :meth:`Rule.grad1`)."""
    return type(rule).forms is not Rule.forms


def single_pass(call: Call, index: int) -> Call:
    """A view of ``call`` holding only backward pass ``index`` (nothing copied)."""
    view = Call.__new__(Call)
    view.args, view.kwargs, view.batch_dim = call.args, call.kwargs, call.batch_dim
    view.training, view.versions, view.per_sample = call.training, call.versions, None
    view.grads = [[passes[index]] if index < len(passes) else [] for passes in call.grads]
    return view


def split_passes(calls: Sequence[Call]) -> list[list[Call]]:
    """``calls`` (several backward passes each) as one list of single-pass views per pass.

    Pass ``k`` of every call belongs to the same backward pass, so all calls must have seen
    the same number of passes."""
    counts = {c.n_passes for c in calls}
    if len(counts) > 1:
        raise PerSampleHooksError(
            f"the calls of one module saw different numbers of backward passes {sorted(counts)}"
            ": some pass did not reach every call, so passes cannot be paired. Run "
            "backprop_hess (or one backward) on a fresh forward")
    n = counts.pop() if counts else 0
    if n <= 1:  # one pass (or per-sample gradients formed on arrival, their records dropped)
        return [list(calls)] if calls else []
    return [[single_pass(c, k) for c in calls] for k in range(n)]


def _materialized_passes(rule: Rule, module: nn.Module, calls: Sequence[Call],
                         params: Mapping[str, Tensor]
                         ) -> Iterator[tuple[str, int, Iterator[Tensor]]]:
    """For each parameter: ``(name, B, per-pass per-sample gradients [B, *param.shape])``,
    captured scale, one reused temporary per parameter."""
    batch = rule.batch_size(module, calls[0])
    passes = split_passes(calls)
    for name, param in params.items():
        buffer = param.new_empty((batch, *param.shape))

        def each_pass(name: str = name, buffer: Tensor = buffer) -> Iterator[Tensor]:
            for pass_calls in passes:
                rule.grad1(module, pass_calls, 1.0, {name: buffer})
                yield buffer
        yield name, batch, each_pass()


def hess_from_grad1(rule: Rule, module: nn.Module, calls: Sequence[Call], scale: float,
                    params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Exact Gauss-Newton blocks from per-pass per-sample gradients ``J_i`` (``[B, n]`` each):
    ``scale * sum_passes J^T J`` (captured scale, so ``(1/B) sum_i x_i x_i^T`` for a mean
    loss, ``x_i`` sample i's gradient of the pass). Exact for any rule whose :meth:`grad1` is
    exact; costs ``B n^2`` per pass."""
    result = {}
    for name, batch, pass_grads in _materialized_passes(rule, module, calls, params):
        n = params[name].numel()
        block = params[name].new_zeros((n, n))
        for per_sample in pass_grads:
            flat = per_sample.reshape(batch, n)
            block.addmm_(flat.t(), flat, alpha=scale)
        result[name] = block
    return result


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
