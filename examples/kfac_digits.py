"""KFAC as a preconditioner for plain SGD, against SGD and Adam, on scikit-learn's digits.

    python examples/kfac_digits.py [--epochs 12] [--out kfac_digits.png] [--curvature fisher]

About 30 seconds on one CPU core. A small CNN (two 3x3 convolutions and a linear layer, about
6,000 parameters) on the 8x8 digit images shipped with scikit-learn (no download; 80% train /
20% test, stratified), mini-batches of 64, cross-entropy. Three optimizers:

- ``SGD``: ``torch.optim.SGD(momentum=0.9)``;
- ``Adam``: ``torch.optim.Adam`` (default betas);
- ``SGD + KFAC``: the same SGD after ``per_sample_hooks.optim.KFAC(model)``, with its defaults
  (damping 1e-3, KL clip 1e-3, factors averaged with decay 0.95, eigendecompositions every 10
  steps), replaced the gradients of the convolutions and the linear layer by the damped
  Kronecker solve. ``--curvature fisher`` (default) reads Fisher factors (``backprop_hess``:
  one extra backward pass per class); ``empirical`` reads the factors of the ordinary
  backward (no extra pass).

Learning rates: each optimizer gets the best of a small grid (``GRIDS``), judged by the mean
training loss over the first ``--tune-epochs`` epochs from the same initialization and batch
order; then each trains ``--epochs`` epochs from that initialization. Prints, per optimizer,
the training loss and test accuracy per epoch, the seconds one epoch of training takes, and
the epochs and seconds it needs to reach a training loss of ``--target``; saves the curves
against epochs and against seconds of training (evaluation not counted) as a PNG at
``--out``. What to expect: per epoch KFAC reaches a low training loss first; one of its epochs
costs several of SGD's (factors, extra backward passes, eigendecompositions), so per second
of a model this small it is not ahead.
"""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn

import per_sample_hooks as psh

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    def tqdm(iterable, **_):
        return iterable

GRIDS = {
    "SGD": [0.01, 0.03, 0.1, 0.3],
    "Adam": [1e-3, 3e-3, 1e-2, 3e-2],
    "SGD + KFAC": [0.01, 0.03, 0.1, 0.3],
}


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 4 x 4
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 2 x 2
        nn.Flatten(), nn.Linear(128, 10))


def load(seed: int) -> tuple[Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, (x_test - mean) / std, y_train, y_test


class Trainer:
    """One optimizer's training state: model, optimizer, optional KFAC preconditioner."""

    def __init__(self, kind: str, lr: float, init: dict[str, Tensor], fisher: bool):
        self.model = small_cnn()
        self.model.load_state_dict(init)
        params = self.model.parameters()
        self.optimizer = (torch.optim.Adam(params, lr=lr) if kind == "Adam"
                          else torch.optim.SGD(params, lr=lr, momentum=0.9))
        self.precond = psh.optim.KFAC(self.model) if kind == "SGD + KFAC" else None
        self.fisher = fisher

    def step(self, x: Tensor, y: Tensor) -> float:
        self.optimizer.zero_grad()
        output = self.model(x)
        if self.precond is not None and self.fisher:
            self.precond.backprop_hess(output, "CrossEntropy")
        loss = F.cross_entropy(output, y)
        loss.backward()
        if self.precond is not None:
            self.precond.step()
        self.optimizer.step()
        return loss.item()

    def epoch(self, x: Tensor, y: Tensor, order: list[Tensor]) -> float:
        """One epoch of training; the mean training loss (inf once it is not finite)."""
        self.model.train()
        total = 0.0
        for idx in order:
            try:
                loss = self.step(x[idx], y[idx])
            except FloatingPointError:  # KFAC refuses non-finite factors: diverged
                return math.inf
            if not math.isfinite(loss):
                return math.inf
            total += loss * len(idx)
        return total / len(x)

    def close(self) -> None:
        if self.precond is not None:
            self.precond.close()


def epoch_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[Tensor]]:
    """The same shuffled batch order for every optimizer: ``[epoch][batch] -> indices``."""
    g = torch.Generator().manual_seed(seed)
    return [list(torch.randperm(n, generator=g).split(batch_size)) for _ in range(epochs)]


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    return (model(x).argmax(1) == y).float().mean().item()


def tune(kind: str, init: dict[str, Tensor], x: Tensor, y: Tensor,
         batches: list[list[Tensor]], fisher: bool) -> float:
    """The grid learning rate with the lowest mean training loss over ``batches``."""
    scores = {}
    for lr in tqdm(GRIDS[kind], desc=f"tuning {kind}", leave=False):
        trainer = Trainer(kind, lr, init, fisher)
        losses = []
        for order in batches:
            losses.append(trainer.epoch(x, y, order))
            if math.isinf(losses[-1]):
                break
        trainer.close()
        scores[lr] = sum(losses) / len(losses)
    best = min(scores, key=scores.get)
    print(f"  {kind:<10} lr grid " + "  ".join(f"{lr:g}: {s:.3f}" for lr, s in scores.items())
          + f"  -> lr {best:g}", flush=True)
    return best


