"""DistributedDataParallel on CPU (gloo, 2 processes, loopback only via a file rendezvous):
every rank's results equal one process's on the concatenated batch.

- per-sample gradients and norms of each rank's shard, model wrapped in DDP;
- DP-SGD: ``psh.distributed.clip_grads`` leaves on every rank the clipped mean (sum) over the
  global batch, with DDP's own all-reduce skipped (comm hook) or suppressed (``no_sync``);
  local batches of different sizes; several optimizer steps keep the ranks identical.
"""
from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import per_sample_hooks as psh
from ground_truth import weighted_square

WORLD = 2
SHARDS = [3, 5]  # local batch sizes: uneven on purpose
MAX_NORM = 0.05  # small enough that most samples are clipped


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 6, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(sum(SHARDS), 2, 6, generator=generator, dtype=torch.float64)


def shard(x: torch.Tensor, rank: int) -> torch.Tensor:
    start = sum(SHARDS[:rank])
    return x[start:start + SHARDS[rank]]


def backward(model: nn.Module, x: torch.Tensor, loss_type: str) -> None:
    losses = weighted_square(model(x))
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()


def check_close(got, expected, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def per_sample_on_each_rank(rank: int) -> None:
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    with psh.add_hooks(reference), psh.add_hooks(ddp):
        x = global_batch(0)
        backward(reference, x, "mean")
        psh.compute_grad1(reference)
        norms = psh.compute_norms(reference)
        expected = {n: shard(p.grad1, rank) for n, p in reference.named_parameters()}
        backward(ddp, shard(x, rank), "mean")  # DDP averages p.grad; grad1 is per sample
        local_norms = psh.compute_norms(ddp)
        psh.compute_grad1(ddp)
        for n, p in ddp.module.named_parameters():
            check_close(p.grad1, expected[n], f"rank {rank} grad1 {n}")
        check_close(local_norms, shard(norms, rank), f"rank {rank} norms")


def local_grads(model: nn.Module, x: torch.Tensor, loss_type: str) -> list[torch.Tensor]:
    """Plain gradients of the local batch, on an unhooked copy (a deepcopy of a hooked model
    would share its hooks)."""
    copied = make_model()
    copied.load_state_dict(model.state_dict())
    model = copied
    backward(model, x, loss_type)
    return [p.grad for p in model.parameters()]


def dp_sgd_matches_one_process(rank: int, loss_type: str, suppress: str) -> None:
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    if suppress == "comm_hook":
        psh.distributed.skip_gradient_allreduce(ddp)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    with psh.add_hooks(reference), psh.add_hooks(ddp):
        for step in range(3):
            x = global_batch(step)
            opt_ref.zero_grad(set_to_none=True)
            backward(reference, x, loss_type)
            expected_norms = psh.clip_grads(reference, MAX_NORM, loss_type)
            opt.zero_grad(set_to_none=True)
            mine = shard(x, rank)
            unsynced = local_grads(ddp.module, mine, loss_type)
            if suppress == "no_sync":
                with ddp.no_sync():
                    backward(ddp, mine, loss_type)
            else:
                backward(ddp, mine, loss_type)
            # DDP's all-reduce of unclipped gradients did not run: p.grad is the local one
            for p, g in zip(ddp.parameters(), unsynced):
                check_close(p.grad, g, f"rank {rank} step {step}: DDP communicated")
            norms = psh.distributed.clip_grads(ddp, MAX_NORM, loss_type)
            check_close(norms, shard(expected_norms, rank), f"rank {rank} norms")
            assert bool((norms > MAX_NORM).any()), "no sample clipped: the test proves little"
            for (n, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
                check_close(p.grad, q.grad, f"rank {rank} step {step} clipped {n}")
            opt_ref.step()
            opt.step()
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        check_close(p.detach(), q.detach(), f"rank {rank} parameters after 3 steps")


def weighted_mean_helper(rank: int) -> None:
    tensors = [torch.full((2, 2), float(rank + 1), dtype=torch.float64)]
    total = psh.distributed.all_reduce_weighted_mean(tensors, SHARDS[rank])
    assert total == sum(SHARDS)
    check_close(tensors[0], torch.full((2, 2), (3 * 1 + 5 * 2) / 8, dtype=torch.float64),
                "weighted mean")


def worker(rank: int, init_file: str, errors: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        per_sample_on_each_rank(rank)
        for loss_type in ("mean", "sum"):
            for suppress in ("comm_hook", "no_sync"):
                dp_sgd_matches_one_process(rank, loss_type, suppress)
        weighted_mean_helper(rank)
    except BaseException:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.skipif(sys.platform == "win32", reason="file rendezvous on POSIX only")
def test_ddp_two_processes_match_one_process(tmp_path):
    init_file = str(tmp_path / "rendezvous")
    errors = str(tmp_path / "errors")
    try:
        mp.spawn(worker, args=(init_file, errors), nprocs=WORLD, join=True)
    except Exception as error:  # noqa: BLE001 - show the workers' own tracebacks
        reports = [open(f"{errors}.{r}").read() for r in range(WORLD)
                   if os.path.exists(f"{errors}.{r}")]
        pytest.fail("\n".join(reports) or str(error))


def test_distributed_helpers_need_an_initialized_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    model = nn.Linear(2, 1)
    with psh.add_hooks(model):
        model(torch.randn(3, 2)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="init_process_group"):
            psh.distributed.clip_grads(model, 1.0)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        psh.distributed.skip_gradient_allreduce(model)
