"""nn.MultiheadAttention: Linear-form per-sample gradients, captured or recomputed.

A call whose projections were captured during its forward (:mod:`.attention_capture`: the
gradient of each in-projection's output and the input of the out-projection, watched) gets its
forms from those directly: nothing is recomputed (:func:`captured_forms`). Any other call
(a configuration the capture does not cover: ``bias_k`` / ``bias_v``, ``torch.compile``, ...)
is recomputed as follows.

For one call (batch first here: ``query [B, L, E]``, ``key [B, S, kdim]``, ``value [B, S, vdim]``)
with captured gradients ``G [B, L, E]`` of the output and, when the loss used them, ``W_g`` of
the attention weights, the rule

1. recomputes ``q, k, v`` (in-projections with the module's weights), appends ``bias_k`` /
   ``bias_v`` and the zero attention, builds the additive mask as
   ``F.multi_head_attention_forward`` does, and forms ``P = softmax(q k^T / sqrt(hd) + mask)``
   per head and the merged heads ``o = P v`` (``[B, L, E]``);
2. out_proj is a Linear on ``o``: weight ``G_b^T o_b``, bias ``G_b.sum(L)``;
3. backpropagates ``dO = G Wo`` (and ``W_g``) through the attention by hand:
   ``dV = P^T dO``, ``dP = dO V^T (+ W_g)``, ``dS = P * (dP - rowsum(dP * P))``,
   ``dq = dS k / sqrt(hd)``, ``dk = dS^T q / sqrt(hd)``;
4. the in-projections are Linears too: ``dq_b^T query_b`` (rows ``0:E`` of ``in_proj_weight``),
   ``dk_b^T key_b``, ``dv_b^T value_b``; ``bias_k`` / ``bias_v`` get the gradient of their
   appended position.

Every parameter's per-sample gradient is thus a sum of ``forms.Outer`` forms,
``G_b^T A_b`` over positions, some of them a block of rows, from which every quantity
follows. The forward uses ``out_proj.weight`` without calling
``out_proj``, so the rule covers the children's parameters (``covers_children``).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import Call, summed_passes
from ..errors import PerSampleHooksError
from ..forms import Form, Outer, by_parameter, one_group
from .attention_capture import Captured, capture_projections
from .base import Rule, register_rule

IN_PROJ = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
           "bias_k", "bias_v")
"""Parameters whose gradients need the backward through the attention."""


@dataclass
class Inputs:
    """One call's arguments, batch first."""
    query: Tensor  # [B, L, E]
    key: Tensor  # [B, S, kdim]
    value: Tensor  # [B, S, vdim]
    key_padding_mask: Tensor | None  # [B, S]
    attn_mask: Tensor | None  # [L, S] or [B * heads, L, S]
    need_weights: bool
    average: bool
    is_causal: bool
    self_attention: bool  # query, key and value are the same tensor


_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two captured tensors are views of the same memory with the same layout (the
    hook detaches each argument, so ``is`` no longer tells)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def bind(module: nn.MultiheadAttention, call: Call) -> Inputs:
    """The arguments of ``call`` by name, sequences moved batch first."""
    arguments = _SIGNATURE.bind(module, *call.args, **call.kwargs).arguments
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    if not module.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    return Inputs(query, key, value, arguments.get("key_padding_mask"),
                  arguments.get("attn_mask"), arguments.get("need_weights", True),
                  arguments.get("average_attn_weights", True), arguments.get("is_causal", False),
                  _same(query, key) and _same(key, value))


def additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: masked) as ``0 / -inf``, a float mask as it is (as
    ``_canonical_mask``)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def attention_mask(inputs: Inputs, batch: int, heads: int, length: int, source: int,
                   extra: int, dtype: torch.dtype) -> Tensor | None:
    """The additive mask ``[B or 1, heads or 1, L, S + extra]`` that
    ``F.multi_head_attention_forward`` applies (``extra``: appended bias_kv / zero-attention
    positions, never masked); None when nothing is masked."""
    padding = additive(inputs.key_padding_mask, dtype)
    if inputs.is_causal and padding is None and not inputs.need_weights:
        # the SDPA path drops attn_mask and applies its own top-left causal mask
        causal = torch.ones(length, source + extra, dtype=torch.bool,
                            device=inputs.query.device).tril_()
        return additive(~causal, dtype)[None, None]
    mask = additive(inputs.attn_mask, dtype)
    if mask is not None:
        mask = mask[None, None] if mask.dim() == 2 else mask.view(batch, heads, length, source)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    if mask is not None and extra:
        mask = torch.nn.functional.pad(mask, (0, extra))
    return mask


