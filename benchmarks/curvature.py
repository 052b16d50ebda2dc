"""Curvature: KFAC factors and the empirical Fisher diagonal against BackPACK and ASDL.

    python -m benchmarks.curvature            # both models
    python -m benchmarks.curvature --quick    # fewer rounds (noisy)

Methods (one training step each, timed interleaved, see harness.py):

- ``plain``: forward + backward of the mean cross-entropy, unhooked copy of the model.
- ``kfac EF``: hooked forward + backward + ``compute_kfac`` (empirical-Fisher factors, and the
  gradient: what a KFAC optimizer step needs).
- ``kfac EF no check``: the same with ``add_hooks(model, check_unseen=False)``: the cost of
  the unseen-use check (:mod:`per_sample_hooks.unseen`), which the peers do not have.
- ``kfac EF factors only``: the backward computes the hooked layers' output gradients only
  (``OutputEdges``, no parameter gradient), then ``compute_kfac``: the factors alone, as ASDL's
  default ``forward_and_backward()`` computes them (it skips the parameter gradients).
- ``kfac MC-1``: hooked forward + ``backprop_hess(n_samples=1, edges=)`` (the pass stops at
  the hooked layers' outputs, as ``optim.KFAC`` does but on the steps the check runs) +
  ``compute_kfac`` + backward of the loss (for the gradient): Fisher factors from one sampled
  label, as BackPACK's ``KFAC`` computes (the like-for-like comparison with it).
- ``kfac GGN``: the same with the exact ``backprop_hess`` (one pass per class, to the output
  edges): the exact Gauss-Newton factors, as BackPACK's ``KFLR`` computes; ``kfac GGN to
  leaves``: its passes to the graph's leaves (``edges=None``, parameter gradients computed).
- ``backpack KFAC``: ``extend``ed model and loss, ``backward`` under ``backpack(KFAC())``
  (one MC sample; gradients included); ``backpack KFLR``: the same under ``KFLR()``.
- ``asdl KFAC EF``: ASDL's empirical-Fisher Kronecker factors (``FisherConfig(FISHER_EMP,
  SHAPE_KRON)``) with the gradient (``calc_loss_grad=True``), when the ``asdl`` package
  (``asdfghjkl`` wheel) imports; ``asdl KFAC EF factors only``: its default, without it.
- ``products floor`` / ``products floor factors only`` (models of Linear layers only): a
  plain implementation with no overhead: the unhooked model's forward and backward
  (``factors only``: output gradients only, as above), with each Linear's two factors as one
  matrix product each (``a^T a`` of its input with a column of ones appended for the bias, in
  a forward hook; ``g^T g`` of its output gradient in a tensor hook; no scaling, no checks).
  What a method costs above it is overhead.
- ``fisher diag``: hooked forward + backward + ``compute_fisher_diag``.
- ``backpack SGS``: BackPACK ``SumGradSquared`` (same quantity up to the ``1/N^2`` of the mean).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402
from benchmarks.run import SimpleCNN  # noqa: E402
from per_sample_hooks.dp import OutputEdges  # noqa: E402

MODELS: dict[str, tuple[str, Callable[[], nn.Module], tuple[int, ...], int]] = {
    "mlp784": ("MLP 784-512-512-10 ReLU, B=128, cross-entropy",
               lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512),
                                     nn.ReLU(), nn.Linear(512, 10)), (784,), 128),
    "cnn001": ("CNN of seed 001, 1x28x28, B=64, cross-entropy", SimpleCNN, (1, 28, 28), 64),
}


def backpack_methods(build: Callable[[], nn.Module], state: dict, x: torch.Tensor,
                     y: torch.Tensor) -> dict[str, Callable[[], object]]:
    try:
        from backpack import backpack, extend
        from backpack.extensions import KFAC, KFLR, SumGradSquared
    except ImportError as error:  # pragma: no cover
        print(f"  BackPACK not available: {error}")
        return {}
    model = build()
    model.load_state_dict(state)
    if isinstance(model, SimpleCNN):  # BackPACK needs modules, not F.relu / torch.flatten
        model = nn.Sequential(model.conv1, nn.ReLU(), model.conv2, nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), model.fc1, nn.ReLU(), model.fc2)
    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())

    def run(extension: object) -> Callable[[], object]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            with backpack(extension):
                loss.backward()
        return step
    return {"backpack KFAC": run(KFAC(mc_samples=1)), "backpack KFLR": run(KFLR()),
            "backpack SGS": run(SumGradSquared())}


def asdl_methods(build: Callable[[], nn.Module], state: dict, x: torch.Tensor, y: torch.Tensor
                 ) -> dict[str, Callable[[], object]]:
    try:
        from asdl import FISHER_EMP, SHAPE_KRON, FisherConfig, get_fisher_maker
    except ImportError as error:
        print(f"  ASDL not available ({error}); pip install --no-deps asdfghjkl")
        return {}
    model = build()
    model.load_state_dict(state)
    config = FisherConfig(fisher_type=FISHER_EMP, fisher_shapes=[SHAPE_KRON],
                          data_size=x.shape[0])
    maker = get_fisher_maker(model, config)

    def run(calc_loss_grad: bool) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            dummy = maker.setup_model_call(model, x)
            maker.setup_loss_call(F.cross_entropy, dummy, y)
            maker.forward_and_backward(calc_loss_grad=calc_loss_grad)
        return step
    try:
        run(True)()
    except Exception as error:  # noqa: BLE001 (report any incompatibility and go on)
        print(f"  ASDL failed on this model: {type(error).__name__}: {error}")
        return {}
    return {"asdl KFAC EF": run(True), "asdl KFAC EF factors only": run(False)}


def product_floor(build: Callable[[], nn.Module], state: dict, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, Callable[[], object]]:
    """``products floor`` methods (see the module docstring); none unless every module with
    parameters is a Linear."""
    model = build()
    model.load_state_dict(state)
    owners = [m for m in model.modules() if m._parameters]
    if not owners or not all(isinstance(m, nn.Linear) for m in owners):
        return {}
    sizes = {m: m.in_features + (m.bias is not None) for m in owners}
    buffers = {m: (torch.empty(sizes[m], sizes[m]), torch.empty(m.out_features, m.out_features))
               for m in owners}
    outputs: list[torch.Tensor] = []

    def product_into(out: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            torch.mm(g.t(), g, out=out)
        return hook

    def forward_hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        a, g_out = inputs[0].detach(), buffers[module][1]
        if module.bias is not None:
            a = torch.cat([a, a.new_ones(len(a), 1)], 1)
        torch.mm(a.t(), a, out=buffers[module][0])
        output.register_hook(product_into(g_out))
        outputs.append(output)

    for m in owners:
        m.register_forward_hook(forward_hook)

    def run(factors_only: bool) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            outputs.clear()
            loss = F.cross_entropy(model(x), y)
            torch.autograd.backward(loss, inputs=outputs if factors_only else None)
        return step
    return {"products floor": run(False), "products floor factors only": run(True)}


def make_methods(name: str, seed: int = 0) -> dict[str, Callable[[], object]]:
    _, build, shape, batch = MODELS[name]
    torch.manual_seed(seed)
    plain = build()
    hooked, unchecked, factors_only = (copy.deepcopy(plain) for _ in range(3))
    psh.add_hooks(hooked)
    psh.add_hooks(unchecked, check_unseen=False)
    x = torch.randn(batch, *shape)
    y = torch.randint(10, (batch,))

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()

    def kfac_ef_of(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            psh.compute_kfac(model)
        return step

    edges = OutputEdges(factors_only)

    def kfac_ef_factors_only() -> None:
        factors_only.zero_grad(set_to_none=True)
        edges.backward(F.cross_entropy(factors_only(x), y))
        psh.compute_kfac(factors_only)

    sampled = copy.deepcopy(plain)
    sampled_edges = OutputEdges(sampled)

    def kfac_ggn(n_samples: int | None, to_edges: bool = True) -> Callable[[], None]:
        def step() -> None:
            sampled.zero_grad(set_to_none=True)
            output = sampled(x)
            psh.backprop_hess(output, "CrossEntropy", n_samples=n_samples, retain_graph=True,
                              edges=sampled_edges if to_edges else None)
            psh.compute_kfac(sampled)
            F.cross_entropy(output, y).backward()  # the gradient, as BackPACK's step has it
        return step

    def fisher_diag() -> None:
        hooked.zero_grad(set_to_none=True)
        F.cross_entropy(hooked(x), y).backward()
        psh.compute_fisher_diag(hooked)

    methods = {"plain": plain_step, "kfac EF": kfac_ef_of(hooked),
               "kfac EF no check": kfac_ef_of(unchecked),
               "kfac EF factors only": kfac_ef_factors_only, "kfac MC-1": kfac_ggn(1),
               "kfac GGN": kfac_ggn(None), "kfac GGN to leaves": kfac_ggn(None, False)}
    methods.update(product_floor(build, plain.state_dict(), x, y))
    methods.update(asdl_methods(build, plain.state_dict(), x, y))
    methods["fisher diag"] = fisher_diag
    methods.update(backpack_methods(build, plain.state_dict(), x, y))
    return methods


def report_goals(name: str, results: dict) -> None:
    """Print the goals: ``kfac EF`` at most 1.5x plain on mlp784 (with the products floor
    beside it); faster than BackPACK's KFAC and ASDL's empirical-Fisher factors, and the Fisher
    diagonal faster than BackPACK's SumGradSquared (paired per-round ratios) on every model."""
    pairs = [("kfac EF", "backpack KFAC"), ("kfac MC-1", "backpack KFAC"),
             ("kfac GGN", "backpack KFLR"),
             ("kfac EF", "asdl KFAC EF"),
             ("kfac EF no check", "asdl KFAC EF"),
             ("kfac EF factors only", "asdl KFAC EF factors only"),
             ("fisher diag", "backpack SGS")]
    if name == "mlp784":
        for ours in ("kfac EF", "kfac EF factors only"):
            ratio = results[ours].ratio_to(results["plain"])
            floor = ours.replace("kfac EF", "products floor")
            below = (f" (the products floor: {results[floor].ratio_to(results['plain']):.2f}x)"
                     if floor in results else "")
            print(f"  goal {ours} <= 1.5x plain on mlp784: {ratio:.2f}x "
                  f"{'ok' if ratio <= 1.5 else 'MISSED'}{below}")
    for ours, peer in pairs:
        if peer in results:
            ratio = results[ours].ratio_to(results[peer])
            verdict = "ok" if ratio < 1 else "MISSED"
            label = "goal" if ours != "kfac EF no check" else "for comparison:"
            print(f"  {label} {ours} faster than {peer}: {ratio:.2f}x its time "
                  f"{verdict if label == 'goal' else ''}".rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 25)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
          "interleaved; median and inter-quartile range of ms per step", flush=True)
    for name in args.models:
        title = MODELS[name][0]
        print()
        results = compare(make_methods(name), rounds=rounds, warmup=2, min_sample_ms=20)
        print_table(results, "plain", title)
        report_goals(name, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
