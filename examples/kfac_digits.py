"""KFAC as a preconditioner for plain SGD, against SGD and Adam, on scikit-learn's digits.

    python examples/kfac_digits.py [--epochs 8] [--out kfac_digits.png] [--curvature fisher]

A small CNN (two 3x3 convolutions and a linear layer, about 6,000 parameters) on the 8x8 digit
images shipped with scikit-learn (no download; 80% train / 20% test, stratified), mini-batches
of 64, cross-entropy. Three optimizers:

- ``SGD``: ``torch.optim.SGD(momentum=0.9)``;
- ``Adam``: ``torch.optim.Adam`` (default betas);
- ``SGD + KFAC``: the same SGD after ``per_sample_hooks.optim.KFAC`` replaced the gradients of
  the convolutions and the linear layer by ``(kron(G, A) + damping)^-1 grad``, the factors
  from ``compute_kfac`` (running average 0.95, eigendecompositions every 10 steps, damping
  3e-2, KL clipping 1e-3: the step is scaled so that ``lr^2 <P, grad>`` stays below it, which
  bounds KFAC's large steps along low-curvature directions; with the clip the learning rate
  matters less). ``--curvature fisher`` (default) reads Fisher factors (``backprop_hess``: one extra
  backward pass per class, every ``--update-freq`` steps); ``empirical`` reads the factors of
  the ordinary backward (empirical Fisher, no extra pass).

Learning rates: each optimizer gets the best of a small grid (``GRIDS``), judged by the mean
training loss over the first ``--tune-epochs`` epoch(s) from the same initialization and batch
order; then every optimizer trains ``--epochs`` epochs from that same initialization. Prints
the mean training loss per epoch (and final test loss / accuracy), and saves the curves
(training loss, test accuracy per epoch) as a PNG at ``--out``.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn

import per_sample_hooks as psh

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

    def __init__(self, kind: str, lr: float, init: dict[str, Tensor], args: argparse.Namespace):
        self.model = small_cnn()
        self.model.load_state_dict(init)
        params = self.model.parameters()
        self.optimizer = (torch.optim.Adam(params, lr=lr) if kind == "Adam"
                          else torch.optim.SGD(params, lr=lr, momentum=0.9))
        self.precond = None
        self.fisher = args.curvature == "fisher"
        if kind == "SGD + KFAC":
            self.precond = psh.optim.KFAC(self.model, damping=args.damping, factor_decay=0.95,
                                          update_freq=args.update_freq, inverse_freq=10,
                                          kl_clip=args.kl_clip or None, lr=lr)

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

    def close(self) -> None:
        if self.precond is not None:
            self.precond.close()


def epoch_batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[Tensor]]:
    """The same shuffled batch order for every optimizer: ``[epoch][batch] -> indices``."""
    g = torch.Generator().manual_seed(seed)
    return [list(torch.randperm(n, generator=g).split(batch_size)) for _ in range(epochs)]


def train(trainer: Trainer, x: Tensor, y: Tensor, batches: list[list[Tensor]],
          on_epoch: Callable[[int, float], None] | None = None) -> list[float]:
    """Mean training loss of each epoch."""
    losses = []
    for epoch, order in enumerate(batches, 1):
        trainer.model.train()
        total = sum(trainer.step(x[idx], y[idx]) * len(idx) for idx in order)
        losses.append(total / len(x))
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    return losses


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    model.eval()
    out = model(x)
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def tune(kind: str, init: dict[str, Tensor], x: Tensor, y: Tensor,
         batches: list[list[Tensor]], args: argparse.Namespace) -> float:
    """The grid learning rate with the lowest mean training loss over ``batches``."""
    scores = {}
    for lr in GRIDS[kind]:
        trainer = Trainer(kind, lr, init, args)
        try:
            losses = train(trainer, x, y, batches)
            mean = sum(losses) / len(losses)
        except FloatingPointError:  # KFAC refuses non-finite factors: diverged
            mean = float("inf")
        trainer.close()
        scores[lr] = mean if mean == mean else float("inf")  # NaN (diverged): worst
    best = min(scores, key=scores.get)
    print(f"  {kind:<11} lr grid " + "  ".join(f"{lr:g}: {s:.3f}" for lr, s in scores.items())
          + f"  -> lr {best:g}", flush=True)
    return best


def plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    import matplotlib  # noqa: PLC0415  (optional: pip install per_sample_hooks[examples])
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in curves.items():
        epochs = range(1, len(curve["train loss"]) + 1)
        left.plot(epochs, curve["train loss"], marker="o", label=name)
        right.plot(epochs, curve["test accuracy"], marker="o", label=name)
    left.set(xlabel="epoch", ylabel="mean training loss", yscale="log",
             title="training loss (cross-entropy)")
    right.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle("small CNN on scikit-learn digits: SGD, Adam, SGD + KFAC")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--tune-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--damping", type=float, default=3e-2)
    parser.add_argument("--update-freq", type=int, default=1)
    parser.add_argument("--kl-clip", type=float, default=1e-3, help="0: off")
    parser.add_argument("--curvature", choices=("fisher", "empirical"), default="fisher")
    parser.add_argument("--out", default="kfac_digits.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    x_train, x_test, y_train, y_test = load(args.seed)
    init = small_cnn().state_dict()
    batches = epoch_batches(len(x_train), args.batch_size, max(args.epochs, args.tune_epochs),
                            args.seed)
    print(f"{len(x_train)} training / {len(x_test)} test digits, batch {args.batch_size}; "
          f"tuning the learning rate on {args.tune_epochs} epoch(s)", flush=True)
    curves: dict[str, dict[str, list[float]]] = {}
    for kind in GRIDS:
        lr = tune(kind, init, x_train, y_train, batches[:args.tune_epochs], args)
        trainer = Trainer(kind, lr, init, args)
        curve = curves[f"{kind} (lr {lr:g})"] = {"train loss": [], "test accuracy": []}

        def record(epoch: int, loss: float, trainer: Trainer = trainer,
                   curve: dict = curve) -> None:
            curve["train loss"].append(loss)
            curve["test accuracy"].append(evaluate(trainer.model, x_test, y_test)[1])
        train(trainer, x_train, y_train, batches[:args.epochs], record)
        test_loss, test_accuracy = evaluate(trainer.model, x_test, y_test)
        trainer.close()
        print(f"{kind:<11} lr {lr:<6g} train loss per epoch: "
              + " ".join(f"{loss:.4f}" for loss in curve["train loss"])
              + f"  | final train loss {curve['train loss'][-1]:.4f}, test loss "
              f"{test_loss:.4f}, test accuracy {test_accuracy:.4f}", flush=True)
    plot(curves, args.out)
    print(f"saved {args.out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
