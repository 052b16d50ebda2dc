"""What the default unseen-use check costs: one hooked model, the check on and off.

    python -m benchmarks.check_cost                     # every model, ~2 minutes
    python -m benchmarks.check_cost --models mlp003 --blocks 60

``benchmarks.run`` and ``benchmarks.sequence_models`` time ``grad1`` and ``grad1 no check`` on
two copies of a model, whose medians differ by a few percent with the check or without (memory
layout, caches). Here one hooked model runs ``grad1`` steps (forward, backward,
``compute_grad1``) in blocks, alternately with its check as ``add_hooks`` made it (the default
policy: checked on new structures and sampled steps) and with the check detached (what
``check_unseen=False`` would give); the cost is the median over pairs of blocks of the ratio of
their times, minus one. It includes the sampled checks and everything the check does on the
steps it does not check.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import per_sample_hooks as psh
from benchmarks import run, sequence_models
from per_sample_hooks.capture import HookState


def check_switch(state: HookState) -> Callable[[bool], None]:
    """``switch(on)``: attach or detach the state's unseen-use check (its object and its two
    callbacks), as ``add_hooks(check_unseen=True / False)`` would have left the state."""
    check = state.unseen
    callbacks = [(state.listeners.on_clear, check.reset), (state.listeners.on_backward, check.due)]

    def switch(on: bool) -> None:
        # ends the last step (a checked one's parameter hooks come off with it); the block's
        # first forward starts the next (the check's start, if on)
        state.clear()
        state.unseen = check if on else None
        for hooks, callback in callbacks:
            if on and callback not in hooks:
                hooks.append(callback)
            elif not on and callback in hooks:
                hooks.remove(callback)
    return switch


def grad1_step(name: str) -> tuple[Callable[[], None], HookState]:
    """One grad1 training step of a model of ``benchmarks.run`` or ``benchmarks.sequence_models``,
    and the model's hook state."""
    torch.manual_seed(0)
    if name in run.MODELS:
        _, build, shape, batch, loss_fn, loss_type = run.MODELS[name]
        model, x, y = build(), torch.randn(batch, *shape), torch.randint(10, (batch,))
    else:
        _, build, make_input, batch = sequence_models.MODELS[name]
        model, x, y = build(), make_input(batch), torch.randint(0, 10, (batch,))
        loss_fn, loss_type = F.cross_entropy, "mean"
    state = psh.add_hooks(model)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        loss_fn(model(x), y).backward()
        psh.compute_grad1(model, loss_type=loss_type)
    return step, state


def measure(name: str, blocks: int, block_ms: float) -> tuple[float, float, int, int]:
    """``(median ratio on / off, its inter-quartile half-width, checks, steps)``."""
    step, state = grad1_step(name)
    switch = check_switch(state)
    for _ in range(3):  # warm-up; the first two steps are checked (new structure, cost)
        step()
    start = time.perf_counter()
    step()
    per_block = max(1, round(block_ms / 1e3 / (time.perf_counter() - start)))

    def block(on: bool) -> float:
        switch(on)
        begin = time.perf_counter()
        for _ in range(per_block):
            step()
        return time.perf_counter() - begin
    checks_before = state.unseen.schedule.checks
    ratios = []
    for _ in range(blocks):
        on, off = block(True), block(False)
        ratios.append(on / off)
    switch(True)
    quartiles = statistics.quantiles(ratios, n=4)
    return (statistics.median(ratios), (quartiles[2] - quartiles[0]) / 2,
            state.unseen.schedule.checks - checks_before, blocks * per_block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    models = [*run.MODELS, *(m for m in sequence_models.MODELS if m not in run.MODELS)]
    parser.add_argument("--models", nargs="+", choices=models,
                        default=["mlp003", "mlp784", "cnn001", "transformer128", "conv1d"])
    parser.add_argument("--blocks", type=int, default=30, help="pairs of blocks (on, off)")
    parser.add_argument("--block-ms", type=float, default=100.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); grad1 steps with the "
          "default check, against the same model with it detached, alternating blocks")
    for name in args.models:
        ratio, spread, checks, steps = measure(name, args.blocks, args.block_ms)
        print(f"  {name:<15} check {ratio - 1:+.1%} of grad1 (+-{spread:.1%}); "
              f"{checks} of {steps} steps checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
