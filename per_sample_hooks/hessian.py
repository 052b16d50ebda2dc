"""Per-sample Hessians of a function with respect to its input: ``[B, d, d]``, not
``[B, d, B, d]`` (seed 004).

``torch.autograd.functional.hessian`` knows nothing about a batch: on a ``[B, d]`` input it
returns the ``[B, d, B, d]`` Hessian of the summed output, whose off-diagonal blocks are zero
when samples do not interact. :func:`batch_hessian` returns only the diagonal blocks, computed
as such with ``torch.func``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import grad, hessian, jvp, vmap


def batch_hessian(fn: Callable[[Tensor], Tensor], x: Tensor, *, batched: bool = False
                  ) -> Tensor:
    """Hessian of ``fn`` at every sample of ``x``: ``H[i] = d^2 fn(x[i]) / dx[i]^2``.

    Args:
        fn: with ``batched=False`` (default), maps ONE sample ``[*S]`` (e.g. ``[d]``) to a
            scalar; it is run under ``torch.func.vmap``, so it must be vmap-compatible (no
            ``.item()``, no data-dependent Python control flow; ``nn.Module``s are fine).
            With ``batched=True``, maps the batch ``[B, *S]`` to per-sample outputs ``[B]``
            where output ``i`` depends on ``x[i]`` only (no batch norm in training mode, no
            mean over the batch); it is called on the whole batch and need not support vmap.
        x: ``[B, *S]``; the batch dim is dim 0.

    Returns:
        ``[B, *S, *S]`` (``[B, d, d]`` for ``x [B, d]``), in ``x``'s dtype.

    Methods: ``batched=False`` is ``vmap(hessian(fn))`` (``hessian`` = forward-over-reverse,
    ``jacfwd(jacrev(fn))``). ``batched=True`` uses that sample ``i``'s gradient of
    ``sum_j fn(x)[j]`` depends on ``x[i]`` only: a forward-mode derivative of that gradient in
    the direction ``e_k`` for every sample at once gives column ``k`` of every sample's Hessian
    (``prod(S)`` Hessian-vector products of the whole batch, vmapped over ``k``). Nothing
    checks that samples do not interact: if they do, the result is wrong, not an error.
    """
    if x.dim() < 1:
        raise ValueError("batch_hessian: x needs a batch dim: [B, *sample_shape]")
    if not batched:
        return vmap(hessian(fn))(x)
    return _batched_hessian(fn, x)


def _batched_hessian(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``[B, *S, *S]``: forward-over-reverse of ``grad(sum(fn))`` along ``e_k``, all samples."""
    sample_shape = x.shape[1:]
    d = sample_shape.numel()

    def summed(inputs: Tensor) -> Tensor:
        out = fn(inputs)
        if out.shape != x.shape[:1]:
            raise ValueError(f"batch_hessian(batched=True): fn must return [B] = "
                             f"[{x.shape[0]}], got {tuple(out.shape)}")
        return out.sum()

    gradient = grad(summed)

    def column(direction: Tensor) -> Tensor:  # direction [*S] -> H[:, ..., k] as [B, *S]
        tangent = direction.expand_as(x)
        return jvp(gradient, (x,), (tangent,))[1]

    basis = torch.eye(d, dtype=x.dtype, device=x.device).reshape(d, *sample_shape)
    columns = vmap(column)(basis)  # [d, B, *S]: columns[k, i] = H_i e_k
    return columns.reshape(d, x.shape[0], d).permute(1, 2, 0).reshape(
        x.shape[0], *sample_shape, *sample_shape)


__all__ = ["batch_hessian"]
