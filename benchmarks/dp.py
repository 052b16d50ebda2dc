"""Per-sample norms and DP clipping: per_sample_hooks against a plain step and the peers.

    python -m benchmarks.dp                       # every model, time and memory
    python -m benchmarks.dp --models mlp cnn --rounds 20 --no-memory

A *step* is ``zero_grad, forward, mean cross-entropy, backward, [norms / clipping], SGD step``.
Methods (each on its own copy of the same model, timed interleaved round by round with
``benchmarks/harness.py``: median, IQR):

- ``plain``: the ordinary step (the reference of every ratio).
- ``psh norms``: per_sample_hooks ``compute_norms`` after the backward (no clipping).
- ``psh clip``: per_sample_hooks ``clip_grads`` (max_grad_norm 1) after the ordinary backward.
- ``psh clip outputs-bwd``: the backward asks autograd for the hooked layers' output gradients
  only (``OutputEdges(model, form_on_arrival=True).backward``, what ``DPSGD.backward`` does),
  skipping the parameter gradients that ``clip_grads`` rebuilds clipped
  anyway, and forming per-sample gradients on arrival where they are smaller than the
  captured pair; then ``clip_grads(release_records=True)`` (as ``DPSGD.step``). A step the
  unseen-use check runs (the first two, and sampled ones) takes an ordinary backward instead.
- ``psh clip outputs-bwd no check``: the same with ``check_unseen=False``: the memory of the
  steps the check does not run on (the memory run's 3 steps include the checked first two).
- ``psh norms outputs-bwd``: the same backward, then ``compute_norms`` (norms when the
  parameter gradients are not wanted: monitoring, or a clipping of one's own).
- ``psh DPSGD noise 0`` / ``psh DPSGD noise 1``: ``DPSGD`` (no accountant) with noise
  multiplier 0 and 1: ``dp.zero_grad(); dp.backward(loss); dp.step()`` (the Gaussian draw is
  the difference; drawn ahead on a background thread, the default).
- ``psh DPSGD noise 1 at step``: the same with ``noise_ahead=False``: the noise drawn in
  ``step()``.
- ``psh DPSGD noise only``: ``dp.step(empty_batch=True)`` with noise multiplier 1, no forward
  or backward: the draw, zero gradients and the SGD step (the cost of the noise alone).
- ``opacus hooks+clip``: Opacus ``GradSampleModule`` + ``DPOptimizer`` (noise 0): per-sample
  gradients materialized, clipped, summed.
- ``opacus ghost``: ``GradSampleModuleFastGradientClipping`` + ``DPLossFastGradientClipping``:
  ghost norms, then a second backward with the clipping coefficients.
- ``backpack L2``: BackPACK ``BatchL2Grad`` (norms only).
- ``func vmap``: ``torch.func.vmap(grad)`` per-sample gradients, their norms, the clipped sum.

Memory (``harness.peak_memory``): each (model, method) runs 3 steps in a fresh subprocess;
``peak MiB`` is the peak RSS during the steps above the RSS once model, data and wrappers are
built and one step of the same method has run on a throwaway copy of the model, then freed (so
one-time costs of the process, such as the JIT kernels of each matrix shape, count for no
method, while what a method keeps per model counts): what the steps add (activations,
gradients, captured tensors, per-sample buffers, temporaries).
Median of 3 children, each with ``MALLOC_MMAP_THRESHOLD_=65536`` (see ``CHILD_MALLOC``). The
ratio is to ``plain``'s.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: python benchmarks/dp.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import compare, peak_memory, print_table  # noqa: E402

MAX_NORM = 1.0
METHODS = ["plain", "psh norms", "psh norms outputs-bwd", "psh clip", "psh clip outputs-bwd",
           "psh clip outputs-bwd no check", "psh DPSGD noise 0", "psh DPSGD noise 1",
           "psh DPSGD noise 1 at step", "psh DPSGD noise only",
           "opacus hooks+clip",
           "opacus ghost",
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
        # position ids per sample: a [T] input broadcast over the batch would mix the samples'
        # gradients of the position table (hooks, Opacus and BackPACK all refuse it)
        positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(len(tokens), 1)
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

def plain_step(model, x, y):
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


def _psh_outputs_backward(model, x, y, clip: bool, check: bool = True):
    from per_sample_hooks.dp import OutputEdges
    psh.add_hooks(model, check_unseen=check)
    edges = OutputEdges(model, form_on_arrival=True)  # as DPSGD's
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        edges.backward(F.cross_entropy(model(x), y))
        if clip:
            psh.clip_grads(model, MAX_NORM, release_records=True)  # as DPSGD's
        else:
            psh.compute_norms(model)
        optimizer.step()
    return step


def _psh_dpsgd(model, x, y, noise: float, empty: bool = False, ahead: bool = True):
    psh.add_hooks(model)
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=noise,
                   max_grad_norm=MAX_NORM, dataset_size=10 * len(x), batch_size=len(x),
                   accountant=None, generator=torch.Generator().manual_seed(0),
                   noise_ahead=ahead)

    def step():
        dp.zero_grad()
        if not empty:
            dp.backward(F.cross_entropy(model(x), y))
        dp.step(empty_batch=empty)
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
    "plain": plain_step,
    "psh norms": lambda m, x, y: _psh(m, x, y, clip=False),
    "psh clip": lambda m, x, y: _psh(m, x, y, clip=True),
    "psh norms outputs-bwd": lambda m, x, y: _psh_outputs_backward(m, x, y, clip=False),
    "psh clip outputs-bwd": lambda m, x, y: _psh_outputs_backward(m, x, y, clip=True),
    "psh clip outputs-bwd no check": lambda m, x, y: _psh_outputs_backward(m, x, y, clip=True,
                                                                           check=False),
    "psh DPSGD noise 0": lambda m, x, y: _psh_dpsgd(m, x, y, 0.0),
    "psh DPSGD noise 1": lambda m, x, y: _psh_dpsgd(m, x, y, 1.0),
    "psh DPSGD noise 1 at step": lambda m, x, y: _psh_dpsgd(m, x, y, 1.0, ahead=False),
    "psh DPSGD noise only": lambda m, x, y: _psh_dpsgd(m, x, y, 1.0, empty=True),
    "opacus hooks+clip": _opacus_hooks,
    "opacus ghost": _opacus_ghost,
    "backpack L2": _backpack,
    "func vmap": _func_vmap,
}


def make_methods(case: str, only: str | None = None) -> dict[str, Callable[[], None]]:
    """``{method: one step}`` on copies of the same model and batch (``only``: one method)."""
    model, x, y = make_case(case)
    methods = [only] if only else METHODS
    if only:  # memory child: one step of the method on a throwaway copy first, so that
        # one-time costs of the process (autograd engine thread, kernel workspaces and JIT
        # kernels of each matrix shape the method uses) count for no method; what the method
        # keeps per model (persistent buffers, hooks) is freed with the copy and counts
        BUILDERS[only](copy.deepcopy(model), x, y)()
        gc.collect()
    return {m: BUILDERS[m](copy.deepcopy(model), x, y) for m in methods}


MEMORY_REPEATS = 3
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Memory children allocate every block above 64 KiB with its own mmap, returned to the system
when freed, so that their RSS follows the live tensors instead of glibc's heap high-water mark
(with the default dynamic threshold, repeated runs of one method differed by up to 2x)."""

