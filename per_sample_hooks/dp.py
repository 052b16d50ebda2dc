"""DP-SGD around any optimizer: sampling, per-sample clipping, Gaussian noise, accounting.

    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.1,
               max_grad_norm=1.0, dataset_size=len(x), batch_size=64)
    for epoch in range(epochs):
        for idx in dp.batches():              # Poisson-sampled indices (may be empty)
            dp.zero_grad()
            if len(idx):
                dp.backward(criterion(model(x[idx]), y[idx]))  # or loss.backward()
            dp.step(empty_batch=len(idx) == 0)
        print(dp.epsilon(delta=1e-5))

Each step replaces the gradient by ``(sum_i c_i g_i + N(0, sigma^2 C^2 I)) / L`` (``C`` the
clipping norm, ``L`` the expected batch size) and tells the accountant. Accounting uses Opacus'
accountants (``pip install per_sample_hooks[dp]``), never a hand-written one. The privacy
guarantee of the RDP/PRV accountants holds for Poisson sampling; fixed-size sampling (a uniform
random subset of ``batch_size`` per step) is accounted as Poisson with the same rate, the usual
approximation (as in Opacus), and is not a formal guarantee. ``torch``'s generator is not a
cryptographically secure source of noise.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import distributed
from .edges import OutputEdges
from .errors import PerSampleHooksError
from .norms import check_max_norm, clip_grads
from .sharded import like, sharded_parameters
from .step import LossType

Sampling = Literal["poisson", "fixed"]


def _opacus_accountants() -> Any:
    try:
        import opacus.accountants as accountants
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "privacy accounting uses Opacus' accountants: pip install 'per_sample_hooks[dp]' "
            "(or pass accountant=None to train without accounting)") from error
    return accountants


def make_accountant(accountant: str | Any | None) -> Any:
    """An Opacus accountant by mechanism name ("rdp", "prv", "gdp"), an object with
    ``step(noise_multiplier=, sample_rate=)`` and ``get_epsilon(delta)``, or None."""
    if accountant is None or not isinstance(accountant, str):
        return accountant
    return _opacus_accountants().create_accountant(mechanism=accountant)


def noise_multiplier_for(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                         accountant: str = "rdp") -> float:
    """The smallest noise multiplier reaching ``(target_epsilon, delta)`` after ``steps`` steps
    (Opacus' ``get_noise_multiplier``)."""
    _opacus_accountants()
    from opacus.accountants.utils import get_noise_multiplier
    return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                sample_rate=sample_rate, steps=steps, accountant=accountant)


def poisson_batch(dataset_size: int, sample_rate: float, generator: torch.Generator | None
                  ) -> Tensor:
    """Indices of a Poisson-sampled batch: each sample independently with ``sample_rate``."""
    keep = torch.rand(dataset_size, generator=generator) < sample_rate
    return keep.nonzero().flatten()


def fixed_size_batch(dataset_size: int, batch_size: int, generator: torch.Generator | None
                     ) -> Tensor:
    """Indices of a uniformly random subset of ``batch_size`` distinct samples."""
    return torch.randperm(dataset_size, generator=generator)[:batch_size]


