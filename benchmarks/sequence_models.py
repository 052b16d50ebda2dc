"""Per-sample gradients of whole sequence models, and the cost of the unseen-use check.

    PYTHONPATH=$PWD python -m benchmarks.sequence_models            # all, ~2-3 minutes
    PYTHONPATH=$PWD python -m benchmarks.sequence_models --models transformer --quick

Methods (one full training step each, timed interleaved in one process, see harness.py):

- ``plain``: forward + backward of the mean cross-entropy on an unhooked copy.
- ``hooks``: the same on the hooked model (capture only), then ``clear_backprops``.
- ``grad1``: hooked forward + backward + ``compute_grad1`` (unseen-use check on, the default).
- ``grad1 no check``: the same with ``add_hooks(..., check_unseen=False)``.
- ``grad1 checked``: with ``check_unseen="always"``: what a step the check runs on costs.
- ``grad1 edges``: hooked forward, ``psh.dp.OutputEdges(model).backward(loss)`` (autograd's
  backward to the hooked modules' outputs only: no parameter gradients, so no weight-gradient
  products; an ordinary backward on the steps the unseen-use check runs), ``compute_grad1``:
  the fast path when ``p.grad`` is not needed.
- ``floor``: ``plain`` plus writing B*P floats once into an existing buffer (``fill_``): the
  least any method that runs the ordinary backward and materializes per-sample gradients
  takes (as in ``benchmarks.run``).
- ``torch.func``: ``vmap(grad(loss of one sample))`` over the whole model with
  ``functional_call``. For the LSTM, ``vmap`` over ``nn.LSTM`` fails on torch 2.13 (no batching
  rule for the fused kernel), so torch.func runs on an equivalent unrolled LSTM (the cell's
  matmuls in a loop over time, same parameters).

Models: the transformer classifier (embedding, learned positions, 2 encoder layers, head; at
d=64, T=32 and at issue 13's d=128, T=64) and the LSTM classifier of ``tests/models.py``,
``benchmarks.dp``'s token MLP (T=64, d=256), a Conv1d+GroupNorm stack, and the MLP
784-512-512-10 (check overhead only).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from models import LSTMClassifier, TransformerClassifier  # noqa: E402

import per_sample_hooks as psh  # noqa: E402
from benchmarks.dp import TokenMLP  # noqa: E402
from benchmarks.harness import check_cost, compare, print_table  # noqa: E402
from per_sample_hooks.rules.raw_parameters import RawParameterRule  # noqa: E402


def unrolled_lstm_classifier(params: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """``LSTMClassifier.forward`` with the LSTM written out (what torch.func can vmap)."""
    x = F.embedding(tokens, params["embedding.weight"])
    for layer in range(2):
        w_ih, w_hh = params[f"lstm.weight_ih_l{layer}"], params[f"lstm.weight_hh_l{layer}"]
        bias = params[f"lstm.bias_ih_l{layer}"] + params[f"lstm.bias_hh_l{layer}"]
        pre = x @ w_ih.t() + bias
        h = c = pre.new_zeros(*pre.shape[:-2], w_hh.shape[1])
        states = []
        for t in range(pre.shape[-2]):
            i, f, g, o = (pre[..., t, :] + h @ w_hh.t()).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            states.append(h)
        x = torch.stack(states, -2)
    return F.linear(h, params["head.weight"], params["head.bias"])


MODELS: dict[str, tuple[str, Callable[[], nn.Module], Callable[[int], Tensor], int]] = {
    # name: (title, model, input maker, batch)
    "transformer": ("Transformer classifier: vocab 1000, d=64, 4 heads, ff 128, 2 layers, "
                    "T=32, B=32",
                    lambda: TransformerClassifier(1000, 64, 4, 128, 2, 32, 10),
                    lambda b: torch.randint(0, 1000, (b, 32)), 32),
    "transformer128": ("Transformer classifier: vocab 1000, d=128, 4 heads, ff 256, 2 layers, "
                       "T=64, B=32 (issue 13's token transformer)",
                       lambda: TransformerClassifier(1000, 128, 4, 256, 2, 64, 10),
                       lambda b: torch.randint(0, 1000, (b, 64)), 32),
    "tokens": ("Token MLP (benchmarks.dp's tokens64): Embedding + positions, 2 pre-norm MLP blocks "
               "(LayerNorm, Linear 256-1024-256, GELU), LayerNorm, head, T=64, B=32",
               lambda: TokenMLP(length=64), lambda b: torch.randint(0, 1000, (b, 64)), 32),
    "lstm": ("LSTM classifier: vocab 1000, d=64, 2-layer LSTM h=128, T=32, B=32",
             lambda: LSTMClassifier(1000, 64, 128, 10),
             lambda b: torch.randint(0, 1000, (b, 32)), 32),
    "conv1d": ("Conv1d+GroupNorm: 3 blocks Conv1d(32, 32, 5, padding=2), GroupNorm(4, 32), ReLU"
               " on [B, 32, 64], mean-pooled head, B=32",
               lambda: nn.Sequential(*[layer for _ in range(3) for layer in (
                   nn.Conv1d(32, 32, 5, padding=2), nn.GroupNorm(4, 32), nn.ReLU())],
                   nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, 10)),
               lambda b: torch.randn(b, 32, 64), 32),
    "mlp784": ("MLP 784-512-512-10 ReLU, B=128 (unseen-use check overhead)",
               lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                                     nn.ReLU(), nn.Linear(512, 10)),
               lambda b: torch.randn(b, 784), 128),
}


GRAD1_GOALS = {"conv1d": 0.8, "transformer128": 0.8, "tokens": 0.8}
"""grad1 over torch.func, issue 13 (the token transformer and the Conv1d+GroupNorm model);
1.2x for the others."""


def make_methods(name: str, seed: int = 0) -> dict[str, Callable[[], object]]:
    _, build, make_input, batch = MODELS[name]
    torch.manual_seed(seed)
    plain = build()
    hooked, unchecked, always, edged = (copy.deepcopy(plain) for _ in range(4))
    psh.add_hooks(hooked)
    edges = psh.dp.OutputEdges(edged)
    psh.add_hooks(unchecked, check_unseen=False)
    psh.add_hooks(always, check_unseen="always")
    x, y = make_input(batch), torch.randint(0, 10, (batch,))
    floor_buffer = torch.empty(batch * sum(p.numel() for p in plain.parameters()))

    def step(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None
        F.cross_entropy(m(x), y).backward()

    def hooks_step() -> None:
        step(hooked)
        psh.clear_backprops(hooked)

    def grad1_step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            step(model)
            psh.compute_grad1(model)
            run.steps += 1
        run.model, run.steps = model, 0
        return run

    def floor_step() -> None:
        step(plain)
        floor_buffer.fill_(1.0)

    def edges_step() -> None:
        edges.backward(F.cross_entropy(edged(x), y))
        psh.compute_grad1(edged)

    params = {k: v.detach() for k, v in plain.named_parameters()}
    if name == "lstm":
        def forward(p: dict, xi: Tensor) -> Tensor:
            return unrolled_lstm_classifier(p, xi)
        expected = unrolled_lstm_classifier(params, x[:2])
        torch.testing.assert_close(expected, plain(x[:2]), rtol=1e-4, atol=1e-5)
    else:
        def forward(p: dict, xi: Tensor) -> Tensor:
            return functional_call(plain, p, (xi,))

    def sample_loss(p: dict, xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(forward(p, xi.unsqueeze(0)), yi.unsqueeze(0))

    per_sample_grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    methods = {"plain": lambda: step(plain), "hooks": hooks_step,
               "grad1": grad1_step(hooked), "grad1 no check": grad1_step(unchecked),
               "grad1 checked": grad1_step(always), "grad1 edges": edges_step,
               "floor": floor_step, "torch.func": lambda: per_sample_grads(params, x, y)}
    if name == "mlp784":
        del methods["torch.func"], methods["hooks"], methods["grad1 edges"], methods["floor"]
    return methods


def native_and_fallback(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """Types of the hooked modules: with a rule of their own, with their raw parameters'
    uses followed (re-run by the fallback where they cannot be), fallback units."""
    state = psh.add_hooks(model)
    try:
        kinds: dict[str, set[str]] = {"native": set(), "followed": set(), "units": set()}
        for m in state.modules:
            rule = state.rules[m]
            kind = "units" if isinstance(rule, psh.FallbackRule) else \
                "followed" if isinstance(rule, RawParameterRule) else "native"
            kinds[kind].add(type(m).__name__)
    finally:
        psh.remove_hooks(model)
    return sorted(kinds["native"]), sorted(kinds["followed"]), sorted(kinds["units"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="default 15 (--quick: 7)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (7 if args.quick else 15)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
          "interleaved; median and inter-quartile range of ms per step", flush=True)
    for name in args.models:
        title, build, *_ = MODELS[name]
        native, followed, units = native_and_fallback(build())
        methods = make_methods(name)
        results = compare(methods, rounds=rounds, warmup=2, min_sample_ms=20)
        print()
        print_table(results, "plain", title)
        print(f"  native rules: {', '.join(native)}; raw parameters followed: "
              f"{', '.join(followed) or '-'}; fallback units: {', '.join(units) or '-'}")
        if "torch.func" in results:
            goal, func = GRAD1_GOALS.get(name, 1.2), results["torch.func"]
            for method in ("grad1", "grad1 edges"):
                ratio = results[method].ratio_to(func)
                print(f"  goal {method} <= {goal}x torch.func: {ratio:.2f}x "
                      f"{'ok' if ratio <= goal else 'MISSED'}")
            print(f"  (plain alone: {results['plain'].ratio_to(func):.2f}x torch.func, the "
                  f"floor {results['floor'].ratio_to(func):.2f}x: bounds for any method that "
                  "runs the ordinary backward, and writes per-sample gradients; per-round "
                  "ratios)")
        check = results["grad1"].median / results["grad1 no check"].median - 1
        print(f"  unseen-use check overhead: {check:+.1%} of grad1 (medians of two copies, "
              "within their noise; one model on and off: python -m benchmarks.check_cost)")
        print("  " + check_cost(methods["grad1"], results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
