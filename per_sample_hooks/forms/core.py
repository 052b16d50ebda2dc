"""Forms: how a layer's per-sample gradient is built, and each quantity computed once per form.

A rule describes the per-sample gradient of each of its parameters (as captured, without the
loss scale) as a list of forms, one or more per call, whose sum it is:

- :class:`Outer`: sums over positions of outer products of output gradients and inputs,
  ``g_b = {sum_t grads[b, j, t]^T acts[b, j, t]}_j`` over ``Gr`` independent groups (Linear
  with any leading dims, convolutions after unfold, attention projections); ``acts`` None is
  a bias, ``{sum_t grads[b, j, t]}_j``; ``acts`` :class:`Unfolded` are built a chunk of
  samples at a time (convolution patches);
- :class:`Rows`: rows scattered from output gradients (Embedding, EmbeddingBag): sample ``b``'s
  gradient is the sum of its entries' values placed at their rows of the table seen as
  ``[num_rows, w]``;
- :class:`Dense`: ``[B, *shape]`` per-sample tensors (normalization layers, gradients formed on
  arrival, user rules).

Per-sample gradients (:func:`write`), squared norms (:func:`norms_squared`; ghost or
materialized, chosen there) and weighted sums (:func:`weighted_sum`, DP clipping and the
unseen-use check's hooked sum) are functions of a parameter's forms. Several forms of one type
are joined (positions or entries concatenated), so norms of the sum carry the cross terms; a
mix of types is materialized once.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import ghost
from .ghost import (
    GHOST_TRUST,
    bias_norms_squared,
    choose_method,
    concat_positions,
    moment_dtype,
    sum_of_squares,
    weight_norms_squared,
    weighted_bias_sum,
    weighted_weight_sum,
)


@dataclass
class Unfolded:
    """Activations ``[B, Gr, T, d]`` too large to hold for the whole batch (convolution
    patches: ``prod(kernel)`` times the input), built a chunk of samples at a time:
    ``build(start, stop)`` gives samples ``start:stop``, ``[n, Gr, T, d]``. Every function
    here builds a chunk at once, uses it and drops it: about ``elements`` numbers to write
    per-sample gradients, at most :data:`~.ghost.CHUNK_ELEMENTS` for the reductions (as their
    other temporaries). ``project``, when given, is ``v [k, d] -> v @ acts^T``
    (``[B, Gr, k, T]``) without building them (for conv patches, a convolution of the input
    with ``v`` as kernels), for :func:`project_sum`."""
    build: Callable[[int, int], Tensor]
    features: int  # d
    elements: int
    project: Callable[[Tensor], Tensor] | None = None


@dataclass
class Outer:
    """``grads [B, Gr, T, p]``, ``acts [B, Gr, T, d]`` (None: a bias; :class:`Unfolded`: built
    a chunk of samples at a time): the gradient is ``[Gr, p, d]`` (``[Gr, p]``) flattened
    into the parameter's shape; or, with ``block`` (one group), into those rows of the
    parameter seen as ``[n0, d]`` (``[n0]``), zero elsewhere (attention's query, key and value
    blocks of one weight). A parameter's blocks are disjoint within a call."""
    grads: Tensor
    acts: Tensor | Unfolded | None = None
    block: slice | None = None
    #: ``(weights [B], like) -> sum_b weights[b] * g_b``, shaped as ``like`` (the parameter), by
    #: the layer's own kernel: a convolution's weight gradient, with no patches built
    #: (:func:`weighted_sum`). Forms derived from this one (regrouped, joined) drop it.
    weighted: Callable[[Tensor, Tensor], Tensor] | None = None

    @property
    def positions(self) -> int:
        return self.grads.shape[2]


@dataclass
class Rows:
    """Entries of per-sample table gradients on the table viewed as ``[num_rows, w]``."""
    samples: Tensor  # [N] long: the sample of each entry
    rows: Tensor  # [N] long: its row in the [num_rows, w] view
    values: Tensor  # [N, w]
    num_rows: int


