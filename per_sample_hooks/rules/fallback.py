"""Fallback for any module with trainable parameters and no rule: ``torch.func`` on its forward.

For one captured call ``y = f(params, *args, **kwargs)`` with output gradients ``g`` (one per
output leaf, in ``torch.utils._pytree`` order), the per-sample gradient of sample ``b`` is the
vector-Jacobian product of ``f`` restricted to that sample::

    grad1[b] = vjp(params -> f(params, args[b], kwargs[b]))(g[b])

computed for all samples at once with ``vmap``, or, for a forward that ``vmap`` cannot batch (a
branch on tensor values, a shape that depends on them: a mixture of experts' routing, packing
sequences of the samples' lengths) or ``torch.func`` cannot transform (an ``autograd.Function``
without ``setup_context``), by a loop over the samples with plain autograd, with a warning. The
re-run's outputs are compared with the batch's, and a unit whose samples alone give other
outputs (its forward depends on the batch or draws random numbers) is refused, as is BatchNorm
with batch statistics inside a unit. Each sample keeps a batch dim of size 1, so a forward that
needs batched inputs (``x.view(x.shape[0], -1)``, a 3-D attention input) runs unchanged. Tensor
arguments whose size at the batch dim is not the batch size (attention masks, constants) are
shared by all samples; tensors inside a tuple, list or dict argument (an LSTM state ``(h, c)``)
are split or shared the same way, one by one. The module is handled as one *unit*: parameters
of its children are included (``nn.MultiheadAttention`` uses ``out_proj.weight`` without
calling ``out_proj``), and the children are not hooked separately.

Where the samples sit in each argument and output is the module's *layout*: by default the
module's ``batch_dim`` (from ``add_hooks``) for every tensor whose size there is the batch size;
:func:`register_layout` adds exact layouts for module types whose arguments disagree (attention:
``key_padding_mask`` and the attention weights are batch first whatever ``batch_first`` says).

Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` and their cells) inside a unit get an
initial state batched over the samples in the re-run (their own zeros are not, and they write
into them in place).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import Call, not_recorded, summed_passes
from ..errors import PerSampleHooksError
from ..forms import Dense, Form
from ..reparametrized import iterating_spectral_norms, power_iterations_off, recorded_forward
from .base import Rule
from .normalization import batch_statistics_error, uses_batch_statistics

HEADS = "heads"
"""Layout marker: a ``[B * heads, ...]`` tensor (3-D attention mask), one block per sample."""

Spec = int | str | None  # batch dim kept as size 1 per sample, HEADS, or None (shared)
# (the default layout gives a tuple, list or dict argument the same container of its leaves'
# specs: vmap's in_dims for it)
CONTAINERS = (tuple, list, dict)


@dataclass
class Layout:
    """Where the samples sit: one spec per positional argument, keyword and output leaf."""
    args: list[Spec]
    kwargs: dict[str, Spec]
    outputs: list[Spec]
    batch_size: int
    #: keyword arguments replaced in the re-run (same values, a path ``vmap`` batches better)
    rerun_kwargs: dict[str, object] = field(default_factory=dict)


LayoutFn = Callable[[nn.Module, Call], Layout]
_layouts: dict[type, LayoutFn] = {}


def register_layout(module_type: type) -> Callable[[LayoutFn], LayoutFn]:
    """Decorator: ``fn(module, call) -> Layout`` for ``module_type`` and its subclasses."""
    def decorator(fn: LayoutFn) -> LayoutFn:
        _layouts[module_type] = fn
        return fn
    return decorator


def _lookup_layout(module: nn.Module) -> LayoutFn:
    for klass in type(module).__mro__:
        if klass in _layouts:
            return _layouts[klass]
    return default_layout


def _spec_for(t: object, dim: int, batch_size: int) -> Spec:
    if isinstance(t, Tensor):
        return dim if t.dim() > dim and t.shape[dim] == batch_size else None
    if isinstance(t, CONTAINERS):  # a container of tensors: each leaf its own spec
        leaves, tree = tree_flatten(t)
        specs = [_spec_for(leaf, dim, batch_size) if isinstance(leaf, Tensor) else None
                 for leaf in leaves]
        if any(spec is not None for spec in specs):
            return tree_unflatten(specs, tree)
    return None


def _first_batch_size(module: nn.Module, tensors: Sequence[object], dim: int) -> int:
    for t in tensors:
        if isinstance(t, Tensor) and t.dim() > dim:
            return t.shape[dim]
    raise PerSampleHooksError(
        f"{type(module).__name__}, handled by the torch.func fallback, was called with no "
        f"tensor input that has a dim {dim} to read the batch from, so its re-run cannot be "
        "split by sample. Make the module that calls it with the batch a unit (units=), or "
        "give it a batched tensor input")


def default_layout(module: nn.Module, call: Call) -> Layout:
    """Every tensor whose size at the module's ``batch_dim`` is the batch size (read off the first
    positional tensor) is batched there; other tensors and non-tensors are shared."""
    dim = call.batch_dim
    inputs = tree_flatten([*call.args, *call.kwargs.values()])[0]
    batch_size = _first_batch_size(module, inputs, dim)
    return Layout([_spec_for(a, dim, batch_size) for a in call.args],
                  {k: _spec_for(v, dim, batch_size) for k, v in call.kwargs.items()},
                  [dim] * len(call.grads), batch_size)


def _bind(module: nn.Module, call: Call) -> dict[str, object]:
    """Positional and keyword arguments of ``call`` by parameter name of ``module.forward``."""
    bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    return dict(bound.arguments)


def _named_layout(module: nn.Module, call: Call, batched: dict[str, Spec],
                  outputs: list[Spec], batch_size: int) -> Layout:
    """Layout from a ``{parameter name: spec}`` table; names not in it are shared."""
    names = list(inspect.signature(module.forward).parameters)
    args = [batched.get(names[i]) if isinstance(a, Tensor) else None
            for i, a in enumerate(call.args)]
    kwargs = {k: batched.get(k) if isinstance(v, Tensor) else None
              for k, v in call.kwargs.items()}
    return Layout(args, kwargs, outputs + [None] * (len(call.grads) - len(outputs)), batch_size)


def _mask_spec(mask: object, dim: int, batch_size: int) -> Spec:
    """Attention mask ``[L, S]`` (shared) or ``[B * heads, L, S]`` (per sample)."""
    if isinstance(mask, Tensor) and mask.dim() == 3:
        return HEADS
    return None


@register_layout(nn.MultiheadAttention)
def attention_layout(module: nn.MultiheadAttention, call: Call) -> Layout:
    """query/key/value ``[B, L, E]`` (batch_first) or ``[L, B, E]``; ``key_padding_mask [B, S]``;
    ``attn_mask [L, S]`` or ``[B * heads, L, S]``; output, then weights ``[B, (heads,) L, S]``."""
    dim = 0 if module.batch_first else 1
    arguments = _bind(module, call)
    batch_size = arguments["query"].shape[dim]
    table = {"query": dim, "key": dim, "value": dim, "key_padding_mask": 0,
             "attn_mask": _mask_spec(arguments.get("attn_mask"), dim, batch_size)}
    layout = _named_layout(module, call, table, [dim, 0], batch_size)
    # The output leaves keep their positions: (out, None) becomes (out, weights).
    if explicit_attention_agrees(arguments):
        layout.rerun_kwargs["need_weights"] = True
    return layout


def explicit_attention_agrees(arguments: dict[str, object]) -> bool:
    """Whether a re-run of a MultiheadAttention call (its arguments by name) with
    ``need_weights=True`` gives its outputs: that path is the explicit ``softmax(QK^T)V``,
    which ``vmap`` batches (the fused ``scaled_dot_product_attention`` has no batching rule on
    CPU: a slow per-sample fallback) and whose backward is faster. Not with ``is_causal``,
    which the fused path applies as its own top-left mask over the keys and any ``bias_k`` /
    zero attention appended, instead of ``attn_mask``."""
    return not arguments.get("is_causal", False)


def _transformer_layout(module: nn.Module, call: Call, sequences: Sequence[str],
                        padding_masks: Sequence[str], masks: Sequence[str]) -> Layout:
    batch_first = getattr(module, "batch_first", None)  # torch 2.15's layers: their attention's
    dim = 0 if (module.self_attn.batch_first if batch_first is None else batch_first) else 1
    arguments = _bind(module, call)
    batch_size = arguments[sequences[0]].shape[dim]
    table: dict[str, Spec] = {name: dim for name in sequences}
    table.update({name: 0 for name in padding_masks})
    table.update({name: _mask_spec(arguments.get(name), dim, batch_size) for name in masks})
    return _named_layout(module, call, table, [dim], batch_size)


@register_layout(nn.TransformerEncoderLayer)
def encoder_layer_layout(module: nn.Module, call: Call) -> Layout:
    return _transformer_layout(module, call, ["src"], ["src_key_padding_mask"], ["src_mask"])


@register_layout(nn.TransformerDecoderLayer)
def decoder_layer_layout(module: nn.Module, call: Call) -> Layout:
    return _transformer_layout(module, call, ["tgt", "memory"],
                               ["tgt_key_padding_mask", "memory_key_padding_mask"],
                               ["tgt_mask", "memory_mask"])


def _split(value: object, spec: Spec, batch_size: int) -> tuple[object, int | None]:
    """The tensor handed to ``vmap`` for one argument, and its ``in_dim``."""
    if spec == HEADS:
        return value.reshape(batch_size, -1, *value.shape[1:]), 0
    return value, spec


def _per_sample(value: object, spec: Spec) -> object:
    """Inside ``vmap``: give the sample back a batch dim of size 1 (none for HEADS; each
    batched leaf of a container)."""
    if isinstance(spec, CONTAINERS):
        return _on_batched_leaves(value, spec, Tensor.unsqueeze)
    return value if spec == HEADS else value.unsqueeze(spec)


def _on_batched_leaves(value: object, specs: object, fn: Callable[[Tensor, int], Tensor]
                       ) -> object:
    """A container argument with ``fn(leaf, dim)`` applied to each leaf its ``specs`` (the
    same container of dims or None) batch, the others as they are."""
    leaves, tree = tree_flatten(value)
    return tree_unflatten([leaf if dim is None else fn(leaf, dim)
                           for leaf, dim in zip(leaves, tree_flatten(specs)[0])], tree)


def _rerun_overrides(module: nn.Module, call: Call, layout: Layout) -> dict[str, object]:
    """``layout.rerun_kwargs`` for arguments not given positionally."""
    if not layout.rerun_kwargs:
        return {}
    names = list(inspect.signature(module.forward).parameters)[:len(call.args)]
    return {k: v for k, v in layout.rerun_kwargs.items() if k not in names}


def unit_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters of a fallback unit, its children's included, by qualified name."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _random_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Submodules that draw random numbers when called in training mode (dropout), by name."""
    found = {}
    for name, sub in module.named_modules():
        if not sub.training:
            continue
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0 or \
                isinstance(sub, nn.MultiheadAttention) and sub.dropout > 0 or \
                isinstance(sub, nn.RNNBase) and sub.dropout > 0 and sub.num_layers > 1:
            found[name or type(sub).__name__] = sub  # an RNN's: between its layers
    return found


