"""Detection of parameter uses that no hook sees, and the policy that bounds its cost.

Hooks see a parameter only inside the forward of the module that owns it. A use elsewhere (a
tied output layer ``h @ emb.weight.t()``, ``F.linear(x, layer.weight)``) adds a term to
``p.grad`` that per-sample quantities from hooks would silently miss. On a *checked* step the
check compares, for every hooked parameter ``p``, random projections (``u_k^T g v_k`` for
:data:`N_PROBES` Gaussian probes, new for every step compared, ``p`` seen as a matrix) of:

- the *total*: the gradient autograd hands ``p`` in each backward pass of the step (a tensor
  hook on the parameter, registered on checked steps only, so gradients the user did not zero
  do not matter), summed over passes;
- the *hooked* sum: the sum over samples of ``p``'s per-sample contributions, computed by the
  rules through the code that computes every other quantity (the weighted sum with unit
  weights, or the per-sample gradients already written), summed over the modules that own
  ``p``, projected module by module (nothing the size of a gradient is held).

**The rounding bound** (:func:`relative_tolerance`, applied in :meth:`UnseenUseCheck.verify`).
Both sides sum the same terms in a different order and decomposition (autograd's batched
backward against the rules' products), so in exact arithmetic they are equal, and in floating
point ``|total - hooked| <= c * eps * sum |terms|``. A projection on standard normal probes has
the size of the Frobenius norm (``E (u^T E v)^2 = |E|^2``), so the norms of the two sides stand
in for ``sum |terms|`` (``size = |total| + |hooked|``, the total's norm summed over passes, since
passes can cancel: ``backprop_hess`` through a normalization sums to rounding). A missing term
shows up as a gap of its own size, far above rounding: the threshold is ``1e-6 * size`` in
float64 and ``0.1 * size`` in float32 (a badly scaled float32 model has shown gaps of 5% with no
missing term), so a term smaller than that fraction of the gradient may go unreported, and one
of the gradient's size escapes all probes with a chance of about ``1e-5``. Where ``size`` itself
is rounding (a gradient that cancels exactly, e.g. a shift before a normalization; a saturated
softmax whose float32 backward leaves ``eps |dO| |V|`` in a gradient that is zero in exact
arithmetic), the norms underestimate ``sum |terms|``: a parameter over the threshold is
therefore confirmed before anything is raised (:meth:`UnseenUseCheck.rounding_explains`), by
recomputing its users' contributions from their captured calls with plain autograd in the
parameter's dtype and in float64 (hooks paused): float64 gives the exact total of the seen uses,
and the rounding on both sides is measured rather than bounded.

**When it runs** (:class:`Schedule`). Comparing costs a weighted sum per layer (about the
weight-gradient part of a backward) and, for consumers that skip parameter gradients
(``DPSGD``'s output-edge backward, ``backprop_hess`` to the output edges), an ordinary backward
on that step. So the default (``add_hooks(check_unseen=True)``) checks:

1. the first step, and every step whose captured structure (which modules were called, how many
   times, with which batch size) differs from every step checked so far;
2. after that a random sample of steps, each step checked with probability
   ``min(1, 0.005 * step time / check cost)``, independently of the others (the number of
   steps to the next sampled check is drawn after each check: geometric; a step counts when a
   ``compute_*`` call reads it), so that the sampled checks cost at most about 0.5% of the
   training time. Both times are measured (running averages); the step time runs from the
   step's first hooked forward to the check in its first ``compute_*`` call (the optimizer's
   step is not counted: an underestimate of a training step), measured on unchecked steps (a
   checked step's includes its check's hooks): the first ones and the one after each check.
   The first check's time, which includes one-time costs, is left out: the step after it is
   checked to measure the check's cost.

On the other steps the check costs a few microseconds: a step count at the step's start and
the decision at its first captured gradient. The parameters' gradient hooks are registered on
checked steps only (:meth:`UnseenUseCheck._arm`): a hook costs a Python call per parameter
per backward. The ``.grad`` of each parameter is noted at the start of the steps that may be
checked, and of every step in a loop that keeps gradients across steps
(:meth:`UnseenUseCheck._start`). In all, on the seed-003 MLP (six parameters, a step of
0.4 ms, the worst case in ``benchmarks``) the check costs 1.6-1.8% of the step (three runs of
``benchmarks.check_cost``); on the other benchmark models, within their noise.

It guarantees that every structure is checked before its per-sample quantities are returned (a
step whose start was not noted takes each ``.grad`` it finds when armed as its own, as in every
step noted so far; a loop that set the gradients to None on every step until then and keeps
them on this one gets an unseen-use report that names this explanation). It does not guarantee
that a use outside the modules that appears only on some steps of an already-checked structure
(a branch taken now and then) is caught on the step it appears: it is caught at the next
sampled check that sees it. ``check_unseen="always"`` checks every step; ``False`` never. A
step that computed no parameter gradient (``torch.autograd.grad`` for inputs only, the
output-edge backward) cannot be checked: a check due on it stays due for the next step that
can. Consumers ask :meth:`UnseenUseCheck.due` before their backward to choose an ordinary one
on a check step.
"""
from __future__ import annotations