@dataclass
class Dense:
    """``per_sample [B, *shape]``."""
    per_sample: Tensor


Form = Outer | Rows | Dense


def features(acts: Tensor | Unfolded) -> int:
    return acts.features if isinstance(acts, Unfolded) else acts.shape[3]


def act_chunks(form: Outer, reduce: bool = True) -> Iterator[tuple[slice, Tensor]]:
    """``(samples, acts[samples])`` covering the batch: a tensor whole, :class:`Unfolded` a
    chunk at a time (of the reductions' size, else of its own; one empty chunk of no sample)."""
    if not isinstance(form.acts, Unfolded):
        yield slice(None), form.acts
        return
    batch, groups, positions, _ = form.grads.shape
    elements = min(form.acts.elements, ghost.CHUNK_ELEMENTS) if reduce else form.acts.elements
    step = max(1, elements // (groups * positions * form.acts.features))
    for start in range(0, max(batch, 1), step):  # an empty batch: one empty chunk
        stop = min(batch, start + step)
        yield slice(start, stop), form.acts.build(start, stop)


def concat_acts(parts: Sequence[Tensor | Unfolded]) -> Tensor | Unfolded:
    """:func:`~.ghost.concat_positions` of activations, lazily when any part is built in
    chunks."""
    if not any(isinstance(a, Unfolded) for a in parts):
        return concat_positions(parts)
    builds = [a.build if isinstance(a, Unfolded) else (lambda start, stop, a=a: a[start:stop])
              for a in parts]
    return Unfolded(lambda start, stop: torch.cat([b(start, stop) for b in builds], dim=2),
                    features(parts[0]),
                    min(a.elements for a in parts if isinstance(a, Unfolded)))


def one_group(grads: Tensor, acts: Tensor | None, block: slice | None = None) -> Outer:
    """``grads [B, T, p]``, ``acts [B, T, d]`` (or None) as an :class:`Outer` of one group."""
    return Outer(grads.unsqueeze(1), None if acts is None else acts.unsqueeze(1), block)


def by_parameter(pairs: Iterable[tuple[str, Form]], names: Sequence[str]
                 ) -> dict[str, list[Form]]:
    """``(parameter name, form)`` pairs (of several calls) as ``{name: forms}`` for ``names``."""
    result: dict[str, list[Form]] = {name: [] for name in names}
    for name, form in pairs:
        result[name].append(form)
    return result


def join(forms: Sequence[Form]) -> Form | None:
    """One form for the sum of ``forms`` when they are of one kind (None otherwise)."""
    first = forms[0]
    if len(forms) == 1:
        return first
    if all(isinstance(f, Outer) for f in forms):
        if len({f.acts is None for f in forms}) == 1 and \
                len({f.grads.shape[1] for f in forms}) == 1 and \
                len({_span(f.block) for f in forms}) == 1:
            acts = None if first.acts is None else concat_acts([f.acts for f in forms])
            return Outer(concat_positions([f.grads for f in forms]), acts, first.block)
    elif all(isinstance(f, Rows) and f.num_rows == first.num_rows for f in forms):
        return Rows(torch.cat([f.samples for f in forms]), torch.cat([f.rows for f in forms]),
                    torch.cat([f.values for f in forms]), first.num_rows)
    elif all(isinstance(f, Dense) for f in forms):
        return Dense(sum(f.per_sample for f in forms[1:]) + first.per_sample)
    return None


# ----------------------------------------------------------------------- per-sample gradients

def _span(block: slice | None) -> tuple[int, int] | None:
    return None if block is None else (block.start, block.stop)


def has_blocks(forms: Sequence[Form]) -> bool:
    return any(isinstance(f, Outer) and f.block is not None for f in forms)


def write(out: Tensor, forms: Sequence[Form], scale: float) -> None:
    """``out [B, *shape]`` = ``scale`` times the per-sample gradients (fully overwritten;
    nothing zero-filled where a form writes every entry; forms of blocks add into zeros)."""
    blocks = has_blocks(forms)
    if blocks:
        out.zero_()
    for i, form in enumerate(forms):
        _write_one(out, form, scale, accumulate=blocks or i > 0)


def _write_one(out: Tensor, form: Form, scale: float, accumulate: bool) -> None:
    batch = out.shape[0]
    if isinstance(form, Dense):
        if accumulate:
            out.add_(form.per_sample.reshape(out.shape), alpha=scale)
        else:
            torch.mul(form.per_sample.reshape(out.shape), scale, out=out)
    elif isinstance(form, Rows):
        flat = out.view(batch * form.num_rows, -1)
        if not accumulate:
            flat.zero_()
        flat.index_add_(0, form.samples * form.num_rows + form.rows, form.values, alpha=scale)
    elif form.acts is None:
        groups, p = form.grads.shape[1], form.grads.shape[3]
        target = out.view(batch * groups, p) if form.block is None else \
            out.view(batch, -1)[:, form.block]
        grads = form.grads.reshape(batch * groups, form.positions, p)
        add_position_sums(target, grads, scale, accumulate)
    else:
        _, groups, positions, p = form.grads.shape
        d = features(form.acts)
        target = out.view(batch * groups, p, d) if form.block is None else \
            out.view(batch, -1, d)[:, form.block]
        grads = form.grads.reshape(batch * groups, positions, p)
        if isinstance(form.acts, Tensor):
            acts = form.acts.reshape(batch * groups, positions, d)
            add_outer_products(target, grads, acts, scale, accumulate)
            return
        for samples, acts in act_chunks(form, reduce=False):  # straight into out
            rows = slice(samples.start * groups, samples.stop * groups)
            add_outer_products(target[rows], grads[rows], acts.reshape(-1, positions, d),
                               scale, accumulate)


def add_outer_products(out: Tensor, grads: Tensor, acts: Tensor, scale: float, accumulate: bool
                       ) -> None:
    """``out[b] (+)= scale * grads[b]^T @ acts[b]`` for ``grads [B,T,p]``, ``acts [B,T,d]``.

    Written straight into ``out`` (``[B, p, d]``); nothing is zero-filled or copied. With one
    position a broadcast product beats ``bmm`` (whose inner dim would be 1) several times over;
    the scale goes on the smaller operand.
    """
    if grads.shape[1] != 1:
        torch.baddbmm(out, grads.transpose(1, 2), acts, beta=1 if accumulate else 0, alpha=scale,
                      out=out)
        return
    if accumulate:
        out.addcmul_(grads.transpose(1, 2), acts, value=scale)
    else:
        write_one_position(out, grads[:, 0], acts[:, 0], scale)


def write_one_position(out: Tensor, grads: Tensor, acts: Tensor | None, scale: float) -> None:
    """``out[b] = scale * grads[b]^T acts[b]`` for ``grads [B, p]``, ``acts [B, d]`` (one
    position), ``out = scale * grads`` for ``acts`` None (a bias): the products
    :func:`add_outer_products` and :func:`add_position_sums` make of ``[B, 1, f]`` operands,
    with fewer views (most of a small layer's time is Python and views)."""
    if acts is None:
        if scale != 1:
            torch.mul(grads, scale, out=out)
        else:
            out.copy_(grads)
        return
    column, row = grads.unsqueeze(2), acts.unsqueeze(1)  # [B, p, 1], [B, 1, d]
    if scale != 1:
        if column.shape[1] <= row.shape[2]:
            column = column * scale
        else:
            row = row * scale
    torch.mul(column, row, out=out)


def add_position_sums(out: Tensor, grads: Tensor, scale: float, accumulate: bool) -> None:
    """``out[b] (+)= scale * grads[b].sum(positions)`` for ``grads [B, T, p]``."""
    if grads.shape[1] == 1:
        summed = grads.squeeze(1)
    elif accumulate:
        summed = grads.sum(1)
    else:
        summed = torch.sum(grads, 1, out=out)
    if accumulate:
        out.add_(summed, alpha=scale)
    elif scale != 1:
        torch.mul(summed, scale, out=out)
    elif summed is not out:
        out.copy_(summed)


# ----------------------------------------------------------------------------- norms

def materializes(forms: Sequence[Form]) -> bool:
    """Whether :func:`norms_squared` of ``forms`` is best had from materialized per-sample
    gradients (which a caller may then keep for a weighted sum): an :class:`Outer` over
    several positions (a weight: the ghost norm is not always cheaper; a bias: its norms sum
    the positions anyway), :class:`Dense` (formed already: keeping it spares the weighted sum
    forming it again, e.g. a normalization layer's ``x_hat``), a mix of kinds."""
    if _disjoint_blocks(forms) is not None:
        return False
    form = join(forms)
    return form is None or isinstance(form, Dense) or (isinstance(form, Outer)
                                                       and form.positions > 1)


def _disjoint_blocks(forms: Sequence[Form]) -> list[list[Form]] | None:
    """Outer forms of several disjoint blocks, grouped by block (None otherwise): their
    squared norms add up."""
    if not has_blocks(forms) or not all(isinstance(f, Outer) and f.block is not None
                                        for f in forms):
        return None
    groups: dict[tuple[int, int], list[Form]] = {}
    for form in forms:
        groups.setdefault(_span(form.block), []).append(form)
    spans = sorted(groups)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return list(groups.values())


def _to_float32(form: Form) -> Form:
    """``form`` with its tensors (lazily built activations too) in float32."""
    if isinstance(form, Dense):
        return Dense(form.per_sample.float())
    if isinstance(form, Rows):
        return Rows(form.samples, form.rows, form.values.float(), form.num_rows)
    acts = form.acts
    if isinstance(acts, Unfolded):
        build = acts.build
        acts = Unfolded(lambda start, stop: build(start, stop).float(), acts.features,
                        acts.elements, acts.project)
    return Outer(form.grads.float(), acts.float() if isinstance(acts, Tensor) else acts,
                 form.block, form.weighted)


def widened(forms: Sequence[Form]) -> Sequence[Form]:
    """``forms`` in :func:`moment_dtype` (float32 where they are float16: norms of 0 or inf,
    second moments of NaN, of a float16 model); else as they are."""
    first = forms[0] if forms else None
    like = first.per_sample if isinstance(first, Dense) else first.values \
        if isinstance(first, Rows) else first.grads if first is not None else None
    if like is None or moment_dtype(like.dtype) == like.dtype:
        return forms
    return [_to_float32(form) for form in forms]


def norms_squared(forms: Sequence[Form], batch: int) -> Tensor:
    """``[B]``: squared norm of each sample's gradient (the sum of ``forms``, unscaled; in
    float32 for float16 forms: :func:`widened`).

    One position: ``|a|^2 |g|^2``; several: the ghost norm or a chunked materialization, by
    cost (:mod:`.ghost`); rows: the values of equal (sample, row) keys summed first; disjoint
    blocks: their norms add up; a mix of kinds (a parameter shared by an Embedding and a
    Linear, tied embeddings): the kinds' norms plus twice their inner products
    (:func:`inner_products`), else materialized once."""
    forms = widened(forms)
    blocks = _disjoint_blocks(forms)
    if blocks is not None and len(blocks) > 1:
        return sum(norms_squared(group, batch) for group in blocks)
    form = join(forms)
    if form is None:
        kinds = [join([f for f in forms if isinstance(f, kind)]) for kind in (Dense, Rows, Outer)
                 if any(isinstance(f, kind) for f in forms)]
        if all(k is not None for k in kinds) and all(
                _inner_supported(a, b) for i, a in enumerate(kinds) for b in kinds[i + 1:]):
            parts = sum(norms_squared([k], batch) for k in kinds)
            total = parts.clone()
            for i, a in enumerate(kinds):
                for b in kinds[i + 1:]:
                    total.add_(inner_products(a, b, batch), alpha=2)
            # (tied uses whose gradients cancel: the sum is mostly rounding, even negative)
            if not (total <= GHOST_TRUST * torch.finfo(total.dtype).eps * parts).any():
                return total
        first = forms[0]
        like = first.per_sample if isinstance(first, Dense) else \
            first.values if isinstance(first, Rows) else first.grads
        per_sample = like.new_empty(flat_shape(forms, batch))
        write(per_sample, forms, 1.0)
        return sum_of_squares(per_sample)
    if isinstance(form, Dense):
        return sum_of_squares(form.per_sample)
    if isinstance(form, Rows):
        keys, rows = summed_rows(form)
        squared = torch.linalg.vector_norm(rows, dim=1).square_()
        return form.values.new_zeros(batch).index_add_(0, keys // form.num_rows, squared)
    if form.acts is None:
        return bias_norms_squared(form.grads)
    if isinstance(form.acts, Tensor):
        return weight_norms_squared(form.acts, form.grads)
    method = choose_method(form.positions, form.acts.features, form.grads.shape[3])
    result = form.grads.new_empty(batch)
    # activations built in chunks of their own size (as grad1's): weight_norms_squared chunks
    # its temporaries itself, and fewer, larger products run faster (seed-001 CNN: the norms
    # 23.1 -> 21.0 ms, 6 samples per chunk of conv2's patches instead of 1)
    for samples, acts in act_chunks(form, reduce=False):
        result[samples] = weight_norms_squared(acts, form.grads[samples], method)
    return result


def _inner_supported(a: Form, b: Form) -> bool:
    """Whether :func:`inner_products` takes ``a`` (Dense or Rows) with ``b`` (Rows or Outer):
    an outer product of tensors, one group, no block; rows as wide as its features."""
    if isinstance(b, Outer) and not (isinstance(b.acts, Tensor) and b.block is None
                                     and b.grads.shape[1] == 1):
        return False
    if isinstance(a, Rows) and isinstance(b, Outer):
        return (a.num_rows, a.values.shape[1]) == (b.grads.shape[3], b.acts.shape[3])
    return True


def inner_products(a: Form, b: Form, batch: int) -> Tensor:
    """``[B]``: ``<g_b, h_b>`` of the per-sample gradients of two forms of one parameter, ``a``
    Dense or Rows and ``b`` Rows or Outer (one group of tensors), without materializing ``b``:
    rows against an outer product, ``sum_{e, t} grads[s, t, r_e] (acts[s, t] . values_e)``
    over each sample's entries ``e``, its entries side by side (:func:`entries_by_sample`) and
    a few samples at a time: one product ``acts @ values^T`` per chunk, not one per entry."""
    if isinstance(a, Dense):
        if isinstance(b, Rows):  # the dense gradient read at the entries' rows
            dense = a.per_sample.reshape(batch, b.num_rows, -1)
            products = (dense[b.samples, b.rows] * b.values).sum(1)
            return products.new_zeros(batch).index_add_(0, b.samples, products)
        dense = a.per_sample.reshape(batch, b.grads.shape[3], b.acts.shape[3])  # [B, p, d]
        return (torch.bmm(b.grads[:, 0], dense) * b.acts[:, 0]).sum((1, 2))
    grads, acts = b.grads[:, 0], b.acts[:, 0]  # [B, T, p], [B, T, d]
    values, rows = entries_by_sample(a, batch)  # [B, E, d], [B, E]
    positions, entries = acts.shape[1], rows.shape[1]
    step = max(1, ghost.CHUNK_ELEMENTS // max(1, positions * entries))
    result = []
    for start in range(0, batch, step):
        chunk = slice(start, start + step)
        along_acts = torch.bmm(acts[chunk], values[chunk].transpose(1, 2))  # [n, T, E]
        picked = grads[chunk].gather(2, rows[chunk, None].expand(-1, positions, -1))
        result.append(torch.linalg.vecdot(along_acts.flatten(1), picked.flatten(1)))
    return torch.cat(result) if result else values.new_zeros(0)


def entries_by_sample(form: Rows, batch: int) -> tuple[Tensor, Tensor]:
    """``(values [B, E, w], rows [B, E])``: each sample's entries side by side, ``E`` the most
    any sample has; the others padded with zero values at row 0."""
    counts = torch.bincount(form.samples, minlength=batch)
    order, slot = side_by_side(form.samples, counts)
    samples = form.samples[order]
    entries = int(counts.max()) if batch and len(samples) else 0
    values = form.values.new_zeros(batch, entries, form.values.shape[1])
    values[samples, slot] = form.values[order]
    rows = form.rows.new_zeros(batch, entries)
    rows[samples, slot] = form.rows[order]
    return values, rows


def side_by_side(ids: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """``(order, slot)``: entry ``order[k]`` (entries sorted by ``ids``, stably) is number
    ``slot[k]`` of its id's; ``counts[i]`` entries have id ``i``."""
    order = torch.sort(ids, stable=True).indices
    slot = torch.arange(len(ids), device=ids.device) - (counts.cumsum(0) - counts)[ids[order]]
    return order, slot


def summed_rows(form: Rows) -> tuple[Tensor, Tensor]:
    """``(keys [K], values [K, w])``: the values of equal ``sample * num_rows + row`` keys
    summed (a sample's gradient has one value per row it hits)."""
    keys = form.samples * form.num_rows + form.rows
    distinct, pair = torch.unique(keys, return_inverse=True)
    rows = form.values.new_zeros(len(distinct), form.values.shape[1])
    return distinct, rows.index_add_(0, pair, form.values)


def flat_shape(forms: Sequence[Form], batch: int) -> tuple[int, int]:
    """``(B, n)``: a flat per-sample shape that holds ``forms``' gradients."""
    form = forms[0]
    if isinstance(form, Dense):
        return (batch, form.per_sample[0].numel())
    if isinstance(form, Rows):
        return (batch, form.num_rows * form.values.shape[1])
    if has_blocks(forms):
        raise ValueError("the size of a parameter is not known from blocks of it")
    _, groups, _, p = form.grads.shape
    return (batch, groups * p * (1 if form.acts is None else features(form.acts)))


# ----------------------------------------------------------------------------- projections

def project_sum(forms: Sequence[Form], probe: tuple[Tensor, Tensor]) -> Tensor:
    """``[k]``: ``u_k^T (sum_b g_b) v_k`` for ``probe = (u [k, n0], v [k, n1])``, the
    parameter seen as ``[n0, n1]`` (its first dim by the rest), without forming the sum:
    ``sum_{b,t} (G u)(A v)`` for an outer product, ``O(B T (p + d) k)``; a bias's grads
    summed first (the unseen-use check's hooked side)."""
    u, v = probe
    total = u.new_zeros(u.shape[0])
    for form in forms:
        if isinstance(form, Dense):
            summed = form.per_sample.sum(0).reshape(u.shape[1], v.shape[1])
            total += torch.linalg.vecdot(u @ summed.to(u.dtype), v)
        elif isinstance(form, Rows):  # entry (row, j) is element row * w + j of the parameter
            values, w = form.values.to(u.dtype), form.values.shape[1]
            if w == v.shape[1]:  # rows of the parameter (Embedding): one product
                total += ((values @ v.t()) * u[:, form.rows].t()).sum(0)
                continue
            flat = (form.rows * w).unsqueeze(1) + torch.arange(w, device=form.rows.device)
            first, second = flat // v.shape[1], flat % v.shape[1]
            total += (u[:, first] * v[:, second] * values).sum((1, 2))
        else:
            _, groups, _, p = form.grads.shape
            rows = u.view(-1, groups, p) if form.block is None else \
                u[:, form.block].unsqueeze(1)
            grads = form.grads.to(u.dtype)
            if form.acts is None:  # sum_{b,t} (G u) v: the grads summed first
                total += (rows * grads.sum(2).sum(0)).sum((1, 2)) * v[:, 0]
            elif isinstance(form.acts, Tensor):
                left = torch.einsum("bjtp,kjp->kbjt", grads, rows)
                right = torch.einsum("bjtd,kd->kbjt", form.acts.to(u.dtype), v)
                total += (left * right).sum((1, 2, 3))
            else:  # [n, Gr, k, T]: positions last (contiguous in conv grads and patches)
                parts = [(slice(None), form.acts.project(v))] if form.acts.project else \
                    ((samples, v @ acts.to(u.dtype).mT) for samples, acts in act_chunks(form))
                for samples, right in parts:
                    left = rows.transpose(0, 1) @ grads[samples].mT
                    total += (left * right).sum((0, 1, 3))
    return total


def projection_cost(forms: Sequence[Form]) -> int:
    """Multiply-adds of :func:`project_sum` per probe (to weigh it against reading per-sample
    gradients already formed); :class:`Unfolded` activations count as many as they hold."""
    cost = 0
    for form in forms:
        if isinstance(form, Dense):
            cost += form.per_sample.numel()
        elif isinstance(form, Rows):
            cost += form.values.numel()
        else:
            cost += form.grads.numel() + (0 if form.acts is None else
                                          form.grads[..., 0].numel() * features(form.acts))
    return cost


# ----------------------------------------------------------------------------- weighted sums

def weighted_sum(out: Tensor, forms: Sequence[Form], weights: Tensor) -> None:
    """``out [*shape] = sum_b weights[b] * g_b`` (fully overwritten): one product per form,
    the weights folded into the smaller operand (book-keeping, Bu et al. 2023)."""
    blocks = has_blocks(forms)
    if blocks:
        out.zero_()
    for i, form in enumerate(forms):
        accumulate = blocks or i > 0
        if isinstance(form, Dense):
            flat = form.per_sample.reshape(len(weights), -1)
            target = out.view(-1)
            torch.addmv(target, flat.t(), weights.to(flat.dtype), beta=int(accumulate),
                        out=target)
        elif isinstance(form, Rows):
            weighted = form.values * weights.to(form.values.dtype)[form.samples].unsqueeze(1)
            flat = out.view(form.num_rows, -1)
            if not accumulate:
                flat.zero_()
            flat.index_add_(0, form.rows, weighted)
        elif form.acts is None:
            target = out if form.block is None else out.view(-1)[form.block]
            weighted_bias_sum(target, form.grads, weights, accumulate)
        elif form.weighted is not None and form.block is None:
            summed = form.weighted(weights, out)
            out.add_(summed) if accumulate else out.copy_(summed)
        else:
            target = out if form.block is None else out.view(-1, features(form.acts))[form.block]
            for j, (samples, acts) in enumerate(act_chunks(form)):
                weighted_weight_sum(target, acts, form.grads[samples], weights[samples],
                                    accumulate or j > 0)


def contract_samples(out: Tensor, per_sample: Tensor, weights: Tensor) -> None:
    """``out = sum_b weights[b] * per_sample[b]`` (``per_sample [B, *out.shape]``), one ``mv``."""
    flat = per_sample.reshape(len(weights), -1)
    if out.is_contiguous():
        torch.mv(flat.t(), weights.to(flat.dtype), out=out.view(-1))
    else:
        out.copy_((weights.to(flat.dtype) @ flat).view(out.shape))