def _draws_random_numbers(unit: nn.Module, name: str, sub: nn.Module, args: tuple) -> None:
    """Forward pre-hook on a unit's dropout during its re-run: refused, where it is called (a
    dropout the forward never calls, peft's ``lora.Embedding``'s, draws nothing)."""
    raise PerSampleHooksError(
        f"{type(unit).__name__}, a unit of the torch.func fallback, calls dropout in training "
        f"mode ({name}, {type(sub).__name__}) in its forward: re-run per sample it draws a new "
        "random mask, so per-sample gradients would not be those of the step. Use dropout=0 "
        "there, or model.eval() for the step")


def _is_cache(value: object) -> bool:
    """Whether ``value`` is a transformers key/value cache (``transformers.cache_utils.Cache``,
    told by its classes' names and module, transformers is not imported)."""
    return any(klass.__name__ == "Cache" and klass.__module__.startswith("transformers")
               for klass in type(value).__mro__)


def _batched_initial_state(module: nn.RNNBase | nn.RNNCellBase, args: tuple, kwargs: dict
                           ) -> tuple[tuple, dict] | None:
    """Forward pre-hook on the recurrent layers and cells of a fallback unit during the re-run:
    give each call an initial state batched over the samples of ``vmap``. Without one the
    layer makes its zeros with ``torch.zeros`` (not batched) and writes each sample's state into
    them in place, which ``vmap`` refuses ("output with shape [1, h] doesn't match the
    broadcast shape [B, 1, h]"); a given state not batched (a learned ``h0``) is made batched
    by adding batched zeros."""
    data = args[0] if args else kwargs.get("input")
    if not isinstance(data, Tensor):  # a PackedSequence: as it is (see call_grad1)
        return None
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if isinstance(module, nn.RNNCellBase):
        lead = [data.shape[0]] if data.dim() == 2 else []  # else unbatched [in]
    else:
        lead = [module.num_layers * (2 if module.bidirectional else 1)]
        if data.dim() == 3:  # else unbatched [T, in]
            lead.append(data.shape[0 if module.batch_first else 1])
    lstm = isinstance(module, (nn.LSTM, nn.LSTMCell))
    sizes = [module.hidden_size]
    if lstm:
        sizes = [getattr(module, "proj_size", 0) or module.hidden_size, module.hidden_size]
    zeros = [data.new_zeros((*lead, size)) for size in sizes]  # new_zeros: batched under vmap
    if hx is None:
        hx = tuple(zeros) if lstm else zeros[0]
    elif isinstance(hx, Tensor):
        hx = hx + zeros[0]
    else:
        hx = tuple(h + z for h, z in zip(hx, zeros))
    if len(args) > 1:
        return (args[0], hx, *args[2:]), kwargs
    return args, {**kwargs, "hx": hx}


