"""Per-sample gradient norms and DP clipping after one ordinary backward, without materializing
per-sample gradients (each rule picks its cheapest exact path; see ``forms/ghost.py``).

    add_hooks(model)
    loss = criterion(model(x), y)          # mean over the batch
    loss.backward()
    norms = clip_grads(model, max_grad_norm=1.0)  # p.grad <- (1/B) sum_i c_i g_i
"""
from __future__ import annotations

from collections.abc import Callable, Container
from functools import partial

import torch
from torch import Tensor, nn

from . import forms
from .capture import HookState
from .clipping import MaxGradNorm, Thresholds, check_max_norm, threshold_argument, thresholds
from .errors import PerSampleHooksError
from .forms import contract_samples
from .forms.groups import RowGrouping, RowGroups, regroup, row_groups
from .quantities import KeptGrads, norms_squared, weighted_sum
from .rules.base import written_grad1
from .sharded import RankAgreement, ShardedGrads, is_sharded, several_ranks, with_full_values
from .step import (
    LayerWork,
    LossType,
    Step,
    check_compares,
    check_unseen_uses,
    library_computation,
    parameter_names,
    prepare_step,
    refusal_ends_step,
    shared_forms,
    shared_parameters,
)

CLIP_EPSILON = 1e-6
"""``c_i = min(1, max_grad_norm / (|g_i| + CLIP_EPSILON))``, as in Opacus."""

KEEP_FRACTION = 0.25
"""``clip_grads`` keeps per-sample gradients that a rule materializes for the norms (so that the
clipped sum is a cheap contraction instead of a second product) up to this fraction of the
number of elements the hooks captured (activations and output gradients), in buffers freed
with the step's records; beyond it the clipped sum is recomputed by one matmul per layer.
Measured (1 thread, ``benchmarks.dp`` on the T=256 token model): 1.0 against 0.25 took
clipping after ``loss.backward()`` from 1.53x to 1.34x a plain step (5 interleaved rounds), but
its peak memory from 1.34x to 1.82x (1.35x to 1.88x at T=64): the kept buffers come on top of
the records."""


def _layer_norms_squared(layer: LayerWork, step: Step, keep: KeptGrads | None,
                         names: list[str], rows: RowGroups | None = None) -> dict[str, Tensor]:
    if not names:
        return {}
    if not layer.calls:  # the module's output did not reach the loss
        p = next(iter(layer.parameters.values()))
        zeros = torch.zeros(step.batch_size if rows is None else rows.count, dtype=p.dtype,
                            device=p.device)  # plain, also for a DTensor (FSDP2) parameter
        return dict.fromkeys(names, zeros)
    if rows is not None:  # each group's gradient, the mean of its rows', from the forms
        parts = layer.rule.forms(layer.module, layer.calls, names)
        return {n: _grouped_norms_squared(parts[n], rows, step, keep, (layer.module, n))
                for n in names}
    return norms_squared(layer.rule, layer.module, layer.calls, step.scale, names, keep)


def _grouped_norms_squared(parts: list[forms.Form], rows: RowGroups, step: Step,
                           keep: KeptGrads | None = None,
                           key: tuple[nn.Module, str] | None = None) -> Tensor:
    """``[count]``: squared norms of the groups' gradients (mean of their rows', scaled); where
    that materializes them, into ``keep``'s buffer for ``key`` when granted (the groups'
    gradients as captured, for the clipped sum)."""
    grouped = [regroup(f, rows) for f in parts]
    kept = keep.reserve(*key, rows.count) if keep is not None and forms.materializes(grouped) \
        else None
    if kept is None:
        squared = forms.norms_squared(grouped, rows.count)
    else:
        forms.write(kept, grouped, 1.0)
        squared = forms.sum_of_squares(kept)
    return squared.mul_(step.scale * step.scale)


