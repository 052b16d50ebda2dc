"""DP-SGD around any optimizer: sampling, per-sample clipping, Gaussian noise, accounting::

    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.1,
               max_grad_norm=1.0, dataset_size=len(x), batch_size=64)
    for epoch in range(epochs):
        for idx in dp.batches():              # Poisson-sampled indices (may be empty)
            dp.zero_grad()
            if len(idx):
                dp.backward(criterion(model(x[idx]), y[idx]))  # or loss.backward()
            dp.step()                         # an empty batch: noise only, still accounted
        print(dp.epsilon(delta=1e-5))

``data=dataset_or_loader`` (instead of ``dataset_size``) makes ``batches()`` yield collated
samples; ``target_epsilon=, target_delta=, epochs=`` (instead of ``noise_multiplier``) picks the
noise for a budget; ``batches(max_micro_batch=32)`` yields each Poisson batch in pieces (virtual
batches: ``step()`` accumulates the clipped sums and steps at the last piece).

Each step replaces the gradient by ``(sum_i c_i g_i + N(0, sigma^2 C^2 I)) / L`` (``C`` the
clipping norm, ``L`` the expected batch size) and tells the accountant. Accounting uses Opacus'
accountants (``pip install per_sample_hooks[dp]``), never a hand-written one. The privacy
guarantee of the RDP/PRV accountants holds for Poisson sampling; fixed-size sampling (a uniform
random subset of ``batch_size`` per step) is accounted as Poisson with the same rate, the usual
approximation (as in Opacus), and is not a formal guarantee. ``torch``'s generator is not a
cryptographically secure source of noise; ``secure_rng=True`` draws it from ``os.urandom``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    default_collate,
)

from . import distributed
from .api import clear_backprops
from .capture import get_state
from .clipping import AdaptiveClipping, MaxGradNorm, Thresholds, thresholds
from .edges import OutputEdges
from .errors import PerSampleHooksError
from .forms.groups import RowGrouping
from .noise import FlatBuffers, GaussianNoise, gaussian_, noise_generator
from .norms import clip_grads
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


def _sampling_device(generator: torch.Generator | None) -> torch.device:
    """Indices are drawn on the generator's device, the CPU without one (whatever torch's
    default device: CPU indices index tensors on any device)."""
    return generator.device if generator is not None else torch.device("cpu")


def poisson_batch(dataset_size: int, sample_rate: float, generator: torch.Generator | None
                  ) -> Tensor:
    """Indices of a Poisson-sampled batch: each sample independently with ``sample_rate``."""
    keep = torch.rand(dataset_size, generator=generator,
                      device=_sampling_device(generator)) < sample_rate
    return keep.nonzero().flatten()


def fixed_size_batch(dataset_size: int, batch_size: int, generator: torch.Generator | None
                     ) -> Tensor:
    """Indices of a uniformly random subset of ``batch_size`` distinct samples."""
    return torch.randperm(dataset_size, generator=generator,
                          device=_sampling_device(generator))[:batch_size]


def micro_batches(indices: Tensor, max_size: int | None) -> list[Tensor]:
    """``indices`` in consecutive pieces of at most ``max_size`` (all of it when None); an
    empty batch is one empty piece."""
    if max_size is None or len(indices) <= max_size:
        return [indices]
    return list(indices.split(max_size))




# ---------------------------------------------------------------- data

def _empty_like_collated(batch: Any) -> Any:
    """``batch`` (a collated batch) with every tensor cut to length 0 along dim 0 and every
    list of other values (collated strings, ...) emptied."""
    if isinstance(batch, Tensor) and batch.dim() > 0:
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({k: _empty_like_collated(v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if not any(isinstance(v, (Tensor, Mapping, list, tuple)) for v in batch):
            return type(batch)()
        items = [_empty_like_collated(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    kind = "a 0-dim tensor" if isinstance(batch, Tensor) else type(batch).__name__
    raise TypeError(f"DPSGD: cannot make an empty batch from the collate_fn's output ({kind}"
                    "; tensors with a batch dimension, mappings and lists are expected), which "
                    "Poisson sampling draws now and then: make collate_fn([]) return the empty "
                    "batch, use the indices of batches() without data=, or sampling='fixed'")


class SampledData:
    """The samples of a ``Dataset`` (or a ``DataLoader``'s dataset and ``collate_fn``) at given
    indices, collated; an empty batch is one sample's collation cut to length 0."""

    def __init__(self, data: Dataset | DataLoader) -> None:
        loader = data if isinstance(data, DataLoader) else None
        self.dataset = loader.dataset if loader is not None else data
        self.collate = loader.collate_fn if loader is not None else default_collate
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__len__") \
                or not hasattr(self.dataset, "__getitem__"):
            raise TypeError(f"DPSGD: data must be a map-style Dataset (with __len__ and "
                            f"__getitem__) or a DataLoader of one, got "
                            f"{type(self.dataset).__name__}")
        self._empty: Any = None

    def __len__(self) -> int:
        return len(self.dataset)

    def _empty_batch(self) -> Any:
        """``collate_fn([])`` where that works, else one sample's collation cut to length 0."""
        try:
            return self.collate([])
        except Exception:  # default_collate and most others need a sample to see the structure
            return _empty_like_collated(self.collate([self.dataset[0]]))

    def __getitem__(self, indices: Tensor) -> Any:
        if len(indices) == 0:
            if self._empty is None:
                self._empty = self._empty_batch()
            return self._empty
        if isinstance(self.dataset, TensorDataset) and self.collate is default_collate:
            return [t[indices] for t in self.dataset.tensors]  # default_collate's, at once
        return self.collate([self.dataset[i] for i in indices.tolist()])


def _data_sizes(data: Dataset | DataLoader | None, dataset_size: int | None,
                batch_size: int | None) -> tuple[SampledData | None, int, int]:
    """The sampled data (or None), the dataset size and the expected batch size."""
    source = None if data is None else SampledData(data)
    if source is not None:
        if dataset_size is not None and dataset_size != len(source):
            raise ValueError(f"DPSGD: dataset_size={dataset_size} but the data holds "
                             f"{len(source)} samples: leave dataset_size out with data=")
        dataset_size = len(source)
        if batch_size is None and isinstance(data, DataLoader):
            batch_size = data.batch_size
    if dataset_size is None or batch_size is None:
        raise ValueError("DPSGD: give dataset_size and batch_size (the expected batch size), or "
                         "data= (a Dataset, with batch_size; or a DataLoader, whose batch_size "
                         "is taken)")
    if not 0 < batch_size <= dataset_size:
        raise ValueError(f"DPSGD: need 0 < batch_size <= dataset_size, got {batch_size} and "
                         f"{dataset_size}")
    return source, dataset_size, batch_size


# ---------------------------------------------------------------- the budget

def _check_noise_multiplier(noise_multiplier: float) -> float:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0):
        raise ValueError(f"DPSGD: noise_multiplier must be a finite number >= 0, got "
                         f"{noise_multiplier!r}")
    return float(noise_multiplier)


