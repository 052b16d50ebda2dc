"""The rule interface and the open registry of rules.

A rule holds all the per-sample math of one layer family. It receives the module, the list of
its captured :class:`~per_sample_hooks.capture.Call` records (one per call of the module in the
forward pass; contributions of several calls add up) and a ``scale`` (the batch size for a mean
loss, 1 for a sum loss), and knows nothing about hooks.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from ..forms import Dense, Form, write

WEIGHT_AND_BIAS = frozenset({"weight", "bias"})
"""The parameters of most layers: :attr:`Rule.parameter_names` of their rules."""


class Rule:
    """Per-sample math for one layer family.

    A rule describes each parameter's per-sample gradient as forms (:meth:`forms`; see
    ``forms``), from which every quantity is computed; or, for a layer with no such
    structure, writes the per-sample gradients (:meth:`grad1`), which are then its dense form.
    Norms, weighted and clipped sums, curvature and the unseen-use check's sums are computed
    from the forms, for every rule alike (``per_sample_hooks.quantities`` and ``forms``); a
    rule with forms may also define :meth:`grad1` where it writes them faster than its forms.
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

    #: The names of the module's own parameters the rule computes; None: any (a rule that
    #: reads them off the module). A module with another parameter of its own (the deprecated
    #: ``weight_norm``'s ``weight_g``) is a unit of the fallback instead
    #: (:mod:`per_sample_hooks.reparametrized`).
    parameter_names: frozenset[str] | None = None

    def own_parameter_names(self, module: nn.Module) -> frozenset[str] | None:
        """:attr:`parameter_names` for ``module`` (a rule whose names depend on the layer's
        configuration, as a recurrent layer's, gives them here)."""
        return self.parameter_names

    #: The weight's forms are ``Outer(output gradients, layer inputs)``, one per call, with any
    #: bias's ``Outer(output gradients)``: Kronecker factors (KFAC) are their second moments
    #: (``forms.kronecker.weight_factors``).
    kronecker: bool = False

    #: With :attr:`kronecker`: the weight is stored ``[in, out]`` (transformers' ``Conv1D``)
    #: and its forms are ``Outer(layer inputs, output gradients)``; its Kronecker factors are
    #: those of the weight transposed, ``[out, in]``, as a Linear's.
    weight_transposed: bool = False

    #: The weight's forms are one-hot ``Rows``: one entry per (sample, position), whose input
    #: picks one row of the weight and whose value is the output gradient there (nn.Embedding):
    #: Kronecker factors with a diagonal input factor (``forms.kronecker.row_factors``).
    one_hot_rows: bool = False

    #: :meth:`forms` re-runs part of the layer (attention, recurrence): a caller that holds
    #: the layer's per-sample gradients already reads those instead.
    forms_rerun: bool = False

    #: The module's outputs are returned as copies, so that the gradient captured for each is
    #: the one from outside the module only: for a module one of whose outputs is computed from
    #: another (``nn.LSTMCell``'s ``h' = o * tanh(c')``, on CPU), whose captured gradient would
    #: otherwise include the path through the first.
    copy_outputs: bool = False

    #: Each call keeps its outputs (:attr:`Call.outputs`), for a rule that re-runs the forward
    #: and compares its outputs with the call's (the fallback: a forward that depends on the
    #: batch or draws random numbers gives other outputs when re-run by sample).
    keeps_outputs: bool = False

    #: The rule reads the parameters' values (not only their shapes): a re-run of the layer
    #: (fallback, attention, recurrence) or a weight product. On an FSDP2 (``fully_shard``)
    #: model, whose parameters are shards outside the forward, the ``compute_*`` calls gather
    #: the full values for such a rule (``sharded.with_full_values``). Their versions are
    #: recorded at each forward, and a change in place before ``compute_*`` (an optimizer's
    #: step) is refused.
    needs_parameter_values: bool = True

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
        written_grad1(self, module, calls, 1.0, out)
        return {n: [Dense(t)] for n, t in out.items()}

    def grad1(self, module: nn.Module, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """Write per-sample gradients into ``out[name]`` (shape ``[B, *param.shape]``).

        ``out`` holds a buffer for each trainable direct parameter the caller wants; its contents
        are undefined on entry and must be fully overwritten. ``scale`` multiplies every result.
        Default: from :meth:`forms`.
        """
        for name, parts in self.forms(module, calls, list(out)).items():
            write(out[name], parts, scale)

    def batch_size(self, module: nn.Module, call: Call) -> int:
        """The batch size of one call; override for inputs ``Call.batch_size`` cannot read
        (a ``PackedSequence``, a batch that is not at ``batch_dim`` by the module's own layout)."""
        return call.batch_size

    def watch(self, module: nn.Module, batch_dim: int, capturing: Callable[[], bool]
              ) -> tuple[Callable[[], tuple[list[Tensor], object]], list[Any]] | None:
        """Tensors to watch inside ``module``'s forward, for a rule that needs more of a call
        than its inputs and output gradients: ``(watcher, hook handles)``, the watcher giving,
        as a call is recorded, the tensors whose gradients are captured too
        (:attr:`Call.watched`) and a note on the call (:attr:`Call.note`), see
        :attr:`HookState.watchers <per_sample_hooks.capture.HookState>`; ``capturing()`` says
        whether the hooks record now. None (the default): nothing watched."""
        return None

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        """Raise :class:`~per_sample_hooks.errors.PerSampleHooksError` if the captured calls
        cannot give exact per-sample quantities (``name`` is the module's path)."""

    def aliases_output_gradient(self, module: nn.Module) -> bool:
        """Whether ``module``'s backward hands its output gradient on as (part of) its
        parameter's gradient, not copied, so that a change in place of that gradient would
        change the captured one: the capture then keeps a copy. ``nn.Embedding(sparse=True)``:
        the sparse gradient's values are a view of the output gradient, and DDP divides them
        in place by the world size (no version counter sees it)."""
        return False


def refuse_unbatched(module: nn.Module, calls: Sequence[Call], name: str, feature_dims: int
                     ) -> None:
    """Refuse a call whose input has no dim besides the ``feature_dims`` trailing dims the layer
    works on (a Linear's ``[in]``, a LayerNorm's ``normalized_shape``) and the ones up to its
    ``batch_dim``: torch runs it as one unbatched sample, whose first dim is no batch."""
    for call in calls:
        x = call.args[0] if call.args else next(iter(call.kwargs.values()), None)
        if isinstance(x, Tensor) and x.dim() <= call.batch_dim + feature_dims:
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) got an input of shape {tuple(x.shape)}, "
                f"without a batch dim (dim {call.batch_dim}) before the last {feature_dims} "
                "dim(s) it works on: torch ran it as one unbatched sample. Per-sample gradients "
                "need the batch: give the input one (x.unsqueeze(0) for a single sample), or "
                "pass add_hooks this module's batch_dim")


