"""Public API: the autograd-hacks verbs, with exact semantics.

``loss = mean_i l_i`` (``loss_type="mean"``) or ``sum_i l_i`` (``"sum"``);
``p.grad1[i] = d l_i / d p`` with shape ``[B, *p.shape]``.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .capture import STATE_ATTRIBUTE, Call, HookState, get_state, live_states
from .errors import PerSampleHooksError, UnsupportedModuleError
from .rules import Rule, RuleRegistry, default_registry

LossType = Literal["mean", "sum"]


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}


def add_hooks(model: nn.Module, *, batch_dim: int = 0,
              registry: RuleRegistry = default_registry) -> HookState:
    """Instrument every submodule of ``model`` that has parameters of its own.

    Returns the model's hook state, also a context manager: ``with add_hooks(model): ...``
    removes the hooks on exit. Calling it again on a hooked model returns the same state.
    Raises :class:`UnsupportedModuleError` for a module with trainable parameters and no rule.
    """
    state = model.__dict__.get(STATE_ATTRIBUTE)
    if state is not None:
        return state
    modules, rules = {}, {}
    for name, module in model.named_modules():
        rule = registry.lookup(module)
        has_parameters = next(module.parameters(recurse=False), None) is not None
        if rule is None:
            if _trainable(module):
                raise UnsupportedModuleError(
                    f"module '{name or type(model).__name__}' of type {type(module).__name__} has "
                    f"trainable parameters ({', '.join(_trainable(module))}) but no per-sample "
                    "rule: register one with @per_sample_hooks.register_rule("
                    f"{type(module).__name__}), or freeze its parameters")
            continue
        if has_parameters or rule.observe_without_parameters:
            modules[module] = (name or type(model).__name__, batch_dim)
            rules[module] = rule
    state = HookState(model, modules)
    state.rules = rules
    model.__dict__[STATE_ATTRIBUTE] = state
    return state


def remove_hooks(model: nn.Module) -> None:
    """Remove every hook, captured tensor and ``grad1`` attribute; the model is as before."""
    state = model.__dict__.get(STATE_ATTRIBUTE)
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


def is_supported(module: nn.Module, registry: RuleRegistry = default_registry) -> bool:
    """Whether ``module``'s own parameters get exact per-sample quantities."""
    return registry.lookup(module) is not None


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


def prepare_step(model: nn.Module, loss_type: LossType, caller: str) -> tuple[HookState, Step]:
    """Check what was captured and pair each hooked module with its rule and calls."""
    if loss_type not in ("mean", "sum"):
        raise ValueError(f"{caller}: loss_type must be 'mean' or 'sum', got {loss_type!r}")
    state = get_state(model)
    layers, sizes = [], {}
    for module, name, calls in state.hooked_calls():
        rule = state.rules[module]
        rule.check(module, calls, name)
        for call in calls:
            changed = call.modified_inputs()
            if changed:
                raise PerSampleHooksError(
                    f"the input of '{name}' ({type(module).__name__}) at position {changed[0]} "
                    "was modified in place after its forward; per-sample gradients would use "
                    "the modified values. Avoid the in-place op (e.g. inplace=False) or clone "
                    "the input")
        with_grads = [c for c in calls if c.has_grads]
        for call in with_grads:
            sizes.setdefault(rule.batch_size(module, call), name)
        layers.append(LayerWork(module, name, rule, with_grads, _trainable(module)))
    if not sizes:
        raise PerSampleHooksError(
            f"{caller}: no output gradient was captured since the hooks were added or last "
            "cleared. Run the forward pass with grad enabled and loss.backward() first")
    if len(sizes) > 1:
        seen = ", ".join(f"{size} (at '{name}')" for size, name in sizes.items())
        raise PerSampleHooksError(
            f"{caller}: captured calls disagree on the batch size: {seen}. Call "
            "clear_backprops(model) between steps, and pass batch_dim to add_hooks if the batch "
            "is not dimension 0")
    batch_size = next(iter(sizes))
    scale = float(batch_size) if loss_type == "mean" else 1.0
    state.consumed = True
    return state, Step(layers, batch_size, scale)


def _parameter_buffers(state: HookState, layer: LayerWork, batch_size: int
                       ) -> Iterator[tuple[str, nn.Parameter, Tensor]]:
    for name, p in layer.parameters.items():
        yield name, p, state.buffer(layer.module, name, batch_size, p)


@torch.no_grad()
def compute_grad1(model: nn.Module, loss_type: LossType = "mean") -> None:
    """Set ``p.grad1`` (``[B, *p.shape]``) on every trainable parameter of hooked modules.

    ``grad1[i]`` is the gradient of sample i's own loss: ``grad1.mean(0) == p.grad`` for a
    mean loss and ``grad1.sum(0) == p.grad`` for ``loss_type="sum"``. The tensors are
    persistent buffers, overwritten by the next call: clone them to keep them.
    """
    state, step = prepare_step(model, loss_type, "compute_grad1")
    for layer in step.layers:
        out = {}
        for name, p, buf in _parameter_buffers(state, layer, step.batch_size):
            out[name] = p.grad1 = buf
        if len(out) < len(layer.module._parameters):  # frozen since the last step: no grad1
            for p in layer.module._parameters.values():
                if p is not None and not p.requires_grad and hasattr(p, "grad1"):
                    del p.grad1
        if not out:
            continue
        if layer.calls:
            layer.rule.grad1(layer.module, layer.calls, step.scale, out)
        else:  # the module's output did not reach the loss: its per-sample gradients are zero
            for buf in out.values():
                buf.zero_()


def per_sample_parameters(model: nn.Module) -> Sequence[nn.Parameter]:
    """The parameters that receive ``grad1``: trainable parameters of hooked modules."""
    state = get_state(model)
    return [p for module in state.modules for p in _trainable(module).values()]


__all__ = [
    "add_hooks", "remove_hooks", "disable_hooks", "enable_hooks", "is_supported",
    "clear_backprops", "compute_grad1", "per_sample_parameters", "prepare_step",
    "LossType",
]