class FallbackRule(Rule):
    """Per-sample gradients of a whole unit by ``torch.func.vmap`` over ``torch.func.vjp``."""

    keeps_outputs = True  # compared with the re-run's (call_grad1)
    forms_rerun = True

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """The calls' per-sample gradients summed as they are re-run, one dense form per
        parameter: a unit called in a loop over time steps holds one ``[B, *p]`` each, not
        one per call."""
        params = unit_parameters(module)
        sums: dict[str, Tensor] = {}
        for call in calls:
            for name, grad in zip(names, call_grad1(module, call, params, names, 1.0)):
                sums[name] = grad if name not in sums else sums[name] + grad
        return {name: [Dense(sums[name])] for name in names}

    def batch_size(self, module: nn.Module, call: Call) -> int:
        return _lookup_layout(module)(module, call).batch_size

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        for call in calls:
            try:
                layout = _lookup_layout(module)(module, call)
            except PerSampleHooksError:
                layout = None  # refused by the re-run, after the step's own checks
            if layout is not None:
                refuse_unbatched_outputs(module, call, layout, name)
            for argument, value in [*enumerate(call.args), *call.kwargs.items()]:
                if _is_cache(value):
                    raise PerSampleHooksError(
                        f"'{name}' ({type(module).__name__}) is handled by the torch.func "
                        "fallback, which re-runs its forward; it was called with a key/value "
                        f"cache ({type(value).__name__}, argument {argument!r}) that its "
                        "forward extends: the re-run would read and extend it again. Call the "
                        "model with use_cache=False for training steps")
        for sub_name, sub in module.named_modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm) and \
                    uses_batch_statistics(sub, sub.training):
                raise batch_statistics_error(sub, f"{name}.{sub_name}" if sub_name else name)
        iterating = iterating_spectral_norms(module) if len(calls) > 1 else []
        if iterating:
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) was called {len(calls)} times in the step "
                f"with a spectral norm in training mode ({', '.join(iterating)}): each call ran "
                "a power iteration of its own, and the fallback's re-run per sample has the "
                "last call's vectors only. Call it once per step, or put the spectral norm in "
                "eval mode (its vectors are then fixed)")

    def grad1(self, module: nn.Module, calls: Sequence[Call], scale: float,
              out: dict[str, Tensor]) -> None:
        """Call by call, each call's dense gradients added into ``out`` before the next re-run
        (the forms' sums would take one more ``[B, *p]`` per parameter, and a pass to scale)."""
        params = unit_parameters(module)
        names = [n for n in params if n in out]
        for i, call in enumerate(calls):
            grads = call_grad1(module, call, params, names, scale)
            for n, g in zip(names, grads):
                if i == 0:
                    out[n].copy_(g)
                else:
                    out[n].add_(g)