GOALS = [("psh norms", 1.3), ("psh norms outputs-bwd", 1.3), ("psh clip", 1.4),
         ("psh clip outputs-bwd", 1.4)]  # issue #4
MEMORY_GOALS = [("psh clip", 1.2), ("psh clip outputs-bwd", 1.2)]


def run_case(case: str, methods: list[str], rounds: int, memory: bool, threads: int) -> None:
    steps, failures = {}, {}
    for method in methods:
        try:
            step = make_methods(case, method)[method]
            step()
            steps[method] = step
        except Exception as error:  # a peer that cannot run this model: report, go on
            failures[method] = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
    results = compare(steps, rounds=rounds, warmup=2, budget_s=180)
    extra, reports = {"__header__": "peak MiB  x plain" if memory else ""}, {}
    if memory:
        for method in steps:
            try:
                reports[method] = statistics.median(
                    peak_memory("benchmarks.dp:make_methods", method,
                                kwargs={"case": case, "only": method},
                                threads=threads).extra_mib for _ in range(MEMORY_REPEATS))
            except RuntimeError as error:
                extra[method] = "fails: " + str(error).strip().splitlines()[-1][:50]
        base = reports.get("plain")
        for method, mib in reports.items():
            extra[method] = f"{mib:8.1f}  {mib / base:7.2f}" if base else f"{mib:8.1f}"
    print_table(results, "plain", f"\n## {CASES[case]}  ({threads} thread(s))", extra)
    for method, error in failures.items():
        print(f"{method:<22} fails: {error}")
    plain = results["plain"].median
    verdicts = [f"{m} {results[m].median / plain:.2f}x (<= {g}x)"
                for m, g in GOALS if m in results]
    for method, goal in MEMORY_GOALS:
        if reports.get(method) is not None and reports.get("plain"):
            ratio = reports[method] / reports["plain"]
            verdicts.append(f"{method} memory {ratio:.2f}x (<= {goal}x)")
    print("goals: " + "; ".join(verdicts), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.update(CHILD_MALLOC)  # read by the memory children only (already started here)
    methods = ["plain"] + [m for m in args.methods if m != "plain"]
    for case in args.models:
        run_case(case, methods, args.rounds, not args.no_memory, args.threads)


if __name__ == "__main__":
    main()
