"""Per-sample input Hessians ``[B, d, d]`` of a 3-layer tanh MLP (seed 004's setting).

    python benchmarks/batch_hessian.py [--batch 500] [--dim 200] [--threads 2] [--memory]

Methods, each computing all B Hessians of ``f(x_i)`` (scalar output, hidden width = d):

- ``batch_hessian``: :func:`per_sample_hooks.batch_hessian` with a one-sample ``fn``
  (``vmap(jacrev(jacrev(fn)))`` over chunks of samples).
- ``batch_hessian batched``: the same with ``batched=True`` (``fn`` maps ``[B, d] -> [B]``).
- ``seed-004 trick``: ``jacobian`` (``vectorize=True``) of the batch-summed input gradient, which
  is ``[d, B, d]``, then ``swapaxes(0, 1)``.
- ``loop hessian``: ``torch.autograd.functional.hessian`` per sample (default
  ``vectorize=False``), and ``loop hessian vec`` with ``vectorize=True``. Both are timed on the
  first ``--loop-samples`` samples and the times scaled by ``B / loop-samples`` (marked
  "extrapolated" in the output).

Timings are interleaved (benchmarks/harness.py); ``--memory`` adds the peak resident memory
above the set-up, each method in a fresh subprocess.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian

if __package__ in (None, ""):  # run as a script: python benchmarks/batch_hessian.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import Timing, compare, peak_memory, print_table  # noqa: E402


def mlp(d: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 1))
    return net.requires_grad_(False)


def seed_trick(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Seed 004: the Jacobian of the batch-summed gradient, ``[d, B, d]`` -> ``[B, d, d]``."""
    def summed_gradient(inputs: Tensor) -> Tensor:
        return torch.autograd.grad(f(inputs).sum(), inputs, create_graph=True)[0].sum(0)
    return jacobian(summed_gradient, x, vectorize=True).swapaxes(0, 1)


def make_methods(batch: int = 500, dim: int = 200, loop_samples: int = 10
                 ) -> dict[str, Callable[[], Tensor]]:
    net = mlp(dim)
    x = torch.randn(batch, dim)
    one = lambda s: net(s).squeeze(-1)  # noqa: E731  ([d] -> [] and [B, d] -> [B])
    subset = x[:loop_samples]
    return {
        "batch_hessian": lambda: psh.batch_hessian(one, x),
        "batch_hessian batched": lambda: psh.batch_hessian(one, x, batched=True),
        "seed-004 trick": lambda: seed_trick(one, x.clone().requires_grad_(True)),
        "loop hessian": lambda: torch.stack([hessian(one, s) for s in subset]),
        "loop hessian vec": lambda: torch.stack([hessian(one, s, vectorize=True)
                                                 for s in subset]),
    }


LOOPS = ("loop hessian", "loop hessian vec")


def check(methods: dict[str, Callable[[], Tensor]], batch: int, dim: int,
          loop_samples: int) -> None:
    """Every method gives the same Hessians (float32 rounding)."""
    reference = methods["batch_hessian"]()
    assert reference.shape == (batch, dim, dim), reference.shape
    for name, method in methods.items():
        got = method()
        want = reference[:loop_samples] if name in LOOPS else reference
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--dim", type=int, default=200)
    parser.add_argument("--loop-samples", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = {"batch": args.batch, "dim": args.dim, "loop_samples": args.loop_samples}
    methods = make_methods(**kwargs)
    check(methods, args.batch, args.dim, args.loop_samples)
    results = compare(methods, rounds=args.rounds, warmup=1, budget_s=120)
    factor = args.batch / args.loop_samples
    for name in LOOPS:  # scale the subset's time to the whole batch
        t = results[name]
        results[name] = Timing(t.name, [s * factor for s in t.samples], t.rounds)
    extra = {"__header__": "note"}
    for name in LOOPS:
        extra[name] = f"extrapolated from {args.loop_samples} samples (x{factor:g})"
    if args.memory:
        extra["__header__"] = "peak MiB above set-up / note"
        for name in methods:
            report = peak_memory("benchmarks.batch_hessian:make_methods", name, kwargs=kwargs,
                                 steps=1, threads=args.threads)
            note = f"{report.extra_mib:.0f} MiB"
            if name in LOOPS:
                note += f" ({args.loop_samples} samples; {extra[name]})"
            extra[name] = note
    print_table(results, baseline="batch_hessian", extra=extra,
                title=f"Per-sample input Hessians [B, d, d], 3-layer tanh MLP, B={args.batch}, "
                      f"d={args.dim}, {args.threads} threads, float32")


if __name__ == "__main__":
    main()
