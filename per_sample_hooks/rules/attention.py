"""nn.MultiheadAttention: Linear-form per-sample gradients, captured in its forward.

A call whose projections were captured during its forward (:mod:`.attention_capture`: the
gradient of each in-projection's output and the input of the out-projection, watched) gets its
forms from those directly, nothing recomputed (:func:`captured_forms`): every parameter's
per-sample gradient is a sum of ``forms.Outer`` forms, ``G_b^T A_b`` over positions, some of
them a block of rows (``bias_k`` / ``bias_v``: dense, from their per-sample copies), from
which every quantity follows. A call not captured in its forward (under ``torch.compile``, a
parameter unfrozen after the forward) is captured the same way in a re-run of torch's own
forward, the gradients of its products by autograd (:func:`rerun_captured`); one the capture
does not cover (another torch-function mode, a tensor subclass) is re-run by the
``torch.func`` fallback (:func:`.fallback.call_grad1`,
its outputs compared with the call's), whose per-sample gradients are dense forms. No
attention math is written here. The forward uses ``out_proj.weight`` without calling
``out_proj``, so the rule covers the children's parameters (``covers_children``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import Call, summed_passes
from ..errors import PerSampleHooksError
from ..forms import Dense, Form, by_parameter, one_group
from .attention_capture import Captured, ProjectionCapture, capture_projections
from .base import Rule, register_rule
from .fallback import call_grad1, explicit_attention_agrees, unit_parameters

IN_PROJ = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias")
"""Parameters of the in-projections (their gradients need the query, key and value)."""

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def bind(module: nn.MultiheadAttention, call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """``(query [B, L, E], key [B, S, kdim], value [B, S, vdim])`` of ``call``, batch first."""
    arguments = _SIGNATURE.bind(module, *call.args, **call.kwargs).arguments
    sequences = (arguments["query"], arguments["key"], arguments["value"])
    return sequences if module.batch_first else tuple(t.transpose(0, 1) for t in sequences)


def output_gradient(module: nn.MultiheadAttention, call: Call) -> Tensor:
    """The captured gradient of the attention output, summed over passes: ``[B, L, E]``
    (zeros where only the attention weights reached the loss: attention-map supervision)."""
    if not call.grads[0]:
        query = bind(module, call)[0]
        return query.new_zeros(*query.shape[:2], module.embed_dim)
    grad = summed_passes(call.grads[0])
    return grad if module.batch_first else grad.transpose(0, 1)


def captured(call: Call) -> Captured | None:
    """The call's captured projections, when they serve its per-sample gradients: captured,
    and every watched gradient arrived in each backward pass the output's did (else None:
    re-run)."""
    note = call.note
    if not isinstance(note, Captured):
        return None
    passes = len(call.grads[0])
    if not passes or any(len(watched) != passes for watched in call.watched):
        return None
    return note


def captured_forms(module: nn.MultiheadAttention, call: Call, note: Captured,
                   watched: Sequence[Tensor], names: Sequence[str]
                   ) -> list[tuple[str, Form]] | None:
    """``(parameter name, form)`` of one captured call for the parameters in ``names``:
    ``out_proj`` from the output gradient ``G`` and the out-projection's input,
    ``Outer(G, o)``; each in-projection's block of rows ``Outer(dP, x)`` from the gradient
    ``dP`` of its output (``watched``, ``[L, B, rows]`` each) and its input ``x`` (query, key
    or value); ``bias_k`` / ``bias_v`` dense, the gradients of their copies (``watched``
    after the projections, ``[1, B, E]``). None when a parameter in ``names`` is in no
    captured product."""
    grad_out = output_gradient(module, call)
    terms: list[tuple[str, Form]] = []
    if "out_proj.bias" in names:
        terms.append(("out_proj.bias", one_group(grad_out, None)))
    if "out_proj.weight" in names:
        if note.attended is None:  # frozen in the forward
            return None
        attended = note.attended.transpose(0, 1).to(grad_out.dtype)  # [B, L, E]
        terms.append(("out_proj.weight", one_group(grad_out, attended)))
    sources = bind(module, call) if any(n in names for n in IN_PROJ) else None
    for projection, grad in zip(note.projections, watched):
        grad = grad.transpose(0, 1)  # [L, B, rows] -> [B, L, rows]
        if projection.weight in names:
            terms.append((projection.weight, one_group(grad, sources[projection.source],
                                                       projection.weight_rows)))
        if projection.has_bias and "in_proj_bias" in names:
            terms.append(("in_proj_bias", one_group(grad, None, projection.bias_rows)))
    for name, grad in zip(note.appended, watched[len(note.projections):]):
        if name in names:  # [1, B, E] -> [B, 1, 1, E]
            terms.append((name, Dense(grad.transpose(0, 1).unsqueeze(1))))
    if {n for n, _ in terms} != set(names):
        return None
    return terms


def rerun_captured(module: nn.MultiheadAttention, call: Call
                   ) -> tuple[Captured | None, list[Tensor]]:
    """The call's forward re-run (torch's own, its hooks bypassed, grad on) under the
    projection capture, and the gradients of its watched products by autograd from the
    call's output gradients: the note and ``dP`` of a captured call. None when the re-run is
    not captured either (another torch-function mode, a tensor subclass). The re-run takes
    the explicit ``softmax(QK^T)V`` where it agrees (:func:`.fallback.explicit_attention_agrees`)
    and three in-projections rather than one packed: measured about 1.3x faster than the fused
    attention's and the packed projection's backward on CPU."""
    capture = ProjectionCapture(module, lambda: True)
    arguments = _SIGNATURE.bind(module, *call.args, **call.kwargs).arguments
    del arguments["self"]
    if explicit_attention_agrees(arguments):
        arguments["need_weights"] = True
    arguments["key"], arguments["value"] = (t if t is not arguments["query"] else t.view_as(t)
                                            for t in (arguments["key"], arguments["value"]))
    with torch.enable_grad(), capture:
        output = type(module).forward(module, **arguments)
    watched, note = capture.take()
    if note is None or not watched:
        return note, []
    pairs = [(out, summed_passes(passes)) for out, passes in zip(output, call.grads)
             if passes and isinstance(out, Tensor) and out.requires_grad]
    grads = torch.autograd.grad([out for out, _ in pairs], watched, [g for _, g in pairs],
                                allow_unused=True)
    return note, [torch.zeros_like(w) if g is None else g for w, g in zip(watched, grads)]


def call_forms(module: nn.MultiheadAttention, call: Call, names: Sequence[str]
               ) -> list[tuple[str, Form]]:
    """The forms of one call: captured in its forward, else in a re-run of its forward, else
    the fallback's per-sample gradients (``torch.func`` on the forward)."""
    note = captured(call)
    if note is not None:
        terms = captured_forms(module, call, note,
                               [summed_passes(passes) for passes in call.watched], names)
        if terms is not None:
            return terms
        if module.dropout > 0 and call.training:  # check() passed it
            raise PerSampleHooksError(
                f"{type(module).__name__} with dropout={module.dropout} in training mode: a "
                "parameter frozen during the forward was unfrozen before this call, so its "
                "per-sample gradient was not captured, and re-running it would draw a new "
                "dropout mask. Unfreeze parameters before the forward")
    note, watched = rerun_captured(module, call)
    terms = None if note is None else captured_forms(module, call, note, watched, names)
    if terms is not None:
        return terms
    grads = call_grad1(module, call, unit_parameters(module), names, 1.0)
    return [(name, Dense(grad)) for name, grad in zip(names, grads)]


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(Rule):
    covers_children = True
    forms_rerun = True

    def batch_size(self, module: nn.MultiheadAttention, call: Call) -> int:
        return bind(module, call)[0].shape[0]

    def watch(self, module: nn.MultiheadAttention, batch_dim: int,
              capturing: Callable[[], bool]
              ) -> tuple[Callable[[], tuple[list[Tensor], object]], list[Any]]:
        """The projections, captured during the forward (:mod:`.attention_capture`)."""
        return capture_projections(module, capturing)

    def check(self, module: nn.MultiheadAttention, calls: Sequence[Call], name: str) -> None:
        if module.dropout > 0 and any(call.training and captured(call) is None
                                      for call in calls):
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) has dropout={module.dropout} in training "
                "mode, and a call whose projections were not captured in its forward (under "
                "torch.compile, another torch-function mode, ...): the rule re-runs that call's "
                "attention, and dropout would draw a new random mask, so per-sample gradients "
                "would not be those of the step. Use dropout=0, or model.eval() for the step")
        for call in calls:
            if bind(module, call)[0].dim() != 3:
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}) was called on an unbatched query "
                    "(2-D): per-sample gradients need a batch dim")

    def forms(self, module: nn.MultiheadAttention, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Per call, the captured forms, else the attention re-run once for all parameters in
        ``names``."""
        return by_parameter((pair for call in calls for pair in call_forms(module, call, names)),
                            names)
