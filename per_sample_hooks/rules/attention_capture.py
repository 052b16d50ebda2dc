"""nn.MultiheadAttention's projections, captured during its own forward (no recompute).

Every parameter of the attention but ``bias_k`` / ``bias_v`` is used in a Linear product inside
``F.multi_head_attention_forward``: the in-projection(s) ``linear(x, W_rows, b_rows)`` with
``x`` the query, key or value and ``W_rows`` all of ``in_proj_weight`` (self-attention), a
block of its rows (cross-attention) or ``q/k/v_proj_weight``; the out-projection
``linear(o, out_proj.weight, out_proj.bias)`` on the merged heads ``o``. With the gradient of
each in-projection's output ``P`` watched (:attr:`Call.watched
<per_sample_hooks.capture.Call>`) and the value of ``o`` kept, the per-sample gradients are
Linear forms, exact, whatever lies between (masks, dropout, returned weights that the loss
uses): ``W_rows`` is ``Outer(dP, x)``, ``b_rows`` ``Outer(dP)``, ``out_proj`` ``Outer(G, o)``.
``bias_k`` / ``bias_v`` are appended to the keys and values as ``bias.repeat(1, B, 1)``, one
copy per sample: the gradient of that copy, watched too, is their per-sample gradient.

How the products are seen: a ``torch.overrides.TorchFunctionMode`` is entered by a forward
pre-hook for the length of the module's forward (as :mod:`per_sample_hooks.raw_uses` does).
``F.multi_head_attention_forward`` hands itself to the mode whole (it checks
``has_torch_function`` first); the mode runs that same function's code with the check answered
False, so that its ops, ``linear`` among them, reach the mode one by one: torch's own forward,
op for op, nothing recomputed or replaced. A call is captured only when everything is as
expected (plain tensors, batched 3-D inputs, no static keys, one out-projection,
in-projections covering each in-projection weight's rows once, each trainable ``bias_k`` /
``bias_v`` repeated once, no other torch-function mode active but
``torch.set_default_device``'s: another would see the ops instead of the functional forward
whole); otherwise, and under ``torch.compile``, its note is None and the rule captures the
call in a re-run of its forward, or hands it to the fallback (:mod:`.attention`).
"""
from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext

IN_PROJECTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


@dataclass
class Projection:
    """One in-projection product of a call: rows ``weight_rows`` of parameter ``weight``
    (None: all of it) times input ``source`` (0, 1, 2: query, key, value), plus rows
    ``bias_rows`` of ``in_proj_bias`` (``has_bias`` False: no bias)."""
    weight: str
    weight_rows: slice | None
    source: int
    has_bias: bool
    bias_rows: slice | None


@dataclass
class Captured:
    """What one call's forward left for its per-sample gradients: the in-projections, in the
    order of the call's watched tensors (their outputs, ``[L, B, rows]``), then the names of
    the appended biases (``bias_k``, ``bias_v``) whose repeated copies (``[1, B, E]``) are
    watched after them, and the input of the out-projection, ``[L, B, E]`` (sequence first, as
    inside the functional forward; None when ``out_proj.weight`` is frozen)."""
    projections: list[Projection] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)
    attended: Tensor | None = None


def _rows(view: Tensor, parameter: Tensor | None) -> tuple[bool, slice | None]:
    """Whether ``view`` is ``parameter`` or a block of its rows, and which (None: all)."""
    if parameter is None:
        return False, None
    if view is parameter:
        return True, None
    if view._base is not parameter or view.shape[1:] != parameter.shape[1:] \
            or view.stride() != parameter.stride():
        return False, None
    offset = view.storage_offset() - parameter.storage_offset()
    row = parameter.stride(0) if parameter.dim() > 1 else 1
    if offset % row:
        return False, None
    start = offset // row
    return True, slice(start, start + view.shape[0])


