"""nn.MultiheadAttention's paths, each against a plain step:

- ``captured``: the projections captured in the module's own forward (the default);
- ``bias_kv``: the same with ``add_bias_kv=True`` (their per-sample copies captured too);
- ``re-run``: the forward's capture off, as under ``torch.compile``: the call is captured in a
  re-run of torch's forward, the projections' gradients by autograd;
- ``fallback``: every step under a torch-function mode of the user's (one that passes every
  call on, the plain step's too), which the capture leaves alone, in the forward and in a
  re-run: the ``torch.func`` fallback re-runs the call under ``vmap``.

The model: token embeddings (vocab 100, d=128), one self-attention (4 heads, ``batch_first``,
``need_weights=False``), mean over T=64 positions, a Linear head to 10 classes; B=32.

    PYTHONPATH=$PWD python -m benchmarks.attention_paths --threads 1 --rounds 20

Methods (one full step each, interleaved in one process, see harness.py; each on its own copy
of the model, hooked with the defaults, the unseen-use check included): ``plain`` (forward +
backward of the mean cross-entropy, unhooked), ``grad1`` (hooked forward + backward +
``compute_grad1``), ``clip`` (hooked forward + backward + ``clip_grads(model, 1.0)``).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402
from per_sample_hooks.rules import Rule, RuleRegistry, default_registry  # noqa: E402
from per_sample_hooks.rules.attention import MultiheadAttentionRule  # noqa: E402

VOCAB, D, HEADS, T, CLASSES = 100, 128, 4, 64, 10


class AttentionModel(nn.Module):
    def __init__(self, bias_kv: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.attention = nn.MultiheadAttention(D, HEADS, batch_first=True, add_bias_kv=bias_kv)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))


class UncapturedAttentionRule(MultiheadAttentionRule):
    """The attention rule with nothing captured in the forward (as under ``torch.compile``)."""

    def watch(self, *args: object) -> None:
        return None


class Uncaptured(RuleRegistry):
    """The default rules, the attention's forward capture off."""

    def lookup(self, module: nn.Module) -> Rule | None:
        if isinstance(module, nn.MultiheadAttention):
            return UncapturedAttentionRule()
        return default_registry.lookup(module)


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


def make_methods(path: str, batch: int) -> dict:
    torch.manual_seed(0)
    net = AttentionModel(bias_kv=path == "bias_kv")
    tokens, y = torch.randint(0, VOCAB, (batch, T)), torch.randint(0, CLASSES, (batch,))
    registry = Uncaptured() if path == "re-run" else default_registry

    def step(m: nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(tokens), y).backward()

    def run_in_mode(method):
        def run() -> None:
            with PassThrough():
                method()
        return run if path == "fallback" else method

    def hooked(compute) -> object:
        m = copy.deepcopy(net)
        psh.add_hooks(m, registry=registry)

        def run() -> None:
            step(m)
            compute(m)
        return run_in_mode(run)

    plain = copy.deepcopy(net)
    return {"plain": run_in_mode(lambda: step(plain)), "grad1": hooked(psh.compute_grad1),
            "clip": hooked(lambda m: psh.clip_grads(m, 1.0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    paths = ["captured", "bias_kv", "re-run", "fallback"]
    parser.add_argument("--paths", nargs="+", default=paths, choices=paths)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for path in args.paths:
        results = compare(make_methods(path, args.batch), rounds=args.rounds, warmup=3)
        print_table(results, "plain", f"MultiheadAttention {path}: d={D}, {HEADS} heads, T={T}, "
                    f"B={args.batch}, float32, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
