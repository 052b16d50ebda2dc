"""KFAC as a gradient preconditioner for any torch optimizer.

::

    precond = psh.optim.KFAC(model)  # damping=1e-3, kl_clip=1e-3, inverse_freq=10, ...
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        precond.step()        # p.grad <- KFAC-preconditioned gradient (covered layers only)
        optimizer.step()

Every trainable parameter of the model that :func:`per_sample_hooks.curvature.compute_kfac`
covers is preconditioned (by default every one of the hooked modules whose output reaches the
loss): Kronecker blocks for ``Linear`` / ``Conv1d/2d/3d`` / transformers' ``Conv1D``, Kronecker
blocks with a diagonal ``A`` for ``nn.Embedding``, and the damped curvature diagonal for the
rest (normalization layers, attention, the torch.func fallback, ...). What it leaves to the
optimizer as it is, and why, is in :attr:`KFAC.left_to_optimizer` (and a warning when that set
changes): parameters of modules that are not hooked or never reach the loss, those
``unsupported="skip"`` leaves out, and a parameter shared by several covered modules (GPT-2's
tied ``wte`` / ``lm_head`` weight): each module has a block for its own use of it, the gradient
is their sum, and the sum of two Kronecker blocks has no cheap inverse; preconditioning it with
one module's block would ignore the other's curvature. Parameters may be frozen and unfrozen
between steps; on a step that reads no factors (``update_freq > 1``) a bias frozen since the
last read drops its row and column of ``A``, a block holding another parameter frozen since is
dropped (its other parameters left as they are), and a parameter unfrozen since is left as it
is until the next read (all of these listed in ``left_to_optimizer``: a frozen parameter's
gradient is never written).

``step()`` once per backward: a second call with no backward since is refused (the gradients
are the ones it preconditioned). On a step that reads the factors, several forward+backward
passes (gradient accumulation) are refused: call ``clear_backprops(model)`` before each
micro-batch's forward but the last, whose factors are then read.

Math, per Kronecker layer (as :func:`~per_sample_hooks.curvature.compute_kfac` returns the
factors). The weight gradient is seen as a matrix ``M [dg, da]`` (Linear ``[out, in]``,
transformers' Conv1D its stored ``[in, out]`` transposed, conv
``[C_out, C_in/groups * prod(kernel)]``, the bias gradient, if the bias is trainable, appended
as the last column), and the curvature block of the (mean) loss for ``vec(M)`` (row-major) as
``kron(G, A)`` with ``A [da, da]``, ``G [dg, dg]``. For a grouped conv everything is per group:
``A [groups, da, da]``, ``G [groups, dg/groups, dg/groups]``, ``M`` viewed as
``[groups, dg/groups, da]``.

1. Running averages (every ``update_freq`` steps; the first update takes the factors as is):
   ``A <- decay * A + (1 - decay) * A_new`` and the same for ``G``.
2. Eigendecompositions (every ``inverse_freq`` steps, batched over groups, in float64 unless
   ``eigh_dtype`` says otherwise):
   ``A = Q_A diag(l_A) Q_A^T``, ``G = Q_G diag(l_G) Q_G^T`` (eigenvalues clamped at 0).
3. Preconditioned gradient (KFAC-eigen with Tikhonov damping ``lambda``)::

       P = Q_G [ (Q_G^T M Q_A) / (l_G l_A^T + lambda) ] Q_A^T

   which is ``(kron(G, A) + lambda I)^{-1} vec(M)`` exactly; with ``lambda -> 0`` it is the
   natural-gradient / Newton direction ``G^{-1} M A^{-1}``.
4. Step-size control over all covered layers (applied in this order):

   - ``kl_clip`` (on by default, ``1e-3``; Ba et al. 2017; Grosse & Martens 2016, as
     kfac-pytorch's ``kl_clip``): with ``lr`` the optimizer's learning rate, the predicted
     change of the model's output distribution is ``lr^2 * sum_layers <P, M>``; ``P`` is
     scaled by ``nu = min(1, sqrt(kl_clip / (lr^2 * sum <P, M>)))``. With the default
     ``lr=1.0`` this bounds ``<P, M>``, the squared curvature norm of the preconditioned
     gradient, and the optimizer's learning rate scales the step below that bound: the
     damped inverse of small eigenvalues can make ``P`` thousands of times the gradient in
     low-curvature directions, and without a clip SGD (momentum 0.9) on the digits CNN of
     ``examples/kfac_digits.py`` diverges at every learning rate from 0.01 to 1 with
     ``damping`` 1e-3, 1e-2 or 1e-1 (at 0.1 with 1e-1). With the default clip it trains at
     every one of them (two epochs: mean loss of the second 1.96 / 0.87 / 0.094 / 0.27 / 1.36
     at lr 0.01 / 0.03 / 0.1 / 0.3 / 1, against 0.24 for plain SGD's best learning rate).
   - ``rescale_norm=True``: ``P`` is scaled to the global norm of the original gradients of
     the covered layers (KFAC gives the direction, the optimizer's step size stays meaningful).

``P`` is split back into ``weight.grad`` and ``bias.grad``. An Embedding ``[V, d]`` is the same
with ``M`` its gradient transposed (``[d, V]``, a Linear on one-hot inputs), ``A = diag(a)``
(``Q_A = I``, ``l_A = a``): ``P^T = [(M^T Q_G) / (a l_G^T + lambda)] Q_G^T``. A parameter with a
curvature diagonal ``D`` (running average as the factors): ``P = M / (D + lambda)``. Step-size
control (4.) sums over all of them.

Which curvature the factors describe is decided by the backward passes the hooks saw
(see :mod:`per_sample_hooks.curvature`): by default ``step()`` reads them after the ordinary
``loss.backward()``: empirical-Fisher factors. For Gauss-Newton / Fisher factors call
:meth:`KFAC.backprop_hess` on the network output before the loss's backward::

    output = model(x)
    precond.backprop_hess(output, "CrossEntropy")   # o extra backward passes (update steps),
                                                    # to the hooked outputs from the second on
    F.cross_entropy(output, y).backward()
    precond.step()

``step()`` clears the captured records (``clear_backprops``) once it has read the factors: call
any other ``compute_*`` function of the same step before ``precond.step()``.
"""
from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .api import LossType, add_hooks, clear_backprops, disable_hooks, enable_hooks
from .capture import STATE_ATTRIBUTE, get_state, unwrap
from .curvature import KFACFactors, KFACUnsupported, compute_kfac
from .edges import OutputEdges
from .errors import PerSampleHooksError
from .forms import moment_dtype
from .step import library_computation

