"""Capture: hook registration and removal, one :class:`Call` record per module call.

This file knows nothing about any layer. A forward hook records the module's inputs; tensor
hooks registered on the module's outputs inside that forward hook record the gradients that
reach them. Tensor hooks (not module backward hooks) keep working when an in-place op such as
``ReLU(inplace=True)`` follows the layer.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache, partial, wraps
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .errors import PerSampleHooksError
from .vision_language import FREEZE_IMAGE_SIDE

if TYPE_CHECKING:
    from .shared_outputs import SharedCall

STATE_ATTRIBUTE = "_per_sample_hooks"


class Call:
    """What one call of a hooked module left behind: its inputs and its output gradients.

    ``grads[j]`` lists, one per backward pass, the gradients reaching output leaf ``j``
    (leaves in ``torch.utils._pytree`` order). Batch dims are as the module saw them;
    :meth:`activation` and :meth:`backprop` move the batch dim to the front.

    ``per_sample``: set (by whoever :attr:`Listeners.on_gradient` calls) when the call's
    per-sample gradients were formed as its output gradient arrived; its inputs and output
    gradient are then dropped (``args`` empty, ``grads`` emptied in place).

    ``watched[k]``: the gradients (one per backward pass) reaching the ``k``-th tensor *inside*
    the call's forward that an add-on asked to watch (:attr:`HookState.watchers`); ``note``:
    what that add-on recorded about the call (opaque here). Empty and None for most modules.

    ``shared_input``: where the call's first input is (a view of) a parameter or buffer of the
    model, not broadcast over its batch dim (a relative position table run through an MLP):
    ``(kind, name)`` of it; every sample shares that input, whatever its size, so its rows are
    not samples. None for most calls.

    ``outputs``: for a rule that compares a re-run of the forward with it
    (:attr:`Rule.keeps_outputs <per_sample_hooks.rules.base.Rule>`), the call's output leaves,
    detached, each with its version at the forward (None for a leaf that is not a tensor);
    None for other rules, under ``torch.compile`` and under ``torch.autocast``.

    ``hooks``: weak references to the gradient hooks of the call's outputs (and watched
    tensors). Autograd's graph holds those hooks: once all are gone, so is every graph through
    the call's outputs, and a call that has received no gradient by then never will
    (:attr:`unreachable`: a forward that no backward followed, e.g. evaluation with grad
    enabled). Empty when unknown (under ``torch.compile``): never unreachable.
    """

    __slots__ = ("args", "kwargs", "grads", "batch_dim", "training", "versions", "per_sample",
                 "watched", "note", "hooks", "values", "recomputed", "outputs", "shared_input",
                 "shared", "name", "__weakref__")

    def __init__(self, args: tuple, kwargs: dict, n_outputs: int, batch_dim: int, training: bool,
                 compiling: bool = False, name: str | None = None):
        self.name = name  # the module's path in the model, for messages
        self.args = args
        self.kwargs = kwargs
        self.grads: list[list[Tensor]] = [[]] if n_outputs == 1 else \
            [[] for _ in range(n_outputs)]
        self.batch_dim = batch_dim
        self.training = training
        # Under torch.compile a traced ``_version`` is a constant of the trace, not the tensor's
        # live counter: in-place changes after the forward cannot be detected there.
        if len(args) == 1 and not compiling and isinstance(args[0], Tensor):
            self.versions = [args[0]._version]  # most calls (no comprehension's frame)
        else:
            self.versions = [None if compiling or not isinstance(a, Tensor) else a._version
                             for a in args]
        self.per_sample: dict[str, Tensor] | None = None
        self.watched: list[list[Tensor]] = []
        self.note: object = None
        self.hooks: list[weakref.ref] = []
        self.values: list[tuple[str, str, Tensor, int]] | None = None
        self.recomputed = False  # recorded during a backward (activation checkpointing)
        self.outputs: list[tuple[Tensor, int] | None] | None = None
        # ("parameter" or "buffer", name): the model's own tensor the call's first input is
        # (a view of), rows and all: a table every sample shares, not a batch
        self.shared_input: tuple[str, str] | None = None
        # a call on indices made inside the forward whose output is followed to where the
        # model broadcasts it over the batch (:mod:`per_sample_hooks.shared_outputs`)
        self.shared: SharedCall | None = None

    @property
    def has_grads(self) -> bool:
        return self.per_sample is not None or any(self.grads)

    @property
    def unreachable(self) -> bool:
        """Whether no gradient can reach this call any more: none has, and the autograd graphs
        through its outputs are gone (see ``hooks``)."""
        return (bool(self.hooks) and not self.has_grads and not any(self.watched)
                and all(hook() is None for hook in self.hooks))

    @property
    def n_passes(self) -> int:
        """Number of backward passes that reached this call's outputs."""
        return max((len(g) for g in self.grads), default=0)

    def activation(self, index: int = 0) -> Tensor:
        """Positional input ``index`` with the batch dim first."""
        return _batch_first(self.args[index], self.batch_dim)

    def backprop(self, leaf: int = 0) -> Tensor | None:
        """Gradient reaching output leaf ``leaf``, summed over backward passes, batch dim first."""
        passes = self.grads[leaf]
        if not passes:
            return None
        return _batch_first(summed_passes(passes), self.batch_dim)

    def backprops(self, leaf: int = 0) -> list[Tensor]:
        """One gradient per backward pass for output leaf ``leaf``, batch dim first."""
        return [_batch_first(g, self.batch_dim) for g in self.grads[leaf]]

    @property
    def batch_size(self) -> int:
        if self.per_sample:
            return next(iter(self.per_sample.values())).shape[0]
        for a in (*self.args, *self.kwargs.values()):  # (a model called by keywords)
            if isinstance(a, Tensor) and a.dim() > self.batch_dim:
                return a.shape[self.batch_dim]
        for passes in self.grads:
            if passes and passes[0].dim() > self.batch_dim:
                return passes[0].shape[self.batch_dim]
        raise PerSampleHooksError("cannot tell the batch size of a call with no tensor input")

    def has_other_float_dtype(self, dtype: torch.dtype) -> bool:
        """Whether a captured floating-point tensor (input or output gradient) is not ``dtype``
        (cheap: no pytree walk unless the call had keyword arguments)."""
        for t in self.args:
            if isinstance(t, Tensor) and t.dtype != dtype and t.is_floating_point():
                return True
        for passes in (*self.grads, *self.watched):
            for g in passes:
                if g.dtype != dtype and g.is_floating_point():
                    return True
        if self.kwargs:
            return any(isinstance(t, Tensor) and t.dtype != dtype and t.is_floating_point()
                       for t in tree_flatten(self.kwargs)[0])
        return False

    def cast_(self, dtype: torch.dtype) -> None:
        """Convert every captured floating-point tensor to ``dtype`` (e.g. bfloat16 captures of
        an autocast forward to the float32 of the parameters), in this record."""
        def convert(t: object) -> object:
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t
        self.args, self.kwargs = map_tensors(convert, (self.args, self.kwargs))
        self.grads = [[convert(g) for g in passes] for passes in self.grads]
        self.watched = [[convert(g) for g in passes] for passes in self.watched]
        self.versions = [a._version if isinstance(a, Tensor) else None for a in self.args]

    def release(self) -> None:
        """Drop every captured tensor (the gradients' lists in place: the capture hooks hold
        them)."""
        self.args, self.kwargs, self.versions, self.per_sample, self.note = (), {}, [], None, None
        self.outputs = self.shared = None
        for passes in (*self.grads, *self.watched):
            passes.clear()

    def only_pass(self, index: int) -> Call:
        """A view of this record holding only backward pass ``index`` (nothing copied)."""
        view = Call.__new__(Call)
        view.args, view.kwargs, view.batch_dim = self.args, self.kwargs, self.batch_dim
        view.training, view.versions, view.per_sample = self.training, self.versions, None
        view.grads = [[passes[index]] if index < len(passes) else [] for passes in self.grads]
        view.watched = [[passes[index]] if index < len(passes) else []
                        for passes in self.watched]
        view.note, view.hooks, view.outputs = self.note, [], self.outputs
        view.name, view.shared = self.name, None
        return view

    def modified_inputs(self) -> list[int]:
        """Positions of tensor inputs modified in place since the forward."""
        return [i for i, (a, v) in enumerate(zip(self.args, self.versions))
                if v is not None and a._version != v]

    def modified_value(self, module: nn.Module) -> tuple[str, str] | None:
        """``(kind, name)`` of the first of :attr:`values` (``(kind, name, tensor, version at
        the forward)``: the parameters of a module whose rule reads their values, the buffers
        of every module in eval mode) modified in place since the forward and still
        ``module``'s (FSDP2 swaps in other tensors outside its forward), or None."""
        for kind, name, t, version in self.values or ():
            if t._version != version and (module.get_parameter(name) if kind == "parameter"
                                          else module.get_buffer(name)) is t:
                return kind, name
        return None


