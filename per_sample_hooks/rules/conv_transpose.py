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
that no input position reaches; they are cropped before unfolding. Everything else (forms,
weighted sums by one weight-gradient convolution) is :class:`~.conv.ConvolutionRule`'s.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn
from torch.nn import functional as F

from ..capture import Call
from .base import register_rule
from .conv import ConvolutionRule, layer_input, unfold_columns


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


@register_rule(nn.ConvTranspose1d)
@register_rule(nn.ConvTranspose2d)
@register_rule(nn.ConvTranspose3d)
class ConvTransposeRule(ConvolutionRule):
    """ConvTranspose1d/2d/3d with any stride, padding, output_padding (or ``output_size`` in
    the forward), dilation, groups and bias."""

    def operands(self, module: nn.modules.conv._ConvTransposeNd, call: Call
                 ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor], None]:
        """The output gradient is the convolution's input, the input its output gradient."""
        x, grad_output = layer_input(call), call.backprop()
        spatial = x.shape[2:]
        return grad_output, x, lambda gy: crop_pad_grad_output(module, gy, spatial), None
