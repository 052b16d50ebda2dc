"""Per-sample gradients, clipping and DP-SGD on transformers models, against torch.func and Opacus.

    python -m benchmarks.hf_models --threads 1 --rounds 10
    python -m benchmarks.hf_models --models gpt2 --rounds 3 --no-memory
    python -m benchmarks.hf_models --workarounds        # GPT-2 position_ids [B, T], untied
    python -m benchmarks.hf_models --attention eager    # transformers' eager attention

Models (random init from a config, no download, float32, train mode, dropout 0 so that every
method computes the same function): hidden size 128, 2 layers, 4 heads, MLP 512, B=16.

- ``gpt2``: ``GPT2LMHeadModel`` (output layer tied to the token embedding, the default),
  vocabulary 1000, T=64, ``model(input_ids=ids, labels=ids).loss``.
- ``llama``: ``LlamaForCausalLM`` with ``tie_word_embeddings=True`` and grouped-query attention
  (2 key/value heads for 4 query heads), vocabulary 1000, T=64, the same call.
- ``vit``: ``ViTForImageClassification``, 3x32x32 images in 4x4 patches (64 patches and the
  class token), 10 classes, ``model(pixel_values=x, labels=y).loss``.

A step, one per method (each on its own copy of the model, timed interleaved round by round with
``benchmarks/harness.py``; every ratio is to ``plain`` of the same batch):

- ``plain``: ``zero_grad``, the call above, ``loss.backward()``, an SGD step.
- ``psh grad1``: the same on the hooked model, ``psh.compute_grad1(model)`` before the SGD step.
- ``psh grad1 outputs-bwd``: the per-sample gradients only, as torch.func gives them: the
  backward to the hooked layers' outputs (``psh.dp.OutputEdges(model).backward(loss)``, no
  parameter gradient), then ``compute_grad1`` (no step).
- ``torch.func``: ``vmap(grad(loss of one sample))`` with ``functional_call``, the same call on
  a batch of one: the per-sample gradients only (no batch gradient, no step). transformers'
  default attention (``sdpa``) calls CPU flash attention, which ``vmap`` has no batching rule
  for: it runs sample by sample (torch warns). ``--attention eager`` builds every model with
  eager attention instead.
- ``psh clip``: the plain step with ``psh.clip_grads(model, 1.0)`` after ``loss.backward()``.
- ``psh DPSGD``: ``psh.DPSGD`` (noise 0, fixed-size batches, no accountant):
  ``dp.zero_grad(); dp.backward(loss); dp.step()``.
- ``opacus hooks+clip``: Opacus ``GradSampleModule`` + ``DPOptimizer`` (noise 0), the same call.
- ``opacus ghost``: ``GradSampleModuleFastGradientClipping`` + ``DPLossFastGradientClipping``,
  which needs per-sample losses: the logits of ``model(input_ids=ids)`` (``pixel_values=x``) and
  Opacus' criterion (language models: the shifted tokens with ``shape=(B, T-1)``, as Opacus'
  documentation does for generative models).

A method that fails is reported in its row with the error, and the run goes on. Before timing,
every method runs 3 steps (learning rate 0) on a copy, and its per-sample norms (where it gives
them), per-sample gradients (``psh grad1`` rows) or clipped gradient are compared with torch.func's
(the clipping threshold set to the median norm, so that about half the samples are clipped):
``check`` gives the largest relative error (norms: per sample; gradients: the norm of the
difference over the norm of torch.func's, per sample or of the whole clipped gradient).

Memory (``--no-memory`` skips it) as in ``benchmarks/dp.py``: peak RSS of 3 steps in a fresh
process above the RSS once the model is built and one step of the method has run on a
throw-away copy, median of 3 children, for ``MEMORY_METHODS``. The peak of ``psh DPSGD`` is
that of its first two steps, which the unseen-use check runs with an ordinary backward; ``psh
DPSGD no check`` (memory only: ``add_hooks(model, check_unseen=False)`` first) is that of the
other steps.

``--workarounds``: untied output layers and GPT-2's ``position_ids`` passed as ``[B, T]``
(Opacus refuses the defaults).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

if __package__ in (None, ""):  # run as a script: python benchmarks/hf_models.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import per_sample_hooks as psh  # noqa: E402
from benchmarks.dp import CHILD_MALLOC, MEMORY_REPEATS  # noqa: E402
from benchmarks.harness import compare, peak_memory, print_table  # noqa: E402

MAX_NORM = 1.0
METHODS = ["plain", "psh grad1", "psh grad1 outputs-bwd", "torch.func", "psh clip", "psh DPSGD",
           "opacus hooks+clip", "opacus ghost"]
MEMORY_METHODS = ["plain", "psh grad1", "psh clip", "psh DPSGD", "psh DPSGD no check"]
MEMORY_ONLY = {"psh DPSGD no check": "psh DPSGD"}  # measured where the second runs
GOALS = [("psh clip", "plain", 2.0), ("psh DPSGD", "plain", 1.5),
         ("psh grad1", "torch.func", 1.0),
         ("psh grad1 outputs-bwd", "torch.func", 1.0)]  # issue 14, goal 9
CHECK_TOLERANCE = 1e-4  # float32: a correct method is at ~1e-6


# ---------------------------------------------------------------- models and batches

@dataclass(frozen=True)
class Sizes:
    """The models' and batches' sizes (the defaults: the CPU tables; ``benchmarks.gpu`` runs
    GPT-2-small sizes)."""
    batch: int = 16
    length: int = 64
    vocab: int = 1000
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    mlp: int = 512
    image: int = 32
    patch: int = 4
    classes: int = 10


SIZES = Sizes()


@dataclass
class Case:
    """A model and one batch: ``inputs`` are the keyword arguments of the model's call (with
    ``labels``: its ``.loss`` is the batch's mean loss, a mean of the samples' mean losses);
    ``language_model``: the labels are the input tokens, shifted by one inside the model."""
    model: nn.Module
    inputs: dict[str, Tensor]
    language_model: bool


def _language_batch(workarounds: bool, s: Sizes) -> dict[str, Tensor]:
    ids = torch.randint(s.vocab, (s.batch, s.length))
    inputs = {"input_ids": ids, "labels": ids}
    if workarounds:  # GPT-2 builds position_ids [1, T] by default
        inputs["position_ids"] = torch.arange(s.length).repeat(s.batch, 1)
    return inputs


def make_case(name: str, workarounds: bool = False, attention: str = "sdpa",
              sizes: Sizes = SIZES) -> Case:
    """The named model (random init, seed 0) and its batch, on the default device;
    ``workarounds``: untied output layers and GPT-2's ``position_ids`` passed as ``[B, T]``
    (what Opacus needs); ``attention``: transformers' ``attn_implementation``."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    s = sizes
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=s.vocab, n_positions=s.length, n_embd=s.hidden, n_layer=s.layers,
            n_head=s.heads, n_inner=s.mlp, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=not workarounds,
            attn_implementation=attention)
        return Case(transformers.GPT2LMHeadModel(config), _language_batch(workarounds, s), True)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.mlp,
            num_hidden_layers=s.layers, num_attention_heads=s.heads,
            num_key_value_heads=s.heads // 2, max_position_embeddings=s.length,
            tie_word_embeddings=not workarounds, attn_implementation=attention)
        return Case(transformers.LlamaForCausalLM(config), _language_batch(False, s), True)
    if name == "vit":
        config = transformers.ViTConfig(
            hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
            intermediate_size=s.mlp, image_size=s.image, patch_size=s.patch, num_channels=3,
            num_labels=s.classes, attn_implementation=attention)
        inputs = {"pixel_values": torch.randn(s.batch, 3, s.image, s.image),
                  "labels": torch.randint(s.classes, (s.batch,))}
        return Case(transformers.ViTForImageClassification(config), inputs, False)
    raise ValueError(f"unknown model {name!r}")