import math
import operator
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from .capture import Call, HookState, map_tensors
from .errors import PerSampleHooksError
from .reparametrized import power_iterations_off, recorded_forward

CheckUnseen = bool | Literal["always"]

CHECK_BUDGET = 0.005
"""Fraction of the training time the sampled checks may take (on average). Small, because the
work on unchecked steps already costs about 1% of the smallest benchmark model's 0.4 ms step
(the whole check 1.6-1.8%, ``benchmarks.check_cost``), and the whole check is meant to stay
under 2%."""


def relative_tolerance(dtype: torch.dtype) -> float:
    """Gap between total and hooked sum, relative to their size, above which a term may be
    missing (and the gap is confirmed by a recomputation; see the module docstring)."""
    return {torch.float64: 1e-6, torch.float32: 1e-1}.get(dtype, 0.5)


class Schedule:
    """Which steps are checked: see the module docstring. ``mode`` is ``"sampled"`` (the
    default policy) or ``"always"``; ``budget``: the fraction of the training time sampled
    checks may take (0: only new structures); ``clock``: seconds (``time.perf_counter``).

    A step counts once a ``compute_*`` call reads it (:meth:`step_read`): one that only
    captures (``clear_backprops``) neither counts nor uses up a draw. Times are running
    averages, the step's measured on the first unchecked steps and on the step after each
    check: a step that is neither checked nor timed costs a flag, a count and a comparison."""

    def __init__(self, mode: Literal["sampled", "always"], seed: int = 0,
                 budget: float = CHECK_BUDGET, clock: Callable[[], float] = time.perf_counter):
        self.mode = mode
        self.budget = budget
        self.clock = clock
        self.checked: set[Hashable] = set()
        self.random = random.Random(seed)
        self.checks = 0  # steps checked so far
        self.until_sampled = math.inf  # steps read before the next sampled one (drawn)
        self.step_seconds: float | None = None
        self.check_seconds: float | None = None
        self.timing = True  # the next step is timed
        self._open = False  # a step started that no compute_* call has read yet
        self._counted = False  # this step's check is counted (a second compute_* call's is not)
        self._started: float | None = None
        self.steps_measured = 0

    def start(self) -> bool:
        """A step starts (its first hooked forward): whether it is sampled (a step of a new
        structure is checked whatever this says)."""
        self._open, self._counted = True, False
        if self.timing:
            self._started = self.clock()
        return self.until_sampled <= 0 or self.mode == "always"

    def step_read(self, checked: bool = False) -> None:
        """A ``compute_*`` call reads the step (the first call of a step counts it). On a
        timed step, the time since :meth:`start` is the step's measure: its forward, backward
        and the ``compute_*`` call's work before the check; the optimizer and anything else
        between steps are not counted, so the checks cost less than ``budget`` of the training
        time, also when steps of other models run in between, as in interleaved benchmarks. A
        ``checked`` step is not measured (its check's hooks are part of its time; counting them
        as training time sampled the next checks up to 2.5x as often as the budget allows on
        the seed-003 MLP): the next one is."""
        if not self._open:
            return
        self._open = False
        self.until_sampled -= 1  # a sampled step that compared nothing stays due: below 0
        started, self._started = self._started, None
        if started is None or checked:
            return
        seconds = self.clock() - started
        self.steps_measured += 1
        if self.steps_measured == 1:  # the first one also pays one-time costs: left out
            return
        self.step_seconds = _average(self.step_seconds, seconds)
        self.timing = False
        if self.until_sampled == math.inf:
            self.draw()

    def draw(self) -> None:
        """Draw the steps before the next sampled one: geometric, so that each step is sampled
        with probability ``p = budget * step time / check time``, independently of the others
        (``p >= 1``: every step)."""
        if not (self.budget and self.step_seconds and self.check_seconds):
            self.until_sampled = math.inf
            return
        p = self.budget * self.step_seconds / self.check_seconds
        self.until_sampled = 0 if p >= 1 else \
            int(math.log(1.0 - self.random.random()) / math.log1p(-p))

    def checked_one(self, structure: Hashable, seconds: float) -> None:
        """A step of ``structure`` was checked, in ``seconds``: draw the next sampled step, and
        time the next step. The first check also pays one-time costs (8x a later one on the
        seed-003 MLP), which would keep the sampled rate far under the budget for thousands of
        steps: its time is left out, and the next step read is checked to measure the cost. A
        step's later ``compute_*`` calls check it again, and are not counted."""
        if self._counted:
            return
        self._counted = True
        self.checks += 1
        self.checked.add(structure)
        self.timing = True
        if self.checks == 1 and self.budget:
            self.until_sampled = 0
            return
        self.check_seconds = _average(self.check_seconds, seconds)
        self.draw()