def summed_passes(passes: list[Tensor]) -> Tensor:
    """The sum of the gradients one captured tensor received, one per backward pass."""
    return passes[0] if len(passes) == 1 else torch.stack(passes).sum(0)


def _isolated(leaf: object) -> object:
    return leaf.clone() if isinstance(leaf, Tensor) and leaf.requires_grad else leaf


AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def autocast_device_types() -> list[str]:
    """The device types for which this thread has ``torch.autocast`` on."""
    def on(device_type: str) -> bool:
        try:
            return torch.is_autocast_enabled(device_type)
        except TypeError:  # torch < 2.4: no device argument
            return torch.is_autocast_cpu_enabled() if device_type == "cpu" else \
                device_type == "cuda" and torch.is_autocast_enabled()
    return [d for d in AUTOCAST_DEVICE_TYPES if on(d)]


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward: a forward then is a recomputation of
    activation checkpointing (``torch.utils.checkpoint``, transformers'
    ``activation_checkpointing_enable``), not a new micro-batch. Reentrant checkpointing runs
    the forward without grad (nothing recorded) and records the recomputed call, whose outputs
    get the gradients; non-reentrant records both, and the recomputed one gets none."""
    return torch._C._current_graph_task_id() != -1


def refused_by_reentrant_checkpointing(error: RuntimeError) -> bool:
    """Whether ``error`` is torch's refusal of a backward that leaves ``.grad`` alone
    (``torch.autograd.grad``, ``inputs=``) through reentrant activation checkpointing."""
    return "use_reentrant=True" in str(error)


NON_REENTRANT = ("use_reentrant=False (transformers: model.activation_checkpointing_enable("
                 "activation_checkpointing_kwargs={'use_reentrant': False}), or "
                 "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                 "False}) in versions that do not have it)")
"""The fix for a backward that reentrant checkpointing refuses, as the refusals spell it."""


_RE_RUNNING: ContextVar[bool] = ContextVar("per_sample_hooks_re_running", default=False)
"""Inside :func:`not_recorded` (context-local, as grad mode is)."""


@contextmanager
def not_recorded() -> Iterator[None]:
    """Calls of hooked modules inside are not recorded, as inside a ``torch.func`` transform:
    for a rule's re-run of a forward by plain autograd (the fallback's loop over samples)."""
    token = _RE_RUNNING.set(True)
    try:
        yield
    finally:
        _RE_RUNNING.reset(token)


def _grad_mode_outside_transforms() -> bool:
    """Grad mode outside the ``torch.func`` transforms running now (``grad`` / ``jacrev``
    turn it on inside): that of the outermost one's caller."""
    try:
        from torch._functorch.pyfunctorch import coerce_cinterpreter  # noqa: PLC0415
        stack = torch._C._functorch.get_interpreter_stack() or ()
    except (ImportError, AttributeError):  # other torch versions: as it is here
        return torch.is_grad_enabled()
    for interpreter in map(coerce_cinterpreter, stack):  # the outermost first
        if hasattr(interpreter, "prev_grad_mode"):
            return interpreter.prev_grad_mode()
    return torch.is_grad_enabled()


def _not_recorded_here(compiling: bool) -> bool:
    """Whether a ``torch.func`` transform (or :func:`not_recorded`) is running: calls there (the
    fallback's re-runs of a module's forward, or the user's own transforms) are not steps and
    are not recorded. Under ``torch.compile`` (``compiling``) dynamo traces the hook; the stack
    is its own business."""
    return not compiling and (torch._C._functorch.peek_interpreter_stack() is not None
                              or _RE_RUNNING.get())


# the forward hooks of every module (register_module_forward_hook), which run before a
# module's own: the library's hook sees what they return
_GLOBAL_FORWARD_HOOKS = getattr(nn.modules.module, "_global_forward_hooks", {})
GLOBAL_HOOKS_WARNING = (
    "per_sample_hooks: a global forward hook (torch.nn.modules.module."
    "register_module_forward_hook) is registered; it runs before the library's hook on every "
    "hooked module. One that only observes (a profiler, FlopCounterMode) is fine; one that "
    "changes a hooked module's output makes the per-sample quantities wrong, and nothing can "
    "tell: register such a hook on the module instead (module.register_forward_hook)")


def _substituted(module: nn.Module, name: str, recurse: bool) -> tuple[str, str] | None:
    """``(module name, parameter name)`` of a plain tensor that stands in a parameter's place
    in ``module`` (below it too: ``recurse``) for this call, as ``torch.func.functional_call``
    puts there; None if every one is an ``nn.Parameter``."""
    holders = module.named_modules(prefix=name) if recurse else ((name, module),)
    for prefix, holder in holders:
        for key, t in holder._parameters.items():
            if t is not None and not isinstance(t, nn.Parameter):
                return prefix, key
    return None


def capture_gradient(leaf: Tensor, sink: list[Tensor], owner: HookState | None = None,
                     call: tuple[nn.Module, Call] | None = None, compiling: bool = False,
                     copy: bool = False) -> list[Callable]:
    """Append to ``sink`` each gradient that reaches ``leaf`` (one per backward pass); on the
    step's first arrival set ``owner.status.backward_seen`` and call each of
    ``owner.listeners.on_backward``; for a call's output (``call``: ``(module, record)``), call
    ``owner.listeners.on_gradient(module, record)`` when one arrives (if set then). Returns the
    hooks registered (autograd's graph holds them, nothing else does: see :attr:`Call.hooks`).

    A tensor hook on ``leaf`` (not a pre-hook on ``leaf.grad_fn``: it also fires when ``leaf``
    is an ``inputs=`` edge of the backward, as ``dp.OutputEdges`` uses). It sees the
    gradient of the value the module returned even when an in-place op (``ReLU(inplace=True)``)
    later changes ``leaf`` -- unless ``leaf`` is a view: an in-place op on a view rebases its
    history and its hook never fires. A Linear on ``[B, *, d]`` returns a reshaped view of its
    matmul (a batch_first LSTM a transposed view of its output), so for a view of a whole
    contiguous base (:func:`gradient_tensor`) a tensor hook on the base catches the gradient of
    the base (= of the view, reshaped or permuted) in the passes where the view's hook did not
    fire (the view's hook fires first when it fires at all). Each hook
    does its work in one Python frame: it runs for every captured call of every step, and is
    added without a handle (:func:`add_tensor_hook`) unless ``compiling``. A None gradient (what
    a node with several outputs, cuDNN's RNN, gives the hooks of those the loss did not use) is
    no arrival. A gradient that requires grad, or any under grad mode (a backward with
    ``create_graph=True``; its seed, a constant, does not require grad) is noted
    in ``owner.status.create_graph``. ``copy``: each gradient is kept as a copy (one the
    backward below aliases: :meth:`Rule.aliases_output_gradient
    <per_sample_hooks.rules.base.Rule.aliases_output_gradient>`). A hook the user registers on
    ``leaf`` after the forward runs after this one: the gradient it leaves takes the captured
    one's place (:class:`FollowedHooks`).
    """
    follow = None if compiling else [sink, copy, False]  # (True: a later hook follows)

    def arrived(grad: Tensor | None) -> None:
        if grad is None:  # an unused output of a node with several (a cuDNN RNN's h_n)
            return
        sink.append(grad.clone() if copy else grad)
        if owner is not None:
            if grad.requires_grad or torch.is_grad_enabled():  # (a constant gradient, the
                owner.status.create_graph = True  # seed's, under create_graph too)
            if not owner.status.backward_seen:
                owner.status.backward_seen = True
                for notify in owner.listeners.on_backward:
                    notify()
            if call is not None:
                if call[1].recomputed:  # reentrant checkpointing's recomputed outputs
                    owner.reentrant_checkpointing = True
                if owner.listeners.on_gradient is not None and not (follow and follow[2]):
                    owner.listeners.on_gradient(*call)  # (not before a later hook's change)

    base = gradient_tensor(leaf)
    if base is leaf:  # the hook itself: one frame per arrival
        add_tensor_hook(leaf, arrived, follow)
        return [arrived]

    def view_hook(grad: Tensor | None) -> None:
        fired[0] = grad is not None
        arrived(grad)

    shape, strides = leaf.shape, None if leaf.is_contiguous() else leaf.stride()

    def base_hook(grad: Tensor | None) -> None:
        if fired[0]:  # the view's own hook had it
            fired[0] = False
            return
        if grad is not None:
            arrived(as_view_of(grad, shape, strides))

    fired = [False]
    add_tensor_hook(leaf, view_hook, follow)
    add_tensor_hook(base, base_hook, follow)
    return [view_hook, base_hook]