def describe(name: str, tying: str, s: Sizes = SIZES) -> str:
    """The table title of a case."""
    return {
        "gpt2": f"GPT2LMHeadModel ({tying}), vocab {s.vocab}, d={s.hidden}, {s.layers} layers, "
                f"T={s.length}, B={s.batch}",
        "llama": f"LlamaForCausalLM ({tying}, {s.heads} heads / {s.heads // 2} kv heads), vocab "
                 f"{s.vocab}, d={s.hidden}, {s.layers} layers, T={s.length}, B={s.batch}",
        "vit": f"ViTForImageClassification, {s.image}x{s.image} / {s.patch}x{s.patch} patches "
               f"({(s.image // s.patch) ** 2} + cls), d={s.hidden}, {s.layers} layers, "
               f"B={s.batch}",
    }[name]


CASES = ["gpt2", "llama", "vit"]


def _batch_size(inputs: dict[str, Tensor]) -> int:
    return len(next(iter(inputs.values())))


# ---------------------------------------------------------------- one step per method
# A builder takes (model, inputs, language_model, lr, max_norm) and returns a step; a step that
# gives per-sample norms returns them (None otherwise) or has ``read_norms`` to read them after.

Step = Callable[[], object]


def _sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _after_backward(then: Callable[[nn.Module, float], object] | None, hooked: bool
                    ) -> Callable:
    """A builder of ``zero_grad; loss.backward(); then(model, max_norm); optimizer.step()``,
    whose step returns what ``then`` returns."""
    def builder(model, inputs, language_model, lr, max_norm) -> Step:
        if hooked:
            psh.add_hooks(model)
        optimizer = _sgd(model, lr)

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()
            result = then(model, max_norm) if then is not None else None
            optimizer.step()
            return result
        return step
    return builder


