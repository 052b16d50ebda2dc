"""Per-sample quantities and DP-SGD clipping with ``torch.distributed`` (DistributedDataParallel).

Per-sample gradients and norms need nothing special: hook the DDP model (``add_hooks(ddp)``
hooks the module it wraps) and each rank gets the rows of its own samples.

DP-SGD clips each sample's gradient before anything is summed, so DDP's all-reduce of the
*unclipped* gradients is useless work. The pattern, on every rank, with a local batch of any
size::

    ddp = DistributedDataParallel(model)
    psh.add_hooks(ddp)
    psh.distributed.skip_gradient_allreduce(ddp)     # once: DDP's backward communicates nothing
    for x, y in loader:                             # each rank: its own shard
        optimizer.zero_grad(set_to_none=True)
        criterion(ddp(x), y).backward()             # local mean loss
        psh.distributed.clip_grads(ddp, max_grad_norm=1.0)  # clip locally, ONE all-reduce
        optimizer.step()                            # every rank: the same gradient

``clip_grads`` leaves on every rank the clipped mean (or sum) over the global batch, exactly
what one process gets from ``per_sample_hooks.clip_grads`` on the concatenated batch:
``(1 / B_global) sum_i c_i g_i`` for ``loss_type="mean"`` (local batches may differ in size;
a rank with an empty batch still runs forward, backward and ``clip_grads`` on a ``[0, ...]``
batch: DDP and the all-reduce need every rank). A step ``clip_grads`` refuses on one rank (a
layout of that rank's data) is refused on every rank, in the same all-reduce: none is left
waiting in it (under FSDP2, whose clipping communicates layer by layer, in one all-reduce
before the first layer's).
Instead of ``skip_gradient_allreduce`` a backward inside ``ddp.no_sync()`` (forward included)
works too; without either, DDP's all-reduce runs and its result is overwritten (correct but
wasted; a module some rank did not call, with ``find_unused_parameters`` or ``static_graph``,
is refused there, its ``.grad`` possibly another rank's). Noise for DP-SGD must be the same
on every rank (a generator seeded alike) or added on one rank before the all-reduce; the
privacy accounting sees the global batch.

KFAC factors computed on each rank's shard are averaged with :func:`all_reduce_kfac` (one flat
all-reduce, weighted by the local batch sizes), after which every rank holds the factors of the
global batch. A rank with an empty batch calls both too: its ``compute_kfac`` gives zero
factors of ``batch_size`` 0 (in one process an empty batch is refused).

Several machines: the functions here only need an initialized default process group, so any
launcher works. With ``torchrun``, the same script on every machine (2 machines, 4 processes
each; ``gloo`` on CPU, ``nccl`` on GPUs)::

    # on machine 0 (its address 10.0.0.1 reachable from the others), then on machine 1 with
    # --node_rank=1; torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 \
             --rdzv_backend=c10d --rdzv_endpoint=10.0.0.1:29500 train.py

    # train.py
    dist.init_process_group("gloo")                 # reads the variables torchrun set
    sampler = DistributedSampler(dataset)           # each rank: its own shard
    ddp = DistributedDataParallel(model)            # device_ids=[LOCAL_RANK] on GPUs
    ... the loop above ...

**FSDP2** (``torch.distributed.fsdp.fully_shard``: each parameter a DTensor sharded on dim 0,
full only inside the forward and backward). Hook the sharded model with
``add_hooks(model, check_unseen=False)`` (the unseen-use check cannot see FSDP2's gradients:
run it once on the unsharded model). Per-sample gradients, norms and KFAC factors are plain
full-shape tensors of each rank's own samples, as under DDP (KFAC: :func:`all_reduce_kfac`).
``clip_grads`` (this module's or :func:`per_sample_hooks.clip_grads`) leaves each rank's
``p.grad`` as its shard of the clipped mean over the global batch: each layer's clipped sum is
summed over the mesh (one all-reduce per layer, the full gradient of one layer at a time) and
cut to the shard. FSDP2's own reduce-scatter of the unclipped gradient is wasted work that is
overwritten; ``DPSGD`` avoids it with its output-edge backward (no parameter gradient, so FSDP2
reduces nothing; measured in ``benchmarks/distributed.py``). ``set_requires_gradient_sync(False)``
is not the way: FSDP2 then keeps the full unsharded gradients between steps. Layers whose rule
reads the parameter values (the torch.func fallback, attention, recurrent layers) get them
all-gathered by ``compute_grad1``, ``compute_norms``, ``clip_grads`` and ``compute_kfac`` for
the length of the call (:func:`per_sample_hooks.sharded.with_full_values`; the other
``compute_*`` refuse them), as long as ``fully_shard`` was applied to a module containing
them (their transformer block), not to them: FSDP2's hooks would spoil the re-run (refused
with a clear error). Parameters left out of the sharding (``ignored_params``) are whole on
every rank; their clipped sums are all-reduced here. Every rank runs every step's forward,
backward and ``clip_grads`` (which communicates), and, with such layers, every
``compute_*`` call, an empty local batch included::

    mesh = init_device_mesh("cpu", (world_size,))          # "cuda" on GPUs
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    psh.add_hooks(model, check_unseen=False)
    dp = psh.DPSGD(model, optimizer, ..., dataset_size=len(my_shard), batch_size=per_rank)

On one machine ``torchrun --standalone --nproc_per_node=2 train.py``;
``examples/dp_distributed.py`` is such a script (``--fsdp`` for FSDP2). The tests
(``tests/test_distributed.py``) start 2 processes with ``torch.multiprocessing`` and a file
rendezvous instead, loopback only.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .api import LossType
from .capture import unwrap
from .clipping import MaxGradNorm, threshold_argument
from .curvature import KFACFactors
from .errors import PerSampleHooksError
from .forms.groups import RowGrouping
from .norms import clip_grads_of_rank
from .sharded import ANOTHER_RANK_REFUSED, is_sharded


def _no_communication(state, bucket):  # noqa: ANN001 - DDP checks real (not string) annotations
    """DDP comm hook (``state``, ``dist.GradBucket`` -> ``Future[Tensor]``) that leaves each
    bucket's local gradients as they are."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def skip_gradient_allreduce(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Make ``ddp``'s backward communicate nothing (a comm hook that keeps local gradients):
    :func:`clip_grads` all-reduces the clipped sums instead. Call once, before the first
    backward; after it ``p.grad`` holds each rank's local gradient until ``clip_grads``."""
    if not isinstance(ddp, nn.parallel.DistributedDataParallel):
        raise TypeError(f"skip_gradient_allreduce expects a DistributedDataParallel model, got "
                        f"{type(ddp).__name__}")
    ddp.register_comm_hook(None, _no_communication)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in unwrap(model).parameters() if p.requires_grad]