def add_tensor_hook(tensor: Tensor, hook: Callable[[Tensor], None],
                    follow: list | None = None) -> None:
    """``tensor.register_hook(hook)`` for a hook that is never removed (it lives as long as the
    graph): the same steps, without the handle, the dispatch check and the import that are
    most of ``register_hook``'s cost (about 4 us of a captured call's 10 on a small model). The
    table is an ``OrderedDict`` (a :class:`FollowedHooks`, given ``follow``: the list the hook
    appends to, whether it keeps copies, and whether a later hook follows it: set by the
    table), so that later hooks (the user's) are added to it
    as usual; the key is the hook itself (``register_hook``'s keys are integers). A tensor
    subclass (``__torch_function__``), or ``follow`` None (under ``torch.compile``), goes
    through ``register_hook``."""
    if type(tensor) is not Tensor or follow is None:
        tensor.register_hook(hook)
        return
    if not tensor.requires_grad:
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = FollowedHooks()
        hooks.sinks = [follow]
        if tensor.grad_fn is not None:
            tensor.grad_fn._register_hook_dict(tensor)
    elif type(hooks) is FollowedHooks:
        hooks.sinks.append(follow)
    OrderedDict.__setitem__(hooks, hook, hook)


class FollowedHooks(OrderedDict):
    """The table of a captured output's tensor hooks (``tensor._backward_hooks``). Autograd
    calls them in order, each with the gradient the one before left, and goes on with what the
    last leaves: a hook the user registers on the output after the forward (``h.register_hook(
    lambda g: g * c)``, a gradient reversal, a schedule's scale) runs after the library's, so
    each is wrapped as it is registered to put the gradient it leaves (returns, or changes in
    place) in the place of the one the library's hooks before it captured (``sinks``: the lists
    they append to, whether they keep copies, and whether a later hook follows them, which
    leaves the call to be formed when its gradients are read, not on arrival)."""

    __slots__ = ("sinks",)
    sinks: list[list]

    def __setitem__(self, key: object, hook: Callable) -> None:
        if self.sinks:
            for follow in self.sinks:
                follow[2] = True
            hook = _followed(hook, [tuple(follow[:2]) for follow in self.sinks])
        super().__setitem__(key, hook)


def _followed(hook: Callable, sinks: list[tuple[list[Tensor], bool]]) -> Callable:
    """``hook``, then the gradient it leaves in the place of the last one in each of ``sinks``
    (for the pass that just gave it one)."""
    @wraps(hook)  # (autograd's messages name the user's hook)
    def followed(grad: Tensor) -> Tensor | None:
        result = hook(grad)
        left = grad if result is None else result
        for sink, copy in sinks:
            if sink:
                sink[-1] = left.clone() if copy else left
        return result
    return followed


def gradient_tensor(leaf: Tensor) -> Tensor:
    """The tensor whose gradient is ``leaf``'s, laid out as :func:`as_view_of` says, even
    after an in-place op on ``leaf``: ``leaf``'s base when ``leaf`` is a view of all of a
    contiguous base with a history (reshaped, or with its dims permuted: a batch_first
    ``nn.LSTM``'s output, ``out.transpose(0, 1)``), else ``leaf``. Ask autograd for this
    tensor's gradient edge (an in-place op on a view takes the view's original edge out of
    the graph; the base's stays)."""
    base = leaf._base
    if base is None or base.grad_fn is None or base.numel() != leaf.numel() \
            or not base.is_contiguous() or leaf.storage_offset() != base.storage_offset():
        return leaf
    if leaf.is_contiguous():
        return base
    sizes_and_strides = sorted((stride, size) for size, stride in
                               zip(leaf.shape, leaf.stride()) if size > 1)
    dense = 1
    for stride, size in sizes_and_strides:  # each dim steps over the smaller ones: a permutation
        if stride != dense:
            return leaf
        dense *= size
    return base


def as_view_of(grad: Tensor, shape: torch.Size, strides: tuple[int, ...] | None) -> Tensor:
    """The gradient of a view (``shape``; ``strides``, None where contiguous) from the
    gradient ``grad`` of the base that :func:`gradient_tensor` gave for it."""
    if strides is None:
        return grad.reshape(shape)
    return grad.contiguous().as_strided(shape, strides)


def map_tensors(fn: Callable[[Tensor], object], tree: Any) -> Any:
    """``tree_map`` of ``fn`` over the tensors of ``tree``, called once per distinct tensor: a
    tensor passed several times (``attn(x, x, x)``) maps to one result, so that a re-run of the
    forward on the result takes the path the forward took (MultiheadAttention projects
    ``query is key is value`` in one packed product, else one by one: other roundings)."""
    results: dict[int, object] = {}  # by id: every key's tensor is alive in ``tree``

    def once(t: object) -> object:
        if not isinstance(t, Tensor):
            return t
        if id(t) not in results:
            results[id(t)] = fn(t)
        return results[id(t)]
    return tree_map(once, tree)


