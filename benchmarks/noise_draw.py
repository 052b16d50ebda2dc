"""The Gaussian draw of DP-SGD's noise on CPU: which call is fastest, and what a secure one costs.

    python -m benchmarks.noise_draw                 # the 784-512-512-10 MLP's 669,706 numbers
    python -m benchmarks.noise_draw --rounds 30 --threads 1

Each method draws N(0, 1) for every parameter of the MLP once (interleaved rounds,
``benchmarks/harness.py``; ratios to ``flat normal_``, what ``DPSGD`` does):

- ``per-parameter torch.normal``: a fresh tensor per parameter (what ``DPSGD`` did before).
- ``flat normal_``: ``Tensor.normal_`` on one flat buffer kept across steps.
- ``flat randn(out=)``, ``flat torch.normal(out=)``: the same buffer, other calls.
- ``flat uniform_``: uniforms only: the cost of torch's CPU generator (mt19937) alone.
- ``float64 normal_`` and ``float64 normal_ -> float32``: a float64 draw (and cast).
- ``secure_gaussian_ float32`` / ``float64``: ``secure_rng=True``'s draw (``os.urandom``,
  Box-Muller); ``os.urandom bytes``: the random bytes it reads, alone.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: python benchmarks/noise_draw.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.dp import make_case  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402
from per_sample_hooks.noise import secure_gaussian_  # noqa: E402


def make_methods() -> dict:
    shapes = [p.shape for p in make_case("mlp")[0].parameters()]
    n = sum(s.numel() for s in shapes)
    generator = torch.Generator().manual_seed(0)
    flat, flat64 = torch.empty(n), torch.empty(n, dtype=torch.float64)
    return {
        "flat normal_": lambda: flat.normal_(generator=generator),
        "per-parameter torch.normal": lambda: [torch.normal(0.0, 1.0, s, generator=generator)
                                               for s in shapes],
        "flat randn(out=)": lambda: torch.randn(n, generator=generator, out=flat),
        "flat torch.normal(out=)": lambda: torch.normal(0.0, 1.0, (n,), generator=generator,
                                                        out=flat),
        "flat uniform_": lambda: flat.uniform_(generator=generator),
        "float64 normal_": lambda: flat64.normal_(generator=generator),
        "float64 normal_ -> float32": lambda: flat.copy_(flat64.normal_(generator=generator)),
        "secure_gaussian_ float32": lambda: secure_gaussian_(flat),
        "secure_gaussian_ float64": lambda: secure_gaussian_(flat64),
        "os.urandom bytes": lambda: os.urandom(6 * n),  # 12 bytes per pair, float32
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = compare(make_methods(), rounds=args.rounds, warmup=2)
    print_table(results, "flat normal_", f"\n## N(0, 1) for the 784-512-512-10 MLP's parameters "
                f"({args.threads} thread(s))")


if __name__ == "__main__":
    main()
