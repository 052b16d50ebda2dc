"""nn.ConvTranspose1d / 2d / 3d: per-sample gradients through an unfolded form.

A transposed convolution is the adjoint (input gradient) of the convolution with the same
weight, stride, padding and dilation. Hence ``<gy, conv_transpose(x, W)> = <conv(gy, W), x>``
and the weight gradient of the transposed convolution is the weight gradient of a convolution
whose *input* is the output gradient ``gy`` and whose *output gradient* is the input ``x``.
With input ``x [B, Cin, *S]``, output gradient ``gy [B, Cout, *So]``, weight
``[Cin, Cout/G, *k]``, ``T = prod(S)`` *input* positions, ``K = (Cout/G) * prod(k)``:

    grad_weight[b, g] = inputs[b, g]^T @ patches[b, g]       # [Cin/G, T] @ [T, K]

where ``inputs = conv_transpose_inputs(module, x)`` (``[B, G, T, Cin/G]``) and
``patches = conv_transpose_patches(module, gy, x.shape[2:])`` (``[B, G, T, K]``), the result
laid out as ``weight[g*Cin/G:(g+1)*Cin/G].reshape(Cin/G, K)``. This costs the same as the
ordinary weight gradient: no zero-stuffing of the input (``prod(stride)`` times larger) and no
cross-group product. ``output_padding`` and an explicit ``output_size`` only add output rows
that no input position reaches; they are cropped before unfolding.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor, nn
from torch.nn import functional as F

from ..capture import Call
from .base import Rule, hess_from_grad1, register_rule
from .conv import (
    add_spatial_sums,
    check_batched,
    layer_input,
    sample_chunks,
    unfold_columns,
)
from .forms import add_outer_products


def crop_pad_grad_output(module: nn.modules.conv._ConvTransposeNd, grad_output: Tensor,
                         input_spatial: Sequence[int]) -> Tensor:
    """``grad_output`` zero-padded by ``module.padding`` on the left and padded or cropped on the
    right to exactly the extent the input positions reach: ``(S-1)*stride + dil*(k-1) + 1``."""
    pads = []
    for size, out_size, k, s, p, dil in zip(input_spatial, grad_output.shape[2:],
                                            module.kernel_size, module.stride, module.padding,
                                            module.dilation):
        reach = (size - 1) * s + dil * (k - 1) + 1
        pads.append((p, reach - p - out_size))
    if not any(left or right for left, right in pads):
        return grad_output
    return F.pad(grad_output, [n for pair in reversed(pads) for n in pair])


def conv_transpose_columns(module: nn.modules.conv._ConvTransposeNd, grad_output: Tensor,
                           input_spatial: Sequence[int]) -> Tensor:
    """Unfolded output gradient, ``[B, G, (Cout/G)*prod(k), T]`` (contiguous);
    :func:`conv_transpose_patches` is its transpose."""
    padded = crop_pad_grad_output(module, grad_output, input_spatial)
    return unfold_columns(padded, module.kernel_size, module.stride, module.dilation,
                          module.groups)


def conv_transpose_patches(module: nn.modules.conv._ConvTransposeNd, grad_output: Tensor,
                           input_spatial: Sequence[int]) -> Tensor:
    """Patches of the output gradient ``[B, Cout, *So]``: ``[B, G, T, (Cout/G)*prod(k)]``.

    ``T = prod(input_spatial)`` input positions (row-major); entry ``(t, (c, *kk))`` of group
    ``g`` is ``grad_output[b, g*Cout/G + c, *(t*stride + kk*dilation - padding)]`` (zero outside).
    The last dim is ordered as ``weight[i]`` flattened (``weight [Cin, Cout/G, *k]``).
    """
    return conv_transpose_columns(module, grad_output, input_spatial).transpose(2, 3)


def conv_transpose_inputs(module: nn.modules.conv._ConvTransposeNd, x: Tensor) -> Tensor:
    """The input ``[B, Cin, *S]`` as ``[B, G, T, Cin/G]`` (a view when ``x`` is contiguous)."""
    batch, channels = x.shape[:2]
    groups = module.groups
    return x.reshape(batch, groups, channels // groups, -1).transpose(2, 3)


def conv_transpose_weight_factors(module: nn.modules.conv._ConvTransposeNd, x: Tensor,
                                  grad_output: Tensor) -> tuple[Tensor, Tensor]:
    """``(left, right)`` with ``left^T @ right`` per sample and group the weight gradient.

    ``left = conv_transpose_inputs(...)`` ``[B, G, T, Cin/G]``, ``right =
    conv_transpose_patches(...)`` ``[B, G, T, (Cout/G)*prod(k)]`` (``T`` input positions), and
    ``grad_weight[b].view(G, Cin/G, -1)[g] = left[b, g]^T @ right[b, g]`` (without the loss
    scale): the contract of :func:`~per_sample_hooks.rules.conv.conv_weight_factors`, with the
    roles of input and output gradient swapped. Materializes the patches of the whole batch.
    """
    return (conv_transpose_inputs(module, x),
            conv_transpose_patches(module, grad_output, x.shape[2:]))


def add_conv_transpose_weight_grads(module: nn.modules.conv._ConvTransposeNd, x: Tensor,
                                    grad_output: Tensor, out: Tensor, scale: float,
                                    accumulate: bool) -> None:
    """``out (+)= scale * per-sample weight gradients``; ``out [B, Cin, Cout/G, *k]``."""
    batch, groups = x.shape[0], module.groups
    in_per_group = module.in_channels // groups
    weights = out.view(batch * groups, in_per_group, -1)
    inputs = x.reshape(batch * groups, in_per_group, -1)
    per_sample = weights.shape[2] * inputs.shape[2] * groups
    spatial = x.shape[2:]
    for start, stop in sample_chunks(batch, per_sample):
        patches = conv_transpose_columns(module, grad_output[start:stop], spatial).flatten(0, 1)
        rows = slice(start * groups, stop * groups)
        add_outer_products(weights[rows], inputs[rows].transpose(1, 2), patches.transpose(1, 2),
                           scale, accumulate)


@register_rule(nn.ConvTranspose1d)
@register_rule(nn.ConvTranspose2d)
@register_rule(nn.ConvTranspose3d)
class ConvTransposeRule(Rule):
    """ConvTranspose1d/2d/3d with any stride, padding, output_padding (or ``output_size`` in
    the forward), dilation, groups and bias."""

    def check(self, module: nn.modules.conv._ConvTransposeNd, calls: Sequence[Call],
              name: str) -> None:
        check_batched(module, calls, name)

    def grad1(self, module: nn.modules.conv._ConvTransposeNd, calls: Sequence[Call],
              scale: float, out: dict[str, Tensor]) -> None:
        weight, bias = out.get("weight"), out.get("bias")
        for i, call in enumerate(calls):
            grad_output = call.backprop()
            if weight is not None:
                add_conv_transpose_weight_grads(module, layer_input(call), grad_output, weight,
                                                scale, i > 0)
            if bias is not None:
                add_spatial_sums(bias, grad_output, scale, i > 0)

    def hess(self, module: nn.modules.conv._ConvTransposeNd, calls: Sequence[Call],
             scale: float, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Exact Gauss-Newton blocks from per-pass per-sample gradients (:meth:`grad1`)."""
        return hess_from_grad1(self, module, calls, scale, params)

