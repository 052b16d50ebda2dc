"""Outputs of calls made without the batch, followed to where the model broadcasts them over it.

Next to the capture (:mod:`per_sample_hooks.capture`), and like it knowing nothing about
layers. A hooked module called on indices that are no sample's, made inside the forward
(nanoGPT's positions ``wpe(torch.arange(T))``, ``[T, d]``; T5's relative-position buckets
``[T, T]``, whose ``[T, T, heads]`` output each layer of the stack adds to its ``[B, heads,
T, T]`` scores as ``bias.permute(2, 0, 1)[None]``), returns a value every sample shares: its
rows are positions, not samples, even where there are as many (``T == B``: the shapes cannot
tell). Its output is returned as a :class:`SharedOutput` (a tensor subclass, the same values)
whose ops are watched:

- an op of followed values and constants only (a permute, ``[None]``, a scale) gives a
  followed value, with the op recorded (a :class:`~per_sample_hooks.raw_uses.Derived` from
  the output);
- a broadcasting op (``+``, ``*``, ``where``, matmul's batch dims, in place into the batch's
  tensor: ``scores += bias``) with a tensor of the batch, where a followed value has size 1
  (or no dim) at the batch dim, is a *use site*: the op runs with that value expanded over the
  batch (a view, the same values), and the gradient of that view, captured, is the value's
  per-sample gradient. ``compute_*`` pulls each site's back through the recorded ops to the
  output (``torch.func.vjp``, vmapped over the samples) and adds them: the call is then one of
  the batch, its input expanded over the samples and its output gradients per sample, and its
  rule reads it as any other;
- a followed value with the batch's size at the batch dim that meets a tensor of the batch
  there (the call's rows were the samples after all: token ids built inside the model,
  ``torch.cat([bos, ids], 1)``), or that reaches another hooked module, ends the following:
  the call stays as captured;
- anything else (a followed value in another op with the batch, as the weight of a product,
  written in place, through dropout, or followed for more than :data:`MOST_OPS` ops) is
  recorded as the call's :attr:`SharedCall.problem`, and ``compute_*`` refuses the step
  naming the module and the op, where the call's rows cannot be the samples.

Followed: single-tensor calls on one integer tensor (the indices) that no autograd op made, not
the model's input nor a view of it, nor the model's own parameter or buffer, after some module
saw the batch. Assumption, as everywhere in this library: a tensor of the batch has it at the
module's ``batch_dim``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from .capture import (
    BROADCASTING_OPS,
    BroadcastOutput,
    Call,
    HookState,
    capture_gradient,
    map_tensors,
    op_name,
    writes_in_place,
)
from .errors import PerSampleHooksError
from .raw_uses import Derived, Site, gradients_by_value

OUTPUT = "output"
"""The name of the followed call's output in its values' recipes."""

MOST_OPS = 32
"""How many ops of its own a followed value may go through before it meets the batch."""

_BROADCASTING = BROADCASTING_OPS | {"scaled_dot_product_attention"}
"""Ops that broadcast their tensor arguments against each other (``scaled_dot_product_attention``
its ``attn_mask`` against the scores, T5's relative position bias under SDPA)."""

_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to", "repeat", "tile"})

_RANDOM = frozenset({"dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout",
                     "dropout1d", "dropout2d", "dropout3d", "bernoulli", "rand_like",
                     "randn_like", "randint_like", "multinomial", "normal"})


@dataclass
class SharedCall:
    """What the following of one call's output found (:attr:`Call.shared`)."""
    name: str
    batch: int
    batch_dim: int
    #: the output had ``batch`` rows at the batch dim: perhaps the samples after all
    ambiguous: bool
    output: Tensor  # detached
    state: HookState
    #: the use sites, each with its gradients (one per backward pass)
    sites: list[tuple[Site, list[Tensor]]] = field(default_factory=list)
    #: what the model did with a followed value that cannot be followed (refused)
    problem: str | None = None
    #: the call's rows were the samples (the following ended; the call is as captured)
    batched: bool = False
    ops_left: int = MOST_OPS

    @property
    def following(self) -> bool:
        return not self.batched and self.problem is None

    def end(self, problem: str | None = None) -> None:
        """Stop following: the call's rows are the samples where it may be so (``ambiguous``
        and no site yet), else ``problem`` (None: no site and not ambiguous, the step's
        batch-size check refuses it)."""
        if self.ambiguous and not self.sites:
            self.batched = True
        elif problem is not None and self.problem is None:
            self.problem = problem


def follows(call: Call, first: object, output: Tensor, batch: int | None,
            model_input_ids: set[int]) -> bool:
    """Whether ``call`` (one tensor input ``first``, output ``output``) is followed: see the
    module's docstring."""
    return (batch is not None and isinstance(first, Tensor) and len(call.args) == 1
            and not call.kwargs and first.grad_fn is None and not first.is_floating_point()
            and not first.is_complex() and call.shared_input is None
            and id(first) not in model_input_ids and (first._base is None or id(first._base)
                                                       not in model_input_ids)
            and (output.dim() <= call.batch_dim or output.shape[call.batch_dim] != 1))


def follow(call: Call, output: Tensor, batch: int, state: HookState) -> Tensor:
    """``output`` followed (a :class:`SharedOutput`), noted in ``call.shared``."""
    dim = call.batch_dim
    ambiguous = output.dim() > dim and output.shape[dim] == batch
    call.shared = SharedCall(call.name, batch, dim, ambiguous, output.detach(), state)
    state.status.followed.append(call.shared)
    return SharedOutput.wrap(output, call.shared, Derived(OUTPUT, output.detach()))


class SharedOutput(Tensor):
    """A value computed from a followed call's output alone (see the module's docstring)."""

    #: the call, and how the value is computed from its output
    followed: tuple[SharedCall, Derived]

    @staticmethod
    def wrap(t: Tensor, shared: SharedCall, recipe: Derived) -> Tensor:
        value = t.as_subclass(SharedOutput)
        value.followed = (shared, recipe)
        return value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if any(issubclass(t, BroadcastOutput) for t in types):  # its own rules: not followed
            for value in _following(args, kwargs):
                value.followed[0].end(f"meets an output expanded over the batch in {name}")
            return NotImplemented
        with torch._C.DisableTorchFunctionSubclass():
            values = _following(args, kwargs)
            if not values:
                return func(*args, **kwargs)
            if name in _RANDOM or (args and any(args[0] is v for v in values)
                                   and writes_in_place(name)):
                for value in values:
                    value.followed[0].end(
                        f"draws random numbers from it in {name} (a re-run would draw others)"
                        if name in _RANDOM else f"writes into it in place ({name})")
                return func(*args, **kwargs)
            base = name.rstrip("_")
            if base.startswith("__i") and base.endswith("__"):
                base = f"__{base[3:]}"
            if base in _BROADCASTING:
                met = _met_the_batch(args, kwargs, values, "matmul" in base)
                if met is not None:
                    return func(*met[0], **met[1])
            result = func(*args, **kwargs)
            if name in _EXPANDS and args[0] is values[0] and isinstance(result, Tensor):
                expanded = _expanded_over_the_batch(func, name, args, kwargs, result)
                if expanded is not None:
                    return expanded
            values = _following(args, kwargs)
            if not values or not isinstance(result, (Tensor, tuple, list)) or \
                    name in ("_base", "grad"):
                return result  # (shape, dtype, ...: no value)
            shared = values[0].followed[0]
            if any(value.followed[0] is not shared for value in values):
                for value in values:
                    value.followed[0].end(f"meets another such output in {name}")
                return result
            if any(_of_the_batch(t, shared.batch_dim, shared.batch) is not None
                   for t in tree_flatten((args, kwargs))[0]):
                shared.end(f"meets a tensor of the batch in {name}, otherwise than broadcast")
                return result
            shared.ops_left -= 1
            if shared.ops_left < 0:
                shared.end(f"is followed for more than {MOST_OPS} ops without meeting the "
                           "batch")
                return result
            recipes = tree_map(lambda a: a.followed[1] if isinstance(a, SharedOutput) else a,
                               (args, kwargs))
            if isinstance(result, Tensor):
                return cls.wrap(result, shared, Derived(None, None, func, *recipes)) \
                    if type(result) is Tensor else result
            return type(result)(
                cls.wrap(t, shared, Derived(None, None, func, *recipes, index=k))
                if type(t) is Tensor else t for k, t in enumerate(result))


def _following(args: tuple, kwargs: dict) -> list[SharedOutput]:
    """The arguments of an op that are followed values of calls still followed."""
    return [t for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, SharedOutput) and t.followed[0].following]


