"""Raw parameters of a module that has children: per-sample gradients from their use sites.

A module that owns parameters directly and has child modules (ViT's embeddings with their class
token and position embeddings around a patch convolution; a block with LayerScale gammas around
its attention and MLP) keeps its children's rules; its own parameters get per-sample gradients
from the *use sites* its calls recorded (:mod:`per_sample_hooks.raw_uses`): at each site a
value ``t`` computed from the parameters met the batch, and the gradient of ``t``'s broadcast
view ``t_b`` (the call's watched tensor) holds, at the site's batch dim, the gradient of ``t``
of each sample::

    d l_b / d t = g_site[b]           (g_site: the captured gradient of t_b, batch dim first)
    d l_b / d p = sum over sites of  J_t(p)^T (d l_b / d t)

``J_t(p)^T`` is the identity when ``t`` is the parameter itself (``x + p``, ``p.expand(B, -1,
-1)``, ``x * p``); otherwise the recorded computation of ``t`` from the parameters
(``p[:, :T]``, an interpolation) is replayed with ``torch.func.vjp`` and the per-sample
gradients of ``t`` pulled back through it with ``vmap``. Several sites of one value are summed
before, and the calls' as they are pulled back: one :class:`~per_sample_hooks.forms.Dense` form
per parameter.

A call whose own code used a raw parameter in a way the sites cannot account for is refused,
with what it did and how to make the module one unit of the ``torch.func`` fallback.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import Call, summed_passes
from ..errors import PerSampleHooksError
from ..forms import Dense, Form, one_group
from ..raw_uses import Derived, LinearSite, Site, Uses, follow_raw_uses, gradients_by_value
from .base import Rule
from .fallback import FallbackRule
from .linear import flatten_positions


def _uses(call: Call) -> Uses:
    return call.note if isinstance(call.note, Uses) else Uses([])


def site_gradients(call: Call) -> list[tuple[Derived, Tensor]]:
    """Per derived value of ``call``'s use sites: its per-sample gradient ``[B, *t.shape]``,
    summed over the value's sites and the backward passes."""
    return gradients_by_value(  # (none: did not reach the loss; a Linear's: its forms)
        (site, summed_passes(passes)) for site, passes in zip(_uses(call).sites, call.watched)
        if passes and not isinstance(site, LinearSite))


def linear_forms(call: Call, names: Sequence[str]) -> list[tuple[str, Form]]:
    """``(name, form)`` of the call's ``F.linear`` and ``x @ w`` sites: a Linear layer's,
    ``Outer(G, x)`` for the weight (``Outer(x, G)`` for ``x @ w``, ``w [in, out]``) and
    ``Outer(G)`` for the bias, positions the leading dims."""
    found = []
    for site, passes in zip(_uses(call).sites, call.watched):
        if not passes or not isinstance(site, LinearSite):
            continue
        grad = summed_passes(passes)
        grads = flatten_positions(grad.movedim(site.batch_dim, 0))
        if site.weight in names:  # (an autocast forward's input: in the gradients' dtype)
            acts = flatten_positions(site.input.movedim(site.batch_dim, 0).to(grads.dtype))
            found.append((site.weight, one_group(acts, grads) if site.transposed
                          else one_group(grads, acts)))
        if site.bias in names:
            found.append((site.bias, one_group(grads, None)))
    return found


def pull_back(module: nn.Module, value: Derived, per_sample: Tensor) -> dict[str, Tensor]:
    """``{parameter name: [B, *p.shape]}``: per-sample gradients ``per_sample`` of ``value``
    pulled back to the parameters it is computed from, at ``module``'s parameters as the
    ``compute_*`` call sees them (an FSDP2 model's full values: the tensors its forward used
    are freed; a change in place since the forward is refused by ``check``)."""
    if value.is_parameter:
        return {value.name: per_sample}
    primals = {name: module.get_parameter(name).detach() for name in value.parameters()}
    with torch.enable_grad():
        _, vjp = torch.func.vjp(value.evaluate, primals)
        (grads,) = torch.func.vmap(vjp)(per_sample)
    return grads


OWN_UNIT_ADVICE = ("Its per-sample gradients cannot be followed op by op: make it one unit of "
                   "the torch.func fallback, add_hooks(model, units=['{name}']), or rewrite "
                   "that use")
"""The advice of a refusal of a use the path cannot follow: the module itself as a unit (which
a module called with merged rows cannot be: the step drops it for the unit to make)."""