def _per_parameter_squared(model: nn.Module, step: Step, keep: KeptGrads | None = None,
                           after: Callable[[LayerWork], None] | None = None,
                           rows: RowGroups | None = None) -> dict[str, Tensor]:
    """``{qualified name: [B]}`` (``[count]`` of ``rows``' groups). A parameter of several
    modules (tied embeddings) from the sum of their forms, cross terms included; the others
    layer by layer (``after`` called on each layer once its norms are taken)."""
    names = parameter_names(model, step)
    shared = shared_parameters(step)
    batch = step.batch_size if rows is None else rows.count
    result = {}
    for uses in shared.values():
        layer, local = uses[0]
        if not any(w.calls for w, _ in uses):
            p = layer.parameters[local]  # plain zeros, also for a DTensor (FSDP2) parameter
            squared = torch.zeros(batch, dtype=p.dtype, device=p.device)
        elif rows is not None:
            squared = _grouped_norms_squared(shared_forms(uses), rows, step)
        else:
            squared = forms.norms_squared(shared_forms(uses), batch).mul_(step.scale ** 2)
        result[names[id(layer)][local]] = squared
    for layer in step.layers:
        own = [n for n, p in layer.parameters.items() if id(p) not in shared]
        squared = _layer_norms_squared(layer, step, keep, own, rows)
        for local in own:
            result[names[id(layer)][local]] = squared[local]
        if after is not None:
            after(layer)
    return result


def _total(squared: dict[str, Tensor], batch_size: int) -> Tensor:
    values = list(squared.values())
    if not values:
        return torch.zeros(batch_size)
    total = values[0].clone()
    for v in values[1:]:
        total.add_(v.to(total.dtype))
    return total.sqrt_()


def _check_finite(norms: Tensor, squared: dict[str, Tensor], caller: str) -> None:
    bad = ~torch.isfinite(norms)
    if not bool(bad.any()):
        return
    samples = bad.nonzero().flatten().tolist()
    culprits = [n for n, s in squared.items() if not bool(torch.isfinite(s[bad]).all())]
    shown = ", ".join(map(str, samples[:10])) + (" ..." if len(samples) > 10 else "")
    raise PerSampleHooksError(
        f"{caller}: the gradient norm is not finite for {len(samples)} sample(s) (indices "
        f"{shown}); first parameter concerned: '{culprits[0] if culprits else '?'}'. Check "
        "those inputs and the loss (overflow, log of zero, NaN in the data)")


@with_full_values
@library_computation
def compute_norms(model: nn.Module, loss_type: LossType = "mean", per_param: bool = False, *,
                  groups: RowGrouping | None = None) -> Tensor | dict[str, Tensor]:
    """After one backward: the L2 norm of each sample's gradient, ``[B]``.

    Exactly the norms of what :func:`compute_grad1` would give (all trainable parameters of
    hooked modules together), without materializing per-sample gradients where a cheaper exact
    path exists. With ``per_param=True``: ``{parameter name: [B]}``, names as in
    ``model.named_parameters()``. Raises if a norm is not finite, naming the samples.

    ``groups``: the norms of groups of rows instead, ``[count]``, each group's gradient the
    mean of its rows', or of :class:`~per_sample_hooks.forms.groups.JointGroups` the
    gradient of its own loss (see :func:`clip_grads`).
    """
    state, step = prepare_step(model, loss_type, "compute_norms",
                               grouped=groups is not None)
    rows = None if groups is None else row_groups(groups, step.batch_size, "compute_norms",
                                                  loss_type == "mean")
    if step.batch_size == 0:
        return _empty_batch_norms(model, step, per_param)
    # on a checked step the check reads again what the norms materialized; else nothing does
    keep = _kept_grads(state, step) if check_compares(state) and rows is None else None
    squared = _per_parameter_squared(model, step, keep, rows=rows)
    check_unseen_uses(state, step, keep)
    norms = _total(squared, step.batch_size if rows is None else rows.count)
    _check_finite(norms, squared, "compute_norms")
    if per_param:
        return {n: s.sqrt() for n, s in squared.items()}
    return norms


def _empty_batch_norms(model: nn.Module, step: Step, per_param: bool
                       ) -> Tensor | dict[str, Tensor]:
    """Norms of an empty batch: ``[0]`` tensors (per parameter with ``per_param``)."""
    names = parameter_names(model, step)
    empty = {names[id(layer)][local]: torch.zeros(0, dtype=p.dtype, device=p.device)
             for layer in step.layers for local, p in layer.parameters.items()}
    if per_param:
        return empty
    return next(iter(empty.values()), torch.zeros(0))