@contextlib.contextmanager
def registrations_kept(module: nn.Module) -> Iterator[None]:
    """The unit's parameters and buffers registered as they were before one re-run of its
    forward, whatever that forward registers (peft's LoRA on ``MultiheadAttention`` merges its
    weights into new parameters and back in every forward): each re-run starts from them."""
    saved = [(sub, dict(sub._parameters), dict(sub._buffers), set(vars(sub)))
             for sub in module.modules()]
    try:
        yield
    finally:
        for sub, parameters, buffers, attributes in saved:
            for name in (set(vars(sub)) - attributes) & (parameters.keys() | buffers.keys()):
                delattr(sub, name)
            sub._parameters.clear()
            sub._parameters.update(parameters)
            sub._buffers.clear()
            sub._buffers.update(buffers)


@contextlib.contextmanager
def values_kept(module: nn.Module, who: str) -> Iterator[Callable[[], list[str]]]:
    """The values of the unit's buffers as they were before its re-runs (one updated in place,
    a count of calls, is copied back once they are over); gives a function that names those
    the re-runs changed so far. A parameter changed in place cannot be restored: refused,
    whatever else the re-runs raised."""
    versions = [(prefix, sub, name, p, p._version) for prefix, sub in module.named_modules()
                for name, p in sub._parameters.items() if p is not None]
    copies = [(name, b, b._version, b.clone()) for name, b in module.named_buffers()]

    def changed() -> list[str]:  # (by value too: torch.ao's fused fake quantization writes
        return [name for name, b, version, copy in copies  # its buffers with no new version)
                if b._version != version or not _same_values(b, copy)]
    try:
        yield changed
    finally:
        with torch.no_grad():
            for _, buffer, version, copy in copies:
                if buffer._version != version or not _same_values(buffer, copy):
                    buffer.copy_(copy)
        for prefix, sub, name, parameter, version in versions:
            if parameter._version != version:
                whose = f"the forward of its '{prefix}' ({type(sub).__name__})" if prefix \
                    else "its forward"
                raise PerSampleHooksError(
                    f"{who}, a unit of the torch.func fallback: {whose} changes the parameter "
                    f"{name!r} in place; the fallback re-runs that forward and cannot restore "
                    "the value. Give the module a rule, or change the parameter outside its "
                    "forward")


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal, NaN where NaN (a buffer left uninitialized)."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(
        torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all()))