def written_grad1(rule: Rule, module: nn.Module, calls: Sequence[Call], scale: float,
                  out: dict[str, Tensor]) -> None:
    """``rule.grad1(module, calls, scale, out)``; for a rule that does not name its parameters
    (a user's), each buffer is checked to have kept its shape: a write with ``out=`` of another
    shape resizes the buffer, and norms and sums of it would be silently wrong."""
    if rule.parameter_names is not None:  # the library's own, tested
        rule.grad1(module, calls, scale, out)
        return
    shapes = {name: buffer.shape for name, buffer in out.items()}
    rule.grad1(module, calls, scale, out)
    for name, buffer in out.items():
        if buffer.shape != shapes[name]:
            raise PerSampleHooksError(
                f"{type(rule).__name__}.grad1 left the buffer of {type(module).__name__}'s "
                f"parameter '{name}' with shape {tuple(buffer.shape)}, not "
                f"{tuple(shapes[name])} ([B, *parameter.shape]): a write with out= of another "
                "shape resizes it. Write per-sample gradients of the parameter's shape")


def describes_forms(rule: Rule) -> bool:
    """Whether ``rule`` gives its forms itself (not by materializing its :meth:`Rule.grad1`)."""
    return type(rule).forms is not Rule.forms


R = TypeVar("R", bound=Rule)


