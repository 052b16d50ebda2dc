"""DistributedDataParallel on CPU (gloo, 2 processes, loopback only via a file rendezvous):
every rank's results equal the float64 per-sample loop on the concatenated (global) batch.

- per-sample gradients and norms of each rank's shard, model wrapped in DDP;
- DP clipping: ``psh.distributed.clip_grads`` leaves on every rank the clipped mean (sum) over
  the global batch, in exactly one all-reduce; DDP's own all-reduce of unclipped gradients is
  skipped (comm hook), suppressed (``no_sync``) or runs and is overwritten (``plain``): never
  leaks into the result; local batches of different sizes, an empty one included; several
  optimizer steps keep the ranks identical to one process;
- ``DPSGD`` on a DDP model: the same parameters as one process running ``DPSGD`` on the global
  batch with the same noise (drawn on rank 0 and broadcast);
- KFAC factors of each shard averaged with ``all_reduce_kfac`` equal those of the global batch.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks
from norms_truth import loop_clipped, loop_grouped_clipping
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import per_sample_hooks as psh
from ground_truth import loop_grads, loop_grads_of
from per_sample_hooks.curvature import compute_kfac

WORLD = 2
STEP_SHARDS = [(3, 5), (0, 4), (5, 2)]  # local batch sizes per step: uneven, one rank empty
MAX_NORM = 0.05  # small enough that most samples are clipped
LR = 0.5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 6, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def make_tagger() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(5, 3), nn.LayerNorm(3), nn.Linear(3, 2)).double()


def weighted_square(output: torch.Tensor) -> torch.Tensor:
    """``ground_truth.weighted_square`` that also takes an empty batch."""
    flat = output.flatten(1)
    weights = torch.linspace(-1.0, 2.0, flat.shape[1], dtype=flat.dtype)
    return (flat.pow(2) * weights + flat * weights.flip(0)).sum(1)


def global_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(sum(STEP_SHARDS[step]), 2, 6, generator=generator, dtype=torch.float64)


def shard(x: torch.Tensor, rank: int, step: int = 0) -> torch.Tensor:
    sizes = STEP_SHARDS[step]
    start = sum(sizes[:rank])
    return x[start:start + sizes[rank]]


def backward(model: nn.Module, x: torch.Tensor, loss_type: str, *args: object) -> None:
    losses = weighted_square(model(x, *args))
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()


def check_close(got, expected, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def loop_truth(model: nn.Module, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Per-sample gradients and total norms of the global batch, float64 loop, unhooked model."""
    grads = loop_grads(model, [x], weighted_square, len(x))
    return grads, torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)