def clipping_coefficients(norms: Tensor, max_grad_norm: float) -> Tensor:
    """``c_i = min(1, max_grad_norm / (norms_i + 1e-6))``."""
    return (max_grad_norm / (norms + CLIP_EPSILON)).clamp_(max=1.0)


def _check_coverage(step: Step, caller: str, model: nn.Module) -> None:
    """Every parameter that backward gave a gradient must be one we can clip (one of no hooked
    module: refused by ``prepare_step``)."""
    # (a parameter of several modules, BART's word embeddings: seen if one of them was called)
    reached = {id(p) for layer in step.layers if layer.calls for p in layer.parameters.values()}
    for layer in step.layers:
        for local, p in layer.parameters.items():
            # a sharded p.grad (FSDP2) holds the other ranks' gradients too: not checked
            if not layer.calls and id(p) not in reached and p.grad is not None \
                    and not is_sharded(p) and bool(p.grad.any()):
                what = (f"{caller}: parameter '{local}' of '{layer.name}' has a non-zero "
                        "gradient but its module's output did not reach the loss in this step")
                if _ddp_of_several_ranks(model):
                    raise PerSampleHooksError(
                        f"{what} on this rank: DistributedDataParallel's all-reduce ran "
                        "(find_unused_parameters or static_graph), so its .grad may be another "
                        "rank's gradient, which cannot be told from a use outside the module's "
                        "forward. Skip DDP's all-reduce, which clipping overwrites anyway: "
                        "per_sample_hooks.distributed.skip_gradient_allreduce(ddp) once, or the "
                        "forward and backward inside ddp.no_sync()")
                raise PerSampleHooksError(
                    f"{what}: either the parameter is used outside its module's forward (its "
                    "per-sample gradients cannot be seen), or its .grad is left over from an "
                    "earlier step (call optimizer.zero_grad() before the forward)")


def _ddp_of_several_ranks(model: nn.Module) -> bool:
    """Whether ``model`` is a DistributedDataParallel in a process group of several ranks."""
    return isinstance(model, nn.parallel.DistributedDataParallel) and several_ranks()


def _captured(layer: LayerWork) -> int:
    """Numbers the captured calls of ``layer`` hold (inputs and output gradients)."""
    return sum(sum(a.numel() for a in call.args if isinstance(a, Tensor))
               + sum(g.numel() for passes in call.grads for g in passes) for call in layer.calls)


def _kept_grads(state: HookState, step: Step, per_layer: bool = False) -> KeptGrads:
    """``per_layer``: each layer may keep as many numbers as its records hold (which are
    released once it has kept everything: :func:`_release_if_kept`), else ``KEEP_FRACTION``
    of all records, shared."""
    def buffer_for(module: nn.Module, name: str, param: Tensor, batch: int) -> Tensor:
        # step-scoped: a persistent one would be held through the next forward and backward,
        # on top of their peak (measured: +32 MiB, 0.16x a plain step, on the T=256 tokens)
        return state.storage.get(module, f"kept {name}", batch, param, step_only=True)
    if per_layer:
        return KeptGrads(0, buffer_for, {id(w.module): _captured(w) for w in step.layers})
    return KeptGrads(int(KEEP_FRACTION * sum(_captured(w) for w in step.layers)), buffer_for)


def _release_if_kept(layer: LayerWork, batch: int, keep: KeptGrads, shared: Container[int]
                     ) -> None:
    """When ``layer``'s norms kept its weight's per-sample gradients, keep the rest too (a
    bias's are small) and drop its records: its clipped sum is then a contraction (not for a
    layer with a parameter of several modules, whose clipped sum reads all their forms)."""
    if not layer.calls or not any(keep.get(layer.module, n) is not None
                                  for n in layer.parameters) \
            or any(id(p) in shared for p in layer.parameters.values()):
        return
    for name in layer.parameters:
        if keep.get(layer.module, name) is None:
            buffer = keep.reserve(layer.module, name, batch)
            if buffer is None:
                return
            written_grad1(layer.rule, layer.module, layer.calls, 1.0, {name: buffer})
    for call in layer.calls:
        call.release()


