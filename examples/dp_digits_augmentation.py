"""DP-SGD on digits with augmentation multiplicity (De et al. 2022): K random shifts per example.

    python examples/dp_digits_augmentation.py        # K = 1 and K = 4, under a minute, 1 thread

Each step Poisson-samples *examples*; each sampled example is shifted at random K times (up to
one pixel each way), and the K rows form one group (``dp.step(groups=K)``): the example's
gradient is the mean of its K rows' gradients, clipped as one sample's, computed from the
captured forms without per-row gradients. Sampling and accounting count examples, so both runs
spend the same epsilon; K = 4 only averages away some of the augmentation noise before
clipping. Prints test accuracy per epoch for both.
"""
from __future__ import annotations

import argparse
import time

import torch
from dp_sgd_digits import accuracy, dp_arguments, load, small_cnn
from torch import nn

from per_sample_hooks import DPSGD, remove_hooks


def random_shifts(x: torch.Tensor, generator: torch.Generator, pixels: int = 1) -> torch.Tensor:
    """Each image ``[N, C, H, W]`` moved by its own random offset in ``-pixels..pixels`` along
    both axes, zeros shifted in."""
    n, _, h, w = x.shape
    padded = nn.functional.pad(x, (pixels,) * 4)
    offsets = torch.randint(0, 2 * pixels + 1, (n, 2), generator=generator)
    rows = (offsets[:, :1] + torch.arange(h)).view(n, 1, h, 1)
    cols = (offsets[:, 1:] + torch.arange(w)).view(n, 1, 1, w)
    batch = torch.arange(n).view(n, 1, 1, 1)
    channels = torch.arange(x.shape[1]).view(1, -1, 1, 1)
    return padded[batch, channels, rows, cols]


def train(multiplicity: int, data: tuple[torch.Tensor, ...], args: argparse.Namespace
          ) -> list[tuple[float, float]]:
    """``[(test accuracy, epsilon)]`` after each epoch."""
    x_train, x_test, y_train, y_test = data
    torch.manual_seed(args.seed)
    model = small_cnn()
    criterion = nn.CrossEntropyLoss()  # mean over the rows: each group's mean is its example's
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5),
               noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
               dataset_size=len(x_train), batch_size=args.batch_size, sampling="poisson",
               generator=torch.Generator().manual_seed(args.seed))
    shifts = torch.Generator().manual_seed(args.seed + 1)
    history = []
    for _ in range(args.epochs):
        model.train()
        for idx in dp.batches():
            dp.zero_grad()
            if len(idx):
                rows = x_train[idx].repeat_interleave(multiplicity, 0)
                labels = y_train[idx].repeat_interleave(multiplicity, 0)
                dp.backward(criterion(model(random_shifts(rows, shifts)), labels))
            dp.step(empty_batch=len(idx) == 0, groups=multiplicity)
        model.eval()
        history.append((accuracy(model, x_test, y_test), dp.epsilon(args.delta)))
    dp.close()
    remove_hooks(model)
    return history


def main(argv: list[str] | None = None) -> dict[int, list[tuple[float, float]]]:
    parser = dp_arguments(__doc__.splitlines()[0])
    parser.add_argument("--multiplicities", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load(args.seed)
    print(f"{len(data[0])} training / {len(data[1])} test digits, expected batch "
          f"{args.batch_size} examples, noise multiplier {args.noise_multiplier}, clip norm "
          f"{args.max_grad_norm}, delta {args.delta}")
    results = {}
    for k in args.multiplicities:
        start = time.perf_counter()
        results[k] = train(k, data, args)
        print(f"K={k}: {args.epochs} epochs in {time.perf_counter() - start:.1f} s")
    print("epoch  epsilon  " + "  ".join(f"acc K={k}" for k in results))
    for epoch in range(args.epochs):
        epsilon = results[args.multiplicities[0]][epoch][1]
        print(f"{epoch + 1:5d}  {epsilon:7.3f}  " + "  ".join(
            f"{results[k][epoch][0]:7.4f}" for k in results))
    return results


if __name__ == "__main__":
    main()
