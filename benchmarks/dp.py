"""Per-sample norms and DP clipping: per_sample_hooks against a plain step and the peers.

    PYTHONPATH=. python benchmarks/dp.py                 # every model, time and memory
    PYTHONPATH=. python benchmarks/dp.py --models mlp --repeats 10 --no-memory

A *step* is ``zero_grad, forward, mean cross-entropy, backward, [norms / clipping], SGD step``.
Methods (each on its own copy of the same model, timed interleaved round by round, median):

- ``plain``: the ordinary step (the reference of every ratio).
- ``psh norms``: per_sample_hooks ``compute_norms`` after the backward (no clipping).
- ``psh clip``: per_sample_hooks ``clip_grads`` (max_norm 1) after the backward.
- ``opacus hooks+clip``: Opacus ``GradSampleModule`` + ``DPOptimizer`` (noise 0): per-sample
  gradients materialized, clipped, summed.
- ``opacus ghost``: ``GradSampleModuleFastGradientClipping`` + ``DPLossFastGradientClipping``:
  ghost norms, then a second backward with the clipping coefficients.
- ``backpack L2``: BackPACK ``BatchL2Grad`` (norms only).
- ``func vmap``: ``torch.func.vmap(grad)`` per-sample gradients, their norms, the clipped sum.

Memory: each (model, method) runs 3 steps in a fresh subprocess; ``peak MB`` is the peak RSS
during the steps minus the RSS after building model, data and wrappers (what the steps add:
activations, gradients, per-sample buffers, temporaries); its ratio is to ``plain``'s.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import per_sample_hooks as psh

MAX_NORM = 1.0
METHODS = ["plain", "psh norms", "psh clip", "opacus hooks+clip", "opacus ghost",
           "backpack L2", "func vmap"]


# ---------------------------------------------------------------- models and data

class SeedCNN(nn.Module):
    """The CNN of seed 001 (the torch.func per-sample-gradients tutorial)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return self.fc2(F.relu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm MLP block: ``x + W2 gelu(W1 LayerNorm(x))``."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """Token model: embedding + positions, MLP blocks, LayerNorm, mean-pooled classifier."""

    def __init__(self, vocab: int = 1000, length: int = 64, d: int = 256, blocks: int = 2,
                 classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(length, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.positions(positions)
        return self.head(self.norm(self.blocks(x)).mean(1))


def make_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10))
        x = torch.randn(128, 784)
    elif name == "cnn":
        model, x = SeedCNN(), torch.randn(64, 1, 28, 28)
    elif name.startswith("tokens"):
        length = int(name[len("tokens"):])
        model = TokenMLP(length=length)
        x = torch.randint(1000, (32, length))
    else:
        raise ValueError(f"unknown model {name!r}")
    return model, x, torch.randint(10, (x.shape[0],))


CASES = {"mlp": "MLP 784-512-512-10, B=128", "cnn": "CNN of seed 001, B=64",
         "tokens64": "token MLP (Embedding, LayerNorm, 2 MLP blocks, d=256), B=32, T=64",
         "tokens256": "token MLP (Embedding, LayerNorm, 2 MLP blocks, d=256), B=32, T=256"}


# ---------------------------------------------------------------- one step per method

def _plain(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def _psh(model, x, y, clip: bool):
    psh.add_hooks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if clip:
            psh.clip_grads(model, MAX_NORM)
        else:
            psh.compute_norms(model)
        optimizer.step()
    return step


def _opacus_hooks(model, x, y):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=1e-3), noise_multiplier=0.0,
                            max_grad_norm=MAX_NORM, expected_batch_size=len(x))

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
    return step


def _opacus_ghost(model, x, y):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    wrapped = GradSampleModuleFastGradientClipping(model, max_grad_norm=MAX_NORM,
                                                   use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(wrapped.parameters(), lr=1e-3), noise_multiplier=0.0,
        max_grad_norm=MAX_NORM, expected_batch_size=len(x))
    criterion = DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss())

    def step():
        optimizer.zero_grad(set_to_none=True)
        criterion(wrapped(x), y).backward()
        optimizer.step()
    return step


def _backpack(model, x, y):
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad
    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with backpack(BatchL2Grad()):
            loss_fn(model(x), y).backward()
        torch.stack([p.batch_l2 for p in model.parameters()]).sum(0).sqrt()
        optimizer.step()
    return step


def _func_vmap(model, x, y):
    from torch.func import functional_call, grad, vmap
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(params.values(), lr=1e-3)

    def sample_loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))
    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def step():
        optimizer.zero_grad(set_to_none=True)
        detached = {k: v.detach() for k, v in params.items()}
        grads = per_sample(detached, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
        coefficients = (MAX_NORM / (norms + 1e-6)).clamp(max=1) / len(x)
        for name, g in grads.items():
            params[name].grad = torch.einsum("b,b...->...", coefficients, g)
        optimizer.step()
    return step


BUILDERS: dict[str, Callable] = {
    "plain": _plain,
    "psh norms": lambda m, x, y: _psh(m, x, y, clip=False),
    "psh clip": lambda m, x, y: _psh(m, x, y, clip=True),
    "opacus hooks+clip": _opacus_hooks,
    "opacus ghost": _opacus_ghost,
    "backpack L2": _backpack,
    "func vmap": _func_vmap,
}


def build(case: str, method: str) -> Callable[[], None]:
    model, x, y = make_case(case)
    return BUILDERS[method](copy.deepcopy(model), x, y)


# ---------------------------------------------------------------- timing and memory

def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 2
                     ) -> dict[str, float]:
    """Median seconds per step; one call of every method per round so drift hits all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(repeats):
        for method, step in steps.items():
            start = time.perf_counter()
            step()
            times[method].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in times.items()}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(case: str, method: str, threads: int) -> None:
    """Print the RSS after setup and the RSS high-water mark of 3 steps (Linux: the mark is
    reset through /proc/self/clear_refs, so that the import of torch does not count)."""
    torch.set_num_threads(threads)
    model, x, y = make_case(case)
    model = copy.deepcopy(model)
    step = BUILDERS[method](model, x, y)
    base = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    for _ in range(3):
        step()
    print(json.dumps({"base": base, "peak": _status_mb("VmHWM")}))


