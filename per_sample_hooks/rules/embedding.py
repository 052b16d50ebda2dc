"""nn.Embedding and nn.EmbeddingBag: per-sample gradients of a ``[V, d]`` table as scattered rows.

A sample's table gradient is non-zero only at the rows its tokens hit. Both layers give the
``forms.Rows`` form: entries ``(sample, row, value)`` on the table seen as ``[R, w]``
(``R w = V d``), sample ``b``'s gradient being the sum of its entries' values placed at their
rows:

- Embedding: one entry per non-padding token, ``[V, d]``, value the output gradient there;
- EmbeddingBag ``sum``/``mean``: one entry per non-padding token, value the bag's output
  gradient times its ``per_sample_weight`` (sum) or ``1 / bag size`` (mean);
- EmbeddingBag ``max``: one entry per (bag, dim ``j``) at the cell of the token that won the
  max there, ``[V d, 1]``; the winners are recomputed by the same ``torch.embedding_bag``.

Then, with ``N`` entries and no ``[B, V, d]`` tensor except for ``grad1`` itself, the form's
quantities (``forms``): per-sample gradients are one ``index_add`` into the zeroed buffer;
squared norms sum the values of equal (sample, row) keys (``unique`` + ``index_add``, O(N w))
and reduce per sample; the weighted sum is one ``index_add`` of the weighted values.

``max_norm`` renormalizes the hit rows in place under ``no_grad`` during the forward: the
gradient of a lookup does not depend on the table's values, and the per-sample loop sees the
same (idempotent) renormalized rows, so results stay exact. ``scale_grad_by_freq`` divides by
token counts *over the batch*, which mixes samples: refused.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from ..forms import Form, Rows
from .base import Rule, refuse_unbatched, register_rule

MODES = {"sum": 0, "mean": 1, "max": 2}


def token_rows(tokens: Tensor, grads: Tensor, padding_idx: int | None, num_rows: int
                  ) -> Rows:
    """Entries of one Embedding call: ``tokens [B, *]``, output gradients ``[B, *, d]``."""
    batch = tokens.shape[0]
    flat_tokens = tokens.reshape(-1)
    values = grads.reshape(flat_tokens.numel(), grads.shape[-1])  # -1: ambiguous if no token
    samples = torch.arange(batch, device=tokens.device).repeat_interleave(
        flat_tokens.numel() // batch if batch else 0)
    if padding_idx is not None:
        hit = flat_tokens != padding_idx
        samples, flat_tokens, values = samples[hit], flat_tokens[hit], values[hit]
    return Rows(samples, flat_tokens, values, num_rows)


def refuse_frequency_scaling(module: nn.Module, name: str) -> None:
    if module.scale_grad_by_freq:
        raise PerSampleHooksError(
            f"'{name}' ({type(module).__name__}) has scale_grad_by_freq=True: its gradient is "
            "divided by token counts over the whole batch, which mixes samples, so per-sample "
            "gradients are undefined. Use scale_grad_by_freq=False")


class RowsRule(Rule):
    """Shared rule for layers whose weight gradient is ``forms.Rows`` (parameter
    ``weight`` only): one form per call."""
    parameter_names = frozenset({"weight"})

    def rows(self, module: nn.Module, call: Call) -> Rows:
        raise NotImplementedError

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        return {name: [self.rows(module, call) for call in calls] for name in names}


@register_rule(nn.Embedding)
class EmbeddingRule(RowsRule):
    """Embedding on indices ``[B, *]``; the padding row gets no gradient."""
    needs_parameter_values = False  # shapes only: runs on FSDP2 shards

    one_hot_rows = True

    def rows(self, module: nn.Embedding, call: Call) -> Rows:
        return token_rows(call.activation(), call.backprop(), module.padding_idx,
                             module.num_embeddings)

    def check(self, module: nn.Embedding, calls: Sequence[Call], name: str) -> None:
        refuse_frequency_scaling(module, name)
        refuse_unbatched(module, calls, name, 0)  # (a 0-dim index: one row, [d])

    def aliases_output_gradient(self, module: nn.Embedding) -> bool:
        return module.sparse


def bag_arguments(call: Call) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(input, offsets, per_sample_weights)`` of an EmbeddingBag call, a 2-D input and its
    weights batch first."""
    names = ("input", "offsets", "per_sample_weights")
    bound = dict(zip(names, call.args))
    bound.update({k: v for k, v in call.kwargs.items() if k in names})
    indices, offsets, weights = (bound.get(n) for n in names)
    if weights is not None:
        weights = weights.detach()
    if indices.dim() == 2 and call.batch_dim != 0:
        indices = indices.movedim(call.batch_dim, 0)
        weights = None if weights is None else weights.movedim(call.batch_dim, 0)
    return indices, offsets, weights


