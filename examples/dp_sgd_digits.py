"""DP-SGD on scikit-learn's digits with a small CNN: per-sample clipping in one backward.

    python examples/dp_sgd_digits.py            # a few seconds on one CPU core

Each step Poisson-samples a batch, runs one ordinary forward and backward, clips every sample's
gradient (``per_sample_hooks.clip_grads``: no per-sample gradients stored), adds Gaussian noise,
and tells Opacus' RDP accountant (``pip install per_sample_hooks[dp]``). Prints test accuracy and
the epsilon spent (at ``delta``) after every epoch.
"""
from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from per_sample_hooks import DPSGD

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    def tqdm(iterable, **_):
        return iterable


def small_cnn() -> nn.Module:
    """Few parameters (about 2,000), tanh activations: both help under DP noise."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.Tanh(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 10))


def load(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, (x_test - mean) / std, y_train, y_test


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def dp_arguments(description: str, epochs: int = 15, batch_size: int = 64,
                 batch_help: str = "expected (Poisson) size") -> argparse.ArgumentParser:
    """The DP-SGD examples' common options (training, privacy, seed)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    parser = dp_arguments(__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: this model is too small for more to help)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = load(args.seed)
    model = small_cnn()
    criterion = nn.CrossEntropyLoss()  # mean over the batch
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5),
               noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
               dataset_size=len(x_train), batch_size=args.batch_size, sampling="poisson",
               generator=torch.Generator().manual_seed(args.seed))
    print(f"{len(x_train)} training / {len(x_test)} test digits, sample rate "
          f"{dp.sample_rate:.4f}, noise multiplier {args.noise_multiplier}, clip norm "
          f"{args.max_grad_norm}, delta {args.delta}")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        progress = tqdm(dp.batches(), total=dp.steps_per_epoch, desc=f"epoch {epoch}",
                        leave=False)
        for idx in progress:
            dp.zero_grad()
            if len(idx):
                dp.backward(criterion(model(x_train[idx]), y_train[idx]))  # skips p.grad
            dp.step(empty_batch=len(idx) == 0)
        model.eval()
        print(f"epoch {epoch:2d}  test accuracy {accuracy(model, x_test, y_test):.4f}  "
              f"epsilon {dp.epsilon(args.delta):.3f}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
