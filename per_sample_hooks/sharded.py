"""Parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): where DTensors meet
the library.

FSDP2 registers each parameter as a ``DTensor`` sharded over a device mesh (``Shard(0)`` by
default) and swaps in the unsharded full tensor for the module's forward and backward only.
So everything the hooks capture (inputs, output gradients) and everything the rules compute
from them (per-sample gradients, norms, KFAC factors) is a plain full-shape tensor of the
rank's own samples: per-sample gradients and norms of the local samples are complete on each
rank, nothing is communicated for them. Only a *sum over samples* written to ``p.grad`` (the
clipped sum of :func:`~per_sample_hooks.clip_grads`) meets the DTensor: the gradient of a
sharded parameter can only be the shard of the global batch's gradient, so it is summed over
the ranks of the mesh and cut to this rank's shard (:class:`ShardedGrads`), one parameter
group (one layer) at a time, so that no rank holds the full gradient of the whole model.
Rules that read parameter values (a re-run of the layer) get the full parameters for the
length of a ``compute_*`` call (:func:`with_full_values`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .capture import STATE_ATTRIBUTE, HookState, unwrap
from .errors import PerSampleHooksError

try:  # torch.distributed may be built without DTensor support or FSDP2
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = FSDPModule = None


def is_sharded(p: Tensor) -> bool:
    """Whether ``p`` is a DTensor (a parameter of an FSDP2 ``fully_shard`` module)."""
    return DTensor is not None and isinstance(p, DTensor)


def contains_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` or a descendant is an FSDP2 unit (``fully_shard`` was applied to it):
    calling it runs FSDP2's hooks, which swap in their own unsharded parameters."""
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in module.modules())


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable DTensor parameters of ``model``, in model order."""
    return [p for p in model.parameters() if p.requires_grad and is_sharded(p)]


def several_ranks() -> bool:
    """Whether this process is one of several ranks of an initialized ``torch.distributed``."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def mesh_all_reduce(t: Tensor, mesh: object) -> None:
    """In place: ``t`` summed over every rank of the device ``mesh`` (each mesh dimension in
    turn: a 2-D HSDP mesh sums over replicas and shards)."""
    for dim in range(mesh.ndim):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))


def like(full: Tensor, p: Tensor) -> Tensor:
    """``full`` (``p``'s global shape, the same on every rank) in ``p``'s layout: this rank's
    shard as a DTensor for a sharded ``p`` (its local tensor a view of ``full`` where the
    layout allows; no communication), ``full`` itself otherwise."""
    if not is_sharded(p):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _value_readers(state: HookState) -> dict[int, tuple[Tensor, list[tuple[nn.Module, str]]]]:
    """``id(p) -> (p, [(owner, name), ...])`` for every sharded parameter of a hooked module
    whose rule reads parameter values (a unit's descendants' too), in hooked order."""
    found: dict[int, tuple[Tensor, list[tuple[nn.Module, str]]]] = {}
    for module in state.modules:
        rule = state.rules.get(module)
        if not getattr(rule, "needs_parameter_values", False):
            continue
        for owner in module.modules() if module in state.units else [module]:
            for name, p in owner._parameters.items():
                if p is not None and is_sharded(p):
                    found.setdefault(id(p), (p, []))[1].append((owner, name))
    return found


Verb = TypeVar("Verb", bound=Callable)


def with_full_values(verb: Verb) -> Verb:
    """Decorator of a ``compute_*`` function whose first argument is the model: on an FSDP2
    model, each hooked module whose rule reads parameter values (the torch.func fallback,
    attention, recurrent layers) holds its full parameters from the call's ``prepare_step``
    (:func:`swap_in_full_values`: all-gathered on every rank, so every rank must make the call,
    an empty local batch included) to its end, as in its forward. What the call resolves
    before (``max_grad_norm`` groups) and the step see the sharded parameters, so gradients
    are written to their shards."""
    @functools.wraps(verb)
    def call(model: nn.Module, *args, **kwargs):
        state = unwrap(model).__dict__.get(STATE_ATTRIBUTE)
        if state is None or DTensor is None or state.sharded_of is not None:  # or nested
            return verb(model, *args, **kwargs)
        state.sharded_of = {}
        try:
            return verb(model, *args, **kwargs)
        finally:
            _swap_back(state)
    return call


def swap_in_full_values(state: HookState) -> None:
    """Inside a :func:`with_full_values` call (once): replace each sharded parameter of a
    hooked module whose rule reads parameter values by a full stand-in (``setattr``, so that
    ``nn.RNN``'s flat weights follow), recorded in ``state.sharded_of``."""
    if state.sharded_of is None or state.sharded_of:
        return
    readers = _value_readers(state)
    if not readers:
        return
    with torch.no_grad():
        for p, owners in readers.values():
            stand_in = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
            state.sharded_of[id(stand_in)] = p
            for owner, name in owners:
                setattr(owner, name, stand_in)