def flat_bags(indices: Tensor, offsets: Tensor | None, weights: Tensor | None,
              include_last_offset: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor, int]:
    """``(tokens [N], offsets, weights [N] | None, bag of each token [N], number of bags)``;
    tokens outside every bag get bag ``-1``."""
    if indices.dim() == 2:
        batch, length = indices.shape
        tokens = indices.reshape(-1)
        offsets = torch.arange(0, tokens.numel(), max(length, 1), device=tokens.device)[:batch]
        bags = torch.arange(batch, device=tokens.device).repeat_interleave(length)
        return tokens, offsets, None if weights is None else weights.reshape(-1), bags, batch
    batch = len(offsets) - int(include_last_offset)
    positions = torch.arange(indices.numel(), device=indices.device)
    bags = torch.searchsorted(offsets, positions, right=True) - 1
    bags = torch.where(bags < batch, bags, -1)
    return indices, offsets, weights, bags, batch


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(RowsRule):
    """EmbeddingBag, each bag a sample: 2-D input ``[B, L]``, or 1-D input with ``offsets``
    (``B`` bags); modes sum (with ``per_sample_weights``), mean, max; ``padding_idx``."""

    def batch_size(self, module: nn.EmbeddingBag, call: Call) -> int:
        indices, offsets, _ = bag_arguments(call)
        if indices.dim() == 2:
            return indices.shape[0]
        return len(offsets) - int(module.include_last_offset)

    def rows(self, module: nn.EmbeddingBag, call: Call) -> Rows:
        indices, offsets, weights = bag_arguments(call)
        grads = call.backprop()  # [B, d]
        tokens, offsets, weights, bags, batch = flat_bags(indices, offsets, weights,
                                                          module.include_last_offset)
        padding = -1 if module.padding_idx is None else module.padding_idx
        if module.mode == "max":
            return self.max_rows(module, tokens, offsets, grads, padding)
        hit = (bags >= 0) & (tokens != padding)
        tokens, bags = tokens[hit], bags[hit]
        values = grads[bags]
        if module.mode == "mean":
            counts = torch.bincount(bags, minlength=batch).to(values.dtype)
            values = values / counts[bags].unsqueeze(1)
        elif weights is not None:
            values = values * weights[hit].to(values.dtype).unsqueeze(1)
        return Rows(bags, tokens, values, module.num_embeddings)

    def max_rows(self, module: nn.EmbeddingBag, tokens: Tensor, offsets: Tensor,
                    grads: Tensor, padding: int) -> Rows:
        """One entry per (bag, dim) at the winning token's cell, ``[V d, 1]``; empty bags
        (or bags of padding only) have none."""
        _, _, bag_size, winners = torch.embedding_bag(
            module.weight.detach(), tokens, offsets, False, MODES["max"], False, None,
            module.include_last_offset, module.padding_idx)
        batch, dim = grads.shape
        filled = (bag_size[:batch] > 0).unsqueeze(1) & (winners != padding)
        samples = torch.arange(batch, device=grads.device).unsqueeze(1).expand(batch, dim)
        cells = winners * dim + torch.arange(dim, device=grads.device)
        return Rows(samples[filled], cells[filled], grads[filled].unsqueeze(1),
                       module.num_embeddings * dim)

    def check(self, module: nn.EmbeddingBag, calls: Sequence[Call], name: str) -> None:
        refuse_frequency_scaling(module, name)
        for call in calls:
            indices, offsets, _ = bag_arguments(call)
            if indices.dim() == 1 and call.batch_dim != 0:
                raise PerSampleHooksError(
                    f"'{name}' (EmbeddingBag) got a 1-D input with offsets and batch_dim="
                    f"{call.batch_dim}: with offsets each bag is a sample (batch_dim 0)")
            if indices.dim() == 1 and module.include_last_offset and len(offsets) and \
                    int(offsets[-1]) != len(indices):
                raise PerSampleHooksError(
                    f"'{name}' (EmbeddingBag, include_last_offset=True) got offsets ending at "
                    f"{int(offsets[-1])} for {len(indices)} indices: torch's documentation "
                    "requires the last offset to be the input's length, and which bag the "
                    "tokens after it belong to is not defined (the CPU kernel adds them to the "
                    "last bag). End the offsets with len(input)")