@contextlib.contextmanager
def conversions_checked(module: nn.Module) -> Iterator[None]:
    """``Module._apply`` (``.to``, ``.float()``, ``.cuda()``, ...) of the unit's modules made a
    check during its re-runs: a conversion that changes no dtype and no device (Switch
    Transformers' router runs ``self.classifier = self.classifier.to(self.dtype)`` in each
    forward) leaves the tensors as they are, any other is refused. torch's ``_apply`` assigns
    ``param.data = param.to(...)``; under ``torch.func`` that ``to`` gives a transform's
    wrapper, and a parameter that is not one (a frozen one, swapped in as a plain tensor)
    takes the wrapper's storage-less body: the next read of it is a segmentation fault
    (pytorch#184876); one that is a wrapper refuses (``mutating directly with .data``) and
    sent the unit to the loop over samples."""
    subs = list(module.modules())
    saved = [vars(sub).get("_apply") for sub in subs]
    for sub in subs:
        vars(sub)["_apply"] = partial(_conversion_in_rerun, sub)
    try:
        yield
    finally:
        for sub, own in zip(subs, saved):
            if own is None:
                vars(sub).pop("_apply", None)
            else:
                vars(sub)["_apply"] = own


def _conversion_in_rerun(sub: nn.Module, fn: Callable[[Tensor], Tensor], recurse: bool = True
                         ) -> nn.Module:
    """``sub._apply(fn)`` inside a re-run (:func:`conversions_checked`): nothing changed where
    ``fn`` keeps every tensor's dtype and device, else refused."""
    if recurse:
        for child in sub.children():
            child._apply(fn)
    for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
        for key, value in table.items():
            if value is None:
                continue
            with torch.no_grad():
                applied = fn(value)
            if applied.dtype != value.dtype or applied.device != value.device:
                raise PerSampleHooksError(
                    f"{type(sub).__name__}: its forward converts its {kind} {key!r} "
                    f"({value.dtype} on {value.device} to {applied.dtype} on {applied.device}: "
                    "Module.to, .float(), .cuda(), ...); the torch.func fallback re-runs that "
                    "forward and cannot convert the module's tensors in place. Convert the "
                    "model before the step's forward, or give the module a rule")
    return sub


@contextlib.contextmanager
def without_cudnn(off: bool = True) -> Iterator[None]:
    """cuDNN off (if ``off``), the user's other cuDNN flags kept: for the re-run of a unit with
    recurrent layers, since cuDNN's RNN has no batching rule for ``torch.func.vmap``, takes no
    strided initial state and has no backward in eval mode ("cudnn RNN backward can only be
    called in training mode"); torch's own RNN kernels run instead (the CPU has no cuDNN)."""
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = enabled and not off
    try:
        yield
    finally:
        torch.backends.cudnn.enabled = enabled


def _who(module: nn.Module, name: str | None) -> str:
    """``'path' (Type)`` of a unit, for messages; the model itself is named by its type."""
    who = type(module).__name__
    return who if name in (None, "", who) else f"'{name}' ({who})"


def refuse_unbatched_outputs(module: nn.Module, call: Call, layout: Layout,
                             name: str | None = None) -> None:
    """Refuse a call of a unit with an output that reaches the loss without the batch at its
    batch dim (``name``: the unit's path, for the message)."""
    who = _who(module, call.name if name is None else name)
    for j, passes in enumerate(call.grads):
        if not passes:
            continue
        spec, shape = layout.outputs[j], tuple(passes[0].shape)
        if not shape:
            raise PerSampleHooksError(
                f"{who}: output {j} is a scalar that reaches the loss: a reduction over the "
                "batch computed inside the module (the loss of a model called with labels=, in "
                "transformers), whose samples per-sample gradients cannot tell apart. Compute "
                "the loss outside it: call the model without labels and the loss on its logits "
                "(reduction='none' for per-sample losses), or make a submodule without the loss "
                "(the backbone) the unit. A term every sample's loss shares, computed from "
                "parameters alone (a flow layer's log-determinant, `H * W * log_scale.sum()`), "
                "is to be expanded to the batch inside the module, `logdet.expand(B)`, so that "
                "each sample's loss carries it")
        if spec is None or len(shape) <= spec or shape[spec] != layout.batch_size:
            raise PerSampleHooksError(
                f"{who}: output {j} received a gradient without a batch dim of size "
                f"{layout.batch_size} (shape {shape}); per-sample gradients need every output "
                "that reaches the loss to be batched. Pass batch_dim to add_hooks for this "
                "module if its batch is not dimension 0. An output computed from the module's "
                "parameters alone, which the module that calls it combines with the batch "
                "(peft DoRA's magnitude scale), needs that module as the unit: add_hooks(model, "
                "units=[its path]). An output of size 1 there is shared by the samples (learned "
                "positions computed from position ids [1, T], not from the batched input): give "
                "the module position ids [B, T] if it takes them, or freeze its parameters")


