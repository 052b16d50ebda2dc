"""The step engine: what the hooks captured in one step, checked and paired with the rules.

Every consumer (``compute_grad1``, norms and clipping, curvature) starts from
:func:`prepare_step`, which checks the records (batch sizes, in-place changes, layers' own
refusals) and gives one :class:`LayerWork` per hooked module; :func:`check_unseen_uses` runs the
unseen-use check of :mod:`per_sample_hooks.unseen` on the steps its schedule checks.
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import Tensor, nn

from .capture import (
    STATE_ATTRIBUTE,
    Call,
    HookState,
    autocast_device_types,
    broadcast_misuse_error,
    get_state,
    not_recorded,
    unwrap,
)
from .errors import PerSampleHooksError
from .forms import Form, contract_samples, project_sum, projection_cost
from .quantities import KeptGrads, weighted_sum
from .reparametrized import is_parametrized, reparametrization
from .rules import Rule
from .rules.base import describes_forms, written_grad1
from .rules.fallback import unit_parameters
from .rules.formed import FormedRule
from .rules.raw_parameters import OWN_UNIT_ADVICE
from .sharded import contains_fsdp_unit, is_sharded, swap_in_full_values
from .shared_outputs import resolve as resolve_followed
from .unseen import N_PROBES, HookedSums, holder_of, hooked_parameters, user_parameter_hooks
from .vision_language import (
    ImagelessSamples,
    images_not_per_sample_error,
    on_image_side,
    packed_images_hint,
)

LossType = Literal["mean", "sum"]
Verb = TypeVar("Verb", bound=Callable)


def library_computation(verb: Verb) -> Verb:
    """Decorator of a ``compute_*`` function: runs it under ``torch.no_grad()``, its rules'
    re-runs of forwards (under ``torch.func`` transforms or not) not recorded
    (:func:`~.capture.not_recorded`), and ``torch.autocast`` off where this thread has it on
    (a call inside ``with torch.autocast(...)``): the library's math runs in the parameters'
    dtype, as after the block, not in autocast's lower one (where the recurrent rules' re-run
    met float32 buffers and crashed)."""
    @functools.wraps(verb)
    def call(*args, **kwargs):
        with torch.no_grad(), not_recorded(), contextlib.ExitStack() as autocast_off:
            for device_type in autocast_device_types():
                autocast_off.enter_context(torch.autocast(device_type, enabled=False))
            return verb(*args, **kwargs)
    return call


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """``module``'s own trainable parameters."""
    return {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}