_plain = _after_backward(None, hooked=False)
_psh_grad1 = _after_backward(lambda model, max_norm: psh.compute_grad1(model), hooked=True)
_psh_clip = _after_backward(psh.clip_grads, hooked=True)


def _psh_grad1_outputs_backward(model, inputs, language_model, lr, max_norm) -> Step:
    from per_sample_hooks.dp import OutputEdges
    psh.add_hooks(model)
    edges = OutputEdges(model)

    def step():
        edges.clear()
        edges.backward(model(**inputs).loss)
        psh.compute_grad1(model)
    return step


def _psh_dpsgd(model, inputs, language_model, lr, max_norm, check: bool = True) -> Step:
    psh.add_hooks(model, check_unseen=check)
    batch = _batch_size(inputs)
    dp = psh.DPSGD(model, _sgd(model, lr), noise_multiplier=0.0, max_grad_norm=max_norm,
                   dataset_size=100 * batch, batch_size=batch, sampling="fixed",
                   accountant=None)

    def step():
        dp.zero_grad()
        dp.backward(model(**inputs).loss)
        return dp.step()
    return step


def _opacus_hooks(model, inputs, language_model, lr, max_norm) -> Step:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(_sgd(wrapped, lr), noise_multiplier=0.0, max_grad_norm=max_norm,
                            expected_batch_size=_batch_size(inputs))

    def step():
        optimizer.zero_grad(set_to_none=True)
        wrapped(**inputs).loss.backward()
        optimizer.step()

    def read_norms():
        squares = [p.grad_sample.flatten(1).square().sum(1) for p in model.parameters()]
        return torch.stack(squares).sum(0).sqrt()
    step.read_norms = read_norms
    return step


def _opacus_ghost(model, inputs, language_model, lr, max_norm) -> Step:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    wrapped = GradSampleModuleFastGradientClipping(model, max_grad_norm=max_norm,
                                                   use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(
        _sgd(wrapped, lr), noise_multiplier=0.0, max_grad_norm=max_norm,
        expected_batch_size=_batch_size(inputs))
    criterion = DPLossFastGradientClipping(wrapped, optimizer, nn.CrossEntropyLoss())
    model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    labels = inputs["labels"]
    shape = (len(labels), labels.shape[-1] - 1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = wrapped(**model_inputs).logits
        if language_model:  # position t predicts token t + 1
            loss = criterion(logits[:, :-1].reshape(-1, logits.shape[-1]),
                             labels[:, 1:].reshape(-1), shape=shape)
        else:
            loss = criterion(logits, labels)
        loss.backward()
        optimizer.step()
    step.read_norms = lambda: wrapped.per_sample_gradient_norms
    return step


def per_sample_gradients(model: nn.Module, inputs: dict[str, Tensor]
                         ) -> Callable[[dict[str, Tensor]], dict[str, Tensor]]:
    """torch.func: ``{name: [B, *shape]}`` of the model's loss on each sample alone."""
    def sample_loss(params: dict[str, Tensor], sample: dict[str, Tensor]) -> Tensor:
        batch_of_one = {k: v.unsqueeze(0) for k, v in sample.items()}
        return functional_call(model, params, (), batch_of_one).loss

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0))
    return lambda params: per_sample(params, inputs)


