"""Parameters that torch's reparametrizations compute, which no layer rule sees.

``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``,
``orthogonal``, a user's ``register_parametrization``) moves a parameter into
``module.parametrizations`` and computes it on each access; the deprecated
``torch.nn.utils.weight_norm`` / ``spectral_norm`` replace it by raw parameters (``weight_g``
and ``weight_v``; ``weight_orig``) from which a forward pre-hook computes it. A layer's rule
gives the gradient of the weight the layer uses, not of what that weight is computed from, so
``add_hooks`` makes such a module one unit of the ``torch.func`` fallback: its forward,
parametrization included, re-run per sample (exact, at the fallback's cost).

A spectral norm in training mode updates its power-iteration vectors in each forward and then
uses them. A re-run of the forward (the fallback's, the unseen-use check's confirmation) must
use the vectors of the step's forward and leave them as they are:
:func:`power_iterations_off`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.nn.utils.spectral_norm import SpectralNorm

_SPECTRAL_PARAMETRIZATIONS = tuple(
    klass for klass in (getattr(parametrizations, "_SpectralNorm", None),) if klass is not None)


def is_parametrized(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` (itself, not its children) is computed by
    ``torch.nn.utils.parametrize`` (a dict lookup: this runs every step)."""
    return "parametrizations" in module._modules


def reparametrization(module: nn.Module, known: frozenset[str] | None,
                      covers_children: bool = False) -> str | None:
    """Why ``module``'s rule cannot see how its parameters are computed, as a predicate for
    messages ("is parametrized (...)", "has parameters ..."), or None. ``known``: the names of
    the parameters its rule computes (None: any); another one of its own is the deprecated
    ``weight_norm``'s ``weight_g`` or a parameter added to a built-in layer.
    ``covers_children``: the rule also computes its descendants' parameters, so a
    parametrization below counts."""
    below = module.modules() if covers_children else (module,)
    parametrized = [m for m in below if is_parametrized(m)]
    if parametrized:
        names = sorted({n for m in parametrized for n in m.parametrizations})
        return f"is parametrized ({', '.join(names)}: torch.nn.utils.parametrize)"
    unknown = [] if known is None else \
        [n for n, p in module._parameters.items() if p is not None and n not in known]
    if unknown:
        return (f"has parameters its rule does not compute ({', '.join(unknown)}: the "
                "deprecated torch.nn.utils.weight_norm / spectral_norm, or added to the layer)")
    return None


def iterating_spectral_norms(module: nn.Module) -> list[str]:
    """The modules in ``module`` whose spectral norm runs a power iteration in each forward
    (training mode): each call of them uses vectors of its own."""
    return [name or type(module).__name__ for name, sub in module.named_modules()
            if isinstance(sub, _SPECTRAL_PARAMETRIZATIONS) and sub.training
            or sub.training and any(isinstance(hook, SpectralNorm)
                                    for hook in sub._forward_pre_hooks.values())]


@contextlib.contextmanager
def power_iterations_off(module: nn.Module) -> Iterator[None]:
    """Spectral norms in ``module`` (``parametrizations.spectral_norm`` and the deprecated
    ``spectral_norm``'s pre-hook) skip their power iteration in training mode while inside:
    a re-run uses the vectors the step's forward updated and used, and changes nothing."""
    switched, replaced = [], []
    for sub in module.modules():
        if isinstance(sub, _SPECTRAL_PARAMETRIZATIONS) and sub.training:
            sub.training = False
            switched.append(sub)
        for key, hook in list(sub._forward_pre_hooks.items()):
            if isinstance(hook, SpectralNorm):
                replaced.append((sub._forward_pre_hooks, key, hook))
                sub._forward_pre_hooks[key] = _SpectralNormWithoutIteration(hook)
    try:
        yield
    finally:
        for sub in switched:
            sub.training = True
        for table, key, hook in replaced:
            table[key] = hook


class _SpectralNormWithoutIteration:
    """The deprecated spectral norm's pre-hook with ``do_power_iteration=False``."""

    def __init__(self, hook: SpectralNorm):
        self.hook = hook

    def __call__(self, module: nn.Module, inputs: object) -> None:
        setattr(module, self.hook.name,
                self.hook.compute_weight(module, do_power_iteration=False))


class _ForwardOnly(nn.Module):
    """Runs ``module``'s forward pre-hooks (the deprecated ``weight_norm`` computes its weight
    in one), their results left out but for those of the hooks ``applied`` (by key), then its
    ``forward``: a recorded call's arguments come after the pre-hooks that change them and its
    output gradient before the hooks that change its output (the user's; see ``capture``), so
    neither is applied again."""

    def __init__(self, module: nn.Module, applied: Collection[int]) -> None:
        super().__init__()
        self.module, self.applied = module, applied

    def forward(self, *args: object, **kwargs: object) -> object:
        module = self.module
        for key, hook in module._forward_pre_hooks.items():
            if key in module._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None and key in self.applied:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None and key in self.applied:
                    args = result if isinstance(result, tuple) else (result,)
        return module.forward(*args, **kwargs)


def recorded_forward(module: nn.Module, applied: Collection[int] = ()
                     ) -> Callable[[dict[str, Tensor], tuple, dict], object]:
    """``call(values, args, kwargs)``: ``torch.func.functional_call(module, values, args,
    kwargs)`` of the computation a recorded call of ``module`` made from its arguments to its
    output (:class:`_ForwardOnly`; ``applied``: the keys of the pre-hooks, registered for the
    re-run, whose results it takes)."""
    wrapper = _ForwardOnly(module, applied)

    def call(values: dict[str, Tensor], args: tuple, kwargs: dict) -> object:
        return torch.func.functional_call(
            wrapper, {f"module.{n}": v for n, v in values.items()}, args, kwargs)
    return call


__all__ = ["is_parametrized", "iterating_spectral_norms", "power_iterations_off",
           "recorded_forward", "reparametrization"]
