"""Per-sample squared norms and weighted sums on the Linear form, without per-sample gradients.

Every function works on ``acts [B, G, T, d]`` and ``grads [B, G, T, p]``: ``B`` samples, ``G``
independent groups (1 for Linear; conv groups), ``T`` positions, so that a sample's weight
gradient is the block-diagonal ``{G_bg^T A_bg}_g`` (``[G, p, d]``) and its bias gradient
``{G_bg.sum(T)}_g`` (``[G, p]``). Several calls of one module are one call whose positions are
concatenated (:func:`concat_positions`): the summed contribution, cross terms included.

Squared norm of the weight gradient, per sample (cheapest exact method, chosen per layer):

- ``T == 1``: ``|a|^2 |g|^2`` (Goodfellow 2015), O(B (d + p)).
- ghost norm, ``<A A^T, G G^T>`` (Li et al. 2022), O(B T^2 (d + p)), when cheaper than
  materializing (:func:`choose_method`); the symmetric Gram matrices are formed by blocks of
  positions, only on and above the diagonal.
- otherwise materialize ``G_b^T A_b`` for a chunk of samples at a time into one reused
  temporary, reduce, move on (mixed ghost clipping, Bu et al. 2022).

Weighted sums ``sum_b w_b grad_b`` (DP clipping) are one matmul with the weights folded into
the smaller operand (book-keeping, Bu et al. 2023).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Method = Literal["outer", "ghost", "materialize"]

CHUNK_ELEMENTS = 1 << 18
"""Largest temporary (in elements) the ghost / materialize paths allocate at once: the batch is
processed in chunks of samples that fit, so the temporary stays cache-sized and is reused."""


def concat_positions(parts: Sequence[Tensor]) -> Tensor:
    """``[B, G, T_k, f]`` per call -> ``[B, G, sum T_k, f]`` (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=2)


GHOST_BLOCK = 64
"""Positions per block of the ghost norm's Gram matrices: by symmetry only the blocks on and
above the diagonal are formed, ``(k + 1) / (2 k)`` of the work for ``k`` blocks, a row of
blocks per product (T=256, d=256, p=1024: 13% faster than one product per block)."""