def _torch_func(model, inputs, language_model, lr, max_norm) -> Step:
    compute = per_sample_gradients(model, inputs)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return lambda: compute(params)


BUILDERS: dict[str, Callable[..., Step]] = {
    "plain": _plain, "psh grad1": _psh_grad1,
    "psh grad1 outputs-bwd": _psh_grad1_outputs_backward, "torch.func": _torch_func,
    "psh clip": _psh_clip, "psh DPSGD": _psh_dpsgd, "opacus hooks+clip": _opacus_hooks,
    "opacus ghost": _opacus_ghost,
    "psh DPSGD no check": lambda *args: _psh_dpsgd(*args, check=False),  # memory only
}


def build(method: str, case: Case, lr: float = 1e-3, max_norm: float = MAX_NORM) -> Step:
    """``method``'s step on a copy of the case's model."""
    return BUILDERS[method](copy.deepcopy(case.model), case.inputs, case.language_model, lr,
                            max_norm)


def make_methods(case: str, only: str | None = None, **options) -> dict[str, Step]:
    """``{method: one step}`` on copies of the same model and batch (``only``: one method,
    warmed on a throw-away copy first, as ``benchmarks.dp.make_methods`` does for memory)."""
    built = make_case(case, **options)
    if only:
        build(only, built)()
        gc.collect()
    return {m: build(m, built) for m in ([only] if only else METHODS)}


# ---------------------------------------------------------------- check against torch.func

@dataclass
class Reference:
    """torch.func's per-sample gradients and norms, and the clipped mean at ``max_norm``."""
    grads: dict[str, Tensor]
    norms: Tensor
    max_norm: float
    clipped: dict[str, Tensor]


def reference(case: Case) -> Reference:
    params = {k: v.detach() for k, v in case.model.named_parameters()}
    grads = per_sample_gradients(case.model, case.inputs)(params)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    max_norm = norms.median().item()
    coefficients = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    clipped = {k: torch.einsum("b,b...->...", coefficients, g) / len(norms)
               for k, g in grads.items()}
    return Reference(grads, norms, max_norm, clipped)


def _relative(difference: dict[str, Tensor], truth: dict[str, Tensor], dims: int) -> float:
    """Largest norm of the difference over the truth's norm, over the first ``dims`` dims."""
    def squared(t: dict[str, Tensor]) -> Tensor:
        return sum(v.flatten(dims).square().sum(-1) for v in t.values())
    return (squared(difference) / squared(truth)).sqrt().max().item()


def check(method: str, case: Case, truth: Reference) -> str:
    """Three steps of ``method`` (learning rate 0) on a copy; its errors against ``truth``."""
    model = copy.deepcopy(case.model)
    step = BUILDERS[method](model, case.inputs, case.language_model, 0.0, truth.max_norm)
    for _ in range(3):
        norms = step()
    params = dict(model.named_parameters())
    if method == "torch.func":
        return "(the reference)"
    if method == "plain":
        return ""
    parts = []
    if norms is None and hasattr(step, "read_norms"):
        norms = step.read_norms()
    if isinstance(norms, Tensor):
        parts.append(f"norms {((norms - truth.norms).abs() / truth.norms).max().item():.1e}")
    if method.startswith("psh grad1"):
        difference = {k: params[k].grad1 - g for k, g in truth.grads.items()}
        parts.append(f"grad1 {_relative(difference, truth.grads, 1):.1e}")
    else:
        difference = {k: params[k].grad - g for k, g in truth.clipped.items()}
        parts.append(f"clipped {_relative(difference, truth.clipped, 0):.1e}")
    worst = max(float(p.split()[-1]) for p in parts)
    return ", ".join(parts) + (" WRONG" if worst > CHECK_TOLERANCE else "")