class DPSGD:
    """Differentially private training step around ``optimizer`` (any ``torch.optim``).

    ``step()`` after an ordinary backward of the sampled batch: clips each sample's gradient
    to ``max_grad_norm`` with :func:`~per_sample_hooks.clip_grads` (no per-sample gradients
    stored), adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` to the sum, divides by the
    expected batch size, steps the optimizer and the accountant. Noise goes on every trainable
    parameter of ``model``. The model is hooked with :func:`~per_sample_hooks.add_hooks`.

    With a ``DistributedDataParallel`` model (process group initialized) every rank samples
    from its own shard: ``dataset_size`` and ``batch_size`` are per rank (the sampling rate,
    hence the accounting, is the global one) and the expected global batch is
    ``world_size * batch_size``. DDP's all-reduce of unclipped gradients is switched off (a
    comm hook); ``step`` clips locally, all-reduces the clipped sums once
    (:func:`per_sample_hooks.distributed.clip_grads`), and adds noise drawn on rank 0 and
    broadcast, so every rank steps with the same gradient. Every rank runs the forward,
    backward and ``step()`` of every step, an empty local batch included (a ``[0, ...]``
    tensor): DDP needs all ranks in each forward, ``step`` in each all-reduce.

    With an FSDP2 (``fully_shard``) model, the same, except that the backward is the output-edge
    one (no parameter gradient: FSDP2 reduces nothing), each layer's clipped sum is summed over
    the ranks into the shards of ``p.grad``, and the noise (drawn on rank 0, broadcast) is cut
    to each rank's shard (:mod:`per_sample_hooks.distributed`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 noise_multiplier: float, max_grad_norm: float, dataset_size: int,
                 batch_size: int, sampling: Sampling = "poisson", loss_type: LossType = "mean",
                 accountant: str | Any | None = "rdp", generator: torch.Generator | None = None):
        max_grad_norm = check_max_norm(max_grad_norm, "DPSGD", "max_grad_norm")
        if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
                and noise_multiplier >= 0):
            raise ValueError(f"DPSGD: noise_multiplier must be a finite number >= 0, got "
                             f"{noise_multiplier!r}")
        if not 0 < batch_size <= dataset_size:
            raise ValueError(f"DPSGD: need 0 < batch_size <= dataset_size, got {batch_size} and "
                             f"{dataset_size}")
        if sampling not in ("poisson", "fixed"):
            raise ValueError(f"DPSGD: sampling must be 'poisson' or 'fixed', got {sampling!r}")
        self.model, self.optimizer = model, optimizer
        self.noise_multiplier, self.max_grad_norm = float(noise_multiplier), float(max_grad_norm)
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.sampling, self.loss_type = sampling, loss_type
        self.sample_rate = batch_size / dataset_size
        self.accountant = make_accountant(accountant)
        self.generator = generator
        self.steps = 0
        self.output_edges = OutputEdges(model, form_on_arrival=True)
        self.ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.distributed = self.ddp or bool(sharded_parameters(model))  # DDP or FSDP2
        if self.ddp:
            distributed.skip_gradient_allreduce(model)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1 / self.sample_rate))

    def sample(self) -> Tensor:
        """Indices of one batch (Poisson: random size, possibly empty; fixed: ``batch_size``)."""
        if self.sampling == "poisson":
            return poisson_batch(self.dataset_size, self.sample_rate, self.generator)
        return fixed_size_batch(self.dataset_size, self.batch_size, self.generator)

    def batches(self) -> Iterator[Tensor]:
        """One epoch: ``dataset_size / batch_size`` independently sampled batches."""
        for _ in range(self.steps_per_epoch):
            yield self.sample()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.output_edges.clear()

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` without the parameter gradients, which :meth:`step` rebuilds
        clipped (about a third of the backward saved; :class:`OutputEdges`, forming per-sample
        gradients on arrival where that holds fewer numbers than the captured pair).
        ``loss.backward()`` works too. On the steps the unseen-use check runs
        (:mod:`per_sample_hooks.unseen`: the first, every new captured structure, a sample of
        the rest) and under DDP (whose reducer expects every parameter's gradient; its
        all-reduce is off), an ordinary ``loss.backward()``."""
        if self.ddp:
            self.output_edges.clear()
            loss.backward()
            return
        self.output_edges.backward(loss)

    def _parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def privatize(self, empty_batch: bool = False) -> Tensor:
        """Replace ``p.grad`` by the noisy clipped mean; return the (unclipped) per-sample norms.

        The norms are not private: log them only when that is acceptable."""
        if empty_batch and self.distributed and not self.ddp:
            raise PerSampleHooksError(
                "DPSGD.step(empty_batch=True) on an FSDP2 (fully_shard) model: every rank must "
                "run the forward and backward of its local batch (an empty one as a [0, ...] "
                "tensor) and step(), whose clipped sums are summed over the ranks layer by layer")
        if empty_batch:
            norms, actual = torch.zeros(0), 0
            for p in self._parameters():
                p.grad = torch.zeros_like(p)
            if self.distributed:  # the other ranks' clipped sums still arrive here
                actual = distributed.reduce_clipped(distributed.trainable_grads(self.model), 0,
                                                    self.loss_type)
        elif self.distributed:
            norms, actual = distributed.clip_and_reduce(self.model, self.max_grad_norm,
                                                        self.loss_type)
        else:
            norms = clip_grads(self.model, self.max_grad_norm, self.loss_type,
                               release_records=True)
            actual = len(norms)
        # clip_grads gives the clipped mean (mean loss) or sum; rescale to sum / expected size
        expected = self.batch_size * (dist.get_world_size() if self.distributed else 1)
        factor = (actual if self.loss_type == "mean" else 1) / expected
        std = self.noise_multiplier * self.max_grad_norm / expected
        params = self._parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if factor != 1:
                p.grad.mul_(factor)
        if std > 0:
            for p, noise in zip(params, self._noise(params, std)):
                p.grad.add_(noise.to(p.device))
        return norms

    def _noise(self, params: list[nn.Parameter], std: float) -> list[Tensor]:
        """One Gaussian draw per parameter from ``generator`` (under DDP: on rank 0, broadcast)."""
        if self.distributed:
            device = params[0].device if params else torch.device("cpu")
            noises = distributed.broadcast_noise([(p.shape, p.dtype) for p in params], std,
                                                 self.generator, device)
            return [like(n, p) for n, p in zip(noises, params)]  # FSDP2: this rank's shard
        return [torch.normal(0.0, std, p.shape, generator=self.generator, dtype=p.dtype,
                             device=p.device if self.generator is None
                             else self.generator.device) for p in params]

    def step(self, empty_batch: bool = False) -> Tensor:
        """Privatize the gradients of this batch, step the optimizer and the accountant.

        Pass ``empty_batch=True`` (and skip forward/backward) when Poisson sampling drew no
        sample: the step still adds noise and counts for privacy."""
        norms = self.privatize(empty_batch)
        self.output_edges.clear()
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.noise_multiplier,
                                 sample_rate=self.sample_rate)
        self.steps += 1
        return norms

    def close(self) -> None:
        """Stop recording the output edges of :meth:`backward` (the capture hooks stay: remove
        them with :func:`~per_sample_hooks.remove_hooks`)."""
        self.output_edges.remove()

    def epsilon(self, delta: float) -> float:
        """Privacy spent so far, ``epsilon`` at ``delta``, from the accountant."""
        if self.accountant is None:
            raise ValueError("DPSGD was built with accountant=None: no privacy accounting")
        return float(self.accountant.get_epsilon(delta=delta))


__all__ = ["DPSGD", "OutputEdges", "make_accountant", "noise_multiplier_for", "poisson_batch",
           "fixed_size_batch"]