class RuleRegistry:
    """Maps module types to rules. A subclass that keeps its parent's ``forward`` shares the
    parent's rule; one that overrides ``forward`` needs a rule of its own.

    A type may also be named ``"module.path:ClassName"`` (a layer of an optional package:
    registering it imports nothing); it matches a class of that module and qualified name.
    Or recognized by a predicate on the module's class (``matches(type) -> bool``: the
    classes whose ``forward`` is some code, whatever their names), asked last. A type
    registered itself takes precedence over its name, a name over a predicate."""

    def __init__(self) -> None:
        self._rules: dict[type, Rule] = {}
        self._named: dict[str, Rule] = {}
        self._matching: list[tuple[Callable[[type], bool], Rule]] = []

    def register(self, module_type: type | str | Callable[[type], bool], rule: Rule) -> None:
        if not isinstance(rule, Rule):
            raise TypeError(f"register_rule expects a Rule instance or subclass, got {rule!r}")
        if isinstance(module_type, str):
            path, _, name = module_type.partition(":")
            if not (path and name):
                raise TypeError("register_rule expects a type name as 'module.path:ClassName', "
                                f"got {module_type!r}")
            self._named[module_type] = rule
        elif isinstance(module_type, type):
            if not issubclass(module_type, nn.Module):
                raise TypeError(f"register_rule expects an nn.Module subclass, got {module_type!r}")
            self._rules[module_type] = rule
        elif callable(module_type):
            self._matching.append((module_type, rule))
        else:
            raise TypeError("register_rule expects an nn.Module subclass, a 'module.path:Class' "
                            f"name or a predicate on module classes, got {module_type!r}")

    def _rule_of(self, module_type: type) -> Rule | None:
        rule = self._rules.get(module_type)
        if rule is None and self._named:
            rule = self._named.get(f"{module_type.__module__}:{module_type.__qualname__}")
        return rule

    def lookup(self, module: nn.Module) -> Rule | None:
        module_type = type(module)
        rule = self._rule_of(module_type)
        if rule is not None:
            return rule
        for base in module_type.__mro__[1:]:
            rule = self._rule_of(base)
            if rule is not None and getattr(base, "forward", None) is module_type.forward:
                return rule
        for matches, rule in self._matching:
            if matches(module_type):
                return rule
        return None


default_registry = RuleRegistry()
"""The registry ``add_hooks`` uses; built-in rules register here when the package is imported."""


def register_rule(module_type: type | str | Callable[[type], bool],
                  registry: RuleRegistry = default_registry
                  ) -> Callable[[type[R] | R], type[R] | R]:
    """Class decorator registering a :class:`Rule` for ``module_type``::

        @register_rule(MyLayer)
        class MyLayerRule(Rule):
            def grad1(self, module, calls, scale, out): ...

    Also accepts a rule instance: ``register_rule(MyLayer)(MyLayerRule())``, and a type by
    name, ``register_rule("package.module:MyLayer")``, for a layer of a package that should
    not be imported to register it (matched by its class's ``__module__`` and
    ``__qualname__``), or a predicate on module classes, ``register_rule(lambda cls: ...)``,
    for layers recognized by what they run rather than by name (transformers' Llama-style
    RMSNorms: ``rules/hf_rmsnorm.py``).
    """
    def decorator(rule: type[R] | R) -> type[R] | R:
        registry.register(module_type, rule() if isinstance(rule, type) else rule)
        return rule
    return decorator
