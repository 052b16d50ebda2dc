"""Kronecker factors on the Linear form, shared by the Linear and convolution rules, and on
one-hot rows (Embedding), whose input factor is diagonal.

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

Cost: one ``addmm`` / ``baddbmm`` per product (scalings folded into ``alpha``) into a factor
whose rows start on 64-byte boundaries (:data:`ROW_ALIGN`; the factor returned is a view of
that storage, not contiguous when ``F`` is not a multiple of it); the bias coordinate is never
materialized (its row and column are the column sums); conv patches and output gradients,
transposed views, are multiplied a sample at a time rather than copied; a factor's storage is
reused at the next call for the same module once nobody holds the factor.

Measured (2 threads, ``[128, 784]`` / ``[128, 512]`` rows, and ``[64, 9216]``, the seed-001
CNN's fc1): rows of an odd length (785 = 784 + bias) make the product 1.1x (MLP) to 1.6x
(fc1: 157 against 96 ms) slower than rows padded to 16 elements; multiplying only the upper
block triangle and mirroring it, which saves up to half the work on paper, was slower than the
full product with 2 threads (the smaller products parallelize worse and the mirror's
transposed copies cost about what they save).
"""
from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from .core import Outer, Rows, act_chunks, join, widened

Approx = Literal["expand", "reduce"]
APPROXIMATIONS = ("expand", "reduce")

ROW_ALIGN = 16
"""Row stride of a factor's storage, in elements: a multiple of this (64 bytes in float32)."""


def matmul_into(out: Tensor, left: Tensor, right: Tensor, alpha: float, beta: float) -> None:
    """``out = beta * out + alpha * left @ right`` in place, 2-D (``addmm``) or batched over a
    leading group dim (``baddbmm``); ``beta = 0`` ignores what ``out`` held (even NaN)."""
    if out.dim() == 2:
        torch.addmm(out, left, right, beta=beta, alpha=alpha, out=out)
    else:
        torch.baddbmm(out, left, right, beta=beta, alpha=alpha, out=out)