def detach_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as recorded: each positional tensor detached once, keeping the
    aliasing of the call (see :func:`map_tensors`; a flat loop, it runs on every module call);
    keyword tensors as they are, but for one also passed positionally (the same detached
    tensor)."""
    if len(args) == 1 and not kwargs:  # most modules: one input
        return ((args[0].detach(),) if isinstance(args[0], Tensor) else args), kwargs
    detached: dict[int, Tensor] = {}
    for a in args:
        if isinstance(a, Tensor) and id(a) not in detached:
            detached[id(a)] = a.detach()
    if not detached:
        return args, kwargs
    args = tuple([detached.get(id(a), a) if isinstance(a, Tensor) else a for a in args])
    if kwargs:
        kwargs = {k: detached.get(id(v), v) if isinstance(v, Tensor) else v
                  for k, v in kwargs.items()}
    return args, kwargs


def _carries_gradient(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in (*args, *kwargs.values()))


def _to_batch(t: object, dim: int, batch: int) -> object:
    """``t`` expanded (a view) to ``batch`` along ``dim`` when it has size 1 there."""
    if not isinstance(t, Tensor) or t.dim() <= dim or t.shape[dim] != 1:
        return t
    shape = list(t.shape)
    shape[dim] = batch
    return t.expand(shape)


class BroadcastOutput(Tensor):
    """An output of size 1 at the batch dim expanded over the batch (a view, nothing copied),
    so that each sample's copy gets that sample's gradient: right where the model broadcasts
    it against the batch's tensors (``h + positions``), each op keeping the batch dim where it
    is. An op on it whose result moves, merges, selects or reduces the batch dim (Swinv2's
    ``table.view(-1, heads)[index]``: the samples' gradients would all reach sample 0's copy)
    is recorded in the step's :attr:`StepStatus.broadcast_misuse` and refused by
    ``compute_*``; one that cannot run on the expanded view (an in-place op) is refused at
    once."""

    #: the module's name, its batch dim, the batch size and the step's status
    expanded: tuple[str, int, int, StepStatus]

    @staticmethod
    def wrap(t: Tensor, name: str, batch_dim: int, batch: int, status: StepStatus) -> Tensor:
        view = t.as_subclass(BroadcastOutput)
        view.expanded = (name, batch_dim, batch, status)
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        views = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, BroadcastOutput)]
        name = op_name(func)
        if args and isinstance(args[0], BroadcastOutput) and not kwargs:
            args = _repeated_once_per_sample(name, args)
        if name.rstrip("_") in _SCATTERS_FROM and any(
                isinstance(t, BroadcastOutput) for t in (*args[3:], kwargs.get("src"))):
            raise _refused_at_once(views[0], name, "reads it row by row through an index")
        with torch._C.DisableTorchFunctionSubclass():  # (the view's own methods too)
            if args and isinstance(args[0], BroadcastOutput) and writes_in_place(name) and \
                    args[0].stride(args[0].expanded[1]) == 0:
                raise _refused_at_once(args[0], name, "writes into it in place (every "
                                       "sample's copy is one memory location)")
            if name in _ALONG_A_DIM and args and isinstance(args[0], BroadcastOutput) and \
                    _along_the_batch(name, args, kwargs, args[0].dim(), args[0].expanded[1]):
                raise _refused_at_once(args[0], name, "works along its batch dim (over the "
                                       "samples' copies: other values, or the samples' "
                                       "gradients given to other copies)")
            if name == "linear" and isinstance(kwargs.get("weight", args[1:2] and args[1]),
                                               BroadcastOutput):
                raise _refused_at_once(views[0], name, "takes it as a weight (expanded, the "
                                       "weight of every sample at once)")
            if name == "dropout" and args and isinstance(args[0], BroadcastOutput):
                return _dropped_once(func, args, kwargs)
            if name.rstrip("_") in BROADCASTING_OPS:
                args, kwargs = _aligned_at_the_batch(args, kwargs, name)
            elif name == "einsum":
                args = _aligned_in_einsum(args)
            elif name in ("expand", "expand_as", "broadcast_to") and len(args) > 1 and \
                    isinstance(args[0], BroadcastOutput):
                args = (_aligned_to(args[0], _target_dims(name, args)), *args[1:])
            try:
                result = func(*args, **kwargs)
            except (RuntimeError, IndexError) as error:
                raise _refused_at_once(views[0], name, f"failed ({error})",
                                       _other_rows(views[0], args, kwargs)) from error
        if name.startswith("new_") or name == "_base":  # (factories: not derived from the
            return result  # view; _base: torch.compile's tracing reads it)
        for view in views:
            module, dim, batch, status = view.expanded
            if _picks_batch_rows(name, args, kwargs, view, dim) or any(
                    isinstance(t, Tensor) and (t.dim() <= dim or t.shape[dim] != batch)
                    for t in tree_flatten(result)[0]):
                status.broadcast_misuse = status.broadcast_misuse or (module, name)
                return result
        return _still_expanded(result, args, kwargs, views[0])


def _dropped_once(func: Callable, args: tuple, kwargs: dict) -> Tensor:
    """``F.dropout`` / ``torch.dropout`` of an expanded output: one mask drawn for one copy,
    as the unexpanded output draws it (the same random numbers: the plain model's forward),
    and every sample's copy times it (on the view, one mask per copy was drawn)."""
    view, rest = args[0], args[1:]
    p = kwargs.get("p", rest[0] if rest else 0.5)
    training = kwargs.get("training", kwargs.get("train", rest[1] if len(rest) > 1 else True))
    if not training or not p:
        return func(*args, **kwargs)  # (the view itself)
    mask = func(torch.ones_like(view.narrow(view.expanded[1], 0, 1)), p, True)
    return BroadcastOutput.wrap(view * mask, *view.expanded)


def _still_expanded(result: object, args: tuple, kwargs: dict, view: BroadcastOutput
                     ) -> object:
    """``result`` of an op on expanded outputs and on no other tensor with the batch's rows,
    one tensor of ``view``'s shape (``1 + e``, ``e * scale``, ``e.tanh()``) or ``e`` times a
    weight (``F.linear(e, w)``, ``e @ w``): its copies are equal too, and it is watched as they
    are (wrapped), so that its later uses are aligned and checked as theirs. Any other result
    is left as it is (``e.mean(0)`` may have ``B`` rows by chance: ``T == B``)."""
    _, dim, batch, _ = view.expanded
    if type(result) is not Tensor or any(
            isinstance(t, Tensor) and not isinstance(t, BroadcastOutput) and t.dim() > dim
            and t.shape[dim] == batch for t in tree_flatten((args, kwargs))[0]):
        return result  # met the samples' own tensors: per sample from here on
    if result.shape == view.shape or (
            _times_a_weight(args, view) and result.dim() == view.dim()):
        return BroadcastOutput.wrap(result, *view.expanded)
    return result


def _times_a_weight(args: tuple, view: BroadcastOutput) -> bool:
    """Whether an op's arguments are ``view`` and a weight of at most two dims (``F.linear(e,
    w)``, ``e @ w``): each copy of ``view`` times the same weight."""
    return len(args) >= 2 and args[0] is view and isinstance(args[1], Tensor) and \
        not isinstance(args[1], BroadcastOutput) and args[1].dim() <= 2


BROADCASTING_OPS = frozenset({
    "add", "sub", "mul", "div", "true_divide", "where", "maximum", "minimum", "max", "min",
    "pow", "lerp", "addcmul", "addcdiv", "masked_fill", "clamp", "clip", "atan2", "arctan2",
    "hypot", "fmax", "fmin", "logaddexp", "logaddexp2", "copysign", "xlogy", "remainder",
    "fmod", "floor_divide", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_xor", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__floordiv__", "__mod__", "__eq__",
    "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__or__", "matmul",
    "__matmul__", "__rmatmul__"})
"""Ops that broadcast their tensor arguments against each other (entry by entry; matmul over
its batch dims, each operand's last two dims a matrix)."""

_ALONG_A_DIM = frozenset({
    "sum", "mean", "nansum", "nanmean", "prod", "std", "var", "amax", "amin", "max", "min",
    "argmax", "argmin", "median", "logsumexp", "all", "any", "norm", "cumsum", "cumprod",
    "cummax", "cummin", "logcumsumexp", "softmax", "log_softmax", "softmin", "normalize",
    "sort", "argsort", "flip", "roll", "diff"})
"""Ops that reduce, scan or reorder their first argument along the dims their ``dim`` (or
``dims``) argument names."""


def _along_the_batch(name: str, args: tuple, kwargs: dict, ndim: int, dim: int) -> bool:
    """Whether ``name`` reduces, scans or reorders its first argument, of ``ndim`` dims,
    along its batch dim ``dim`` (``e.mean(0)``, ``e.flip(0)``, ``e.softmax(0)``): its result
    may keep the batch's size there (``T == B``, or all of it), and either its values differ
    from the unexpanded output's (``cumsum``) or the samples' gradients reach other copies."""
    dims = kwargs.get("dim", kwargs.get("dims"))
    if dims is None:  # positional: (x, dim) -- (x, p, dim) for norm/normalize, roll's shifts
        at = {"norm": 2, "normalize": 2, "roll": 2}.get(name, 1)
        dims = args[at] if len(args) > at else None
    if name in ("flip", "roll") and dims is None:  # roll without dims: flattened
        return name == "roll"
    if isinstance(dims, int):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return False  # (a reduction over every dim drops the batch: told by its shape)
    return any(d % ndim == dim for d in dims)


def _target_dims(name: str, args: tuple) -> int:
    """The number of dims ``expand``, ``expand_as`` or ``broadcast_to`` gives its first
    argument."""
    target = args[1]
    if isinstance(target, Tensor):
        return target.dim()
    return len(target) if isinstance(target, (tuple, list, torch.Size)) else len(args) - 1


def _aligned_to(view: BroadcastOutput, width: int) -> Tensor:
    """``view`` (batch dim 0) with singleton dims after its batch dim up to ``width`` dims, as
    :func:`_aligned_at_the_batch` gives it to a wider tensor (an explicit ``expand`` to that
    shape aligns the trailing dims as broadcasting does)."""
    if view.expanded[1] != 0 or view.dim() >= width or view.dim() < 1:
        return view
    return view.reshape(view.shape[0], *[1] * (width - view.dim()), *view.shape[1:])


def _aligned_in_einsum(args: tuple) -> tuple:
    """``einsum``'s operands with each expanded output (batch dim 0) whose subscripts begin
    with ``...`` given singleton dims after its batch dim, as many as another operand's
    ``...`` has more (the ellipsis dims broadcast, aligned at their right: see
    :func:`_aligned_at_the_batch`)."""
    if not args or not isinstance(args[0], str) or "..." not in args[0]:
        return args
    listed = len(args) == 2 and isinstance(args[1], (list, tuple))
    operands = list(args[1] if listed else args[1:])
    subscripts = args[0].split("->")[0].replace(" ", "").split(",")
    if len(subscripts) != len(operands):
        return args
    spans = [t.dim() - len(sub.replace("...", "")) if "..." in sub else None
             for t, sub in zip(operands, subscripts)]
    widest = max((n for n in spans if n is not None), default=0)
    for k, (t, sub, span) in enumerate(zip(operands, subscripts, spans)):
        if isinstance(t, BroadcastOutput) and sub.startswith("...") and 0 < span < widest:
            operands[k] = _aligned_to(t, t.dim() + widest - span)
    return (args[0], operands) if listed else (args[0], *operands)


def writes_in_place(name: str) -> bool:
    """``fill_``, ``masked_fill_``, ``t[i] = v``, ``+=``: an op that writes into its first
    argument."""
    return name == "__setitem__" or (
        name.endswith("_") and not name.endswith("__") and
        name not in ("requires_grad_", "share_memory_", "retain_grad_")) or (
        name.startswith("__i") and name[3:-2] in {"add", "sub", "mul", "truediv", "pow", "and",
                                                  "or", "floordiv", "mod"})


def _aligned_at_the_batch(args: tuple, kwargs: dict, name: str) -> tuple[tuple, dict]:
    """The arguments of a broadcasting op with each expanded output (batch dim 0) that has
    fewer dims than the widest argument given singleton dims after its batch dim: broadcasting
    aligns trailing dims, so the model's ``h [B, T, D] + e [1, D]`` broadcasts ``e`` over
    ``B`` and ``T``, but expanded to ``[B, D]`` its samples would meet the positions (an
    error, or silently the wrong rows where ``T == B``); as ``[B, 1, D]`` they meet the
    samples. (matmul: an operand of two dims or more, a matrix broadcast over the other's
    batch dims, a learned query ``[1, K, d]`` against keys ``[B, H, T, d]``.)"""
    width = max(t.dim() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor))
    least = 2 if "matmul" in name else 1

    def narrow(t: object) -> bool:
        return isinstance(t, BroadcastOutput) and least <= t.dim() < width

    if not any(map(narrow, tree_flatten((args, kwargs))[0])):
        return args, kwargs
    return tree_map(lambda t: _aligned_to(t, width) if narrow(t) else t, (args, kwargs))


