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

Cost: only the upper block triangle of each ``rows^T rows`` is multiplied (``addmm`` /
``baddbmm`` per column block, scalings folded into ``alpha``), then mirrored; the bias
coordinate is never materialized (its row is the column sums); conv patches and output
gradients, transposed views, are multiplied a sample at a time rather than copied; a factor's
storage is reused at the next call for the same module once nobody holds the factor.
"""
from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import Literal

import torch
from torch import Tensor

Approx = Literal["expand", "reduce"]
APPROXIMATIONS = ("expand", "reduce")

MIN_BLOCK = 128
"""Smallest column block of a symmetric product (narrower products lose more to the smaller
matmuls than the skipped triangle saves)."""
MAX_BLOCKS = 4
"""Most column blocks of a symmetric product: ``(k+1)/(2k)`` of the full product's work.
Measured (1 thread, rows ``[128, f]``): f = 784: 2.3 ms against 3.6 ms for the full product,
f = 512: 0.70 ms against 1.14 ms (the mirror's transposed copies cost about a third of the
saving)."""
MIN_ROWS = 96
"""Fewest rows for which the triangle pays: the mirror's transposed copy costs about as much
per element as a product over 64 rows (measured: ``[64, 9216]``, the seed-001 CNN's fc1, gains
nothing; ``[128, 512]`` gains 40%)."""
MIRROR_TILE = 1024
"""Columns of the lower triangle copied at once by :func:`mirror_upper` (measured: smaller
tiles are slower for the 513 and 785 factors of the MLP, 0.20 against 0.16 ms at 256)."""


def block_bounds(features: int, rows: int) -> list[int]:
    """Column block bounds ``[0, s_1, ..., features]`` of a symmetric product of ``rows [m, f]``:
    one block (the full product) below ``2 * MIN_BLOCK`` features or ``MIN_ROWS`` rows, else at
    most ``MAX_BLOCKS`` blocks of at least ``MIN_BLOCK``. Only the upper block triangle is
    multiplied: ``(k+1)/(2k)`` of the work for ``k`` blocks."""
    if features < 2 * MIN_BLOCK or rows < MIN_ROWS:
        return [0, features]
    size = max(MIN_BLOCK, -(-features // MAX_BLOCKS))
    return [*range(0, features, size), features]


def matmul_into(out: Tensor, left: Tensor, right: Tensor, alpha: float, beta: float) -> None:
    """``out = beta * out + alpha * left @ right`` in place, 2-D (``addmm``) or batched over a
    leading group dim (``baddbmm``); ``beta = 0`` ignores what ``out`` held (even NaN)."""
    if out.dim() == 2:
        torch.addmm(out, left, right, beta=beta, alpha=alpha, out=out)
    else:
        torch.baddbmm(out, left, right, beta=beta, alpha=alpha, out=out)


def add_upper_gram(out: Tensor, rows: Tensor, bounds: Sequence[int], ones: float | None,
                   alpha: float, beta: float) -> None:
    """Upper block triangle of ``out = beta * out + alpha * [rows, ones]^T [rows, ones]``.

    ``rows [(Gr,) m, f]``, ``out [(Gr,) F, F]`` with ``F = f + 1`` when ``ones`` is given
    (the homogeneous coordinate of a bias: value ``ones`` on every row, never materialized:
    its column is the column sums, its corner ``m * ones^2``), else ``F = f``. Blocks below
    the diagonal of the column blocks ``bounds`` (:func:`block_bounds`, the same for every
    product into ``out``) are left as they were; :func:`mirror_upper` fills them.
    """
    features = rows.shape[-1]
    for start, stop in zip(bounds, bounds[1:]):
        matmul_into(out[..., start:stop, start:features], rows[..., start:stop].mT,
                    rows[..., start:], alpha, beta)
    if ones is not None:
        column, corner = out[..., :features, features], out[..., features, features]
        sums = rows.sum(-2).mul_(alpha * ones)
        value = alpha * rows.shape[-2] * ones * ones
        if beta == 0:
            column.copy_(sums)
            corner.fill_(value)
        else:
            column.add_(sums)
            corner.add_(value)


def mirror_upper(out: Tensor, bounds: Sequence[int]) -> Tensor:
    """Copy the upper block triangle written by :func:`add_upper_gram` (column blocks
    ``bounds``) onto the lower one: ``out [(Gr,) F, F]`` symmetric, returned."""
    size = out.shape[-1]
    for start, stop in zip(bounds, bounds[1:]):
        for column in range(stop, size, MIRROR_TILE):  # tiles: transposed copies stay cached
            end = min(size, column + MIRROR_TILE)
            out[..., column:end, start:stop].copy_(out[..., start:stop, column:end].mT)
    return out


def sample_rows(x: Tensor) -> list[Tensor]:
    """``[n, Gr, T, f]`` as matrices of rows ``[(Gr,) m, f]`` (no group dim when ``Gr = 1``)
    whose second moments add up to the whole: one ``[(Gr,) n*T, f]`` view when the layout
    allows, else one view ``[(Gr,) T, f]`` per sample (conv patches and output gradients are
    transposed views: no copy of them is made)."""
    n, groups, positions, features = x.shape
    try:
        rows = [x.transpose(0, 1).view(groups, n * positions, features)]
    except RuntimeError:
        rows = list(x.unbind(0))
    return [r[0] for r in rows] if groups == 1 else rows


def squeeze_groups(x: Tensor) -> Tensor:
    """``[n, Gr, f] -> [(Gr,) n, f]`` (no group dim when ``Gr = 1``)."""
    return x[:, 0] if x.shape[1] == 1 else x.transpose(0, 1)


def only_cached(buffer: Tensor) -> bool:
    """Whether nothing but the cache (no tensor, view or storage object elsewhere) holds
    ``buffer``'s storage; False when the count is not available."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    return count(buffer.untyped_storage()._cdata) <= 2  # the cached tensor + this query's


