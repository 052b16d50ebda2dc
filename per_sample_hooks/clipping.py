"""Clipping thresholds: one for each sample's whole gradient, or one per group of parameters
(per-layer clipping), and the adaptive threshold of Andrew et al. 2021.

Per-group clipping: sample ``i``'s gradient restricted to group ``k`` is clipped to ``C_k``,
``c_ik = min(1, C_k / (|g_ik| + 1e-6))``. A sample's clipped gradient then has norm at most
``sqrt(sum_k C_k^2)``, the sensitivity that DP-SGD's noise is scaled by (as in Opacus'
``clipping="per_layer"``); the accounting (the noise multiplier) is unchanged.
"""
from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .capture import unwrap

MaxGradNorm = float | Mapping[object, float] | Iterable[tuple[object, float]]
"""A real number (one threshold), or groups of parameters with a threshold each: a mapping
``{selector: threshold}`` or ``(selector, threshold)`` pairs, a selector being a parameter or
module name of the model, an ``nn.Parameter``, an ``nn.Module`` (its trainable parameters) or
an iterable of those (``model.fc.parameters()``)."""


def check_max_norm(max_norm: object, caller: str, name: str = "max_grad_norm") -> float:
    """``max_norm`` as a float: any real scalar (a Python int or float, a 0-dim or one-element
    real tensor, a numpy real scalar or one-element array), finite and > 0."""
    where = f"{caller}: {name}"
    if isinstance(max_norm, bool):
        raise ValueError(f"{where} must be a real number, not bool")
    if isinstance(max_norm, Tensor):
        dtype = max_norm.dtype
        kind = "b" if dtype == torch.bool else "c" if dtype.is_complex else "f"
        size = max_norm.numel()
    elif hasattr(getattr(max_norm, "dtype", None), "kind"):  # numpy (not imported here)
        kind, size = max_norm.dtype.kind, max_norm.size
    elif isinstance(max_norm, numbers.Number):  # Decimal too (a Number, not a Real)
        complex_ = isinstance(max_norm, numbers.Complex) and not isinstance(max_norm, numbers.Real)
        kind, size = "c" if complex_ else "f", None
    else:
        kind = "?"
    if kind == "b":
        raise ValueError(f"{where} must be a real number, not bool")
    if kind == "c":
        raise ValueError(f"{where} must be a real number, not complex: got {max_norm!r}")
    if kind not in "fiu":
        raise ValueError(f"{where} must be a real number (int, float or a one-element tensor), "
                         f"or groups of parameters with a threshold each, got {max_norm!r}")
    if size is None:
        value = float(max_norm)
    elif size != 1:
        raise ValueError(f"{where} must be one number, got {size} of them: pass a float (or "
                         "(parameters, threshold) pairs for per-group clipping)")
    else:
        value = float(max_norm.item())
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    if value <= 0:
        raise ValueError(f"{where} must be > 0, got {value}")
    return value


@dataclass(frozen=True)
class Thresholds:
    """Clipping thresholds ``values[k]`` of parameter groups; ``group_of`` maps each trainable
    parameter (by ``id``) to its group, None for one group of every parameter."""
    values: tuple[float, ...]
    group_of: Mapping[int, int] | None = None

    def group(self, param: Tensor) -> int:
        return 0 if self.group_of is None else self.group_of[id(param)]

    @property
    def sensitivity(self) -> float:
        """``sqrt(sum_k C_k^2)``: the largest norm of one sample's clipped gradient."""
        return math.sqrt(sum(c * c for c in self.values))


def threshold_argument(max_grad_norm: object, max_norm: object, caller: str,
                       stacklevel: int = 3) -> object:
    """``max_grad_norm``, or the deprecated ``max_norm`` with a DeprecationWarning (pointing
    at ``stacklevel`` frames up: the caller's caller by default)."""
    if max_norm is None:
        if max_grad_norm is None:
            raise TypeError(f"{caller}: missing the clipping threshold max_grad_norm")
        return max_grad_norm
    if max_grad_norm is not None:
        raise TypeError(f"{caller}: pass max_grad_norm only (max_norm is its deprecated name)")
    warnings.warn(f"{caller}: max_norm is deprecated, use max_grad_norm (as DPSGD does)",
                  DeprecationWarning, stacklevel=stacklevel)
    return max_norm


def _is_threshold(value: object) -> bool:
    return isinstance(value, (numbers.Number, Tensor)) or hasattr(
        getattr(value, "dtype", None), "kind")


def _selected(model: nn.Module, selector: object, caller: str) -> list[Tensor]:
    """The trainable parameters ``selector`` names (see :data:`MaxGradNorm`)."""
    if isinstance(selector, str):
        for root in (model, unwrap(model)):
            params = dict(root.named_parameters(remove_duplicate=False))
            if selector in params:
                return [params[selector]]
            modules = dict(root.named_modules())
            if selector in modules:
                return [p for p in modules[selector].parameters() if p.requires_grad]
        raise ValueError(f"{caller}: max_grad_norm names '{selector}', which is neither a "
                         "parameter nor a module of the model (names as in "
                         "model.named_parameters() / named_modules())")
    if isinstance(selector, Tensor):
        return [selector]
    if isinstance(selector, nn.Module):
        return [p for p in selector.parameters() if p.requires_grad]
    if isinstance(selector, Iterable):
        return [p for item in selector for p in _selected(model, item, caller)]
    raise TypeError(f"{caller}: a max_grad_norm group is selected by a parameter or module "
                    f"name, an nn.Parameter, an nn.Module or an iterable of those, got "
                    f"{type(selector).__name__}")