_SCATTERS_FROM = frozenset({"scatter", "scatter_add", "scatter_reduce"})
"""Ops that read their source ``src`` at the positions of an index: an expanded output as the
source would be read in its first copies only (its backward cannot even give its gradient)."""


def _refused_at_once(view: BroadcastOutput, op: str, what: str, other_rows: int | None = None
                     ) -> PerSampleHooksError:
    """The refusal of an op that cannot run on the expanded ``view``, in the forward; where
    the op met a tensor with ``other_rows`` rows at the batch dim, those rows are not the
    samples, and that is the refusal."""
    module, dim, batch, status = view.expanded
    status.consumed = True  # the next forward starts a clean step
    if other_rows is None:
        return broadcast_misuse_error("", module, op, what)
    return PerSampleHooksError(
        f"'{module}' was called with batch size 1 and its output, broadcast over the "
        f"{batch} samples of the step, met in the model's {op} a tensor of {other_rows} rows "
        f"at dim {dim}: that tensor's rows are not the samples (the images of a vision "
        "tower, one sample holding two or none; the crops of an image; a zero-shot head's "
        "prompts), so the layers that computed them cannot have per-sample gradients. "
        f"{FREEZE_IMAGE_SIDE}; or give the model one such row per sample")


def _other_rows(view: BroadcastOutput, args: tuple, kwargs: dict) -> int | None:
    """The number of rows at the batch dim of a tensor among an op's arguments that has
    neither the step's batch size there nor 1 (None: none has)."""
    _, dim, batch, _ = view.expanded
    return next((t.shape[dim] for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, Tensor) and not isinstance(t, BroadcastOutput)
                 and t.dim() > dim and t.shape[dim] not in (1, batch)), None)


def _repeated_once_per_sample(name: str, args: tuple) -> tuple:
    """``view.repeat(B, ...)`` (``tile``): the model repeats its size-1 output over the batch
    (timm XCiT's positional encoding); already expanded, the view is repeated once there."""
    if name not in ("repeat", "tile") or len(args) < 2:
        return args
    view, sizes = args[0], args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    _, dim, batch, _ = view.expanded
    at = len(sizes) - view.dim() + dim
    if not 0 <= at < len(sizes) or sizes[at] != batch:
        return args
    return view, (*sizes[:at], 1, *sizes[at + 1:])


def _picks_batch_rows(name: str, args: tuple, kwargs: dict, view: Tensor, dim: int) -> bool:
    """Whether an indexing op on ``view`` (its first argument) selects along its batch dim
    ``dim``: ``view[0]``, ``view[idx]``, ``view.select(dim, 0)``: the samples' gradients would
    reach the rows picked, whatever the result's shape (it may be ``B`` by chance: ``T == B``)."""
    if not args or args[0] is not view:
        return False
    if name == "__getitem__":
        item = _indexing(args[1], view.dim(), dim)
        return not (isinstance(item, slice) and item == slice(None))
    if name in ("select", "index_select", "narrow", "unbind", "gather"):
        picked = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        return isinstance(picked, int) and picked % view.dim() == dim
    return False


def _indexing(index: object, ndim: int, dim: int) -> object:
    """What ``t[index]`` puts at dim ``dim`` of an ``ndim``-dim ``t`` (``slice(None)``: all of
    it); an Ellipsis stands for the dims the items around it do not index."""
    items = [i for i in (index if isinstance(index, tuple) else (index,)) if i is not None]
    ellipsis = next((k for k, i in enumerate(items) if i is Ellipsis), None)
    if ellipsis is not None:
        before, after = items[:ellipsis], items[ellipsis + 1:]
        items = [*before, *[slice(None)] * (ndim - len(before) - len(after)), *after]
    return items[dim] if dim < len(items) else slice(None)


def op_name(func: Callable) -> str:
    """``reshape``; ``T`` for a property's getter."""
    name = getattr(func, "__name__", None) or str(func)
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" \
        else name


def broadcast_misuse_error(prefix: str, module: str, op: str, what: str
                           ) -> PerSampleHooksError:
    """The refusal of a model's ``op`` on the expanded output of ``module`` that ``what``
    (failed on the view, or did not keep the batch dim)."""
    return PerSampleHooksError(
        f"{prefix}'{module}' was called with batch size 1 and its output, broadcast over the "
        "batch, was expanded to the batch (a view) to tell the samples' gradients apart; but "
        f"the model's {op} on it {what}: its code uses that output otherwise than broadcast "
        "(a table reshaped then indexed, as Swinv2's relative position bias; a row picked; a "
        "reduction), and the samples' gradients would reach the wrong copies. Make a module "
        "that holds the call and every use of its output (the attention layer or block that "
        f"computes and uses it) {_BROADCAST_FIX}")


_BROADCAST_FIX = ("one unit of the torch.func fallback, add_hooks(model, units=[...]), or "
                  "add_hooks(..., broadcast=False) to leave such outputs as they are")


def _batch_first(t: Tensor, batch_dim: int) -> Tensor:
    return t if batch_dim == 0 else t.movedim(batch_dim, 0)


_live_states: weakref.WeakSet[HookState] = weakref.WeakSet()
"""Every live HookState, so that ``disable_hooks()`` with no model reaches all of them. It holds
no captured data: each model's records live in its own HookState."""


def _note_parameter_registration(module: nn.Module, name: str, param: object) -> None:
    """torch's global hook on every parameter registration (``module.weight =
    nn.Parameter(...)``, ``load_state_dict(assign=True)``, a model built): each live state
    notes that its modules' parameters may have been replaced (a flag: nothing else runs)."""
    for state in _live_states:
        state.parameters_registered = True


@cache
def _watch_parameter_registrations() -> None:
    """Register :func:`_note_parameter_registration` with torch, once per process."""
    register = getattr(nn.modules.module, "register_module_parameter_registration_hook", None)
    if register is not None:
        register(_note_parameter_registration)


class Buffers:
    """Storage reused across steps, per ``(module, purpose)``: per-sample buffers, persistent or
    held for one step, and add-ons' scratch tensors (opaque here)."""

    def __init__(self) -> None:
        self._persistent: dict[tuple[nn.Module, str], Tensor] = {}
        self._step: dict[tuple[nn.Module, str], Tensor] = {}
        self._scratch: dict[tuple[nn.Module, str], dict[str, Tensor]] = {}

    def get(self, module: nn.Module, name: str, batch_size: int, param: Tensor,
            step_only: bool = False) -> Tensor:
        """A ``[batch_size, *param.shape]`` buffer reused across steps, never zeroed.

        A smaller batch than before gets a view of the first rows of the existing buffer.
        ``step_only``: held until :meth:`end_step` (the next step's first forward), not through
        the next step's forward and backward.
        """
        key = (module, name)
        table = self._step if step_only else self._persistent
        buf = table.get(key)
        if (buf is None or buf.shape[1:] != param.shape or buf.shape[0] < batch_size
                or buf.dtype != param.dtype or buf.device != param.device):
            buf = torch.empty((batch_size, *param.shape), dtype=param.dtype, device=param.device)
            table[key] = buf
        return buf if buf.shape[0] == batch_size else buf[:batch_size]

    def scratch(self, module: nn.Module, purpose: str) -> dict[str, Tensor]:
        """A dict an add-on fills with tensors it reuses across steps for ``module``."""
        return self._scratch.setdefault((module, purpose), {})

    def held(self, step_only: bool = False) -> list[tuple[nn.Module, str]]:
        """The ``(module, name)`` keys of the buffers held (for one step: ``step_only``)."""
        return list(self._step if step_only else self._persistent)

    def end_step(self) -> None:
        """Free the buffers held for one step."""
        self._step.clear()

    def clear(self) -> None:
        self._persistent.clear()
        self._step.clear()
        self._scratch.clear()