def _grad_target(p: nn.Parameter, captured: set[int]) -> Tensor:
    """``p.grad``, to write ``p``'s clipped sum into, or a new one when it is not a contiguous
    tensor of ``p``'s dtype and shape, or shares its memory with a captured gradient
    (``captured``: their storages' addresses) that later sums still read."""
    g = p.grad
    if g is None or not g.is_contiguous() or g.dtype != p.dtype or g.shape != p.shape or \
            g.untyped_storage().data_ptr() in captured:
        g = torch.empty_like(p, memory_format=torch.contiguous_format)
        p.grad = g
    return g


def _write_zeros(layers: list[LayerWork], shared: dict, grads: ShardedGrads) -> None:
    """The clipped sum of an empty batch, zeros, written (and published) in the order of
    :func:`clip_grads`'s: parameters of several modules first, then layer by layer."""
    for uses in shared.values():
        layer, local = uses[0]
        grads.target(layer.parameters[local]).zero_()
        grads.publish([layer.parameters[local]])
    for layer in layers:
        own = [p for p in layer.parameters.values() if id(p) not in shared]
        for p in own:
            grads.target(p).zero_()
        grads.publish(own)


def _group_coefficients(model: nn.Module, step: Step, squared: dict[str, Tensor],
                        norms: Tensor, limits: Thresholds, caller: str) -> list[Tensor]:
    """Clipping coefficients ``[B]`` of each parameter group, from the norm of each sample's
    gradient restricted to the group (``norms`` when there is one group)."""
    if limits.group_of is None:
        return [clipping_coefficients(norms, limits.values[0])]
    names = parameter_names(model, step)
    in_group: list[dict[str, Tensor]] = [{} for _ in limits.values]
    for layer in step.layers:
        for local, p in layer.parameters.items():
            if id(p) not in limits.group_of:
                raise PerSampleHooksError(
                    f"{caller}: parameter '{local}' of '{layer.name}' is in no max_grad_norm "
                    "group (made trainable after the groups were given?): give it a threshold")
            name = names[id(layer)][local]
            in_group[limits.group_of[id(p)]][name] = squared[name]
    return [clipping_coefficients(_total(part, len(norms)).to(norms), limit)
            for part, limit in zip(in_group, limits.values)]


def _sample_weights(coefficients: Tensor, rows: RowGroups | None, step: Step,
                    loss_type: LossType) -> Tensor:
    """Weights of the samples' gradients as captured in the clipped sum: the coefficients
    themselves (a mean loss's captured rows carry ``1/B``), or of groups' gradients (means of
    their rows' as captured) ``c_g scale / count`` (mean) or ``c_g`` (sum)."""
    if rows is None:
        return coefficients
    return coefficients * (step.scale / (rows.count if loss_type == "mean" else 1))


def _row_weights(coefficients: Tensor, rows: RowGroups | None, step: Step,
                 loss_type: LossType) -> Tensor:
    """Weights of the captured rows in the clipped sum: :func:`_sample_weights` of each row's
    group divided by the group's size."""
    per_group = _sample_weights(coefficients, rows, step, loss_type)
    if rows is None:
        return per_group
    return per_group[rows.ids.to(per_group.device)] * rows.weights.to(per_group)