def run(kind: str, lr: float, init: dict[str, Tensor], data: tuple[Tensor, ...],
        batches: list[list[Tensor]], fisher: bool) -> dict[str, list[float]]:
    """Train ``len(batches)`` epochs: per epoch the mean training loss, the test accuracy and
    the seconds of training so far (evaluation not counted)."""
    x_train, x_test, y_train, y_test = data
    trainer = Trainer(kind, lr, init, fisher)
    curve: dict[str, list[float]] = {"train loss": [], "test accuracy": [], "seconds": []}
    seconds = 0.0
    for order in tqdm(batches, desc=kind, leave=False):
        start = time.perf_counter()
        loss = trainer.epoch(x_train, y_train, order)
        seconds += time.perf_counter() - start
        curve["train loss"].append(loss)
        curve["test accuracy"].append(accuracy(trainer.model, x_test, y_test))
        curve["seconds"].append(seconds)
        if math.isinf(loss):
            break
    trainer.close()
    return curve


def reached(curve: dict[str, list[float]], target: float) -> str:
    """When the training loss first reached ``target``: ``"epoch 3, 0.41 s"`` or ``"-"``."""
    for epoch, (loss, seconds) in enumerate(zip(curve["train loss"], curve["seconds"]), 1):
        if loss <= target:
            return f"epoch {epoch}, {seconds:.2f} s"
    return "-"


def plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    import matplotlib  # noqa: PLC0415  (optional: pip install per_sample_hooks[examples])
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for name, curve in curves.items():
        epochs = range(1, len(curve["train loss"]) + 1)
        for row, quantity in enumerate(("train loss", "test accuracy")):
            axes[row, 0].plot(epochs, curve[quantity], marker="o", label=name)
            axes[row, 1].plot(curve["seconds"], curve[quantity], marker="o", label=name)
    for column, xlabel in enumerate(("epoch", "seconds of training (1 thread)")):
        axes[0, column].set(xlabel=xlabel, ylabel="mean training loss", yscale="log",
                            title=f"training loss per {xlabel.split()[0].rstrip('s')}")
        axes[1, column].set(xlabel=xlabel, ylabel="test accuracy",
                            title=f"test accuracy per {xlabel.split()[0].rstrip('s')}")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle("small CNN on scikit-learn digits: SGD, Adam, SGD + KFAC")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--tune-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--curvature", choices=("fisher", "empirical"), default="fisher")
    parser.add_argument("--target", type=float, default=0.05,
                        help="report when the training loss reaches this")
    parser.add_argument("--out", default="kfac_digits.png", help="the PNG ('': no plot)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: this model is too small for more to help)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """Tune, train and report; return each optimizer's curves (keyed ``"kind (lr x)"``)."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    data = load(args.seed)
    x_train, y_train = data[0], data[2]
    init = small_cnn().state_dict()
    batches = epoch_batches(len(x_train), args.batch_size, max(args.epochs, args.tune_epochs),
                            args.seed)
    fisher = args.curvature == "fisher"
    print(f"{len(x_train)} training / {len(data[1])} test digits, batch {args.batch_size}; "
          f"tuning the learning rate on {args.tune_epochs} epoch(s)", flush=True)
    curves: dict[str, dict[str, list[float]]] = {}
    for kind in GRIDS:
        lr = tune(kind, init, x_train, y_train, batches[:args.tune_epochs], fisher)
        curves[f"{kind} (lr {lr:g})"] = run(kind, lr, init, data, batches[:args.epochs],
                                            fisher)
    print(f"\n{'':<22} {'s/epoch':>8} {'final loss':>11} {'test acc':>9}  "
          f"training loss <= {args.target:g} at")
    for name, curve in curves.items():
        per_epoch = curve["seconds"][-1] / len(curve["seconds"])
        print(f"{name:<22} {per_epoch:>8.3f} {curve['train loss'][-1]:>11.4f} "
              f"{curve['test accuracy'][-1]:>9.4f}  {reached(curve, args.target)}")
    print("\nper epoch: " + "; ".join(
        f"{name}: " + " ".join(f"{loss:.3f}" for loss in curve["train loss"])
        for name, curve in curves.items()))
    if args.out:
        plot(curves, args.out)
        print(f"saved {args.out}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return curves


if __name__ == "__main__":
    main()
