"""Kronecker factors on the Linear form, shared by the Linear and convolution rules.

Every function works on ``x [n, Gr, T, f]``: ``n`` samples, ``Gr`` independent groups (1 for
Linear; conv groups), ``T`` positions (Linear leading dims, conv output positions), ``f``
features (input features / patch size for activations, output features for gradients). Several
calls of one module are several parts whose positions add up. See
:mod:`per_sample_hooks.curvature` for the scaling contract:

- expand: ``A = 1/(N T) sum_{i,t} a a^T``, ``G = scale * sum_{passes,i,t} g g^T``
- reduce: ``A = 1/(N T^2) sum_i (sum_t a)(sum_t a)^T``,
  ``G = scale * sum_{passes,i} (sum_t g)(sum_t g)^T``

with ``a`` the activations (a constant 1 appended when the layer has a trainable bias) and
``g`` the captured output gradients.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor

Approx = Literal["expand", "reduce"]
APPROXIMATIONS = ("expand", "reduce")


def factor_rows(x: Tensor, ones: bool) -> Tensor:
    """``[n, Gr, T, f] -> [Gr, n*T, f (+1)]``, a constant 1 appended to each row when ``ones``
    (the homogeneous coordinate of a bias). A view when possible, else one copy."""
    n, groups, positions, features = x.shape
    if not ones:
        return x.transpose(0, 1).reshape(groups, n * positions, features)
    out = x.new_empty((groups, n, positions, features + 1))
    out[..., :features] = x.transpose(0, 1)
    out[..., features] = 1
    return out.view(groups, n * positions, features + 1)


def position_sums(x: Tensor, ones: bool) -> Tensor:
    """``[n, Gr, T, f] -> [n, Gr, f (+1)]``: each sample's sum over positions; the appended
    homogeneous coordinate sums to ``T``."""
    summed = x.sum(2)
    if not ones:
        return summed
    return torch.cat([summed, summed.new_full((*summed.shape[:2], 1), x.shape[2])], dim=2)


def add_second_moment(acc: Tensor | None, rows: Tensor, alpha: float = 1.0) -> Tensor:
    """``acc (+)= alpha * rows^T rows`` per group: ``rows [Gr, m, f] -> [Gr, f, f]``."""
    if acc is None:
        product = torch.matmul(rows.mT, rows)
        return product if alpha == 1 else product.mul_(alpha)
    return torch.baddbmm(acc, rows.mT, rows, alpha=alpha, out=acc)


def add_sample_outer(acc: Tensor | None, sums: Tensor, alpha: float = 1.0) -> Tensor:
    """``acc (+)= alpha * sum_i s_i s_i^T`` per group: ``sums [n, Gr, f] -> [Gr, f, f]``."""
    return add_second_moment(acc, sums.transpose(0, 1), alpha)


def input_factor(chunks: Iterable[Sequence[Tensor]], batch: int, ones: bool, approx: Approx
                 ) -> Tensor:
    """``A [Gr, da, da]`` from activations given a chunk of samples at a time.

    Each chunk lists one ``[n, Gr, T_c, f]`` tensor per call (the same samples); the chunks
    cover the batch of ``batch`` samples once. Positions of all calls count together.
    """
    acc, positions = None, 0
    for parts in chunks:
        positions = sum(x.shape[2] for x in parts)
        if approx == "expand":
            for x in parts:
                acc = add_second_moment(acc, factor_rows(x, ones))
        else:
            acc = add_sample_outer(acc, sum(position_sums(x, ones) for x in parts))
    denominator = batch * positions * (positions if approx == "reduce" else 1)
    return acc.div_(max(denominator, 1))


def output_factor(passes: Iterable[Sequence[Tensor]], scale: float, approx: Approx) -> Tensor:
    """``G [Gr, dg, dg]`` from captured output gradients: one list per backward pass, one
    ``[B, Gr, T_c, p]`` tensor per call."""
    acc = None
    for parts in passes:
        if approx == "expand":
            for g in parts:
                acc = add_second_moment(acc, factor_rows(g, False), scale)
        else:
            acc = add_sample_outer(acc, sum(g.sum(2) for g in parts), scale)
    return acc


def check_approx(approx: str, caller: str) -> None:
    if approx not in APPROXIMATIONS:
        raise ValueError(f"{caller}: approx must be one of {APPROXIMATIONS} (Eschenhagen et al. "
                         f"2023, K-FAC-expand / K-FAC-reduce), got {approx!r}")
