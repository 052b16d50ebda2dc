"""Public API: the autograd-hacks verbs, with exact semantics.

``loss = mean_i l_i`` (``loss_type="mean"``) or ``sum_i l_i`` (``"sum"``);
``p.grad1[i] = d l_i / d p`` with shape ``[B, *p.shape]``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .capture import STATE_ATTRIBUTE, Call, HookState, get_state, live_states, unwrap
from .errors import PerSampleHooksError, UnsupportedModuleError
from .rules import Rule, RuleRegistry, default_registry
from .rules.base import KeptGrads, contract_samples
from .rules.fallback import FallbackRule, unit_parameters
from .rules.formed import FormedRule
from .unseen import CheckUnseen, UnseenUseCheck, check_mode

LossType = Literal["mean", "sum"]


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}


def _frozen_parent(module: nn.Module) -> bool:
    """Frozen parameters of its own and trainable ones below: its forward may use the children's
    weights directly (as ``nn.MultiheadAttention`` with a frozen ``in_proj_weight`` still uses
    ``out_proj.weight``; its rule covers that), so a module with no rule is a fallback unit like
    any module with trainable parameters of its own."""
    own = any(p is not None for p in module._parameters.values())
    return own and any(p.requires_grad for p in module.parameters())


def _owned(state: HookState, module: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters whose ``grad1`` ``module`` gives (a unit's: its children's too)."""
    return unit_parameters(module) if module in state.units else _trainable(module)


fallback_rule = FallbackRule()


BatchDims = int | Mapping[nn.Module | str, int]


def _batch_dim_lookup(model: nn.Module, batch_dim: BatchDims) -> Callable[[str, nn.Module], int]:
    """``batch_dim`` as ``(qualified name, module) -> int``: an int for every module, or a
    mapping from modules or qualified names ("" is the model) to the batch dim of that module
    and its descendants (the deepest entry wins; modules under no entry: 0)."""
    if isinstance(batch_dim, int):
        return lambda name, module: batch_dim
    names = {m: n for n, m in model.named_modules()}
    table: dict[str, int] = {}
    for key, dim in batch_dim.items():
        name = names.get(key) if isinstance(key, nn.Module) else key
        if name is None or name not in names.values():
            raise ValueError(f"add_hooks: batch_dim names {key!r}, which is not a submodule of "
                             f"{type(model).__name__}; use a module or a name from "
                             "model.named_modules()")
        table[name] = dim

    def lookup(name: str, module: nn.Module) -> int:
        parts = name.split(".") if name else []
        for end in range(len(parts), -1, -1):
            prefix = ".".join(parts[:end])
            if prefix in table:
                return table[prefix]
        return 0
    return lookup