def measure_memory(case: str, method: str, threads: int) -> float | str:
    """Max-RSS growth (MB) of 3 steps in a fresh process, or the error's last line."""
    result = subprocess.run(
        [sys.executable, __file__, "--memory-child", case, method, "--threads", str(threads)],
        capture_output=True, text=True)
    if result.returncode != 0:
        return "fails: " + (result.stderr.strip().splitlines() or ["?"])[-1][:60]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    return numbers["peak"] - numbers["base"]


def run_case(case: str, methods: list[str], repeats: int, memory: bool, threads: int) -> None:
    steps, failures = {}, {}
    for method in methods:
        try:
            step = build(case, method)
            step()
            steps[method] = step
        except Exception as error:  # a peer that cannot run this model: report, go on
            failures[method] = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:50]}"
    timings = time_interleaved(steps, repeats)
    memories = {m: measure_memory(case, m, threads) for m in methods} if memory else {}
    plain_time, plain_memory = timings.get("plain"), memories.get("plain")
    print(f"\n## {CASES[case]}  (median of {repeats}, {threads} thread(s))\n")
    print("| method | ms / step | x plain | peak MB | x plain |")
    print("|---|---|---|---|---|")
    for method in methods:
        if method in failures:
            print(f"| {method} | {failures[method]} | | | |")
            continue
        ms = timings[method] * 1e3
        ratio = timings[method] / plain_time if plain_time else float("nan")
        mem = memories.get(method)
        if isinstance(mem, float):
            mem_ratio = f"{mem / plain_memory:.2f}" if isinstance(plain_memory, float) \
                and plain_memory > 0 else ""
            mem_text = f"{mem:.1f}"
        else:
            mem_text, mem_ratio = (mem or ""), ""
        print(f"| {method} | {ms:.1f} | {ratio:.2f} | {mem_text} | {mem_ratio} |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-child", nargs=2, metavar=("MODEL", "METHOD"))
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child, args.threads)
        return
    torch.set_num_threads(args.threads)
    for case in args.models:
        run_case(case, args.methods, args.repeats, not args.no_memory, args.threads)


if __name__ == "__main__":
    main()
