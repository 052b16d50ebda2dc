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
        psh.distributed.clip_grads(ddp, max_norm=1.0)   # clip locally, ONE all-reduce
        optimizer.step()                            # every rank: the same gradient

``clip_grads`` leaves on every rank the clipped mean (or sum) over the global batch, exactly
what one process gets from ``per_sample_hooks.clip_grads`` on the concatenated batch:
``(1 / B_global) sum_i c_i g_i`` for ``loss_type="mean"`` (local batches may differ in size).
Instead of ``skip_gradient_allreduce`` a backward inside ``ddp.no_sync()`` (forward included)
works too; without either, DDP's all-reduce runs and its result is overwritten (correct but
wasted). Noise for DP-SGD must be the same on every rank (a generator seeded alike) or added
on one rank before the all-reduce; the privacy accounting sees the global batch.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .api import LossType
from .capture import unwrap
from .errors import PerSampleHooksError
from .norms import clip_grads as clip_grads_local


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
    dtype = tensors[0].dtype if tensors else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    flat = torch.cat([t.reshape(-1).to(dtype) * weight for t in tensors]
                     + [torch.tensor([float(weight)], dtype=dtype, device=device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    total = float(flat[-1])
    if total > 0:
        flat[:-1].div_(total)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return total


@torch.no_grad()
def clip_grads(model: nn.Module, max_norm: float, loss_type: LossType = "mean",
               group: dist.ProcessGroup | None = None) -> Tensor:
    """DP clipping over the global batch: on every rank ``p.grad`` becomes the clipped mean
    (``loss_type="mean"``) or sum over all ranks' samples, as one process would get on the
    concatenated batch. Each rank clips its own samples (:func:`per_sample_hooks.clip_grads`),
    then one all-reduce of the clipped sums (and the batch sizes). Returns the local
    (unclipped) norms ``[B_local]``."""
    _check_initialized("distributed.clip_grads")
    norms = clip_grads_local(model, max_norm, loss_type)
    local = len(norms)
    grads = []
    for p in _trainable(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if loss_type == "mean":  # local clipped mean -> weighted by the local batch size
        all_reduce_weighted_mean(grads, local, group)
    else:
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return norms


__all__ = ["skip_gradient_allreduce", "clip_grads", "all_reduce_weighted_mean"]