def clip_grads(model: nn.Module, max_grad_norm: MaxGradNorm | None = None,
               loss_type: LossType = "mean", *, groups: RowGrouping | None = None,
               release_records: bool = False, max_norm: float | None = None) -> Tensor:
    """After one ordinary backward, replace ``p.grad`` with the per-sample-clipped gradient.
    (Of a DistributedDataParallel model in a process group of several ranks:
    :func:`per_sample_hooks.distributed.clip_grads`, which sums over them; here each rank's
    ``p.grad`` would be its own clipped mean and the replicas would drift apart. Refused.)

    ``p.grad = (1/B) sum_i c_i g_i`` (``loss_type="mean"``) or ``sum_i c_i g_i`` (``"sum"``) with
    ``g_i`` sample i's gradient and ``c_i = min(1, max_grad_norm / (|g_i| + 1e-6))``; ``|g_i|``
    is over all trainable parameters of hooked modules. No second backward: one matmul per
    layer from the captured activations and output gradients. Returns the unclipped norms
    ``[B]``. ``max_grad_norm``: any real number > 0 (a float, int, one-element tensor or numpy
    scalar); ``max_norm`` is its deprecated name.

    Per-group (per-layer) clipping: ``max_grad_norm`` as groups of parameters with a threshold
    each, ``{"fc1": 1.0, "fc2.weight": 0.5, ...}`` or ``[(model.conv, 1.0), (params, 0.5)]``
    (:data:`~per_sample_hooks.clipping.MaxGradNorm`): each sample's gradient restricted to
    group ``k`` is clipped to ``C_k``; every trainable parameter in exactly one group. A
    clipped sample's gradient then has norm at most ``sqrt(sum_k C_k^2)``.

    Groups of rows (augmentation multiplicity, user-level DP): ``groups`` an int ``K`` (rows
    ``gK..gK+K-1`` are group ``g``) or a ``[B]`` tensor of group ids; the "samples" clipped are
    then the groups, each group's gradient the *mean* of its rows' gradients (``d l_r / d p``),
    so a threshold keeps its meaning whatever the group size, and with equal sizes, a mean
    loss and no clipping ``p.grad`` is the gradient of the loss. Rows that make a sample's loss
    together, with no loss of their own (multiple choice, a graph's nodes under a graph-level
    loss, a bag): ``groups=JointGroups(K or ids)``, each group's gradient that of its own loss
    (:class:`~per_sample_hooks.forms.groups.JointGroups`), any sizes, either ``loss_type``.
    ``p.grad = (1/count) sum_g c_g g_g`` (mean) or ``sum_g c_g g_g`` (sum); the norms returned
    are the groups', ``[count]``, in the order of the sorted ids. Computed from the forms of
    the groups (their rows' positions side by side: the cross terms between a group's rows
    included) without per-row gradients.

    ``release_records=True`` (what :class:`~per_sample_hooks.dp.DPSGD` does; no other
    ``compute_*`` can read this step then): drop each layer's captured tensors as soon as its
    clipped gradient is written, so that they and the new ``p.grad`` are not all held at once;
    after a backward that computed no parameter gradient (``dp.OutputEdges``), a layer whose
    norms formed its per-sample gradients keeps them (up to the size of its records) and drops
    its records right away, its clipped sum then a contraction.
    """
    if _ddp_of_several_ranks(model):
        with refusal_ends_step(model):
            raise PerSampleHooksError(
                "clip_grads on a DistributedDataParallel model clips this rank's samples only, "
                "and its p.grad (DDP's all-reduced one overwritten) would differ from the other "
                "ranks': the replicas would drift apart. Use "
                "per_sample_hooks.distributed.clip_grads (one all-reduce of the clipped sums)")
    return clip_grads_of_rank(model, max_grad_norm, loss_type, groups=groups,
                              release_records=release_records, max_norm=max_norm)


@with_full_values
@library_computation
def clip_grads_of_rank(model: nn.Module, max_grad_norm: MaxGradNorm | None = None,
                       loss_type: LossType = "mean", *, groups: RowGrouping | None = None,
                       release_records: bool = False, max_norm: float | None = None) -> Tensor:
    """:func:`clip_grads` of this process's samples, whatever wraps the model
    (:mod:`per_sample_hooks.distributed` sums the ranks' after it). On an FSDP2 model a
    refusal on one rank is one on every rank (:class:`~.sharded.RankAgreement`)."""
    agreement = RankAgreement(model)
    with agreement.refusals_shared():
        return _clip_grads_of_rank(model, max_grad_norm, loss_type, groups, release_records,
                                   max_norm, agreement)