def position_blocks(positions: int) -> list[tuple[int, int]]:
    """``[(start, stop)]``: ``positions`` split into about equal blocks of ``GHOST_BLOCK``."""
    k = max(1, math.ceil(positions / GHOST_BLOCK))
    bounds = [round(i * positions / k) for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def choose_method(positions: int, d: int, p: int) -> Method:
    """The cheapest exact norm method for a weight with ``positions`` positions (all calls).

    Per sample, the ghost norm costs ``T^2 (d + p) (k + 1) / (2 k)`` multiply-adds (``k``
    blocks of positions, see :data:`GHOST_BLOCK`) and materializing ``T d p``. Both keep their
    temporaries to about ``CHUNK_ELEMENTS`` by working a chunk of samples at a time, so memory
    does not decide (the usual ``2 T^2 < p d`` rule compares unchunked temporaries).
    """
    if positions == 1:
        return "outer"
    k = len(position_blocks(positions))
    if positions * (d + p) * (k + 1) < 2 * k * d * p:
        return "ghost"
    return "materialize"


def chunk_ranges(batch: int, per_sample: int) -> list[tuple[int, int]]:
    step = max(1, min(batch, CHUNK_ELEMENTS // max(per_sample, 1)))
    return [(start, min(start + step, batch)) for start in range(0, batch, step)]


def moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of second moments (squares, norms, curvature) of ``dtype`` values: float32 for
    float16, whose range (6e-8 to 65504) squares leave, and for bfloat16, whose 8 bits of
    precision the ghost norm's sums of products of either sign lose (20-130% off where a
    sample's positions cancel by 30-100x); else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _norm_dtype(t: Tensor) -> torch.dtype | None:
    """:func:`moment_dtype` where it is not ``t``'s own (None: ``t``'s)."""
    dtype = moment_dtype(t.dtype)
    return None if dtype == t.dtype else dtype


def sum_of_squares(t: Tensor) -> Tensor:
    """``[B, ...] -> [B]``."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1,
                                    dtype=_norm_dtype(t)).square_()


def _sum_of_squares_last(t: Tensor) -> Tensor:
    """``[..., f] -> [...]``."""
    return torch.linalg.vector_norm(t, dim=-1, dtype=_norm_dtype(t)).square_()


def weight_norms_squared(acts: Tensor, grads: Tensor, method: Method | None = None) -> Tensor:
    """``[B]``: squared Frobenius norm of each sample's weight gradient (unscaled)."""
    batch, groups, positions, d = acts.shape
    p = grads.shape[-1]
    method = method or choose_method(positions, d, p)
    if method == "outer":
        return (_sum_of_squares_last(acts[:, :, 0]) * _sum_of_squares_last(grads[:, :, 0])).sum(1)
    result = acts.new_empty(batch)
    flat_a = acts.reshape(batch * groups, positions, d)
    flat_g = grads.reshape(batch * groups, positions, p)
    if method == "ghost":
        blocks = position_blocks(positions)
        size = max(stop - start for start, stop in blocks)
        buffers = None
        for start, stop in chunk_ranges(batch, 2 * groups * size * positions):
            rows = slice(start * groups, stop * groups)
            n = (stop - start) * groups
            if buffers is None:
                buffers = (acts.new_empty(n * size * positions),
                           acts.new_empty(n * size * positions))
            total = acts.new_zeros(stop - start)
            for a0, a1 in blocks:
                # one row of Gram blocks, the diagonal one and those right of it (which count
                # twice) in one product: larger products run faster than one per block (the
                # temporaries of one sample, 2 * GHOST_BLOCK * T numbers, exceed CHUNK_ELEMENTS
                # beyond T = 2048, still fewer than its captured inputs where d >= 128)
                shape = (n, a1 - a0, positions - a0)
                gram_a = buffers[0][:math.prod(shape)].view(shape)
                gram_g = buffers[1][:math.prod(shape)].view(shape)
                torch.bmm(flat_a[rows, a0:a1], flat_a[rows, a0:].transpose(1, 2), out=gram_a)
                torch.bmm(flat_g[rows, a0:a1], flat_g[rows, a0:].transpose(1, 2), out=gram_g)
                products = gram_a.mul_(gram_g).view(stop - start, groups, *shape[1:])
                total.add_(products[..., :a1 - a0].sum((1, 2, 3)))
                if a1 < positions:
                    total.add_(products[..., a1 - a0:].sum((1, 2, 3)), alpha=2)
            result[start:stop] = total
        _materialize_cancelled(result, acts, grads)
        return result
    if method != "materialize":
        raise ValueError(f"unknown norm method {method!r}")
    buffer = None
    for start, stop in chunk_ranges(batch, groups * p * d):
        rows = slice(start * groups, stop * groups)
        n = (stop - start) * groups
        if buffer is None:
            buffer = acts.new_empty(n, p, d)
        per_sample = buffer[:n]
        torch.bmm(flat_g[rows].transpose(1, 2), flat_a[rows], out=per_sample)
        result[start:stop] = sum_of_squares(per_sample.view(stop - start, -1))
    return result


GHOST_TRUST = 100.0
"""A ghost norm is recomputed where it is below ``GHOST_TRUST * eps * sqrt(d + p)`` times the
sum of its diagonal terms (:func:`_materialize_cancelled`)."""


def _materialize_cancelled(result: Tensor, acts: Tensor, grads: Tensor) -> None:
    """Recompute, materialized in float64, the ghost norms ``result`` of the samples whose
    positions' terms cancel. The ghost norm ``sum_{t,s} (g_t.g_s)(a_t.a_s)`` adds ``T^2`` terms
    of either sign, each Gram entry rounded by about ``eps sqrt(d)`` of ``|a_t||a_s|``: its
    error is of the order of ``eps sqrt(d + p)`` times the diagonal ``D = sum_t |a_t|^2
    |g_t|^2``, which is the norm of a sample whose positions' terms are unrelated (then
    exact to ``eps``). A sample whose per-position gradients cancel (a model near its minimum,
    repeated tokens with opposite gradients) has a norm far below ``D``: the ghost value is
    then mostly rounding, even negative (a NaN norm, or a clipping that leaves the sample above
    ``max_grad_norm``), so below ``GHOST_TRUST`` times that error it is replaced by the norm of
    ``G_b^T A_b`` in float64 (few samples: the bound rarely holds for ordinary data)."""
    batch, groups, positions, d = acts.shape
    p = grads.shape[-1]
    diagonal = (_sum_of_squares_last(acts) * _sum_of_squares_last(grads)).sum((1, 2))
    trusted = GHOST_TRUST * torch.finfo(acts.dtype).eps * math.sqrt(d + p) * diagonal
    suspect = (result <= trusted.to(result.dtype)).nonzero().flatten()
    if len(suspect) == 0:
        return
    for start, stop in chunk_ranges(len(suspect), groups * p * d):
        samples = suspect[start:stop]
        product = torch.einsum("bgtp,bgtd->bgpd", grads[samples].double(),
                               acts[samples].double())
        result[samples] = product.square().sum((1, 2, 3)).to(result.dtype)


def bias_norms_squared(grads: Tensor) -> Tensor:
    """``[B]``: squared norm of each sample's bias gradient ``grads.sum(T)`` (unscaled)."""
    summed = grads[:, :, 0] if grads.shape[2] == 1 else grads.sum(2)
    return sum_of_squares(summed)


def weighted_weight_sum(out: Tensor, acts: Tensor, grads: Tensor, weights: Tensor,
                        accumulate: bool = False) -> None:
    """``out (+)= sum_b weights[b] G_b^T A_b``, ``out`` viewed as ``[G, p, d]``: one matmul
    (per group), the weights folded into the smaller of ``acts`` and ``grads``."""
    batch, groups, positions, d = acts.shape
    p = grads.shape[-1]
    w = weights.to(acts.dtype).view(-1, 1, 1, 1)
    if p <= d:
        grads = grads * w
    else:
        acts = acts * w
    target = out.view(groups, p, d)
    if groups == 1:
        torch.addmm(target[0], grads.reshape(-1, p).t(), acts.reshape(-1, d),
                    beta=1 if accumulate else 0, out=target[0])
        return
    summed = torch.einsum("bgtp,bgtd->gpd", grads, acts)
    if accumulate:
        target.add_(summed)
    else:
        target.copy_(summed)


def weighted_bias_sum(out: Tensor, grads: Tensor, weights: Tensor,
                      accumulate: bool = False) -> None:
    """``out (+)= sum_b weights[b] grads[b].sum(T)``, ``out`` viewed as ``[G * p]``."""
    batch = grads.shape[0]
    summed = grads[:, :, 0] if grads.shape[2] == 1 else grads.sum(2)
    target = out.view(-1)
    torch.addmv(target, summed.reshape(batch, -1).t(), weights.to(grads.dtype),
                beta=1 if accumulate else 0, out=target)
