"""Every benchmark on a CUDA GPU, side by side in one process, with peak GPU memory (issue 15).

    python -m benchmarks.gpu                                  # everything, ~10-15 minutes
    python -m benchmarks.gpu --suites gpt2 --lengths 256 1024 --rounds 10
    python -m benchmarks.gpu --device cpu --suites gpt2 --gpt2-small 0 --rounds 2   # dry run

The suites reuse the CPU benchmarks' methods, built with the GPU as torch's default device (so
every model, batch and buffer of a method lives there):

- ``grad1``: ``benchmarks.run`` (compute_grad1 against a plain step and ``torch.func``);
- ``dp``: ``benchmarks.dp`` (norms, clipping, the DPSGD step's backward; Opacus hooks and ghost
  clipping, BackPACK, ``torch.func``);
- ``curvature``: ``benchmarks.curvature`` (KFAC factors and second moments against BackPACK and
  ASDL);
- ``gpt2``: ``benchmarks.hf_models`` on a GPT-2-small-sized ``GPT2LMHeadModel`` (random init:
  vocabulary 50257, d=768, 12 layers, 12 heads, MLP 3072; tied output layer) at each
  ``--lengths`` (batch ``--gpt2-batch``): plain, grad1, ``torch.func``, clipping, DPSGD,
  Opacus hooks and ghost clipping (which refuse the tied output layer and GPT-2's default
  ``[1, T]`` position ids: ``--workarounds`` unties it and passes ``[B, T]``, as the CPU table).

Time: each method is wrapped in ``torch.cuda.synchronize()`` and timed interleaved with
``benchmarks/harness.py`` (median per-round ratio to ``plain``). Memory: for each method in turn,
two steps after ``torch.cuda.reset_peak_memory_stats()``; ``peak MiB`` is
``max_memory_allocated`` minus what was allocated before them (the models of all methods are
alive throughout and count for none), and its ratio to ``plain``'s. Goals checked (issue 15):
on the GPT-2-sized model the DPSGD step at most 1.2x a plain step and its peak at most 1.1x;
grad1 at most 0.5x ``torch.func``; clipping faster than Opacus ghost clipping.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from collections.abc import Callable

import torch

if __package__ in (None, ""):  # run as a script: python benchmarks/gpu.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import curvature, dp, hf_models, run  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402

GPT2_SMALL = hf_models.Sizes(vocab=50257, hidden=768, layers=12, heads=12, mlp=3072)
GPT2_METHODS = ["plain", "psh grad1", "torch.func", "psh clip", "psh DPSGD", "opacus hooks+clip",
                "opacus ghost"]
GOALS = [("psh DPSGD", "plain", 1.2, 1.1), ("psh grad1", "torch.func", 0.5, None),
         ("psh clip", "opacus ghost", 1.0, None), ("psh DPSGD", "opacus ghost", 1.0, None)]
"""(method, reference, time ratio at most, peak-memory ratio at most or None)."""


def synchronized(step: Callable[[], object], device: torch.device) -> Callable[[], None]:
    def run_and_wait() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run_and_wait


def peak_mib(step: Callable[[], None], device: torch.device) -> float | None:
    """Peak memory of two steps above what was allocated before them (None off CUDA)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    step()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def measure(title: str, methods: dict[str, Callable[[], object]], device: torch.device,
            rounds: int) -> dict[str, tuple[float, float | None]]:
    """Time and peak memory of every method; prints the table; ``{method: (x plain, MiB)}``."""
    steps, failures = {}, {}
    for name, method in methods.items():
        try:
            steps[name] = synchronized(method, device)
            steps[name]()
        except Exception as error:  # noqa: BLE001 - report in the table, go on
            steps.pop(name, None)
            failures[name] = f"{type(error).__name__}: {str(error).strip()[:150]}"
    memory = {name: peak_mib(step, device) for name, step in steps.items()}
    results = compare(steps, rounds=rounds, warmup=2, budget_s=240)
    base = memory.get("plain")
    extra = {"__header__": f"{'peak MiB':>9} {'x plain':>7}"}
    for name, mib in memory.items():
        extra[name] = "" if mib is None else (
            f"{mib:9.1f} {mib / base:7.2f}" if base else f"{mib:9.1f}")
    print_table(results, "plain", title, extra)
    for name, error in failures.items():
        print(f"{name:<28} fails: {error}")
    return {name: (results[name].ratio_to(results["plain"]), memory[name]) for name in results}


def report_goals(rows: dict[str, tuple[float, float | None]]) -> None:
    verdicts = []
    for method, reference, time_goal, memory_goal in GOALS:
        if method not in rows or reference not in rows:
            continue
        ratio = rows[method][0] / rows[reference][0]
        verdicts.append(f"{method} {ratio:.2f}x {reference} time (<= {time_goal} "
                        f"{'ok' if ratio <= time_goal else 'MISSED'})")
        mib, base = rows[method][1], rows[reference][1]
        if memory_goal is not None and mib is not None and base:
            verdicts.append(f"{method} {mib / base:.2f}x {reference} peak memory (<= "
                            f"{memory_goal} {'ok' if mib / base <= memory_goal else 'MISSED'})")
    if verdicts:
        print("goals: " + "; ".join(verdicts), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--suites", nargs="+", default=["grad1", "dp", "curvature", "gpt2"],
                        choices=["grad1", "dp", "curvature", "gpt2"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--workarounds", action="store_true",
                        help="GPT-2 untied, position_ids [B, T] (what Opacus' rows need)")
    parser.add_argument("--gpt2-small", type=int, default=1,
                        help="1: GPT-2-small sizes; 0: the CPU table's small GPT-2 (dry runs)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_default_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; {args.rounds} rounds, interleaved, "
          f"median and inter-quartile range of ms per step, float32", flush=True)
    if "grad1" in args.suites:
        for model in run.MODELS:
            measure(f"\n## grad1: {run.MODELS[model][0]}", run.make_methods(model), device,
                    args.rounds)
    if "dp" in args.suites:
        for case, title in dp.CASES.items():
            measure(f"\n## DP: {title}", dp.make_methods(case), device, args.rounds)
    if "curvature" in args.suites:
        for model in curvature.MODELS:
            measure(f"\n## curvature: {curvature.MODELS[model][0]}",
                    curvature.make_methods(model), device, args.rounds)
    if "gpt2" in args.suites:
        base = GPT2_SMALL if args.gpt2_small else hf_models.SIZES
        for length in args.lengths:
            sizes = dataclasses.replace(base, batch=args.gpt2_batch, length=length)
            case = hf_models.make_case("gpt2", workarounds=args.workarounds, sizes=sizes)
            methods = {m: hf_models.build(m, case) for m in GPT2_METHODS}
            tying = "untied" if args.workarounds else "tied"
            rows = measure(f"\n## {hf_models.describe('gpt2', tying, sizes)}", methods, device,
                           args.rounds)
            report_goals(rows)
            del case, methods
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
