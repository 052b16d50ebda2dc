"""DP-SGD on several processes: DistributedDataParallel or FSDP2 (``fully_shard``), CPU or GPU.

    torchrun --standalone --nproc_per_node=2 examples/dp_distributed.py           # DDP
    torchrun --standalone --nproc_per_node=2 examples/dp_distributed.py --fsdp    # FSDP2

scikit-learn's digits, a small CNN. Each rank Poisson-samples its own half of the training set
(``dataset_size`` and ``batch_size`` per rank; the sampling rate, hence the accounting, is the
global one), runs one forward and backward of its local batch, and ``DPSGD.step`` clips each
sample, sums the clipped gradients over the ranks (DDP: one all-reduce; FSDP2: one per layer,
into each rank's shards), adds the noise drawn on rank 0 and steps: every rank ends each step
with the same parameters (FSDP2: its shards of them) as one process on the global batch.
``gloo`` on CPU, ``nccl`` with ``--device cuda`` (one GPU per process, ``LOCAL_RANK``). Rank 0
prints test accuracy and epsilon after every epoch, and a checksum of the final parameters.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from dp_sgd_digits import (  # the single-process example's model and data
    dp_arguments,
    load,
    small_cnn,
)
from torch import nn

import per_sample_hooks as psh


def distribute(model: nn.Sequential, fsdp: bool, device: torch.device) -> nn.Module:
    """DDP, or FSDP2 with each convolution its own unit inside the root's."""
    if not fsdp:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Conv2d):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


@torch.no_grad()
def checksum(model: nn.Module) -> float:
    """Sum of every parameter (FSDP2: of the full tensors; every rank takes part)."""
    return sum(float((p.full_tensor() if psh.sharded.is_sharded(p) else p).double().sum())
               for p in model.parameters())


def main() -> None:
    parser = dp_arguments(__doc__.splitlines()[0], epochs=10, batch_size=32,
                          batch_help="expected, per rank")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # torchrun's variables
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        x_train, x_test, y_train, y_test = (t.to(device) for t in load(args.seed))
        x_mine, y_mine = x_train[rank::world], y_train[rank::world]  # this rank's shard
        torch.manual_seed(args.seed)  # the same initial parameters on every rank
        model = distribute(small_cnn().to(device), args.fsdp, device)
        psh.add_hooks(model, check_unseen=not args.fsdp)  # FSDP2: see distributed's docs
        dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=args.lr),
                       noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
                       dataset_size=len(x_mine), batch_size=args.batch_size,
                       generator=torch.Generator(device).manual_seed(args.seed + rank))
        criterion = nn.CrossEntropyLoss()
        for epoch in range(args.epochs):
            model.train()
            for idx in dp.batches():  # maybe empty: every rank still runs every step
                idx = idx.to(device)
                dp.zero_grad()
                dp.backward(criterion(model(x_mine[idx]), y_mine[idx]))
                dp.step()
            model.eval()
            score = accuracy(model, x_test, y_test)  # FSDP2: every rank runs the forward
            if rank == 0:
                print(f"epoch {epoch + 1}: test accuracy {score:.3f}, "
                      f"epsilon {dp.epsilon(args.delta):.2f} (delta {args.delta})", flush=True)
        total = checksum(model)
        if rank == 0:
            print(f"parameter checksum {total:.6f}", flush=True)
        dp.close()
        dist.barrier()  # every rank done before the teardown: gloo aborts on a peer gone early
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
