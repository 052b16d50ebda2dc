"""Groups of rows: the batch's rows (samples as the hooks see them) gathered into groups whose
gradient is the *mean* of their rows' gradients (augmentation multiplicity: the K augmented
copies of one example; user-level DP: all rows of one user), or, for :class:`JointGroups`, the
gradient of the group's own loss, which its rows make together (multiple choice: a sample's C
choices; a graph's nodes; a bag's instances).

A group's gradient is again a form, built without per-row gradients: an :class:`~.core.Outer`
of a group is the Outer of its rows with their positions concatenated (``sum_r G_r^T A_r`` is
one product over all the rows' positions), :class:`~.core.Rows` entries move to their row's
group, :class:`~.core.Dense` per-row tensors are summed. Norms of the regrouped forms therefore
carry every cross term between a group's rows.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from .core import Dense, Form, Outer, Rows, Unfolded, features, side_by_side


@dataclass(frozen=True)
class JointGroups:
    """``groups=JointGroups(K or ids)``: groups of rows (as ``groups=K`` or ``groups=ids``)
    that make one sample's loss together, each row no loss of its own: a multiple-choice
    model's ``[B, C, T] -> [B * C, T]`` choices scored jointly, a graph's nodes under a
    graph-level loss, a bag's instances. Each group's gradient is the gradient of its own loss
    ``l_g``, the batch's loss being ``(1/count) sum_g l_g`` (``loss_type="mean"``) or
    ``sum_g l_g`` (``"sum"``), whatever the groups' sizes: its rows' contributions summed.
    (Plain ``groups=``: each row has a loss of its own, a group's gradient is the mean of its
    rows'; the two agree for a mean loss over groups of one size.)

    ``count``: the number of groups where some have no rows (a batch of graphs holding an
    empty graph, whose id never appears in torch_geometric's ``batch``): ``groups`` are then
    ids ``0..count-1``, the mean loss is over all ``count``, and results have one entry per
    id (an empty group's zero)."""
    groups: Tensor | int
    count: int | None = None


RowGrouping = Tensor | int | JointGroups
"""What ``groups=`` takes: ``K``, ``[B]`` ids, or either as :class:`JointGroups`."""


@dataclass(frozen=True)
class RowGroups:
    """On the CPU (moved where a form needs them): ``ids [B]``: each row's group in
    ``0..count-1``; ``index [count, K]``: the rows of each group (``K`` the largest group),
    padded with ``B`` (a zero row); ``weights [B]``: each row's weight in its group's gradient
    as captured: ``1 / size`` of its group (the mean of its rows'), or for
    :class:`JointGroups` ``count / B`` (mean loss: the captured rows carry ``1 / B``, a
    group's loss ``1 / count``) or 1 (sum); ``contiguous``: group ``g`` is rows
    ``gK..gK+K-1``."""
    ids: Tensor
    index: Tensor
    weights: Tensor
    contiguous: bool

    @property
    def count(self) -> int:
        return self.index.shape[0]

    @property
    def rows(self) -> int:
        return self.ids.shape[0]


def row_groups(groups: RowGrouping, batch: int, caller: str,
               mean: bool = True) -> RowGroups:
    """:class:`RowGroups` from ``groups``: an int ``K`` (rows ``gK..gK+K-1`` form group ``g``, a
    ``[B // K, K]`` layout of the batch) or a ``[B]`` integer tensor of group ids (any values;
    groups numbered by sorted id), or either as a :class:`JointGroups` (``mean``: the loss is
    a mean)."""
    if isinstance(groups, JointGroups):
        rows = row_groups(groups.groups, batch, caller) if groups.count is None else \
            _numbered_groups(groups.groups, groups.count, batch, caller)
        share = rows.count / batch if mean and batch else 1.0
        return RowGroups(rows.ids, rows.index, torch.full_like(rows.weights, share),
                         rows.contiguous)
    scalar = groups.item() if isinstance(groups, Tensor) and groups.dim() == 0 else groups
    if isinstance(scalar, numbers.Integral) and not isinstance(scalar, bool):
        groups = int(scalar)  # (a numpy integer, a 0-dim integer tensor)
    if isinstance(groups, bool) or not isinstance(groups, (int, Tensor)):
        raise TypeError(f"{caller}: groups must be an int K (groups of K consecutive rows), a "
                        "[batch] tensor of integer group ids, or either as JointGroups(...), "
                        f"got {type(groups).__name__}")
    if isinstance(groups, int):
        if groups < 1 or batch % groups:
            raise ValueError(f"{caller}: groups={groups} consecutive rows must divide the batch "
                             f"of {batch} rows")
        rows = torch.arange(batch, device="cpu")
        weights = torch.full((batch,), 1.0 / groups, dtype=torch.float64, device="cpu")
        return RowGroups(rows // groups, rows.view(-1, groups), weights, True)
    _check_ids(groups, batch, caller)
    _, ids, sizes = torch.unique(groups.cpu(), return_inverse=True, return_counts=True)
    return _grouped_by_ids(ids, sizes)


def _check_ids(groups: Tensor, batch: int, caller: str) -> None:
    if groups.dim() != 1 or groups.shape[0] != batch or groups.is_floating_point() \
            or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"{caller}: groups must be a 1-D integer tensor with one group id per "
                         f"row ({batch} rows), got dtype {groups.dtype}, shape "
                         f"{tuple(groups.shape)}")


def _numbered_groups(groups: Tensor | int, count: int, batch: int, caller: str) -> RowGroups:
    """The groups of ``JointGroups(ids, count)``: ``count`` groups numbered by the ids
    ``0..count-1``, some possibly without rows."""
    if not isinstance(groups, Tensor) or isinstance(count, bool) or \
            not isinstance(count, numbers.Integral) or count < 1:
        raise TypeError(f"{caller}: JointGroups(ids, count) takes a [batch] tensor of ids "
                        f"0..count-1 and a positive int count, got {type(groups).__name__} "
                        f"and {count!r}")
    _check_ids(groups, batch, caller)
    ids = groups.cpu().long()
    if batch and not 0 <= int(ids.min()) <= int(ids.max()) < count:
        raise ValueError(f"{caller}: JointGroups(ids, count={count}) needs ids in 0..{count - 1}"
                         f", got ids from {int(ids.min())} to {int(ids.max())}")
    return _grouped_by_ids(ids, torch.bincount(ids, minlength=int(count)))


def _grouped_by_ids(ids: Tensor, sizes: Tensor) -> RowGroups:
    """``ids [B]`` in ``0..len(sizes)-1``, ``sizes[g]`` rows in group ``g``."""
    batch = len(ids)
    order, position = side_by_side(ids, sizes)
    index = torch.full((len(sizes), int(sizes.max()) if batch else 0), batch, dtype=torch.long,
                       device="cpu")
    index[ids[order], position] = order
    contiguous = bool((sizes == sizes[0]).all()) and torch.equal(
        index.flatten(), torch.arange(batch, device="cpu")) if batch else True
    return RowGroups(ids, index, 1.0 / sizes[ids].double(), contiguous)


def _gather(t: Tensor, groups: RowGroups, count: int | None = None) -> Tensor:
    """``[B, Gr, T, f]`` -> ``[count, Gr, K * T, f]``: each group's rows' positions side by
    side (padding rows zero); of ``count`` consecutive groups' rows when contiguous."""
    rows, gr, positions, f = t.shape
    count = groups.count if count is None else count
    if groups.contiguous:
        stacked = t.reshape(count, -1, gr, positions, f)
    else:
        stacked = torch.cat([t, t.new_zeros(1, gr, positions, f)])[groups.index.to(t.device)]
    return stacked.transpose(1, 2).reshape(count, gr, -1, f)


def _gathered_build(acts: Unfolded, groups: RowGroups) -> Unfolded:
    """Lazily built activations of groups ``start:stop``: their rows' patches built at once
    (rows ``lo:hi`` spanning them), gathered."""
    def build(start: int, stop: int) -> Tensor:
        if groups.contiguous:  # a view of the rows' patches (for one conv group)
            return _gather(acts.build(start * groups.index.shape[1],
                                      stop * groups.index.shape[1]), groups, stop - start)
        index = groups.index[start:stop]
        valid = index < groups.rows
        lo, hi = (int(index[valid].min()), int(index[valid].max()) + 1) if valid.any() \
            else (0, 0)  # groups without rows
        chunk = acts.build(lo, hi)
        local = torch.where(valid, index - lo, hi - lo).to(chunk.device)
        padded = torch.cat([chunk, chunk.new_zeros(1, *chunk.shape[1:])])[local]
        return padded.transpose(1, 2).reshape(stop - start, chunk.shape[1], -1, chunk.shape[3])
    return Unfolded(build, features(acts), acts.elements)


def regroup(form: Form, groups: RowGroups) -> Form:
    """The form of each group's gradient, its rows' weighted by ``groups.weights`` (``count``
    samples)."""
    if isinstance(form, Dense):
        weights = groups.weights.to(form.per_sample)
        rows = form.per_sample * weights.view(-1, *[1] * (form.per_sample.dim() - 1))
        summed = rows.new_zeros(groups.count, *rows.shape[1:])
        return Dense(summed.index_add_(0, groups.ids.to(rows.device), rows))
    if isinstance(form, Rows):
        ids, weights = groups.ids.to(form.samples.device), groups.weights.to(form.values)
        return Rows(ids[form.samples], form.rows, form.values * weights[form.samples, None],
                    form.num_rows)
    weights = groups.weights.to(form.grads)
    grads = _gather(form.grads * weights.view(-1, 1, 1, 1), groups)
    if form.acts is None:
        return Outer(grads, None, form.block)
    acts = _gathered_build(form.acts, groups) if isinstance(form.acts, Unfolded) else \
        _gather(form.acts, groups)
    return Outer(grads, acts, form.block)


__all__ = ["JointGroups", "RowGrouping", "RowGroups", "row_groups", "regroup"]