def call_grad1(module: nn.Module, call: Call, params: dict[str, nn.Parameter],
               names: Sequence[str], scale: float) -> tuple[Tensor, ...]:
    """Per-sample gradients ``[B, *p.shape]`` of ``params[n]`` for ``n`` in ``names``, from one
    call, times ``scale``."""
    layout = _lookup_layout(module)(module, call)
    refuse_unbatched_outputs(module, call, layout)
    who = _who(module, call.name)
    cotangents, out_specs, out_leaves = [], [], []
    for j, passes in enumerate(call.grads):
        if not passes:
            continue
        spec = layout.outputs[j]
        grad = summed_passes(passes)
        cotangents.append(grad * scale if scale != 1 else grad)
        out_specs.append(spec)
        out_leaves.append(j)

    flat_args, arg_specs, in_dims = [], [], []
    for value, spec in [*zip(call.args, layout.args), *zip(call.kwargs.values(),
                                                          layout.kwargs.values())]:
        split, dim = _split(value, spec, layout.batch_size) if spec is not None else (value, None)
        flat_args.append(split)
        arg_specs.append(spec)
        in_dims.append(dim if isinstance(split, Tensor) or isinstance(spec, CONTAINERS) else None)
    n_args, keys = len(call.args), list(call.kwargs)
    rerun_kwargs = _rerun_overrides(module, call, layout)
    frozen = {n: p.detach() for n, p in params.items() if n not in names}
    trainable = {n: params[n].detach() for n in names}

    def outputs(args: Sequence, kwargs: dict, weights: dict[str, Tensor]) -> list[Tensor]:
        with registrations_kept(module):
            output = forward({**frozen, **weights}, tuple(args), {**kwargs, **rerun_kwargs})
        leaves = tree_flatten(output)[0]
        return [leaves[j] for j in out_leaves]

    def rerun(values: list, grads: list, differentiate: Callable = torch.func.vjp
              ) -> tuple[list[Tensor], tuple[Tensor, ...]]:
        """One sample's outputs (its batch dim dropped) and per-sample gradients."""
        values = [_per_sample(v, s) if s is not None else v for v, s in zip(values, arg_specs)]
        args, kwargs = values[:n_args], dict(zip(keys, values[n_args:]))
        out, vjp = differentiate(lambda weights: outputs(args, kwargs, weights), trainable)
        (result,) = vjp([g.unsqueeze(s) for g, s in zip(grads, out_specs)])
        return [o.squeeze(s) for o, s in zip(out, out_specs)], tuple(result[n] for n in names)

    def vmapped_or_looped() -> tuple[list[Tensor], tuple[Tensor, ...], Exception | None]:
        """The samples' outputs and gradients under ``vmap``, else one sample at a time (with
        the error that sent them there)."""
        try:
            return (*torch.func.vmap(rerun, in_dims=(in_dims, out_specs),
                                     out_dims=(out_specs, 0))(flat_args, cotangents), None)
        except PerSampleHooksError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            failure = error
        norms = any(isinstance(m, nn.modules.batchnorm._NormBase) for m in module.modules())
        try:
            with ContiguousBatchNormGradients() if norms else contextlib.nullcontext():
                return (*_one_sample_at_a_time(partial(rerun, differentiate=_autograd_vjp),
                                               flat_args, in_dims, cotangents, out_specs,
                                               layout.batch_size), failure)
        except PerSampleHooksError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            raise _unbatchable(who, recurrent, error) from error

    # compute_* run under no_grad; the re-run is a differentiation: with grad enabled at the
    # vmap level too (else the CPU float32 LSTM's oneDNN kernel keeps no workspace for its
    # backward: "Expected a proper Tensor but got None ... for argument #22 'workspace'")
    recurrent = {n or ".": m for n, m in module.named_modules()
                 if type(m).forward in (nn.RNN.forward, nn.GRU.forward, nn.LSTM.forward,
                                        nn.RNNCell.forward, nn.GRUCell.forward,
                                        nn.LSTMCell.forward)}
    handles = [m.register_forward_pre_hook(_batched_initial_state, with_kwargs=True)
               for m in recurrent.values()]
    handles += [sub.register_forward_pre_hook(partial(_draws_random_numbers, module, name))
                for name, sub in (_random_modules(module) if call.training else {}).items()]
    forward = recorded_forward(module, {handle.id for handle in handles})
    try:
        with torch.enable_grad(), without_cudnn(bool(recurrent)), \
                power_iterations_off(module), values_kept(module, who) as changed, \
                conversions_checked(module):
            alone, grads, failure = vmapped_or_looped()
            with torch.no_grad():
                batched = _kept_outputs(call, out_leaves, alone) or \
                    outputs(call.args, call.kwargs, trainable)
                _outputs_agree(who, batched, alone, out_specs, failure is not None, changed())
    finally:
        for handle in handles:
            handle.remove()
    if failure is not None:
        warnings.warn(
            f"{who}, a unit of the torch.func fallback, is re-run one sample "
            "at a time, since torch.func cannot batch its forward "
            f"({type(failure).__name__}: {str(failure)[:160]}). Its per-sample gradients are "
            "exact, at the cost of a forward and backward of the unit per sample; smaller units "
            "whose forward vmap can batch (no branch on tensor values) are faster", stacklevel=2)
    return grads