def add_hooks(model: nn.Module, *, batch_dim: BatchDims = 0, fallback: bool = True,
              units: Iterable[nn.Module | str] = (), check_unseen: CheckUnseen = True,
              registry: RuleRegistry = default_registry) -> HookState:
    """Instrument every submodule of ``model`` that has parameters of its own.

    A module with trainable parameters of its own and no rule is handled by the ``torch.func``
    fallback as one *unit* with everything below it (its children are not hooked separately:
    its forward may use their parameters directly, as ``nn.MultiheadAttention`` does with
    ``out_proj``). A module whose rule has ``covers_children`` (``nn.MultiheadAttention``'s)
    is a unit likewise, handled by that rule. ``units`` forces the fallback's treatment for
    given modules or qualified names (a module whose forward uses a child's weight, e.g. a tied
    output layer ``h @ emb.weight.t()``).
    With ``fallback=False`` such modules raise :class:`UnsupportedModuleError` instead.

    ``batch_dim``: where the batch is in the inputs and outputs of each module: an int for all,
    or ``{module or qualified name: int}`` applying to that module and its descendants (others:
    0). Attention, transformer and recurrent layers read it from their ``batch_first``.

    ``check_unseen``: detect parameter uses outside their module's forward (raise rather than
    return per-sample quantities that miss a term; see :mod:`per_sample_hooks.unseen`): True
    checks the first step, every step of a new captured structure (modules called, how often,
    batch sizes) and a random sample of the others at about 2% of the training time;
    ``"always"`` every step; False never.

    Returns the model's hook state, also a context manager: ``with add_hooks(model): ...``
    removes the hooks on exit. Calling it again on a hooked model returns the same state.
    Raises :class:`UnsupportedModuleError` for a module with trainable parameters and no rule.
    A ``DistributedDataParallel`` or ``DataParallel`` model is hooked through to the model it
    wraps (the same state answers for either handle). A ``torch.compile``'d model is refused:
    compiled code does not see hooks added after compilation; hook the model, then compile it.

    A copy of a hooked model (``torch.save(model)`` then ``torch.load(..., weights_only=False)``,
    ``pickle``, ``copy.deepcopy``) is not hooked: its copied hooks do nothing and it computes as
    an unhooked model (its parameters keep copies of any ``grad1``/``hess`` attributes); call
    ``add_hooks`` on the copy to hook it. The original stays hooked.
    """
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise PerSampleHooksError(
            "add_hooks got a torch.compile'd module: code compiled before the hooks existed "
            "would not run them (torch._dynamo does not guard on module hooks). Hook the "
            "original model first, then compile it: add_hooks(model); compiled = "
            "torch.compile(model). The compiled module's own original is compiled._orig_mod; "
            "after hooking it call torch._dynamo.reset() so that it is compiled again")
    model = unwrap(model)
    state = model.__dict__.get(STATE_ATTRIBUTE)
    if state is not None:
        return state
    dim_of = _batch_dim_lookup(model, batch_dim)
    forced = _resolve_units(model, units)
    modules, rules, unit_modules, owners = {}, {}, set(), {}
    inside: set[nn.Module] = set()  # descendants of a unit
    for name, module in model.named_modules():
        if module in inside:
            continue
        label = name or type(model).__name__
        rule = None if module in forced else registry.lookup(module)
        has_parameters = next(module.parameters(recurse=False), None) is not None
        if rule is None:
            if not (_trainable(module) or module in forced or _frozen_parent(module)):
                continue
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
        elif rule.covers_children:  # a unit with a rule of its own
            inside.update(module.modules())
            if next(module.parameters(), None) is None and not rule.observe_without_parameters:
                continue
            unit_modules.add(module)
        elif not (has_parameters or rule.observe_without_parameters):
            continue
        modules[module] = (label, dim_of(name, module))
        rules[module] = rule
        prefix = f"{name}." if name else ""
        for n, p in module.named_parameters(recurse=module in unit_modules):
            if p.requires_grad:
                owners.setdefault(p, f"{prefix}{n}")
    state = HookState(model, modules)
    state.rules = rules
    state.units = unit_modules
    state.isolate_outputs = unit_modules
    mode = check_mode(check_unseen)
    if mode is not None:
        state.unseen = UnseenUseCheck(state, owners, mode)
    model.__dict__[STATE_ATTRIBUTE] = state
    return state


def _resolve_units(model: nn.Module, units: Iterable[nn.Module | str]) -> set[nn.Module]:
    named = dict(model.named_modules())
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
    """Whether ``module``'s own parameters get exact per-sample quantities: by a rule, or by the
    ``torch.func`` fallback (unless ``fallback=False``). False for a module with no rule and no
    parameters of its own (nothing to compute)."""
    if registry.lookup(module) is not None:
        return True
    return fallback and next(module.parameters(recurse=False), None) is not None


def clear_backprops(model: nn.Module) -> None:
    """Forget everything captured so the next step starts clean (buffers are kept for reuse).

    Not needed in a loop that calls a ``compute_*`` function every step: the first forward
    after a ``compute_*`` call starts a new step by itself.
    """
    get_state(model).clear()


@dataclass
class LayerWork:
    """One hooked module ready for a rule: its calls that received gradients."""
    module: nn.Module
    name: str
    rule: Rule
    calls: list[Call]
    parameters: dict[str, nn.Parameter]


@dataclass
class Step:
    """Everything captured in one step, checked: common batch size and the loss scale."""
    layers: list[LayerWork]
    batch_size: int
    scale: float


def _parameter_dtype(module: nn.Module) -> torch.dtype | None:
    """The floating-point dtype of ``module``'s first own parameter, if any."""
    for p in module._parameters.values():
        if p is not None:
            return p.dtype if p.is_floating_point() else None
    return None


def prepare_step(model: nn.Module, loss_type: LossType, caller: str) -> tuple[HookState, Step]:
    """Check what was captured and pair each hooked module with its rule and calls.

    A refused step that had a backward is over, as a computed one is: the next forward starts
    a new step (else it would count as a second micro-batch of the refused one)."""
    try:
        return _prepare_step(model, loss_type, caller)
    except Exception:
        state = unwrap(model).__dict__.get(STATE_ATTRIBUTE)
        if state is not None and state.backward_seen:
            state.consumed = True
        raise


