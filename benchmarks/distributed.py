"""The DP-SGD step on 2 processes (DDP, FSDP2) against one process on the same global batch::

    python -m benchmarks.distributed [--batch 128] [--rounds 20]

MLP 784-512-512-10 (float32), global batch ``--batch`` (each of the 2 ranks: half of it),
gloo on loopback, one thread per process (``OMP_NUM_THREADS=1``). Per configuration (one
process; DDP on 2; FSDP2 on 2, each Linear its own unit inside the root's) two steps:

- ``plain``: ``zero_grad``, forward, ``loss.backward()``, ``SGD.step`` (DDP: its all-reduce;
  FSDP2: its all-gathers and reduce-scatters);
- ``dp``: ``DPSGD`` (noise multiplier 1.0, ``check_unseen=False`` everywhere): forward,
  ``DPSGD.backward`` (output edges; DDP: an ordinary backward with its all-reduce switched
  off), ``DPSGD.step`` (clipping, the sum over ranks, noise drawn on rank 0 and broadcast);
- ``dp0``: the same with noise multiplier 0 (no noise drawn or broadcast);
- ``clip``: forward, ``loss.backward()``, ``distributed.clip_grads`` (one process:
  ``clip_grads``), ``SGD.step``: DDP with its all-reduce switched off
  (``skip_gradient_allreduce``), FSDP2 with its reduce-scatter of the unclipped gradient
  running (overwritten): against ``dp0``, what the output-edge backward saves.

Time: median over ``--rounds`` interleaved rounds (plain, dp, plain, dp, ...) of the step
time, each step started after a barrier and timed as the slowest rank's; the ratio is to the
one-process ``dp`` step. Memory per rank: peak resident memory (``VmHWM``, reset after the
setup) above the resident memory once the model, data, optimizer and process group exist, over
3 steps in fresh processes (glibc's mmap threshold at 64 KiB so that RSS follows the live
tensors, as in ``benchmarks.dp``), the larger of the 2 ranks; it counts everything the step
allocates on the CPU: activations, gradients, the library's buffers, communication buffers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import per_sample_hooks as psh
from benchmarks.dp import CHILD_MALLOC
from benchmarks.harness import reset_peak, status_kib

WORLD = 2
CONFIGS = ("one", "ddp", "fsdp")
METHODS = ("plain", "clip", "dp", "dp0")  # timed; memory: plain, clip and dp


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def wrap(model: nn.Sequential, config: str) -> nn.Module:
    if config == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if config == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def make_step(config: str, method: str, batch: int, rank: int):
    """A zero-argument callable doing one step of ``method`` on this rank's share."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 784, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    if config != "one":
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    model = wrap(mlp(), config)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if method == "plain":
        def plain() -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            optimizer.step()
        return plain
    psh.add_hooks(model, check_unseen=False)
    if method == "clip":
        if config == "ddp":
            psh.distributed.skip_gradient_allreduce(model)
        clip = psh.clip_grads if config == "one" else psh.distributed.clip_grads

        def clipped() -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            clip(model, 1.0)
            optimizer.step()
        return clipped
    dp = psh.DPSGD(model, optimizer, noise_multiplier=0.0 if method == "dp0" else 1.0,
                   max_grad_norm=1.0,
                   dataset_size=100 * len(x), batch_size=len(x), accountant=None,
                   generator=torch.Generator().manual_seed(7))

    def private() -> None:
        dp.zero_grad()
        dp.backward(criterion(model(x), y))
        dp.step()
    return private


def timed(step, distributed: bool) -> float:
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    step()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if distributed:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def run(rank: int, config: str, task: str, batch: int, rounds: int, init_file: str,
        results: dict) -> None:
    """``task``: "time" (both methods, interleaved) or a method name (its memory)."""
    torch.set_num_threads(1)
    distributed = config != "one"
    if distributed:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        if task == "time":
            steps = {m: make_step(config, m, batch, rank) for m in METHODS}
            for _ in range(3):
                for step in steps.values():
                    step()
            times = {m: [] for m in METHODS}
            for _ in range(rounds):
                for m, step in steps.items():
                    times[m].append(timed(step, distributed))
            if rank == 0:
                results.update({m: statistics.median(t) for m, t in times.items()})
        else:
            step = make_step(config, task, batch, rank)
            import gc
            gc.collect()
            if distributed:
                dist.barrier()
            setup = status_kib("VmRSS") or 0
            reset_peak()
            for _ in range(3):
                step()
            extra = torch.tensor([((status_kib("VmHWM") or 0) - setup) / 1024])
            if distributed:
                dist.all_reduce(extra, op=dist.ReduceOp.MAX)
            if rank == 0:
                results[task] = float(extra)
        if distributed:
            dist.barrier()
    finally:
        if distributed:
            dist.destroy_process_group()
    if distributed:  # no interpreter teardown: a gloo thread still joinable there aborts
        os._exit(0)  # (SIGABRT, as in tests/test_distributed.py); results are already sent


def measure(config: str, task: str, batch: int, rounds: int) -> dict:
    """``run`` in fresh processes (2 for DDP/FSDP2, 1 for one process)."""
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        args = (config, task, batch, rounds, os.path.join(folder, "rendezvous"), results)
        mp.spawn(run, args=args, nprocs=1 if config == "one" else WORLD, join=True)
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(CHILD_MALLOC)
    times = {c: measure(c, "time", args.batch, args.rounds) for c in CONFIGS}
    memory = {c: {m: measure(c, m, args.batch, 0)[m] for m in ("plain", "clip", "dp")}
              for c in CONFIGS}
    reference = times["one"]["dp"]
    print(f"MLP 784-512-512-10, global batch {args.batch}, {WORLD} processes for DDP/FSDP2, "
          "1 thread each")
    print(f"{'config':8} {'step':6} {'ms':>8} {'x one-process dp':>17} {'MiB per rank':>13}")
    for config in CONFIGS:
        for method in METHODS:
            ms = 1e3 * times[config][method]
            mib = memory[config].get(method)
            print(f"{config:8} {method:6} {ms:8.2f} {ms / (1e3 * reference):17.2f} "
                  f"{'' if mib is None else f'{mib:.1f}':>13}")


if __name__ == "__main__":
    main()