Factors = Mapping[nn.Module, tuple[Tensor, Tensor]]
FactorFn = Callable[[nn.Module], Factors]
Approx = Literal["expand", "reduce"]
HessType = Literal["LeastSquares", "CrossEntropy"]


@dataclass
class Eigen:
    """Eigendecompositions of one layer's factors, batched over groups.

    ``q_a [g, da, da]``, ``l_a [g, da]``, ``q_g [g, dg/g, dg/g]``, ``l_g [g, dg/g]``;
    ``q_a`` None: ``A`` is diagonal (Embedding), ``l_a`` its diagonal.
    """
    q_a: Tensor | None
    l_a: Tensor
    q_g: Tensor
    l_g: Tensor


def as_grouped(factor: Tensor) -> Tensor:
    """A factor ``[d, d]`` as ``[1, d, d]``; a grouped factor ``[g, d, d]`` unchanged."""
    if factor.dim() == 2:
        return factor.unsqueeze(0)
    if factor.dim() == 3:
        return factor
    raise ValueError(f"KFAC: a Kronecker factor must be [d, d] or [groups, d, d], got "
                     f"{tuple(factor.shape)}")


def symmetric_eigh(factor: Tensor, dtype: torch.dtype | None = torch.float64
                   ) -> tuple[Tensor, Tensor]:
    """``(eigenvalues [..., d], eigenvectors [..., d, d])`` of a batch of symmetric PSD matrices
    ``[..., d, d]``, computed in ``dtype`` (None: ``factor``'s own) on the symmetrized matrix,
    eigenvalues clamped at 0, returned in ``factor``'s dtype."""
    wide = factor.to(dtype or factor.dtype)
    values, vectors = torch.linalg.eigh((wide + wide.mT) / 2)
    return values.clamp_min(0).to(factor.dtype), vectors.to(factor.dtype)


def eigen_of(a: Tensor, g: Tensor, dtype: torch.dtype | None = torch.float64) -> Eigen:
    """:class:`Eigen` of grouped factors ``a [g, da, da]`` and ``g [g, dg/g, dg/g]``
    (decomposed in ``dtype``, see :func:`symmetric_eigh`)."""
    l_a, q_a = symmetric_eigh(a, dtype)
    l_g, q_g = symmetric_eigh(g, dtype)
    return Eigen(q_a, l_a, q_g, l_g)


def precondition(m: Tensor, eigen: Eigen, damping: float) -> Tensor:
    """``Q_G [(Q_G^T M Q_A) / (l_G l_A^T + damping)] Q_A^T`` for ``m [g, dg/g, da]`` (no
    ``Q_A`` when ``A`` is diagonal).

    Equals ``(kron(G, A) + damping I)^{-1} vec(M)`` per group (row-major ``vec``).
    """
    rotated = eigen.q_g.mT @ m.to(eigen.q_g.dtype)  # (a float16 gradient: in float32)
    if eigen.q_a is not None:
        rotated = rotated @ eigen.q_a
    rotated = rotated / (eigen.l_g.unsqueeze(-1) * eigen.l_a.unsqueeze(-2) + damping)
    rotated = eigen.q_g @ rotated
    return rotated if eigen.q_a is None else rotated @ eigen.q_a.mT