def fallback_units(model: nn.Module) -> list[str]:
    """Types of the modules that ``add_hooks`` hands to the torch.func fallback."""
    state = psh.add_hooks(copy.deepcopy(model))
    return sorted({type(m).__name__ for m in state.modules
                   if isinstance(state.rules[m], psh.FallbackRule)})


def _failure(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:150]}"


# ---------------------------------------------------------------- run

def memory(case: str, methods: list[str], threads: int, options: dict
           ) -> dict[str, float | str]:
    """Median peak MiB above set-up of each method (a failure's message instead)."""
    reports: dict[str, float | str] = {}
    for method in methods:
        try:
            reports[method] = statistics.median(
                peak_memory("benchmarks.hf_models:make_methods", method,
                            kwargs={"case": case, "only": method, **options},
                            threads=threads).extra_mib for _ in range(MEMORY_REPEATS))
        except RuntimeError as error:
            reports[method] = "fails: " + str(error).strip().splitlines()[-1][:60]
    return reports


def _memory_column(reports: dict[str, float | str], method: str) -> str:
    mib, base = reports.get(method), reports.get("plain")
    if not isinstance(mib, float):
        return f"{mib or '':>16}"
    return f"{mib:8.1f} {mib / base:7.2f}" if isinstance(base, float) else f"{mib:8.1f}"


def run_case(name: str, methods: list[str], rounds: int, with_memory: bool, threads: int,
             options: dict) -> None:
    """Check, time and measure every method on the named model; ``options`` of
    :func:`make_case`."""
    case = make_case(name, **options)
    truth = reference(case)
    steps, failures, checks = {}, {}, {}
    for method in methods:
        try:
            checks[method] = check(method, case, truth)
            steps[method] = build(method, case)
            steps[method]()
        except Exception as error:  # report in the row, go on
            failures[method] = _failure(error)
    results = compare(steps, rounds=rounds, warmup=2, budget_s=300)
    measured = [m for m in MEMORY_METHODS if MEMORY_ONLY.get(m, m) in steps]
    reports = memory(name, measured, threads, options) if with_memory else {}
    extra = {"__header__": f"{'peak MiB':>8} {'x plain':>7}  check vs torch.func"}
    extra.update({m: f"{_memory_column(reports, m)}  {checks[m]}" for m in steps})
    title = describe(name, "untied" if options["workarounds"] else "tied")
    print_table(results, "plain", f"\n## {title}  ({threads} thread(s))", extra)
    for method, error in failures.items():
        print(f"{method:<22} fails: {error}")
    for method in MEMORY_ONLY:
        if method in reports:
            print(f"{method:<22} {'(memory only)':>46}  {_memory_column(reports, method)}")
    verdicts = []
    for method, reference_method, goal in GOALS:
        if method in results and reference_method in results:
            ratio = results[method].ratio_to(results[reference_method])
            verdicts.append(f"{method} {ratio:.2f}x {reference_method} (<= {goal}x "
                            f"{'ok' if ratio <= goal else 'MISSED'})")
    if verdicts:
        print("goals: " + "; ".join(verdicts), flush=True)
    print(f"check: max_norm {truth.max_norm:.3g} (median norm; norms "
          f"{truth.norms.min().item():.3g}-{truth.norms.max().item():.3g}); psh fallback units: "
          f"{', '.join(fallback_units(case.model)) or '-'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--workarounds", action="store_true",
                        help="untied output layers, GPT-2 position_ids as [B, T]")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                        help="transformers' attn_implementation (default: its default)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.update(CHILD_MALLOC)  # read by the memory children only
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds, interleaved; "
          f"median and inter-quartile range of ms per step"
          + (" (WORKAROUNDS: untied, GPT-2 position_ids [B, T])" if args.workarounds else "")
          + f"; {args.attention} attention",
          flush=True)
    methods = ["plain"] + [m for m in args.methods if m != "plain"]
    for name in args.models:
        run_case(name, methods, args.rounds, not args.no_memory, args.threads,
                 {"workarounds": args.workarounds, "attention": args.attention})
    return 0


if __name__ == "__main__":
    sys.exit(main())
