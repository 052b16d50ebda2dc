"""Per-sample gradients: compute_grad1 against a plain step, torch.func, a loop and the floor.

    python -m benchmarks.run                      # every model, ~1-2 minutes on 2 cores
    python -m benchmarks.run --quick              # fewer rounds
    python -m benchmarks.run --models mlp003 mlp784 --threads 2 --memory

Methods (each one full training step, timed interleaved in one process, see harness.py):

- ``plain``: forward + backward of the mean (or sum) loss on an unhooked copy of the model.
- ``hooks``: the same on the hooked model (capture only), then ``clear_backprops``.
- ``grad1``: hooked forward + backward + ``compute_grad1``.
- ``grad1 no check``: the same with ``add_hooks(..., check_unseen=False)`` (what the unseen-use
  check costs).
- ``grad1 checked``: with ``check_unseen="always"`` (what a step the check runs on costs).
- ``torch.func``: ``vmap(grad(loss of one sample))`` with ``functional_call``.
- ``loop``: one forward + backward per sample, gradients stacked.
- ``floor``: ``plain`` plus writing B*P floats once into an existing buffer (``fill_``): what
  any method that materializes per-sample gradients must at least pay.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

if __package__ in (None, ""):  # run as a script: python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import check_cost, compare, peak_memory, print_table  # noqa: E402


class SimpleCNN(nn.Module):
    """The CNN of seed 001 (the torch.func per-sample-gradients tutorial), MNIST-sized."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


def sum_of_outputs(output: Tensor, target: Tensor) -> Tensor:
    return output.sum()


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


MODELS: dict[str, tuple[str, Callable[[], nn.Module], tuple[int, ...], int, Callable, str]] = {
    # name: (title, model, input shape without batch, batch size, loss, loss_type)
    "mlp003": ("MLP 10-32-32-10, B=256, sum of outputs (seed 003)",
               lambda: nn.Sequential(nn.Linear(10, 32), nn.Linear(32, 32), nn.Linear(32, 10)),
               (10,), 256, sum_of_outputs, "sum"),
    "cnn001": ("CNN of seed 001, 1x28x28, B=64, cross-entropy", SimpleCNN,
               (1, 28, 28), 64, cross_entropy, "mean"),
    "mlp784": ("MLP 784-512-512-10 ReLU, B=128, cross-entropy",
               lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                                     nn.ReLU(), nn.Linear(512, 10)),
               (784,), 128, cross_entropy, "mean"),
}


def unsupported(model: nn.Module) -> list[str]:
    """Types of modules with trainable parameters and no rule."""
    return sorted({type(m).__name__ for m in model.modules()
                   if next(m.parameters(recurse=False), None) is not None
                   and not psh.is_supported(m)})


def make_methods(model: str, seed: int = 0) -> dict[str, Callable[[], object]]:
    """``{method: one training step}`` for the named model (see the module docstring)."""
    _, build, shape, batch, loss_fn, loss_type = MODELS[model]
    torch.manual_seed(seed)
    plain = build()
    hooked, unchecked, always = (copy.deepcopy(plain) for _ in range(3))
    psh.add_hooks(hooked)
    psh.add_hooks(unchecked, check_unseen=False)
    psh.add_hooks(always, check_unseen="always")
    x = torch.randn(batch, *shape)
    y = torch.randint(10, (batch,))
    n_floats = batch * sum(p.numel() for p in plain.parameters())
    floor_buffer = torch.empty(n_floats)

    def step(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None
        loss_fn(m(x), y).backward()

    def plain_step() -> None:
        step(plain)

    def hooks_step() -> None:
        step(hooked)
        psh.clear_backprops(hooked)

    def grad1_step() -> None:
        step(hooked)
        psh.compute_grad1(hooked, loss_type=loss_type)
        grad1_step.steps += 1

    grad1_step.model, grad1_step.steps = hooked, 0

    def unchecked_step() -> None:
        step(unchecked)
        psh.compute_grad1(unchecked, loss_type=loss_type)

    def checked_step() -> None:
        step(always)
        psh.compute_grad1(always, loss_type=loss_type)

    def floor_step() -> None:
        step(plain)
        floor_buffer.fill_(1.0)

    params = {k: v.detach() for k, v in plain.named_parameters()}

    def sample_loss(params: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss_fn(functional_call(plain, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def func_step() -> None:
        per_sample_grads(params, x, y)

    weights = list(plain.parameters())

    def loop_step() -> None:
        grads = [torch.autograd.grad(loss_fn(plain(x[i:i + 1]), y[i:i + 1]), weights)
                 for i in range(batch)]
        [torch.stack(g) for g in zip(*grads)]

    return {"plain": plain_step, "hooks": hooks_step, "grad1": grad1_step,
            "grad1 no check": unchecked_step, "grad1 checked": checked_step,
            "torch.func": func_step, "loop": loop_step,
            "floor": floor_step}


GOALS = {  # (model, method, reference, at most): issue 13's
    "grad1 <= 0.5x torch.func": (None, "grad1", "torch.func", 0.5),
    "grad1 <= 1.1x floor on mlp784": ("mlp784", "grad1", "floor", 1.1),
    "grad1 <= 2x plain on mlp003": ("mlp003", "grad1", "plain", 2.0),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--memory", action="store_true",
                        help="also measure each method's peak memory in a subprocess")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (7 if args.quick else 25)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
          "interleaved; median and inter-quartile range of ms per step", flush=True)
    missed = []
    for name in args.models:
        title, build, *_ = MODELS[name]
        missing = unsupported(build())
        if missing:
            print(f"\n{title}\n  skipped: no rule for {', '.join(missing)}")
            continue
        methods = make_methods(name)
        results = compare(methods, rounds=rounds, warmup=2, min_sample_ms=20,
                          every={"loop": 5})
        extra = None
        if args.memory:
            extra = {"__header__": "peak MiB above setup"}
            for method in methods:
                report = peak_memory("benchmarks.run:make_methods", method,
                                     kwargs={"model": name}, threads=args.threads)
                extra[method] = f"{report.extra_mib:>8.1f}"
        print()
        print_table(results, "plain", f"{title}", extra)
        print("  " + check_cost(methods["grad1"], results))
        for goal, (model, method, reference, limit) in GOALS.items():
            if model in (None, name):
                ratio = results[method].ratio_to(results[reference])
                verdict = "ok" if ratio <= limit else "MISSED"
                bound = "" if reference == "floor" else \
                    f" (floor: {results['floor'].ratio_to(results[reference]):.2f}x)"
                print(f"  goal {goal}: {ratio:.2f}x {verdict}{bound}")
                if ratio > limit:
                    missed.append(f"{name}: {goal}")
    if missed:
        print("\nmissed goals: " + "; ".join(missed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