def add_gram(out: Tensor, rows: Tensor, ones: float | None, alpha: float, beta: float) -> None:
    """``out = beta * out + alpha * [rows, ones]^T [rows, ones]``.

    ``rows [(Gr,) m, f]``, ``out [(Gr,) F, F]`` with ``F = f + 1`` when ``ones`` is given
    (the homogeneous coordinate of a bias: value ``ones`` on every row, never materialized:
    its row and column are the column sums, its corner ``m * ones^2``), else ``F = f``.
    """
    features = rows.shape[-1]
    matmul_into(out[..., :features, :features], rows.mT, rows, alpha, beta)
    if ones is not None:
        column, row = out[..., :features, features], out[..., features, :features]
        corner = out[..., features, features]
        sums = rows.sum(-2).mul_(alpha * ones)
        value = alpha * rows.shape[-2] * ones * ones
        if beta == 0:
            column.copy_(sums)
            row.copy_(sums)
            corner.fill_(value)
        else:
            column.add_(sums)
            row.add_(sums)
            corner.add_(value)


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
    ``F = features (+1)``: a view of storage whose rows are :data:`ROW_ALIGN`-aligned.

    With ``spare`` (the caller's storage for one module, kept across steps), the storage of the
    factor returned for ``kind`` last time is reused when nobody holds it any more: a fresh
    340 MB factor (the seed-001 CNN's fc1) costs about 150 ms of page faults, more than its
    product. A factor the caller still holds is never overwritten (a fresh one is made).
    """
    size = features + int(ones)
    shape = (*like.shape[:-2], size, size + (-size) % ROW_ALIGN)
    buffer = None if spare is None else spare.get(kind)
    if (buffer is None or buffer.shape != shape or buffer.dtype != like.dtype
            or buffer.device != like.device or not only_cached(buffer)):
        buffer = like.new_empty(shape)
        if spare is not None:
            spare[kind] = buffer
    return buffer[..., :size]


def as_grouped(factor: Tensor, rows: Tensor) -> Tensor:
    """A factor built from 2-D rows gets back its group dim of 1: ``[Gr, F, F]``."""
    return factor.unsqueeze(0) if rows.dim() == 2 else factor


def input_factor(chunks: Iterable[Sequence[Tensor]], batch: int, ones: bool, approx: Approx,
                 spare: MutableMapping[str, Tensor] | None = None) -> Tensor:
    """``A [Gr, da, da]`` from activations given a chunk of samples at a time.

    Each chunk lists one ``[n, Gr, T_c, f]`` tensor per call (the same samples); the chunks
    cover the batch of ``batch`` samples once. Positions of all calls count together. The
    ``1/(N T)`` (``1/(N T^2)``) scaling goes into the products; the bias coordinate is never
    materialized. ``spare``: see :func:`new_factor`.
    """
    acc, beta = None, 0.0
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
            add_gram(acc, rows, coordinate if ones else None, alpha, beta)
            beta = 1.0
    return as_grouped(acc, rows)


def output_factor(passes: Iterable[Sequence[Tensor]], scale: float, approx: Approx,
                  spare: MutableMapping[str, Tensor] | None = None) -> Tensor:
    """``G [Gr, dg, dg]`` from captured output gradients: one list per backward pass, one
    ``[B, Gr, T_c, p]`` tensor per call; ``scale`` goes into the products. ``spare``: see
    :func:`new_factor`."""
    acc, beta = None, 0.0
    for parts in passes:
        if approx == "expand":
            terms = [rows for g in parts for rows in sample_rows(g)]
        else:
            summed = parts[0].sum(2) if len(parts) == 1 else sum(g.sum(2) for g in parts)
            terms = [squeeze_groups(summed)]
        for rows in terms:
            if acc is None:
                acc = new_factor(rows, rows.shape[-1], False, spare, "G")
            add_gram(acc, rows, None, scale, beta)
            beta = 1.0
    return as_grouped(acc, rows)


def weight_factors(passes: Sequence[Sequence[Outer]], ones: bool, scale: float, approx: Approx,
                   spare: MutableMapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(A, G)`` of a weight whose forms are ``Outer(output gradients, layer inputs)``, one
    list of forms (one per call) per backward pass: ``A`` from the inputs (a chunk of samples
    at a time when built lazily), ``G`` from every pass's output gradients; ``ones`` appends
    the coordinate of a trainable bias. ``[(Gr,) F, F]``: the group dim only when
    ``Gr > 1``. In float32 for float16 forms (:func:`~.core.widened`)."""
    passes = [widened(forms) for forms in passes]
    first = join(passes[0])
    chunks = ([acts] for _, acts in act_chunks(first, reduce=False))
    a = input_factor(chunks, first.grads.shape[0], ones, approx, spare)
    g = output_factor([[join(forms).grads] for forms in passes], scale, approx, spare)
    return (a[0], g[0]) if first.grads.shape[1] == 1 else (a, g)


def row_factors(passes: Sequence[Sequence[Rows]], batch: int, scale: float, approx: Approx,
                spare: MutableMapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(a [R], G [w, w])`` of a table ``[R, w]`` whose forms are one-hot :class:`Rows`: one
    entry per (sample, position) whose input picks row ``rows[k]``, its value the output
    gradient there (nn.Embedding, the layer as a Linear on one-hot inputs), one list of forms
    (one per call) per backward pass. One-hot inputs make ``A = E[a a^T]`` diagonal, so ``a`` is
    its diagonal; ``kron(diag(a), G)`` approximates the curvature block of the table flattened
    row-major. With ``n`` entries in all, ``c_ir`` sample i's entries at row r and ``n_i`` its
    entries (``N T`` and ``T`` without padding, which has no entry):

    - expand: ``a_r = sum_i c_ir / n``, ``G = scale * sum_{passes, entries} v v^T``
      (the diagonal A of the Linear rule's expand, exactly);
    - reduce: ``a_r = 1/N sum_i (c_ir / n_i)^2`` (the diagonal of the reduce A, whose
      off-diagonal terms of rows met in one sample are dropped),
      ``G = scale * sum_{passes, i} (sum_{i's entries} v)(sum_{i's entries} v)^T``.

    In float32 for float16 forms (:func:`~.core.widened`).
    """
    passes = [widened(forms) for forms in passes]
    first = join(passes[0])
    values = first.values
    if approx == "expand":
        counts = torch.bincount(first.rows, minlength=first.num_rows)
        a = counts.to(values.dtype).div_(max(len(first.rows), 1))
    else:
        keys, counts = torch.unique(first.samples * first.num_rows + first.rows,
                                    return_counts=True)
        entries = torch.bincount(first.samples, minlength=batch)[keys // first.num_rows]
        shares = counts.to(values.dtype).div_(entries).square_()
        a = values.new_zeros(first.num_rows).index_add_(0, keys % first.num_rows, shares)
        a.div_(max(batch, 1))

    def rows_of(forms: Sequence[Rows]) -> Tensor:  # [n, 1, 1, w] for output_factor
        form = join(forms)
        if approx == "reduce":
            summed = form.values.new_zeros(batch, form.values.shape[1])
            return summed.index_add_(0, form.samples, form.values)[:, None, None]
        return form.values[:, None, None]
    g = output_factor([[rows_of(forms)] for forms in passes], scale, "expand", spare)
    return a, g[0]


def check_approx(approx: str, caller: str) -> None:
    if approx not in APPROXIMATIONS:
        raise ValueError(f"{caller}: approx must be one of {APPROXIMATIONS} (Eschenhagen et al. "
                         f"2023, K-FAC-expand / K-FAC-reduce), got {approx!r}")