class AllReduceCounter:
    """Counts ``dist.all_reduce`` calls made from Python (DDP's reducer calls C++ directly)."""

    def __init__(self):
        self.count = 0
        self.original = dist.all_reduce

    def __enter__(self):
        def counting(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


def per_sample_on_each_rank(rank: int) -> None:
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    x = global_batch(0)
    grads, norms = loop_truth(reference, x)
    with psh.add_hooks(ddp):
        backward(ddp, shard(x, rank), "mean")  # DDP averages p.grad; grad1 is per sample
        local_norms = psh.compute_norms(ddp)
        psh.compute_grad1(ddp)
        for n, p in ddp.module.named_parameters():
            check_close(p.grad1, shard(grads[n], rank), f"rank {rank} grad1 {n}")
        check_close(local_norms, shard(norms, rank), f"rank {rank} norms")


def dp_clipping_matches_one_process(rank: int, loss_type: str, suppress: str) -> None:
    reference = make_model()  # unhooked: the loop's model, stepped with the loop's clipped mean
    ddp = DistributedDataParallel(make_model())
    if suppress == "comm_hook":
        psh.distributed.skip_gradient_allreduce(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with psh.add_hooks(ddp):
        for step in range(len(STEP_SHARDS)):
            x = global_batch(step)
            grads, total = loop_truth(reference, x)
            expected = loop_clipped(grads, total, MAX_NORM, loss_type)
            assert bool((total > MAX_NORM).any()), "no sample clipped: the test proves little"
            opt.zero_grad(set_to_none=True)
            mine = shard(x, rank, step)
            local = {n: g.sum(0) / (max(len(mine), 1) if loss_type == "mean" else 1)
                     for n, g in shard_grads(grads, rank, step).items()}
            # every rank runs forward and backward, an empty batch included (DDP needs all)
            if suppress == "no_sync":
                with ddp.no_sync():
                    backward(ddp, mine, loss_type)
            else:
                backward(ddp, mine, loss_type)
            if suppress != "plain":  # DDP's all-reduce of unclipped gradients did not run
                for n, p in ddp.module.named_parameters():
                    check_close(p.grad, local[n], f"rank {rank} step {step}: DDP synced {n}")
            with AllReduceCounter() as counter:
                norms = psh.distributed.clip_grads(ddp, MAX_NORM, loss_type)
            assert counter.count == 1, f"{counter.count} all-reduces in clip_grads"
            check_close(norms, shard(total, rank, step), f"rank {rank} norms")
            for n, p in ddp.module.named_parameters():
                check_close(p.grad, expected[n], f"rank {rank} step {step} clipped {n}")
            opt.step()
            with torch.no_grad():
                for n, q in reference.named_parameters():
                    q.sub_(LR * expected[n])
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        check_close(p.detach(), q.detach(), f"rank {rank} parameters after the steps")


def grouped_clipping_matches_one_process(rank: int, loss_type: str) -> None:
    """Per-layer thresholds and groups of rows (pairs of a rank's rows; ids of rank 1 after
    rank 0's) through ``distributed.clip_grads``: the global batch's clipped mean (sum)."""
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    psh.distributed.skip_gradient_allreduce(ddp)
    limits = [(ddp.module[0], 0.02), (ddp.module[3:], 0.05)]
    group_of = {n: 0 if n.startswith("0.") else 1 for n, _ in reference.named_parameters()}
    with psh.add_hooks(ddp):
        for step, sizes in enumerate(STEP_SHARDS):
            x = global_batch(step)
            ids = torch.cat([torch.arange(n) // 2 + 100 * r for r, n in enumerate(sizes)])
            grads = loop_grads(reference, [x], weighted_square, len(x))
            total, _, expected = loop_grouped_clipping(grads, group_of, [0.02, 0.05], ids,
                                                       loss_type)
            ddp.zero_grad(set_to_none=True)
            backward(ddp, shard(x, rank, step), loss_type)
            norms = psh.distributed.clip_grads(ddp, limits, loss_type,
                                               groups=shard(ids, rank, step))
            counts = [(n + 1) // 2 for n in sizes]
            check_close(norms, total[sum(counts[:rank]):sum(counts[:rank + 1])],
                        f"rank {rank} step {step} group norms")
            for n, p in ddp.module.named_parameters():
                check_close(p.grad, expected[n], f"rank {rank} step {step} grouped clipped {n}")


def shard_grads(grads: dict, rank: int, step: int) -> dict:
    return {n: shard(g, rank, step) for n, g in grads.items()}


def dpsgd_matches_one_process(rank: int, loss_type: str) -> None:
    """DPSGD on DDP (per rank: half the dataset, half the expected batch) vs DPSGD in one
    process on the global batch; rank 0's generator is the one process's, rank 1's differs."""
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    options = dict(noise_multiplier=0.7, max_grad_norm=MAX_NORM, loss_type=loss_type,
                   accountant=None)
    one = psh.DPSGD(reference, torch.optim.SGD(reference.parameters(), lr=LR), dataset_size=16,
                    batch_size=8, generator=torch.Generator().manual_seed(7), **options)
    mine = psh.DPSGD(ddp, torch.optim.SGD(ddp.parameters(), lr=LR), dataset_size=8,
                     batch_size=4, generator=torch.Generator().manual_seed(7 + 50 * rank),
                     **options)
    with psh.add_hooks(reference), psh.add_hooks(ddp):
        for step in range(len(STEP_SHARDS)):
            x = global_batch(step)
            one.zero_grad()
            one.backward(losses(reference, x, loss_type))
            one.step()
            mine.zero_grad()
            mine.backward(losses(ddp, shard(x, rank, step), loss_type))  # maybe empty
            mine.step()
            for (n, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
                check_close(p.detach(), q.detach(), f"rank {rank} DPSGD step {step} {n}")
    one.close()
    mine.close()


def losses(model: nn.Module, x: torch.Tensor, loss_type: str) -> torch.Tensor:
    values = weighted_square(model(x))
    return values.mean() if loss_type == "mean" else values.sum()


def kfac_factors_match_one_process(rank: int) -> None:
    reference = make_model()
    ddp = DistributedDataParallel(make_model())
    x = global_batch(0)
    with psh.add_hooks(reference), psh.add_hooks(ddp):
        backward(reference, x, "mean")
        expected = compute_kfac(reference, approx="expand", loss_type="mean")
        expected = [tuple(t.clone() for t in pair) for pair in expected.values()]
        mine = shard(x, rank)
        with ddp.no_sync():
            backward(ddp, mine, "mean")
        factors = compute_kfac(ddp, approx="expand", loss_type="mean")
        with AllReduceCounter() as counter:
            psh.distributed.all_reduce_kfac(factors, batch_size=len(mine))
        assert counter.count == 1
        assert len(factors) == len(expected) > 0
        for (module, (a, g)), (ea, eg) in zip(factors.items(), expected):
            check_close(a, ea, f"rank {rank} KFAC A of {type(module).__name__}")
            check_close(g, eg, f"rank {rank} KFAC G of {type(module).__name__}")
    tagger, tokens = make_tagger(), torch.randint(0, 5, (len(x), 4), generator=torch.Generator(
        ).manual_seed(1))  # Embedding factors and LayerNorm diagonals are averaged too
    with psh.add_hooks(tagger):
        tagger(tokens).square().sum((1, 2)).mean().backward()
        expected = compute_kfac(tagger).tensors()
        expected = [t.clone() for t in expected]
        tagger(shard(tokens, rank)).square().sum((1, 2)).mean().backward()
        factors = compute_kfac(tagger)
        assert factors.embeddings and factors.diagonal
        psh.distributed.all_reduce_kfac(factors, batch_size=len(shard(tokens, rank)))
        for got, want in zip(factors.tensors(), expected, strict=True):
            check_close(got, want, f"rank {rank} KFAC of the tagger")


def curvature_of_an_empty_rank(rank: int) -> None:
    """Rank 0's batch is empty (Poisson sampling): its compute_kfac gives zero factors of
    batch_size 0 (it refused them, and rank 1 waited in all_reduce_kfac until gloo's timeout),
    which all_reduce_kfac weighs 0 without being told: every rank gets the factors of the
    global batch, for the Embedding's and the LayerNorm's diagonal too, after an ordinary
    backward and after backprop_hess. compute_fisher_diag gives zeros, its share of the sum.
    In float64 and float32, against the one process's float64 factors."""
    step = 1
    x, tokens = global_batch(step), torch.randint(5, (sum(STEP_SHARDS[step]), 4),
                                                   generator=torch.Generator().manual_seed(3))
    def backwards(model: nn.Module, data: torch.Tensor, hess: bool) -> None:
        output = model(data)
        if hess:
            psh.backprop_hess(output.flatten(1), "LeastSquares")
        else:
            weighted_square(output).mean().backward()
    for make, inputs in ((make_model, x), (make_tagger, tokens)):
        for hess in (False, True):
            for approx in ("expand", "reduce"):
                reference = make()
                with psh.add_hooks(reference):
                    backwards(reference, inputs, hess)
                    expected = [t.clone() for t in compute_kfac(reference, approx).tensors()]
                for dtype in (torch.float64, torch.float32):
                    model = make().to(dtype)
                    data = shard(inputs, rank, step)
                    data = data.to(dtype) if data.is_floating_point() else data
                    with psh.add_hooks(model):
                        backwards(model, data, hess)
                        factors = compute_kfac(model, approx)
                        assert factors.batch_size == len(data)
                        if not len(data):
                            assert all(not t.any() for t in factors.tensors())
                        psh.distributed.all_reduce_kfac(factors)
                    tolerance = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else \
                        dict(rtol=1e-4, atol=1e-6)
                    what = f"rank {rank} {make.__name__} hess={hess} {approx} {dtype}"
                    for got, want in zip(factors.tensors(), expected, strict=True):
                        torch.testing.assert_close(got.double(), want, **tolerance,
                                                   msg=lambda m, what=what: f"{what}: {m}")
    reference, model = make_model(), make_model()
    with psh.add_hooks(reference), psh.add_hooks(model):
        backward(reference, x, "sum")
        expected = psh.compute_fisher_diag(reference, "sum")
        backward(model, shard(x, rank, step), "sum")
        diagonal = psh.compute_fisher_diag(model, "sum")
    for name, value in diagonal.items():
        dist.all_reduce(value)
        check_close(value, expected[name], f"rank {rank} Fisher diagonal {name}")


def weighted_mean_helper(rank: int) -> None:
    tensors = [torch.full((2, 2), float(rank + 1), dtype=torch.float64)]
    total = psh.distributed.all_reduce_weighted_mean(tensors, STEP_SHARDS[0][rank])
    assert total == sum(STEP_SHARDS[0])
    check_close(tensors[0], torch.full((2, 2), (3 * 1 + 5 * 2) / 8, dtype=torch.float64),
                "weighted mean")


def all_checks(rank: int) -> None:
    per_sample_on_each_rank(rank)
    kfac_factors_match_one_process(rank)
    curvature_of_an_empty_rank(rank)
    for loss_type in ("mean", "sum"):
        for suppress in ("comm_hook", "no_sync", "plain"):
            dp_clipping_matches_one_process(rank, loss_type, suppress)
        dpsgd_matches_one_process(rank, loss_type)
        grouped_clipping_matches_one_process(rank, loss_type)
    weighted_mean_helper(rank)
    a_refusal_on_one_rank_stops_every_rank(rank)
    plain_clip_grads_of_a_ddp_model_is_refused(rank)
    a_branch_unused_on_one_rank(rank)
    for dtype in (torch.float64, torch.float32):
        sparse_embedding_clipping(rank, dtype)


def a_refusal_on_one_rank_stops_every_rank(rank: int) -> None:
    """groups=2 with an odd local batch on rank 1 only: refused there, and rank 0 (which sat
    in the all-reduce until gloo's timeout) refuses too; the next step is clean on both."""
    ddp = DistributedDataParallel(make_model())
    x = global_batch(0)
    with psh.add_hooks(ddp):
        backward(ddp, x[:3] if rank == 1 else x[:4], "mean")
        with pytest.raises((psh.PerSampleHooksError, ValueError),
                           match="must divide the batch" if rank == 1 else
                           "another rank refused this step"):
            psh.distributed.clip_grads(ddp, MAX_NORM, groups=2)
        ddp.zero_grad(set_to_none=True)
        backward(ddp, shard(x, rank), "mean")
        psh.distributed.clip_grads(ddp, MAX_NORM)
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    gathered = [torch.empty_like(grads) for _ in range(WORLD)]
    dist.all_gather(gathered, grads)
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)


class Branches(nn.Module):
    """``b`` only on samples of rank 1: DDP needs find_unused_parameters=True."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b = nn.Linear(2, 3), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.a(h) + self.b(h) if branch else self.a(h)


def a_branch_unused_on_one_rank(rank: int) -> None:
    """With DDP's all-reduce on, 'b' (not called on rank 0) has rank 1's gradient on rank 0,
    which cannot be told from a use outside its forward: refused on rank 0 naming the all-reduce
    and what to do (it said 'used outside its module's forward ... or left over'), on rank 1
    as another rank's refusal. Doing what it says is exact, against the float64 loop."""
    x = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    branches = [0, 0, 0, 1, 1, 1]
    reference = Branches().double()
    grads = loop_grads_of(reference, zip(x, branches), lambda out: weighted_square(out[None]))
    total = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    expected = loop_clipped(grads, total, MAX_NORM, "mean")
    ddp = DistributedDataParallel(Branches().double(), find_unused_parameters=True)
    mine = x[3 * rank:3 * rank + 3]
    with psh.add_hooks(ddp):
        backward(ddp, mine, "mean", rank)
        with pytest.raises(psh.PerSampleHooksError, match="another rank refused" if rank else
                           "'weight' of 'b'.*all-reduce ran.*skip_gradient_allreduce"):
            psh.distributed.clip_grads(ddp, MAX_NORM)
        ddp.zero_grad(set_to_none=True)
        psh.distributed.skip_gradient_allreduce(ddp)
        backward(ddp, mine, "mean", rank)
        psh.distributed.clip_grads(ddp, MAX_NORM)
    for n, p in ddp.module.named_parameters():
        check_close(p.grad, expected[n], f"rank {rank} clipped {n}")


def plain_clip_grads_of_a_ddp_model_is_refused(rank: int) -> None:
    """Each rank's p.grad became its own clipped mean: the replicas drifted apart, silently."""
    ddp = DistributedDataParallel(make_model())
    with psh.add_hooks(ddp):
        backward(ddp, shard(global_batch(0), rank), "mean")
        with pytest.raises(psh.PerSampleHooksError, match="drift apart.*distributed.clip_grads"):
            psh.clip_grads(ddp, MAX_NORM)
        psh.distributed.clip_grads(ddp, MAX_NORM)  # the same step, not poisoned


def sparse_embedding_clipping(rank: int, dtype: torch.dtype) -> None:
    """An Embedding(sparse=True): DDP divides its sparse gradient in place, whose values are a
    view of the Embedding's output gradient (grad1 was 1/world_size of the truth unchecked,
    the unseen-use check refused it); distributed.clip_grads sums its clipped gradient (sparse,
    as clip_grads keeps it) over the ranks, densely. Against the float64 loop, in ``dtype``."""
    reference = make_tagger()
    model = make_tagger().to(dtype)
    model[0].sparse = True
    ddp = DistributedDataParallel(model)
    tolerance = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else \
        dict(rtol=1e-4, atol=1e-6)
    tokens = torch.randint(5, (sum(STEP_SHARDS[0]), 4), generator=torch.Generator().manual_seed(7))
    grads, total = loop_truth(reference, tokens)
    expected = loop_clipped(grads, total, MAX_NORM, "mean")
    with psh.add_hooks(ddp, check_unseen=False):
        backward(ddp, shard(tokens, rank), "mean")
        assert ddp.module[0].weight.grad.is_sparse
        psh.compute_grad1(ddp)
        for n, p in ddp.module.named_parameters():
            torch.testing.assert_close(p.grad1.double(), shard(grads[n], rank), **tolerance,
                                       msg=lambda m, n=n: f"rank {rank} grad1 {n}: {m}")
    ddp.zero_grad(set_to_none=True)
    with psh.add_hooks(ddp):
        backward(ddp, shard(tokens, rank), "mean")
        psh.distributed.clip_grads(ddp, MAX_NORM, "mean")
    for n, p in ddp.module.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[n], **tolerance,
                                   msg=lambda m, n=n: f"rank {rank} clipped {n}: {m}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.skipif(sys.platform == "win32", reason="file rendezvous on POSIX only")
def test_ddp_two_processes_match_one_process(tmp_path):
    run_ranks(all_checks, WORLD, tmp_path)


def test_distributed_helpers_need_an_initialized_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    model = nn.Linear(2, 1)
    with psh.add_hooks(model):
        model(torch.randn(3, 2)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="init_process_group"):
            psh.distributed.clip_grads(model, 1.0)
        with pytest.raises(psh.PerSampleHooksError, match="init_process_group"):
            psh.distributed.all_reduce_kfac({model: (torch.eye(2), torch.eye(1))})
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        psh.distributed.skip_gradient_allreduce(model)