def _prepare_step(model: nn.Module, loss_type: LossType, caller: str
                  ) -> tuple[HookState, Step]:
    if loss_type not in ("mean", "sum"):
        raise ValueError(f"{caller}: loss_type must be 'mean' or 'sum', got {loss_type!r}")
    state = get_state(model)
    if state.forward_after_backward is not None:
        state.consumed = True  # this step is lost; the next forward starts a new one
        raise PerSampleHooksError(
            f"{caller}: '{state.forward_after_backward}' ran a forward pass after a backward "
            "pass of the same step (several forward+backward passes, e.g. gradient "
            "accumulation): the rows of different micro-batches would be added sample by "
            f"sample. Call {caller} after each backward (clone the results to keep them), or "
            "clear_backprops(model) before each micro-batch you do not need")
    if state.released_by is not None:
        raise PerSampleHooksError(
            f"{caller}: {state.released_by} dropped this step's captured tensors; run a new "
            "forward and backward (or leave release_records=False to read them again)")
    layers, sizes = [], {}
    for module, name, calls in state.hooked_calls():
        rule = state.rules[module]
        formed = [c.per_sample for c in calls if c.per_sample is not None]
        if formed:  # its per-sample gradients were formed on arrival: they are all there is
            if len(formed) != len(calls) or any(calls[0].grads):
                raise PerSampleHooksError(
                    f"{caller}: '{name}' received another gradient after its per-sample "
                    "gradients were formed on arrival (OutputEdges(model, form_on_arrival="
                    "True)) and its captured input was dropped: several backward passes of one "
                    "forward need form_on_arrival=False")
            sizes.setdefault(calls[0].batch_size, name)
            layers.append(LayerWork(module, name, FormedRule(formed[0]), calls,
                                    _owned(state, module)))
            continue
        rule.check(module, calls, name)
        dtype = _parameter_dtype(module)
        with_grads = []
        for call in calls:
            changed = call.modified_inputs()
            if changed:
                raise PerSampleHooksError(
                    f"the input of '{name}' ({type(module).__name__}) at position {changed[0]} "
                    "was modified in place after its forward; per-sample gradients would use "
                    "the modified values. Avoid the in-place op (e.g. inplace=False) or clone "
                    "the input")
            if not call.has_grads:
                continue
            # under torch.autocast a module sees lower-precision tensors than its parameters:
            # compute per-sample quantities in the parameters' dtype (captures converted once)
            if dtype is not None and call.has_other_float_dtype(dtype):
                call.cast_(dtype)
            sizes.setdefault(rule.batch_size(module, call), name)
            with_grads.append(call)
        layers.append(LayerWork(module, name, rule, with_grads, _owned(state, module)))
    if not sizes:
        raise PerSampleHooksError(
            f"{caller}: no output gradient was captured since the hooks were added or last "
            "cleared. Run the forward pass with grad enabled and loss.backward() first")
    if len(sizes) > 1:
        seen = ", ".join(f"{size} (at '{name}')" for size, name in sizes.items())
        raise PerSampleHooksError(
            f"{caller}: captured calls disagree on the batch size: {seen}. Call "
            "clear_backprops(model) between steps, and pass batch_dim to add_hooks if the batch "
            "is not dimension 0. A module called without the batch dim whose output is "
            "broadcast over the batch (position ids `pos_emb(torch.arange(T))`) mixes the "
            "samples' gradients: give it the batch, `pos_emb(torch.arange(T).expand(B, -1))`")
    batch_size = next(iter(sizes))
    scale = float(batch_size) if loss_type == "mean" else 1.0
    state.consumed = True
    return state, Step(layers, batch_size, scale)


FORM_RATIO = 2
"""``form_on_arrival`` forms a call's per-sample gradients when its captured input and output
gradient hold at least this many times as many numbers. Measured on the T=256 token model: a
ratio of 1, which also forms its Linear layers (per-sample gradients 0.8x their pair), gave the
same peak memory (1.16x against 1.15x a plain step) and time within noise; 2 leaves more layers
with their records, so more of them serve ``compute_kfac``."""


@torch.no_grad()
def form_on_arrival(state: HookState, module: nn.Module, call: Call) -> None:
    """Form ``call``'s per-sample gradients now, as captured, into step-scoped buffers, and drop
    its input and output gradient, when those hold :data:`FORM_RATIO` times as many numbers
    (LayerNorm; Linear and convolutions on many positions): set as
    :attr:`HookState.on_gradient` during a backward that only clipping or norms will read.

    Only the plain case is formed: the module's only call of the step, one output, its first
    backward pass, inputs unchanged, not a unit (the torch.func fallback, attention); anything
    else keeps its record and is handled as usual."""
    if (call.per_sample is not None or len(call.grads) != 1 or len(call.grads[0]) != 1
            or module in state.units or len(state.calls[module]) != 1
            or call.modified_inputs()):
        return
    params = _owned(state, module)
    rule = state.rules[module]
    held = call.grads[0][0].numel() + sum(a.numel() for a in call.args if isinstance(a, Tensor))
    batch = rule.batch_size(module, call)
    if not params or batch == 0 or \
            FORM_RATIO * batch * sum(p.numel() for p in params.values()) > held:
        return
    name = state.modules[module][0]
    try:
        rule.check(module, [call], name)
    except PerSampleHooksError:
        return  # reported by prepare_step, with the record intact
    dtype = _parameter_dtype(module)
    if dtype is not None and call.has_other_float_dtype(dtype):
        call.cast_(dtype)
    out = {n: state.buffer(module, f"formed {n}", batch, p, step_only=True)
           for n, p in params.items()}
    rule.grad1(module, [call], 1.0, out)
    call.release()
    call.per_sample = out