def _check_initialized(caller: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise PerSampleHooksError(
            f"{caller}: torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first (or use the single-process function)")


def all_reduce_weighted_mean(tensors: Iterable[Tensor], weight: float,
                             group: dist.ProcessGroup | None = None) -> float:
    """In place on every rank: ``t <- sum_r weight_r t_r / sum_r weight_r`` for each tensor, in
    one all-reduce of one flat buffer. Returns ``sum_r weight_r`` (e.g. the global batch size
    when ``weight`` is the local one). For KFAC factors, norms statistics, any average over
    samples held per rank."""
    _check_initialized("all_reduce_weighted_mean")
    tensors = list(tensors)
    return sum_across_ranks(tensors, weight, float(weight), divide=True, group=group)


def sum_across_ranks(tensors: list[Tensor], weight: float, count: float, divide: bool,
                     group: dist.ProcessGroup | None = None, refused: bool = False) -> float:
    """One all-reduce, in place: every tensor becomes the sum over ranks of ``weight * t``,
    divided by the summed ``count`` when ``divide`` (and that sum is positive). Returns the
    summed ``count``. ``refused``: this rank refused the step (``weight`` 0); on every other
    rank the step is refused too (raises), none left waiting in a collective."""
    dtype = tensors[0].dtype if tensors else torch.float64
    device = tensors[0].device if tensors else torch.device("cpu")
    flat = torch.cat([t.reshape(-1).to(dtype) * weight for t in tensors]
                     + [torch.tensor([count, float(refused)], dtype=dtype, device=device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if float(flat[-1]) > 0 and not refused:
        raise PerSampleHooksError(ANOTHER_RANK_REFUSED)
    flat = flat[:-1]
    total = float(flat[-1])
    if divide and total > 0:
        flat[:-1].div_(total)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return total


@torch.no_grad()
def all_reduce_kfac(factors: Mapping[nn.Module, tuple[Tensor, Tensor]],
                    batch_size: int | None = None, group: dist.ProcessGroup | None = None
                    ) -> Mapping[nn.Module, tuple[Tensor, Tensor]]:
    """Average KFAC factors ``{module: (A, G)}`` over ranks, in place, in one flat all-reduce;
    of a :class:`~per_sample_hooks.curvature.KFACFactors`, its Embedding factors and
    curvature diagonals too.

    Every rank must pass the factors of the same modules in the same order (as
    ``compute_kfac`` returns them for the same model), an empty batch's zeros included. The
    average is weighted by ``batch_size`` (the local batch size; by default a
    :class:`~per_sample_hooks.curvature.KFACFactors`' own ``batch_size``): the factors of the
    global batch when local batches differ in size (an Embedding's ``expand`` ``a`` when every
    sample has as many tokens: it is a share of the tokens, which padding makes differ). A
    plain mapping without ``batch_size``: every rank weighs the same. Returns ``factors``."""
    _check_initialized("all_reduce_kfac")
    if isinstance(factors, KFACFactors):
        tensors = factors.tensors()
        if batch_size is None:
            batch_size = factors.batch_size
    else:
        tensors = [t for pair in factors.values() for t in pair]
    if tensors:
        all_reduce_weighted_mean(tensors, 1 if batch_size is None else batch_size, group)
    return factors


def reduce_clipped(grads: list[Tensor], local_batch: int, loss_type: LossType,
                   group: dist.ProcessGroup | None = None) -> int:
    """In place on every rank, one all-reduce: each rank's clipped mean (``loss_type="mean"``,
    weighted by ``local_batch``) or clipped sum becomes the global one. Returns the global batch
    size. A rank with an empty batch passes zero gradients and ``local_batch=0``."""
    mean = loss_type == "mean"
    total = sum_across_ranks(grads, float(local_batch) if mean else 1.0, float(local_batch),
                             divide=mean, group=group)
    return int(round(total))


def trainable_grads(model: nn.Module) -> list[Tensor]:
    """``p.grad`` of every trainable parameter (zeros where there is none), in model order;
    not of the sharded (FSDP2) ones, whose clipped sums ``clip_grads`` sums over the ranks
    itself."""
    grads = []
    for p in _trainable(model):
        if is_sharded(p):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:  # (Embedding(sparse=True)): summed over the ranks densely
            p.grad = p.grad.to_dense()
        grads.append(p.grad)
    return grads


@torch.no_grad()
def clip_and_reduce(model: nn.Module, max_grad_norm: MaxGradNorm, loss_type: LossType = "mean",
                    group: dist.ProcessGroup | None = None, *,
                    groups: RowGrouping | None = None) -> tuple[Tensor, int]:
    """:func:`clip_grads`, also returning the global batch size (of groups, with ``groups``)."""
    _check_initialized("distributed.clip_grads")
    try:
        norms = clip_grads_of_rank(model, max_grad_norm, loss_type, groups=groups)
    except (PerSampleHooksError, ValueError, TypeError):
        if not any(is_sharded(p) for p in _trainable(model)):  # (FSDP2: per-layer collectives)
            sum_across_ranks(trainable_grads(model), 0.0, 0.0, divide=False, group=group,
                             refused=True)
        raise
    total = reduce_clipped(trainable_grads(model), len(norms), loss_type, group)
    return norms, total


def clip_grads(model: nn.Module, max_grad_norm: MaxGradNorm | None = None,
               loss_type: LossType = "mean", group: dist.ProcessGroup | None = None, *,
               groups: RowGrouping | None = None, max_norm: float | None = None) -> Tensor:
    """DP clipping over the global batch: on every rank ``p.grad`` becomes the clipped mean
    (``loss_type="mean"``) or sum over all ranks' samples, as one process would get on the
    concatenated batch. Each rank clips its own samples (:func:`per_sample_hooks.clip_grads`,
    whose ``max_grad_norm`` and ``groups`` this takes; ``max_norm`` is the deprecated name of
    ``max_grad_norm``), then one all-reduce of the clipped sums and the batch sizes. Returns
    the local (unclipped) norms ``[B_local]``.

    On an FSDP2 (``fully_shard``) model each rank's ``p.grad`` becomes its shard of that
    gradient: :func:`per_sample_hooks.clip_grads` already sums each layer's clipped sum over
    the ranks (one all-reduce per layer, over the parameters' device mesh, not ``group``) as
    it writes it; here one more all-reduce gives the global batch size."""
    max_grad_norm = threshold_argument(max_grad_norm, max_norm, "distributed.clip_grads")
    return clip_and_reduce(model, max_grad_norm, loss_type, group, groups=groups)[0]


def broadcast_noise(shapes: list[tuple[torch.Size, torch.dtype]], std: float,
                    generator: torch.Generator | None, device: torch.device,
                    group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Gaussian noise drawn on rank 0 (one draw per shape, in order, from ``generator``) and
    broadcast, so that every rank adds the same noise. One broadcast."""
    _check_initialized("broadcast_noise")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank() == src:
        gen_device = device if generator is None else generator.device
        noises = [torch.normal(0.0, std, shape, generator=generator, dtype=dtype,
                               device=gen_device).to(device) for shape, dtype in shapes]
    else:
        noises = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    if not noises:
        return noises
    dtypes = {n.dtype for n in noises}  # one broadcast, in float64 only for mixed dtypes
    common = dtypes.pop() if len(dtypes) == 1 else torch.float64
    flat = torch.cat([n.reshape(-1).to(common) for n in noises])
    dist.broadcast(flat, src=src, group=group)
    offset, out = 0, []
    for n in noises:
        out.append(flat[offset:offset + n.numel()].view(n.shape).to(n.dtype))
        offset += n.numel()
    return out


__all__ = ["skip_gradient_allreduce", "clip_grads", "clip_and_reduce", "reduce_clipped",
           "all_reduce_weighted_mean", "all_reduce_kfac", "broadcast_noise", "trainable_grads"]
