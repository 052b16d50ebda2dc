"""Normalization layers: LayerNorm, RMSNorm, GroupNorm, InstanceNorm*d, BatchNorm*d (eval).

Each layer computes ``y = x_hat * weight (+ bias)`` where ``x_hat`` is ``x`` normalized with
statistics that do not mix samples (per sample, per group, per instance, or constant running
statistics), so the per-sample gradients are, with ``g`` the output gradient of one sample::

    weight: sum over positions of g * x_hat        bias: sum over positions of g

``x_hat`` is recomputed from the captured input with the module's own statistics and
functional op (the same numbers as the forward). The affine parameters are small (``[C]`` or
``normalized_shape``): per-sample gradients ``[B, F]`` cost less than ``x_hat`` itself, so they
are the rule's form (dense), from which norms and weighted sums follow.

BatchNorm with batch statistics (training mode, or ``track_running_stats=False``) mixes the
samples of the batch: per-sample gradients are undefined for it and for every layer below it,
and :class:`BatchNormRule` refuses it (even without affine parameters).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..capture import Call
from ..errors import PerSampleHooksError
from ..forms import Dense, Form
from .base import WEIGHT_AND_BIAS, Rule, refuse_unbatched, register_rule


def sums_channels_first(x_hat: Tensor | None, grads: Tensor) -> tuple[Tensor | None, Tensor]:
    """``x_hat, grads [B, C, *]`` -> per-sample ``(sum g * x_hat, sum g)`` over ``*``,
    ``[B, C]``."""
    batch, channels = grads.shape[:2]
    g = grads.reshape(batch, channels, -1)
    weight = None if x_hat is None else (g * x_hat.reshape(batch, channels, -1)).sum(2)
    return weight, g.sum(2)


def sums_channels_last(x_hat: Tensor | None, grads: Tensor, features: int
                       ) -> tuple[Tensor | None, Tensor]:
    """``x_hat, grads [B, *, *shape]`` (``prod(shape) = features``) -> per-sample
    ``(sum g * x_hat, sum g)`` over ``*``, ``[B, features]``."""
    batch = grads.shape[0]
    g = grads.reshape(batch, -1, features)
    weight = None if x_hat is None else (g * x_hat.reshape(batch, -1, features)).sum(1)
    return weight, g.sum(1)


class AffineNormRule(Rule):
    """Shared rule for ``y = normalize(x) * weight (+ bias)``; a subclass gives ``normalize``
    (from the module and one call's batch-first input) and the layout of its parameters."""
    needs_parameter_values = False  # shapes only: runs on FSDP2 shards
    parameter_names = WEIGHT_AND_BIAS

    #: parameters run along dim 1 (``[B, C, *]``) rather than over the last dims
    channels_first: bool = True

    def normalize(self, module: nn.Module, call: Call, x: Tensor) -> Tensor:
        """``x_hat``, same shape as ``x`` (batch first), with the statistics of the forward."""
        raise NotImplementedError

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        if not self.channels_first:  # normalized over the last dims, its parameters' shape
            weight = next(p for p in module._parameters.values() if p is not None)
            refuse_unbatched(module, calls, name, weight.dim())

    def per_sample(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
                   ) -> dict[str, Tensor]:
        """``{name: [B, *param.shape]}`` for ``names`` (of weight, bias): unscaled, all calls
        summed."""
        result: dict[str, Tensor] = {}
        for call in calls:
            grads = call.backprop()
            x_hat = self.normalize(module, call, call.activation()) if "weight" in names \
                else None
            features = module._parameters[names[0]].numel()
            if self.channels_first:
                weight, bias = sums_channels_first(x_hat, grads)
            else:
                weight, bias = sums_channels_last(x_hat, grads, features)
            for name, value in (("weight", weight), ("bias", bias)):
                if name in names:
                    result[name] = value if name not in result else result[name] + value
        batch = grads.shape[0]
        return {n: v.reshape(batch, *module._parameters[n].shape) for n, v in result.items()}

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Dense: the ``[B, F]`` per-sample gradients cost less than ``x_hat`` itself."""
        return {n: [Dense(v)] for n, v in self.per_sample(module, calls, names).items()}


@register_rule(nn.LayerNorm)
class LayerNormRule(AffineNormRule):
    channels_first = False

    def normalize(self, module: nn.LayerNorm, call: Call, x: Tensor) -> Tensor:
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


@register_rule(nn.RMSNorm)
class RMSNormRule(AffineNormRule):
    channels_first = False

    def normalize(self, module: nn.RMSNorm, call: Call, x: Tensor) -> Tensor:
        return F.rms_norm(x, module.normalized_shape, None, module.eps)


@register_rule(nn.GroupNorm)
class GroupNormRule(AffineNormRule):
    def normalize(self, module: nn.GroupNorm, call: Call, x: Tensor) -> Tensor:
        return F.group_norm(x, module.num_groups, None, None, module.eps)


def uses_instance_statistics(module: _InstanceNorm, training: bool) -> bool:
    """InstanceNorm normalizes with each instance's own statistics unless it tracks running
    statistics and is in eval mode (then the running ones, constants)."""
    return training or not module.track_running_stats


class InstanceNormRule(AffineNormRule):
    """InstanceNorm1d/2d/3d: per-instance or running statistics, both per-sample exact."""

    def normalize(self, module: _InstanceNorm, call: Call, x: Tensor) -> Tensor:
        if uses_instance_statistics(module, call.training):
            # no running statistics passed: the recomputation must not update them again
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        return F.instance_norm(x, module.running_mean, module.running_var, None, None, False,
                               0.0, module.eps)

    def check(self, module: _InstanceNorm, calls: Sequence[Call], name: str) -> None:
        expected = module._get_no_batch_dim() + 1
        for call in calls:
            if call.args and isinstance(call.args[0], Tensor) and call.args[0].dim() != expected:
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}) got a {call.args[0].dim()}-D input "
                    f"without a batch dim; per-sample gradients need a batched "
                    f"{expected}-D input")


for _instance in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    register_rule(_instance)(InstanceNormRule())


def uses_batch_statistics(module: _BatchNorm, training: bool) -> bool:
    """BatchNorm normalizes with the batch's statistics in training mode, and always when it
    keeps no running statistics (``track_running_stats=False``)."""
    return training or module.running_mean is None or module.running_var is None


def batch_statistics_error(module: _BatchNorm, name: str) -> PerSampleHooksError:
    kind = type(module).__name__
    why = ("it is in training mode" if module.running_mean is not None
           else "it has track_running_stats=False")
    return PerSampleHooksError(
        f"'{name}' ({kind}) normalizes with batch statistics ({why}): they mix the samples of "
        "the batch, so per-sample gradients are undefined for it and for every layer below it. "
        "Call model.eval() so that BatchNorm uses its running statistics (exact per sample), "
        f"or replace {kind} with nn.GroupNorm (per-sample statistics)")


class BatchNormRule(AffineNormRule):
    """BatchNorm*d with running statistics (eval mode): constants, so per-sample exact.

    With batch statistics it refuses, whether or not it has affine parameters: they mix the
    samples for every layer below it too (hence ``observe_without_parameters``).
    """

    observe_without_parameters = True

    def normalize(self, module: _BatchNorm, call: Call, x: Tensor) -> Tensor:
        return F.batch_norm(x, module.running_mean, module.running_var, None, None, False,
                            0.0, module.eps)

    def check(self, module: _BatchNorm, calls: Sequence[Call], name: str) -> None:
        # A call is recorded only when its output requires grad: with no record (e.g. a first
        # BatchNorm without affine parameters on an input that does not require grad) the
        # module's current mode is the best evidence of what the forward did.
        modes = [call.training for call in calls] or [module.training]
        if any(uses_batch_statistics(module, training) for training in modes):
            raise batch_statistics_error(module, name)


for _batch_norm in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                    _BatchNorm):
    register_rule(_batch_norm)(BatchNormRule())