def projections(module: nn.MultiheadAttention
                ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``(Wq, Wk, Wv, bq, bk, bv)``, detached."""
    if module._qkv_same_embed_dim:
        wq, wk, wv = module.in_proj_weight.detach().chunk(3)
    else:
        wq, wk, wv = (w.detach() for w in (module.q_proj_weight, module.k_proj_weight,
                                           module.v_proj_weight))
    if module.in_proj_bias is None:
        return wq, wk, wv, None, None, None
    bq, bk, bv = module.in_proj_bias.detach().chunk(3)
    return wq, wk, wv, bq, bk, bv


def split_heads(t: Tensor, heads: int) -> Tensor:
    """``[B, T, E] -> [B, heads, T, E / heads]``, contiguous (one copy; batched matmuls then
    need none)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2).contiguous()


def merge_heads(t: Tensor) -> Tensor:
    """``[B, heads, T, hd] -> [B, T, heads * hd]``."""
    return t.transpose(1, 2).flatten(2)


def project_heads(module: nn.MultiheadAttention, inputs: Inputs
                  ) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(q, k, v, extra)``: the in-projections per head, ``q [B, H, L, hd]``,
    ``k, v [B, H, S + extra, hd]`` with the ``extra`` appended positions (bias_kv, then the
    zero attention)."""
    heads = module.num_heads
    batch = inputs.query.shape[0]
    wq, wk, wv, bq, bk, bv = projections(module)
    if inputs.self_attention and module._qkv_same_embed_dim:
        bias = None if bq is None else module.in_proj_bias.detach()
        packed = torch.nn.functional.linear(inputs.query, module.in_proj_weight.detach(), bias)
        # [B, L, 3 * E] -> [3, B, H, L, hd] in one copy
        q, k, v = packed.unflatten(-1, (3, heads, -1)).permute(2, 0, 3, 1, 4).contiguous()
    else:
        q = split_heads(torch.nn.functional.linear(inputs.query, wq, bq), heads)
        k = split_heads(torch.nn.functional.linear(inputs.key, wk, bk), heads)
        v = split_heads(torch.nn.functional.linear(inputs.value, wv, bv), heads)
    appended_k, appended_v = [], []
    if module.bias_k is not None:
        appended_k.append(module.bias_k.detach().view(1, heads, 1, -1).expand(batch, -1, -1, -1))
        appended_v.append(module.bias_v.detach().view(1, heads, 1, -1).expand(batch, -1, -1, -1))
    if module.add_zero_attn:
        appended_k.append(k.new_zeros(batch, heads, 1, k.shape[-1]))
        appended_v.append(v.new_zeros(batch, heads, 1, v.shape[-1]))
    if appended_k:
        k, v = torch.cat([k, *appended_k], 2), torch.cat([v, *appended_v], 2)
    return q, k, v, len(appended_k)


def softmax_backward_(probs: Tensor, grad: Tensor) -> Tensor:
    """Gradient of the softmax's input (last dim) from that of its output ``grad`` (which is
    overwritten with it)."""
    return grad.sub_((grad * probs).sum(-1, keepdim=True)).mul_(probs)


def attention_backward(probs: Tensor, q_scaled: Tensor, k: Tensor, v: Tensor,
                       grad_heads: Tensor, grad_weights: Tensor | None, scaling: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` per head of ``o = softmax(q_scaled k^T + mask) v`` with
    ``q_scaled = scaling * q``, from ``dO`` (``grad_heads [B, H, L, hd]``) and the gradient of the
    probabilities other than through ``o`` (``grad_weights``, broadcast to ``[B, H, L, S]``)."""
    grad_probs = grad_heads @ v.transpose(-2, -1)
    if grad_weights is not None:
        grad_probs.add_(grad_weights)
    grad_v = probs.transpose(-2, -1) @ grad_heads
    grad_scores = softmax_backward_(probs, grad_probs)
    grad_q = (grad_scores @ k).mul_(scaling)
    grad_k = grad_scores.transpose(-2, -1) @ q_scaled
    return grad_q, grad_k, grad_v