@dataclass
class StepStatus:
    """Where the current step stands; a fresh one for each step (:meth:`HookState._new_step`)."""
    consumed: bool = False  # a compute_* call ended the step: the next forward starts anew
    backward_seen: bool = False  # a captured output received a gradient in this step
    forward_after_backward: str | None = None  # first module called after a backward
    released_by: str | None = None  # the call that dropped this step's records
    batch: int | None = None  # the first batch size > 1 captured in this step
    # the first module called with batch size 1, on an input with a gradient, after a batch
    shared_computation: str | None = None
    # a captured gradient that requires grad: a backward with create_graph=True ran through it
    create_graph: bool = False
    # (module, op): the first op on an output expanded over the batch that did not keep the
    # batch dim (:class:`BroadcastOutput`)
    broadcast_misuse: tuple[str, str] | None = None
    # (module, its batch dim, the dim it had the batch at): the first module called on a
    # view of a model's input with that input's batch dim moved (``emb(ids.T)``)
    batch_moved: tuple[str, int, int] | None = None
    # (module, parameter): the first call of a module with a plain tensor in place of one of
    # its parameters (``torch.func.functional_call`` with other tensors, fast weights)
    substituted: tuple[str, str] | None = None
    # the first module called inside the user's torch.func transform (its calls there are not
    # recorded) with gradients enabled outside it: a loss with derivatives of the model
    transformed: str | None = None
    # (module, type): the first unit, or module whose raw parameters are followed with no
    # tensor output, that returned a torch.distributions object (its uses are inside it)
    opaque_output: tuple[str, str] | None = None
    # (module, rows, batch): the first module called on a view of a model's input with fewer of
    # its rows than the batch (``inp(x[:bt, t])``: a loop over length-sorted sequences)
    row_subset: tuple[str, int, int] | None = None
    # the first module whose output of size 1 was expanded over the batch in this step
    expanded: str | None = None
    # calls of hooked modules in this step with the hooks disabled and grad mode on: not
    # recorded (where their outputs reach the loss, the unseen-use check's refusal says so)
    disabled_calls: int = 0
    # the first module called on a nested (ragged) tensor: not recorded
    nested: str | None = None
    # backward passes that backprop_hess ran through hooked outputs (each a column of the
    # loss' Hessian square root: the curvature keeps them apart; other passes add up)
    hess_passes: int = 0
    # the rows (dim 0) of the output backprop_hess seeded: each sample's loss Hessian
    hess_rows: int | None = None
    # the loss_type backprop_hess scaled its passes for ("mixed": two calls, two types)
    hess_loss_type: str | None = None
    # storage address -> (kind, name) of the model's parameters and buffers, formed the first
    # time in the step that a call's input may be one of them (:attr:`Call.shared_input`)
    model_tensors: dict[int, tuple[str, str]] | None = None
    # the calls whose outputs are followed in this step (:mod:`.shared_outputs`)
    followed: list[SharedCall] = field(default_factory=list)


@dataclass
class Listeners:
    """Add-ons' callbacks; each add-on subscribes (and unsubscribes) its own."""
    # per-step state of add-ons to reset when a step's records are cleared
    on_clear: list[Callable[[], None]] = field(default_factory=list)
    # called when the step's first captured gradient arrives (its forward is over), before
    # autograd reaches any parameter whose uses all went through captured tensors
    on_backward: list[Callable[[], None]] = field(default_factory=list)
    # told each tensor whose gradient is captured (a call's outputs, watched tensors)
    on_capture: list[Callable[[Tensor], None]] = field(default_factory=list)
    # called as on_gradient(module, call) after a gradient of a call's output is captured
    # (set for the length of a backward)
    on_gradient: Callable[[nn.Module, Call], None] | None = None