def _clip_grads_of_rank(model: nn.Module, max_grad_norm: MaxGradNorm | None,
                        loss_type: LossType, groups: RowGrouping | None, release_records: bool,
                        max_norm: float | None, agreement: RankAgreement) -> Tensor:
    # stacklevel 7: threshold_argument, this, clip_grads_of_rank, torch.no_grad's and
    # with_full_values' wrappers, clip_grads or distributed.clip_and_reduce, then the caller
    with refusal_ends_step(model):
        limits = thresholds(model, threshold_argument(max_grad_norm, max_norm, "clip_grads", 7),
                            "clip_grads")
    state, step = prepare_step(model, loss_type, "clip_grads",
                               grouped=groups is not None)
    _check_coverage(step, "clip_grads", model)
    rows = None if groups is None else row_groups(groups, step.batch_size, "clip_grads",
                                                  loss_type == "mean")
    # sharded (FSDP2) parameters: each layer's sum is summed over the ranks as it is written,
    # in an order that every rank follows (an empty batch's too), once the ranks agree that
    # none refused the step (after the last refusal)
    captured = {t.untyped_storage().data_ptr() for w in step.layers for call in w.calls
                for passes in (*call.grads, *call.watched) for t in passes}
    sharded_grads = partial(ShardedGrads, (p for w in step.layers for p in w.parameters.values()),
                            step.batch_size if rows is None else rows.count,
                            loss_type == "mean", partial(_grad_target, captured=captured),
                            agreement)
    shared = shared_parameters(step)
    layers = step.layers
    sparse = [p for w in layers for p in w.parameters.values()  # Embedding(sparse=True)'s
              if p.grad is not None and p.grad.is_sparse]
    if release_records:  # the largest new p.grad last, when the fewest records are left
        layers = sorted(layers, key=lambda w: sum(p.numel() for p in w.parameters.values()))
    if step.batch_size == 0:  # the sum over no sample: zero gradients
        _write_zeros(layers, shared, sharded_grads())
        _as_sparse(sparse)
        return _empty_batch_norms(model, step, per_param=False)
    # records released as soon as a layer's per-sample gradients are all kept; only when the
    # unseen-use check has nothing to compare (not a checked step, or the output-edge backward
    # computed no parameter gradient), since confirming a failed check re-runs the captured calls
    early = release_records and not check_compares(state) and rows is None
    if release_records:
        state.release_records("clip_grads(release_records=True)")
    keep = _kept_grads(state, step, per_layer=early)  # of the groups' gradients with rows
    after = partial(_release_if_kept, batch=step.batch_size, keep=keep,
                    shared=shared) if early else None
    squared = _per_parameter_squared(model, step, keep, after, rows)
    # contracts the kept per-sample gradients (not those of groups: it compares rows' sums)
    check_unseen_uses(state, step, keep if rows is None else None)
    norms = _total(squared, step.batch_size if rows is None else rows.count)
    _check_finite(norms, squared, "clip_grads")
    # The captured grads of a mean loss carry 1/B: sum_b c_b * captured_b is already the mean.
    coefficients = _group_coefficients(model, step, squared, norms, limits, "clip_grads")
    grads = sharded_grads()
    weights = [_row_weights(c, rows, step, loss_type) for c in coefficients]
    kept_weights = [_sample_weights(c, rows, step, loss_type) for c in coefficients]
    for uses in shared.values():  # before any of their modules' records are released
        layer, local = uses[0]
        p = layer.parameters[local]
        target, parts = grads.target(p), shared_forms(uses)
        if parts:
            forms.weighted_sum(target, parts, weights[limits.group(p)])
        else:
            target.zero_()
        grads.publish([layer.parameters[local]])
    for layer in layers:
        if layer.parameters and not layer.calls:
            for p in layer.parameters.values():
                if (p.grad is not None or is_sharded(p)) and id(p) not in shared:
                    grads.target(p).zero_()
        else:  # the kept per-sample gradients contracted, the rest from the rule
            by_group: dict[int, dict[str, Tensor]] = {}
            for name, p in layer.parameters.items():
                kept = keep.get(layer.module, name)
                if kept is not None:
                    contract_samples(grads.target(p), kept, kept_weights[limits.group(p)])
                elif id(p) not in shared:
                    by_group.setdefault(limits.group(p), {})[name] = grads.target(p)
            for k, out in by_group.items():
                weighted_sum(layer.rule, layer.module, layer.calls, weights[k], out)
        grads.publish(p for p in layer.parameters.values() if id(p) not in shared)
        if release_records:
            for call in layer.calls:
                call.release()
    if release_records:
        state.storage.end_step()
    _as_sparse(sparse)
    return norms


def _as_sparse(params: list[Tensor]) -> None:
    """Each ``p.grad`` back to the sparse layout autograd gave it (SparseAdam takes no dense
    gradient)."""
    for p in params:
        p.grad = p.grad.to_sparse(sparse_dim=1)


__all__ = ["compute_norms", "clip_grads", "clipping_coefficients", "check_max_norm",
           "CLIP_EPSILON"]