def weights_gradient(call: Call) -> Tensor | None:
    """Captured gradient of the attention weights (batch first: the module returns them so
    whatever ``batch_first`` says), summed over passes; None if the loss did not use them."""
    passes = call.grads[1] if len(call.grads) > 1 else []
    return summed_passes(passes) if passes else None


def probs_gradient(call: Call, inputs: Inputs, heads: int) -> Tensor | None:
    """The captured gradient of the attention weights as one of the per-head probabilities:
    ``[B, H, L, S]``, or ``[B, 1, L, S]`` (each head's share of an average); None if unused."""
    grad_weights = weights_gradient(call)
    if grad_weights is None or not inputs.average:
        return grad_weights
    return (grad_weights / heads).unsqueeze(1)


def output_gradient(module: nn.MultiheadAttention, call: Call) -> Tensor:
    """The captured gradient of the attention output, summed over passes: ``[B, L, E]``."""
    grad = summed_passes(call.grads[0])
    return grad if module.batch_first else grad.transpose(0, 1)


def recomputed_forms(module: nn.MultiheadAttention, call: Call, names: Sequence[str]
                     ) -> list[tuple[str, Outer]]:
    """``(parameter name, form)`` of one call for the parameters in ``names`` (only the work
    they need): outer products of the recomputed projections' gradients and inputs; the
    unfused in-projection as three blocks (query, key, value rows); ``bias_k`` ``[1, 1, E]``
    as ``[1, E]``."""
    grad_out = output_gradient(module, call)
    terms: list[tuple[str, Outer]] = []
    if "out_proj.bias" in names:
        terms.append(("out_proj.bias", one_group(grad_out, None)))
    backward = any(n in names for n in IN_PROJ)
    if "out_proj.weight" not in names and not backward:
        return terms

    inputs = bind(module, call)
    batch, length, embed = inputs.query.shape
    source, heads = inputs.key.shape[1], module.num_heads
    q, k, v, extra = project_heads(module, inputs)
    scaling = math.sqrt(1.0 / q.shape[-1])
    q_scaled = q.mul_(scaling)
    mask = attention_mask(inputs, batch, heads, length, source, extra, q.dtype)
    scores = torch.matmul(q_scaled, k.transpose(-2, -1))  # [B, H, L, S + extra]
    if mask is not None:
        scores.add_(mask)
    probs = torch.softmax(scores, -1)
    del scores
    if "out_proj.weight" in names:
        terms.append(("out_proj.weight", one_group(grad_out, merge_heads(probs @ v))))
    if not backward:
        return terms

    grad_heads = split_heads(grad_out @ module.out_proj.weight.detach(), heads)  # dO per head
    grad_q, grad_k, grad_v = attention_backward(
        probs, q_scaled, k, v, grad_heads, probs_gradient(call, inputs, heads), scaling)
    del probs
    if module.bias_k is not None:
        if "bias_k" in names:
            terms.append(("bias_k", one_group(grad_k.new_ones(batch, 1, 1),
                                          grad_k[:, :, source].reshape(batch, 1, embed))))
        if "bias_v" in names:
            terms.append(("bias_v", one_group(grad_v.new_ones(batch, 1, 1),
                                          grad_v[:, :, source].reshape(batch, 1, embed))))
    grad_k, grad_v = grad_k[:, :, :source], grad_v[:, :, :source]
    blocks = [slice(0, embed), slice(embed, 2 * embed), slice(2 * embed, 3 * embed)]
    fused = inputs.self_attention and module._qkv_same_embed_dim
    if fused and ("in_proj_weight" in names or "in_proj_bias" in names):
        # [B, H, L, hd] each -> [B, L, 3, H, hd] = [B, L, 3 * E] in one copy: one product for
        # the whole weight
        merged = torch.stack([g.transpose(1, 2) for g in (grad_q, grad_k, grad_v)], 2).flatten(2)
        if "in_proj_weight" in names:
            terms.append(("in_proj_weight", one_group(merged, inputs.query)))
        if "in_proj_bias" in names:
            terms.append(("in_proj_bias", one_group(merged, None)))
        return terms
    grads = [merge_heads(g) for g in (grad_q, grad_k, grad_v)]
    acts = (inputs.query, inputs.key, inputs.value)
    if "in_proj_weight" in names:
        terms += [("in_proj_weight", one_group(g, a, r)) for r, g, a in zip(blocks, grads, acts)]
    for name, grad, act in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), grads, acts):
        if name in names:
            terms.append((name, one_group(grad, act)))
    if "in_proj_bias" in names:
        terms += [("in_proj_bias", one_group(g, None, r)) for r, g in zip(blocks, grads)]
    return terms