def _of_the_batch(t: object, dim: int, batch: int) -> Tensor | None:
    """``t`` where it is a tensor of the batch (``batch`` rows at ``dim``): see
    :func:`_may_be_batch`."""
    if isinstance(t, Tensor) and t.dim() > dim and t.shape[dim] == batch and _may_be_batch(t):
        return t
    return None


def _may_be_batch(t: Tensor) -> bool:
    """Neither a followed value nor a parameter (a position table ``[T, d]``; an input that
    requires grad may be the batch)."""
    return not (isinstance(t, SharedOutput) and t.followed[0].following or
                isinstance(t, torch.nn.Parameter))


def _met_the_batch(args: tuple, kwargs: dict, values: list[SharedOutput], matmul: bool
                   ) -> tuple[tuple, dict] | None:
    """The arguments of a broadcasting op with each followed value broadcast over the batch
    (size 1 or no dim at the batch dim, once the arguments' shapes are aligned at their right)
    replaced by a use site; None where no other argument is a tensor of the batch there. A
    followed value with the batch's size there, where another is broadcast (token ids built in
    the forward plus positions ``arange(T)``), holds the samples: no longer followed."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    rank = max(t.dim() for t in tensors)
    dim, batch = values[0].followed[0].batch_dim, values[0].followed[0].batch

    def at_batch(t: Tensor) -> int | None:
        k = dim - (rank - t.dim())
        return t.shape[k] if k >= 0 else None

    broadcast = {id(v) for v in values if at_batch(v) in (None, 1)}
    for value in values:
        if id(value) not in broadcast and at_batch(value) == batch and broadcast:
            value.followed[0].end()  # (its rows meet the samples: they are the samples)
    if not any(at_batch(t) == batch for t in tensors if _may_be_batch(t)):
        return None
    for value in _following(args, kwargs):
        if id(value) not in broadcast or (matmul and value.dim() < 2):
            value.followed[0].end(f"meets the batch in {'a product' if matmul else 'an op'} "
                                  "where it is not broadcast over the samples")
            return None
    return tree_map(lambda t: _use_site(t, rank) if isinstance(t, SharedOutput) and
                    t.followed[0].following else t, (args, kwargs))


def _expanded_over_the_batch(func: Callable[..., Any], name: str, args: tuple, kwargs: dict,
                             result: Tensor) -> Tensor | None:
    """``value.expand(B, ...)`` (``expand_as``, ``broadcast_to``, ``repeat``, ``tile``) of a
    followed value with size 1 (or no dim) at the batch dim, to the batch's size there: the
    model broadcasts it over the samples (``pos[None].expand(B, -1, -1)``), a use site (the
    op run on the site, repeated once there); None for any other expand."""
    value = args[0]
    shared = value.followed[0]
    dim, rank = shared.batch_dim, result.dim()
    k = dim - (rank - value.dim())
    if rank <= dim or result.shape[dim] != shared.batch or (k >= 0 and value.shape[k] != 1):
        return None
    site = _use_site(value, rank)
    if name in ("expand", "expand_as", "broadcast_to"):
        return func(site, *args[1:], **kwargs)
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    at = len(sizes) - rank + dim
    return func(site, [*sizes[:at], 1, *sizes[at + 1:]])


def _use_site(value: SharedOutput, rank: int) -> Tensor:
    """``value`` padded to ``rank`` dims and expanded over the batch at the batch dim, its
    gradient captured as the value's per-sample gradient (:class:`Site`)."""
    shared, recipe = value.followed
    padded = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
    shape = list(padded.shape)
    shape[shared.batch_dim] = shared.batch
    view = padded.expand(shape)
    grads: list[Tensor] = []
    shared.sites.append((Site(recipe, value.shape, shared.batch_dim), grads))
    capture_gradient(view, grads, shared.state)
    for notify in shared.state.listeners.on_capture:
        notify(view)
    return view