class RawParameterRule(Rule):
    """Per-sample gradients of a module's own raw parameters from its calls' use sites."""

    def watch(self, module: nn.Module, batch_dim: int, capturing: Callable[[], bool]
              ) -> tuple[Callable[[], tuple[list[Tensor], Uses]], list[Any]]:
        """The use sites of the raw parameters, followed op by op."""
        return follow_raw_uses(module, batch_dim, capturing)

    def batch_size(self, module: nn.Module, call: Call) -> int:
        size = _uses(call).batch_size  # a call with no tensor input: its expand's
        return call.batch_size if size is None else size

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        for call in calls:
            uses = _uses(call)
            if uses.mixes_samples:
                raise PerSampleHooksError(f"'{name}' ({type(module).__name__}) {uses.problem}")
            if uses.returns_unbatched:
                caller = name.rpartition(".")[0]
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}) {uses.problem}, for the module that "
                    "calls it to combine with the batch. Expand the value to the batch "
                    "where it is returned (`return ..., p.expand(batch_size, *p.shape)`), or "
                    "make the calling module one unit of the torch.func fallback (its parent: "
                    f"add_hooks(model, units=['{caller}']))")
            if uses.problem is not None:
                raise PerSampleHooksError(f"'{name}' ({type(module).__name__}) {uses.problem}. "
                                          + OWN_UNIT_ADVICE.format(name=name))
            replayed = [site.value for site in uses.sites
                        if isinstance(site, Site) and not site.value.is_parameter]
            if any(value.modified() for value in replayed):
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}): a tensor its raw parameters' values "
                    "were computed from was modified in place after its forward (an optimizer "
                    "step before compute_*?); compute per-sample quantities before changing "
                    "the parameters")
            passes = call.n_passes
            if any(watched and len(watched) != passes for watched in call.watched):
                raise PerSampleHooksError(
                    f"'{name}' ({type(module).__name__}): a use of its raw parameters inside "
                    f"its forward received gradients in {len(max(call.watched, key=len))} "
                    f"backward passes, its outputs in {passes}: the passes cannot be paired. "
                    "Either the loss reads a value made in the forward other than through the "
                    "module's tensor outputs (a torch.distributions object it returns, whose "
                    "log_prob the loss takes, while an output tensor is not in that loss): "
                    "return such values as tensors and build the object outside the module; "
                    "or several backward passes ran: run one backward per forward")

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """The ``F.linear`` sites' forms, and the other sites' per-sample gradients summed
        over the calls as they are pulled back (one dense form per parameter: a module called
        in a loop holds one ``[B, *p]``, not one per call)."""
        result: dict[str, list[Form]] = {name: [] for name in names}
        sums: dict[str, Tensor] = {}
        for call in calls:
            for value, per_sample in site_gradients(call):
                for name, grad in pull_back(module, value, per_sample).items():
                    if name in result:
                        sums[name] = grad if name not in sums else sums[name] + grad
            for name, form in linear_forms(call, names):
                result[name].append(form)
        for name, parts in result.items():
            if name in sums:
                parts.append(Dense(sums[name]))
            elif not parts:  # not used in any call that reached the loss
                p = module.get_parameter(name)
                parts.append(Dense(p.new_zeros((self.batch_size(module, calls[0]), *p.shape))))
        return result


class RawUsesOrFallbackRule(RawParameterRule):
    """A module with raw parameters and no children with parameters (a learned scale or
    temperature, position embeddings added to its input, a normalization written by hand,
    einops' ``EinMix`` with its ``Rearrange``): its calls whose uses of
    the parameters can be followed (:class:`RawParameterRule`: exact, with no re-run, whatever
    random ops surround the uses) get their forms from the use sites; a call whose code used a
    parameter otherwise (``F.layer_norm`` with it, ``w @ x``) is re-run per sample by the
    ``torch.func`` fallback (:class:`~per_sample_hooks.rules.fallback.FallbackRule`), as every
    call of such a module was before. No child is hooked separately either way."""

    fallback = FallbackRule()

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        followed, rerun = _split_calls(calls)
        super().check(module, [call for call in calls if _uses(call).mixes_samples] + followed,
                      name)  # a statistic over the batch: no re-run makes it per sample
        self.fallback.check(module, rerun, name)

    def forms(self, module: nn.Module, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        followed, rerun = _split_calls(calls)
        result = super().forms(module, followed, names) if followed else \
            {name: [] for name in names}
        if rerun:
            for name, parts in self.fallback.forms(module, rerun, names).items():
                result[name] += parts
        return result


def _split_calls(calls: Sequence[Call]) -> tuple[list[Call], list[Call]]:
    """``calls`` whose uses were followed, and those to re-run (a use that was not)."""
    followed = [call for call in calls if _uses(call).problem is None]
    return followed, [call for call in calls if _uses(call).problem is not None]
