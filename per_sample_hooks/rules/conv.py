"""nn.Conv1d / Conv2d / Conv3d: per-sample gradients through the unfolded (im2col) form.

Notation: input ``x [B, Cin, *S]``, output gradient ``gy [B, Cout, *So]``, ``G`` groups,
kernel ``k`` (``d`` spatial dims), ``K = (Cin/G) * prod(k)``, ``T = prod(So)`` output positions.
Group ``g`` of the weight, ``weight[g*Cout/G:(g+1)*Cout/G]`` flattened to ``[Cout/G, K]``
(input channel major, then the kernel dims in order), has the per-sample gradient

    grad_weight[b, g] = grads[b, g]^T @ patches[b, g]        # [Cout/G, T] @ [T, K]

with ``patches = conv_patches(module, x)`` (``[B, G, T, K]``) and
``grads = conv_output_grads(module, gy)`` (``[B, G, T, Cout/G]``): the Linear math per group.
Grouped and depthwise convolutions cost one small product per group; the cross-group
``Cout x Cin*prod(k)`` product is never formed.

The rule's forms (``forms``) are, per call, ``Outer(grads, patches)`` for the weight and
``Outer(grads)`` for the bias, the patches ``forms.Unfolded``: built a few samples at a
time (about ``PATCH_CHUNK_ELEMENTS`` numbers), so the im2col buffer stays small and
cache-resident instead of ``prod(k)`` times the input. Per-sample gradients are multiplied
straight into the persistent ``[B, Cout, Cin/G, *k]`` buffer viewed as ``[B*G, Cout/G, K]``; on
the seed-001 CNN this beats both a whole-batch ``F.unfold`` (page faults of a fresh 42 MB
buffer) and the grouped-convolution trick of Rochette et al. (``convolution_backward`` with
``groups = B*G``), which the rule uses where it measured faster: 3d convolutions with many
input channels per group (:func:`prefers_grouped_convolution`). Weighted sums of the weight
are one weight-gradient convolution (no unfold), the ``weighted`` of its forms.
:class:`ConvolutionRule` holds what transposed convolutions share (their weight gradient is
that of a convolution too).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from ..forms import Form, Outer, Unfolded
from .base import WEIGHT_AND_BIAS, Rule, register_rule

PATCH_CHUNK_ELEMENTS = 1 << 20
"""Target size (in numbers) of the patch buffer built at once; 4 MB in float32."""


def unfold_columns(x: Tensor, kernel_size: Sequence[int], stride: Sequence[int],
                   dilation: Sequence[int], groups: int) -> Tensor:
    """im2col of an already padded input ``x [B, C, *S]`` -> ``[B, G, (C/G)*prod(k), T]``.

    Row ``(c, *kk)`` of group ``g``, column ``t`` (output position, row-major over the output
    grid) holds ``x[b, g*C/G + c, *(t*stride + kk*dilation)]``. The result is contiguous (one
    copy; a view of ``x`` when that is already contiguous, e.g. a 1x1 kernel with stride 1).
    Overlapping window views are always copied: batched GEMM on them is ten times slower.
    """
    d = len(kernel_size)
    windows = x
    for i, (k, s, dil) in enumerate(zip(kernel_size, stride, dilation)):
        windows = windows.unfold(2 + i, dil * (k - 1) + 1, s)  # [B, C, *So, *span]
    if any(dil != 1 for dil in dilation):
        windows = windows[(..., *(slice(None, None, dil) for dil in dilation))]
    batch, channels = x.shape[:2]
    positions = math.prod(windows.shape[2:2 + d])
    order = (0, 1, *range(2 + d, 2 + 2 * d), *range(2, 2 + d))
    return windows.permute(order).reshape(
        batch, groups, channels // groups * math.prod(kernel_size), positions).contiguous()


def pad_conv_input(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """``x`` padded exactly as ``module``'s forward pads it (any ``padding_mode``, ``"same"``
    with its asymmetric split for even kernels); ``x`` itself when there is no padding."""
    pads = module._reversed_padding_repeated_twice
    if not any(pads):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pads, mode=mode)


def conv_columns(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """The unfolded input of a convolution, ``[B, G, (Cin/G)*prod(k), T]`` (contiguous);
    :func:`conv_patches` is its transpose."""
    return unfold_columns(pad_conv_input(module, x), module.kernel_size, module.stride,
                          module.dilation, module.groups)


def conv_patches(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Patches of ``module``'s input ``x [B, Cin, *S]``: ``[B, G, T, (Cin/G)*prod(k)]``.

    ``T`` = output positions (row-major over the output grid). The last dim is ordered as
    ``weight[g*Cout/G:(g+1)*Cout/G].reshape(Cout/G, -1)``: input channel of the group, then the
    kernel offsets. A transposed view of a contiguous ``[B, G, K, T]`` tensor.
    """
    return conv_columns(module, x).transpose(2, 3)


