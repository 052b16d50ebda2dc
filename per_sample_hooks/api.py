"""Public API: the autograd-hacks verbs, with exact semantics.

``loss = mean_i l_i`` (``loss_type="mean"``) or ``sum_i l_i`` (``"sum"``);
``p.grad1[i] = d l_i / d p`` with shape ``[B, *p.shape]``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

from torch import Tensor, nn

from .capture import (
    STATE_ATTRIBUTE,
    HookState,
    ModelCallHook,
    get_state,
    live_states,
    unwrap,
)
from .errors import PerSampleHooksError, UnsupportedModuleError
from .quantities import KeptGrads
from .reparametrized import reparametrization
from .rules import RuleRegistry, default_registry
from .rules.base import written_grad1
from .rules.fallback import FallbackRule
from .rules.raw_parameters import RawParameterRule, RawUsesOrFallbackRule
from .sharded import with_full_values
from .step import (
    LayerWork,
    LossType,
    check_compares,
    check_unseen_uses,
    complex_parameter_error,
    library_computation,
    owned_parameters,
    prepare_step,
    trainable_parameters,
)
from .unseen import CheckUnseen, UnseenUseCheck, check_mode
from .vision_language import image_tokens


def _frozen_parent(module: nn.Module) -> bool:
    """Frozen parameters of its own and trainable ones below: its forward may use the children's
    weights directly (as ``nn.MultiheadAttention`` with a frozen ``in_proj_weight`` still uses
    ``out_proj.weight``; its rule covers that), so a module with no rule is handled like any
    module with trainable parameters of its own (its own code is watched for such uses)."""
    own = any(p is not None for p in module._parameters.values())
    return own and any(p.requires_grad for p in module.parameters())


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _children_have_parameters(module: nn.Module) -> bool:
    """Whether a child of ``module`` has parameters (hooked apart: a re-run of ``module`` by the
    fallback would count its terms twice). Parameter-free children (einops' ``Rearrange`` in
    ``EinMix``, activations) run inside such a re-run."""
    return any(next(child.parameters(), None) is not None for child in module.children())


fallback_rule = FallbackRule()
raw_parameter_rule = RawParameterRule()
raw_uses_or_fallback_rule = RawUsesOrFallbackRule()


BatchDims = int | Mapping[nn.Module | str, int]


def _batch_dim_lookup(model: nn.Module, batch_dim: BatchDims) -> Callable[[str, nn.Module], int]:
    """``batch_dim`` as ``(qualified name, module) -> int``: an int for every module, or a
    mapping from modules or qualified names ("" is the model) to the batch dim of that module
    and its descendants (the deepest entry wins; modules under no entry: 0). The children of
    an ``nn.TransformerEncoderLayer`` / ``DecoderLayer``, and the final ``norm`` of an
    ``nn.TransformerEncoder`` / ``Decoder`` (``nn.Transformer``'s): 1 if the layers are
    sequence-first, else 0, unless named. A recurrent or attention layer's own: 0 if it is
    ``batch_first``, else 1, whatever ``batch_dim`` says."""
    names = {m: n for n, m in model.named_modules()}
    table: dict[str, int] = {}
    for key, dim in ({"": batch_dim} if isinstance(batch_dim, int) else batch_dim).items():
        name = names.get(key) if isinstance(key, nn.Module) else key
        if name is None or name not in names.values():
            raise ValueError(f"add_hooks: batch_dim names {key!r}, which is not a submodule of "
                             f"{type(model).__name__}; use a module or a name from "
                             "model.named_modules()")
        table[name] = dim
    # the children of torch's transformer layers, and the final norm of their stacks, see
    # [S, B, E] or [B, S, E] as the layers' batch_first says, whatever the model's batch dim
    # (an entry naming a child wins)
    for module, name in names.items():
        if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            layer, children = module, [child for child, _ in module.named_children()]
        elif isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and \
                module.norm is not None and len(module.layers):
            layer, children = module.layers[0], ["norm"]
        else:
            continue
        for child in children:
            table.setdefault(f"{name}.{child}" if name else child,
                             0 if layer.self_attn.batch_first else 1)

    def lookup(name: str, module: nn.Module) -> int:
        if isinstance(module, (nn.RNNBase, nn.MultiheadAttention)):  # (their rules read it too)
            return 0 if module.batch_first else 1
        parts = name.split(".") if name else []
        for end in range(len(parts), -1, -1):
            prefix = ".".join(parts[:end])
            if prefix in table:
                return table[prefix]
        return 0
    return lookup


def _refuse_other_options(model: nn.Module, state: HookState,
                          **given: tuple[object, object]) -> None:
    """Refuse options given to ``add_hooks`` on a hooked model (each ``(value, default)``) other
    than the defaults and other than those it was hooked with: they would be ignored."""
    hooked = state.options
    differ = [name for name, (value, default) in given.items()
              if value != default and value != hooked.get(name, default)]
    if differ:
        raise PerSampleHooksError(
            f"add_hooks: {type(model).__name__} is hooked already, with another "
            f"{' and '.join(differ)} than asked now, which would be ignored: "
            "remove_hooks(model) first, then add_hooks(model, ...) with the new options")


def _is_compiled_handle(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of another (``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def add_hooks(model: nn.Module, *, batch_dim: BatchDims = 0, fallback: bool = True,
              units: Iterable[nn.Module | str] = (), check_unseen: CheckUnseen = True,
              broadcast: bool = True, registry: RuleRegistry = default_registry) -> HookState:
    """Instrument every submodule of ``model`` that has parameters of its own.

    A module with parameters of its own (raw ``nn.Parameter`` s: a class token, position
    embeddings, LayerScale gammas) and no rule:

    - with child modules: the children keep their own rules, and the uses of the module's
      raw parameters in its own code are followed op by op (:mod:`per_sample_hooks.raw_uses`:
      elementwise ops with the batch such as ``x + pos``, ``x * gamma``, expands such as
      ``cls.expand(B, -1, -1)``, ``F.linear(x, w, b)`` and ``x @ w``, exact); a use that
      cannot be followed (a product with a weight computed first, a raw value passed to a
      child, a child's weight used by the module's own code) is refused by the ``compute_*``
      call with what to do;
    - without children (a learned scale, position embeddings, a normalization written by
      hand, a custom linear): the same following, call by call; a call whose uses cannot be
      followed (``F.layer_norm`` with a raw weight) is re-run per sample by the
      ``torch.func`` fallback instead of refused.

    A unit includes everything below it (its children are not hooked separately: its forward
    may use their parameters directly, as ``nn.MultiheadAttention`` does with ``out_proj``).
    A module whose rule has ``covers_children`` (``nn.MultiheadAttention``'s) is a unit
    likewise, handled by that rule. ``units`` forces the fallback's treatment for given
    modules or qualified names (a module whose forward uses a child's weight, e.g. a tied
    output layer ``h @ emb.weight.t()``, or its raw parameters in ways not followed).
    With ``fallback=False`` modules with parameters, no rule and no children raise
    :class:`UnsupportedModuleError` instead.

    A module whose weight is computed from its parameters before its forward uses it
    (``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal`` and
    any ``torch.nn.utils.parametrize`` parametrization; the deprecated
    ``torch.nn.utils.weight_norm`` / ``spectral_norm``; a parameter added to a built-in layer)
    is one unit of the fallback, exact: its rule would give the gradient of the weight, not of
    the parameters it is computed from (:mod:`per_sample_hooks.reparametrized`). Apply them
    before ``add_hooks``; with ``fallback=False`` they raise :class:`UnsupportedModuleError`.

    ``batch_dim``: where the batch is in the inputs and outputs of each module: an int for all,
    or ``{module or qualified name: int}`` applying to that module and its descendants (others:
    0). Attention, transformer and recurrent layers read it from their ``batch_first``.

    ``check_unseen``: detect parameter uses outside their module's forward (raise rather than
    return per-sample quantities that miss a term; see :mod:`per_sample_hooks.unseen`): True
    checks the first two steps, every step of a new captured structure (modules called, how
    often, batch sizes) and a random sample of the others at about 0.5% of the training time;
    ``"always"`` every step; False never.

    ``broadcast``: a module called with batch size 1 after some module of the same forward saw
    the batch ``B > 1``, with one tensor output (position embeddings of ids ``[1, T]``, as
    transformers' GPT-2 and BERT build them), is taken as broadcast over the batch: its output
    is returned expanded to ``B`` (a view, the same values wherever it is added to or
    multiplied with the batch), so that its per-sample gradients are exact. Code that
    concatenates such an output along the batch dim or reads its batch rows one by one (a
    genuinely separate batch of 1) would see ``B`` rows: pass ``broadcast=False`` (the call is
    then refused, its batch size disagreeing).

    A module none of whose parameters is trainable (frozen) is hooked all the same and records
    nothing: no input or output gradient held (unless its rule observes it anyway, BatchNorm's
    batch statistics), until its parameters are unfrozen.

    Returns the model's hook state, also a context manager: ``with add_hooks(model): ...``
    removes the hooks on exit. Calling it again on a hooked model returns the same state (given
    options other than the defaults and those it was hooked with: refused, they would be
    ignored; ``remove_hooks`` first).
    Raises :class:`UnsupportedModuleError` for a module with trainable parameters and no rule.
    A ``DistributedDataParallel`` or ``DataParallel`` model is hooked through to the model it
    wraps (the same state answers for either handle). A ``torch.compile``'d model is refused
    unless the model it wraps is hooked already (then its state): compiled code does not see
    hooks added after compilation; hook the model, then compile it.

    A copy of a hooked model (``torch.save(model)`` then ``torch.load(..., weights_only=False)``,
    ``pickle``, ``copy.deepcopy``) is not hooked: its copied hooks do nothing and it computes as
    an unhooked model (its parameters keep copies of any ``grad1``/``hess`` attributes); call
    ``add_hooks`` on the copy to hook it. The original stays hooked.
    """
    if _is_compiled_handle(model) and STATE_ATTRIBUTE not in unwrap(model).__dict__:
        raise PerSampleHooksError(
            "add_hooks got a torch.compile'd module: code compiled before the hooks existed "
            "would not run them (torch._dynamo does not guard on module hooks). Hook the "
            "original model first, then compile it: add_hooks(model); compiled = "
            "torch.compile(model). The compiled module's own original is compiled._orig_mod; "
            "after hooking it call torch._dynamo.reset() so that it is compiled again")
    model = unwrap(model)
    state = model.__dict__.get(STATE_ATTRIBUTE)
    if state is not None:  # hooked before (and compiled after: the documented order)
        _refuse_other_options(model, state, batch_dim=(batch_dim, 0), fallback=(fallback, True),
                              units=(_resolve_units(model, units), set()),
                              check_unseen=(check_unseen, True),
                              broadcast=(broadcast, True), registry=(registry, default_registry))
        return state
    compiled = [n or type(model).__name__ for n, m in model.named_modules()
                if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise PerSampleHooksError(
            f"add_hooks: {compiled[0]!r} was compiled in place (module.compile()) before "
            "add_hooks: its compiled code would not run hooks added later (torch._dynamo does "
            "not guard on module hooks), and its layers' per-sample gradients would be missing. "
            "Hook the model first, then compile: add_hooks(model); model.compile()")
    wrapped = [n for n, m in model.named_modules() if n and _is_compiled_handle(m)]
    if wrapped:
        raise PerSampleHooksError(
            f"add_hooks: {wrapped[0]!r} is a torch.compile'd module (a wrapper): code it "
            "compiled before add_hooks would not run hooks added later (torch._dynamo does not "
            "guard on module hooks), and its layers' per-sample gradients would be missing. "
            f"Hook the model first, then compile the part: set {wrapped[0]!r} back to its "
            "original (the wrapper's ._orig_mod), call add_hooks(model), then set it to "
            "torch.compile(original); if it ran compiled already, call torch._dynamo.reset() "
            "so that it is compiled again")
    complex_parameter = next(((n, p) for n, p in model.named_parameters() if p.is_complex()),
                             None)
    if complex_parameter is not None:
        name, p = complex_parameter
        raise PerSampleHooksError(f"add_hooks: {complex_parameter_error(repr(name), p.dtype)}")
    dim_of = _batch_dim_lookup(model, batch_dim)
    forced = _resolve_units(model, units)
    modules, rules, unit_modules, followed = {}, {}, set(), []
    inside: set[nn.Module] = set()  # descendants of a unit
    for name, module in model.named_modules():
        if module in inside:
            continue
        label = name or type(model).__name__
        rule = None if module in forced else registry.lookup(module)
        reparametrized = None if module in forced else reparametrization(
            module, rule and rule.own_parameter_names(module),
            rule is not None and rule.covers_children)
        if reparametrized is not None and any(p.requires_grad for p in module.parameters()):
            # only its forward sees how its weight is computed: one unit of the fallback
            if not fallback:
                raise UnsupportedModuleError(
                    f"module '{label}' ({type(module).__name__}) {reparametrized}: its "
                    "layer rule would give the gradient of the weight it computes, not of its "
                    "parameters, and the torch.func fallback that follows the computation is "
                    "off. Use add_hooks(model, fallback=True) (the module becomes one unit), "
                    "freeze its parameters, or remove the reparametrization "
                    "(torch.nn.utils.parametrize.remove_parametrizations)")
            forced.add(module)
            rule = None
        has_parameters = next(module.parameters(recurse=False), None) is not None
        if rule is None:
            # frozen parameters of its own, nothing trainable below: hooked all the same, as
            # a layer with a rule is, recording nothing until they are unfrozen (a peft
            # adapter's scale vector, frozen while another adapter is active)
            frozen = has_parameters and not (trainable_parameters(module) or _frozen_parent(module))
            if not (has_parameters or module in forced) or frozen and not fallback:
                continue
            if module not in forced and (_children_have_parameters(module) or
                                         not fallback and _has_children(module)):
                rule = raw_parameter_rule  # its raw parameters' uses followed, children hooked
            elif module not in forced and fallback:
                rule = raw_uses_or_fallback_rule  # followed where it can be, else re-run
            else:
                if not fallback:
                    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
                    raise UnsupportedModuleError(
                        f"module '{label}' of type {type(module).__name__} has trainable "
                        f"parameters ({', '.join(trainable)}) but no per-sample rule, and "
                        "the fallback is off: register one with @per_sample_hooks.register_rule("
                        f"{type(module).__name__}), freeze its parameters, or use "
                        "add_hooks(model, fallback=True)")
                rule = fallback_rule
                unit_modules.add(module)
                inside.update(module.modules())
            if rule is not fallback_rule and not frozen:
                followed.append(module)
        elif rule.covers_children:  # a unit with a rule of its own
            inside.update(module.modules())
            if next(module.parameters(), None) is None and not rule.observe_without_parameters:
                continue
            unit_modules.add(module)
        elif not (has_parameters or rule.observe_without_parameters):
            continue
        modules[module] = (label, dim_of(name, module))
        rules[module] = rule
    # followed modules are recorded even when frozen: their code may use a child's weight
    observed = {m for m, rule in rules.items() if rule.observe_without_parameters} | set(followed)
    state = HookState(model, modules, rules, unit_modules, observed,
                      lambda module, call: rules[module].batch_size(module, call), broadcast)
    state.model_batch_dim = dim_of("", model)
    state.options = dict(batch_dim=batch_dim, fallback=fallback, units=forced,
                         check_unseen=check_unseen, broadcast=broadcast, registry=registry)
    images = image_tokens(model)
    if images is not None:
        state.inspect_model_call = images.imageless_samples
    model_calls = ModelCallHook(state)
    state.handles += [model.register_forward_pre_hook(model_calls, with_kwargs=True),
                      model.register_forward_hook(model_calls.after, always_call=True)]
    state.gradient_copies = {m for m, rule in rules.items() if rule.aliases_output_gradient(m)}
    for module, rule in rules.items():  # tensors watched inside forwards (raw uses, attention)
        watching = rule.watch(module, modules[module][1], partial(state.captures_now, module))
        if watching is not None:
            state.watchers[module], handles = watching
            state.handles += handles
    mode = check_mode(check_unseen)
    if mode is not None:
        state.unseen = UnseenUseCheck(state, mode)
    model.__dict__[STATE_ATTRIBUTE] = state
    return state


def _resolve_units(model: nn.Module, units: Iterable[nn.Module | str]) -> set[nn.Module]:
    # the model by its class name too: messages name it so ("'LearnedH0' (LearnedH0)")
    named = {type(model).__name__: model, **dict(model.named_modules())}
    resolved = set()
    for unit in units:
        module = named.get(unit) if isinstance(unit, str) else unit
        if module is None or all(module is not m for m in named.values()):
            raise ValueError(f"add_hooks: units names {unit!r}, which is not a submodule of "
                             f"{type(model).__name__}")
        resolved.add(module)
    return resolved


def remove_hooks(model: nn.Module) -> None:
    """Remove every hook, captured tensor and ``grad1`` attribute; the model is as before."""
    state = unwrap(model).__dict__.get(STATE_ATTRIBUTE)
    if state is not None:
        state.remove()


def _states(model: nn.Module | None) -> list[HookState]:
    return live_states() if model is None else [get_state(model)]


def disable_hooks(model: nn.Module | None = None) -> None:
    """Pause capture for ``model``, or for every hooked model when ``model`` is None."""
    for state in _states(model):
        state.enabled = False


def enable_hooks(model: nn.Module | None = None) -> None:
    """Resume capture for ``model``, or for every hooked model when ``model`` is None."""
    for state in _states(model):
        state.enabled = True


def is_supported(module: nn.Module, registry: RuleRegistry = default_registry, *,
                 fallback: bool = True) -> bool:
    """Whether ``module``'s own parameters get exact per-sample quantities: by a rule, by
    following their uses (a module with children), or by the ``torch.func`` fallback (unless
    ``fallback=False``). False for a module with no rule and no parameters of its own (nothing
    to compute)."""
    if registry.lookup(module) is not None:
        return True
    own = next(module.parameters(recurse=False), None) is not None
    return own and (fallback or _has_children(module))


def clear_backprops(model: nn.Module) -> None:
    """Forget everything captured so the next step starts clean (buffers are kept for reuse).

    Not needed in a loop that calls a ``compute_*`` function every step: the first forward
    after a ``compute_*`` call starts a new step by itself. The next forward starts the next
    step either way (:meth:`HookState.clear <per_sample_hooks.capture.HookState.clear>`).
    """
    get_state(model).clear()


@with_full_values
@library_computation
def compute_grad1(model: nn.Module, loss_type: LossType = "mean") -> None:
    """Set ``p.grad1`` (``[B, *p.shape]``) on every trainable parameter of hooked modules.

    ``grad1[i]`` is the gradient of sample i's own loss: ``grad1.mean(0) == p.grad`` for a
    mean loss and ``grad1.sum(0) == p.grad`` for ``loss_type="sum"``. The tensors are
    persistent buffers, overwritten by the next call: clone them to keep them.
    """
    state, step = prepare_step(model, loss_type, "compute_grad1")
    # the buffers written, for the unseen-use check on a step it compares
    written: dict[tuple[int, str], Tensor] | None = {} if check_compares(state) else None
    seen: dict[int, Tensor] = {}  # id(parameter) -> its grad1 buffer (hashing a tensor is slow)
    shared: list[tuple[Tensor, Tensor]] = []  # a parameter of several modules: summed at the end
    assigned: list[Tensor] = []  # the parameters given a grad1
    batch, scale, get = step.batch_size, step.scale, state.storage.get
    empty = batch == 0  # an empty batch: [0, *p.shape] buffers, nothing to compute
    for layer in step.layers:
        module, params = layer.module, layer.parameters
        if layer.frozen:
            _drop_frozen_grad1(state, layer)
        if not params:
            continue
        out = {name: get(module, name, batch, p) for name, p in params.items()}
        if not empty:
            if layer.calls:
                written_grad1(layer.rule, module, layer.calls, scale, out)
            else:  # the module's output did not reach the loss: its per-sample gradients are zero
                for buf in out.values():
                    buf.zero_()
        key = id(module)
        for name, buf in out.items():
            if written is not None and not empty:
                written[(key, name)] = buf
            p = params[name]
            first = seen.get(id(p))
            if first is None:
                seen[id(p)] = buf
                p.grad1 = buf
                assigned.append(p)
            else:
                shared.append((first, buf))
    if not empty:  # the hooked sums from the buffers (captured scale: 1 / scale)
        kept = KeptGrads.holding(written) if written is not None else None
        try:
            check_unseen_uses(state, step, kept, 1.0 / scale)
        except PerSampleHooksError:
            for p in assigned:  # no parameter keeps a grad1 that the check refused
                del p.grad1
            raise
    for first, buf in shared:
        first.add_(buf)


def _drop_frozen_grad1(state: HookState, layer: LayerWork) -> None:
    """Parameters frozen since an earlier step lose their ``grad1``."""
    module = layer.module
    if module in state.units:
        params = list(module.parameters())
    else:
        params = [p for p in module._parameters.values() if p is not None]
    if len(params) == len(layer.parameters):
        return  # all trainable
    for p in params:
        if not p.requires_grad and hasattr(p, "grad1"):
            del p.grad1


def per_sample_parameters(model: nn.Module) -> Sequence[nn.Parameter]:
    """The parameters that receive ``grad1``: trainable parameters of hooked modules."""
    state = get_state(model)
    seen: dict[nn.Parameter, None] = {}
    for module in state.modules:
        seen.update(dict.fromkeys(owned_parameters(state, module).values()))
    return list(seen)


__all__ = [
    "add_hooks", "remove_hooks", "disable_hooks", "enable_hooks", "is_supported",
    "clear_backprops", "compute_grad1", "per_sample_parameters", "LossType",
]