def owned_parameters(state: HookState, module: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters whose ``grad1`` ``module`` gives (a unit's: its children's too);
    the sharded ones where full stand-ins hold their place (``sharded.with_full_values``)."""
    params = unit_parameters(module) if module in state.units else trainable_parameters(module)
    if state.sharded_of:
        params = {n: state.sharded_of.get(id(p), p) for n, p in params.items()}
    return params


@dataclass
class LayerWork:
    """One hooked module ready for a rule: its calls that received gradients; ``frozen``: some
    parameter of the module (a unit: below it too) does not require grad."""
    module: nn.Module
    name: str
    rule: Rule
    calls: list[Call]
    parameters: dict[str, nn.Parameter]
    frozen: bool = True


@dataclass
class Step:
    """Everything captured in one step, checked: common batch size and the loss scale."""
    layers: list[LayerWork]
    batch_size: int
    scale: float
    hess_passes: int = 0  # backward passes of backprop_hess that reached the hooks (0: none)


def parameter_dtype(module: nn.Module) -> torch.dtype | None:
    """The floating-point dtype of ``module``'s first own parameter, if any."""
    for p in module._parameters.values():
        if p is not None:
            return p.dtype if p.is_floating_point() else None
    return None


def _layer_parameters(state: HookState, module: nn.Module
                      ) -> tuple[dict[str, nn.Parameter], torch.dtype | None, bool]:
    """:func:`owned_parameters`, :func:`parameter_dtype` and whether a parameter is frozen, read
    afresh every step (a parameter may be replaced or frozen between steps), in one pass over
    a plain module's own parameters."""
    if module in state.units or state.sharded_of:
        params = owned_parameters(state, module)
        everything = list(module.parameters(recurse=module in state.units))
        return params, parameter_dtype(module), len(everything) != len(params)
    params, dtype, frozen, first = {}, None, False, True
    for n, p in module._parameters.items():
        if p is None:
            continue
        if first:
            dtype, first = (p.dtype if p.is_floating_point() else None), False
            if p.is_complex():
                raise PerSampleHooksError(complex_parameter_error(
                    f"'{state.modules[module][0]}.{n}'", p.dtype))
        if p.requires_grad:
            params[n] = p
        else:
            frozen = True
    return params, dtype, frozen


def _warn_of_parameter_hooks(state: HookState, module: str,
                             params: dict[str, nn.Parameter]) -> None:
    """Warn, once per parameter, of a gradient hook the user registered on it: it changes
    ``.grad`` after autograd computed it, which the per-sample quantities do not follow (a
    hook that only reads, a logger's, changes nothing; the unseen-use check refuses a change
    on the steps it runs)."""
    for local, p in params.items():
        if p._backward_hooks is not None and id(p) not in state.warned_parameter_hooks and \
                user_parameter_hooks(p):
            state.warned_parameter_hooks.add(id(p))
            warnings.warn(
                f"per_sample_hooks: parameter '{module}.{local}' has a gradient hook "
                "(p.register_hook): if it changes the gradient (a mask, a scale), the "
                "per-sample quantities do not include the change; apply it to them (grad1, "
                "the clipped sum) instead. A hook that only reads the gradient is fine",
                stacklevel=7)


def complex_parameter_error(parameter: str, dtype: torch.dtype) -> str:
    """The refusal of a complex ``parameter`` (by ``add_hooks`` or ``compute_*``)."""
    return (
        f"parameter {parameter} is {str(dtype).removeprefix('torch.')}: per-sample gradients "
        "of complex parameters are not supported (the layers' rules do not follow autograd's "
        "conjugate convention for them). Take them with torch.func (vmap of grad), or give "
        "the layer real parameters")


def reparametrized_since_hooks(state: HookState, module: nn.Module,
                               params: dict[str, nn.Parameter]) -> bool:
    """Whether ``module``, which ``add_hooks`` gave its layer's rule, has been parametrized
    since, or has trainable parameters the rule does not compute (``per_sample_hooks.
    reparametrized``; a few dict lookups: this runs every step)."""
    known = state.rules[module].parameter_names
    return bool(params) and module not in state.units and (is_parametrized(module) or (
        known is not None and not known.issuperset(params)))


def prepare_step(model: nn.Module, loss_type: LossType, caller: str, grouped: bool = False,
                 curvature: bool = False) -> tuple[HookState, Step]:
    """Check what was captured and pair each hooked module with its rule and calls
    (``grouped``: the caller groups the rows into samples, ``groups=``; ``curvature``: the
    caller reads ``backprop_hess``'s passes, which per-sample gradients refuse); a refusal ends
    the step (:func:`refusal_ends_step`)."""
    with refusal_ends_step(model):
        return _prepare_step(model, loss_type, caller, grouped, curvature)


@contextlib.contextmanager
def refusal_ends_step(model: nn.Module) -> Iterator[None]:
    """A step refused inside (its capture, or a verb's arguments) that had a backward is over,
    as a computed one is: the next forward starts a new step (else it would count as a second
    micro-batch of the refused one)."""
    try:
        yield
    except Exception:
        state = unwrap(model).__dict__.get(STATE_ATTRIBUTE)
        if state is not None and state.status.backward_seen:
            state.end_step()
        raise


def _prepare_step(model: nn.Module, loss_type: LossType, caller: str, grouped: bool,
                  curvature: bool) -> tuple[HookState, Step]:
    if loss_type not in ("mean", "sum"):
        raise ValueError(f"{caller}: loss_type must be 'mean' or 'sum', got {loss_type!r}")
    state = get_state(model)
    swap_in_full_values(state)  # FSDP2, in a call that gathers them (every rank, collective)
    status = state.status
    if status.create_graph:  # before a forward after the backward: meta-learning does both
        raise PerSampleHooksError(
            f"{caller}: a backward pass of this step built the graph of its gradients "
            "(create_graph=True: a gradient penalty, meta-learning, a Hessian-vector product) "
            "through hooked modules. Per-sample gradients of a loss that contains gradients are "
            "not products of the captured inputs and output gradients (the second-order terms "
            "reach the parameters through the backward's own graph), and the captured passes "
            "would be summed as if each were a loss of its own: not supported. Take such "
            "per-sample gradients with torch.func (vmap of grad), or run that backward on an "
            "unhooked copy of the model")
    if status.consumed and state.disabled_calls and any(state.calls.values()):
        raise PerSampleHooksError(
            f"{caller}: the hooked modules ran with their hooks disabled (disable_hooks) since "
            "the step whose records are left: their calls were not recorded, and per-sample "
            "quantities of those records would be the earlier step's. Run the forward and "
            "backward with the hooks on (enable_hooks) before computing them")
    if status.transformed is not None:
        raise PerSampleHooksError(
            f"{caller}: '{status.transformed}' was called inside a torch.func transform (vmap, "
            "grad, jacrev, hessian) in this step, with gradients enabled outside it. Calls "
            "there are not recorded: if the loss uses them (a PINN's residual of derivatives "
            "of the model, a Jacobian penalty), the per-sample gradients miss their terms, and "
            "nothing here can tell whether it does. Run such calls under torch.no_grad() when "
            "the loss does not differentiate them; a loss with derivatives of the model in it "
            "takes its per-sample gradients with torch.func as a whole (vmap of grad), on an "
            "unhooked copy of the model")
    if status.nested is not None:
        state.end_step()  # (no captured gradient marked it as one with a backward)
        raise PerSampleHooksError(
            f"{caller}: '{status.nested}' was called on a nested (ragged) tensor: its rows are "
            "not taken apart by sample here, and its call was not recorded. Pad the batch "
            "(torch.nested.to_padded_tensor(x, 0.0)) and mask the padding in the loss, or take "
            "per-sample gradients of nested inputs with torch.func")
    if status.opaque_output is not None:
        module, kind = status.opaque_output
        raise PerSampleHooksError(
            f"{caller}: '{module}' returned a torch.distributions {kind}: the gradients that "
            "reach its parameters through it (a log_prob in the loss) reach no output of the "
            "module that the hooks see, so its per-sample gradients cannot be paired with "
            "them. Return the distribution's parameters as tensors (`return mu, "
            "log_std.exp().expand_as(mu)`) and build it outside the module, after the call")
    if status.forward_after_backward is not None:
        state.end_step()  # this step is lost; the next forward starts a new one
        raise PerSampleHooksError(
            f"{caller}: '{status.forward_after_backward}' ran a forward pass after a backward "
            "pass of the same step (several forward+backward passes, e.g. gradient "
            "accumulation): the rows of different micro-batches would be added sample by "
            f"sample. Call {caller} after each backward (clone the results to keep them), or "
            "clear_backprops(model) before each micro-batch you do not need")
    if status.substituted is not None:
        module, parameter = status.substituted
        raise PerSampleHooksError(
            f"{caller}: '{module}' ran with a tensor in place of its parameter '{parameter}' "
            "(torch.func.functional_call with other tensors, fast weights, a hypernetwork's "
            "output): the hooks give per-sample gradients of the registered parameters, which "
            "that call did not use as they are. Call it with its own parameters "
            "(functional_call(model, dict(model.named_parameters()), ...), values changed in "
            "place), or take per-sample gradients of other tensors with torch.func")
    if status.broadcast_misuse is not None:
        module, op = status.broadcast_misuse
        state.end_step()  # this step is lost; the next forward starts a new one
        raise broadcast_misuse_error(f"{caller}: ", module, op, "did not keep the batch dim")
    if status.batch_moved is not None:
        module, batch_dim, moved_to = status.batch_moved
        raise PerSampleHooksError(
            f"{caller}: '{module}' was called on a view of the model's input with that input's "
            f"batch dim at its dim {moved_to} (a transpose: ids looked up as `emb(ids.T)`), "
            f"where it takes dim {batch_dim} for the samples: the rows it would tell apart are "
            f"not the samples (whatever their number). Give it the samples at dim {batch_dim} "
            f"and move the dim after the call (`emb(ids).transpose(0, 1)`); a module that reads "
            "the batch at another dim takes add_hooks(..., batch_dim=)")
    if status.released_by is not None:
        raise PerSampleHooksError(
            f"{caller}: {status.released_by} dropped this step's captured tensors; run a new "
            "forward and backward (or leave release_records=False to read them again)")
    for note in state.model_call_notes:
        if isinstance(note, ImagelessSamples):
            _refuse_image_side_gradients(state, note, caller)
    layers, rules = [], state.rules
    sizes: dict[int, list[str]] = {}  # the layers that saw each batch size, first seen first
    for module, name, calls in state.hooked_calls():
        rule = rules[module]
        formed = [c.per_sample for c in calls if c.per_sample is not None] if calls else None
        if formed:  # its per-sample gradients were formed on arrival: they are all there is
            if len(formed) != len(calls) or any(calls[0].grads):
                raise PerSampleHooksError(
                    f"{caller}: '{name}' received another gradient after its per-sample "
                    "gradients were formed on arrival (OutputEdges(model, form_on_arrival="
                    "True)) and its captured input was dropped: several backward passes of one "
                    "forward need form_on_arrival=False")
            sizes.setdefault(calls[0].batch_size, []).append(name)
            layers.append(LayerWork(module, name, FormedRule(formed[0]), calls,
                                    owned_parameters(state, module)))
            continue
        for call in calls:
            if call.shared is not None:  # its output was followed over the forward
                resolve_followed(call)
        try:
            rule.check(module, calls, name)
        except PerSampleHooksError as error:
            raise _with_merged_batch_hint(error, rule, module, name, calls, status.batch,
                                          state.model) from error
        if rule.needs_parameter_values:
            refuse_sharded_values(module, name, rule, caller)
        params, dtype, frozen = _layer_parameters(state, module)
        if reparametrized_since_hooks(state, module, params):
            raise PerSampleHooksError(
                f"{caller}: '{name}' ({type(module).__name__}) "
                f"{reparametrization(module, rule.parameter_names)} since add_hooks, which gave "
                "it its layer's rule: that rule gives the gradient of the weight the layer "
                "uses, not of the parameters it is computed from. Reparametrize before "
                "add_hooks (remove_hooks(model), then add_hooks(model): the module becomes one "
                "unit of the torch.func fallback)")
        _warn_of_parameter_hooks(state, name, params)
        with_grads = []
        for call in calls:
            if call.shared_input is not None and call.has_grads:
                raise _shared_input_error(caller, name, module, call)
            changed = call.modified_inputs()
            if changed:
                raise PerSampleHooksError(
                    f"the input of '{name}' ({type(module).__name__}) at position {changed[0]} "
                    "was modified in place after its forward; per-sample gradients would use "
                    "the modified values. Avoid the in-place op (e.g. inplace=False) or clone "
                    "the input")
            modified = call.modified_value(module)
            if modified is not None:
                kind, changed = modified
                cause, then = ("an optimizer's step", "the step") if kind == "parameter" else (
                    "another forward, as BatchNorm's running statistics in training mode, or "
                    "the module's own forward hooks, as torch.ao's fake quantization of its "
                    "output with its observer on,", "that forward (or freeze that state: "
                    "model.apply(torch.ao.quantization.disable_observer))")
                raise PerSampleHooksError(
                    f"{caller}: {kind} '{changed}' of '{name}' ({type(module).__name__}) "
                    f"was changed in place after the forward (by {cause} before {caller}?). Its "
                    f"rule reads the {kind}s' values, so per-sample gradients would use the new "
                    f"ones: call {caller} before {then}")
            if not call.has_grads:
                continue
            # under torch.autocast a module sees lower-precision tensors than its parameters:
            # compute per-sample quantities in the parameters' dtype (captures converted once)
            if dtype is not None and call.has_other_float_dtype(dtype):
                call.cast_(dtype)
            sizes.setdefault(rule.batch_size(module, call), []).append(name)
            with_grads.append(call)
        layers.append(LayerWork(module, name, rule, with_grads, params, frozen))
    _refuse_unhooked_parameters(state, caller)
    if not sizes:
        raise _no_gradient_captured(state, caller)
    if len(sizes) > 1:
        seen = ", ".join(f"{size} (at '{names[0]}')" for size, names in sizes.items())
        if status.row_subset is not None:
            module, rows, batch = status.row_subset
            raise PerSampleHooksError(
                f"{caller}: captured calls disagree on the batch size: {seen}. '{module}' was "
                f"called on {rows} of the {batch} rows of the model's input (`x[:bt]`: a loop "
                "over sequences sorted by length that runs the unfinished ones only): each "
                "hooked module must see every sample in each call. Run all rows at every step "
                "and keep the finished ones' state, `h = torch.where(active[:, None], new_h, h)`"
                ", with their losses masked")
        if len(state.model_call_rows) > 1:
            counts = " and ".join(map(str, sorted(state.model_call_rows, reverse=True)))
            raise PerSampleHooksError(
                f"{caller}: captured calls disagree on the batch size: {seen}. The model was "
                f"called in this step with {counts} rows (the most along its batch dim among "
                "each call's inputs): every call of a step must see the step's samples. A call "
                "the loss does not differentiate (an evaluation, an RL bootstrap value V(s_T), "
                "a target) goes under torch.no_grad() (or clear_backprops(model) after it); a "
                "term every sample shares (the loss at an anchor or boundary point) has no "
                "per-sample gradient: give its points to the batch's call, as samples with a "
                "loss of their own, or take its gradient in a backward of its own, outside the "
                "per-sample step. (Pass batch_dim to add_hooks if the batch is not dimension 0)")
        shared = status.shared_computation
        if shared is not None:
            raise PerSampleHooksError(
                f"{caller}: captured calls disagree on the batch size: {seen}. '{shared}' was "
                "called with batch size 1 on an input computed from trainable parameters "
                "(relative position embeddings, a learned query; or one row picked from the "
                "batch's, the token routed to an expert of a mixture of experts): that "
                "computation is shared by the samples, or its row is no sample, and its "
                "per-sample gradients need it run per sample. Make a module that contains it "
                "and the ops that meet its output with the batch (an encoder, a transformer "
                "block, the mixture-of-experts block) one unit of the torch.func fallback: "
                "add_hooks(model, units=[...]); or freeze the parameters it is computed from")
        # the step's batch is its first hooked call's; a first layer that saw merged rows
        # (PointNet's [B * N, F]) leaves the model's own samples to tell
        batches = (status.batch, _model_samples(state.model_input_shapes, state.model_batch_dim))
        hint = next(filter(None, (
            merged_batch_hint(names, size, batch, sizes.get(batch, ()), state.model)
            for batch in batches for size, names in sizes.items())), None)
        if hint is not None:
            raise PerSampleHooksError(
                f"{caller}: captured calls disagree on the batch size: {seen}. {hint}. (Call "
                "clear_backprops(model) between steps, and pass batch_dim to add_hooks if the "
                "batch is not dimension 0)")
        fewer = next(((size, names[0]) for size, names in sizes.items()
                      if status.batch and 1 < size < status.batch), None)
        if fewer is not None:
            raise PerSampleHooksError(
                f"{caller}: captured calls disagree on the batch size: {seen}. '{fewer[1]}' "
                f"saw {fewer[0]} rows, fewer than the {status.batch} samples: rows selected "
                "from the batch's by a mask or an index (an early exit's `deep(h[keep])`, the "
                "tokens a mixture-of-depths routes), while each hooked module must see every "
                "sample in each call. Run it on every row and keep the selected rows' results, "
                "`torch.where(keep[:, None], deep(h), h)`, or make the module that selects and "
                "runs them one unit of the torch.func fallback (add_hooks(model, units=[...])), "
                "which re-runs each sample alone")
        raise PerSampleHooksError(
            f"{caller}: captured calls disagree on the batch size: {seen}. Call "
            "clear_backprops(model) between steps, and pass batch_dim to add_hooks if the batch "
            "is not dimension 0. A module whose output is broadcast over the batch (position "
            "ids) is handled when called with batch size 1 after some module saw the batch, "
            "`pos_emb(torch.arange(T)[None])`, or on indices without the batch dim made in the "
            "forward, `pos_emb(torch.arange(T))`, followed to where the model broadcasts its "
            "output; called with batch size 1 before any module saw the batch, it cannot be "
            "told from a batch of one: give it the batch, `pos_emb(torch.arange(T).expand(B, "
            "-1))`, or, in code you do not change (the relative position biases of "
            "transformers' BEiT and Swin, picked from a table), make a module that holds every "
            "use of its output (the attention layer or transformer block that adds it to the "
            "batch's) one unit of the torch.func fallback, add_hooks(model, units=[...]). A "
            "layer called on rows picked from the "
            "batch's (the experts of a mixture of experts on the tokens routed to them, a "
            "graph's edges) does not see samples: make the block that picks them one unit")
    batch_size = next(iter(sizes))
    if not grouped:
        _refuse_rows_that_are_not_samples(state.model_input_shapes, state.model_batch_dim,
                                          batch_size, sizes[batch_size][0], caller)
    if status.hess_passes and not curvature:
        raise PerSampleHooksError(
            f"{caller}: this step's records hold the {status.hess_passes} backward passes of "
            "backprop_hess (columns of the loss Hessian's square root), which per-sample "
            "gradients would add to the loss's (5-150% off). Take per-sample gradients in a "
            "step of their own (a new forward and loss.backward()), or before backprop_hess")
    if status.hess_passes and status.hess_loss_type != loss_type:
        raise PerSampleHooksError(
            f"{caller}: backprop_hess scaled its passes for loss_type="
            f"{status.hess_loss_type!r}, but this call reads them with loss_type={loss_type!r}"
            " (a mean over the samples and a sum differ by the batch size squared here): pass "
            "the same loss_type to both, in a new forward and backprop_hess (this step is over)")
    if status.hess_passes and status.hess_rows != batch_size:
        raise PerSampleHooksError(
            f"{caller}: backprop_hess was given an output of {status.hess_rows} rows, but the "
            f"hooked layers saw {batch_size} samples ('{sizes[batch_size][0]}'...): each row's "
            "loss Hessian would be taken as a sample's. Give it the model's output with the "
            "samples at dim 0; for positions ([B, T, o], not flattened into the batch) use "
            "n_samples= with weights=")
    scale = float(batch_size) if loss_type == "mean" else 1.0
    state.end_step()
    return state, Step(layers, batch_size, scale, status.hess_passes)


def _refuse_image_side_gradients(state: HookState, note: ImagelessSamples, caller: str
                                 ) -> None:
    """Refuse a step of a vision-language model called with images not one per sample
    (``note``) in which a layer off its text side received gradients."""
    for module, name, calls in state.hooked_calls():
        if module not in note.text_side and any(c.has_grads for c in calls) and \
                any(p.requires_grad for p in owned_parameters(state, module).values()):
            raise PerSampleHooksError(images_not_per_sample_error(caller, note, name))


def _shared_input_error(caller: str, name: str, module: nn.Module, call: Call
                        ) -> PerSampleHooksError:
    kind, tensor = call.shared_input
    shape = tuple(call.args[0].shape)
    return PerSampleHooksError(
        f"{caller}: '{name}' ({type(module).__name__}) was called on the model's {kind} "
        f"'{tensor}' (shape {shape}), which every sample shares (a relative position table "
        "run through an MLP, learned queries): its rows are not the samples, whatever their "
        f"number, so the per-sample gradients of '{name}' are not those of its rows. Make a "
        "module that holds this call and the ops that meet its output with the batch (the "
        "attention layer that adds it to the scores) one unit of the torch.func fallback, "
        "add_hooks(model, units=[...]), or freeze the parameters of the layers that act on "
        "it before it meets the batch")


def _model_samples(shapes: set[torch.Size] | None, batch_dim: int) -> int | None:
    """The size the model's tensor inputs of ``shapes`` share at ``batch_dim``, if one."""
    at_dim = {shape[batch_dim] for shape in shapes or () if len(shape) > batch_dim}
    return at_dim.pop() if len(at_dim) == 1 else None


def _refuse_rows_that_are_not_samples(shapes: set[torch.Size] | None, batch_dim: int,
                                      rows: int, name: str, caller: str) -> None:
    """Refuse a step whose hooked layers saw ``rows`` rows where the model was called with
    ``samples`` samples (the size its tensor inputs of ``shapes`` share at ``batch_dim``), when
    each sample became several rows (a multiple-choice head's ``[B, C, T] -> [B * C, T]``) or
    all shared one (a soft prompt computed once, repeated over the batch): the rows would be
    taken as the samples. Rows counted by some dim of the model's inputs (a sequence-first
    input, whose batch is not at the dim ``add_hooks`` was given) and other mismatches are
    left alone."""
    # (the rows at the first two dims only: a multiple-choice input [B, C, T] with T = B * C
    # rows is no sequence-first input)
    if not shapes or any(rows in shape[:2] for shape in shapes):
        return
    samples = _model_samples(shapes, batch_dim)
    if not samples:
        return
    if rows == 1:
        raise PerSampleHooksError(
            f"{caller}: the model was called with {samples} samples, but the hooked layers "
            f"that received gradients ('{name}'...) saw 1 row: a computation shared by the "
            "samples and repeated over the batch (a soft prompt, as peft's prompt tuning and "
            "P-tuning compute it), with the layers that see the batch frozen. Its per-sample "
            "gradients are not those of one row: make a module that holds it and the ops "
            "that meet the batch one unit of the torch.func fallback (add_hooks(model, "
            "units=[...]); the whole model: units=['']), or compute it from the batch")
    if rows % samples == 0:
        raise PerSampleHooksError(
            f"{caller}: the model was called with {samples} samples, but its hooked layers "
            f"('{name}'...) saw {rows} rows, {rows // samples} per sample: the model turns each "
            "sample into several rows before any hooked layer (a multiple-choice head's "
            "[B, C, T] -> [B * C, T]), and each row would be taken as a sample. Pass "
            f"groups=per_sample_hooks.JointGroups({rows // samples}) to compute_norms / "
            "clip_grads / DPSGD.step when a sample's rows make its loss together (choices "
            f"scored jointly), groups={rows // samples} when each row has a loss of its own (a "
            "sample's gradient then the mean of its rows'); or add_hooks(model, batch_dim=...) "
            "if the batch is not dim 0 of the model's inputs")


def _no_gradient_captured(state: HookState, caller: str) -> PerSampleHooksError:
    """No hooked output received a gradient: no backward, or one that reached the trainable
    parameters only through uses outside their modules' forwards (named, with a unit)."""
    model = state.model
    called = state.enabled and state.model_input_shapes != set()  # in this step, hooked
    reached = [] if model is None or not called else [
        name for name, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    if not reached:
        disabled = "" if state.enabled else (
            " The hooks are disabled (disable_hooks(model); psh.optim.KFAC with update_freq "
            "> 1 pauses them on the steps that read no factors: KFAC(..., pause_hooks=False) "
            "keeps them on).")
        return PerSampleHooksError(
            f"{caller}: no output gradient was captured since the hooks were added or last "
            "cleared. Run the forward pass with grad enabled and loss.backward() first."
            f"{disabled}")
    units = sorted({holder_of(model, name) for name in reached})
    return PerSampleHooksError(
        f"{caller}: autograd gave trainable parameters a gradient ({', '.join(reached[:4])}"
        f"{', ...' if len(reached) > 4 else ''}), yet no hooked module's output received one: "
        "they are used outside the forward of the module that owns them (peft's IA3, LoHa, "
        "VeRA and similar adapters read them in the forward of the layer that holds them). "
        "Let the torch.func fallback handle the modules that use them as units: "
        f"add_hooks(model, units={units})")


def _refuse_unhooked_parameters(state: HookState, caller: str) -> None:
    """Every trainable parameter of the model belongs to a hooked module (a unit: below it),
    else its per-sample gradients would be missing from every quantity, unseen."""
    model = state.model
    if model is None or all(id(p) in state.hooked_parameter_ids or not p.requires_grad
                            for p in model.parameters()):
        return
    # (a parameter replaced since: looked up again)
    state.hooked_parameter_ids = hooked = set(map(id, hooked_parameters(state)))
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in hooked:
            raise PerSampleHooksError(
                f"{caller}: trainable parameter '{name}' belongs to no hooked module, so its "
                "per-sample gradients cannot be seen: it, or its module, was added to the model "
                "after add_hooks. Hook the model again (remove_hooks(model), then "
                "add_hooks(model)), or freeze it")


def merged_batch_hint(names: Sequence[str], size: int, batch: int | None,
                      batch_layers: Sequence[str] | None = None, model: nn.Module | None = None
                      ) -> str | None:
    """What to do about modules ``names`` called with ``size`` rows, a multiple of the step's
    ``batch`` (the samples' positions merged into its batch dim); None if it is not one. Given
    the layers that saw the batch (``batch_layers``), the units it names are, for each of
    ``names``, its nearest ancestor that holds one of them too, so is likely called with the
    batch (``ModuleList`` s and ``ModuleDict`` s of ``model`` skipped): OPT's decoder layers
    (their ``fc1`` sees ``B * T`` rows, their ``q_proj`` the batch), PatchTST's encoder (its
    layers see the channels folded into the batch), PointNet's model itself; else the parent
    of the first."""
    if not batch or batch < 2 or size <= batch or size % batch:
        return None
    names = list(dict.fromkeys(names))  # a layer called several times, once
    others = len(names) - 1
    seen = f"'{names[0]}'" + (f" and {others} other layer{'s' * (others > 1)}" if others else "")
    if model is not None and on_image_side(model, names):
        return packed_images_hint(seen, size)
    if batch_layers is None:
        parent = _unit_holding(names[0], None, model)
        where = f"its parent {parent!r}, if it is one" if parent else "the model itself"
        units = [parent]
    else:
        found = list(dict.fromkeys(_unit_holding(name, batch_layers, model) for name in names))
        units = [u for u in found if not any(v != u and (not v or u.startswith(f"{v}."))
                                             for v in found)]
        where = "the model itself" if units == [""] else ", ".join(map(repr, units[:3])) + (
            f" and {len(units) - 3} more" if len(units) > 3 else "")
        where += ", which hold a layer that saw the batch too"
    return (
        f"{seen} saw a multiple of the batch {batch}: called with {size} rows, "
        f"{size // batch} times the batch of {batch}, the samples' positions merged into one "
        "dim (`x.view(B * T, H)`, windows or patches folded into the batch, a "
        "mixture-of-experts block routing its tokens), which only the module that merges them "
        "can tell apart. Make the nearest module that contains it and is called with the batch "
        f"(a decoder layer, a transformer block) one unit of the torch.func fallback: {where}, "
        f"add_hooks(model, units={units!r})")


def _unit_holding(name: str, batch_layers: Sequence[str] | None, model: nn.Module | None
                  ) -> str:
    """The nearest ancestor of layer ``name`` that holds one of ``batch_layers`` (None: any)
    and is not a ``ModuleList`` or ``ModuleDict`` of ``model``; ``''``: the model itself."""
    path = name
    while path:
        path = path.rpartition(".")[0]
        if model is not None and path and \
                isinstance(model.get_submodule(path), (nn.ModuleList, nn.ModuleDict)):
            continue
        if path and (batch_layers is None or
                     any(layer.startswith(f"{path}.") for layer in batch_layers)):
            return path
    return ""


def _with_merged_batch_hint(error: PerSampleHooksError, rule: Rule, module: nn.Module,
                            name: str, calls: Sequence[Call], batch: int | None,
                            model: nn.Module | None) -> PerSampleHooksError:
    """A rule's refusal, with :func:`merged_batch_hint` if the module saw a multiple of the
    batch: a unit of the module itself would split its calls by the wrong batch."""
    hint = next(filter(None, (
        merged_batch_hint([name], rule.batch_size(module, call), batch, model=model)
        for call in calls)), None)
    if hint is None:
        return error
    message = str(error).replace(f" {OWN_UNIT_ADVICE.format(name=name)}", "")
    return PerSampleHooksError(f"{message.rstrip('.')}. {hint}")


FORM_RATIO = 2
"""``form_on_arrival`` forms a call's per-sample gradients when its captured input and output
gradient hold at least this many times as many numbers. Measured on the T=256 token model: a
ratio of 1, which also forms its Linear layers (per-sample gradients 0.8x their pair), gave the
same peak memory (1.16x against 1.15x a plain step) and time within noise; 2 leaves more layers
with their records, so more of them serve ``compute_kfac``."""


@torch.no_grad()
def form_on_arrival(state: HookState, module: nn.Module, call: Call) -> None:
    """Form ``call``'s per-sample gradients now, as captured, into step-scoped buffers, and drop
    its input and output gradient, when those hold :data:`FORM_RATIO` times as many numbers
    (LayerNorm; Linear and convolutions on many positions): set as ``state.listeners.on_gradient``
    during a backward that only clipping or norms will read.

    Only the plain case is formed: the module's only call of the step, one output, its first
    backward pass, inputs unchanged, not a unit (the torch.func fallback, attention), no
    tensors watched inside its forward (their gradients arrive after the output's); anything
    else keeps its record and is handled as usual."""
    if (call.per_sample is not None or len(call.grads) != 1 or len(call.grads[0]) != 1
            or call.watched or module in state.units or len(state.calls[module]) != 1
            or call.modified_inputs() or call.shared is not None):
        return
    params = owned_parameters(state, module)
    rule = state.rules[module]
    if rule.needs_parameter_values and any(is_sharded(p) for p in module.parameters()):
        return  # FSDP2 shards: formed by the compute_* call, which gathers the values
    held = call.grads[0][0].numel() + sum(a.numel() for a in call.args if isinstance(a, Tensor))
    batch = rule.batch_size(module, call)
    if not params or batch == 0 or reparametrized_since_hooks(state, module, params) or \
            FORM_RATIO * batch * sum(p.numel() for p in params.values()) > held:
        return  # (reparametrized: refused by prepare_step, with the record intact)
    name = state.modules[module][0]
    try:
        rule.check(module, [call], name)
    except PerSampleHooksError:
        return  # reported by prepare_step, with the record intact
    dtype = parameter_dtype(module)
    if dtype is not None and call.has_other_float_dtype(dtype):
        call.cast_(dtype)
    out = {n: state.storage.get(module, f"formed {n}", batch, p, step_only=True)
           for n, p in params.items()}
    written_grad1(rule, module, [call], 1.0, out)
    call.release()
    call.per_sample = out


def check_compares(state: HookState) -> bool:
    """Whether the unseen-use check compares this step (its backward gave the check parameter
    gradients): only then is anything kept for :func:`check_unseen_uses` read again."""
    return state.unseen is not None and bool(state.unseen.totals)


def refuse_sharded_values(module: nn.Module, name: str, rule: Rule, caller: str) -> None:
    """A rule that reads parameter values cannot run on FSDP2 shards (full only in forward)
    outside the calls that gather them (``sharded.with_full_values``)."""
    if not rule.needs_parameter_values:
        return
    if contains_fsdp_unit(module):
        raise PerSampleHooksError(
            f"{caller}: '{name}' ({type(module).__name__}) is, or contains, an FSDP2 unit "
            f"(fully_shard was applied to it) and its rule ({type(rule).__name__}) re-runs or "
            "reads it: FSDP2's hooks would replace the parameters the rule differentiates. "
            "Apply fully_shard to a module that contains it (e.g. its transformer block) "
            "instead, or leave its parameters out of the sharding (ignored_params)")
    if any(is_sharded(p) for p in module.parameters()):
        raise PerSampleHooksError(
            f"{caller}: '{name}' ({type(module).__name__}) is sharded by FSDP2 (fully_shard) "
            f"and its rule ({type(rule).__name__}) reads its parameters' values, which FSDP2 "
            "holds in full only during the forward and backward; compute_grad1, compute_norms, "
            f"clip_grads and compute_kfac gather them, {caller} does not. Leave this module's "
            "parameters out of the sharding (fully_shard(..., ignored_params=...)) or use "
            "DistributedDataParallel")


def refuse_sharded_check(step: Step) -> None:
    """The unseen-use check compares autograd's gradient of each parameter with the hooked sum;
    FSDP2 hands autograd's gradient to its unsharded copy, not to the (DTensor) parameter the
    check watches, so on a sharded model it would never run: refuse rather than pass unchecked."""
    for layer in step.layers:
        for local, p in layer.parameters.items():
            if is_sharded(p):
                raise PerSampleHooksError(
                    f"parameter '{local}' of '{layer.name}' is sharded (FSDP2 fully_shard): the "
                    "unseen-use check cannot see its gradient. Check the model once unsharded "
                    "(one process, add_hooks(model) and any compute_* call), then hook the "
                    "sharded model with add_hooks(model, check_unseen=False)")


def check_unseen_uses(state: HookState, step: Step, kept: KeptGrads | None = None,
                      kept_scale: float = 1.0) -> None:
    """The unseen-use check of :mod:`per_sample_hooks.unseen`, on the steps its schedule
    checks: each layer's hooked sum is projected from its rule's forms without being formed
    (``forms.project_sum``), except each parameter whose per-sample gradients
    ``kept`` holds (``kept_scale`` times them is as captured) where reading them costs less,
    or all of the layer's when it holds them all and the forms would re-run the layer; those
    are contracted, as a rule without forms has its weighted sum with unit weights taken,
    each projected and dropped layer by layer; then compared with autograd's gradients.
    Raises before anything is written."""
    check = state.unseen
    if check is None:
        return
    if check.decision is not False:  # not a step the schedule skipped (a sharded model's: None)
        refuse_sharded_check(step)
    check.schedule.step_read(checked=bool(check.decision))
    if not check.totals:
        return
    start = time.perf_counter()
    hooked = HookedSums(check)
    users: dict[int, list[str]] = {}
    for layer in step.layers:
        wanted = {}
        for n, p in layer.parameters.items():
            users.setdefault(id(p), []).append(layer.name)
            if id(p) in check.totals and layer.calls:
                wanted[n] = p
        if not wanted:
            continue
        stored = {n: kept.get(layer.module, n) for n in wanted} if kept is not None else {}
        have_all = bool(stored) and all(t is not None for t in stored.values())
        if describes_forms(layer.rule) and not (have_all and layer.rule.forms_rerun):
            for n, parts in layer.rule.forms(layer.module, layer.calls, list(wanted)).items():
                reads = step.batch_size * wanted[n].numel()
                if stored.get(n) is None or N_PROBES * projection_cost(parts) < reads:
                    hooked.add_projection(wanted[n], project_sum(parts, check.probe(wanted[n])))
                    del wanted[n]
            if not wanted:
                continue
            have_all = True  # the rest is kept
        out = {n: torch.empty_like(p, memory_format=torch.contiguous_format)
               for n, p in wanted.items()}
        ones = out[next(iter(out))].new_ones(step.batch_size)
        if have_all:
            for n, target in out.items():
                contract_samples(target, stored[n], ones * kept_scale)
        else:
            weighted_sum(layer.rule, layer.module, layer.calls, ones, out, keep=kept)
        for n, value in out.items():
            hooked.add(wanted[n], value)
    check.verify(hooked, users, time.perf_counter() - start)


def parameter_names(model: nn.Module, step: Step) -> dict[int, dict[str, str]]:
    """Qualified parameter name (the first in ``model.named_parameters()``) for each layer's
    trainable parameters."""
    qualified: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        qualified.setdefault(id(p), n)
    return {id(layer): {local: qualified.get(id(p), f"{layer.name}.{local}")
                        for local, p in layer.parameters.items()} for layer in step.layers}


def shared_parameters(step: Step) -> dict[int, list[tuple[LayerWork, str]]]:
    """Parameters of several hooked modules (tied input and output embeddings), by id: the
    ``(layer, local name)`` of each use. Their per-sample gradient is the sum of the modules'
    forms, whose norms carry the cross terms (``forms.norms_squared``)."""
    uses: dict[int, list[tuple[LayerWork, str]]] = {}
    for layer in step.layers:
        for local, p in layer.parameters.items():
            uses.setdefault(id(p), []).append((layer, local))
    return {key: found for key, found in uses.items() if len(found) > 1}


def shared_forms(uses: list[tuple[LayerWork, str]]) -> list[Form]:
    """The forms of a shared parameter: each module's, as captured (modules whose output did
    not reach the loss give none)."""
    return [form for layer, local in uses if layer.calls
            for form in layer.rule.forms(layer.module, layer.calls, [local])[local]]


__all__ = ["LayerWork", "Step", "LossType", "prepare_step", "check_unseen_uses",
           "form_on_arrival", "parameter_names", "shared_parameters", "shared_forms",
           "owned_parameters", "trainable_parameters",
           "FORM_RATIO"]