def running_average(old: tuple[Tensor, ...] | None, new: tuple[Tensor, ...], decay: float
                    ) -> tuple[Tensor, ...]:
    """``old <- decay * old + (1 - decay) * new`` in place; a copy of ``new`` when there is no
    ``old`` of its shapes."""
    if old is None or any(o.shape != n.shape for o, n in zip(old, new)):
        return tuple(n.clone() for n in new)
    for o, n in zip(old, new):
        o.mul_(decay).add_(n, alpha=1 - decay)
    return old


def moved_like(p: Tensor, tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """``tensors`` on ``p``'s device in the dtype of its curvature (its own; float32 for a
    float16 ``p``: ``forms.moment_dtype``), the same tensors where they already are."""
    dtype = moment_dtype(p.dtype)
    return tuple(None if t is None else t.to(p.device, dtype) for t in tensors)


def check_finite(tensors: tuple[Tensor, ...], what: str) -> None:
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise FloatingPointError(
            f"KFAC: non-finite {what}: a sample of the batch with non-finite values (the data; "
            "psh.compute_norms names the samples), or the training diverged (lower the "
            "learning rate or raise the damping)")


def has_trainable_bias(module: nn.Module) -> bool:
    bias = getattr(module, "bias", None)
    return isinstance(bias, Tensor) and bias.requires_grad


def matrix_columns(module: nn.Module, transposed: bool = False) -> int:
    """The columns of :func:`gradient_matrix`: a row of the weight, and the bias if it is
    trainable (the size of the factor ``A``)."""
    weight = module.weight
    rows = weight.shape[1] if transposed else weight.shape[0]
    return weight.numel() // rows + has_trainable_bias(module)


def gradient_matrix(module: nn.Module, groups: int, da: int, transposed: bool = False
                    ) -> Tensor | None:
    """The weight gradient (``transposed``: of a weight stored ``[in, out]``, transformers'
    Conv1D) and the bias gradient as the last column where ``A`` has one,
    ``[groups, dg/groups, da]``; None when the weight has no gradient or is frozen. (A bias
    unfrozen since the factors were read has no column in ``A``: its gradient is left as it
    is.)"""
    weight = module.weight
    if weight.grad is None or not weight.requires_grad:
        return None
    grad = weight.grad.t() if transposed else weight.grad
    m = grad.reshape(groups, grad.shape[0] // groups, -1)
    if has_trainable_bias(module) and da == m.shape[-1] + 1:
        bias = module.bias.grad
        bias = torch.zeros_like(module.bias) if bias is None else bias
        m = torch.cat([m, bias.reshape(groups, -1, 1).to(m.dtype)], dim=-1)
    if m.shape[-1] != da:
        raise ValueError(f"KFAC: {type(module).__name__}'s gradient matrix has {m.shape[-1]} "
                         f"columns but its factor A is {da} x {da}")
    return m


def write_back(module: nn.Module, p: Tensor, transposed: bool = False) -> None:
    """Split ``p [groups, dg/groups, da]`` into ``weight.grad`` (``transposed``: stored
    ``[in, out]``) and ``bias.grad`` (in place) where ``p`` has its column."""
    weight = module.weight
    if has_trainable_bias(module) and p.shape[-1] == matrix_columns(module, transposed):
        p, bias = p[..., :-1], p[..., -1]
        if module.bias.grad is None:
            module.bias.grad = bias.reshape(module.bias.shape).clone()
        else:
            module.bias.grad.copy_(bias.reshape(module.bias.shape))
    weight.grad.copy_(p.reshape(weight.shape[::-1]).t() if transposed else
                      p.reshape(weight.shape))


def write_rows(module: nn.Module, p: Tensor) -> None:
    """``p [1, d, V]`` (the Linear layout) back into an Embedding's ``weight.grad [V, d]``."""
    module.weight.grad.copy_(p[0].t())


def block_module(key: object) -> nn.Module:
    """The module of a block key: a module, or ``(module, local name)``."""
    return key if isinstance(key, nn.Module) else key[0]


def default_factors(approx: Approx, loss_type: LossType, unsupported: KFACUnsupported
                    ) -> FactorFn:
    """``model -> compute_kfac(model, approx, loss_type, unsupported=unsupported)``."""
    return partial(compute_kfac, approx=approx, loss_type=loss_type, unsupported=unsupported)


class KFAC:
    """KFAC preconditioner: replaces the gradients of the parameters it covers by the damped
    curvature solve (``(kron(G, A) + damping)^-1`` times the gradient for a Kronecker block),
    for use before any optimizer's ``step()`` (see the module docstring).

    Args:
        model: the model; hooked with :func:`per_sample_hooks.add_hooks` if it is not already
            (:meth:`close` removes hooks added here).
        damping: Tikhonov damping ``lambda`` added to the eigenvalues ``l_G l_A^T`` (and to
            curvature diagonals).
        factor_decay: running-average decay of the factors and diagonals (0: latest only).
        update_freq: read new factors every this many steps. Between updates the hooks are
            disabled (``pause_hooks``), so those steps cost a plain forward and backward.
        inverse_freq: recompute the eigendecompositions every this many steps.
        approx, loss_type, unsupported: passed to ``compute_kfac`` (``"expand"``/``"reduce"``
            for layers with positions; ``"mean"``/``"sum"``: how the loss reduces the batch;
            ``"diagonal"``: a curvature diagonal for layers without Kronecker structure,
            ``"skip"``: leave them to the optimizer).
        kl_clip: bound the predicted KL change ``lr^2 <P, M>`` by it (None: no bound; see
            the module docstring: without it KFAC's steps along low-curvature directions can
            diverge at ordinary learning rates).
        lr: used only by ``kl_clip``. 1.0 (the default): ``kl_clip`` bounds ``<P, M>`` and the
            optimizer's learning rate scales the clipped step. The optimizer's learning rate
            (kfac-pytorch's convention): it bounds the step's own predicted KL, so the
            learning rate matters only while the clip does not bind; update ``precond.lr``
            along with a schedule.
        rescale_norm: scale the preconditioned gradients to the norm of the original ones.
        pause_hooks: disable the model's hooks on steps that read no factors (``update_freq >
            1``); set False if something else reads the hooks on every step.
        factors: ``model -> factors``; default ``compute_kfac(model, approx, loss_type,
            unsupported=unsupported)`` after the step's backward. A
            :class:`~per_sample_hooks.curvature.KFACFactors`, or any mapping
            ``{module: (A, G)}`` of Kronecker factors only.
        eigh_dtype: the dtype of the eigendecompositions (None: the factors' own). float64
            (the default) costs more: on the 784-512-512-10 MLP, 2 threads, the 785-wide
            factor's took 108 ms in float64 and 33 ms in float32 (every ``inverse_freq``
            steps), next to about 20 ms per step for the preconditioning products.

    Attributes:
        factors: ``{module: (A [g, da, da], G [g, dg/g, dg/g])}``, Kronecker running averages;
        embeddings: ``{module: (a [V], G [d, d])}``; diagonals: ``{(module, local name): D}``.
        left_to_optimizer: ``{qualified parameter name: why}`` for every trainable parameter
            of the model that is not preconditioned (its gradient is left as it is).
    """

    def __init__(self, model: nn.Module, *, damping: float = 1e-3, factor_decay: float = 0.95,
                 update_freq: int = 1, inverse_freq: int = 10, approx: Approx = "expand",
                 loss_type: LossType = "mean", unsupported: KFACUnsupported = "diagonal",
                 kl_clip: float | None = 1e-3, lr: float = 1.0, rescale_norm: bool = False,
                 pause_hooks: bool = True, factors: FactorFn | None = None,
                 eigh_dtype: torch.dtype | None = torch.float64) -> None:
        if damping < 0:
            raise ValueError(f"KFAC: damping must be >= 0, got {damping}")
        if not 0 <= factor_decay < 1:
            raise ValueError(f"KFAC: factor_decay must be in [0, 1), got {factor_decay}")
        if update_freq < 1 or inverse_freq < 1:
            raise ValueError("KFAC: update_freq and inverse_freq must be >= 1")
        if kl_clip is not None and kl_clip <= 0:
            raise ValueError(f"KFAC: kl_clip must be > 0, got {kl_clip}")
        self.model = model
        self.damping = damping
        self.factor_decay = factor_decay
        self.update_freq = update_freq
        self.inverse_freq = inverse_freq
        self.kl_clip = kl_clip
        self.lr = lr
        self.rescale_norm = rescale_norm
        self.pause_hooks = pause_hooks
        self.loss_type = loss_type
        self.eigh_dtype = eigh_dtype
        self.read_factors = factors or default_factors(approx, loss_type, unsupported)
        self.read_this_step = False  # factors already read by backprop_hess
        self.owns_hooks = unwrap(model).__dict__.get(STATE_ATTRIBUTE) is None
        add_hooks(model)
        # the hooked outputs' edges for backprop_hess, recorded from its first call on (they
        # hold the graph of every forward until a backward: none without backprop_hess)
        self.edges: OutputEdges | None = None
        self.transposed = {m for m, rule in get_state(model).rules.items()
                           if getattr(rule, "weight_transposed", False)}  # stored [in, out]
        self.steps = 0
        self.factors: dict[nn.Module, tuple[Tensor, Tensor]] = {}  # running averages, grouped
        self.embeddings: dict[nn.Module, tuple[Tensor, Tensor]] = {}
        self.diagonals: dict[tuple[nn.Module, str], Tensor] = {}
        self.eigen: dict[nn.Module, Eigen] = {}
        self.names = {m: n for n, m in unwrap(model).named_modules()}
        self.parameters = list(unwrap(model).named_parameters())  # as made, like names
        self.skipped: set[str] = set()  # what the last KFACFactors skipped
        self.excluded: set[object] = set()  # blocks holding a parameter of several blocks
        self.left_to_optimizer: dict[str, str] = {}
        # (parameter, its .grad, the version) of each gradient the last step() wrote: all
        # still there, unchanged, there was no backward since
        self.written: list[tuple[Tensor, weakref.ref, int]] = []

    # ------------------------------------------------------------------ the step

    def backprop_hess(self, output: Tensor, hess_type: HessType, *,
                      n_samples: int | None = None,
                      generator: torch.Generator | None = None,
                      weights: Tensor | None = None) -> None:
        """On an update step, read Gauss-Newton / Fisher factors now: ``backprop_hess(output,
        hess_type)`` (graph kept for the loss's backward) then the factors. Call it on the
        step's fresh ``output`` before ``loss.backward()``; ``step()`` then reads no factors.
        Does nothing on steps that read no factors (``update_freq > 1``). Called again before
        ``step()`` (the step of the previous call was skipped), it reads this batch's factors
        too (folded into the running averages), so that the step uses them.

        ``hess_type``: ``"CrossEntropy"`` or ``"LeastSquares"`` (per-sample ``0.5|y - t|^2``);
        ``n_samples``: Monte-Carlo Fisher with that many sampled targets instead of the exact
        ``o`` passes; ``weights``: each position's share of its sample's loss, 0 where
        padded (see :func:`per_sample_hooks.curvature.backprop_hess`).

        From the second call on, the passes stop at the hooked layers' outputs
        (``backprop_hess(..., edges=)``, recorded in every forward from the first call on) and
        compute no parameter gradient, except on the steps the unseen-use check runs
        (:mod:`per_sample_hooks.unseen`, the first among them), whose passes go to the graph's
        leaves so that it has parameter gradients to compare. Without ``backprop_hess`` no
        edges are recorded: they would keep the graphs of forwards no backward follows.
        """
        if self.steps % self.update_freq != 0:
            return
        from .curvature import backprop_hess  # noqa: PLC0415
        if self.edges is None:  # records from the next forward on: this pass goes to the leaves
            self.edges = OutputEdges(self.model)
        backprop_hess(output, hess_type, loss_type=self.loss_type, n_samples=n_samples,
                      generator=generator, weights=weights, retain_graph=True,
                      edges=self.edges)
        self.update_factors(self.read_factors(self.model))
        clear_backprops(self.model)
        self.read_this_step = True

    @library_computation
    def step(self) -> None:
        """Update factors / eigendecompositions when due, then precondition the gradients."""
        self.refuse_preconditioned_gradients()
        if self.steps % self.update_freq == 0 and not self.read_this_step:
            self.refuse_micro_batches()
            self.update_factors(self.read_factors(self.model))
        self.read_this_step = False
        clear_backprops(self.model)
        self.follow_parameters()
        self.drop_frozen_bias_columns()
        self.drop_frozen_blocks()
        if self.steps % self.inverse_freq == 0:
            self.update_eigen()
        else:  # blocks new or reshaped since the last refresh (the others keep theirs)
            self.update_eigen([m for m in (*self.factors, *self.embeddings)
                               if m not in self.eigen and m not in self.excluded])
        self.precondition_grads()
        self.written = [(p, weakref.ref(p.grad), p.grad._version) for params in
                        self.blocks().values() for p in params if p.grad is not None]
        self.steps += 1
        if self.pause_hooks and self.update_freq > 1:
            (enable_hooks if self.steps % self.update_freq == 0 else disable_hooks)(self.model)

    def refuse_preconditioned_gradients(self) -> None:
        """Refuse a ``step()`` with no backward since the last: the gradients it wrote are
        still there, unchanged (preconditioned again, they would be another direction)."""
        if self.written and all(p.grad is not None and p.grad is grad() and
                                p.grad._version == version for p, grad, version in self.written):
            raise PerSampleHooksError(
                "KFAC.step(): no backward since the last step(): the gradients are the ones it "
                "preconditioned, and preconditioning them again gives another direction. Call "
                "step() once after each backward")

    def refuse_micro_batches(self) -> None:
        """Refuse to read factors from several forward+backward passes of one step (gradient
        accumulation); the records are dropped, so the next step starts clean."""
        state = get_state(self.model)
        if state.status.forward_after_backward is not None:
            clear_backprops(self.model)
            raise PerSampleHooksError(
                "KFAC.step(): several forward+backward passes before this step (gradient "
                "accumulation?), on a step that reads the factors: they are read from one "
                "backward, and the micro-batches' rows cannot be told apart. Call "
                "per_sample_hooks.clear_backprops(model) before each micro-batch's forward "
                "but the last (the factors are then the last micro-batch's), or step once "
                "per backward")

    def follow_parameters(self) -> None:
        """The running state on its parameters' device and dtype: the model may have been
        moved or cast (``model.double()``) since it was computed."""
        for module, pair in self.factors.items():
            self.factors[module] = moved_like(module.weight, pair)
        for module, pair in self.embeddings.items():
            self.embeddings[module] = moved_like(module.weight, pair)
        for (module, name), diagonal in self.diagonals.items():
            self.diagonals[(module, name)] = moved_like(module.get_parameter(name),
                                                        (diagonal,))[0]
        for module, e in self.eigen.items():
            self.eigen[module] = Eigen(*moved_like(module.weight, (e.q_a, e.l_a, e.q_g, e.l_g)))

    def drop_frozen_bias_columns(self) -> None:
        """A bias frozen since the factors were read (on a step that reads none,
        ``update_freq > 1``): its row and column of ``A`` dropped, leaving the block of the
        weight alone, whose eigendecomposition is redone."""
        for module, (a, g) in self.factors.items():
            if a.shape[-1] == matrix_columns(module, module in self.transposed) + 1:
                self.factors[module] = (a[..., :-1, :-1], g)
                self.eigen.pop(module, None)

    def drop_frozen_blocks(self) -> None:
        """A block holding a parameter frozen since the factors were read (on a step that
        reads none, ``update_freq > 1``) is dropped, its parameters' gradients left as they
        are until the next read; then :attr:`left_to_optimizer` is brought up to date."""
        for key, params in self.blocks().items():
            if not all(p.requires_grad for p in params):
                for blocks in (self.factors, self.embeddings, self.diagonals, self.eigen):
                    blocks.pop(key, None)
        self.update_coverage()

    def update_factors(self, new: Factors) -> None:
        """Fold ``new`` factors (and diagonals) into the running averages (the first ones are
        taken as is), then update :attr:`left_to_optimizer`."""
        self.follow_parameters()
        decay = self.factor_decay
        everything = new if isinstance(new, KFACFactors) else KFACFactors(dict(new))
        read = {*everything.kronecker, *everything.embeddings,
                *((m, n) for m, diagonals in everything.diagonal.items() for n in diagonals)}
        for module, (a, g) in everything.kronecker.items():
            self.fold(self.factors, module, (as_grouped(a.detach()), as_grouped(g.detach())))
        for module, (a, g) in everything.embeddings.items():
            self.fold(self.embeddings, module, (a.detach(), g.detach()))
        for module, diagonals in everything.diagonal.items():
            for name, diagonal in diagonals.items():
                key = (module, name)
                check_finite((diagonal,), f"curvature diagonal of "
                                          f"'{self.names.get(module, module)}' {name}")
                old = self.diagonals.get(key)
                self.diagonals[key] = running_average(None if old is None else (old,),
                                                      (diagonal.detach(),), decay)[0]
        self.drop_outdated(read)
        self.skipped = set(everything.skipped)
        self.update_coverage()

    def fold(self, blocks: dict[nn.Module, tuple[Tensor, Tensor]], module: nn.Module,
             pair: tuple[Tensor, Tensor]) -> None:
        """``module``'s new factors ``pair`` into its running average in ``blocks``; its
        eigendecomposition is dropped when their shapes changed (a bias frozen or unfrozen)."""
        check_finite(pair, f"Kronecker factors for '{self.names.get(module, module)}'")
        old = blocks.get(module)
        if old is not None and any(o.shape != n.shape for o, n in zip(old, pair)):
            self.eigen.pop(module, None)
        blocks[module] = running_average(old, pair, self.factor_decay)

    def drop_outdated(self, read: set[object]) -> None:
        """Drop the blocks (and their eigendecompositions) that the factors just ``read``
        (folded in) replace: one not read now whose parameters are held by a block read now
        (a Linear's bias had a diagonal while its weight was frozen, and is in its Kronecker
        block again), or that holds a frozen parameter, or whose bias column is no longer
        that of the module (its bias frozen or unfrozen). A block merely not read now (its
        module did not reach this step's loss) keeps its running average."""
        held = {id(p) for key, params in self.blocks().items() if key in read for p in params}
        for key, params in self.blocks().items():
            if key in read:
                continue
            module = block_module(key)
            reshaped = key in self.factors and self.factors[key][0].shape[-1] != \
                matrix_columns(module, module in self.transposed)
            if reshaped or any(id(p) in held or not p.requires_grad for p in params):
                for blocks in (self.factors, self.embeddings, self.diagonals, self.eigen):
                    blocks.pop(key, None)

    def update_eigen(self, modules: list[nn.Module] | None = None) -> None:
        """Eigendecompositions of the current running averages (the diagonal ``A`` of an
        Embedding is its own): of ``modules``' blocks, or all (None)."""
        if modules is None:
            self.eigen = {}
            modules = [m for m in (*self.factors, *self.embeddings) if m not in self.excluded]
        for module in modules:
            if module in self.factors:
                self.eigen[module] = eigen_of(*self.factors[module], self.eigh_dtype)
            else:
                a, g = self.embeddings[module]
                l_g, q_g = symmetric_eigh(as_grouped(g), self.eigh_dtype)
                self.eigen[module] = Eigen(None, a.clamp_min(0).unsqueeze(0), q_g, l_g)

    def precondition_grads(self) -> None:
        """Replace covered gradients by the damped KFAC direction, with step-size control."""
        done: list[tuple[Tensor, Tensor, Callable[[Tensor], None]]] = []  # (M, P, write P)
        sparse = []
        for module, eigen in self.eigen.items():
            if module in self.excluded:
                continue
            if eigen.q_a is None:  # Embedding [V, d]: as a Linear on one-hot inputs, [d, V]
                grad = module.weight.grad
                if grad is not None and grad.is_sparse:  # Embedding(sparse=True)
                    grad = module.weight.grad = grad.to_dense()
                    sparse.append(module.weight)
                m = None if grad is None else grad.t().unsqueeze(0)
                write = partial(write_rows, module)
            else:
                transposed = module in self.transposed
                m = gradient_matrix(module, eigen.q_a.shape[0], eigen.q_a.shape[-1], transposed)
                write = partial(write_back, module, transposed=transposed)
            if m is not None:
                done.append((m, precondition(m, eigen, self.damping), write))
        for (module, name), diagonal in self.diagonals.items():
            grad = module.get_parameter(name).grad
            if grad is not None and (module, name) not in self.excluded:
                done.append((grad, grad / (diagonal + self.damping), grad.copy_))
        if self.damping == 0 and not all(bool(torch.isfinite(p).all()) for _, p, _ in done):
            raise FloatingPointError(
                "KFAC: a preconditioned gradient is not finite: with damping=0 a singular "
                "factor (a layer wider than the samples it saw, a dead unit) has no inverse. "
                "Give damping > 0 (1e-8 keeps the natural-gradient direction wherever the "
                "factors are invertible); no gradient was changed")
        scale = self.step_scale([(m, p) for m, p, _ in done])
        for _, p, write in done:
            write(p * scale if scale != 1.0 else p)
        for weight in sparse:  # the layout autograd gave: A is diagonal, so the rows no token
            weight.grad = weight.grad.to_sparse(sparse_dim=1)  # hit stay zero

    def step_scale(self, pairs: list[tuple[Tensor, Tensor]]) -> float:
        """The factor applied to every preconditioned gradient (1 without step-size control)."""
        scale = 1.0
        if not pairs:
            return scale
        if self.kl_clip is not None:
            vg = sum(float((p * m).sum()) for m, p in pairs) * self.lr ** 2
            if vg > 0:
                scale = min(1.0, math.sqrt(self.kl_clip / vg))
        if self.rescale_norm:
            before = math.sqrt(sum(float(m.pow(2).sum()) for m, _ in pairs))
            after = math.sqrt(sum(float(p.pow(2).sum()) for _, p in pairs)) * scale
            if after > 0:
                scale *= before / after
        return scale

    # ------------------------------------------------------------------ coverage

    def blocks(self) -> dict[object, list[Tensor]]:
        """The parameters each block preconditions, keyed as the blocks: a module (Kronecker
        factors: weight and trainable bias; Embedding: weight) or ``(module, local name)``
        (a curvature diagonal). A bias unfrozen since the factors were read has no column
        in ``A``: not in its module's block."""
        result: dict[object, list[Tensor]] = {}
        for module, (a, _) in self.factors.items():
            bias_column = has_trainable_bias(module) and \
                a.shape[-1] == matrix_columns(module, module in self.transposed)
            result[module] = [module.weight, *([module.bias] if bias_column else [])]
        for module in self.embeddings:
            result[module] = [module.weight]
        for module, name in self.diagonals:
            result[(module, name)] = [module.get_parameter(name)]
        return result

    def update_coverage(self) -> None:
        """:attr:`excluded` (blocks holding a parameter that another block holds too) and
        :attr:`left_to_optimizer`; a warning when the names left to the optimizer change."""
        blocks = self.blocks()
        users: dict[int, list[object]] = {}
        for key, params in blocks.items():
            for p in params:
                users.setdefault(id(p), []).append(key)
        self.excluded = {key for key, params in blocks.items()
                         if any(len(users[id(p)]) > 1 for p in params)}
        if not users.keys() <= {id(p) for _, p in self.parameters}:  # replaced since (assign=)
            self.parameters = list(unwrap(self.model).named_parameters())
        left = {}
        for name, p in self.parameters:
            keys = users.get(id(p), [])
            if not p.requires_grad or (keys and keys[0] not in self.excluded):
                continue
            if len(keys) > 1:
                modules = " and ".join(sorted(f"'{self.names.get(block_module(k))}'"
                                              for k in keys))
                left[name] = (f"used by {modules}: each has a block for its own use, and their "
                              "sum has no cheap inverse")
            elif keys:
                left[name] = "in one Kronecker block with a parameter used by several modules"
            elif name in self.skipped:
                left[name] = "left out by compute_kfac(unsupported='skip')"
            else:
                left[name] = ("no curvature read: its module is not hooked, its output never "
                              "reached the loss, the factors function left it out, or it was "
                              "frozen (or unfrozen) since the factors were last read "
                              "(update_freq > 1: until the next read)")
        if left and left.keys() != self.left_to_optimizer.keys():
            warnings.warn("KFAC leaves these trainable parameters to the optimizer as they are "
                          f"(KFAC.left_to_optimizer says why): {sorted(left)}", stacklevel=4)
        self.left_to_optimizer = left

    # ------------------------------------------------------------------ life cycle, state

    def close(self) -> None:
        """Remove the hooks if this preconditioner added them (re-enable them otherwise)."""
        from .api import remove_hooks  # noqa: PLC0415
        if self.edges is not None:
            self.edges.remove()
            self.edges = None
        if self.owns_hooks:
            remove_hooks(self.model)
        elif unwrap(self.model).__dict__.get(STATE_ATTRIBUTE) is not None:
            enable_hooks(self.model)

    def state_dict(self) -> dict[str, Any]:
        """Step count, running factors and diagonals and the eigendecompositions (those in use
        until the next ``inverse_freq`` step), keyed by qualified module name (diagonals by
        module name and the parameter's local name)."""
        def cloned(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
            return tuple(None if t is None else t.clone() for t in tensors)
        return {
            "steps": self.steps,
            "factors": {self.names[m]: cloned(f) for m, f in self.factors.items()},
            "embeddings": {self.names[m]: cloned(f) for m, f in self.embeddings.items()},
            "diagonals": {(self.names[m], n): d.clone() for (m, n), d in self.diagonals.items()},
            "eigen": {self.names[m]: cloned((e.q_a, e.l_a, e.q_g, e.l_g))
                      for m, e in self.eigen.items()},
            "hyperparameters": {"damping": self.damping, "factor_decay": self.factor_decay,
                                "update_freq": self.update_freq,
                                "inverse_freq": self.inverse_freq, "kl_clip": self.kl_clip,
                                "lr": self.lr, "rescale_norm": self.rescale_norm},
        }

    def state_shapes(self, state: Mapping[str, Any], modules: Mapping[str, nn.Module]
                     ) -> dict[str, tuple[list[tuple[int, ...]], list[tuple[int, ...]]] | None]:
        """``{module name: None}`` where the state's blocks fit the module's parameters, else
        ``(the blocks' shapes, the parameters' shapes)``: a Kronecker block's ``G`` spans the
        weight's rows and its ``A`` a row (and the bias, if one), an Embedding's ``a [V]``
        and ``G [d, d]`` the weight ``[V, d]``, a diagonal its parameter."""
        result: dict[str, tuple[list[tuple[int, ...]], list[tuple[int, ...]]] | None] = {}
        for name, (a, g) in state["factors"].items():
            module = modules[name]
            rows = module.weight.shape[1 if module in self.transposed else 0]
            extra = a.shape[-1] - module.weight.numel() // rows
            fits = g.shape[-1] * (g.shape[0] if g.dim() == 3 else 1) == rows and (
                extra == 0 or (extra == 1 and isinstance(getattr(module, "bias", None), Tensor)))
            result[name] = None if fits else (
                [tuple(a.shape), tuple(g.shape)],
                [tuple(p.shape) for p in module.parameters(recurse=False)])
        for name, (a, g) in state.get("embeddings", {}).items():
            weight = modules[name].weight
            fits = (a.shape[-1], g.shape[-1]) == tuple(weight.shape)
            result[name] = None if fits else ([tuple(a.shape), tuple(g.shape)],
                                              [tuple(weight.shape)])
        for (name, local), diagonal in state.get("diagonals", {}).items():
            parameter = modules[name].get_parameter(local)
            if diagonal.shape != parameter.shape:
                result[f"{name}.{local}"] = ([tuple(diagonal.shape)], [tuple(parameter.shape)])
        return result

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (on a model with the same module names)."""
        modules = dict(unwrap(self.model).named_modules())
        wanted = [*state["factors"], *state.get("embeddings", {}),
                  *(n for n, _ in state.get("diagonals", {}))]
        missing = [n for n in wanted if n not in modules]
        if missing:
            raise KeyError(f"KFAC.load_state_dict: no module named {missing} in the model")
        for name, shapes in self.state_shapes(state, modules).items():
            if shapes is not None:
                raise ValueError(
                    f"KFAC.load_state_dict: the state's factors of '{name}' have shapes "
                    f"{shapes[0]}, which do not fit its parameters {shapes[1]}: a state of "
                    "another model (other layer sizes). Nothing was loaded")
        self.steps = int(state["steps"])
        for name, value in state.get("hyperparameters", {}).items():
            setattr(self, name, value)

        def like(p: Tensor, tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
            return tuple(None if t is None else t.clone() for t in moved_like(p, tensors))
        self.factors = {modules[n]: like(modules[n].weight, f)
                        for n, f in state["factors"].items()}
        self.embeddings = {modules[n]: like(modules[n].weight, f)
                           for n, f in state.get("embeddings", {}).items()}
        self.diagonals = {(modules[n], local): like(modules[n].get_parameter(local), (d,))[0]
                          for (n, local), d in state.get("diagonals", {}).items()}
        self.update_coverage()
        if "eigen" in state:
            self.eigen = {modules[n]: Eigen(*like(modules[n].weight, e))
                          for n, e in state["eigen"].items()}
        else:
            self.update_eigen()
        if self.pause_hooks and self.update_freq > 1:
            (enable_hooks if self.steps % self.update_freq == 0 else disable_hooks)(self.model)


__all__ = ["KFAC", "Eigen", "precondition", "eigen_of", "symmetric_eigh"]