def _unchecked(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``func`` with its ``has_torch_function`` check answered False (its code, its globals
    but that one name), or None when its code makes no such check."""
    code = getattr(func, "__code__", None)
    if code is None or "has_torch_function" not in code.co_names:
        return None
    names = dict(func.__globals__)
    names["has_torch_function"] = _never
    clone = types.FunctionType(code, names, func.__name__, func.__defaults__, func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


def _never(*args: object) -> bool:
    return False


_ARGUMENTS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
              "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p",
              "out_proj_weight", "out_proj_bias")
"""The positional parameters of ``F.multi_head_attention_forward``."""


class ProjectionCapture(TorchFunctionMode):
    """Captures the projections of each recorded call of one ``nn.MultiheadAttention`` (see the
    module docstring). :meth:`take` gives the last call's watched tensors and its
    :class:`Captured` note, or no tensors and None when the call was not captured (the
    :attr:`HookState.watchers <per_sample_hooks.capture.HookState>` entry of the module)."""

    def __init__(self, module: nn.MultiheadAttention, capturing: Callable[[], bool]):
        super().__init__()
        self.module, self.capturing = module, capturing
        self.active = False  # the mode is entered for the module's forward
        self.call: _Forward | None = None  # inside the functional forward
        self.finished: tuple[list[Tensor], Captured | None] = ([], None)
        # the functional forward and its unchecked clone, made once (a copy of its globals)
        self.unchecked: tuple[Callable[..., Any] | None, Callable[..., Any] | None] = \
            (None, None)

    def __reduce__(self) -> tuple:
        return _inert, ()

    def install(self) -> list[Any]:
        """Register the hooks (enter before the forward; leave first after it, also on an
        exception); returns their handles."""
        module = self.module
        return [module.register_forward_pre_hook(self.before),
                module.register_forward_hook(self.after, prepend=True, always_call=True)]

    def take(self) -> tuple[list[Tensor], Captured | None]:
        finished, self.finished = self.finished, ([], None)
        return finished

    def before(self, module: nn.Module, args: tuple) -> None:
        self.finished = ([], None)
        if self.module is None or self.active or torch.compiler.is_compiling() \
                or not self.capturing():
            return
        self.active = True
        self.__enter__()

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Callable[..., Any], types_: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        call = self.call
        if call is not None:
            out = func(*args, **kwargs)
            if func is F.linear:
                call.linear(args, kwargs, out)
            elif func is Tensor.repeat:
                call.repeat(args[0], out)
            return out
        if func is F.multi_head_attention_forward:
            return self.forward(func, args, kwargs)
        return func(*args, **kwargs)

    def forward(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> object:
        """Run the functional forward op by op under the mode, when the call is covered."""
        arguments = dict(zip(_ARGUMENTS, args), **kwargs)
        if self.unchecked[0] is not func:
            self.unchecked = (func, _unchecked(func))
        unchecked = self.unchecked[1]
        if unchecked is None or not _covered(arguments) or not _only_device_modes_below():
            # another mode below this one (the user's) is handed the functional forward whole
            return func(*args, **kwargs)
        self.call = _Forward(arguments)
        try:
            with self:
                out = unchecked(*args, **kwargs)
        finally:
            call, self.call = self.call, None
        self.finished = call.result()
        return out


def _only_device_modes_below() -> bool:
    """Whether the torch-function modes below this one, if any, are all torch's default-device
    mode (``torch.set_default_device``): it only places new tensors, so the functional forward
    may reach it op by op."""
    if not torch._C._len_torch_function_stack():
        return True
    return all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


class _Forward:
    """The products seen in one run of the functional forward."""

    def __init__(self, arguments: dict[str, Any]):
        self.sources = (arguments["query"], arguments["key"], arguments["value"])
        self.out_weight = arguments["out_proj_weight"]
        self.weights = {name: arguments.get(name) for name in IN_PROJECTION_WEIGHTS}
        self.bias = arguments.get("in_proj_bias")
        self.appended = {name: arguments.get(name) for name in ("bias_k", "bias_v")}
        self.watched: list[Tensor] = []
        self.appended_copies: list[Tensor] = []
        self.captured = Captured()
        self.out_calls = 0
        self.problem = False

    def linear(self, args: tuple, kwargs: dict, out: Tensor) -> None:
        given = dict(zip(("input", "weight", "bias"), args), **kwargs)
        x, weight, bias = given.get("input"), given.get("weight"), given.get("bias")
        if weight is self.out_weight:
            self.out_calls += 1
            if weight.requires_grad:  # else not needed: not held
                self.captured.attended = x.detach()
            return
        found = self.projection_weight(weight)
        if found is None:
            return  # not a projection
        name, rows = found
        source = next((i for i, s in enumerate(self.sources) if x is s), None)
        has_bias, bias_rows = _rows(bias, self.bias) if bias is not None else (False, None)
        if source is None or (bias is not None and not has_bias):
            self.problem = True  # a product of a projection weight not understood
            return
        if not out.requires_grad:
            return  # nothing trainable in it
        self.captured.projections.append(Projection(name, rows, source, has_bias, bias_rows))
        self.watched.append(out)

    def repeat(self, source: Tensor, out: Tensor) -> None:
        """``bias_k`` / ``bias_v`` repeated over the batch: watched if trainable."""
        name = next((n for n, bias in self.appended.items() if source is bias), None)
        if name is not None and out.requires_grad:
            self.captured.appended.append(name)
            self.appended_copies.append(out)

    def projection_weight(self, weight: Tensor) -> tuple[str, slice | None] | None:
        """``(parameter name, rows)`` of an in-projection weight or block of its rows."""
        for name, parameter in self.weights.items():
            found, rows = _rows(weight, parameter)
            if found:
                return name, rows
        return None

    def result(self) -> tuple[list[Tensor], Captured | None]:
        """The watched outputs and the note; no tensors and None unless every product was
        seen as expected."""
        trainable = sorted(n for n, bias in self.appended.items()
                           if bias is not None and bias.requires_grad)
        if self.problem or self.out_calls != 1 or not self._rows_covered() \
                or sorted(self.captured.appended) != trainable:
            return [], None
        shape = (*self.sources[0].shape[:2], self.out_weight.shape[1])  # [L, B, E]
        attended = self.captured.attended
        if attended is not None:
            if attended.numel() != shape[0] * shape[1] * shape[2]:
                return [], None
            self.captured.attended = attended.reshape(shape)
        return self.watched + self.appended_copies, self.captured

    def _rows_covered(self) -> bool:
        """The rows of each trainable in-projection weight, and of the bias, covered exactly
        once."""
        projections = self.captured.projections
        blocks = {name: [p.weight_rows for p in projections if p.weight == name]
                  for name in self.weights}
        blocks["in_proj_bias"] = [p.bias_rows for p in projections if p.has_bias]
        for name, parameter in {**self.weights, "in_proj_bias": self.bias}.items():
            if parameter is None or not parameter.requires_grad:
                continue
            spans = sorted((0, parameter.shape[0]) if rows is None else (rows.start, rows.stop)
                           for rows in blocks[name])
            end = 0
            for start, stop in spans:
                if start != end:
                    return False
                end = stop
            if end != parameter.shape[0]:
                return False
        return True


def _covered(arguments: dict[str, Any]) -> bool:
    """Whether a call of the functional forward is one the capture handles: batched 3-D
    inputs, plain tensors (a subclass's own ``__torch_function__`` is left to run), no static
    keys or values."""
    query = arguments.get("query")
    if not isinstance(query, Tensor) or query.dim() != 3:
        return False
    if any(arguments.get(name) is not None for name in ("static_k", "static_v")):
        return False
    return all(type(t) in (Tensor, nn.Parameter) for t in arguments.values()
               if isinstance(t, Tensor))


def _inert() -> ProjectionCapture:
    """A :class:`ProjectionCapture` whose hooks do nothing (that of a copy of a hooked
    model)."""
    inert = ProjectionCapture.__new__(ProjectionCapture)
    inert.module, inert.active, inert.call, inert.finished = None, False, None, ([], None)
    return inert


def capture_projections(module: nn.MultiheadAttention, capturing: Callable[[], bool]
                        ) -> tuple[Callable[[], tuple[list[Tensor], Captured | None]], list[Any]]:
    """Capture ``module``'s projections: its watcher (``HookState.watchers[module]``) and the
    handles of the hooks installed."""
    capture = ProjectionCapture(module, capturing)
    return capture.take, capture.install()


__all__ = ["Captured", "Projection", "ProjectionCapture", "capture_projections"]