class HookState:
    """All capture state of one hooked model. Returned by ``add_hooks``; a context manager.

    Set once by ``add_hooks``: ``modules``: module -> (qualified name, batch dim); ``rules``:
    module -> its rule (opaque here but for three flags: ``needs_parameter_values``,
    ``copy_outputs``, its outputs returned as copies, as a unit's, and ``keeps_outputs``,
    :attr:`Call.outputs` kept); ``units``: modules whose
    parameters include their children's and whose outputs are returned as copies, so that a
    unit's captured gradient is the one from outside it only; ``observed``: modules captured even
    when none of their parameters is trainable (the others capture nothing then: a frozen layer
    holds no input or output gradient); ``batch_of``: ``(module, call) -> batch size`` of a call
    (raises when it cannot tell); ``broadcast`` (below); ``watchers``: ``module -> watcher()``,
    giving, as a call of ``module`` is recorded, tensors of its forward whose gradients are
    captured too (:attr:`Call.watched`) and a note on the call (:attr:`Call.note`);
    ``gradient_copies``: modules whose captured output gradients are copies (the backward
    below aliases them); ``unseen`` (the unseen-use check, opaque here).
    Changing: ``calls`` and ``status`` (this step's), ``storage`` (buffers), ``enabled``
    (pausing capture), ``listeners`` (add-ons' callbacks), ``sharded_of`` (FSDP2) and
    ``reentrant_checkpointing`` (set once a call recorded during a backward, a recomputation of
    reentrant activation checkpointing, received a gradient).

    Inputs broadcast over the batch (``broadcast``): a call with batch size 1 in a step whose
    earlier calls saw a batch ``B > 1`` (transformers' position ids ``[1, T]``, a shared
    query), with one tensor output, has its output returned expanded to the batch (a view: the
    same values wherever it is broadcast against the batch) and its inputs recorded expanded,
    so that the gradient reaching the output is per sample and the call is one of ``B``. Not
    when an input has a gradient (DeBERTa's relative embeddings): what made it is shared by
    the samples too, and the model may rely on the size 1; the step is refused, naming it.
    """

    def __init__(self, model: nn.Module, modules: dict[nn.Module, tuple[str, int]],
                 rules: dict[nn.Module, Any], units: set[nn.Module],
                 observed: set[nn.Module] = frozenset(),
                 batch_of: Callable[[nn.Module, Call], int] = lambda module, call:
                 call.batch_size, broadcast: bool = True):
        self._model_ref = weakref.ref(model)
        self.modules = modules
        self.rules = rules
        self.units = units
        self.observed = observed
        self.batch_of = batch_of
        self.broadcast = broadcast  # expand calls of batch 1 to the step's batch
        self.watchers: dict[nn.Module, Callable[[], tuple[list[Tensor], object]]] = {}
        self.gradient_copies: set[nn.Module] = set()
        self.unseen: Any = None
        self.calls: dict[nn.Module, list[Call]] = {m: [] for m in modules}
        self.status = StepStatus(consumed=True)  # the first forward starts the first step
        self.storage = Buffers()
        self.enabled = True
        self.listeners = Listeners()
        # during a compute_* call that gives the modules whose rules read parameter values their
        # full values (FSDP2): id(full stand-in) -> the sharded parameter it stands in for
        self.sharded_of: dict[int, Tensor] | None = None
        # the shapes of the tensor inputs of the model's calls with grad enabled in this step,
        # and their batch dim (ModelCallHook; None: a PackedSequence, whose dim 0 counts tokens)
        self.model_input_shapes: set[torch.Size] | None = set()
        self.model_batch_dim = 0
        self.options: dict[str, object] = {}  # add_hooks' arguments, as it resolved them
        self.warned_global_hooks = False  # GLOBAL_HOOKS_WARNING given
        self.warned_parameter_hooks: set[int] = set()  # ids of parameters warned of (step.py)
        # ids of those inputs (a layer called on one is called on the batch, no model tensor)
        self.model_input_ids: set[int] = set()
        # the most rows (along its batch dim) among the tensor inputs of each of those calls,
        # and of the latest: 1 is a call with one sample of its own (an RL bootstrap value
        # V(s_T) after the batch's forward), in which no output of size 1 is broadcast over
        # the step's batch
        self.model_call_rows: set[int] = set()
        self.latest_call_rows: int | None = None
        # what inspect_model_call(args, kwargs) said of those calls, where it said something
        # (vision_language: samples of a call with images that hold none)
        self.inspect_model_call: Callable[[tuple, dict], object] | None = None
        self.model_call_notes: list[object] = []
        # ids of the parameters of the hooked modules (a unit's: below it too), kept until a
        # trainable parameter is not among them (step.py)
        self.hooked_parameter_ids: set[int] = set()
        self.handles: list[Any] = []
        # a call recorded during a backward received a gradient: the model uses reentrant
        # activation checkpointing, through which no backward to given inputs can run
        self.reentrant_checkpointing = False
        # how many captured hooks autograd freed since the last drop_unreachable (a weakref
        # callback counts them: the records are scanned only after some graph went away)
        self._graphs_freed = [0]
        self._on_graph_freed = partial(_count_freed, self._graphs_freed)
        # calls of hooked modules with the hooks disabled and grad mode on since the last step
        # ended, before the next began (see StepStatus.disabled_calls)
        self.disabled_calls = 0
        for module in modules:
            self.handles.append(module.register_forward_hook(  # first: the module's output
                ForwardHook(self, module), with_kwargs=True, prepend=True))
        # a parameter was registered somewhere since a consumer cleared this (every step's
        # look-up of the modules' parameters costs more than the check's budget on small models)
        self.parameters_registered = False
        _watch_parameter_registrations()
        _live_states.add(self)

    @property
    def model(self) -> nn.Module | None:
        return self._model_ref()

    def __reduce__(self) -> tuple:
        """A copy (``copy.deepcopy(model)``, pickling) of a hooked model is not hooked: its
        state becomes None, and so does the state its copied hooks hold (:class:`ForwardHook`):
        they do nothing."""
        return _no_state, ()

    def forward_hook(self, owner: nn.Module, module: nn.Module, args: tuple, kwargs: dict,
                     output: Any) -> Any:
        """Record a call of ``owner`` (see :class:`ForwardHook`)."""
        if module is not owner or not self.enabled or not torch.is_grad_enabled():
            if not self.enabled and torch.is_grad_enabled():  # (told by the check's refusal)
                if self.status.consumed:  # (the next step's, if it is its first call)
                    self.disabled_calls += 1
                else:
                    self.status.disabled_calls += 1
            return  # the cheap tests first: this runs on every call of every hooked module
        compiling = torch.compiler.is_compiling()
        if _not_recorded_here(compiling):
            if not compiling and not _RE_RUNNING.get() and self.captures(owner) and \
                    _grad_mode_outside_transforms():
                status = self.current_status()
                if status.transformed is None:
                    status.transformed = self.modules[owner][0]  # (refused by compute_*)
            return
        if not self.captures(owner):
            return
        if args and isinstance(args[0], Tensor) and args[0].is_nested:
            status = self.current_status()  # not recorded: refused by compute_*
            status.nested = status.nested or self.modules[owner][0]
            return
        rule = self.rules[owner]
        if isinstance(output, Tensor):
            if not output.requires_grad:
                return
            leaves = (output,)
        else:
            leaves, spec = tree_flatten(output)
            tracked = any(isinstance(t, Tensor) and t.requires_grad for t in leaves)
            if owner in self.units or (not tracked and owner in self.watchers):
                distribution = next((t for t in leaves if isinstance(t, Distribution)), None)
                if distribution is not None and self.current_status().opaque_output is None:
                    self.status.opaque_output = (self.modules[owner][0],
                                                 type(distribution).__name__)
            if not tracked:
                return
            if module in self.units or rule.copy_outputs:
                leaves = [_isolated(t) for t in leaves]
                output = tree_unflatten(leaves, spec)
        name, batch_dim = self.modules[owner]
        status = self.current_status()
        in_backward = not compiling and _in_backward()
        if status.followed:  # a followed value reaching a module whose rule takes it as a batch
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, SharedOutput):
                    value.followed[0].end(f"passes it to '{name}' ({type(owner).__name__})")
        if status.backward_seen and status.forward_after_backward is None and not in_backward:
            status.forward_after_backward = name  # a second micro-batch: refused by compute_*
        given_args, given_kwargs = args, kwargs
        args, kwargs = detach_arguments(args, kwargs)
        call = Call(args, kwargs, len(leaves), batch_dim, module.training, compiling, name)
        call.recomputed = in_backward
        subset = None  # (rows, batch) of a view of a model input with some of its rows
        if not compiling:
            first = given_args[0] if given_args else None
            if _may_be_a_model_tensor(first, batch_dim) and id(first) not in self.model_input_ids:
                call.shared_input = self._model_tensor(first)
            if isinstance(first, Tensor) and first._base is not None and \
                    id(first._base) in self.model_input_ids:
                moved_to = _batch_moved(first, batch_dim, self.model_batch_dim)
                if moved_to is not None and status.batch_moved is None:
                    status.batch_moved = (name, batch_dim, moved_to)
                subset = None if moved_to is not None else \
                    _row_subset(first, batch_dim, self.model_batch_dim)
                if subset is not None and status.row_subset is None:
                    status.row_subset = (name, *subset)
            recurse = owner in self.units
            if status.substituted is None:
                status.substituted = _substituted(owner, name, recurse)
            if _GLOBAL_FORWARD_HOOKS and not self.warned_global_hooks:
                self.warned_global_hooks = True
                warnings.warn(GLOBAL_HOOKS_WARNING, stacklevel=2)
            # the values a re-run or a rule reads
            values = [("parameter", n, p) for n, p in owner.named_parameters(recurse=recurse)
                      ] if rule.needs_parameter_values else []
            if (owner._buffers or recurse) and not owner.training:  # running statistics (in
                # training mode BatchNorm is refused, InstanceNorm reads its own statistics)
                values += [("buffer", n, b) for n, b in owner.named_buffers(recurse=recurse)]
            if values:
                call.values = [(kind, n, t, t._version) for kind, n, t in values]
        own_batch, expanded, followed = None, False, None
        if self.broadcast and not compiling and not in_backward and isinstance(output, Tensor) \
                and follows(call, given_args[0] if given_args else None, output,
                            status.batch or self.latest_call_rows, self.model_input_ids):
            followed = status.batch = status.batch or self.latest_call_rows
        if status.batch is None and call.shared_input is None:
            own_batch = self._batch_or_none(owner, call)
            if own_batch is not None and own_batch > 1:
                status.batch = own_batch
        if status.batch is not None and self.broadcast and isinstance(output, Tensor) \
                and output.dim() > batch_dim and output.shape[batch_dim] == 1:
            if own_batch is None:
                own_batch = self._batch_or_none(owner, call)
            carries_gradient = _carries_gradient(given_args, given_kwargs)
            if own_batch == 1 and carries_gradient:
                # computed from trainable parameters: shared by the samples before this call
                # too, and the model's code may rely on its size 1 (DeBERTa repeats it by B):
                # left as it is, refused by compute_*
                status.shared_computation = status.shared_computation or name
            elif own_batch in (1, status.batch) and not carries_gradient and subset is None \
                    and self.latest_call_rows != 1:
                # (not rows of the batch's input, `x[:1]`, nor in a call of the model with one
                # sample: expanded, they would change the forward; refused by compute_*)
                # (called with the batch, an output of size 1 all the same: positions from their
                # ids [1, T] alone, BART's decoder `embed_positions(input_ids, position_ids=)`)
                expand = partial(_to_batch, dim=batch_dim, batch=status.batch)
                output = expand(output)
                expanded = not compiling
                leaves = (output,)
                call.args, call.kwargs = map_tensors(expand, (args, kwargs))
        if rule.keeps_outputs and not compiling and not autocast_device_types():
            # (under autocast they are not what a re-run outside it gives, in other rounding)
            call.outputs = [(t.detach(), t._version) if isinstance(t, Tensor) else None
                            for t in leaves]
        hooks = []
        for grads, leaf in zip(call.grads, leaves):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                hooks += capture_gradient(leaf, grads, self, (owner, call), compiling,
                                          owner in self.gradient_copies)
                for notify in self.listeners.on_capture:
                    notify(leaf)
        watcher = self.watchers.get(owner) if self.watchers else None
        if watcher is not None:
            tensors, call.note = watcher()
            for tensor in tensors:
                call.watched.append([])
                hooks += capture_gradient(tensor, call.watched[-1], self, None, compiling)
                for notify in self.listeners.on_capture:
                    notify(tensor)
        if not compiling:
            freed = self._on_graph_freed
            call.hooks = [weakref.ref(hooks[0], freed)] if len(hooks) == 1 else \
                [weakref.ref(hook, freed) for hook in hooks]
        if self._graphs_freed[0]:
            self.drop_unreachable()
        self.calls[owner].append(call)
        if expanded:  # the model's uses of it are watched from here on
            status.expanded = status.expanded or name
            output = BroadcastOutput.wrap(output, name, batch_dim, status.batch, status)
        elif followed is not None:
            output = follow(call, output, followed, self)
        return output

    def _model_tensor(self, t: Tensor) -> tuple[str, str] | None:
        """``("parameter" | "buffer", name)`` of the model's tensor whose storage ``t`` uses."""
        status = self.status
        if status.model_tensors is None:
            model = self.model
            named = [] if model is None else [
                *(("parameter", n, p) for n, p in model.named_parameters()),
                *(("buffer", n, b) for n, b in model.named_buffers())]
            status.model_tensors = {_storage_address(v): (kind, n) for kind, n, v in named}
            status.model_tensors.pop(0, None)
        return status.model_tensors.get(_storage_address(t))

    def drop_unreachable(self) -> None:
        """Forget the calls no gradient can reach any more (:attr:`Call.unreachable`)."""
        self._graphs_freed[0] = 0
        for calls in self.calls.values():
            if calls:
                calls[:] = [c for c in calls if not c.unreachable]

    def captures(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` is recorded: it has a trainable parameter (a unit: below
        it too), or it is observed anyway."""
        if module in self.observed:
            return True
        for p in module.parameters() if module in self.units else module._parameters.values():
            if p is not None and p.requires_grad:
                return True
        return False

    def captures_now(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` beginning now is recorded (:meth:`capturing`,
        :meth:`captures`)."""
        return self.capturing() and self.captures(module)

    def current_status(self) -> StepStatus:
        """The status of the step a call now belongs to: a new step if the last one is over."""
        if self.status.consumed:
            self._new_step()
        return self.status

    def _batch_or_none(self, module: nn.Module, call: Call) -> int | None:
        try:
            return self.batch_of(module, call)
        except Exception:  # no tensor input, a layout the rule refuses: reported by the rule
            return None

    def capturing(self, compiling: bool | None = None) -> bool:
        """Whether a forward pass now is recorded: capture enabled, grad mode on, not inside
        a ``torch.func`` transform (``compiling``: ``torch.compiler.is_compiling()``, if known)."""
        if not (self.enabled and torch.is_grad_enabled()):
            return False
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        return not _not_recorded_here(compiling)

    def clear(self) -> None:
        """Forget every captured call (buffers stay for reuse). The next forward still starts
        the next step (the records are cleared again, add-ons reset there): what happens to
        ``.grad`` in between (an optimizer's or a preconditioner's in-place edit) belongs to no
        step."""
        self._new_step()
        self.end_step()

    def _new_step(self) -> None:
        """Forget every captured call and reset the add-ons: a step starts."""
        for calls in self.calls.values():
            calls.clear()
        self.storage.end_step()
        for reset in self.listeners.on_clear:
            reset()
        self.status = StepStatus(disabled_calls=self.disabled_calls)
        self.disabled_calls = 0

    def remove(self) -> None:
        """Remove every hook, captured tensor, buffer and ``grad1``/``hess`` attribute."""
        self.enabled = False  # code compiled while hooked may still call the hook: a no-op
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.clear()
        self.storage.clear()
        for module in self.modules:
            for p in module.parameters(recurse=module in self.units):
                for attribute in ("grad1", "hess"):
                    if hasattr(p, attribute):
                        delattr(p, attribute)
        model = self.model
        if model is not None and model.__dict__.get(STATE_ATTRIBUTE) is self:
            del model.__dict__[STATE_ATTRIBUTE]
        _live_states.discard(self)

    def __enter__(self) -> HookState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def end_step(self) -> None:
        """This step is over (computed, or refused after its backward): the next forward
        starts a new one (and notes the model's calls anew)."""
        self.status.consumed = True
        self.forget_model_calls()

    def forget_model_calls(self) -> None:
        """The model's calls noted so far (:class:`ModelCallHook`) belong to no step now."""
        self.model_input_shapes, self.model_input_ids = set(), set()
        self.model_call_rows, self.latest_call_rows = set(), None
        self.model_call_notes = []

    def release_records(self, by: str) -> None:
        """Mark this step's records as dropped by ``by`` (read again: refused, naming it)."""
        self.status.released_by = by

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Capture nothing inside (a re-run of a module's forward)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def captured_passes(self) -> int:
        """How many output gradients the hooks hold (all calls, all passes)."""
        return sum(len(passes) for calls in self.calls.values() for call in calls
                   for passes in call.grads)

    def hooked_calls(self) -> Iterator[tuple[nn.Module, str, list[Call]]]:
        for module, (name, _) in self.modules.items():
            yield module, name, self.calls[module]


class ForwardHook:
    """The forward hook of one hooked module: ``state.forward_hook(owner, ...)``. An object of a
    module-level class, not a closure, so that a hooked model can be pickled (``torch.save(
    model)``); its state pickles and deep-copies to None (:meth:`HookState.__reduce__`), so
    the hooks of a copy do nothing: the copy is not hooked (``add_hooks`` it to hook it)."""

    __slots__ = ("state", "owner")

    def __init__(self, state: HookState, owner: nn.Module):
        self.state: HookState | None = state
        self.owner = owner

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.state is not None:
            return self.state.forward_hook(self.owner, module, args, kwargs, output)
        return None


class ModelCallHook:
    """The forward pre-hook of the hooked model itself: notes the shapes of its tensor inputs
    in the step's calls (:attr:`HookState.model_input_shapes`), to compare the samples it was
    called with and the rows its hooked layers see. Not a unit's re-run of the whole model."""

    __slots__ = ("state",)

    def __init__(self, state: HookState):
        self.state: HookState | None = state

    @torch.compiler.disable  # (traced, it would be recompiled for every new input's id)
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = self.state
        if state is None or not state.enabled or not torch.is_grad_enabled() or \
                _not_recorded_here(torch.compiler.is_compiling()):  # (a unit's re-run)
            return
        if state.status.consumed:  # this call starts a step (its first hooked forward will)
            state.forget_model_calls()
        if not kwargs and all(type(a) is Tensor and not a.is_nested for a in args):
            tensors = args  # the common call, cheaply
        else:  # (a nested tensor has no size at a dim)
            tensors = [t for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, Tensor) and not t.is_nested]
            if any(isinstance(a, PackedSequence) for a in (*args, *kwargs.values())):
                state.model_input_shapes = None
        state.model_input_ids.update(map(id, tensors))
        dim = state.model_batch_dim
        rows = state.latest_call_rows = max((t.shape[dim] for t in tensors if t.dim() > dim),
                                            default=None)
        if rows is not None:
            state.model_call_rows.add(rows)
        if state.inspect_model_call is not None:
            note = state.inspect_model_call(args, kwargs)
            if note is not None:
                state.model_call_notes.append(note)
        if state.model_input_shapes is not None:
            state.model_input_shapes.update(t.shape for t in tensors)

    @torch.compiler.disable
    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        """The model's forward hook, called even when the forward raised: an error of the
        model's own code on an output expanded over the batch (an ``index_copy_`` of it, past
        an op that made it a plain tensor) gets a note naming the expansion, and ends the step
        (the next forward starts clean, not refused for what this one recorded)."""
        error, state = sys.exc_info()[1], self.state
        expanded = state.status.expanded if error is not None and state is not None and \
            not state.status.consumed else None
        if expanded:
            state.end_step()
        if expanded and hasattr(error, "add_note") and \
                not isinstance(error, PerSampleHooksError):
            error.add_note(
                f"per_sample_hooks: '{expanded}' was called with batch size 1 in this forward "
                "and its output, broadcast over the batch, was expanded to the batch (a view) to "
                "tell the samples' gradients apart. If the error comes from the model's use of "
                "that output otherwise than broadcast, make the module that holds the call and "
                f"its uses {_BROADCAST_FIX}")


def _batch_moved(view: Tensor, batch_dim: int, model_batch_dim: int) -> int | None:
    """The dim of ``view``, a view of a model's input, that holds that input's batch dim
    ``model_batch_dim``, where it is not ``batch_dim`` (ids looked up transposed,
    ``emb(ids.T)``): what the module takes for its rows are not the samples. None where it
    stayed, or went (merged, ``ids.view(-1)``)."""
    base = view._base
    if base.dim() <= model_batch_dim or view.dim() <= batch_dim:
        return None
    samples, stride = base.shape[model_batch_dim], base.stride(model_batch_dim)
    if samples < 2 or (view.shape[batch_dim] == samples and view.stride(batch_dim) == stride):
        return None
    return next((k for k in range(view.dim())
                 if view.shape[k] == samples and view.stride(k) == stride), None)


def _row_subset(view: Tensor, batch_dim: int, model_batch_dim: int) -> tuple[int, int] | None:
    """``(rows, batch)`` where ``view``, a view of a model's input, holds fewer rows at
    ``batch_dim`` than that input's batch (``x[:bt, t]``); None where it holds them all."""
    base = view._base
    if base.dim() <= model_batch_dim or view.dim() <= batch_dim:
        return None
    rows, batch = view.shape[batch_dim], base.shape[model_batch_dim]
    same_stride = view.stride(batch_dim) == base.stride(model_batch_dim)
    return (rows, batch) if rows < batch and (same_stride or rows == 1) else None


def _may_be_a_model_tensor(t: object, batch_dim: int) -> bool:
    """Whether ``t`` could be a model's parameter or buffer (or a view of one) with rows at
    ``batch_dim``: a tensor no autograd op made, whose dim there is not broadcast (a table
    expanded over the batch, as transformers' ``position_ids``, is the batch's)."""
    return isinstance(t, Tensor) and t.grad_fn is None and t.dim() > batch_dim and \
        t.shape[batch_dim] > 1 and t.stride(batch_dim) != 0


def _storage_address(t: Tensor) -> int:
    """The address of the memory ``t`` views (0: none, a tensor subclass without storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _count_freed(counter: list[int], _: weakref.ref) -> None:
    counter[0] += 1


def _no_state() -> None:
    return None


def live_states() -> list[HookState]:
    return list(_live_states)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside wrappers that forward to it unchanged: ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod``), ``DistributedDataParallel`` and ``DataParallel``
    (``module``). Hooks and state live on the inner model, so either handle works."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(
                model.__dict__.get("_modules", {}).get("_orig_mod"), nn.Module):
            model = model._orig_mod
        else:
            return model


def get_state(model: nn.Module) -> HookState:
    model = unwrap(model)
    state = model.__dict__.get(STATE_ATTRIBUTE)
    if state is None:
        raise PerSampleHooksError(
            f"{type(model).__name__} has no per_sample_hooks: call "
            "per_sample_hooks.add_hooks(model) before the forward pass")
    return state


from .shared_outputs import SharedOutput, follow, follows  # noqa: E402  (imports this module)