def _average(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


def hooked_parameters(state: HookState) -> dict[nn.Parameter, str]:
    """Every parameter of the hooked modules (a unit's: below it too; frozen ones too, they may
    be unfrozen) by qualified name."""
    owners: dict[nn.Parameter, str] = {}
    for module, (name, _) in state.modules.items():
        prefix = "" if module is state.model else f"{name}."
        for n, p in module.named_parameters(recurse=module in state.units):
            owners.setdefault(p, f"{prefix}{n}")
    return owners


def captured_structure(state: HookState) -> tuple:
    """Which hooked modules were called this step (in the order of ``state.calls``), how many
    times, and the step's batch size (the first above 1 a call had: a step whose calls
    disagree is refused before it is compared). Asked every step: no per-call work."""
    return state.status.batch, tuple(map(len, state.calls.values()))


class UnseenUseCheck:
    """On checked steps: random projections (:data:`N_PROBES` rank-1 probes ``u v^T``, ``p``
    seen as a matrix) and norms of autograd's gradient of each hooked parameter, summed over
    the step's backward passes; no gradient is copied (a step holds ``N_PROBES`` numbers per
    parameter). The probes are drawn once and kept until a step compares them: drawing them
    is most of a small model's cost of a due step that nothing computes (a loop that only
    captures, on a structure not yet checked, is due on every step), and a step that compared
    nothing revealed nothing about them. Tables are keyed by ``id(parameter)`` (hashing a
    tensor is a Python call)."""

    def __init__(self, state: HookState, mode: Literal["sampled", "always"] = "sampled",
                 seed: int = 0):
        self.schedule = Schedule(mode, seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.decision: bool | None = None  # this step is checked (decided on first ask)
        self.totals: dict[int, Tensor] = {}  # [N_PROBES] projections, summed over passes
        # sum over passes of the gradient's norm: the size rounding is relative to (passes can
        # cancel, e.g. backprop_hess through a normalization)
        self.sizes: dict[int, Tensor] = {}
        # drawn on first use, kept for the next step unless this one compared them (verify):
        # a step never compared (capture only, no compute_* call) reveals nothing about them
        self.probes: dict[int, Probe] = {}
        self.compared = False
        self.hook_seconds = 0.0  # this checked step's time in the hooks (part of its cost)
        self._state = state
        # the hooks registered on a checked step
        self._armed: list[tuple[nn.Parameter, RemovableHandle]] = []
        self._follow_parameters()
        # each parameter's .grad at the step's start (None: not noted) and their versions
        # (None: no .grad)
        self._marks: list[Tensor | None] | None = []
        self._versions: list[int | None] | None = None
        self.noting = True  # the next step's start notes the .grads (see _start)
        self.grads_left = False  # a step had a .grad at its start (noted, or found by _arm)
        # keys of gradients found at arming on a step whose start was not noted
        self.taken_unnoted: list[int] = []
        self.changed_early: list[int] = []  # keys of gradients changed in place before arming
        self._sampled = False  # this step is sampled (drawn before its start)
        state.listeners.on_clear.append(self.reset)
        state.listeners.on_backward.append(self.due)
        self._start()

    def _follow_parameters(self) -> None:
        """Key the tables by the hooked modules' parameters as they are now
        (:func:`hooked_parameters`)."""
        owners = hooked_parameters(self._state)
        self.owners = {id(p): name for p, name in owners.items()}  # -> qualified name
        self.params = {id(p): p for p in owners}
        self.probes.clear()
        self._hooks = [(p, self._total_hook(id(p))) for p in owners]
        self._params = [p for p, _ in self._hooks]
        self._nones = [None] * len(self._params)

    def _parameters_replaced(self) -> bool:
        """Whether a hooked module holds a parameter the tables do not know (assigned since
        they were keyed: ``layer.weight = nn.Parameter(...)``, ``load_state_dict(assign=
        True)``). A dict lookup per parameter, on the steps after some parameter was registered
        (``HookState.parameters_registered``); the tables hold the old ones, so no new
        parameter has an old one's id."""
        params, units = self.params, self._state.units
        for module in self._state.modules:
            for p in module.parameters() if module in units else module._parameters.values():
                if p is not None and id(p) not in params:
                    return True
        return False

    def reset(self) -> None:
        """A new step: nothing decided, compared or armed (runs on every step: a checked
        step's leftovers are looked at only after one)."""
        self.decision = None
        if self._armed:
            self._disarm()
        self._start()

    def _disarm(self) -> None:
        """Remove the hooks :meth:`_arm` registered and forget what they summed (and the
        probes, if compared: new ones for the next step that compares). Autograd
        keeps a parameter's hook table once one was registered, and calls into it on every
        backward even when empty (about a microsecond per parameter): an emptied table is
        dropped, one holding others' hooks stays."""
        for p, handle in self._armed:
            handle.remove()
            if not p._backward_hooks:
                p._backward_hooks = None
        self._armed.clear()
        self.totals.clear()
        self.sizes.clear()
        self.changed_early.clear()
        self.taken_unnoted.clear()
        if self.compared:  # (compared on an armed step only)
            self.probes.clear()
            self.compared = False

    def _start(self) -> None:
        """The step's start (its first hooked forward): ask the schedule whether it is sampled
        (which also times the step, when due), and note each parameter's ``.grad`` and its
        version, so that :meth:`_arm` can tell what autograd accumulated before it. The
        ``.grad`` s are held until the step's first captured gradient (one the loop drops
        after its forward lives until then).

        Noting is most of the check's cost on an unchecked step (reading a parameter's
        ``.grad`` costs about 0.4 us in a training step), so it is skipped where the step is
        not expected to be checked: not sampled, after a step whose structure was checked
        already, in a loop whose steps noted so far all started without a ``.grad`` (one that
        sets them to None). If such a step's structure is new after all, :meth:`_arm` counts a
        ``.grad`` it finds as the step's own."""
        self._sampled = self.schedule.start()
        if not (self._sampled or self.noting):
            self._marks = None
            return
        grads = list(map(_grad_of, self._params))
        self._marks = grads
        # (not grads.count(None): it compares with ==, a Tensor.__eq__ call per .grad)
        if any(map(operator.is_not, grads, self._nones)):
            self._versions = [None if g is None else g._version for g in grads]
            self.grads_left = True
        else:
            self._versions = None

    def due(self) -> bool:
        """Whether this step is checked. Asked by consumers before their backward and, through
        ``Listeners.on_backward``, when the step's first captured gradient arrives: the
        forward is over, so the structure is known. The first ask of a step decides (a step
        drawn at its start, or of a structure not checked yet), and on a checked step arms the
        check (:meth:`_arm`)."""
        if self.decision is None:
            replaced = self._state.parameters_registered and self._parameters_replaced()
            self._state.parameters_registered = False
            if replaced:  # checked now, its .grads taken as new (none was noted for them)
                self._follow_parameters()
                self._marks = None
            self.decision = replaced or self._sampled or \
                captured_structure(self._state) not in self.schedule.checked
            if self.decision:
                self._arm()
            self._marks = []
            # a next step of this structure is checked only if sampled (known at its start)
            self.noting = self.decision or self.grads_left
        return self.decision

    def _arm(self) -> None:
        """Register the parameters' gradient hooks for this step (none on the other steps: the
        hooks cost a Python call per parameter per backward).

        They are registered at the step's first captured gradient at the latest. Autograd
        reaches a parameter after the gradient of every tensor it was used for, so one used in
        a hooked module's forward whose output reached the loss is reached after that. Only a
        parameter used outside the hooked forwards alone can have been reached before (by this
        backward, or an earlier pass of the step that reached no hooked output): its ``.grad``
        changed since the step's start (:meth:`_start`). A new ``.grad`` is that gradient, and
        is counted as if the hook had seen it; one changed in place (accumulated onto an older
        gradient) is not known: a nonzero one is reported as an unseen use by :meth:`verify`
        (an in-place zeroing leaves zeros, nothing to count). On a step whose start was not
        noted (:meth:`_start`), every ``.grad`` is taken as new, as at the start of every step
        noted so far."""
        start = time.perf_counter()
        marks = self._marks
        for i, (p, hook) in enumerate(self._hooks):
            if not p.requires_grad:
                continue
            grad = p.grad
            if grad is not None:
                if marks is None:  # (from now on every step notes: it may be kept again)
                    self.taken_unnoted.append(id(p))
                    self.grads_left = True
                if marks is None or marks[i] is not grad:
                    hook(grad)
                elif grad._version != self._versions[i] and bool(grad.detach().any()):
                    self.changed_early.append(id(p))
            self._armed.append((p, p.register_hook(hook)))
        self.hook_seconds = time.perf_counter() - start  # the step's first: _arm runs once

    def probe(self, p: Tensor) -> Probe:
        """The probes for ``p`` (drawn on first use, in ``p``'s dtype and device; new ones
        after each step that compared them)."""
        probe = self.probes.get(id(p))
        n0, n1 = matrix_shape(p.shape)
        if probe is None or probe[0].shape[1] != n0 or probe[1].shape[1] != n1 \
                or probe[0].dtype != p.dtype or probe[0].device != p.device:
            probe = tuple(torch.randn(N_PROBES, n, generator=self.generator, device="cpu",
                                      dtype=torch.float64).to(device=p.device, dtype=p.dtype)
                          for n in (n0, n1))
            self.probes[id(p)] = probe
        return probe

    def _total_hook(self, key: int) -> Callable[[Tensor], None]:
        totals, sizes, param = self.totals, self.sizes, self.params[key]

        def hook(grad: Tensor) -> None:
            if not self._state.enabled:
                return
            start = time.perf_counter()
            grad = grad.detach()
            if grad.is_sparse:  # Embedding(sparse=True)
                grad = grad.to_dense()
            value, size = project(grad, self.probe(param)), _norm(grad)
            if key in totals:
                value, size = value + totals[key], size + sizes[key]
            totals[key], sizes[key] = value, size
            self.hook_seconds += time.perf_counter() - start
        hook.armed_by_check = True  # (not the user's: user_parameter_hooks)
        return hook

    def verify(self, hooked: HookedSums, users: Mapping[int, Sequence[str]],
               seconds: float = 0.0) -> None:
        """Raise if a parameter's total differs from its hooked sum beyond rounding.

        ``hooked``: the projections and norms of the sum over samples of each parameter's
        contributions, summed over the modules that own it, whose names are ``users[id(p)]``.
        ``seconds``: what computing ``hooked`` took (the schedule's measure of the cost).
        Every parameter is compared in one batch; failures are confirmed one by one
        (:meth:`rounding_explains`)."""
        if self.changed_early:
            key = self.changed_early[0]
            raise_unseen(self.owners[key], users.get(key, ()), None, model=self._state.model)
        if not self.totals:  # nothing to compare (no parameter gradient): stays due
            return
        self.compared = True
        start = time.perf_counter()
        keys = list(self.totals)
        device = self.totals[keys[0]].device  # stacked there, copied to the host once each

        def gather(values: list[Tensor]) -> Tensor:
            return torch.stack([v.to(device, torch.float64) for v in values]).cpu()

        zeros = torch.zeros(N_PROBES, dtype=torch.float64, device=device)
        totals = gather([self.totals[k] for k in keys])
        values = gather([hooked.projections.get(k, zeros) for k in keys])
        sizes = gather([self.sizes[k] + hooked.norms[k] if k in hooked.norms else self.sizes[k]
                        for k in keys])
        tolerances = torch.tensor([relative_tolerance(self.totals[k].dtype) for k in keys],
                                  dtype=torch.float64, device="cpu")
        gaps = (totals - values).abs()
        bounds = (tolerances * sizes + torch.finfo(torch.float32).tiny).unsqueeze(1)
        unseen = [i for i in (gaps > bounds).any(1).nonzero().flatten().tolist()
                  if not self.rounding_explains(self.params[keys[i]], totals[i], values[i],
                                                float(bounds[i]), users.get(keys[i], ()))]
        if unseen:
            i, key = unseen[0], keys[unseen[0]]
            fraction = float(gaps[i].max() / sizes[i].clamp_min(1e-300))
            state = self._state
            raise_unseen(self.owners[key], users.get(key, ()), fraction,
                         key in self.taken_unnoted, state.model,
                         [self.owners[keys[j]] for j in unseen[1:]],
                         state.status.disabled_calls > 0,
                         user_parameter_hooks(self.params[key]))
        self.schedule.checked_one(captured_structure(self._state),
                                  seconds + self.hook_seconds + time.perf_counter() - start)

    def rounding_explains(self, p: nn.Parameter, total: Tensor, hooked: Tensor, bound: float,
                          users: Sequence[str]) -> bool:
        """Confirm-before-raise, for a parameter over the threshold: is the gap rounding?

        The contributions of ``p``'s users are recomputed by autograd from their captured calls
        (their own forward, one vector-Jacobian product per backward pass) in ``p``'s dtype and
        in float64. Float64 gives the exact total of the seen uses; the difference of the two
        measures the rounding of the original backward (the same computation, so the same
        rounding; ``3x``, and its norm, cover kernels that do not round the same way twice). The
        ``k`` terms of several calls or passes are added in another order than autograd's, which
        rounds apart by up to ``(k - 1) eps`` times the sum of their norms: that is added
        (``4x``), and matters where the gradient is itself rounding (the LayerNorm bias of a
        triplet loss over three calls). It is the same computation only on the same kernels,
        which hang on more than the values (:func:`recompute_gradient`; on other kernels a
        saturated softmax's query/key rounding came out up to 140x smaller than autograd's, and
        was reported).
        The rules' sum (``hooked``, projected) is a second witness of rounding: it sees the
        same uses as the recomputation, summed in another order, so its gap to the exact
        total is rounding alone. A missing term stays in ``total - exact`` in full, so it is
        reported when it exceeds the threshold plus that rounding. Anything that prevents the
        recomputation (no float64 on the device, a forward that cannot be re-run) leaves the
        check's answer.

        For a float64 (and float32) ``p`` the same recomputation tells a wrong decomposition
        from an unseen use: when the total is the seen uses' (no missing term) but the rules'
        sum is off the exact total by more than :data:`UNFAITHFUL` of it, the owning modules'
        per-sample gradients do not add up to their gradient: a forward or backward that
        couples the samples (statistics over the batch, token counts) in a fallback unit, or a
        user rule's wrong formula. That is raised (:func:`raise_unfaithful`), not taken as
        rounding. In float32 the rules' own rounding can reach such gaps where the gradient is
        itself rounding (a saturated softmax: 50%), so there it is judged only where the
        float32 recomputation gives the exact total to 1%, and at :data:`UNFAITHFUL`'s float32
        fraction."""
        by_name = {name: module for module, (name, _) in self._state.modules.items()}
        exact = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
        seen = torch.zeros_like(exact)
        coarse = torch.zeros_like(exact)  # recomputed in float32 (the conditioning)
        terms: list[Tensor] = []  # the norms of the calls' and passes' contributions
        try:
            for user in users:
                module = by_name.get(user)
                calls = [c for c in self._state.calls.get(module, ()) if c.has_grads]
                if module is None or not calls:
                    continue
                local = next((n for n, q in module.named_parameters() if q is p), None)
                if local is None:
                    return False
                high = recompute_gradient(self._state, module, calls, local, torch.float64,
                                          terms)
                exact += high
                if p.dtype == torch.float64:
                    seen += high
                    coarse += recompute_gradient(self._state, module, calls, local,
                                                 torch.float32).double()
                else:
                    seen += recompute_gradient(self._state, module, calls, local,
                                               p.dtype).double()
        except Exception:  # noqa: BLE001 - any failure: the check's answer stands
            return False
        if p.dtype != torch.float64:
            coarse = seen
        probe = tuple(t.double() for t in self.probe(p))
        exact_projection = project(exact, probe).cpu()
        error = seen - exact
        rounding = 3 * (project(error, probe).cpu().abs() + _norm(error).cpu())
        if len(terms) > 1:  # added in another order than autograd's: at most (k - 1) eps sum
            rounding = rounding + 4 * (len(terms) - 1) * torch.finfo(p.dtype).eps * \
                torch.stack(terms).sum().cpu()
        rules_gap = (hooked - exact_projection).abs()
        total_gap = (total - exact_projection).abs()
        size = _norm(exact).cpu()
        unfaithful = UNFAITHFUL.get(p.dtype)
        if unfaithful is not None and _norm(coarse - exact) < 0.01 * size and \
                (total_gap <= bound + rounding).all() and \
                (rules_gap > bound + unfaithful * size).any():
            raise_unfaithful(self.owners[id(p)], users, float(rules_gap.max() / size))
        return bool((total_gap <= bound + rounding + 10 * rules_gap).all())


UNFAITHFUL = {torch.float64: 1e-4, torch.float32: 0.1}
"""A rules' sum off the exact total by more than this fraction of it is a wrong decomposition,
not rounding, where float32 rounding leaves that total determined to 1%
(:meth:`UnseenUseCheck.rounding_explains`); other dtypes are not judged. The worst rounding
seen (a saturated softmax, whose float32 rules' sum was off by 50% while autograd's was not)
was of a gradient that float32 does not determine, and scales to about 1e-9 in float64; a
decomposition that couples the samples is off by a fraction of the gradient itself (a
backward that divides by token counts over the batch, ``scale_grad_by_freq``: 100-400%)."""


class HookedSums:
    """The hooked side of a check: for each parameter (keyed by ``id``), the projections of
    the sum over samples of its contributions and, where that sum was formed, its norm; added
    module by module (no module's sum is held after it is projected)."""

    def __init__(self, check: UnseenUseCheck):
        self.check = check
        self.projections: dict[int, Tensor] = {}
        self.norms: dict[int, Tensor] = {}

    def add(self, p: Tensor, summed: Tensor) -> None:
        """A module's formed sum ``summed`` (``p.shape``)."""
        self.add_projection(p, project(summed, self.check.probe(p)))
        size = _norm(summed)
        self.norms[id(p)] = size + self.norms[id(p)] if id(p) in self.norms else size

    def add_projection(self, p: Tensor, value: Tensor) -> None:
        """A module's sum, projected on ``self.check.probe(p)`` (``[N_PROBES]``)."""
        key = id(p)
        self.projections[key] = value + self.projections[key] if key in self.projections \
            else value


N_PROBES = 8
"""Probes per parameter: a missing term of relative size ``r`` escapes one probe with the
chance that a standard normal is below about ``0.1 (2 + r) / r`` (float32's threshold), all
eight together with about ``0.24^8 = 1e-5`` for ``r = 1``."""

Probe = tuple[Tensor, Tensor]  # u [N_PROBES, n0], v [N_PROBES, n1]
_grad_of = operator.attrgetter("grad")


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """``p`` seen as ``[n0, n1]``: first dim by the rest (a scalar as ``[1, 1]``)."""
    n0 = shape[0] if len(shape) else 1
    return n0, (shape.numel() // n0 if n0 else 0)


def project(t: Tensor, probe: Probe) -> Tensor:
    """``u_k^T t v_k`` for each probe ``k`` (``t`` seen as ``[n0, n1]``): ``[N_PROBES]``."""
    u, v = probe
    return torch.linalg.vecdot(u @ t.reshape(u.shape[1], v.shape[1]).to(u.dtype), v)


def _norm(t: Tensor) -> Tensor:
    """In float64: a float32 gradient's entries below about 1e-19 square to 0 in float32 (a
    complex one's, refused by ``compute_*``, as its real and imaginary parts)."""
    return torch.linalg.vector_norm(torch.view_as_real(t) if t.is_complex() else t,
                                    dtype=torch.float64)


def recompute_gradient(state: HookState, module: nn.Module, calls: Sequence[Call], name: str,
                       dtype: torch.dtype, term_norms: list[Tensor] | None = None) -> Tensor:
    """Autograd's gradient of ``module``'s parameter ``name`` summed over ``calls`` (captured
    records, each backward pass its own vector-Jacobian product), recomputed in ``dtype``;
    the norm of each term added is appended to ``term_norms`` where given.

    The module's own forward (:func:`~.reparametrized.recorded_forward`) runs with plain
    autograd and the hooks paused, on copies of the buffers (a BatchNorm's running statistics
    are not updated twice); grad mode is on, so recurrent layers take their training kernels.
    It takes the
    forward's kernels as far as the record tells: arguments keep their aliasing
    (:func:`~per_sample_hooks.capture.map_tensors`: MultiheadAttention's packed in-projection
    needs ``query is key is value``) and parameters their ``requires_grad``; inputs do not
    require grad (the record does not keep whether they did)."""
    def cast(t: Tensor) -> Tensor:
        return t.detach().to(dtype) if t.is_floating_point() else t.detach()

    # every parameter requires grad as in the forward: kernels depend on it (matmul folds a
    # non-contiguous [L, B, E] input into one mm only for a weight that requires grad)
    params = {n: cast(q).requires_grad_(q.requires_grad) for n, q in module.named_parameters()}
    buffers = {n: cast(b).clone() for n, b in module.named_buffers()}
    weight = params[name].requires_grad_()
    total = torch.zeros_like(weight)
    forward = recorded_forward(module)
    with state.paused(), torch.enable_grad(), power_iterations_off(module):
        for call in calls:
            leaves = [j for j, passes in enumerate(call.grads) if passes]
            args, kwargs = map_tensors(cast, (call.args, call.kwargs))  # aliasing kept
            output = forward({**params, **buffers}, args, kwargs)
            flat = tree_flatten(output)[0]
            outputs = [flat[j] for j in leaves]
            for k in range(max(len(call.grads[j]) for j in leaves)):
                seeds = [cast(call.grads[j][k]) if k < len(call.grads[j])
                         else torch.zeros_like(outputs[i]) for i, j in enumerate(leaves)]
                (grad,) = torch.autograd.grad(outputs, weight, seeds, retain_graph=True,
                                              allow_unused=True)
                if grad is not None:
                    total += grad
                    if term_norms is not None:
                        term_norms.append(_norm(grad))
    return total


def holder_of(model: nn.Module | None, name: str) -> str:
    """The module whose forward most likely uses parameter ``name`` (a path in ``model``)
    outside its own module's forward: the one that holds that module (for peft's IA3, the layer
    that reads its ``ia3_l`` ``ParameterDict``), ``ModuleList`` s and ``ModuleDict`` s skipped;
    ``''`` for the model itself."""
    owner = name.rpartition(".")[0]
    if ".parametrizations." in f".{owner}.":  # the parametrized module owns it
        owner = f".{owner}".partition(".parametrizations.")[0][1:]
    path = owner.rpartition(".")[0]
    while path and model is not None and \
            isinstance(model.get_submodule(path), (nn.ModuleList, nn.ModuleDict)):
        path = path.rpartition(".")[0]
    return path


def user_parameter_hooks(p: Tensor) -> bool:
    """Whether ``p`` holds a gradient hook of the user's (``p.register_hook``), not one the
    check armed."""
    return any(not getattr(hook, "armed_by_check", False)
               for hook in (p._backward_hooks or {}).values())


def raise_unseen(name: str, users: Sequence[str], fraction: float | None,
                 taken_unnoted: bool = False, model: nn.Module | None = None,
                 others: Sequence[str] = (), disabled_calls: bool = False,
                 parameter_hooks: bool = False) -> None:
    """``fraction``: the gap relative to the gradient; None for a gradient that autograd
    accumulated in place before any hooked output's (:meth:`UnseenUseCheck._arm`);
    ``taken_unnoted``: the parameter's ``.grad`` was taken as the step's own without a note
    of the step's start (:meth:`UnseenUseCheck._start`); ``others``: the other parameters
    with such a term; ``disabled_calls``: hooked modules ran in the step with their hooks
    disabled; ``parameter_hooks``: the parameter holds a hook of the user's."""
    owners = " and ".join(f"'{u}'" for u in users) or "no hooked module"
    how = (f"its gradient differs by {fraction:.0%} from the hooked contributions"
           if fraction is not None else "autograd added to its .grad before any hooked "
           "module's output received a gradient")
    holder = holder_of(model, name)
    units = list(dict.fromkeys(holder_of(model, n) for n in (name, *others)))
    root = type(model).__name__ if model is not None else ""  # the whole model's unit's name
    container = name.rpartition(".")[0]
    if model is not None and isinstance(model.get_submodule(container),
                                        (nn.ParameterList, nn.ParameterDict)):
        fix = (f"it is held by '{container}', a {type(model.get_submodule(container)).__name__}"
               ", which has no forward, and read by the forward of the module that indexes "
               "it; its per-sample gradients would miss that term. Let the torch.func "
               f"fallback handle that module as one unit (likely add_hooks(model, units={units}"
               ")), or hold each such parameter in a module that uses it "
               "(an nn.Embedding for a table) and call that module")
    elif any(holder == u or holder.startswith(f"{u}.") or u in ("", root) for u in users):
        fix = (f"{owners} holds it, and every use in its forward is seen: the term comes "
               "from elsewhere, a term of "
               "the loss that reads the parameter itself (a regularizer, as peft AdaLoRA's "
               "orthogonal penalty in its .loss: leave it out of the loss the per-sample "
               "quantities are taken of, or set its weight to 0) or another module that reads "
               "it (the output layer of tied embeddings: make it a unit too, or the module "
               "that holds both)")
    else:
        fix = ("it is used outside the forward of "
               f"{owners}, for example `h @ {name}.t()` or `F.linear(x, {name})`; its "
               "per-sample gradients would miss that term. Route the use through a module "
               "(call a module that holds the parameter, e.g. an nn.Linear whose weight is tied "
               "to it), or let the torch.func fallback handle the module whose forward makes "
               "that use as one unit (likely the one that holds it: add_hooks(model, "
               f"units={units}))")
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} \
            if model is not None else set()
        if len(trainable) > 1 and trainable <= {name, *others}:
            fix = ("every trainable parameter has such a term: most likely a term of the loss "
                   "reads them all, a regularizer (an L2 penalty, `lam * sum(p.square().sum() "
                   "for p in model.parameters())`). Leave it out of the loss the per-sample "
                   "quantities are taken of (the optimizer's weight_decay, or its gradient added "
                   "to p.grad after them). Otherwise " + fix)
        else:
            fix += (". Or a term of the loss reads it (a regularizer): leave that out of the "
                    "loss the per-sample quantities are taken of")
    also = f", and so do {', '.join(repr(o) for o in others)}" if others else ""
    if parameter_hooks:
        fix = ("its gradient passes through a hook registered on it (p.register_hook), which "
               "changes .grad after autograd computed it and which the per-sample quantities "
               "do not follow: apply that change to them (grad1, the clipped sum), or remove "
               "the hook. Else " + fix)
    if disabled_calls:
        fix = ("hooked modules ran in this step with their hooks disabled (disable_hooks; "
               "psh.optim.KFAC's pause on the steps that read no factors), and their calls "
               "were not recorded: where their outputs reach the loss (a GAN's fake batch "
               "through the discriminator), their terms are unseen. Run them with the hooks "
               "on, or under torch.no_grad() (detach what the loss does not differentiate). "
               "Else " + fix)
    raise PerSampleHooksError(
        f"parameter '{name}' has a gradient term that no hook sees ({how}){also}: {fix}"
        + (
            ". Or its .grad held a gradient kept from before this step, which the check took "
            "as this step's (every step it had noted began without one): the next step is "
            "checked from its start" if taken_unnoted else ""))


def raise_unfaithful(name: str, users: Sequence[str], fraction: float) -> None:
    """The per-sample contributions to ``name`` of its owners ``users`` do not sum to the
    gradient those owners' forwards give it (by ``fraction`` of that gradient)."""
    owners = " and ".join(f"'{u}'" for u in users)
    raise PerSampleHooksError(
        f"parameter '{name}': the per-sample gradients of {owners} do not sum to the gradient "
        f"that autograd gives it through {owners} (they differ by {fraction:.0%} of it), so "
        "they are not per-sample gradients. Either the forward couples the samples of the "
        "batch (statistics over the batch dim, such as `x - x.mean(0)`, in a torch.func "
        "fallback unit: per-sample gradients are undefined there; use per-sample statistics, "
        "LayerNorm or GroupNorm), or its backward does (F.embedding(..., "
        "scale_grad_by_freq=True) divides by token counts over the batch: use "
        "scale_grad_by_freq=False), or, for a rule of your own (register_rule), its formula "
        "is wrong")


def check_mode(check_unseen: CheckUnseen) -> Literal["sampled", "always"] | None:
    """``add_hooks``' ``check_unseen`` as a :class:`Schedule` mode (None: no check)."""
    if check_unseen is True:
        return "sampled"
    if check_unseen == "always":
        return "always"
    if check_unseen is False:
        return None
    raise ValueError(f"add_hooks: check_unseen must be True (checked on new structures and "
                     f"sampled steps), 'always' or False, got {check_unseen!r}")


__all__ = ["UnseenUseCheck", "HookedSums", "Schedule", "CheckUnseen", "check_mode",
           "relative_tolerance", "CHECK_BUDGET", "N_PROBES", "UNFAITHFUL"]