def new_factor(like: Tensor, features: int, ones: bool,
               spare: MutableMapping[str, Tensor] | None = None, kind: str = "") -> Tensor:
    """Uninitialized ``[(Gr,) F, F]`` for rows ``like [(Gr,) m, features]``,
    ``F = features (+1)``.

    With ``spare`` (the caller's storage for one module, kept across steps), the storage of the
    factor returned for ``kind`` last time is reused when nobody holds it any more: a fresh
    340 MB factor (the seed-001 CNN's fc1) costs about 150 ms of page faults, more than its
    product. A
    factor the caller still holds is never overwritten (a fresh one is made instead).
    """
    size = features + int(ones)
    shape = (*like.shape[:-2], size, size)
    if spare is None:
        return like.new_empty(shape)
    buffer = spare.get(kind)
    if (buffer is None or buffer.shape != shape or buffer.dtype != like.dtype
            or buffer.device != like.device or not only_cached(buffer)):
        buffer = spare[kind] = like.new_empty(shape)
    return buffer


def as_grouped(factor: Tensor, rows: Tensor) -> Tensor:
    """A factor built from 2-D rows gets back its group dim of 1: ``[Gr, F, F]``."""
    return factor.unsqueeze(0) if rows.dim() == 2 else factor


def input_factor(chunks: Iterable[Sequence[Tensor]], batch: int, ones: bool, approx: Approx,
                 spare: MutableMapping[str, Tensor] | None = None) -> Tensor:
    """``A [Gr, da, da]`` from activations given a chunk of samples at a time.

    Each chunk lists one ``[n, Gr, T_c, f]`` tensor per call (the same samples); the chunks
    cover the batch of ``batch`` samples once. Positions of all calls count together. The
    ``1/(N T)`` (``1/(N T^2)``) scaling goes into the products; only the upper block triangle
    is multiplied, then mirrored; the bias coordinate is never materialized. ``spare``: see
    :func:`new_factor`.
    """
    acc, bounds, beta = None, [], 0.0
    for parts in chunks:
        positions = sum(x.shape[2] for x in parts)
        denominator = batch * positions * (positions if approx == "reduce" else 1)
        alpha = 1.0 / max(denominator, 1)
        if approx == "expand":
            terms = [(rows, 1.0) for x in parts for rows in sample_rows(x)]
        else:
            summed = parts[0].sum(2) if len(parts) == 1 else sum(x.sum(2) for x in parts)
            terms = [(squeeze_groups(summed), float(positions))]
        for rows, coordinate in terms:
            if acc is None:
                acc = new_factor(rows, rows.shape[-1], ones, spare, "A")
                bounds = block_bounds(rows.shape[-1], rows.shape[-2])
            add_upper_gram(acc, rows, bounds, coordinate if ones else None, alpha, beta)
            beta = 1.0
    return as_grouped(mirror_upper(acc, bounds), rows)


def output_factor(passes: Iterable[Sequence[Tensor]], scale: float, approx: Approx,
                  spare: MutableMapping[str, Tensor] | None = None) -> Tensor:
    """``G [Gr, dg, dg]`` from captured output gradients: one list per backward pass, one
    ``[B, Gr, T_c, p]`` tensor per call; ``scale`` goes into the products. ``spare``: see
    :func:`new_factor`."""
    acc, bounds, beta = None, [], 0.0
    for parts in passes:
        if approx == "expand":
            terms = [rows for g in parts for rows in sample_rows(g)]
        else:
            summed = parts[0].sum(2) if len(parts) == 1 else sum(g.sum(2) for g in parts)
            terms = [squeeze_groups(summed)]
        for rows in terms:
            if acc is None:
                acc = new_factor(rows, rows.shape[-1], False, spare, "G")
                bounds = block_bounds(rows.shape[-1], rows.shape[-2])
            add_upper_gram(acc, rows, bounds, None, scale, beta)
            beta = 1.0
    return as_grouped(mirror_upper(acc, bounds), rows)


def check_approx(approx: str, caller: str) -> None:
    if approx not in APPROXIMATIONS:
        raise ValueError(f"{caller}: approx must be one of {APPROXIMATIONS} (Eschenhagen et al. "
                         f"2023, K-FAC-expand / K-FAC-reduce), got {approx!r}")