def thresholds(model: nn.Module, max_grad_norm: object, caller: str) -> Thresholds:
    """:class:`Thresholds` from ``max_grad_norm`` (:data:`MaxGradNorm`): every trainable
    parameter of ``model`` in exactly one group (a parameter tied between modules is one
    parameter)."""
    if isinstance(max_grad_norm, Thresholds):
        return max_grad_norm
    if _is_threshold(max_grad_norm) or isinstance(max_grad_norm, (str, bytes)) or \
            not isinstance(max_grad_norm, Iterable):
        return Thresholds((check_max_norm(max_grad_norm, caller),))
    pairs = list(max_grad_norm.items() if isinstance(max_grad_norm, Mapping) else max_grad_norm)
    if not pairs or not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
        raise ValueError(f"{caller}: max_grad_norm must be a real number, a mapping "
                         "{parameters: threshold} or (parameters, threshold) pairs, got "
                         f"{max_grad_norm!r}")
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    group_of: dict[int, int] = {}
    values = []
    for k, (selector, value) in enumerate(pairs):
        values.append(check_max_norm(value, caller, f"max_grad_norm of group {k}"))
        selected = _selected(model, selector, caller)
        if not selected:
            raise ValueError(f"{caller}: max_grad_norm group {k} ({selector!r}) holds no "
                             "trainable parameter")
        for p in selected:
            if id(p) not in names:
                raise ValueError(f"{caller}: max_grad_norm group {k} holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the model")
            if group_of.get(id(p), k) != k:
                raise ValueError(f"{caller}: parameter '{names[id(p)]}' is in max_grad_norm "
                                 f"groups {group_of[id(p)]} and {k}: each parameter belongs to "
                                 "exactly one group")
            group_of[id(p)] = k
    missing = [n for n, p in model.named_parameters() if p.requires_grad
               and id(p) not in group_of]
    if missing:
        raise ValueError(f"{caller}: trainable parameter(s) {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} in no max_grad_norm group: give "
                         "every trainable parameter a threshold (or freeze it)")
    return Thresholds(tuple(values), group_of)


@dataclass(frozen=True)
class AdaptiveClipping:
    """The clipping threshold follows the ``target_quantile`` of the per-sample gradient
    norms (Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping";
    Opacus' ``AdaClipDPOptimizer``), estimated privately.

    After each step with threshold ``C`` (``m`` the expected batch size, ``b`` the number of
    samples whose norm is at most ``C``): ``b~ = (b + N(0, count_noise_multiplier^2)) / m``,
    ``C <- C exp(-learning_rate (b~ - target_quantile))``. The count is a second Gaussian
    mechanism on the same batch (sensitivity 1/2 once centred); for the pair to cost what the
    requested ``noise_multiplier`` ``z`` alone costs, the gradient is noised with
    ``z_grad = (z^-2 - (2 count_noise_multiplier)^-2)^(-1/2)`` (Theorem 1 of the paper), and
    the accountant is told ``z``: needs ``count_noise_multiplier > z / 2``. Default
    ``count_noise_multiplier``: the expected batch size / 20, the paper's choice.
    """
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"AdaptiveClipping: target_quantile must be in (0, 1), got "
                             f"{self.target_quantile!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"AdaptiveClipping: learning_rate must be finite and > 0, got "
                             f"{self.learning_rate!r}")
        if self.count_noise_multiplier is not None and not (
                math.isfinite(self.count_noise_multiplier) and self.count_noise_multiplier >= 0):
            raise ValueError(f"AdaptiveClipping: count_noise_multiplier must be finite and >= 0, "
                             f"got {self.count_noise_multiplier!r}")

    def count_noise(self, expected_batch: float) -> float:
        return expected_batch / 20 if self.count_noise_multiplier is None else \
            self.count_noise_multiplier

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch: float) -> float:
        """``z_grad`` for the requested total ``noise_multiplier`` ``z`` (see the class)."""
        if noise_multiplier == 0:
            return 0.0
        sigma_b = self.count_noise(expected_batch)
        if not 2 * sigma_b > noise_multiplier:
            raise ValueError(
                f"AdaptiveClipping: count_noise_multiplier ({sigma_b}) must be > noise_multiplier"
                f" / 2 ({noise_multiplier / 2}) for the gradient's share of the privacy budget "
                "to be positive: raise it (the paper uses the expected batch size / 20)")
        return (noise_multiplier ** -2 - (2 * sigma_b) ** -2) ** -0.5

    def update(self, threshold: float, noisy_count: float, expected_batch: float) -> float:
        """The next threshold from this step's count of samples within ``threshold``, with
        its ``N(0, count_noise^2)`` noise added (by the caller, as the gradient's)."""
        fraction = noisy_count / expected_batch
        return threshold * math.exp(-self.learning_rate * (fraction - self.target_quantile))


__all__ = ["AdaptiveClipping", "MaxGradNorm", "Thresholds", "check_max_norm",
           "threshold_argument", "thresholds"]
