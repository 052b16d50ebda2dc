"""Per-sample gradient norms point at mislabeled samples.

scikit-learn's handwritten digits (8x8 images, shipped with the package: no download). We flip
the labels of 10% of the training images on purpose, train a small CNN briefly, then compute
every training sample's gradient with ``per_sample_hooks.compute_grad1`` and rank the samples
by gradient norm. A sample the model cannot fit has a large gradient: the top of the ranking
is mostly the flipped samples.

    python examples/digits_grad_norms.py [--epochs 8] [--flip 0.1] [--seed 0] [--threads 1]

About 10 seconds on one CPU core. One thread is the default: this model is too small for a
second one to help (a second thread of a shared two-core machine made it slower, see
``--threads``).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import per_sample_hooks as psh

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    def tqdm(iterable, **_):
        return iterable


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10))


def load(flip: float, seed: int):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    train, test = order[:1400], order[1400:]
    labels = y[train].clone()
    flipped = torch.randperm(len(train), generator=g)[:int(flip * len(train))]
    labels[flipped] = (labels[flipped] + torch.randint(1, 10, (len(flipped),), generator=g)) % 10
    is_flipped = torch.zeros(len(train), dtype=torch.bool)
    is_flipped[flipped] = True
    return x[train], labels, is_flipped, x[test], y[test]


def train(model: nn.Module, x, y, epochs: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in tqdm(range(epochs), desc="training", leave=False):
        for batch in torch.randperm(len(y), generator=g).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()


def gradient_norms(model: nn.Module, x, y, batch_size: int = 256) -> torch.Tensor:
    """``[N]``: norm of each sample's gradient of its own loss, over all parameters."""
    norms = []
    with psh.add_hooks(model):
        for start in tqdm(range(0, len(y), batch_size), desc="per-sample gradients",
                          leave=False):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            model.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            psh.compute_grad1(model)  # p.grad1: [B, *p.shape]; a new step starts by itself
            for p in model.parameters():  # grad1 averages to the ordinary gradient
                torch.testing.assert_close(p.grad1.mean(0), p.grad, rtol=1e-4, atol=1e-5)
            squared = sum(p.grad1.flatten(1).pow(2).sum(1) for p in model.parameters())
            norms.append(squared.sqrt())
    return torch.cat(norms)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train, rank and print; return the test accuracy and the precision of the top k (k the
    number of flipped labels)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--flip", type=float, default=0.1, help="fraction of labels flipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    x, y, is_flipped, x_test, y_test = load(args.flip, args.seed)
    model = small_cnn()
    train(model, x, y, args.epochs, args.seed)
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"trained a small CNN for {args.epochs} epochs on {len(y)} digits, "
          f"{int(is_flipped.sum())} of them with a flipped label; test accuracy {accuracy:.1%}")

    norms = gradient_norms(model, x, y)
    k = int(is_flipped.sum())
    ranking = norms.argsort(descending=True)
    print(f"\nper-sample gradient norms: median {norms.median():.3f}, "
          f"flipped samples {norms[is_flipped].median():.3f} (median), "
          f"clean samples {norms[~is_flipped].median():.3f} (median)")
    print("\nthe k samples with the largest gradient norm: how many are flipped labels?")
    print(f"{'k':>6} {'precision':>10} {'recall':>8}   "
          f"(a random ranking: {is_flipped.float().mean():.0%} precision)")
    for top in (k // 4, k // 2, k, 2 * k):
        hits = int(is_flipped[ranking[:top]].sum())
        print(f"{top:>6} {hits / top:>10.1%} {hits / k:>8.1%}")
    clean_top = [int(i) for i in ranking if not is_flipped[i]][:5]
    with torch.no_grad():
        predicted = model(x[clean_top]).argmax(1).tolist()
    print("\nthe clean samples with the largest norms are hard digits (label -> prediction): "
          + ", ".join(f"#{i}: {int(y[i])} -> {p}" for i, p in zip(clean_top, predicted)))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return {"test_accuracy": accuracy, "precision_at_k": int(is_flipped[ranking[:k]].sum()) / k}


if __name__ == "__main__":
    main()