@torch.no_grad()
def compute_grad1(model: nn.Module, loss_type: LossType = "mean") -> None:
    """Set ``p.grad1`` (``[B, *p.shape]``) on every trainable parameter of hooked modules.

    ``grad1[i]`` is the gradient of sample i's own loss: ``grad1.mean(0) == p.grad`` for a
    mean loss and ``grad1.sum(0) == p.grad`` for ``loss_type="sum"``. The tensors are
    persistent buffers, overwritten by the next call: clone them to keep them.
    """
    state, step = prepare_step(model, loss_type, "compute_grad1")
    written: dict[tuple[int, str], Tensor] = {}
    seen: dict[nn.Parameter, Tensor] = {}  # each parameter's grad1 buffer
    shared: list[tuple[Tensor, Tensor]] = []  # a parameter of several modules: summed at the end
    empty = step.batch_size == 0  # an empty batch: [0, *p.shape] buffers, nothing to compute
    for layer in step.layers:
        out = {name: state.buffer(layer.module, name, step.batch_size, p)
               for name, p in layer.parameters.items()}
        _drop_frozen_grad1(state, layer)
        if not out:
            continue
        if not empty:
            if layer.calls:
                layer.rule.grad1(layer.module, layer.calls, step.scale, out)
            else:  # the module's output did not reach the loss: its per-sample gradients are zero
                for buf in out.values():
                    buf.zero_()
            written.update({(id(layer.module), n): buf for n, buf in out.items()})
        for name, buf in out.items():
            p = layer.parameters[name]
            if p in seen:
                shared.append((seen[p], buf))
            else:
                seen[p] = buf
                p.grad1 = buf
    if not empty:  # the hooked sums from the buffers (captured scale: 1 / step.scale)
        check_unseen_uses(state, step, KeptGrads.holding(written), 1.0 / step.scale)
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


def check_unseen_uses(state: HookState, step: Step, kept: KeptGrads | None = None,
                      kept_scale: float = 1.0) -> None:
    """The unseen-use check of :mod:`per_sample_hooks.unseen`, on the steps its schedule
    checks: each layer's hooked sum is its rule's weighted sum with unit weights, or the sum
    of the per-sample gradients in ``kept`` where it has all of the layer's (``kept_scale``
    times them is as captured), compared with autograd's gradients. Raises before anything is
    written."""
    check = state.unseen
    if check is None or not check.totals:
        return
    start = time.perf_counter()
    hooked: dict[int, Tensor] = {}
    users: dict[int, list[str]] = {}
    for layer in step.layers:
        out = {}
        for n, p in layer.parameters.items():
            users.setdefault(id(p), []).append(layer.name)
            if id(p) in check.totals and layer.calls:
                out[n] = torch.empty_like(p, memory_format=torch.contiguous_format)
        if not out:
            continue
        ones = out[next(iter(out))].new_ones(step.batch_size)
        stored = {n: kept.get(layer.module, n) for n in out} if kept is not None else {}
        if all(t is not None for t in stored.values()) and stored:
            for n, target in out.items():
                contract_samples(target, stored[n], ones * kept_scale)
        else:
            layer.rule.weighted_sum(layer.module, layer.calls, ones, out, keep=kept)
        for n, value in out.items():
            key = id(layer.parameters[n])
            hooked[key] = value if key not in hooked else hooked[key].add_(value)
    check.verify(hooked, users, time.perf_counter() - start)


def per_sample_parameters(model: nn.Module) -> Sequence[nn.Parameter]:
    """The parameters that receive ``grad1``: trainable parameters of hooked modules."""
    state = get_state(model)
    seen: dict[nn.Parameter, None] = {}
    for module in state.modules:
        seen.update(dict.fromkeys(_owned(state, module).values()))
    return list(seen)


__all__ = [
    "add_hooks", "remove_hooks", "disable_hooks", "enable_hooks", "is_supported",
    "clear_backprops", "compute_grad1", "per_sample_parameters", "prepare_step",
    "check_unseen_uses", "form_on_arrival",
    "LossType",
]