def _sample(value: object, dim: object, b: int) -> object:
    """Sample ``b`` of one argument as ``vmap`` hands it over with ``in_dims`` ``dim``."""
    if dim is None:
        return value
    if isinstance(dim, CONTAINERS):
        return _on_batched_leaves(value, dim, lambda leaf, d: leaf.select(d, b))
    return value.select(dim, b)


def _autograd_vjp(fn: Callable[[dict[str, Tensor]], list[Tensor]], primals: dict[str, Tensor]
                  ) -> tuple[list[Tensor], Callable]:
    """``torch.func.vjp(fn, primals)`` by plain autograd, for the loop over samples: it also
    runs forwards that ``torch.func`` cannot transform (an ``autograd.Function`` without
    ``setup_context``: PhiMoE's router)."""
    leaves = {n: p.detach().requires_grad_() for n, p in primals.items()}
    with not_recorded():
        out = fn(leaves)

    def pullback(cotangents: list[Tensor]) -> tuple[dict[str, Tensor]]:
        pairs = [(o, g) for o, g in zip(out, cotangents) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                    [g for _, g in pairs], allow_unused=True)
        return ({n: torch.zeros_like(p) if g is None else g
                 for (n, p), g in zip(leaves.items(), grads)},)
    return [o.detach() for o in out], pullback


