"""Curvature from the hooks: Gauss-Newton blocks, Kronecker factors (KFAC), gradient second
moments (empirical Fisher diagonal, per-parameter variance, per-sample Gram matrix).

Two ways to fill the hooks, then one ``compute_*`` call::

    add_hooks(model)
    output = model(x)
    backprop_hess(output, "CrossEntropy")   # GGN / Fisher: one backward pass per class
    compute_hess(model)                     # p.hess: exact GGN block of the mean loss
    factors = compute_kfac(model)           # {module: (A, G)}: kron(G, A) ~ GGN block

    loss = F.cross_entropy(model(x), y); loss.backward()  # an ordinary backward instead:
    factors = compute_kfac(model)           # empirical-Fisher factors

Notation: ``N`` samples, mean loss ``L = 1/N sum_i l_i`` (``loss_type="mean"``) or sum
(``"sum"``: drop the ``1/N`` of the seeds, of ``p.hess`` and of ``G`` below, which are then
``N`` times the mean's; ``A`` is an average of the layer's inputs whatever the reduction and
keeps its ``1/N``, as in curvlinops), ``y_i`` the network output of sample i,
``H_i = d^2 l_i / dy_i^2 = S_i S_i^T``. ``backprop_hess`` runs one backward pass per column
``k`` of ``S_i`` (the same ``k`` for every sample: batched, no loop over samples) seeded with
``S_i[:, k] / N``, the factor an ordinary backward of the mean loss puts on each sample's
output gradient. At a layer, ``x_ikt`` is the gradient w.r.t. its output at position ``t`` in
pass ``k`` in the units of ``grad1`` (the captured gradient times ``N``); an ordinary backward
is one pass with ``x_i = dl_i/dz``. ``a_it`` is the layer's input (conv: the patch) at
position ``t``, with a constant 1 appended when the layer has a trainable bias.

- ``compute_hess``: ``p.hess = 1/N sum_{i,k} J_ik J_ik^T`` with ``J_ik`` sample i's gradient
  of ``p`` in pass ``k`` (flattened row-major, positions summed inside the sample). After
  ``backprop_hess`` this is the exact GGN block of ``L`` for ``p`` (= the Hessian block for
  networks piecewise linear in ``p``, e.g. ReLU nets); after an ordinary backward the
  empirical Fisher block. Weight and bias are separate blocks.
- ``compute_kfac`` (Eschenhagen et al. 2023, "Kronecker-factored approximate curvature for
  modern neural network architectures"), ``T`` positions (Linear leading dims; conv output
  positions; several calls of a module add their positions):

  - ``"expand"``: ``A = 1/(N T) sum_{i,t} a_it a_it^T``,
    ``G = 1/N sum_{i,k,t} x_ikt x_ikt^T`` (positions as extra samples);
  - ``"reduce"``: ``A = 1/(N T^2) sum_i (sum_t a_it)(sum_t a_it)^T``,
    ``G = 1/N sum_{i,k} (sum_t x_ikt)(sum_t x_ikt)^T`` (positions summed first).

  ``kron(G, A)`` approximates the curvature block of ``L`` for ``vec(W)`` (row-major), ``W``
  the weight as a matrix ``[dg, da]``: Linear ``[out, in]`` (transformers' ``Conv1D``, whose
  weight is stored ``[in, out]``: its transpose), conv
  ``[C_out, C_in/groups * prod(kernel)]``, with the trainable bias as its last column
  (``da = in + 1``). Grouped conv: ``A [groups, da, da]``, ``G [groups, dg/groups, dg/groups]``
  (``W`` viewed as ``[groups, dg/groups, da]``, block diagonal). With ``T = 1`` both agree,
  and for a deep linear network, MSE, one sample, ``kron(G, A)`` is exact. Storage: a
  factor's rows start on 64-byte boundaries (a 785-wide factor has row stride 800, so it is
  not ``is_contiguous()``; call ``.contiguous()`` before ``.view``); it is symmetric up to the
  rounding of one matrix product; it is reused at the next ``compute_kfac`` once you no
  longer hold it (clone what you keep).

  Layers without that structure, by default (:class:`KFACFactors` tells them apart):

  - ``nn.Embedding`` ``[V, d]``, a Linear on one-hot inputs: ``A`` is diagonal, returned as
    its diagonal ``a [V]`` (``expand``: the share of the step's tokens that hit each row,
    ``a_v = count_v / (N T)``; ``reduce``: the diagonal of the reduce ``A``), ``G [d, d]`` the
    output-gradient second moment as above; ``kron(diag(a), G)`` approximates the block of the
    weight flattened row-major (the diagonal input factor of TensorFlow K-FAC's
    ``EmbeddingKFACFB`` and kfac-pytorch's ``EmbeddingLayer``). Padding tokens have no
    gradient and count in neither factor (``N T``: the tokens that are not padding).
  - every other layer (normalization, EmbeddingBag, attention, recurrent, the torch.func
    fallback) and the trainable bias of a layer whose weight is frozen: the curvature
    diagonal of each parameter, ``diag(p.hess)`` of :func:`compute_hess` (``scale/N^2`` times
    :func:`compute_fisher_diag`: ``1/N sum_i J_i^2`` for a mean loss), from the forms without
    forming the block.

  A parameter shared by several modules (tied input and output embeddings) gets each
  module's factors for that module's use of it, as if the uses were separate parameters: the
  cross terms between the uses are in none of them.
- ``compute_fisher_diag``: ``sum_i sum_k J_ik^2`` per parameter (``N`` times the diagonal of
  the (empirical) Fisher / GGN of the mean loss); ``compute_grad_variance``: the population
  variance ``1/N sum_i (g_i - mean g)^2`` of the per-sample gradients;
  ``compute_gram``: ``K_ij = sum_k <J_ik, J_jk>`` over all parameters, ``[N, N]``.

Conventions of other libraries (mean loss; ``x`` from their loss's square-root backprop;
checked against BackPACK 1.7.1 and asdfghjkl 0.1a5 in ``docs/conventions.rst``):

==================  ==================================  ======================================
library             Linear, 2-D input (T = 1)           Conv, T output positions
==================  ==================================  ======================================
per_sample_hooks    ``A = 1/N sum a a^T``,              expand: ``A = 1/(NT) sum_{i,t} a a^T``,
                    ``G = 1/N sum x x^T``; bias: last   ``G = 1/N sum_{i,k,t} x x^T``; reduce:
                    column of ``W`` (ones in ``a``)     see above; groups: one pair per group
BackPACK KFAC,      ``A``, ``G`` as ours (``A`` of the  ``A = 1/N sum_{i,t} a a^T`` (no
KFLR (extend())     weight only); bias: its own         ``1/T``), ``G`` as our reduce: kron is
                    factor ``[G]``. ``MSELoss``         ``T`` times our reduce when ``a`` is
                    (mean): ``2/o`` times ours (it      constant over ``t``; groups > 1 and
                    also averages over outputs)         Linear ``[B, T, d]``: not supported
ASDL (asdfghjkl     ``A = 1/N sum a a^T`` of the        ``A = 1/(NT) sum_{i,t} a a^T``,
0.1a5) KFAC         weight only (no ones), ``G`` as     ``G = 1/N sum_{i,t} x x^T``: our expand
                    ours; bias: ``G`` alone             (weight part of ``A``)
curvlinops KFAC     as ours with                        expand and reduce as ours (``A``:
(KFACLinear-        ``separate_weight_and_bias=False``  ``1/(NT)`` and mean of patches); its
Operator)           (ones appended); by default the     ``A`` keeps ``1/N`` for a sum loss too
                    bias is its own block ``[G]``
==================  ==================================  ======================================

A loss of ``T`` terms per sample (a sequence's tokens, averaged): curvlinops' ``TYPE2``
(``num_per_example_loss_terms=T``) is the GGN that ``backprop_hess(..., n_samples=m,
weights=1/T)`` estimates; the empirical-Fisher ``G`` here, of per-sample gradients, is ``1/T``
of curvlinops' ``EMPIRICAL``, which takes each token's gradient as a sample's.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .capture import (
    NON_REENTRANT,
    Call,
    HookState,
    live_states,
    refused_by_reentrant_checkpointing,
)
from .edges import OutputEdges
from .errors import PerSampleHooksError, UnsupportedModuleError
from .forms import Form, Outer, moment_dtype
from .forms.core import weighted_sum as forms_weighted_sum
from .forms.kronecker import Approx, check_approx, row_factors, weight_factors
from .forms.second_order import add_gauss_newton, add_gram, add_squares, per_sample_gradients
from .rules.base import Rule
from .rules.formed import FormedRule
from .sharded import several_ranks, with_full_values
from .step import (
    LayerWork,
    LossType,
    Step,
    check_unseen_uses,
    library_computation,
    parameter_names,
    prepare_step,
    refusal_ends_step,
    shared_parameters,
)

HessType = Literal["LeastSquares", "CrossEntropy"]
HESS_TYPES = ("LeastSquares", "CrossEntropy")
Unsupported = Literal["raise", "skip"]
KFACUnsupported = Literal["diagonal", "skip", "raise"]


# ----------------------------------------------------------------------------- backprop_hess

def hessian_sqrt_columns(output: Tensor, hess_type: HessType) -> Iterator[Tensor]:
    """Columns ``S[:, k]`` of a square root ``S S^T = H`` of each sample's loss Hessian w.r.t.
    its output ``[B, o]``, batched: yields ``o`` tensors ``[B, o]``.

    LeastSquares (``l_i = 0.5 |y_i - t_i|^2``, ``H = I``): ``S = I``. CrossEntropy (softmax,
    ``H = diag(p) - p p^T``): ``S[:, k] = sqrt(p_k) (p - e_k)``, i.e. ``sqrt(p_k)`` times the
    loss gradient for label ``k`` (exact: ``sum_k p_k (p - e_k)(p - e_k)^T = H``).
    """
    batch, classes = output.shape
    if hess_type == "LeastSquares":
        for k in range(classes):
            column = output.new_zeros((batch, classes))
            column[:, k] = 1
            yield column
        return
    p = torch.softmax(output.detach(), dim=1)
    root = p.sqrt()
    for k in range(classes):
        column = p * root[:, k:k + 1]
        column[:, k] -= root[:, k]
        yield column


def sampled_gradients(output: Tensor, hess_type: HessType, n_samples: int,
                      generator: torch.Generator | None) -> Iterator[Tensor]:
    """``n_samples`` Monte-Carlo gradients ``[B, *, o]`` of the per-sample loss w.r.t. the
    output, targets drawn from the model's predictive distribution, each divided by
    ``sqrt(n_samples)``: their outer products average to the Fisher (= GGN here)."""
    y = output.detach()
    weight = 1.0 / math.sqrt(n_samples)
    if hess_type == "CrossEntropy":
        p = torch.softmax(y, dim=-1)
        flat = p.reshape(-1, p.shape[-1])
        for _ in range(n_samples):
            labels = torch.multinomial(flat, 1, generator=generator).squeeze(1)
            grad = flat - F.one_hot(labels, flat.shape[1]).to(flat.dtype)
            yield grad.view(p.shape).mul_(weight)
        return
    for _ in range(n_samples):  # t = y + eps, eps ~ N(0, I): dl/dy = y - t = -eps
        noise = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
        yield noise.mul_(-weight)


def graph_leaves(output: Tensor) -> list[Tensor]:
    """The leaf tensors requiring grad that ``output`` depends on (parameters, inputs)."""
    leaves, seen, stack = [], set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def backprop_hess(output: Tensor, hess_type: HessType, *, loss_type: LossType = "mean",
                  n_samples: int | None = None, generator: torch.Generator | None = None,
                  weights: Tensor | None = None, retain_graph: bool = False,
                  edges: OutputEdges | None = None) -> None:
    """Backpropagate a square root of the loss Hessian w.r.t. ``output``, so that the hooks
    capture one output gradient per pass (``Call.backprops``) for :func:`compute_hess`,
    :func:`compute_kfac` and the second moments.

    ``hess_type``: ``"LeastSquares"`` (per-sample loss ``0.5 * sum (y - t)^2``; Hessian ``I``;
    ``nn.MSELoss()`` is ``2/o`` times it per sample) or ``"CrossEntropy"`` (softmax cross
    entropy over the last dim). Exact (``n_samples=None``): ``output [B, o]``, ``o`` batched
    backward passes (see :func:`hessian_sqrt_columns`). Monte-Carlo Fisher
    (``n_samples=m``): ``m`` passes of the loss gradients for targets sampled from the model's
    predictive distribution (``output [B, *, o]``, positions summed per sample), divided by
    ``sqrt(m)``; unbiased for the Fisher, which equals the GGN for these two losses.

    ``weights``: each position's share of its sample's loss, ``[B, *]`` (broadcast to
    ``output.shape[:-1]``, non-negative): ``l_i = sum_t w_it loss(y_it)``; the default 1 sums
    the positions. A sequence model's loss averages them (``1/T``, as the empirical Fisher's
    gradients do), and gives padded or ``ignore_index`` positions 0:
    ``mask / mask.sum(1, keepdim=True)`` for each sample's mean over its labelled tokens;
    ``mask * B / mask.sum()`` for transformers' mean over the batch's labelled tokens. Each
    position's seeds are multiplied by ``sqrt(w_it)``. With ``output [B, o]``: each sample's
    weight.

    Each pass is seeded with ``1/B`` (``loss_type="mean"``) or 1 (``"sum"``) times the
    per-sample columns, exactly as an ordinary backward of that loss scales output gradients;
    pass the same ``loss_type`` to the ``compute_*`` functions. ``p.grad`` is not touched
    (``torch.autograd.grad`` on the graph's leaves). Call it on a fresh forward, before any
    other backward of the step: every captured pass counts. ``retain_graph=True`` keeps the
    graph for a later ``loss.backward()`` (after the ``compute_*`` call), for ``p.grad``:
    per-sample gradients of those records are refused (they hold these passes too).

    ``edges``: an :class:`~per_sample_hooks.edges.OutputEdges` of the model, made before the
    forward: each pass then goes only as far as the hooked modules' outputs it recorded, and
    computes no parameter (or input) gradient, which the passes do not need: the
    weight-gradient products, about a third of a backward, are skipped in every pass. The
    edges are used up; if it recorded none (made after this forward), or the unseen-use check
    runs on this step (it compares parameter gradients), the leaves are used.
    """
    if hess_type not in HESS_TYPES:
        raise ValueError(f"backprop_hess: hess_type must be one of {HESS_TYPES}, "
                         f"got {hess_type!r}")
    if loss_type not in ("mean", "sum"):
        raise ValueError(f"backprop_hess: loss_type must be 'mean' or 'sum', got {loss_type!r}")
    if not output.requires_grad:
        raise PerSampleHooksError("backprop_hess: output does not require grad; run the "
                                  "forward with grad enabled")
    if n_samples is None:
        if output.dim() != 2:
            raise ValueError(
                "backprop_hess: the exact Hessian square root needs an output [batch, "
                f"classes], got shape {tuple(output.shape)}: a sequence's would take a pass "
                "per position and class. Use n_samples= (the Monte-Carlo Fisher; weights= "
                "for each position's share of its sample's loss, 0 where padded). Flattening "
                "the positions into the batch does not do: the hooks' samples stay the "
                "model's, and each pass would mix a sample's positions")
        seeds = hessian_sqrt_columns(output, hess_type)
    else:
        if not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"backprop_hess: n_samples must be an int >= 1, got {n_samples!r}")
        seeds = sampled_gradients(output, hess_type, n_samples, generator)
    factor = 1.0 / max(output.shape[0], 1) if loss_type == "mean" else 1.0  # (an empty batch)
    roots = None if weights is None else _weight_roots(weights, output)
    recorded = edges.take() if edges is not None else []
    if recorded and edges.check_due():
        recorded = []
    leaves = [] if recorded else graph_leaves(output)
    if not recorded and not leaves:
        raise PerSampleHooksError("backprop_hess: output depends on no tensor that requires "
                                  "grad")
    seeds = [seed if roots is None else seed.mul_(roots) for seed in seeds]
    before = edges.captured_passes() if recorded else 0
    states = live_states()  # the hooked models its passes reach get them counted
    held = [(state.captured_passes(), state.status.backward_seen) for state in states]
    try:
        for index, seed in enumerate(seeds):
            retain = retain_graph or index < len(seeds) - 1
            if recorded:
                torch.autograd.backward(output, seed.mul_(factor), inputs=recorded,
                                        retain_graph=retain)
            else:
                torch.autograd.grad(output, leaves, seed.mul_(factor), allow_unused=True,
                                    retain_graph=retain)
    except RuntimeError as error:
        if not refused_by_reentrant_checkpointing(error):
            raise
        for state, before in zip(states, held):
            if (state.captured_passes(), state.status.backward_seen) != before:
                state.end_step()  # half run: the next forward starts a new step
        raise PerSampleHooksError(
            "backprop_hess: the model uses reentrant activation checkpointing "
            "(torch.utils.checkpoint with use_reentrant=True), through which no backward that "
            "leaves .grad alone can run (torch.autograd.grad, or a backward to given tensors). "
            f"Use {NON_REENTRANT}") from error
    for state, (count, _) in zip(states, held):
        if state.captured_passes() != count:
            state.status.hess_passes += len(seeds)
            state.status.hess_rows = output.shape[0]
            seeded = state.status.hess_loss_type
            state.status.hess_loss_type = loss_type if seeded in (None, loss_type) else "mixed"
    if recorded and edges.captured_passes() == before:  # autograd skips unreachable inputs
        raise PerSampleHooksError(
            "backprop_hess: no output that edges recorded is reached from output (edges of "
            "another model, or of an earlier forward?): pass the OutputEdges of the model that "
            "computed output, made before its forward")


def _weight_roots(weights: Tensor, output: Tensor) -> Tensor:
    """``sqrt(weights)`` broadcast to ``output.shape[:-1]``, with a trailing 1 for the classes."""
    if not isinstance(weights, Tensor):
        raise TypeError(f"backprop_hess: weights must be a tensor, got {type(weights).__name__}")
    positions = output.shape[:-1]
    try:
        weights = weights.detach().to(output.dtype).expand(positions)
    except RuntimeError:
        raise ValueError(f"backprop_hess: weights of shape {tuple(weights.shape)} do not "
                         f"broadcast to the output's positions {tuple(positions)} (its shape "
                         "but the last, class dim)") from None
    if bool((weights < 0).any()):
        raise ValueError("backprop_hess: weights must be non-negative (each position's share "
                         "of its sample's loss)")
    return weights.sqrt().unsqueeze(-1)


# ----------------------------------------------------------------------------- helpers

def _curvature_layers(step: Step) -> Iterator[LayerWork]:
    """Layers with trainable parameters whose output reached the loss."""
    for layer in step.layers:
        if layer.parameters and layer.calls:
            yield layer


def _check_unsupported(unsupported: str, caller: str,
                       choices: tuple[str, ...] = ("raise", "skip")) -> None:
    if unsupported not in choices:
        raise ValueError(f"{caller}: unsupported must be one of {choices}, got {unsupported!r}")


def _squares(layer: LayerWork, names: list[str], batch: int, factor: float, hess_passes: int
             ) -> dict[str, Tensor]:
    """``{name: factor * sum_{passes, i} g_i^2}`` for ``names`` of ``layer`` (``g_i`` as
    captured), from the forms (``forms.second_order.add_squares``); in float32 for float16
    parameters (:func:`_moment_zeros`)."""
    totals = {n: _moment_zeros(layer.parameters[n]) for n in names}
    for forms in _pass_forms(layer, names, hess_passes):
        for name, total in totals.items():
            add_squares(total, forms[name], batch)
    return {n: total.mul_(factor) for n, total in totals.items()}


# ----------------------------------------------------------------------------- public

def split_passes(calls: Sequence[Call], hess_passes: int) -> list[list[Call]]:
    """``calls`` as one list of single-pass views per pass of :func:`backprop_hess`
    (``hess_passes`` of them: each a column of the Hessian's square root), or as one list
    whose passes add up (ordinary backward passes: the gradient of their summed losses).

    Pass ``k`` of every call belongs to the same backward pass, so all calls must have seen
    the same number of passes: backprop_hess', and no other."""
    counts = {c.n_passes for c in calls}
    if hess_passes and counts - {0, hess_passes}:  # 0: formed on arrival, records dropped
        raise PerSampleHooksError(
            f"a module's calls saw {sorted(counts)} backward passes where backprop_hess ran "
            f"{hess_passes}: another backward of the step, or a pass that did not reach every "
            "call, would be taken for a column of the curvature. Run backprop_hess alone on a "
            "fresh forward (an ordinary backward after the compute_* call)")
    n = counts.pop() if len(counts) == 1 else 0
    if not hess_passes or n <= 1:
        return [list(calls)] if calls else []
    return [[c.only_pass(k) for c in calls] for k in range(n)]


def _pass_forms(layer: LayerWork, names: list[str], hess_passes: int
                ) -> list[dict[str, list[Form]]]:
    """The forms of ``names`` in each pass (:func:`split_passes`)."""
    return [layer.rule.forms(layer.module, calls, names)
            for calls in split_passes(layer.calls, hess_passes)]


def _parameter_passes(step: Step, names: dict[int, dict[str, str]]
                      ) -> Iterator[tuple[str, Tensor, list[list[Form]]]]:
    """Each trainable parameter of the hooked modules once, in the layers' order: its
    qualified name, the parameter, and its forms in each pass (none where its modules'
    outputs did not reach the loss). A parameter of several modules (tied embeddings) has the
    sum of theirs, as its per-sample gradient is."""
    shared = shared_parameters(step)
    for layer in step.layers:
        own = [n for n, p in layer.parameters.items() if id(p) not in shared]
        passes = _pass_forms(layer, own, step.hess_passes) if own else []
        for local, p in layer.parameters.items():
            uses = shared.get(id(p))
            if uses is None:
                yield names[id(layer)][local], p, [forms[local] for forms in passes]
            elif uses[0][0] is layer:
                each = [[forms[n] for forms in _pass_forms(use, [n], step.hess_passes)]
                        for use, n in uses]
                yield names[id(layer)][local], p, [
                    [form for forms in in_pass for form in forms]
                    for in_pass in zip_longest(*each, fillvalue=[])]


def _nonempty_step(model: nn.Module, loss_type: LossType, caller: str, *,
                   empty_of_rank: bool = False) -> tuple[HookState, Step]:
    """:func:`prepare_step`, refusing an empty batch: no curvature or second moment of zero
    samples (a mean over them is undefined). ``empty_of_rank``: the caller's result of an empty
    batch is its zeros, which the ranks' weighted mean (``torch.distributed``, several ranks)
    weighs 0; so it is taken there, where a refusal on one rank would leave the others waiting
    in that mean's all-reduce."""
    state, step = prepare_step(model, loss_type, caller, curvature=True)
    if step.batch_size == 0 and not (empty_of_rank and several_ranks()):
        raise PerSampleHooksError(
            f"{caller}: the step's batch is empty (0 samples): there is no curvature or second "
            "moment to compute. Skip the call for an empty batch (Poisson sampling draws one "
            "now and then)")
    return state, step


@library_computation
def compute_hess(model: nn.Module, loss_type: LossType = "mean", *,
                 unsupported: Unsupported = "raise") -> None:
    """Set ``p.hess`` (``[p.numel(), p.numel()]``, row-major flatten of ``p``) on every
    trainable parameter of hooked modules: the Gauss-Newton block of the reduced loss for
    ``p`` (after :func:`backprop_hess`; the empirical Fisher block after an ordinary backward),
    from the per-sample gradients of each pass, ``scale * sum_passes J^T J``. Weight and bias
    get separate blocks. Every layer has them; ``unsupported`` is accepted as by the other
    ``compute_*`` functions."""
    with refusal_ends_step(model):
        _check_unsupported(unsupported, "compute_hess")
    state, model_step = _nonempty_step(model, loss_type, "compute_hess")
    check_unseen_uses(state, model_step)
    work = [entry for entry in _parameter_passes(model_step, parameter_names(model, model_step))
            if entry[2]]
    with refusal_ends_step(model):
        blocks = [_zero_block(name, p) for name, p, _ in work]  # (none set if one cannot be)
    for (_, p, passes), block in zip(work, blocks):
        # (torch.empty, not p.new_empty: a plain tensor for an FSDP2 DTensor too)
        buffer = torch.empty((model_step.batch_size, *p.shape), dtype=p.dtype, device=p.device)
        for forms in passes:
            add_gauss_newton(block, forms, buffer, model_step.scale)
        p.hess = block


def _zero_block(name: str, p: Tensor) -> Tensor:
    """``[p.numel(), p.numel()]`` zeros, or a refusal naming ``p`` where memory is short."""
    try:
        return torch.zeros((p.numel(), p.numel()), dtype=p.dtype, device=p.device)
    except RuntimeError as error:  # (torch.OutOfMemoryError too)
        raise PerSampleHooksError(
            f"compute_hess: the block of '{name}' {tuple(p.shape)} has {p.numel()}^2 entries "
            f"({p.numel() ** 2 * p.element_size() / 2**30:.1f} GiB), more than can be "
            f"allocated ({str(error).splitlines()[0][:120]}). Freeze it for this step "
            "(requires_grad_(False) before the forward), or take a smaller curvature of it: "
            "compute_kfac (Kronecker factors; an Embedding's A is diagonal) or "
            "compute_fisher_diag") from error


@dataclass(eq=False)
class KFACFactors(Mapping[nn.Module, tuple[Tensor, Tensor]]):
    """What :func:`compute_kfac` returns: each covered layer's curvature, by structure.

    As a mapping it is :attr:`kronecker`, ``{module: (A, G)}``, what ``compute_kfac`` returned
    before it covered other layers: code that iterates over it or indexes it by a Linear or
    conv sees only full Kronecker factors. The other kinds are in their own fields, never
    mixed with those.

    Attributes:
        kronecker: ``{module: (A, G)}`` for Linear / Conv1d/2d/3d / transformers' Conv1D with
            a trainable weight: ``A [(groups,) da, da]``, ``G [(groups,) dg, dg]`` (see
            :mod:`.curvature`; Conv1D: of its weight transposed).
        embeddings: ``{module: (a, G)}`` for nn.Embedding with a trainable weight
            ``[V, d]``: ``a [V]`` the diagonal of ``A``, ``G [d, d]``; ``kron(diag(a), G)``
            approximates the weight's block (row-major).
        diagonal: ``{module: {local name: [*p.shape]}}``: the curvature diagonal of each
            trainable parameter of the other layers (``unsupported="diagonal"``), local names
            as the module's rule knows them (``"weight"``; a unit's ``"out_proj.weight"``).
        skipped: qualified names (``model.named_parameters()``) of the trainable parameters
            that ``unsupported="skip"`` left out.
        batch_size: the number of samples they were computed from (0: an empty batch of one
            of several ``torch.distributed`` ranks, whose factors are zeros), the weight
            :func:`~per_sample_hooks.distributed.all_reduce_kfac` gives them.
    """
    kronecker: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)
    embeddings: dict[nn.Module, tuple[Tensor, Tensor]] = field(default_factory=dict)
    diagonal: dict[nn.Module, dict[str, Tensor]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    batch_size: int | None = None

    def __getitem__(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        return self.kronecker[module]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.kronecker)

    def __len__(self) -> int:
        return len(self.kronecker)

    def tensors(self) -> list[Tensor]:
        """Every factor and diagonal: the Kronecker factors, the Embeddings' and the diagonals,
        each in the order of the layers."""
        return [*(t for pair in self.kronecker.values() for t in pair),
                *(t for pair in self.embeddings.values() for t in pair),
                *(t for diagonals in self.diagonal.values() for t in diagonals.values())]


def _kronecker_structure(rule: Rule) -> Literal["outer", "rows"] | None:
    """Which Kronecker factors ``rule`` (a module's own rule) gives its weight, if any."""
    if rule.kronecker:
        return "outer"
    return "rows" if rule.one_hot_rows else None


@with_full_values
@library_computation
def compute_kfac(model: nn.Module, approx: Approx = "expand", loss_type: LossType = "mean", *,
                 unsupported: KFACUnsupported = "diagonal") -> KFACFactors:
    """Curvature of every trainable parameter of the hooked modules whose output reached the
    loss, as a :class:`KFACFactors`: Kronecker factors ``(A, G)`` for Linear / Conv1d/2d/3d
    and transformers' Conv1D (indexing the result by such a module gives them), ``(a, G)``
    with a diagonal ``A`` for nn.Embedding, and for everything else what ``unsupported``
    says:

    - ``"diagonal"`` (default): the parameter's curvature diagonal, scaled as the factors;
    - ``"skip"``: nothing; its qualified name is listed in ``skipped``;
    - ``"raise"``: :class:`~per_sample_hooks.errors.UnsupportedModuleError` naming the layer.

    Layout and scaling: see the module docstring (``kron(G, A)`` approximates the curvature
    block of the reduced loss for the weight matrix with the bias as last column; grouped conv
    factors carry a leading ``groups`` dim). GGN / Fisher factors after :func:`backprop_hess`,
    empirical Fisher factors after an ordinary backward. A parameter shared by several modules
    gets each module's factors for that module's use. A Linear or conv whose per-sample
    gradients were formed on arrival (``OutputEdges(form_on_arrival=True)``) has lost the
    records its factors need: refused unless ``unsupported="skip"``.

    An empty batch is refused in one process; on one of several ``torch.distributed`` ranks
    it gives zero factors with ``batch_size`` 0, which
    :func:`~per_sample_hooks.distributed.all_reduce_kfac` weighs 0 (every rank makes the call
    and the all-reduce, none waits for a rank that skipped them).
    """
    with refusal_ends_step(model):
        check_approx(approx, "compute_kfac")
        _check_unsupported(unsupported, "compute_kfac", ("diagonal", "skip", "raise"))
    state, step = _nonempty_step(model, loss_type, "compute_kfac", empty_of_rank=True)
    empty = step.batch_size == 0  # one rank's empty batch: zeros (weighed 0 across ranks)
    if not empty:
        check_unseen_uses(state, step)
    result = KFACFactors(batch_size=step.batch_size)
    names = None  # qualified parameter names, read once something is skipped
    for layer in _curvature_layers(step):
        rest = list(layer.parameters)
        rule = state.rules[layer.module]
        structure = _kronecker_structure(rule)
        formed = isinstance(layer.rule, FormedRule)
        lost = formed and structure is not None and "weight" in rest  # records dropped
        if structure is not None and "weight" in rest and not formed:
            passes = [forms["weight"]
                      for forms in _pass_forms(layer, ["weight"], step.hess_passes)]
            spare = state.storage.scratch(layer.module, "kfac")
            if structure == "outer":
                if rule.weight_transposed:  # Outer(inputs, output gradients): swap them
                    passes = [[Outer(f.acts, f.grads) for f in forms] for forms in passes]
                result.kronecker[layer.module] = weight_factors(
                    passes, "bias" in rest, step.scale, approx, spare)
                rest = [n for n in rest if n not in ("weight", "bias")]
            else:
                result.embeddings[layer.module] = row_factors(
                    passes, step.batch_size, step.scale, approx, spare)
                rest.remove("weight")
        if not rest:
            continue
        if unsupported == "skip":
            names = names or parameter_names(model, step)
            result.skipped.extend(names[id(layer)][n] for n in rest)
        elif lost or unsupported == "raise":
            raise UnsupportedModuleError(_refusal(layer, rule, structure, lost, rest))
        else:
            result.diagonal[layer.module] = (
                {n: _moment_zeros(layer.parameters[n]) for n in rest} if empty else
                _squares(layer, rest, step.batch_size, step.scale, step.hess_passes))
    return result


def _refusal(layer: LayerWork, rule: Rule, structure: str | None, lost: bool,
             rest: list[str]) -> str:
    """Why ``layer`` (its own rule ``rule``) has no Kronecker factors for ``rest``."""
    if lost:
        why = ("its per-sample gradients were formed when its output gradient arrived "
               "(OutputEdges(model, form_on_arrival=True), as DPSGD does) and its input and "
               "output gradient were dropped: run an ordinary loss.backward(), or an "
               "OutputEdges without form_on_arrival, before compute_kfac.")
        choices = "Pass unsupported='skip' to leave such layers out"
    else:
        why = ("its weight is frozen, and its trainable bias has no Kronecker factors of its "
               "own." if structure is not None else
               f"its rule {type(rule).__name__} gives no Kronecker structure (built in: "
               "Linear, Conv1d/2d/3d, transformers' Conv1D, Embedding; not ConvTranspose, "
               "whose parameters get the curvature diagonal).")
        choices = ("Pass unsupported='diagonal' (the default) for the curvature diagonal of "
                   "such layers, or unsupported='skip' to leave them out")
    return (f"compute_kfac: '{layer.name}': Kronecker factors are not available for "
            f"{type(layer.module).__name__} ({', '.join(rest)}): {why} {choices}")


@library_computation
def compute_fisher_diag(model: nn.Module, loss_type: LossType = "mean") -> dict[str, Tensor]:
    """``{parameter name: sum_i g_i^2}`` (shape of the parameter), ``g_i`` sample i's gradient
    as in ``grad1`` (ordinary backward passes add up into it); after :func:`backprop_hess`
    summed over its passes too: ``N`` times the GGN diagonal of the mean loss. Divide by ``N``
    for the empirical Fisher diagonal of the mean loss. Names as in
    ``model.named_parameters()``. From the forms (``forms.second_order.add_squares``): no
    per-sample gradients for one-position outer products, biases and embedding rows; others
    materialize one parameter at a time. An empty batch of one of several ``torch.distributed``
    ranks gives zeros (its share of the sum over ranks); in one process it is refused."""
    state, step = _nonempty_step(model, loss_type, "compute_fisher_diag", empty_of_rank=True)
    if step.batch_size:
        check_unseen_uses(state, step)
    result = {}
    for name, p, passes in _parameter_passes(step, parameter_names(model, step)):
        total = _moment_zeros(p)
        for forms in passes if step.batch_size else []:
            add_squares(total, forms, step.batch_size)
        result[name] = total.mul_(step.scale * step.scale)
    return result


CANCELLING = 0.01
"""Where the variance from ``E[g^2] - E[g]^2`` is under this share of ``E[g^2]``, its rounding
error is over ``1 / CANCELLING`` times the dtype's: :func:`compute_grad_variance` takes two
passes there."""


@library_computation
def compute_grad_variance(model: nn.Module, loss_type: LossType = "mean") -> dict[str, Tensor]:
    """``{parameter name: 1/N sum_i (g_i - mean_i g_i)^2}``: the population variance of the
    per-sample gradients (``g_i`` each sample's own: BackPACK's ``Variance``, of ``g_i / N``
    for a mean loss, is this ``/ N**2``), after one ordinary backward.

    ``E[g^2] - E[g]^2`` from the forms (the Fisher diagonal's squares and the mean); a
    parameter where that difference cancels (somewhere under :data:`CANCELLING` of
    ``E[g^2]``: samples that agree on a large common gradient, whose variance float32 would
    lose) is done again in two passes over its materialized per-sample gradients."""
    state, step = _nonempty_step(model, loss_type, "compute_grad_variance")
    if step.hess_passes:
        raise PerSampleHooksError(
            "compute_grad_variance: the hooks captured the passes of backprop_hess; the "
            "variance of per-sample gradients needs an ordinary backward of the loss")
    check_unseen_uses(state, step)
    batch, result = step.batch_size, {}
    for name, p, passes in _parameter_passes(step, parameter_names(model, step)):
        square_mean = _moment_zeros(p)
        if not passes:  # its modules' outputs did not reach the loss
            result[name] = square_mean
            continue
        forms = passes[0]
        add_squares(square_mean, forms, batch)
        square_mean.mul_(step.scale * step.scale / batch)
        mean = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        forms_weighted_sum(mean, forms, torch.full(
            (batch,), step.scale / batch, dtype=p.dtype, device=p.device))
        variance = square_mean - mean.to(square_mean.dtype).square()
        if bool((variance < square_mean * CANCELLING).any()):
            per_sample = per_sample_gradients(forms, p.shape, batch)
            variance = per_sample.to(square_mean.dtype).mul_(step.scale).var(0, unbiased=False)
        result[name] = variance.clamp_(min=0)
    return result


def _moment_zeros(p: Tensor, shape: Sequence[int] | None = None) -> Tensor:
    """Zeros of ``p``'s (global) shape, or ``shape``, for a second moment of ``p``: in float32
    for a float16 ``p``, whose range (6e-8 to 65504) squares leave."""
    return torch.zeros(p.shape if shape is None else shape, dtype=moment_dtype(p.dtype),
                       device=p.device)


@library_computation
def compute_gram(model: nn.Module, loss_type: LossType = "mean") -> Tensor:
    """``[N, N]``: ``K_ij = <g_i, g_j>`` over every trainable parameter of hooked modules
    (``g_i`` as in ``grad1``; after :func:`backprop_hess` summed over its passes). From the forms
    (``forms.second_order.add_gram``): one-position outer products ``(A A^T) * (G G^T)``,
    several positions the ghost Gram where cheaper; others materialize one parameter at a
    time. In float32 for a float16 model (whose range its entries leave)."""
    state, step = _nonempty_step(model, loss_type, "compute_gram")
    check_unseen_uses(state, step)
    total = None
    for _, p, passes in _parameter_passes(step, parameter_names(model, step)):
        for forms in passes:
            if total is None:
                total = _moment_zeros(p, (step.batch_size, step.batch_size))
            add_gram(total, forms, p.shape, step.batch_size)
    if total is None:
        return torch.zeros(step.batch_size, step.batch_size)
    return total.mul_(step.scale * step.scale)


__all__ = ["backprop_hess", "compute_hess", "compute_kfac", "KFACFactors", "compute_fisher_diag",
           "compute_grad_variance", "compute_gram"]
