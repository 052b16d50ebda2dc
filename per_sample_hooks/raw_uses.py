"""The uses of a module's raw parameters inside its own forward, followed op by op.

Next to the capture (:mod:`per_sample_hooks.capture`), and like it knowing nothing about
layers. A module that owns parameters directly (``module._parameters``: a class token, position
embeddings, LayerScale gammas, a learned bias) and has child modules runs arbitrary code of its
own around its children. Its children keep their own rules; only what its own code does with
its raw parameters is followed here, by a ``torch.overrides.TorchFunctionMode`` entered for the
length of the module's forward and suspended while its children run (so they pay nothing and
the mode sees the module's own ops only).

The mode sorts the tensors of the module's own ops into three kinds:

- *derived*: a raw trainable parameter, or the output (requiring grad) of an op whose tensor
  inputs are derived tensors and constants only (slicing, reshape, ``.T``, ``.to``, a scalar
  product, ``torch.cat`` of two tokens, an interpolation): no batch. Each is recorded as a
  :class:`Derived` recipe from the parameters, to be replayed at compute time;
- *batched*: the module's tensor inputs and its children's tensor outputs whose size at the
  module's ``batch_dim`` is the call's batch size ``B``, and every output of an op with a batched
  input (provenance, not shape: a constant of size ``B`` made inside the forward is no batch).
  Batched values whose rows at ``batch_dim`` are other rows, picked by an index or reordered
  (``h[edge_index[0]]``, ``index_select``, ``gather``, ``flip``, ``sort``, and every value
  computed from them), are *moved*: a graph's edges are not its nodes even where there are as
  many. A scatter (``index_add``, ``x[index] = v``) writes into the rows of its first
  argument, and ``arange(B)`` picks the batch's rows in order. A reduction over ``batch_dim``
  (``x.mean(0)``, ``x.std()``, ``softmax(0)``) gives a statistic of every sample: moved too,
  refused as batch statistics are;
- constants: everything else (buffers, ``torch.arange``, frozen parameters).

A derived tensor ``t`` meets the batch at a *use site*: an elementwise broadcasting op (add,
sub, mul, div, their Tensor methods, in-place forms and ``rsub``, ``addcmul``, ``addcdiv``,
``lerp``, ``where``, ``maximum``, ``minimum``, ``pow``) with a batched input, or an expand-like
op (``expand``, ``expand_as``, ``broadcast_to``, ``repeat``), whose output has size ``B`` at
``batch_dim`` where ``t`` (its shape padded with leading 1s to the output's rank) has 1. The op
is run with ``t`` replaced by ``t_b``, ``t`` padded and expanded to ``B`` at that dim: the same
values, and the gradient autograd gives ``t_b`` is ``[..., B, ...]`` with row ``b`` from sample
``b`` only, ``t``'s per-sample gradient (the op's backward has already summed every other
broadcast dim). ``t_b``
is watched (:attr:`Call.watched <per_sample_hooks.capture.Call>`); the call's note, a
:class:`Uses`, says which derived value each watched tensor stands for. ``F.linear(x, w, b)``
with the batch in ``x`` and raw parameters ``w`` and/or ``b`` (the other a constant or None)
is a use site too, a Linear layer's (:class:`LinearSite`): its output is watched and ``x``
kept, and the rule forms ``Outer(G, x)`` and ``Outer(G)`` from them, as for ``nn.Linear``; so
is ``x @ w`` with ``w`` a raw 2-D parameter (``Outer(x, G)``) or its transpose (``w.t()``,
``w.T``, ``w.mT``, ``w.transpose(0, 1)``: ``Outer(G, x)``).

Anything else is refused, never silently followed: a derived tensor in any other op with the
batch (a product with a weight computed from parameters, ``w @ x`` with the weight first,
``torch.cat`` of an unexpanded token with the batch, an op that mixes the samples, any use on
moved rows), passed to a child module (so are moved rows to a child with trainable parameters,
whose rule takes them for the batch's), returned, written in place, or used inside a custom
``torch.autograd.Function`` (whose ``apply`` is no torch function: its output is caught when it
comes back with a gradient); a trainable parameter of a descendant used by the module's own
code (the descendant's rule would miss that term); a batch that is not at ``batch_dim``. The
call's :attr:`Uses.problem` says what and where, and the rule refuses the step with it and with
the fix: the module as one unit of the ``torch.func`` fallback, ``add_hooks(model,
units=[name])``. Refused, not switched to that unit by itself: by the time a use is seen the
children have been hooked and recorded separately, and a unit must be chosen before its forward
(its outputs are isolated copies); a switch would also hide a slowdown of 20x and more on a
whole model. What the mode cannot see at all (a derived tensor stored on the module and used
after its forward, one inside a nested container it does not open, a parameter a child reads
from its parent) reaches ``p.grad`` and not the use sites: the unseen-use check
(:mod:`per_sample_hooks.unseen`) reports it.

Assumption, as everywhere in this library: a tensor of the module's forward that carries the
batch carries it at ``batch_dim``; an expand of a derived value to size ``B`` there is read as
broadcasting it over the samples, unless the batch meets it at another dim (an expand over
``T == B`` positions, ``tok[0].expand(T, -1) + x``): then it was a derived value after all
(:meth:`_Forward.provisional`).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


def _functions(*names: str) -> frozenset[Callable[..., Any]]:
    """``torch.X`` and ``Tensor.X`` for each name, where they exist."""
    found = {getattr(owner, name) for owner in (torch, Tensor) for name in names
             if hasattr(owner, name)}
    return frozenset(found)


_ELEMENTWISE_NAMES = ("add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide",
                      "true_divide", "addcmul", "addcdiv", "lerp", "where", "maximum", "minimum",
                      "pow")
ELEMENTWISE = _functions(
    *_ELEMENTWISE_NAMES, *(f"{name}_" for name in _ELEMENTWISE_NAMES),
    *(f"__{op}__" for base in ("add", "sub", "mul", "truediv", "div", "pow")
      for op in (base, f"r{base}", f"i{base}")),
    "broadcast_tensors")  # (torch.distributions' broadcast_all: Normal(mu, log_std.exp()))
"""Elementwise broadcasting ops: a use site when a derived input meets the batch."""

LINEAR = frozenset({torch.nn.functional.linear})
"""``F.linear(x, weight, bias)`` with the batch in ``x`` and a raw ``weight``: a use site whose
per-sample gradient is a Linear layer's (:class:`LinearSite`)."""