def resolve(call: Call) -> None:
    """Make a followed call one of the batch: its output gradients per sample from its use
    sites, its input expanded over the samples (or refuse what could not be followed)."""
    shared, call.shared = call.shared, None
    if shared.problem is not None:
        raise PerSampleHooksError(
            f"'{shared.name}' was called on indices of shape {tuple(call.args[0].shape)} made "
            "inside the forward, not the batch's (positions, relative-position buckets), and "
            "its output, shared by the samples, was followed to where the model broadcasts it "
            f"over the batch; but the model {shared.problem}, so its per-sample gradients "
            "cannot be told apart there. Give it the batch (`emb(pos.expand(B, -1))`), or make "
            "a module that holds the call and every use of its output one unit of the "
            "torch.func fallback, add_hooks(model, units=[...])")
    if shared.batched or not shared.sites:
        return  # as captured: the rows are the samples, or the step's batch check refuses
    passes = len(call.grads[0])
    if any(len(grads) != passes for _, grads in shared.sites):
        raise PerSampleHooksError(
            f"'{shared.name}' was called on indices made inside the forward and its output "
            "broadcast over the batch in several places, which the step's backward passes "
            "reached in different numbers: its per-sample gradients cannot be paired by pass. "
            "Take one backward of the summed losses")
    dim, batch = shared.batch_dim, shared.batch
    call.grads[0][:] = [_pulled_back(shared, k).movedim(0, dim) for k in range(passes)]
    call.args = map_tensors(lambda t: t.unsqueeze(dim).expand(
        *t.shape[:dim], batch, *t.shape[dim:]), call.args)
    call.outputs = None  # (of the call without the batch)


def _pulled_back(shared: SharedCall, k: int) -> Tensor:
    """``[B, *output.shape]``: the per-sample gradients of the output in backward pass ``k``,
    its sites' pulled back through their recorded ops and added."""
    total = None
    for value, per_sample in gradients_by_value((site, grads[k])
                                                for site, grads in shared.sites):
        if not value.is_parameter:  # (the output itself: as it is)
            with torch.enable_grad():
                _, vjp = torch.func.vjp(lambda out, v=value: v.evaluate({OUTPUT: out}),
                                        shared.output)
                (per_sample,) = torch.func.vmap(vjp)(per_sample)
        total = per_sample if total is None else total + per_sample
    return total