def _noise_for_budget(target_epsilon: float, target_delta: float | None, epochs: int | None,
                      sample_rate: float, steps_per_epoch: int, accountant: Any) -> float:
    """The noise multiplier that spends ``target_epsilon`` at ``target_delta`` in ``epochs``."""
    if target_delta is None or epochs is None:
        raise ValueError("DPSGD: target_epsilon needs target_delta and epochs too")
    if not (0 < target_epsilon < math.inf and 0 < target_delta < 1 and epochs > 0):
        raise ValueError(f"DPSGD: need target_epsilon > 0, 0 < target_delta < 1 and epochs > 0, "
                         f"got {target_epsilon!r}, {target_delta!r}, {epochs!r}")
    if not isinstance(accountant, str):
        raise ValueError("DPSGD: target_epsilon picks the noise with the accountant named by "
                         "accountant= ('rdp', 'prv' or 'gdp'); with another accountant (or "
                         "None) give noise_multiplier instead (see noise_multiplier_for)")
    return noise_multiplier_for(target_epsilon, target_delta, sample_rate,
                                epochs * steps_per_epoch, accountant)


class DPSGD:
    """Differentially private training step around ``optimizer`` (any ``torch.optim``).

    ``step()`` after an ordinary backward of the sampled batch: clips each sample's gradient
    to ``max_grad_norm`` with :func:`~per_sample_hooks.clip_grads` (no per-sample gradients
    stored), adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` to the sum, divides by the
    expected batch size, steps the optimizer and the accountant. Noise goes on every trainable
    parameter of ``model``, drawn in one call per dtype into storage kept across steps. The model
    is hooked with :func:`~per_sample_hooks.add_hooks`.

    What to sample: ``dataset_size`` and ``batch_size`` (the expected batch size; the sample
    rate is their ratio), and :meth:`batches` yields indices; or ``data`` (a map-style
    ``Dataset``, or a ``DataLoader`` whose dataset, ``batch_size`` and ``collate_fn`` are
    taken; its sampler and workers are not used) and :meth:`batches` yields collated samples.

    How much noise: ``noise_multiplier``; or ``target_epsilon``, ``target_delta`` and
    ``epochs``, which pick the smallest noise multiplier spending that budget in
    ``epochs * steps_per_epoch`` steps (:func:`noise_multiplier_for`, with ``accountant``).

    The noise comes from a generator of its own, seeded from ``generator`` (torch's global one
    without it) when DPSGD is built, so that runs are reproducible from the seed; with
    ``noise_ahead`` (the default) the next step's noise is drawn on a background thread while
    the forward and backward run (:mod:`per_sample_hooks.noise`: on the CPU that hides the
    draw where a core is free). ``secure_rng=True`` draws it from ``os.urandom``
    (:func:`~per_sample_hooks.noise.secure_gaussian_`) instead: about 8x the cost of torch's
    float32 draw on CPU (2x its float64 one; ``benchmarks/noise_draw.py``), not reproducible.

    Virtual batches: :meth:`batches` with ``max_micro_batch`` yields each Poisson batch in
    pieces; :meth:`step` after each piece adds its clipped sum to the batch's and steps (noise,
    optimizer, accountant) after the last. Or, with pieces of one's own, :meth:`accumulate`
    after each piece's backward and :meth:`step` at the end. Not under DDP. A refused piece
    keeps the earlier pieces' sums (step again once it is fixed), :meth:`discard_batch` drops
    them; the trainable parameters may change between batches, not between pieces of one.

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

    Per-group (per-layer) clipping: ``max_grad_norm`` as groups of parameters with a threshold
    each (:func:`~per_sample_hooks.clip_grads`); the noise is then
    ``N(0, (noise_multiplier * sqrt(sum_k C_k^2))^2)``, ``sqrt(sum_k C_k^2)`` being the norm
    of a clipped sample's gradient at most (Opacus' ``clipping="per_layer"``), and the
    accounting is unchanged. ``adaptive_clipping``: the threshold (``max_grad_norm``, one
    number, the initial one) follows a quantile of the norms, estimated privately
    (:class:`~per_sample_hooks.clipping.AdaptiveClipping`): the gradient noise multiplier is
    raised so that gradient and count together cost ``noise_multiplier``, which is what the
    accountant is told; ``dp.max_grad_norm`` is the current threshold.

    Groups of rows (augmentation multiplicity, user-level DP): ``dataset_size`` and
    ``batch_size`` count groups (examples, users), which :meth:`batches` samples; expand each
    sampled group into its rows (``K`` augmentations, a user's records) and pass ``groups``
    to :meth:`step` (an int ``K`` or ``[rows]`` group ids, as in ``clip_grads``): each
    group's gradient, the mean of its rows', is clipped as one sample's, and the accounting
    counts groups.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_grad_norm: MaxGradNorm, noise_multiplier: float | None = None,
                 dataset_size: int | None = None, batch_size: int | None = None,
                 data: Dataset | DataLoader | None = None,
                 target_epsilon: float | None = None, target_delta: float | None = None,
                 epochs: int | None = None, sampling: Sampling = "poisson",
                 loss_type: LossType = "mean", accountant: str | Any | None = "rdp",
                 generator: torch.Generator | None = None, secure_rng: bool = False,
                 adaptive_clipping: AdaptiveClipping | None = None, noise_ahead: bool = True):
        self.thresholds = thresholds(model, max_grad_norm, "DPSGD")
        self.data, dataset_size, batch_size = _data_sizes(data, dataset_size, batch_size)
        if sampling not in ("poisson", "fixed"):
            raise ValueError(f"DPSGD: sampling must be 'poisson' or 'fixed', got {sampling!r}")
        if self.data is not None and sampling == "poisson":
            self.data[torch.zeros(0, dtype=torch.long)]  # the empty batch, refused now if need be
        if secure_rng and generator is not None:
            raise ValueError("DPSGD: secure_rng=True draws the noise from os.urandom, which "
                             "takes no generator (the generator would only sample the batches: "
                             "pass it to neither, or leave secure_rng False to reproduce runs)")
        self.model, self.optimizer = model, optimizer
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.sampling, self.loss_type = sampling, loss_type
        self.sample_rate = batch_size / dataset_size
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPSGD: give exactly one of noise_multiplier and target_epsilon "
                             "(with target_delta and epochs)")
        if target_epsilon is None and (target_delta is not None or epochs is not None):
            raise ValueError("DPSGD: target_delta and epochs go with target_epsilon (the "
                             "budget), not with noise_multiplier")
        if target_epsilon is not None:
            noise_multiplier = _noise_for_budget(target_epsilon, target_delta, epochs,
                                                 self.sample_rate, self.steps_per_epoch,
                                                 accountant)
        self.noise_multiplier = _check_noise_multiplier(noise_multiplier)
        self.target_delta = target_delta
        self.accountant = make_accountant(accountant)
        self.generator, self.secure_rng = generator, secure_rng
        self.steps = 0
        self.ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.distributed = self.ddp or bool(sharded_parameters(model))  # DDP or FSDP2
        params = self._parameters()
        self._noise = GaussianNoise(
            None if secure_rng else noise_generator(
                generator, params[0].device if params else torch.device("cpu")),
            secure_rng, ahead=noise_ahead)
        self._sums = FlatBuffers()
        self._accumulated = 0  # micro-batches in self._sums since the last optimizer step
        self._batch_parameters: list[nn.Parameter] = []  # trainable at the batch's first piece
        self._pieces_left = 0  # pieces of the current batch from batches() after this one
        self._last_batch_empty = False  # the last batch batches() yielded had no sample
        self.adaptive_clipping = adaptive_clipping
        self.gradient_noise_multiplier = self.noise_multiplier
        self._unclipped = 0  # samples (groups) of this batch within the threshold, adaptive
        if adaptive_clipping is not None:
            if self.thresholds.group_of is not None or self.distributed:
                raise ValueError("DPSGD: adaptive_clipping needs one max_grad_norm (not groups "
                                 "of parameters) and a single process (not DDP)")
            self.gradient_noise_multiplier = adaptive_clipping.gradient_noise_multiplier(
                self.noise_multiplier, batch_size)
        # the model changed last, once every argument is accepted (a refusal leaves it as it was)
        self.output_edges = OutputEdges(model, form_on_arrival=True)
        self.zeroed: object = None  # the step status zero_grad() dropped the records of
        if self.ddp:
            distributed.skip_gradient_allreduce(model)

    @property
    def max_grad_norm(self) -> float | tuple[float, ...]:
        """The clipping threshold (now, under adaptive clipping), or those of the groups."""
        values = self.thresholds.values
        return values[0] if self.thresholds.group_of is None else values

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1 / self.sample_rate))

    @property
    def last_micro_batch(self) -> bool:
        """Whether :meth:`step` after the batch just taken from :meth:`batches` steps the
        optimizer (True unless more pieces of its Poisson batch follow)."""
        return self._pieces_left == 0

    def sample(self) -> Tensor:
        """Indices of one batch (Poisson: random size, possibly empty; fixed: ``batch_size``)."""
        if self.sampling == "poisson":
            return poisson_batch(self.dataset_size, self.sample_rate, self.generator)
        return fixed_size_batch(self.dataset_size, self.batch_size, self.generator)

    def batches(self, max_micro_batch: int | None = None) -> Iterator[Any]:
        """One epoch: ``dataset_size / batch_size`` independently sampled batches, as indices
        or, with ``data``, collated samples (an empty batch: tensors of length 0).

        ``max_micro_batch``: each batch in consecutive pieces of at most that many samples
        (virtual batches); call :meth:`step` after each piece's backward, as without: it adds
        the piece's clipped sum to the batch's, and at the last piece
        (:attr:`last_micro_batch`) adds the noise and steps. An empty batch is one empty
        piece."""
        if max_micro_batch is not None:
            if not (isinstance(max_micro_batch, int) and max_micro_batch > 0):
                raise ValueError(f"DPSGD.batches: max_micro_batch must be an int > 0, got "
                                 f"{max_micro_batch!r}")
            self._refuse_distributed_accumulation()
        try:
            for _ in range(self.steps_per_epoch):
                if self._accumulated:
                    raise PerSampleHooksError(
                        "DPSGD.batches: the last batch's pieces were accumulated but never "
                        "stepped: call dp.step() after the backward of every piece, or "
                        "dp.discard_batch() to drop them (after a refused piece)")
                indices = self.sample()
                pieces = micro_batches(indices, max_micro_batch)
                self._last_batch_empty = len(indices) == 0
                for k, piece in enumerate(pieces):
                    self._pieces_left = len(pieces) - 1 - k
                    yield piece if self.data is None else self.data[piece]
        finally:
            self._pieces_left, self._last_batch_empty = 0, False

    def zero_grad(self) -> None:
        """The optimizer's ``zero_grad(set_to_none=True)``; forgets the outputs recorded for
        :meth:`backward` (an unused forward's; between forward and backward, the backward is
        then an ordinary one), and the records of a backward no step took (a GAN's generator
        step through the private discriminator, ``D(G(z))``: the next batch starts clean, as
        Opacus' ``zero_grad`` drops its per-sample gradients)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.output_edges.clear()
        state = get_state(self.model)
        if state.status.backward_seen and not state.status.consumed:
            clear_backprops(self.model)
            self.zeroed = state.status  # (a step() with no forward since: told so)

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

    def _empty_batch(self, empty_batch: bool | None) -> bool:
        return self._last_batch_empty if empty_batch is None else empty_batch

    @torch.no_grad()
    def _clip(self, empty_batch: bool, groups: RowGrouping | None = None
              ) -> tuple[Tensor, float]:
        """Clip this (micro-)batch (its groups of rows with ``groups``): ``p.grad * scale``
        becomes its clipped sum (over every rank under DDP). Returns the (unclipped) local
        norms and ``scale``."""
        if empty_batch and self.distributed and not self.ddp:  # FSDP2: sums layer by layer
            if not self._backward_pending():
                raise PerSampleHooksError(
                    "DPSGD.step on an FSDP2 (fully_shard) model: every rank must run the "
                    "forward and backward of its local batch, an empty one included (a "
                    "[0, ...] tensor), before step(): the clipped sums are summed over the "
                    "ranks layer by layer")
            empty_batch = False  # the empty backward's zeros go through clip_grads
        if empty_batch:
            clear_backprops(self.model)  # a backward of the empty batch, if any, is spent
            norms, actual = torch.zeros(0), 0
            for p in self._parameters():
                p.grad = torch.zeros_like(p)
            if self.distributed:  # the other ranks' clipped sums still arrive here
                actual = distributed.reduce_clipped(distributed.trainable_grads(self.model), 0,
                                                    self.loss_type)
        else:
            if get_state(self.model).status is self.zeroed:
                raise PerSampleHooksError(
                    "DPSGD: dp.zero_grad() ran after this batch's backward and dropped its "
                    "records (it starts a batch: call it before the forward). Run the "
                    "forward and backward again")
            if get_state(self.model).status.released_by is not None:
                raise PerSampleHooksError(
                    "DPSGD: no forward and backward ran since the last step, whose clipping "
                    "used its captured tensors. A Poisson batch that drew no sample (the "
                    "forward and backward skipped) takes step(empty_batch=True): it adds the "
                    "noise alone and counts the step (dp.batches() tells the step itself)")
            try:
                if self.distributed:
                    norms, actual = distributed.clip_and_reduce(self.model, self.thresholds,
                                                                self.loss_type, groups=groups)
                else:
                    norms = clip_grads(self.model, self.thresholds, self.loss_type,
                                       groups=groups, release_records=True)
                    actual = len(norms)
            except PerSampleHooksError as error:  # named as the call the user made
                raise type(error)(re.sub(r"^(distributed\.)?clip_grads:", "DPSGD:",
                                         str(error))) from error
        if self.adaptive_clipping is not None:
            self._unclipped += int((norms <= self.thresholds.values[0]).sum())
        for p in self._parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # clip_grads gives the clipped mean (mean loss) or sum
        return norms, float(actual) if self.loss_type == "mean" else 1.0

    def _refuse_distributed_accumulation(self) -> None:
        if self.distributed:
            raise PerSampleHooksError(
                "DPSGD: virtual batches (max_micro_batch, accumulate) are not supported with "
                "DistributedDataParallel or FSDP2 (fully_shard): each rank's Poisson batch "
                "would split into a different number of pieces, and every piece needs every "
                "rank. Use a smaller batch_size per rank, or more ranks")

    def _backward_pending(self) -> bool:
        """A backward since the last clipping (or a step that began without one)."""
        state = get_state(self.model)
        return state.status.backward_seen and not state.status.consumed

    def discard_batch(self) -> None:
        """Drop the current batch: the pieces accumulated so far and what the hooks recorded
        since (after a refused piece, or to give up a virtual batch); the next piece starts a
        new batch. Nothing of it was released, so nothing is accounted."""
        self._accumulated, self._batch_parameters = 0, []
        self._drop_piece()

    def _drop_piece(self) -> None:
        """Drop what the hooks recorded since the last piece (its forward and backward)."""
        self.output_edges.clear()
        clear_backprops(self.model)

    def _refuse_changed_parameters(self, caller: str) -> None:
        """Refuse a piece whose trainable parameters are not those of the batch's first."""
        params = self._parameters()
        if self._accumulated and self._batch_parameters != params:
            before, now = set(self._batch_parameters), set(params)
            changed = [f"'{name}' ({'frozen' if p in before else 'unfrozen'})"
                       for name, p in self.model.named_parameters() if (p in before) != (p in now)]
            self._drop_piece()  # run again, it starts clean
            raise PerSampleHooksError(
                f"DPSGD.{caller}: the trainable parameters changed between pieces of one batch "
                f"({', '.join(changed) or 'their order'}): the batch's clipped sums are kept "
                "for the parameters of its first piece. This piece is dropped: run its "
                "forward and backward again with the parameters of the first piece trainable, "
                f"then {caller}() (the {self._accumulated} earlier pieces stay accumulated); "
                "freeze or unfreeze between batches (after the step that ends one), or "
                "dp.discard_batch() to drop this batch's pieces")

    @contextmanager
    def _keeping_pieces(self) -> Iterator[None]:
        """A refusal while pieces are accumulated says that they are kept."""
        try:
            yield
        except PerSampleHooksError as error:
            if not self._accumulated:
                raise
            raise PerSampleHooksError(
                f"{error}. (The clipped sums of this batch's earlier pieces, "
                f"{self._accumulated}, stay accumulated: run this piece again once it is "
                "fixed, or dp.discard_batch() to drop them)") from error

    @torch.no_grad()
    def accumulate(self, empty_batch: bool | None = None, groups: RowGrouping | None = None
                   ) -> Tensor:
        """Clip this micro-batch and add its clipped sum to the current batch's, without
        stepping (:meth:`step` ends the batch). Returns the micro-batch's unclipped norms."""
        self._refuse_distributed_accumulation()
        self._refuse_changed_parameters("accumulate")
        with self._keeping_pieces():
            norms, scale = self._clip(self._empty_batch(empty_batch), groups)
        params = self._parameters()
        sums = self._sums.like(params)
        if not self._accumulated:
            self._batch_parameters = params
            for flat in self._sums.flats.values():
                flat.zero_()
        if scale:
            for total, p in zip(sums, params):
                total.add_(p.grad, alpha=scale)
        self._accumulated += 1
        self.output_edges.clear()
        return norms

    @torch.no_grad()
    def privatize(self, empty_batch: bool | None = None, groups: RowGrouping | None = None
                  ) -> Tensor:
        """Replace ``p.grad`` by the noisy clipped mean of the batch (of its micro-batches added
        by :meth:`accumulate`, and of the backward since, if any); return the (unclipped)
        per-sample norms of the last (micro-)batch.

        The norms are not private: log them only when that is acceptable."""
        empty_batch = self._empty_batch(empty_batch)
        params = self._parameters()
        if self._accumulated:
            pending = empty_batch or self._backward_pending()
            if not pending and get_state(self.model).status is self.zeroed:
                raise PerSampleHooksError(
                    "DPSGD: dp.zero_grad() ran after this piece's backward and dropped its "
                    "records (it starts a piece: call it before the forward); the earlier "
                    "pieces' sums are kept. Run this piece's forward and backward again, then "
                    "step")
            self._refuse_changed_parameters("step")
            norms = self.accumulate(empty_batch, groups) if pending else torch.zeros(0)
            for p, total in zip(params, self._sums.like(params)):
                p.grad = total.clone() if p.grad is None or p.grad.is_sparse else \
                    p.grad.copy_(total)
            scale, self._accumulated, self._batch_parameters = 1.0, 0, []
        else:
            norms, scale = self._clip(empty_batch, groups)
        for p in params:  # a checked step's Embedding(sparse=True): dense, as on the others
            if p.grad.is_sparse:  # (and the noise is on every row)
                p.grad = p.grad.to_dense()
        expected = self.batch_size * (dist.get_world_size() if self.distributed else 1)
        if scale != expected:
            for p in params:
                p.grad.mul_(scale / expected)
        self._add_noise(params, self.gradient_noise_multiplier * self.thresholds.sensitivity
                        / expected)
        return norms

    def _add_noise(self, params: list[nn.Parameter], std: float) -> None:
        """``p.grad += std * N(0, 1)``: one draw per dtype into storage kept across steps, made
        ahead during this step (:class:`~per_sample_hooks.noise.GaussianNoise`); under DDP
        drawn on rank 0 and broadcast."""
        if std <= 0:
            return
        drawing = not self.distributed or dist.get_rank() == 0
        noise = self._noise.draw(params) if drawing else self._noise.buffers.like(params)
        if self.distributed:
            for flat in self._noise.buffers.flats.values():
                dist.broadcast(flat, src=0)
        for p, n in zip(params, noise):  # FSDP2: this rank's shard of the full draw
            p.grad.add_(like(n, p), alpha=std)
        if drawing:
            self._noise.draw_ahead()

    def _adapt_threshold(self) -> None:
        """Adaptive clipping: the next threshold from this batch's noisy count of samples
        within the threshold (the noise drawn as the gradient's)."""
        noise = torch.zeros(1, dtype=torch.float64)
        std = self.adaptive_clipping.count_noise(self.batch_size)
        if std > 0:
            gaussian_(noise, std, self.generator, self.secure_rng)
        threshold = self.adaptive_clipping.update(self.thresholds.values[0],
                                                  self._unclipped + float(noise),
                                                  self.batch_size)
        self.thresholds, self._unclipped = Thresholds((threshold,)), 0

    def step(self, empty_batch: bool | None = None, groups: RowGrouping | None = None
             ) -> Tensor:
        """Privatize the gradients of this batch, step the optimizer and the accountant (and
        the adaptive threshold); after a piece of a batch from ``batches(max_micro_batch=)``
        other than its last, only :meth:`accumulate`. Returns the (unclipped) per-sample norms
        of this (micro-)batch (per group with ``groups``: the batch's rows in groups, see the
        class).

        An empty batch (Poisson sampling drew no sample; forward and backward skipped) still
        adds noise and counts for privacy: ``empty_batch`` says so, by default whether the last
        batch from :meth:`batches` was empty (False when :meth:`batches` is not used)."""
        if self._pieces_left:
            return self.accumulate(empty_batch, groups)
        syncing = getattr(getattr(self.optimizer, "gradient_state", None), "sync_gradients", True)
        if not syncing:  # accelerate's optimizer inside accelerator.accumulate(model)
            raise PerSampleHooksError(
                "DPSGD.step: the optimizer is accelerate's, on a micro-batch that "
                "accelerator.accumulate() does not sync (gradient_accumulation_steps > 1): its "
                "step() would do nothing, and this micro-batch would be privatized alone, the "
                "earlier ones dropped, and counted as a step. Add micro-batches with "
                "dp.accumulate() and step on the last: `dp.step() if accelerator.sync_gradients "
                "else dp.accumulate()` (nothing was changed: call it now)")
        norms = self.privatize(empty_batch, groups)
        if self.adaptive_clipping is not None:
            self._adapt_threshold()
        self.output_edges.clear()
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.noise_multiplier,
                                 sample_rate=self.sample_rate)
        self.steps += 1
        return norms

    def close(self) -> None:
        """Stop recording the output edges of :meth:`backward` and drawing noise ahead (the
        capture hooks stay: remove them with :func:`~per_sample_hooks.remove_hooks`)."""
        self.output_edges.remove()
        self._noise.close()

    def state_dict(self) -> dict[str, Any]:
        """What resuming the run needs besides the model's and the optimizer's state dicts:
        the steps taken, the accountant's state (the privacy spent so far), the adaptive
        threshold, and the generators' states (the noise's; the sampling's, when ``generator``
        was given), so that a run saved and resumed with :meth:`load_state_dict` steps as the
        run would have (``torch.save``-able; ``torch.load(weights_only=True)`` loads it).
        Between steps only: not while pieces of a batch are accumulated."""
        if self._accumulated or self._pieces_left:
            raise PerSampleHooksError(
                "DPSGD.state_dict: a batch is under way (pieces accumulated, or more pieces "
                "of it to come from batches()): save after the step() that ends it, or after "
                "dp.discard_batch()")
        state: dict[str, Any] = {"steps": self.steps}
        if self.accountant is not None:
            if not callable(getattr(self.accountant, "state_dict", None)):
                raise PerSampleHooksError(
                    f"DPSGD.state_dict: the accountant ({type(self.accountant).__name__}) has "
                    f"no state_dict(), so the privacy spent so far could not be restored; use "
                    f"one of Opacus' accountants ('rdp', 'prv', 'gdp')")
            state["accountant"] = self.accountant.state_dict()
        if self.adaptive_clipping is not None:
            state["max_grad_norm"] = self.thresholds.values[0]
        noise_state = self._noise.generator_state()
        if noise_state is not None:
            state["noise_generator"] = noise_state
        if self.generator is not None:
            state["sampling_generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a ``DPSGD`` built with the same arguments (the
        noise multiplier may differ: the accountant's history holds each step's)."""
        if self._accumulated or self._pieces_left:
            raise PerSampleHooksError(
                "DPSGD.load_state_dict: a batch is under way here: load before the first "
                "batch, or after a step()")
        for key, here, what in (
                ("accountant", self.accountant is not None, "an accountant"),
                ("max_grad_norm", self.adaptive_clipping is not None, "adaptive clipping"),
                ("sampling_generator", self.generator is not None, "a generator")):
            if (key in state) != here:
                saved, built = ("with", "without") if key in state else ("without", "with")
                raise PerSampleHooksError(
                    f"DPSGD.load_state_dict: the state was saved by a DPSGD {saved} {what}, "
                    f"this one was built {built}: build it as the saved one was")
        if self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
        if self.adaptive_clipping is not None:
            self.thresholds = Thresholds((float(state["max_grad_norm"]),))
        if "noise_generator" in state and self._noise.generator is not None:
            self._noise.set_generator_state(state["noise_generator"])
        if self.generator is not None:
            self.generator.set_state(state["sampling_generator"])
        self.steps = int(state["steps"])

    def epsilon(self, delta: float | None = None) -> float:
        """Privacy spent so far, ``epsilon`` at ``delta`` (by default ``target_delta``), from
        the accountant."""
        if self.accountant is None:
            raise ValueError("DPSGD was built with accountant=None: no privacy accounting")
        if delta is None:
            if self.target_delta is None:
                raise ValueError("DPSGD.epsilon: give delta (there is no target_delta)")
            delta = self.target_delta
        return float(self.accountant.get_epsilon(delta=delta))


__all__ = ["DPSGD", "OutputEdges", "make_accountant", "noise_multiplier_for", "poisson_batch",
           "fixed_size_batch", "micro_batches", "SampledData"]