class ContiguousBatchNormGradients(TorchDispatchMode):
    """Hands ``batch_norm``'s backward (BatchNorm's, InstanceNorm's) a contiguous output
    gradient. torch's CPU kernel reads one of batch size 1 wrongly when its strides are a
    channels-last view's with the batch dim's stride C (a patch embedding's ``flatten(2)
    .transpose(1, 2)`` gives that one sample's gradient): per-sample gradients 100% off, in a
    plain loop over samples too (``vmap`` hands it the whole batch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_batch_norm_backward.default:
            args = (args[0].contiguous(), *args[1:])
        return func(*args, **(kwargs or {}))


def _one_sample_at_a_time(rerun: Callable, values: list, in_dims: list, grads: list[Tensor],
                          out_dims: list[int], batch_size: int
                          ) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """``vmap(rerun, in_dims=(in_dims, out_dims), out_dims=(out_dims, 0))(values, grads)`` by a
    loop over the samples, for forwards that ``vmap`` cannot batch (a branch on tensor values,
    a shape that depends on them: a mixture of experts' routing) or ``torch.func`` cannot
    transform (``rerun`` then differentiates by plain autograd): the samples' outputs, stacked
    along ``out_dims``, and their gradients."""
    outputs, sample_grads = [], []
    for b in range(batch_size):
        out, sample = rerun([_sample(v, d, b) for v, d in zip(values, in_dims)],
                            [g.select(d, b) for g, d in zip(grads, out_dims)])
        outputs.append(out)
        sample_grads.append(sample)
    return ([torch.stack(column, d) for column, d in zip(zip(*outputs), out_dims)],
            tuple(torch.stack(column) for column in zip(*sample_grads)))


def _kept_outputs(call: Call, leaves: list[int], alone: list[Tensor]) -> list[Tensor] | None:
    """The outputs ``leaves`` of ``call`` as its forward gave them (:attr:`Call.outputs`), or
    None where they were not kept, or changed in place since, or are not in the dtype of the
    re-run (``alone``: a call cast to its parameters' dtype)."""
    if call.outputs is None:
        return None
    kept = [call.outputs[j] for j in leaves]
    if any(k is None or k[0]._version != k[1] or k[0].dtype != a.dtype
           for k, a in zip(kept, alone)):
        return None
    return [tensor for tensor, _ in kept]


def _outputs_agree(who: str, batched: list[Tensor], alone: list[Tensor],
                   dims: list[int], looped: bool, changed: Sequence[str] = ()) -> None:
    """Refuse a unit whose samples, re-run alone (``looped``: one at a time, else under
    ``vmap``), give other outputs than the batch did: its forward depends on the batch (a
    statistic over the batch, ``y - y.mean(0)``; a branch on a batch-wide value,
    ``if x.sum() > 0``; a limit on tokens per expert), draws random numbers, or updates a
    state at each call (the buffers the re-runs ``changed``), so its per-sample gradients are
    not those of the step. Each output is compared within ``sqrt(eps)`` of its largest entry
    (rounding of batched against single kernels)."""
    for j, (whole, parts, dim) in enumerate(zip(batched, alone, dims)):
        if whole.shape[dim] == 1 and whole.shape[:dim] + whole.shape[dim + 1:] == \
                parts.shape[:dim] + parts.shape[dim + 1:]:
            whole = whole.expand_as(parts)  # shared by the samples, as the capture took it
        if whole.shape != parts.shape:
            b, off = 0, f"of shape {tuple(parts.shape)}, not {tuple(whole.shape)}"
        else:
            largest = whole.abs().max().clamp_min(1e-30)
            gap, others = (whole - parts).abs(), [d for d in range(whole.dim()) if d != dim]
            gap = gap.amax(dim=others) if others else gap  # (no dim list: all of them)
            b = int(gap.argmax())
            off = f"off by {float(gap[b] / largest):.1e} of its largest entry"
            if not (gap > torch.finfo(whole.dtype).eps ** 0.5 * largest).any():
                continue
        how = "one at a time (vmap cannot batch it)" if looped else "under torch.func.vmap"
        differs = (f"{who}, a unit of the torch.func fallback, gives sample {b} another output "
                   f"{j} when re-run alone, {how}, than in the batch ({off})")
        if changed:
            shown = ", ".join(map(repr, changed[:3])) + (" ..." if len(changed) > 3 else "")
            raise PerSampleHooksError(
                f"{differs}, and its re-runs changed its buffers {shown} in place: its forward "
                "updates a state at each call (an observer's range, as torch.ao's fake "
                "quantization with its observer on; running statistics), so the samples re-run "
                "from the state the batch left get other outputs, and the step's outputs "
                "depend on what came before them. Freeze that state for the steps that take "
                "per-sample quantities (after calibrating, model.apply(torch.ao.quantization."
                "disable_observer); BatchNorm: eval mode)")
        raise PerSampleHooksError(
            f"{differs}: its forward depends on the batch (a statistic over the batch, as "
            "`y - y.mean(0)`; a branch on a value over the batch, as `if x.sum() > 0`; a "
            "capacity limit per expert) or draws random numbers (noise, stochastic depth), so "
            "its per-sample gradients would not be those of the step. Compute such statistics "
            "and branches per sample, or outside the unit; draw random numbers outside it, or "
            "use model.eval() for the step")


def _unbatchable(who: str, recurrent: dict[str, nn.Module], error: Exception
                 ) -> PerSampleHooksError:
    """The refusal of a unit that neither ``vmap`` nor a loop over samples could re-run."""
    if recurrent:
        layers = ", ".join(f"'{n}' ({type(m).__name__})" for n, m in recurrent.items())
        return PerSampleHooksError(
            f"{who}, a unit of the torch.func fallback with recurrent "
            f"layers {layers}, could not be re-run per sample ({error}). Let the recurrent "
            "layers have their own rule (exact, packed sequences included, and faster): "
            "do not make the module that calls them a unit (units=), or move them out of it")
    return PerSampleHooksError(
        f"{who}, a unit of the torch.func fallback, could not be re-run per "
        f"sample, under torch.func.vmap nor one sample at a time ({type(error).__name__}: "
        f"{error}). Make smaller modules units (units=), or give the values its forward needs "
        "from outside (e.g. an attention mask built before the call)" + (
            ". An index among its inputs that is not split by sample (a graph's edge_index "
            "into the rows of every graph) picks rows of other samples: a unit's forward must "
            "compute each sample from that sample's inputs alone"
            if isinstance(error, IndexError) else "") + (
            ". TorchScript functions in the forward (torch.jit.script) may not vmap on "
            "CUDA: PYTORCH_JIT=0 in the environment runs them as Python"
            if "TorchScript" in str(error) else ""))
