"""Second-order quantities as functions of forms: sums of squared per-sample gradients (the
Fisher diagonal), per-sample Gram matrices and Gauss-Newton blocks.

Each function takes the forms of one parameter in one backward pass (a rule's
:meth:`~.base.Rule.forms` of the calls of that pass, :func:`~.base.split_passes`) and adds
that pass's term, unscaled; the caller sums the passes and applies the loss scale. Paths that
form no per-sample gradient where one exists: one position ``(G^2)^T (A^2)`` and
``(A A^T) * (G G^T)``, rows with equal (sample, row) keys summed first, the ghost Gram over
position pairs; otherwise the per-sample gradients are materialized once
(:func:`per_sample_gradients`).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .core import Dense, Form, Outer, Rows, has_blocks, join, summed_rows, widened, write

GHOST_GRAM_ELEMENTS = 1 << 22
"""Largest ``(B T)^2`` position-pair Gram the ghost Gram forms; beyond it, materialize."""


def per_sample_gradients(forms: Sequence[Form], shape: Sequence[int], batch: int,
                         buffer: Tensor | None = None) -> Tensor:
    """``[B, *shape]``: the per-sample gradients of ``forms`` (into ``buffer`` when given)."""
    if buffer is None:
        first = forms[0]
        like = first.per_sample if isinstance(first, Dense) else \
            first.values if isinstance(first, Rows) else first.grads
        buffer = like.new_empty((batch, *shape))
    write(buffer, forms, 1.0)
    return buffer


def simple_outer(forms: Sequence[Form]) -> Outer | None:
    """``forms`` as one :class:`Outer` of whole tensors (no blocks, no lazy activations), or
    None."""
    form = None if has_blocks(forms) else join(forms)
    if isinstance(form, Outer) and (form.acts is None or isinstance(form.acts, Tensor)):
        return form
    return None


def add_squares(out: Tensor, forms: Sequence[Form], batch: int) -> None:
    """``out += sum_b g_b^2`` (elementwise, ``out`` of the parameter's shape; squared in
    float32 for float16 forms)."""
    forms = widened(forms)
    form = simple_outer(forms)
    if form is not None and form.acts is None:
        out.view(form.grads.shape[1], -1).add_(form.grads.sum(2).square().sum(0))
    elif form is not None and form.positions == 1:  # [J, p, B] @ [J, B, d], added in place
        out.view(form.grads.shape[1], form.grads.shape[3], -1).baddbmm_(
            form.grads[:, :, 0].square().permute(1, 2, 0).to(out.dtype),
            form.acts[:, :, 0].square().transpose(0, 1).to(out.dtype))
    elif len(forms) == 1 and isinstance(forms[0], Rows):
        keys, values = summed_rows(forms[0])
        out.view(forms[0].num_rows, -1).index_add_(0, keys % forms[0].num_rows,
                                                   values.square().to(out.dtype))
    elif len(forms) == 1 and isinstance(forms[0], Dense):
        out.add_(forms[0].per_sample.square().sum(0).view(out.shape))
    else:
        out.add_(per_sample_gradients(forms, out.shape, batch).square().sum(0))


def add_gram(total: Tensor, forms: Sequence[Form], shape: Sequence[int], batch: int) -> None:
    """``total [B, B] += <g_i, g_j>``: a bias from its summed gradients; one position
    ``(A A^T) * (G G^T)``; several, the ghost Gram over position pairs where cheaper than
    materializing (one group); in float32 for float16 forms."""
    forms = widened(forms)
    form = simple_outer(forms)
    if form is not None and form.acts is None:
        summed = form.grads.sum(2).reshape(batch, -1)
        total.addmm_(summed, summed.t())
        return
    if form is not None and form.grads.shape[1] == 1:
        grads, acts = form.grads[:, 0], form.acts[:, 0]  # [B, T, p], [B, T, d]
        positions, p, d = grads.shape[1], grads.shape[2], acts.shape[2]
        if positions == 1:
            total.add_((acts[:, 0] @ acts[:, 0].t()).mul_(grads[:, 0] @ grads[:, 0].t()))
            return
        ghost_cost = batch * positions * positions * (d + p)
        if (batch * positions) ** 2 <= GHOST_GRAM_ELEMENTS and \
                ghost_cost <= (positions + batch) * p * d:
            flat_a, flat_g = acts.reshape(-1, d), grads.reshape(-1, p)
            pairs = (flat_g @ flat_g.t()).mul_(flat_a @ flat_a.t())
            total.add_(pairs.view(batch, positions, batch, positions).sum((1, 3)))
            return
    flat = per_sample_gradients(forms, shape, batch).reshape(batch, -1)
    total.addmm_(flat, flat.t())


def add_gauss_newton(block: Tensor, forms: Sequence[Form], buffer: Tensor, alpha: float) -> None:
    """``block [n, n] += alpha * J^T J``, ``J [B, n]`` the pass's per-sample gradients, written
    into ``buffer [B, *shape]`` (reused across passes)."""
    batch = buffer.shape[0]
    flat = per_sample_gradients(forms, buffer.shape[1:], batch, buffer).reshape(batch, -1)
    block.addmm_(flat.t(), flat, alpha=alpha)