def captured(call: Call) -> Captured | None:
    """The call's captured projections, when they serve its per-sample gradients: captured,
    and every watched gradient arrived in each backward pass the output's did (else None:
    recomputed)."""
    note = call.note
    if not isinstance(note, Captured):
        return None
    passes = len(call.grads[0])
    if not passes or any(len(watched) != passes for watched in call.watched):
        return None
    return note


def captured_forms(module: nn.MultiheadAttention, call: Call, note: Captured,
                   names: Sequence[str]) -> list[tuple[str, Outer]] | None:
    """``(parameter name, form)`` of one captured call for the parameters in ``names``:
    ``out_proj`` from the output gradient ``G`` and the out-projection's input,
    ``Outer(G, o)``; each in-projection's block of rows ``Outer(dP, x)`` from the watched
    gradient ``dP`` of its output and its input ``x`` (query, key or value). None when a
    parameter in ``names`` is in no captured product (recomputed then)."""
    grad_out = output_gradient(module, call)
    terms: list[tuple[str, Outer]] = []
    if "out_proj.bias" in names:
        terms.append(("out_proj.bias", one_group(grad_out, None)))
    if "out_proj.weight" in names:
        if note.attended is None:  # frozen in the forward
            return None
        attended = note.attended.transpose(0, 1).to(grad_out.dtype)  # [B, L, E]
        terms.append(("out_proj.weight", one_group(grad_out, attended)))
    inputs = bind(module, call) if any(n in names for n in IN_PROJ) else None
    for projection, passes in zip(note.projections, call.watched):
        grad = summed_passes(passes).transpose(0, 1)  # [L, B, rows] -> [B, L, rows]
        if projection.weight in names:
            source = (inputs.query, inputs.key, inputs.value)[projection.source]
            terms.append((projection.weight, one_group(grad, source, projection.weight_rows)))
        if projection.has_bias and "in_proj_bias" in names:
            terms.append(("in_proj_bias", one_group(grad, None, projection.bias_rows)))
    if {n for n, _ in terms} != set(names):
        return None
    return terms


def call_forms(module: nn.MultiheadAttention, call: Call, names: Sequence[str]
               ) -> list[tuple[str, Outer]]:
    """The captured forms of one call when it has them, else the recomputed ones."""
    note = captured(call)
    terms = None if note is None else captured_forms(module, call, note, names)
    if terms is not None:
        return terms
    if note is not None and module.dropout > 0 and call.training:  # check() passed it
        raise PerSampleHooksError(
            f"{type(module).__name__} with dropout={module.dropout} in training mode: a "
            "parameter frozen during the forward was unfrozen before this call, so its "
            "per-sample gradient was not captured, and recomputing it would draw a new dropout "
            "mask. Unfreeze parameters before the forward")
    return recomputed_forms(module, call, names)


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(Rule):
    covers_children = True
    forms_rerun = True

    def batch_size(self, module: nn.MultiheadAttention, call: Call) -> int:
        return bind(module, call).query.shape[0]

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
                "mode, and a call whose projections were not captured in its forward (with "
                "bias_k / bias_v, under torch.compile, ...): the rule recomputes that call's "
                "attention, and dropout would draw a new random mask, so per-sample gradients "
                "would not be those of the step. Use dropout=0, or model.eval() for the step")
        for call in calls:
            if bind(module, call).query.dim() != 3:
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}) was called on an unbatched query "
                    "(2-D): per-sample gradients need a batch dim")

    def forms(self, module: nn.MultiheadAttention, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """Per call, the captured forms, else the attention recomputed once for all
        parameters in ``names``."""
        return by_parameter((pair for call in calls for pair in call_forms(module, call, names)),
                            names)