MATMUL = _functions("matmul")
"""``x @ w`` (``torch.matmul``) with the batch in ``x`` and ``w`` a raw 2-D parameter or its
transpose: a Linear layer's use site too."""

_T = _functions("t")
_TRANSPOSE = _functions("transpose")


def _transposed_parameter(value: Derived) -> str | None:
    """The name of the 2-D raw parameter ``value`` is the transpose of (``p.t()``, ``p.T``,
    ``p.mT``, ``p.transpose(0, 1)``), else None."""
    source = value.args[0] if value.args else None
    if not isinstance(source, Derived) or not source.is_parameter or source.source.dim() != 2:
        return None
    owner = getattr(value.func, "__self__", None)
    if value.func in _T or owner is Tensor.T or owner is Tensor.mT:
        return source.name
    if value.func in _TRANSPOSE:
        dims = [*value.args[1:3], *(value.kwargs.get(k) for k in ("dim0", "dim1")
                                   if k in value.kwargs)]
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and \
                {d % 2 for d in dims} == {0, 1}:  # not transpose(0, 0)
            return source.name
    return None


NORMS = frozenset({F.batch_norm, F.group_norm, F.layer_norm, F.instance_norm})
"""Normalizations with the batch in their input and raw parameters as their affine weight or
bias (timm's BatchNormAct2d, GroupNormAct, LayerNormAct2d): run without them, then
``x_hat * weight + bias``, two elementwise use sites (the same values, up to rounding)."""

# (read once: binding runs in every forward of such a module)
_NORM_SIGNATURES = MappingProxyType({func: inspect.signature(func) for func in NORMS})

BATCH_STATISTICS = (
    "normalizes with batch statistics (`batch_norm` in training mode or without running "
    "statistics): they mix the samples of the batch, so per-sample gradients are undefined for "
    "it and for every layer below it. Call model.eval() so that it uses its running statistics "
    "(exact per sample), or replace it with a GroupNorm (per-sample statistics)")

REPEAT = _functions("repeat")
EXPANDS = _functions("expand", "expand_as", "broadcast_to")
"""Ops that broadcast a derived value over the batch (a view: run once to read the shape)."""


GATHERS = _functions("index_select", "gather", "take_along_dim", "take", "flip", "roll", "sort")
"""Ops whose output rows along their ``dim`` are other rows of their input, picked by an index
or an order (with ``__getitem__`` by a tensor or list index at batch_dim)."""

SCATTERS = _functions(*(f"{name}{suffix}" for name in (
    "index_add", "index_copy", "index_fill", "index_put", "scatter", "scatter_add",
    "scatter_reduce") for suffix in ("", "_")))
"""Ops that write rows of a source into the rows of their first argument by an index: their
output rows along ``dim`` are that argument's rows."""

_GETITEM = frozenset({Tensor.__getitem__})
_SETITEM = frozenset({Tensor.__setitem__})


def _index_entry(index: object, rank: int, dim: int) -> object:
    """The entry of a ``__getitem__`` (or ``index_put``) index that indexes dim ``dim`` of a
    tensor of ``rank`` dims; ``slice(None)`` where none does."""
    entries = index if isinstance(index, tuple) else (index,)

    def width(entry: object) -> int:
        if entry is None or entry is Ellipsis:
            return 0
        return entry.dim() if isinstance(entry, Tensor) and entry.dtype == torch.bool else 1
    position = 0
    for entry in entries:
        if entry is Ellipsis:
            position += rank - sum(width(e) for e in entries)
            if position > dim:
                return slice(None)
            continue
        if position <= dim < position + width(entry):
            return entry
        position += width(entry)
    return slice(None)


