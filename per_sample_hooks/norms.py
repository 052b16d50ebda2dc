"""Per-sample gradient norms and DP clipping after one ordinary backward, without materializing
per-sample gradients (each rule picks its cheapest exact path; see ``forms/ghost.py``).

    add_hooks(model)
    loss = criterion(model(x), y)          # mean over the batch
    loss.backward()
    norms = clip_grads(model, max_norm=1.0)  # p.grad <- (1/B) sum_i c_i g_i
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Container
from functools import partial

import torch
from torch import Tensor, nn

from . import forms
from .capture import HookState
from .errors import PerSampleHooksError
from .rules.base import KeptGrads, contract_samples
from .sharded import ShardedGrads, is_sharded, with_full_values
from .step import (
    LayerWork,
    LossType,
    Step,
    check_compares,
    check_unseen_uses,
    parameter_names,
    prepare_step,
    shared_forms,
    shared_parameters,
)

CLIP_EPSILON = 1e-6
"""``c_i = min(1, max_norm / (|g_i| + CLIP_EPSILON))``, as in Opacus."""

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
                         names: list[str]) -> dict[str, Tensor]:
    if not names:
        return {}
    if not layer.calls:  # the module's output did not reach the loss
        p = next(iter(layer.parameters.values()))
        zeros = torch.zeros(step.batch_size, dtype=p.dtype, device=p.device)
        return dict.fromkeys(names, zeros)
    if keep is None:
        return layer.rule.norms_squared(layer.module, layer.calls, step.scale, names)
    return layer.rule.norms_squared(layer.module, layer.calls, step.scale, names, keep=keep)


def _per_parameter_squared(model: nn.Module, step: Step, keep: KeptGrads | None = None,
                           after: Callable[[LayerWork], None] | None = None
                           ) -> dict[str, Tensor]:
    """``{qualified name: [B]}``. A parameter of several modules (tied embeddings) from the
    sum of their forms, cross terms included; the others layer by layer (``after`` called on
    each layer once its norms are taken)."""
    names = parameter_names(model, step)
    shared = shared_parameters(step)
    result = {}
    for uses in shared.values():
        layer, local = uses[0]
        p = layer.parameters[local]
        squared = forms.norms_squared(shared_forms(uses), step.batch_size) if any(
            w.calls for w, _ in uses) else torch.zeros(step.batch_size, dtype=p.dtype,
                                                      device=p.device)
        result[names[id(layer)][local]] = squared.mul_(step.scale * step.scale)
    for layer in step.layers:
        own = [n for n, p in layer.parameters.items() if id(p) not in shared]
        squared = _layer_norms_squared(layer, step, keep, own)
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
@torch.no_grad()
def compute_norms(model: nn.Module, loss_type: LossType = "mean", per_param: bool = False
                  ) -> Tensor | dict[str, Tensor]:
    """After one backward: the L2 norm of each sample's gradient, ``[B]``.

    Exactly the norms of what :func:`compute_grad1` would give (all trainable parameters of
    hooked modules together), without materializing per-sample gradients where a cheaper exact
    path exists. With ``per_param=True``: ``{parameter name: [B]}``, names as in
    ``model.named_parameters()``. Raises if a norm is not finite, naming the samples.
    """
    state, step = prepare_step(model, loss_type, "compute_norms")
    if step.batch_size == 0:
        return _empty_batch_norms(model, step, per_param)
    # on a checked step the check reads again what the norms materialized; else nothing does
    keep = _kept_grads(state, step) if check_compares(state) else None
    squared = _per_parameter_squared(model, step, keep)
    check_unseen_uses(state, step, keep)
    norms = _total(squared, step.batch_size)
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


def clipping_coefficients(norms: Tensor, max_norm: float) -> Tensor:
    """``c_i = min(1, max_norm / (norms_i + 1e-6))``."""
    return (max_norm / (norms + CLIP_EPSILON)).clamp_(max=1.0)


def check_max_norm(max_norm: object, caller: str, name: str = "max_norm") -> float:
    """``max_norm`` as a float: any real scalar (a Python int or float, a 0-dim or one-element
    real tensor, a numpy real scalar or one-element array), finite and > 0."""
    where = f"{caller}: {name}"
    if isinstance(max_norm, bool):
        raise ValueError(f"{where} must be a real number, not bool")
    if isinstance(max_norm, Tensor):
        dtype = max_norm.dtype
        kind = "b" if dtype == torch.bool else "c" if dtype.is_complex else "f"
        size = max_norm.numel()
    elif hasattr(getattr(max_norm, "dtype", None), "kind"):  # numpy (not imported here)
        kind, size = max_norm.dtype.kind, max_norm.size
    elif isinstance(max_norm, numbers.Number):  # Decimal too (a Number, not a Real)
        complex_ = isinstance(max_norm, numbers.Complex) and not isinstance(max_norm, numbers.Real)
        kind, size = "c" if complex_ else "f", None
    else:
        kind = "?"
    if kind == "b":
        raise ValueError(f"{where} must be a real number, not bool")
    if kind == "c":
        raise ValueError(f"{where} must be a real number, not complex: got {max_norm!r}")
    if kind not in "fiu":
        raise ValueError(f"{where} must be a real number (int, float or a one-element tensor), "
                         f"got {max_norm!r}")
    if size is None:
        value = float(max_norm)
    elif size != 1:
        raise ValueError(f"{where} must be one number, got {size} of them: pass a float")
    else:
        value = float(max_norm.item())
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    if value <= 0:
        raise ValueError(f"{where} must be > 0, got {value}")
    return value


def _check_coverage(model: nn.Module, step: Step, caller: str) -> None:
    """Every parameter that backward gave a gradient must be one we can clip."""
    covered = {id(p) for layer in step.layers for p in layer.parameters.values()}
    for layer in step.layers:
        for local, p in layer.parameters.items():
            # a sharded p.grad (FSDP2) holds the other ranks' gradients too: not checked
            if not layer.calls and p.grad is not None and not is_sharded(p) \
                    and bool(p.grad.any()):
                raise PerSampleHooksError(
                    f"{caller}: parameter '{local}' of '{layer.name}' has a non-zero gradient "
                    "but its module's output did not reach the loss in this step: either the "
                    "parameter is used outside its module's forward (its per-sample gradients "
                    "cannot be seen), or its .grad is left over from an earlier step (call "
                    "optimizer.zero_grad() before the forward)")
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None and id(p) not in covered:
            raise PerSampleHooksError(
                f"{caller}: parameter '{name}' received a gradient but belongs to no hooked "
                "module, so it cannot be clipped per sample. Freeze it, or give its module a "
                "rule (register_rule) before add_hooks")


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


def _fully_kept(layer: LayerWork, keep: KeptGrads) -> bool:
    return bool(layer.parameters) and all(keep.get(layer.module, n) is not None
                                          for n in layer.parameters)


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
            layer.rule.grad1(layer.module, layer.calls, 1.0, {name: buffer})
    for call in layer.calls:
        call.release()


def _grad_target(p: nn.Parameter) -> Tensor:
    g = p.grad
    if g is None or not g.is_contiguous() or g.dtype != p.dtype or g.shape != p.shape:
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


@with_full_values
@torch.no_grad()
def clip_grads(model: nn.Module, max_norm: float, loss_type: LossType = "mean", *,
               release_records: bool = False) -> Tensor:
    """After one ordinary backward, replace ``p.grad`` with the per-sample-clipped gradient.

    ``p.grad = (1/B) sum_i c_i g_i`` (``loss_type="mean"``) or ``sum_i c_i g_i`` (``"sum"``) with
    ``g_i`` sample i's gradient and ``c_i = min(1, max_norm / (|g_i| + 1e-6))``; ``|g_i|`` is
    over all trainable parameters of hooked modules. No second backward: one matmul per layer
    from the captured activations and output gradients. Returns the unclipped norms ``[B]``.
    ``max_norm``: any real number > 0 (a float, int, one-element tensor or numpy scalar).

    ``release_records=True`` (what :class:`~per_sample_hooks.dp.DPSGD` does; no other
    ``compute_*`` can read this step then): drop each layer's captured tensors as soon as its
    clipped gradient is written, so that they and the new ``p.grad`` are not all held at once;
    after a backward that computed no parameter gradient (``dp.OutputEdges``), a layer whose
    norms formed its per-sample gradients keeps them (up to the size of its records) and drops
    its records right away, its clipped sum then a contraction.
    """
    max_norm = check_max_norm(max_norm, "clip_grads")
    state, step = prepare_step(model, loss_type, "clip_grads")
    _check_coverage(model, step, "clip_grads")
    # sharded (FSDP2) parameters: each layer's sum is summed over the ranks as it is written,
    # in an order that every rank follows (an empty batch's too)
    grads = ShardedGrads((p for w in step.layers for p in w.parameters.values()),
                         step.batch_size, loss_type == "mean", _grad_target)
    shared = shared_parameters(step)
    layers = step.layers
    if release_records:  # the largest new p.grad last, when the fewest records are left
        layers = sorted(layers, key=lambda w: sum(p.numel() for p in w.parameters.values()))
    if step.batch_size == 0:  # the sum over no sample: zero gradients
        _write_zeros(layers, shared, grads)
        return _empty_batch_norms(model, step, per_param=False)
    # records released as soon as a layer's per-sample gradients are all kept; only when the
    # unseen-use check has nothing to compare (not a checked step, or the output-edge backward
    # computed no parameter gradient), since confirming a failed check re-runs the captured calls
    early = release_records and not check_compares(state)
    if release_records:
        state.release_records("clip_grads(release_records=True)")
    keep = _kept_grads(state, step, per_layer=early)
    after = partial(_release_if_kept, batch=step.batch_size, keep=keep,
                    shared=shared) if early else None
    squared = _per_parameter_squared(model, step, keep, after)
    check_unseen_uses(state, step, keep)  # contracts the kept per-sample gradients
    norms = _total(squared, step.batch_size)
    _check_finite(norms, squared, "clip_grads")
    # The captured grads of a mean loss carry 1/B: sum_b c_b * captured_b is already the mean.
    coefficients = clipping_coefficients(norms, max_norm)
    for uses in shared.values():  # before any of their modules' records are released
        layer, local = uses[0]
        target, parts = grads.target(layer.parameters[local]), shared_forms(uses)
        if parts:
            forms.weighted_sum(target, parts, coefficients)
        else:
            target.zero_()
        grads.publish([layer.parameters[local]])
    for layer in layers:
        if layer.parameters and not layer.calls:
            for p in layer.parameters.values():
                if (p.grad is not None or is_sharded(p)) and id(p) not in shared:
                    grads.target(p).zero_()
        elif _fully_kept(layer, keep):
            for name, p in layer.parameters.items():
                contract_samples(grads.target(p), keep.get(layer.module, name), coefficients)
        elif layer.parameters:
            out = {name: grads.target(p) for name, p in layer.parameters.items()
                   if id(p) not in shared}
            if out:
                layer.rule.weighted_sum(layer.module, layer.calls, coefficients, out, keep=keep)
        grads.publish(p for p in layer.parameters.values() if id(p) not in shared)
        if release_records:
            for call in layer.calls:
                call.release()
    if release_records:
        state.storage.end_step()
    return norms


__all__ = ["compute_norms", "clip_grads", "clipping_coefficients", "CLIP_EPSILON"]
