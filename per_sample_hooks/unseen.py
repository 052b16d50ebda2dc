"""Detection of parameter uses that no hook sees, by random projections of gradients.

Hooks see a parameter only inside the forward of the module that owns it. A use elsewhere (a
tied output layer ``h @ emb.weight.t()``, ``F.linear(x, layer.weight)``) adds a term to
``p.grad`` that per-sample gradients from hooks would silently miss. The check compares, per
step and parameter, two projections onto the same random rank-1 probes ``u v^T`` (two of
them, drawn fresh each step from a private generator; ``p`` seen as a ``[n0, n1]`` matrix):

- the *total*: ``u^T g v`` for the gradient ``g`` that autograd hands the parameter in each
  backward pass of the step (a tensor hook on the parameter; the gradient of that pass, not
  ``p.grad``, so gradients the user did not zero do not matter), summed over passes;
- the *hooked* sum: the same projection of the batch-summed contributions the rules see, which
  each rule computes from its captured pairs (:meth:`Rule.probe`; for Linear
  ``sum_{b,t} (G u)(A v)``, ``O(B T (p + d))``).

A term missing from the hooked sum shows up as a difference far above rounding (thresholds in
:func:`relative_tolerance`: 10% of the projection in float32, 1e-6 in float64; the size of a
gradient that came in several backward passes is the sum of each pass's ``|projection|``, since
passes can cancel: ``backprop_hess`` through a normalization sums to rounding). A parameter over
the threshold is confirmed before anything is raised (:meth:`UnseenUseCheck.rounding_explains`):
its users' contributions are recomputed by autograd from the captured calls in float32 and
float64, so that rounding inside a module's own backward (a saturated softmax's cancellation,
which no scale read off the projections bounds) is measured rather than reported. Cost per step:
one matrix-vector product over each parameter (``O(P)``, not ``O(B P)``) plus the rules' probes;
a rule without a cheap probe reads its own per-sample gradients once. A parameter whose
gradient autograd did not compute this step (``torch.autograd.grad`` for inputs only) is not
checked. A random projection can miss a term that is nearly orthogonal to both probes: with two
Gaussian probes the chance is negligible, and a miss does not repeat on the next step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from .capture import HookState
from .errors import PerSampleHooksError

N_PROBES = 2

Probe = tuple[Tensor, Tensor]  # u [N_PROBES, n0], v [N_PROBES, n1]


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """``p`` seen as ``[n0, n1]``: first dim by the rest (a scalar as ``[1, 1]``)."""
    n0 = shape[0] if len(shape) else 1
    return n0, (shape.numel() // n0 if n0 else 0)


def project(t: Tensor, probe: Probe) -> Tensor:
    """``u_k^T t v_k`` for ``t [..., n0, n1]`` and each probe ``k``: ``[..., N_PROBES]``."""
    u, v = probe
    return torch.linalg.vecdot(torch.matmul(u, t), v)


def project_gradient(grad: Tensor, probe: Probe) -> Tensor:
    """``u_k^T grad v_k`` for a parameter's gradient, dense or sparse (``Embedding(sparse=True)``
    gives rows: ``O(nnz)`` from its entries, no dense ``[V, d]`` copy)."""
    if not grad.is_sparse:
        return project(grad.reshape(matrix_shape(grad.shape)), probe)
    if grad.sparse_dim() != 1:
        return project(grad.to_dense().reshape(matrix_shape(grad.shape)), probe)
    u, v = probe
    rows, values = grad._indices()[0], grad._values().reshape(len(grad._indices()[0]), -1)
    return (torch.matmul(values, v.t()) * u[:, rows].t()).sum(0)


def project_samples(per_sample: Tensor, probe: Probe) -> tuple[Tensor, Tensor]:
    """Projection of ``per_sample.sum(0)`` (``[B, *shape]``) and its rounding scale: the sum of
    the absolute per-sample projections."""
    n0, n1 = matrix_shape(per_sample.shape[1:])
    each = project(per_sample.reshape(per_sample.shape[0], n0, n1), probe)
    return each.sum(0), each.abs().sum(0)


def relative_tolerance(dtype: torch.dtype) -> float:
    """Gap between total and hooked sum, relative to their size, above which a term is missing.

    Both sides are rounded differently (batched autograd vs the rules' math); in float32 a badly
    scaled model (saturated attention, large inputs) showed gaps of 5% with no missing term, so
    the float32 threshold is 10%: terms below that fraction of a gradient may go unreported.
    Larger gaps that are rounding (19% measured on a saturated attention) are told apart by the
    confirmation step, not by this threshold."""
    return {torch.float64: 1e-6, torch.float32: 1e-1}.get(dtype, 0.5)


class ProbeBank:
    """Persistent storage of every parameter's probes: one flat buffer per (dtype, device) of
    which each parameter's ``u [N_PROBES, n0]`` and ``v [N_PROBES, n1]`` are views, redrawn in
    one call per step (a CPU generator; copied to the device when the parameters are not on
    the CPU). Rebuilt when a parameter's dtype or device changes (``model.to(...)``).
    ``views`` is keyed by ``id(parameter)``."""

    def __init__(self, params: Sequence[Tensor], generator: torch.Generator):
        self.params = list(params)
        self.generator = generator
        self.views: dict[int, Probe] = {}
        self.layout: list[tuple[torch.dtype, torch.device]] = []
        self.flats: list[tuple[Tensor, Tensor]] = []  # (device buffer, CPU staging buffer)

    def _build(self) -> None:
        self.layout = [(p.dtype, p.device) for p in self.params]
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for p, key in zip(self.params, self.layout):
            n0, n1 = matrix_shape(p.shape)
            sizes[key] = sizes.get(key, 0) + N_PROBES * (n0 + n1)
        flats = {key: torch.empty(size, dtype=key[0], device=key[1])
                 for key, size in sizes.items()}
        self.flats = [(flat, flat if flat.device.type == "cpu" else
                       torch.empty(flat.shape, dtype=flat.dtype)) for flat in flats.values()]
        offsets = dict.fromkeys(sizes, 0)
        self.views.clear()  # in place: hooks hold this dict
        for p, key in zip(self.params, self.layout):
            n0, n1 = matrix_shape(p.shape)
            start, flat = offsets[key], flats[key]
            middle, end = start + N_PROBES * n0, start + N_PROBES * (n0 + n1)
            self.views[id(p)] = (flat[start:middle].view(N_PROBES, n0),
                                 flat[middle:end].view(N_PROBES, n1))
            offsets[key] = end

    def draw(self) -> None:
        """Fresh probes for every parameter."""
        if not self.layout or any((p.dtype, p.device) != key
                                  for p, key in zip(self.params, self.layout)):
            self._build()
        for flat, staging in self.flats:
            staging.normal_(generator=self.generator)
            if staging is not flat:
                flat.copy_(staging, non_blocking=True)


class UnseenUseCheck:
    """Per-step totals of the probes for each hooked parameter; see the module docstring.
    Per-step tables are keyed by ``id(parameter)`` (hashing a tensor is a Python call)."""

    def __init__(self, state: HookState, owners: Mapping[nn.Parameter, str], seed: int = 0):
        self.owners = {id(p): name for p, name in owners.items()}  # -> qualified name
        self.params = {id(p): p for p in owners}
        self.bank = ProbeBank(list(owners), torch.Generator().manual_seed(seed))
        self.drawn = False  # this step's probes are drawn
        self.totals: dict[int, Tensor] = {}
        # sum of each pass's |projection|, for a parameter whose gradient came in several
        # backward passes: the size its rounding is relative to when the passes cancel
        self.pass_scales: dict[int, Tensor] = {}
        self._state = state
        for p in owners:
            state.handles.append(p.register_hook(self._total_hook(id(p))))
        state.on_clear.append(self.reset)

    def reset(self) -> None:
        self.drawn = False
        self.totals.clear()
        self.pass_scales.clear()

    def probe(self, p: Tensor) -> Probe:
        """This step's probes for ``p``."""
        return self._views()[id(p)]

    def _views(self) -> dict[int, Probe]:
        """Every parameter's probes, drawn on the step's first use."""
        if not self.drawn:
            self.bank.draw()
            self.drawn = True
        return self.bank.views

    def _total_hook(self, key: int) -> Callable[[Tensor], None]:
        state, totals, scales = self._state, self.totals, self.pass_scales

        def hook(grad: Tensor) -> None:
            if not state.enabled:
                return
            value = project_gradient(grad.detach(), self._views()[key])
            total = totals.get(key)
            if total is None:
                totals[key] = value
                return
            scales[key] = (scales[key] if key in scales else total.abs()) + value.abs()
            totals[key] = total + value
        return hook

    def verify(self, hooked: Mapping[int, tuple[Tensor, Tensor]],
               users: Mapping[int, Sequence[str]]) -> None:
        """Raise if a parameter's total differs from its hooked sum beyond rounding.

        ``hooked[id(p)]`` is (projection, rounding scale) summed over the modules that own
        ``p``, whose names are ``users[id(p)]``. All parameters of a dtype and device are
        compared in one batch of operations; the rare failures are then confirmed one by one.
        """
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for key, total in self.totals.items():
            groups.setdefault((total.dtype, total.device), []).append(key)
        for (dtype, _), keys in groups.items():
            totals = torch.stack([self.totals[key] for key in keys])
            if all(key in hooked for key in keys):
                pairs = [hooked[key] for key in keys]
            else:  # a parameter whose modules' outputs did not reach the loss: nothing hooked
                zero = torch.zeros_like(totals[0])
                pairs = [hooked.get(key, (zero, zero)) for key in keys]
            values = torch.stack([value for value, _ in pairs])
            magnitudes = totals.abs()
            if self.pass_scales:  # passes that cancel (a sum of passes' seeds the net ignores)
                magnitudes = torch.stack([self.pass_scales.get(key, magnitudes[i])
                                          for i, key in enumerate(keys)])
            sizes = torch.stack([scale for _, scale in pairs]).add_(magnitudes)
            gaps = torch.sub(totals, values).abs_()
            bounds = sizes * relative_tolerance(dtype) + torch.finfo(dtype).tiny
            failed = gaps > bounds
            if not bool(failed.any()):
                continue
            for i in failed.any(1).nonzero().flatten().tolist():
                key = keys[i]
                if not self.rounding_explains(self.params[key], totals[i], values[i],
                                              bounds[i], users.get(key, ())):
                    fraction = gaps[i] / sizes[i].clamp_min(torch.finfo(dtype).tiny)
                    raise_unseen(self.owners[key], users.get(key, ()), float(fraction.max()))

    def rounding_explains(self, p: nn.Parameter, total: Tensor, hooked: Tensor, bound: Tensor,
                          users: Sequence[str]) -> bool:
        """Confirm-before-raise, run only for a parameter that failed the check: is the gap
        autograd's own rounding rather than a missing term?

        Rounding inside a module's backward can exceed any scale read off the projections: a
        saturated softmax (attention on inputs scaled by 1e3) computes a gradient that is zero
        in exact arithmetic as the difference of two terms of order ``|dO| |V|``, and float32
        keeps their rounding (measured: a query/key gradient of norm 0.037 whose exact value is
        3e-11, next to a value gradient of norm 0.36). The rules' math and autograd round such
        cancellations differently, so the gap measures rounding, not a missing term.

        Autograd's contribution of the users of ``p`` is recomputed from their captured calls
        (their own forward, the path autograd took, one vector-Jacobian product per backward
        pass) in ``p``'s dtype and in float64. Float64 gives the exact total of the seen uses;
        the difference of the two measures the rounding of the original backward (the same
        computation, so the same rounding; ``3 rms`` covers kernels that do not round the same
        way twice). The rules' own sum ``hooked`` is a second witness of rounding: it sees the
        same uses as the recomputation, summed in another order, so ``|hooked - exact|`` is
        rounding alone (in float64 too, where a gradient that cancels exactly, a shift before a
        normalization, is all rounding on both sides). A missing term stays in
        ``total - exact`` in full, so it is reported when it exceeds the usual tolerance plus
        that rounding. Anything that prevents the recomputation (no float64 on the device, a
        forward that cannot be re-run) leaves the check's answer.
        """
        if not users or self._state is None:
            return False
        by_name = {name: module for module, (name, _) in self._state.modules.items()}
        probe = self.probe(p)
        seen, exact, error = (torch.zeros_like(total, dtype=torch.float64) for _ in range(3))
        squared = torch.zeros((), dtype=torch.float64, device=total.device)
        try:
            for user in users:
                module = by_name.get(user)
                calls = [c for c in self._state.calls.get(module, ()) if c.has_grads]
                if module is None or not calls:
                    continue
                local = next((n for n, q in module.named_parameters() if q is p), None)
                if local is None:
                    return False
                high, high_grad = rerun_projections(module, calls, local, probe, torch.float64)
                low, low_grad = (high, high_grad) if p.dtype == torch.float64 else \
                    rerun_projections(module, calls, local, probe, p.dtype)
                seen += low
                exact += high
                squared += (low_grad.double() - high_grad).square().sum()
        except Exception:  # noqa: BLE001 - any failure: the check's answer stands
            return False
        u, v = (t.double() for t in probe)
        n0, n1 = matrix_shape(p.shape)
        rms = squared.sqrt() * u.norm(dim=1) * v.norm(dim=1) / math.sqrt(max(n0 * n1, 1))
        rounding = 2 * (seen - exact).abs() + 3 * rms + 10 * (hooked.double() - exact).abs()
        gap = (total.double() - exact).abs()
        return bool((gap <= bound.double() + rounding).all())

    def probes_for(self, parameters: Mapping[str, nn.Parameter]) -> dict[str, Probe]:
        """Probes of those of ``parameters`` whose gradient was seen this step."""
        views, totals = self.bank.views, self.totals
        return {n: views[id(p)] for n, p in parameters.items() if id(p) in totals}


def rerun_projections(module: nn.Module, calls: Sequence, name: str, probe: Probe,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Autograd's gradient of ``module``'s parameter ``name`` summed over ``calls`` (captured
    :class:`~per_sample_hooks.capture.Call` records), recomputed in ``dtype``: the projections
    (each backward pass projected on its own, as the totals are) and the full gradient.

    The forward runs as the module's own (``torch.func.functional_call`` inside
    ``torch.func.vjp``, so that hooks do not record it) on copies of the buffers (a BatchNorm's
    running statistics are not updated twice)."""
    def cast(t: object) -> object:
        return t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t

    params = {n: cast(q.detach()) for n, q in module.named_parameters()}
    buffers = {n: cast(b.detach()).clone() for n, b in module.named_buffers()}
    weight = {name: params.pop(name)}
    value, full = None, None
    for call in calls:
        leaves = [j for j, passes in enumerate(call.grads) if passes]
        counts = {len(call.grads[j]) for j in leaves}
        if len(counts) == 1:  # one vector-Jacobian product per backward pass, as autograd did
            passes = [[call.grads[j][i] for j in leaves] for i in range(counts.pop())]
        else:
            passes = [[sum(call.grads[j][1:], call.grads[j][0]) for j in leaves]]
        args, kwargs = tree_map(cast, call.args), tree_map(cast, call.kwargs)

        def forward(w: dict[str, Tensor], args: tuple = args, kwargs: dict = kwargs,
                    leaves: list = leaves) -> list[Tensor]:
            output = torch.func.functional_call(module, {**params, **buffers, **w}, args,
                                                kwargs)
            flat = tree_flatten(output)[0]
            return [flat[j] for j in leaves]

        _, vjp = torch.func.vjp(forward, weight)
        for grads in passes:
            (result,) = vjp([cast(g) for g in grads])
            g = result[name].reshape(matrix_shape(result[name].shape))
            projected = project(g, (probe[0].to(dtype), probe[1].to(dtype)))
            value = projected if value is None else value + projected
            full = g if full is None else full + g
    if value is None:
        raise ValueError("no captured gradient")
    return value.double(), full


def raise_unseen(name: str, users: Sequence[str], fraction: float) -> None:
    owners = " and ".join(f"'{u}'" for u in users) or "no hooked module"
    raise PerSampleHooksError(
        f"parameter '{name}' has a gradient term that no hook sees (a random projection of its "
        f"gradient differs by {fraction:.0%} from the hooked contributions): it is used "
        f"outside the forward of {owners}, for example "
        f"`h @ {name}.t()` or `F.linear(x, {name})`; its per-sample gradients would miss that "
        "term. Route the use through a module (call a module that holds the parameter, e.g. an "
        "nn.Linear whose weight is tied to it), or let the torch.func fallback handle the module "
        "whose forward makes that use as one unit: add_hooks(model, units=['<module name>'])")