def _op_dims(func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
    """The dim (or dims) along which a gather or scatter picks rows; None: the flattened input
    (``take``, ``roll`` without dims, ``take_along_dim`` without dim)."""
    name = _name(func).rstrip("_")
    if name == "take":
        return None
    if name == "flip":  # torch.flip(x, dims), Tensor.flip(*dims)
        return kwargs.get("dims", args[1] if len(args) == 2 else args[1:])
    if name in ("roll", "take_along_dim"):
        return kwargs.get("dims", kwargs.get("dim", args[2] if len(args) > 2 else None))
    if name == "sort":
        return kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
    return kwargs.get("dim", args[1] if len(args) > 1 else None)


def _identity(index: object, size: int) -> bool:
    """Whether ``index`` picks rows ``0..size-1`` in order (``x[torch.arange(B), last]``)."""
    if isinstance(index, Tensor) and index.dim() == 1 and len(index) == size:
        if index.dtype == torch.bool:
            return bool(index.all())
        return not index.is_floating_point() and \
            torch.equal(index, torch.arange(size, device=index.device, dtype=index.dtype))
    return False


def _reorders_rows(func: Callable[..., Any], args: tuple, kwargs: dict, dim: int,
                   batch_size: int | None) -> bool | None:
    """Whether ``func``'s output rows at ``dim`` are other rows than its first argument's: True
    for a gather by an index (``h[edge_index[0]]``, ``index_select``) or a reorder (``flip``,
    ``sort``), False for a scatter into the first argument's rows (``index_add``), None for
    any other op (its rows are its inputs' rows)."""
    source = args[0] if args else kwargs.get("input")
    if not isinstance(source, Tensor) or source.dim() <= dim:
        return None
    if func in _GETITEM:
        entry = _index_entry(args[1], source.dim(), dim)
        if isinstance(entry, slice):
            return None
        return not _identity(entry, batch_size)
    if func in _SETITEM or _name(func).startswith("index_put"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        indices = tuple(indices) if isinstance(indices, list) and func not in _SETITEM \
            else indices
        return None if isinstance(_index_entry(indices, source.dim(), dim), slice) else False
    if func in GATHERS or func in SCATTERS:
        dims = _op_dims(func, args, kwargs)
        if dims is None:
            return True
        dims = dims if isinstance(dims, (tuple, list)) else (dims,)
        if dim not in [d % source.dim() for d in dims if isinstance(d, int)]:
            return None
        if func in SCATTERS:
            return False
        index = kwargs.get("index", args[2] if _name(func) == "index_select" and len(args) > 2
                           else None)
        return not _identity(index, batch_size)
    return None


REDUCTIONS = _functions("sum", "mean", "std", "var", "std_mean", "var_mean", "amax", "amin",
                        "max", "min", "logsumexp", "norm", "prod", "median", "nanmean", "nansum",
                        "cumsum", "cumprod", "softmax", "log_softmax") | {F.softmax,
                                                                         F.log_softmax}
"""Reductions (and scans, softmaxes) along a dim or over every element: along the batch dim
(or every element) of a batched value, a statistic of every sample."""


def _reduces_batch(func: Callable[..., Any], args: tuple, kwargs: dict, dim: int) -> bool:
    """Whether ``func`` reduces its batched first argument along ``dim`` or over every
    element (``x.mean(0)``, ``x.std()``, ``x.softmax(0)``), not ``torch.max(x, y)``."""
    source = args[0] if args else kwargs.get("input")
    if func not in REDUCTIONS or not isinstance(source, Tensor) or source.dim() <= dim:
        return False
    if _name(func) == "norm":  # norm(input, p, dim)
        dims = kwargs.get("dim", args[2] if len(args) > 2 else None)
    else:
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dims, Tensor):  # torch.max(x, y): elementwise
        return False
    if dims is None:
        return True
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return dim in [d % source.dim() for d in dims if isinstance(d, int)]


def _leaves(args: tuple, kwargs: dict, kind: type) -> list[Any]:
    """The ``kind`` objects among the arguments of a call, also inside a list or tuple
    argument (``torch.cat((a, b))``): how torch functions take tensors."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, kind):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            found.extend(t for t in a if isinstance(t, kind))
    return found


def _replace(args: tuple, kwargs: dict, kind: type, fn: Callable[[Any], object]
             ) -> tuple[tuple, dict]:
    """The arguments with each ``kind`` object ``a`` (as :func:`_leaves` finds them) replaced
    by ``fn(a)``."""
    def one(a: object) -> object:
        if isinstance(a, kind):
            return fn(a)
        if isinstance(a, (tuple, list)) and any(isinstance(t, kind) for t in a):
            items = [fn(t) if isinstance(t, kind) else t for t in a]
            return items if isinstance(a, list) else tuple(items)
        return a
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _flat_tensors(output: object) -> list[Tensor]:
    """The tensors of a module's input or output (any nesting)."""
    if isinstance(output, Tensor):
        return [output]
    return [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]


def _broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """The broadcast of ``shapes`` (None: they do not broadcast)."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        sizes = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


class Derived:
    """A value the module's own code computed from its raw parameters and constants only.

    A parameter (``name``; ``source`` the parameter), or output ``index`` (None: the only one)
    of ``func(*args, **kwargs)`` with the derived inputs as :class:`Derived` in ``args`` and
    ``kwargs``. Tensors are held with their version counter at the forward, so that a later
    in-place change is detected (:meth:`modified`)."""

    __slots__ = ("name", "source", "func", "args", "kwargs", "index", "versions")

    def __init__(self, name: str | None = None, source: Tensor | None = None,
                 func: Callable[..., Any] | None = None, args: tuple = (),
                 kwargs: dict | None = None, index: int | None = None):
        self.name, self.source = name, source
        self.func, self.args, self.kwargs, self.index = func, args, kwargs or {}, index
        held = [source] if source is not None else _leaves(args, self.kwargs, Tensor)
        self.versions = [(t, t._version) for t in held]

    @property
    def is_parameter(self) -> bool:
        return self.name is not None

    def parameters(self) -> dict[str, Tensor]:
        """The raw parameters this value is computed from, by name."""
        if self.is_parameter:
            return {self.name: self.source}
        found: dict[str, Tensor] = {}
        for leaf in _leaves(self.args, self.kwargs, Derived):
            found.update(leaf.parameters())
        return found

    def modified(self) -> bool:
        """Whether a tensor it was computed from changed in place since the forward."""
        if any(t._version != version for t, version in self.versions):
            return True
        return any(leaf.modified() for leaf in _leaves(self.args, self.kwargs, Derived))

    def evaluate(self, values: Mapping[str, Tensor]) -> Tensor:
        """The value again, from ``values`` of the parameters (differentiable in them)."""
        if self.is_parameter:
            return values[self.name]

        args, kwargs = _replace(self.args, self.kwargs, Derived,
                                lambda leaf: leaf.evaluate(values))
        out = self.func(*args, **kwargs)
        return out if self.index is None else out[self.index]


@dataclass
class Site:
    """One use site: a watched ``t_b``, ``value`` (shape ``shape``) padded and expanded to the
    batch at dim ``batch_dim`` of ``t_b``."""
    value: Derived
    shape: torch.Size
    batch_dim: int


def gradients_by_value(site_grads: Iterable[tuple[Site, Tensor]]
                       ) -> list[tuple[Derived, Tensor]]:
    """Per derived value: its per-sample gradient ``[B, *value.shape]``, the gradients of its
    sites (each the watched view's, ``B`` at the site's ``batch_dim``) added."""
    summed: dict[int, tuple[Derived, Tensor]] = {}
    for site, grad in site_grads:
        per_sample = grad.movedim(site.batch_dim, 0).reshape(grad.shape[site.batch_dim],
                                                               *site.shape)
        key = id(site.value)
        if key in summed:
            per_sample = per_sample + summed[key][1]
        summed[key] = (site.value, per_sample)
    return list(summed.values())


@dataclass
class LinearSite:
    """One ``F.linear`` of the batch by raw parameters: the watched tensor is its output; its
    ``weight`` and ``bias`` (their names; None: not a raw parameter) have the per-sample
    gradients of a Linear layer on ``input`` (the batched input, detached: autograd saves it
    for the weight's gradient and refuses the backward if it is changed in place), the batch
    at ``batch_dim``."""
    weight: str | None
    bias: str | None
    input: Tensor
    batch_dim: int
    #: ``x @ weight`` (``weight [in, out]``): per-sample gradients ``x^T G``, not ``G^T x``
    transposed: bool = False


@dataclass
class Uses:
    """What one call's own code did with its module's raw parameters: the use sites, in the
    order of the call's watched tensors, and ``problem``, the first use that cannot be followed
    (None: every use was seen)."""
    sites: list[Site | LinearSite]
    problem: str | None = None
    #: the problem is statistics over the batch (no unit makes per-sample gradients of it)
    mixes_samples: bool = False
    #: for a call with no tensor input (``latents.expand(batch_size, -1, -1)``, Perceiver's
    #: embeddings): the size at batch_dim of its first expand of a derived value
    batch_size: int | None = None
    #: the problem is an output made of raw parameters alone (a decoder's shared log-scale),
    #: which the calling module combines with the batch
    returns_unbatched: bool = False


def _describe(value: Derived) -> str:
    return ", ".join(f"'{name}'" for name in value.parameters())


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", repr(func))


def _outputs(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "matmul", "and", "or",
    "xor", "lshift", "rshift")) | {"__setitem__"}


def _in_place(func: Callable[..., Any], kwargs: dict) -> bool:
    """Whether ``func`` writes into its first argument (or ``out=``)."""
    name = _name(func)
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS \
        or kwargs.get("out") is not None


@dataclass
class _Expansion:
    """An expand of derived values to size B at batch_dim in an op without the batch: its use
    sites, and the values computed from it alone (id: the tensor and its recipe), provisional
    batches until the batch meets one (:meth:`_Forward.provisional`); ``used``: one met the
    batch there, or left the forward."""
    sites: list[Site | LinearSite] = field(default_factory=list)
    #: (a child's output: no recipe)
    values: dict[int, tuple[Tensor, Derived | None]] = field(default_factory=dict)
    used: bool = False
    #: the first call of a child it was passed to (its outputs are values of it too)
    child: str | None = None


class _Forward:
    """The tables of one call of the owner, for the length of its forward."""

    def __init__(self, uses: RawUses, args: tuple, kwargs: dict):
        self.uses = uses
        tensors = _leaves(args, kwargs, Tensor)
        dim = uses.batch_dim
        self.batch_size: int | None = next((t.shape[dim] for t in tensors if t.dim() > dim),
                                           None)
        self.tracked: dict[int, tuple[Tensor, Derived]] = {
            id(p): (p, Derived(name, p)) for name, p in uses.owner._parameters.items()
            if p is not None and p.requires_grad}
        self.batched: dict[int, Tensor] = {}  # held: an id is not reused during the forward
        # batched values whose rows at batch_dim are not the call's (picked by an index: a
        # graph's edges, a permutation), even where there are B of them, or that mix them (a
        # statistic over the batch): the op that picked or mixed them, and whether it mixed
        self.moved: dict[int, tuple[Tensor, str, bool]] = {}
        self.add_batched(tensors)
        # computed from derived values with grad mode off: no gradient, unless a custom
        # autograd Function (whose apply the mode does not see) gives them one on return
        self.unseen: dict[int, tuple[Tensor, str]] = {}
        self.watched: list[Tensor] = []
        self.record = Uses([])
        # values of an expand to B of derived values with no batch in the op (provisional
        # batches, see :meth:`provisional`), each with the expand they come from
        self.expansion_of: dict[int, _Expansion] = {}
        self.passing: list[_Expansion] = []  # those passed to the child being called

    def refuse(self, problem: str) -> None:
        if self.record.problem is None:
            self.record.problem = problem

    def add_batched(self, tensors: list[object]) -> None:
        """Inputs and children's outputs: batched where their size at batch_dim is B, unless
        a value every sample shares (a child called on positions made in the forward,
        ``wpe(torch.arange(T))``, :mod:`~per_sample_hooks.shared_outputs`: ``T == B`` rows
        that are positions)."""
        from .shared_outputs import SharedOutput  # (it imports this module)
        dim, size = self.uses.batch_dim, self.batch_size
        for t in tensors:
            if isinstance(t, Tensor) and t.dim() > dim and t.shape[dim] == size and not (
                    isinstance(t, SharedOutput) and t.followed[0].following):
                self.batched[id(t)] = t

    # --------------------------------------------------------------- the module's own ops

    def apply(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
        inputs = _leaves(args, kwargs, Tensor)
        expansions = self.provisional(inputs)
        first = len(self.watched)
        out = self.follow(func, args, kwargs, inputs)
        if expansions or len(self.watched) > first and (func in EXPANDS or func in REPEAT) \
                and not any(id(t) in self.batched for t in inputs):
            self.expanded(expansions, first, func, *self.template(args, kwargs), out)
        return out

    def provisional(self, inputs: list[Tensor]) -> list[_Expansion]:
        """The expansions of the provisional batches among ``inputs`` (an op of them without
        the batch follows them further), or none where the op has the batch too.

        An expand of derived values to size B at batch_dim in an op without the batch
        (``tok.expand(B, -1, -1)``) is taken for their broadcast over the samples, a use
        site; but it may be an expand over positions that happen to number B
        (``tok[0].expand(T, -1)``, einops' ``repeat(tok, '1 1 d -> 1 t d')``, T == B), whose
        dim 0 the batch meets at another dim (``x [B, T, d] + e``). Where the batch meets such
        a value with size 1 at its batch_dim (padded to the batch's rank), the expand was
        over positions: its sites are dropped and its values are derived after all, as they
        are where T != B. So before the batch: one with size 1 there (``e[None]``, then
        expanded over the batch), or met by a derived value with the batch's size there (a
        position table ``pos [T, d]``)."""
        def expansions() -> list[_Expansion]:
            found = map(self.expansion_of.get, map(id, inputs))
            return list({id(e): e for e in found if e is not None}.values())
        if not expansions():
            return []
        real = [t for t in inputs if id(t) in self.batched and id(t) not in self.expansion_of]
        rank = max(t.dim() for t in inputs if id(t) in self.batched or id(t) in self.tracked)
        dim = self.uses.batch_dim if self.uses.batch_dim >= 0 else self.uses.batch_dim + rank
        size = self.batch_size
        rows = not real and any(id(t) in self.tracked and self.padded_size(t, rank, dim) == size
                                for t in inputs)
        for t in inputs:
            expansion = self.expansion_of.get(id(t))
            if expansion is not None and (rows or self.padded_size(t, rank, dim) == 1 != size):
                self.derived_after_all(expansion)
            elif expansion is not None and real:
                expansion.used = True
        return [] if real else expansions()

    def derived_after_all(self, expansion: _Expansion) -> None:
        """Drop the sites of an expand over positions, and make its values derived."""
        if expansion.used:
            value = next(iter(expansion.values.values()))[1]
            met = "the result both there and" if expansion.child is None else \
                f"it at batch_dim in a call of {expansion.child}, and its output"
            self.refuse(
                f"expands its raw parameter(s) {_describe(value)} to the batch's size at "
                f"batch_dim, and the batch meets {met} at another dim: expand it where it "
                "meets the batch (`x + p`)")
            return
        for site in expansion.sites:
            index = next(i for i, s in enumerate(self.record.sites) if s is site)
            del self.record.sites[index], self.watched[index]
        for key, entry in expansion.values.items():
            self.expansion_of.pop(key)
            self.batched.pop(key, None)
            self.moved.pop(key, None)
            self.tracked[key] = entry

    def expanded(self, expansions: list[_Expansion], first: int, func: Callable[..., Any],
                 args: tuple, kwargs: dict, out: object) -> None:
        """Record an op's batched outputs (and the sites it made) as provisional, of the
        expansion of its inputs (a new one: an expand of derived values)."""
        expansion = expansions[0] if expansions else _Expansion()
        for other in expansions[1:]:
            expansion.sites += other.sites
            expansion.values.update(other.values)
            expansion.used |= other.used
            self.expansion_of.update(dict.fromkeys(other.values, expansion))
        expansion.sites += self.record.sites[first:]
        several = isinstance(out, (tuple, list))
        for index, o in enumerate(out if several else [out]):
            if isinstance(o, Tensor) and id(o) in self.batched:
                expansion.values[id(o)] = (o, Derived(func=func, args=args, kwargs=kwargs,
                                                      index=index if several else None))
                self.expansion_of[id(o)] = expansion

    def template(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with derived (and provisional) tensors as :class:`Derived`."""
        def one(a: Tensor) -> object:
            expansion = self.expansion_of.get(id(a))
            entry = self.tracked.get(id(a)) if expansion is None else expansion.values[id(a)]
            return a if entry is None or entry[1] is None else entry[1]
        return _replace(args, kwargs, Tensor, one)

    def follow(self, func: Callable[..., Any], args: tuple, kwargs: dict,
               inputs: list[Tensor]) -> object:
        if any(id(t) in self.uses.descendants and t.requires_grad for t in inputs):
            # a descendant's trainable parameter: refused only where a gradient can flow back
            # from the result (not a read of its dtype or shape, not a detach)
            out = func(*args, **kwargs)
            if any(o.requires_grad for o in _outputs(out)):
                self.check_inputs(inputs, f"`{_name(func)}`")
            elif any(id(t) in self.batched for t in inputs):
                self.add_results(func, args, kwargs, inputs, out)
            return out
        self.check_inputs(inputs, f"`{_name(func)}`")
        tracked = list({id(t): t for t in inputs if id(t) in self.tracked}.values())
        batched = any(id(t) in self.batched for t in inputs)
        values = " and ".join(_describe(self.tracked[id(t)][1]) for t in tracked)
        if not tracked or not torch.is_grad_enabled():  # no gradient reaches a parameter
            out = func(*args, **kwargs)
            if batched:
                self.add_results(func, args, kwargs, inputs, out)
            if not tracked and not torch.is_grad_enabled():  # (a Function's later ops)
                values = next((self.unseen[id(t)][1] for t in inputs if id(t) in self.unseen),
                              "")
            if values:
                self.unseen.update((id(o), (o, values)) for o in _outputs(out))
            return out
        moved = next((self.moved[id(t)] for t in inputs if id(t) in self.moved), None)
        if moved is not None and moved[2]:
            self.refuse(
                f"uses its raw parameter(s) {values} in `{_name(func)}` on values computed with "
                f"`{moved[1]}` over batch_dim, a statistic of every sample: per-sample "
                "gradients are undefined for them. Compute such statistics per sample (over "
                "positions or features; per graph, with the graph of each node)")
            self.record.mixes_samples = True
        elif moved is not None:
            self.refuse(
                f"uses its raw parameter(s) {values} in `{_name(func)}` on rows that "
                f"`{moved[1]}` picked along batch_dim by an index (a graph's edges, a token's "
                "expert, a permutation): they are not the batch's rows, even where there are B "
                "of them. A unit re-runs each sample alone: exact where the index comes from "
                "the sample's own values (a router's), not where it picks rows of every sample "
                "(a graph's edge_index: apply the parameter to the rows before they are picked)")
        if moved is not None:
            out = func(*args, **kwargs)
            self.add_results(func, args, kwargs, inputs, out)
            return out
        target = args[0] if args else kwargs.get("input")
        if _in_place(func, kwargs) and (id(target) in self.tracked or not batched):
            self.refuse(f"writes in place into a value of, or with a value of, its raw "
                        f"parameter(s) {values} (`{_name(func)}`) without the batch")
            return func(*args, **kwargs)
        if batched and (func in LINEAR or func in MATMUL):
            out = self.linear_site(func, args, kwargs)
            if out is not None:
                return out
        if batched and func in NORMS:
            out = self.norm_site(func, args, kwargs)
            if out is not None:
                return out
        if (func in ELEMENTWISE and batched) or func in EXPANDS or func in REPEAT:
            shape = self.output_shape(func, args, kwargs, inputs)
            if self.batch_size is None and not batched and shape is not None \
                    and (func in EXPANDS or func in REPEAT):
                self.adopt_batch_size(shape)
            dim = self.dim_in(shape)
            if dim is not None and all(self.padded_size(t, len(shape), dim) == 1
                                       for t in tracked):
                return self.use_site(func, args, kwargs, tracked, len(shape), dim)
        if batched:
            shape = self.output_shape(func, args, kwargs, inputs)
            dim = self.dim_in(shape)
            rows = "" if dim is None or not any(
                self.padded_size(t, len(shape), dim) == self.batch_size for t in tracked) else (
                f". Its value there has the batch's {self.batch_size} rows from a tensor that "
                "comes from no input (made in the forward: `torch.rand(B)`), which the path "
                "does not take for the samples' rows: make it from one that does "
                "(`torch.rand_like(x[:, 0])`), pass it in, or use `torch.where(mask, p, x)`")
            self.refuse(
                f"uses its raw parameter(s) {values} together with the batch in "
                f"`{_name(func)}`, which the per-sample path for raw parameters cannot follow "
                "(it follows elementwise ops such as `x + p` and `x * p`, expands such as "
                "`p.expand(B, -1, -1)`, and `F.linear(x, p, b)`, `x @ p` and `x @ p.T` of raw "
                f"parameters, with the batch of size B at batch_dim){rows}")
            out = func(*args, **kwargs)
            self.add_results(func, args, kwargs, inputs, out)
            return out
        return self.derive(func, args, kwargs)

    def add_results(self, func: Callable[..., Any], args: tuple, kwargs: dict,
                    inputs: list[Tensor], out: object) -> None:
        """Record the outputs of an op with a batched input as batched, and as moved where
        their rows are not the call's (:func:`_reorders_rows`) or a statistic over them
        (:func:`_reduces_batch`)."""
        moved = self.moved_by(func, args, kwargs, inputs)
        for o in _outputs(out):
            self.batched[id(o)] = o
            if moved is None:
                self.moved.pop(id(o), None)
            else:
                self.moved[id(o)] = (o, *moved)

    def moved_by(self, func: Callable[..., Any], args: tuple, kwargs: dict,
                 inputs: list[Tensor]) -> tuple[str, bool] | None:
        """The op that moved an op's output rows and whether it mixed them (None: the rows are
        the call's)."""
        if _reduces_batch(func, args, kwargs, self.uses.batch_dim):
            return _name(func), True
        order = _reorders_rows(func, args, kwargs, self.uses.batch_dim, self.batch_size)
        if order is None:  # the rows of its inputs
            return next((self.moved[id(t)][1:] for t in inputs if id(t) in self.moved), None)
        if order:
            return "__getitem__" if func in _GETITEM else _name(func), False
        target = self.moved.get(id(args[0] if args else kwargs.get("input")))  # a scatter
        return None if target is None else target[1:]

    def output_shape(self, func: Callable[..., Any], args: tuple, kwargs: dict,
                     inputs: list[Tensor]) -> tuple[int, ...] | None:
        try:
            if func in REPEAT:
                sizes = _repeats(args)
                source = args[0]
                padded = (1,) * (len(sizes) - source.dim()) + tuple(source.shape)
                return tuple(a * b for a, b in zip(padded, sizes))
            if func in EXPANDS:
                return tuple(func(*args, **kwargs).shape)  # a view: nothing copied
            return _broadcast_shape([t.shape for t in inputs])
        except (RuntimeError, TypeError, ValueError, IndexError):
            return None  # the op itself will say what is wrong

    def adopt_batch_size(self, shape: tuple[int, ...]) -> None:
        """A call with no tensor input expands a derived value: its size at batch_dim is the
        batch (``compute_*`` refuses the step if the other modules saw another)."""
        dim = self.uses.batch_dim
        dim = dim if dim >= 0 else dim + len(shape)
        if 0 <= dim < len(shape):
            self.batch_size = self.record.batch_size = shape[dim]

    def dim_in(self, shape: tuple[int, ...] | None) -> int | None:
        """The batch dim of an output of ``shape``, if it has size B there."""
        if shape is None or self.batch_size is None:
            return None
        dim = self.uses.batch_dim
        dim = dim if dim >= 0 else dim + len(shape)
        if not 0 <= dim < len(shape) or shape[dim] != self.batch_size:
            return None
        return dim

    @staticmethod
    def padded_size(t: Tensor, rank: int, dim: int) -> int:
        """``t``'s size at ``dim`` of its shape padded with leading 1s to ``rank`` dims."""
        index = dim - (rank - t.dim())
        return 1 if index < 0 else t.shape[index]

    def use_site(self, func: Callable[..., Any], args: tuple, kwargs: dict,
                 tracked: list[Tensor], rank: int, dim: int) -> object:
        """Run the op with each derived input replaced by its broadcast view over the batch,
        watched."""
        views = {}
        for t in tracked:
            expanded = [1] * (rank - t.dim()) + list(t.shape)
            expanded[dim] = self.batch_size
            # expand, not a reshape then an expand: the reshape's backward would hand the
            # parameter a view of the captured gradient at B = 1 (autograd keeps it as p.grad,
            # which clip_grads then overwrites); the expand's sums or passes it on as it is
            view = t.expand(expanded)
            views[id(t)] = view
            self.watched.append(view)
            self.record.sites.append(Site(self.tracked[id(t)][1], t.shape, dim))
        args, kwargs = _replace(args, kwargs, Tensor, lambda a: views.get(id(a), a))
        if func in REPEAT:
            sizes = list(_repeats(args))
            sizes[dim] = 1  # the view carries the batch already
            args = (args[0], *sizes)
        out = func(*args, **kwargs)
        for o in _outputs(out):
            self.batched[id(o)] = o
        return out

    def linear_site(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
        """``F.linear(x, weight, bias)`` with ``x`` batched and its weight or bias raw
        parameters (the other a constant or None), or ``x @ w`` with ``w`` a raw 2-D parameter
        or its transpose: run as it is, its output watched (:class:`LinearSite`). None (not
        run) for anything else."""
        names = ("input", "weight", "bias") if func in LINEAR else ("input", "other")
        bound = dict(zip(names, args), **kwargs)
        x, dim = bound.get("input"), self.uses.batch_dim
        if not isinstance(x, Tensor) or id(x) not in self.batched or not 0 <= dim < x.dim() - 1 \
                or x.shape[dim] != self.batch_size:  # (the batch moved off batch_dim)
            return None
        if func in LINEAR:
            found: list[str | None] = []
            for t in (bound.get("weight"), bound.get("bias")):
                entry = self.tracked.get(id(t)) if isinstance(t, Tensor) else None
                if isinstance(t, Tensor) and id(t) in self.batched or \
                        entry is not None and not entry[1].is_parameter:
                    return None
                found.append(entry[1].name if entry is not None else None)
            site = LinearSite(*found, x.detach(), dim)
        else:
            entry = self.tracked.get(id(bound.get("other")))
            if entry is None or entry[0].dim() != 2:
                return None
            value = entry[1]
            name = value.name if value.is_parameter else _transposed_parameter(value)
            if name is None:
                return None
            site = LinearSite(name, None, x.detach(), dim, transposed=value.is_parameter)
        out = func(*args, **kwargs)
        self.watched.append(out)
        self.record.sites.append(site)
        self.batched[id(out)] = out
        return out

    def norm_site(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
        """A normalization (:data:`NORMS`) of the batch with raw parameters as its weight or
        bias, neither batched: normalized without them, then ``* weight + bias`` through
        :meth:`apply` (use sites of the per-channel, or ``normalized_shape``, values). None
        (not run) for anything else; batch statistics are refused."""
        try:
            bound = _NORM_SIGNATURES[func].bind(*args, **kwargs).arguments
        except TypeError:
            return None  # the op itself will say what is wrong
        weight, bias = bound.pop("weight", None), bound.pop("bias", None)
        if id(bound.get("input")) not in self.batched or any(
                id(t) in self.batched for t in (weight, bias) if isinstance(t, Tensor)):
            return None
        if func is F.batch_norm and (bound.get("training") or
                                     bound.get("running_mean") is None):
            self.refuse(BATCH_STATISTICS)
            self.record.mixes_samples = True
            return None
        x = func(**bound)
        self.batched[id(x)] = x
        shape = tuple(bound["normalized_shape"]) if func is F.layer_norm else \
            (-1, *[1] * (x.dim() - 2))  # per channel, at dim 1
        for value, op in ((weight, torch.mul), (bias, torch.add)):
            if value is not None:
                x = self.apply(op, (x, self.apply(Tensor.reshape, (value, shape), {})), {})
        return x

    def derive(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
        """Run an op of derived values and constants; its outputs that require grad are
        derived."""
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        args_, kwargs_ = self.template(args, kwargs)
        several = isinstance(out, (tuple, list))
        for index, o in enumerate(out if several else [out]):
            if isinstance(o, Tensor) and o.requires_grad and id(o) not in self.tracked \
                    and id(o) not in self.batched:
                self.tracked[id(o)] = (o, Derived(func=func, args=args_, kwargs=kwargs_,
                                                  index=index if several else None))
        return out

    # --------------------------------------------------------------- boundaries

    def check_inputs(self, inputs: list[Tensor], where: str) -> None:
        """Refuse a trainable parameter of a descendant, and a value computed from raw
        parameters out of the mode's sight that has a gradient (a custom autograd Function)."""
        for t in inputs:
            entry = self.uses.descendants.get(id(t))
            if entry is not None and t.requires_grad:
                self.refuse(f"uses '{entry[0]}', a parameter of a module below it, in {where} "
                            "outside that module's forward: its rule would miss that term")
            unseen = self.unseen.get(id(t))
            if unseen is not None and t.grad_fn is not None:
                self.refuse(f"uses its raw parameter(s) {unseen[1]} in a computation whose "
                            "gradient the per-sample path cannot follow (a custom "
                            f"torch.autograd.Function?), then in {where}")

    def check_child_inputs(self, child: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = _leaves(args, kwargs, Tensor)
        where = f"a call of its child '{self.uses.names.get(child, '?')}'"
        self.check_inputs(inputs, where)
        self.passing = self.keep_expansions(inputs)
        for expansion in self.passing:
            expansion.child = expansion.child or where.removeprefix("a call of its ")
        for t in inputs:
            entry = self.tracked.get(id(t))
            if entry is not None:
                self.refuse(f"passes a value of its raw parameter(s) {_describe(entry[1])} to "
                            f"{where} ({type(child).__name__}), whose rule does not see that "
                            "use")
            moved = self.moved.get(id(t))
            if moved is None or not any(p.requires_grad for p in child.parameters()):
                continue
            if moved[2]:
                self.refuse(f"passes values computed with `{moved[1]}` over batch_dim, a "
                            f"statistic of every sample, to {where} ({type(child).__name__}): "
                            "per-sample gradients are undefined for it")
                self.record.mixes_samples = True
            else:
                self.refuse(f"passes rows that `{moved[1]}` picked along batch_dim by an index "
                            "(a graph's edges, a token's expert, a permutation) to "
                            f"{where} ({type(child).__name__}), whose rule takes its rows for "
                            "the batch's")

    def keep_expansions(self, tensors: list[Tensor]) -> list[_Expansion]:
        """Provisional batches that leave the forward are the batch (a child's input, an
        output): their expansions."""
        kept = {id(e): e for e in map(self.expansion_of.get, map(id, tensors)) if e is not None}
        for expansion in kept.values():
            expansion.used = True
        return list(kept.values())

    def add_child_outputs(self, tensors: list[object]) -> None:
        """A child's outputs: batched (:meth:`add_batched`), and values of the expansions
        passed to it (met by the batch at another dim, refused)."""
        self.add_batched(tensors)
        for expansion in self.passing:
            for t in tensors:
                if isinstance(t, Tensor) and id(t) in self.batched:
                    expansion.values[id(t)] = (t, None)
                    self.expansion_of[id(t)] = expansion
        self.passing = []

    def check_output(self, output: object) -> None:
        tensors = _flat_tensors(output)
        self.check_inputs(tensors, "its output")
        self.keep_expansions(tensors)
        for t in tensors:
            entry = self.tracked.get(id(t))
            if entry is not None and self.record.problem is None:
                self.refuse(f"returns a value of its raw parameter(s) {_describe(entry[1])} "
                            "without the batch")
                self.record.returns_unbatched = True


def _repeats(args: tuple) -> tuple[int, ...]:
    """The sizes of ``t.repeat(*sizes)`` or ``t.repeat(sizes)``."""
    if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)):
        return tuple(args[1])
    return tuple(args[1:])


class RawUses(TorchFunctionMode):
    """Follows the raw parameters of ``owner`` through each call of its forward (see the module
    docstring), for a call recorded by the hooks: ``capturing()`` says whether the hooks record
    now. :meth:`take` gives the last call's watched tensors and its :class:`Uses` (the
    :attr:`HookState.watchers <per_sample_hooks.capture.HookState>` entry of ``owner``).

    :meth:`install` adds a forward pre-hook on ``owner`` (enter the mode), a forward hook run
    first and also on an exception (leave it), and both on the modules its code may call:
    its children and every descendant with parameters (suspend it; a child's batched outputs
    are recorded as they come back). A copy of the owner (pickling, ``copy.deepcopy``) gets
    hooks that do nothing."""

    def __init__(self, owner: nn.Module, batch_dim: int, capturing: Callable[[], bool]):
        super().__init__()
        self.owner, self.batch_dim, self.capturing = owner, batch_dim, capturing
        own = {id(p) for p in owner._parameters.values() if p is not None}
        self.descendants = {id(p): (name, p) for name, p in owner.named_parameters()
                            if id(p) not in own}
        self.names = {m: name for name, m in owner.named_modules() if m is not owner}
        self.forward: _Forward | None = None
        self.finished: tuple[list[Tensor], Uses] = ([], Uses([]))
        self.depth = 0  # calls of the owner's modules under way inside its forward
        self.suspended = False  # the mode was left for them
        self.nested = 0  # calls of the owner itself inside its forward (refused)

    def __reduce__(self) -> tuple:
        return _inert, ()

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles."""
        owner = self.owner
        handles = [owner.register_forward_pre_hook(self.before, with_kwargs=True),
                   owner.register_forward_hook(self.after, prepend=True, always_call=True)]
        callees = dict.fromkeys(owner.children())
        callees.update(dict.fromkeys(m for m in owner.modules()
                                     if m is not owner and next(m.parameters(False), None)
                                     is not None))
        for module in callees:
            handles += [module.register_forward_pre_hook(self.before_callee, with_kwargs=True),
                        module.register_forward_hook(self.after_callee, always_call=True)]
        return handles

    def take(self) -> tuple[list[Tensor], Uses]:
        finished, self.finished = self.finished, ([], Uses([]))
        return finished

    @torch.compiler.disable  # (the owner's own ops only: its callees run without the mode)
    def __torch_function__(self, func: Callable[..., Any], types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        forward = self.forward
        if forward is None or self.depth:
            return func(*args, **kwargs)
        return forward.apply(func, args, kwargs)

    # --------------------------------------------------------------- hooks

    @torch.compiler.disable  # (see capture.ModelCallHook)
    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.forward is not None:  # the owner called inside its own forward
            self.forward.refuse("is called inside its own forward")
            self.nested += 1
            return
        if self.owner is None or not self.capturing():
            # should the hooks record this call all the same (capture or grad mode switched
            # on inside the forward), its uses were not followed: refused, not zero
            self.finished = ([], Uses([], "began its forward while capture was off"))
            return
        self.forward = _Forward(self, args, kwargs)
        self.depth, self.suspended, self.nested = 0, False, 0
        self.__enter__()

    @torch.compiler.disable  # (see capture.ModelCallHook)
    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        forward = self.forward
        if forward is None:
            return
        if self.nested:
            self.nested -= 1
            return
        self.__exit__(None, None, None)
        self.forward = None
        forward.check_output(output)
        self.finished = (forward.watched, forward.record)

    @torch.compiler.disable  # (see capture.ModelCallHook)
    def before_callee(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        forward = self.forward
        if forward is None:
            return
        if not self.depth:
            forward.check_child_inputs(module, args, kwargs)
            if torch.overrides._get_current_function_mode() is self:
                self.__exit__(None, None, None)  # the callee runs without the mode
                self.suspended = True
        self.depth += 1

    @torch.compiler.disable
    def after_callee(self, module: nn.Module, args: tuple, output: object) -> None:
        forward = self.forward
        if forward is None or not self.depth:
            return
        self.depth -= 1
        if not self.depth:
            if self.suspended:
                self.__enter__()
                self.suspended = False
            forward.add_child_outputs(_flat_tensors(output))


def _inert() -> RawUses:
    """A :class:`RawUses` whose hooks do nothing (that of a copy of a hooked model)."""
    inert = RawUses.__new__(RawUses)
    inert.owner, inert.forward, inert.depth, inert.nested = None, None, 0, 0
    return inert


def follow_raw_uses(owner: nn.Module, batch_dim: int, capturing: Callable[[], bool]
                    ) -> tuple[Callable[[], tuple[list[Tensor], Uses]], list[Any]]:
    """Follow ``owner``'s raw parameters: its watcher (``HookState.watchers[owner]``) and the
    handles of the hooks installed."""
    uses = RawUses(owner, batch_dim, capturing)
    return uses.take, uses.install()


__all__ = ["Derived", "Site", "LinearSite", "Uses", "RawUses", "follow_raw_uses", "ELEMENTWISE",
           "EXPANDS", "LINEAR", "MATMUL", "REPEAT"]