def conv_output_grads(module: nn.modules.conv._ConvNd, grad_output: Tensor) -> Tensor:
    """Output gradients ``[B, Cout, *So]`` of ``module`` as ``[B, G, T, Cout/G]``, ``T`` as in
    :func:`conv_patches`. A view when ``grad_output`` is contiguous."""
    batch, channels = grad_output.shape[:2]
    groups = module.groups
    positions = math.prod(grad_output.shape[2:])  # not -1: ambiguous for an empty batch
    return grad_output.reshape(batch, groups, channels // groups, positions).transpose(2, 3)


def conv_weight_factors(module: nn.modules.conv._ConvNd, x: Tensor, grad_output: Tensor
                        ) -> tuple[Tensor, Tensor]:
    """``(left, right)`` with ``left^T @ right`` per sample and group the weight gradient.

    ``left = conv_output_grads(...)`` ``[B, G, T, Cout/G]``, ``right = conv_patches(...)``
    ``[B, G, T, (Cin/G)*prod(k)]``, and ``grad_weight[b].view(G, Cout/G, -1)[g] =
    left[b, g]^T @ right[b, g]`` (without the loss scale). Same contract as
    :func:`~per_sample_hooks.rules.conv_transpose.conv_transpose_weight_factors`, so norm,
    clipping and Kronecker-factor code can treat both layer kinds (and Linear, with ``G = 1``)
    alike. Materializes the patches of the whole batch: slice the batch for large inputs.
    """
    return conv_output_grads(module, grad_output), conv_patches(module, x)


def unfolded(module: nn.modules.conv._ConvNd, x: Tensor, pad: Callable[[Tensor], Tensor],
             padding: Sequence[int] | None = None) -> Unfolded:
    """The patches of ``pad(x)`` (``[B, G, T, K]``, ``K`` the size of a row of the weight):
    built ``PATCH_CHUNK_ELEMENTS`` numbers at a time; projected by a convolution of ``x`` with
    each probe as a kernel (no unfold), with ``padding`` when given (zero padding: no padded
    copy), else over ``pad(x)``."""
    kernel, stride, dilation, groups = (module.kernel_size, module.stride, module.dilation,
                                        module.groups)
    dims = len(kernel)

    def build(start: int, stop: int) -> Tensor:
        return unfold_columns(pad(x[start:stop]), kernel, stride, dilation, groups).mT

    def project(probes: Tensor) -> Tensor:  # [k, K] -> [B, G, k, T]
        count = probes.shape[0]
        kernels = probes.view(count, -1, *kernel).repeat(groups, *[1] * (dims + 1))
        source = x if padding is not None else pad(x)
        out = torch.convolution(source.to(probes.dtype), kernels, None, stride,
                                padding or [0] * dims, dilation, False, [0] * dims, groups)
        return out.view(out.shape[0], groups, count, -1)

    return Unfolded(build, module.weight.shape[1:].numel(), PATCH_CHUNK_ELEMENTS, project)


def weighted_weight_gradient(module: nn.modules.conv._ConvNd, source: Tensor, grads: Tensor,
                             pad: Callable[[Tensor], Tensor], padding: Sequence[int] | None,
                             weights: Tensor, like: Tensor) -> Tensor:
    """``sum_b weights[b] * grad1_b`` of the weight (shaped as ``like``), the convolution's
    weight gradient (operands as ``ConvolutionRule.operands``) with ``weights`` folded into
    its output gradient ``grads``: no patches built. Measured 1.5-2.5x faster than the chunked
    patches on 1d and 2d shapes, 0.7x on the seed-001 CNN's conv2 (whose clipping keeps its
    per-sample gradients: not asked there)."""
    dims = len(module.kernel_size)
    w = weights.to(grads.dtype).view(-1, *[1] * (grads.dim() - 1))
    return torch.ops.aten.convolution_backward(
        grads * w, source if padding is not None else pad(source), like, None, module.stride,
        padding or [0] * dims, module.dilation, False, [0] * dims, module.groups,
        [False, True, False])[1]


def zero_padding(module: nn.modules.conv._ConvNd) -> Sequence[int] | None:
    """``module.padding`` when a convolution can apply it itself (zeros, symmetric)."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return module.padding
    return None


def add_grouped_conv_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor,
                                  grad_output: Tensor, out: Tensor, scale: float,
                                  accumulate: bool) -> None:
    """``out (+)= scale * per-sample weight gradients`` (``[B, *weight.shape]``) by the trick
    of Rochette et al. (2019): the per-sample weight gradients are the weight gradient of a
    single convolution over the batch folded into the channels, with ``groups = B*G`` (one
    oneDNN/cuDNN call, no im2col). Costs one fresh ``[B, *weight.shape]`` result copied into
    ``out``."""
    batch, dims = x.shape[0], len(module.kernel_size)
    padded = pad_conv_input(module, x)
    weights = out.view(-1, *out.shape[2:])  # [B*Cout, Cin/G, *k]; only its shape is read
    result = torch.ops.aten.convolution_backward(
        grad_output.reshape(1, -1, *grad_output.shape[2:]),
        padded.reshape(1, -1, *padded.shape[2:]), weights, None, module.stride, [0] * dims,
        module.dilation, False, [0] * dims, batch * module.groups, [False, True, False])[1]
    if accumulate:
        weights.add_(result, alpha=scale)
    else:
        torch.mul(result, scale, out=weights)


def prefers_grouped_convolution(module: nn.modules.conv._ConvNd) -> bool:
    """Which of the two exact methods is faster, from CPU measurements (torch 2.13, one thread):
    chunked im2col + batched GEMM wins on every 1d and 2d shape tried (seed-001 CNN conv2:
    21 vs 25 ms; depthwise: 2-3x) and on 3d convs with few input channels per group; the
    grouped-convolution weight gradient wins on 3d convs with 8 or more (1.4-1.7x)."""
    return len(module.kernel_size) == 3 and module.in_channels // module.groups >= 8


def layer_input(call: Call) -> Tensor:
    """The input of a (transposed) convolution call, batch first, passed by position or as
    ``input=``."""
    if call.args:
        return call.activation()
    x = call.kwargs["input"].detach()
    return x if call.batch_dim == 0 else x.movedim(call.batch_dim, 0)


def check_batched(module: nn.Module, calls: Sequence[Call], name: str) -> None:
    """Refuse unbatched inputs (``[Cin, *S]``): there is no batch to take samples from."""
    expected = len(module.kernel_size) + 2
    for call in calls:
        x = call.args[0] if call.args else call.kwargs.get("input")
        if isinstance(x, Tensor) and x.dim() != expected:
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) got an input of shape {tuple(x.shape)}; "
                f"per-sample gradients need a batched input with {expected} dims "
                "[batch, channels, *spatial]: add a batch dim (x.unsqueeze(0))")


class ConvolutionRule(Rule):
    """What convolutions and transposed convolutions share: the weight gradient is the weight
    gradient of a convolution (:meth:`operands`), whose per-sample form is ``Outer(grads,
    patches)``, the patches ``forms.Unfolded`` (built a chunk of samples at a time,
    projected by a convolution), weighted sums one weight-gradient convolution
    (:func:`weighted_weight_gradient`); the bias's is ``Outer(grads)`` of the output
    gradients."""
    needs_parameter_values = False  # shapes only: runs on FSDP2 shards
    parameter_names = WEIGHT_AND_BIAS

    def operands(self, module: nn.Module, call: Call
                 ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor], Sequence[int] | None]:
        """``(source, grads, pad, padding)``: ``module``'s weight gradient in ``call`` is the
        weight gradient of the convolution (``module``'s kernel, stride, dilation, groups) of
        ``pad(source)``, or of ``source`` with zero ``padding`` when given, whose output
        gradient is ``grads``."""
        raise NotImplementedError

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        check_batched(module, calls, name)

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        result: dict[str, list[Form]] = {name: [] for name in names}
        for call in calls:
            for name, parts in result.items():
                if name == "weight":
                    source, grads, pad, padding = self.operands(module, call)
                    parts.append(Outer(conv_output_grads(module, grads),
                                       unfolded(module, source, pad, padding), None,
                                       partial(weighted_weight_gradient, module, source, grads,
                                               pad, padding)))
                else:
                    parts.append(Outer(conv_output_grads(module, call.backprop())))
        return result


@register_rule(nn.Conv1d)
@register_rule(nn.Conv2d)
@register_rule(nn.Conv3d)
class ConvRule(ConvolutionRule):
    """Conv1d/2d/3d with any stride, padding (ints, tuples, "same", "valid"), padding_mode,
    dilation, groups (depthwise included) and bias."""

    kronecker = True

    def operands(self, module: nn.modules.conv._ConvNd, call: Call
                 ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor], Sequence[int] | None]:
        return (layer_input(call), call.backprop(), partial(pad_conv_input, module),
                zero_padding(module))

    def grad1(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """The forms, except the weight of 3d convolutions with many input channels per group:
        there the grouped-convolution trick is 1.4-1.7x faster than the chunked patches
        (:func:`prefers_grouped_convolution`)."""
        weight = out.get("weight")
        if weight is None or not prefers_grouped_convolution(module):
            super().grad1(module, calls, scale, out)
            return
        for i, call in enumerate(calls):
            add_grouped_conv_weight_grads(module, layer_input(call), call.backprop(), weight,
                                          scale, i > 0)
        if "bias" in out:
            super().grad1(module, calls, scale, {"bias": out["bias"]})
