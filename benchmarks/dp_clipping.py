"""Per-layer clipping and groups of rows (K=4) against the plain DP step and a plain step.

    python -m benchmarks.dp_clipping                  # mlp, cnn, tokens64; 1 thread
    python -m benchmarks.dp_clipping --models cnn --rounds 20

Models and batches of ``benchmarks.dp`` (``make_case``). Every method sees the same batch of
``B`` rows, so ratios show what the clipping variant costs on top of the same forward and
backward. Methods (each on its own copy of the model, timed interleaved round by round with
``benchmarks/harness.py``: median, IQR, ratio to ``plain`` paired by round):

- ``plain``: ``zero_grad, forward, mean cross-entropy, backward, SGD step``.
- ``clip``: the plain step with ``clip_grads(model, 1.0)`` after the backward.
- ``clip per-layer``: ``clip_grads`` with one threshold per parameter (Opacus' per-layer).
- ``clip K=4``: ``clip_grads(model, 1.0, groups=4)``: ``B / 4`` groups of 4 rows (the rows of
  one example's augmentations), each group's gradient the mean of its rows'.
- ``DPSGD``, ``DPSGD per-layer``, ``DPSGD K=4``: a ``DPSGD`` step (noise multiplier 1, its
  backward without parameter gradients, ``release_records``) with those thresholds / groups.

Measured (1 thread, 15 interleaved rounds, x the plain DP step of the same kind): per-layer
1.00-1.03 everywhere; K=4 1.05 / 1.07 (MLP, clip / DPSGD), 1.22 / 1.01 (CNN: DPSGD forms the
conv gradients on arrival, then sums rows), 1.09 / 1.11 (tokens T=64: the ghost norm of a
group of 4 rows costs (4T)^2, 4x that of its rows).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: python benchmarks/dp_clipping.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.dp import CASES, make_case, plain_step  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402

MULTIPLICITY = 4


def per_parameter(model: torch.nn.Module) -> dict[str, float]:
    """One threshold per parameter, ``1 / sqrt(n)`` each: the total sensitivity stays 1."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: len(names) ** -0.5 for n in names}


def _clip(model, x, y, thresholds, groups):
    psh.add_hooks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        psh.clip_grads(model, thresholds, groups=groups)
        optimizer.step()
    return step


def _dpsgd(model, x, y, thresholds, groups):
    examples = len(x) // (groups or 1)
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0,
                   max_grad_norm=thresholds, dataset_size=100 * examples,
                   batch_size=examples, accountant=None)

    def step():
        dp.zero_grad()
        dp.backward(F.cross_entropy(model(x), y))
        dp.step(groups=groups)
    return step


def variants(build: Callable) -> dict[str, Callable]:
    return {"": lambda m, x, y: build(m, x, y, 1.0, None),
            " per-layer": lambda m, x, y: build(m, x, y, per_parameter(m), None),
            f" K={MULTIPLICITY}": lambda m, x, y: build(m, x, y, 1.0, MULTIPLICITY)}


BUILDERS: dict[str, Callable] = {"plain": plain_step}
BUILDERS.update({f"clip{k}": b for k, b in variants(_clip).items()})
BUILDERS.update({f"DPSGD{k}": b for k, b in variants(_dpsgd).items()})


def run_case(case: str, rounds: int, threads: int) -> None:
    model, x, y = make_case(case)
    steps = {name: build(copy.deepcopy(model), x, y) for name, build in BUILDERS.items()}
    results = compare(steps, rounds=rounds, warmup=2, budget_s=180)
    print_table(results, "plain", f"\n## {CASES[case]}  ({threads} thread(s); K={MULTIPLICITY}: "
                                  f"{len(x) // MULTIPLICITY} groups of the {len(x)} rows)")
    for kind in ("clip", "DPSGD"):
        base = results[kind]
        print(f"x {kind}: " + ", ".join(f"{name} {results[name].ratio_to(base):.2f}"
                                        for name in results if name.startswith(kind + " ")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "tokens64"],
                        choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for case in args.models:
        run_case(case, args.rounds, args.threads)


if __name__ == "__main__":
    main()
