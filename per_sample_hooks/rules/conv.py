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

The rule writes straight into the persistent ``[B, Cout, Cin/G, *k]`` buffer viewed as
``[B*G, Cout/G, K]`` with ``baddbmm(out=...)`` (scale folded into ``alpha``). Patches are built a
few samples at a time (about ``PATCH_CHUNK_ELEMENTS`` numbers), so the im2col buffer stays small
and cache-resident instead of ``prod(k)`` times the input; on the seed-001 CNN this beats both a
whole-batch ``F.unfold`` (page faults of a fresh 42 MB buffer) and the grouped-convolution trick
of Rochette et al. (``convolution_backward`` with ``groups = B*G``), which the rule uses where it
measured faster: 3d convolutions with many input channels per group
(:func:`prefers_grouped_convolution`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from .base import (
    KeptGrads,
    Rule,
    contract_samples,
    hess_from_grad1,
    register_rule,
    split_passes,
)
from .forms import add_outer_products, add_position_sums
from .ghost import (
    bias_norms_squared,
    choose_method,
    chunk_ranges,
    concat_positions,
    sum_of_squares,
    weight_norms_squared,
    weighted_bias_sum,
)
from .kronecker import Approx, input_factor, output_factor

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
    return grad_output.reshape(batch, groups, channels // groups, -1).transpose(2, 3)


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


def sample_chunks(batch: int, per_sample: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges over the batch holding about ``PATCH_CHUNK_ELEMENTS`` numbers."""
    size = max(1, PATCH_CHUNK_ELEMENTS // max(1, per_sample))
    for start in range(0, batch, size):
        yield start, min(batch, start + size)


def add_conv_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor, grad_output: Tensor,
                          out: Tensor, scale: float, accumulate: bool) -> None:
    """``out (+)= scale * per-sample weight gradients`` for one call; ``out [B, *weight.shape]``.

    Patches are unfolded a chunk of samples at a time and multiplied straight into ``out``.
    """
    batch, groups = x.shape[0], module.groups
    out_per_group = module.out_channels // groups
    weights = out.view(batch * groups, out_per_group, -1)
    grads = grad_output.reshape(batch * groups, out_per_group, -1)
    per_sample = weights.shape[2] * grads.shape[2] * groups
    for start, stop in sample_chunks(batch, per_sample):
        patches = conv_columns(module, x[start:stop]).flatten(0, 1).transpose(1, 2)
        rows = slice(start * groups, stop * groups)
        add_outer_products(weights[rows], grads[rows].transpose(1, 2), patches, scale, accumulate)


def add_grouped_conv_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor,
                                  grad_output: Tensor, out: Tensor, scale: float,
                                  accumulate: bool) -> None:
    """Same result as :func:`add_conv_weight_grads` by the trick of Rochette et al. (2019): the
    per-sample weight gradients are the weight gradient of a single convolution over the batch
    folded into the channels, with ``groups = B*G`` (one oneDNN/cuDNN call, no im2col). Costs
    one fresh ``[B, *weight.shape]`` result copied into ``out``."""
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


def add_spatial_sums(out: Tensor, grad_output: Tensor, scale: float, accumulate: bool) -> None:
    """Bias gradients: ``out[b] (+)= scale * grad_output[b].sum(spatial)``, ``out [B, C]``."""
    add_position_sums(out, grad_output.flatten(2).transpose(1, 2), scale, accumulate)


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


@register_rule(nn.Conv1d)
@register_rule(nn.Conv2d)
@register_rule(nn.Conv3d)
class ConvRule(Rule):
    """Conv1d/2d/3d with any stride, padding (ints, tuples, "same", "valid"), padding_mode,
    dilation, groups (depthwise included) and bias."""

    def check(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call], name: str) -> None:
        check_batched(module, calls, name)

    def grad1(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        weight, bias = out.get("weight"), out.get("bias")
        add_weight_grads = (add_grouped_conv_weight_grads if prefers_grouped_convolution(module)
                            else add_conv_weight_grads)
        for i, call in enumerate(calls):
            grad_output = call.backprop()
            if weight is not None:
                add_weight_grads(module, layer_input(call), grad_output, weight, scale, i > 0)
            if bias is not None:
                add_spatial_sums(bias, grad_output, scale, i > 0)

    def norms_squared(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call],
                      scale: float, names: Sequence[str], keep: KeptGrads | None = None
                      ) -> dict[str, Tensor]:
        """Linear norm paths per group on the unfolded form, a chunk of samples at a time; the
        weight's per-sample gradients go into ``keep`` when granted (several positions)."""
        if "weight" in names and keep is not None:
            grads = calls[0].backprop()
            if sum(c.backprop()[0, 0].numel() for c in calls) > 1:
                kept = keep.reserve(module, "weight", grads.shape[0])
                if kept is not None:
                    self.grad1(module, calls, 1.0, {"weight": kept})
                    result = conv_norms_squared(module, calls, scale,
                                                [n for n in names if n != "weight"])
                    result["weight"] = sum_of_squares(kept).mul_(scale * scale)
                    return result
        return conv_norms_squared(module, calls, scale, names)

    def weighted_sum(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call],
                     weights: Tensor, out: dict[str, Tensor], keep: KeptGrads | None = None
                     ) -> None:
        """From the kept per-sample gradients, else one weight-gradient convolution per call
        with ``weights`` folded into the output gradients."""
        kept = keep.get(module, "weight") if keep is not None else None
        if kept is not None and "weight" in out:
            contract_samples(out["weight"], kept, weights)
            out = {n: t for n, t in out.items() if n != "weight"}
        conv_weighted_sum(module, calls, weights, out)

    def kfac(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call], scale: float,
             approx: Approx, spare: MutableMapping[str, Tensor] | None = None
             ) -> tuple[Tensor, Tensor]:
        """``A [(G,) K(+1), K(+1)]`` from the patches (unfolded a chunk of samples at a time),
        ``G [(G,) Cout/G, Cout/G]``; the group dim only when ``groups > 1``."""
        ones = module.bias is not None and module.bias.requires_grad
        inputs = [layer_input(c) for c in calls]
        batch = inputs[0].shape[0]
        positions = sum(c.backprop()[0, 0].numel() for c in calls)
        per_sample = module.groups * positions * module.weight[0].numel()
        chunks = ([conv_patches(module, x[start:stop]) for x in inputs]
                  for start, stop in sample_chunks(batch, per_sample))
        a = input_factor(chunks, batch, ones, approx, spare)
        passes = [[conv_output_grads(module, c.backprop()) for c in pass_calls]
                  for pass_calls in split_passes(calls)]
        g = output_factor(passes, scale, approx, spare)
        return (a[0], g[0]) if module.groups == 1 else (a, g)

    def hess(self, module: nn.modules.conv._ConvNd, calls: Sequence[Call], scale: float,
             params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Exact Gauss-Newton blocks from per-pass per-sample gradients."""
        return hess_from_grad1(self, module, calls, scale, params)


def conv_norms_squared(module: nn.modules.conv._ConvNd, calls: Sequence[Call], scale: float,
                       names: Sequence[str]) -> dict[str, Tensor]:
    """``{name: [B]}`` squared per-sample norms (``scale`` included) of all calls together.

    Weight: patches ``[B, G, T, K]`` and grads ``[B, G, T, Cout/G]`` of every call joined
    along positions, then :func:`~.ghost.weight_norms_squared` (``|a|^2|g|^2`` for one
    position, ghost norm when ``2 T^2 < K Cout/G``, else materialized), a chunk of samples
    at a time so the patch buffer stays about ``PATCH_CHUNK_ELEMENTS`` numbers.
    """
    grads = [conv_output_grads(module, c.backprop()) for c in calls]
    batch, groups = grads[0].shape[0], module.groups
    result = {}
    if "bias" in names:
        result["bias"] = bias_norms_squared(concat_positions(grads)).mul_(scale * scale)
    if "weight" in names:
        acts = [layer_input(c) for c in calls]
        positions = sum(g.shape[2] for g in grads)
        k = module.weight[0].numel()
        method = choose_method(positions, k, grads[0].shape[3])
        norms = grads[0].new_empty(batch)
        for start, stop in chunk_ranges(batch, groups * positions * k):
            patches = concat_positions([conv_patches(module, a[start:stop]) for a in acts])
            chunk_grads = concat_positions([g[start:stop] for g in grads])
            norms[start:stop] = weight_norms_squared(patches, chunk_grads, method)
        result["weight"] = norms.mul_(scale * scale)
    return result


def conv_weighted_sum(module: nn.modules.conv._ConvNd, calls: Sequence[Call], weights: Tensor,
                      out: dict[str, Tensor]) -> None:
    """``out[name] = sum_b weights[b] grad1_b`` (captured scale): the weight gradient of the
    convolution with each sample's output gradient multiplied by its weight (no unfold)."""
    weight, bias = out.get("weight"), out.get("bias")
    zero_padding = module.padding_mode == "zeros" and not isinstance(module.padding, str)
    for i, call in enumerate(calls):
        grad_output = call.backprop()
        w = weights.to(grad_output.dtype).view(-1, *([1] * (grad_output.dim() - 1)))
        if weight is not None:
            x = layer_input(call)
            if not zero_padding:
                x = pad_conv_input(module, x)
            padding = module.padding if zero_padding else (0,) * len(module.kernel_size)
            _, summed, _ = torch.ops.aten.convolution_backward(
                grad_output * w, x, module.weight, None, module.stride, padding,
                module.dilation, False, (0,) * len(module.kernel_size), module.groups,
                (False, True, False))
            if i == 0:
                weight.copy_(summed)
            else:
                weight.add_(summed)
        if bias is not None:
            weighted_bias_sum(bias, conv_output_grads(module, grad_output), weights, i > 0)