def _swap_back(state: HookState) -> None:
    """The sharded parameters back in place of their stand-ins; outside a gathering call."""
    stand_ins, state.sharded_of = state.sharded_of or {}, None
    if not stand_ins:
        return
    for module in state.modules:
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and id(p) in stand_ins:
                    setattr(owner, name, stand_ins[id(p)])


ANOTHER_RANK_REFUSED = (
    "another rank refused this step (its error says why); every rank stops with it, so that "
    "none waits in a collective. Fix the cause, zero the gradients and go on")


class RankAgreement:
    """Whether the ranks of an FSDP2 model (one with a sharded trainable parameter) all take
    a step, and the sum of a count over them: one all-reduce over its mesh, made by every rank
    before the call's first per-layer collective. A refusal raised inside
    :meth:`refusals_shared` before that point makes the same all-reduce, flagged: every rank
    then refuses, none waits in a layer's all-reduce. Without sharded parameters: no
    communication."""

    def __init__(self, model: nn.Module):
        sharded = sharded_parameters(model)
        self.mesh = sharded[0].device_mesh if sharded else None
        self.device = sharded[0].to_local().device if sharded else None
        self.reached = False

    def agree(self, count: float, refused: bool = False) -> float:
        """``count`` summed over the mesh (``count`` itself without one); raises when another
        rank refused."""
        if self.mesh is None:
            return count
        flat = torch.tensor([count, float(refused)], dtype=torch.float64, device=self.device)
        self.reached = True
        mesh_all_reduce(flat, self.mesh)
        if float(flat[1]) > 0 and not refused:
            raise PerSampleHooksError(ANOTHER_RANK_REFUSED)
        return float(flat[0])

    @contextlib.contextmanager
    def refusals_shared(self) -> Iterator[RankAgreement]:
        """A refusal inside, before :meth:`agree`, is announced to the other ranks."""
        try:
            yield self
        except Exception:
            if self.mesh is not None and not self.reached:
                self.agree(0.0, refused=True)
            raise


class ShardedGrads:
    """Where a clipped sum is written: ``plain_target(p)`` (``p.grad``) for an ordinary
    parameter; for a DTensor one a full-shape buffer of this rank's sum, which
    :meth:`publish` sums over the mesh (one all-reduce per call) and cuts to ``p.grad``'s
    shard. Every rank must publish the same parameters in the same order.

    ``batch_size``: the local number of clipped samples (groups of rows); the global one is
    summed over the mesh here (``agreement``, made after the caller's last refusal), and for
    a mean loss the local mean is rescaled to its share of the global mean
    (``B_local / B_global``), so that ``p.grad`` ends as the mean over the global batch."""

    def __init__(self, params: Iterable[Tensor], batch_size: int, mean: bool,
                 plain_target: Callable[[Tensor], Tensor], agreement: RankAgreement):
        self.plain_target = plain_target
        self.buffers: dict[int, Tensor] = {}
        sharded = [p for p in params if is_sharded(p)]
        self.mesh = sharded[0].device_mesh if sharded else None
        self.scale = 1.0
        total = agreement.agree(float(batch_size))
        if self.mesh is not None and mean and total > 0:
            self.scale = batch_size / total

    def target(self, p: Tensor) -> Tensor:
        """The tensor to write ``p``'s clipped sum into (overwritten, not accumulated)."""
        if not is_sharded(p):
            return self.plain_target(p)
        buffer = self.buffers.get(id(p))
        if buffer is None:
            buffer = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
            self.buffers[id(p)] = buffer
        return buffer

    def publish(self, params: Iterable[Tensor]) -> None:
        """Sum the targets of the sharded ``params`` over the mesh (one all-reduce of one
        flat buffer) and write this rank's shard into ``p.grad``; a sharded parameter with no
        target gets zeros from this rank. Ordinary parameters are left as written."""
        sharded = [p for p in params if is_sharded(p)]
        if not sharded:
            return
        if any(p.device_mesh != self.mesh for p in sharded):
            raise PerSampleHooksError("clip_grads: the trainable parameters are sharded on "
                                     "different device meshes: shard them all on one mesh")
        fulls = [self.buffers.pop(id(p), None) for p in sharded]
        flat = torch.cat([(f if f is not None else torch.zeros(p.shape, dtype=p.dtype,
                                                                device=p.to_local().device)
                           ).reshape(-1) for p, f in zip(sharded, fulls)])
        del fulls
        if self.scale != 1.0:
            flat.mul_(self.scale)
        mesh_all_reduce(flat, self.mesh)
        offset = 0
        for p in sharded:
            full = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            if p.grad is None or not is_sharded(p.grad) or p.grad.placements != p.placements:
                p.grad = torch.zeros_like(p)
            p.grad.to_local().copy_(like(full, p).to_local())


__all__ = ["is_sharded", "sharded_parameters", "several_ranks", "contains_fsdp_unit",
           "ShardedGrads", "RankAgreement", "ANOTHER_RANK_REFUSED", "like",
           "mesh_all_reduce", "with_full_values", "swap_in_full_values"]
