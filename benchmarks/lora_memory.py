"""Memory of a peft LoRA step on GPT-2 (frozen layers record nothing): the numbers the hooks
hold after the backward, and the peak memory of a plain step, ``clip_grads`` after
``loss.backward()`` and a ``DPSGD`` step (``benchmarks.harness.peak_memory``: the median of
fresh processes, allocated as ``benchmarks.dp``'s)::

    python -m benchmarks.lora_memory [--vocab 8000]

GPT-2 with hidden 128, 2 layers, T=64, B=16, LoRA rank 8 on ``c_attn`` and ``c_fc``. The
position ids are passed as ``[B, T]`` so that the script also runs on commits from before
broadcast position ids were handled (to compare with them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch
from torch import Tensor

import per_sample_hooks as psh
from benchmarks.dp import CHILD_MALLOC, MEMORY_REPEATS
from benchmarks.harness import peak_memory

BATCH, LENGTH = 16, 64


def lora_gpt2(vocab: int) -> tuple[torch.nn.Module, dict[str, Tensor]]:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=vocab,
                                       n_positions=LENGTH))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn", "c_fc"],
                                             fan_in_fan_out=True))
    ids = torch.randint(0, vocab, (BATCH, LENGTH))
    return model, {"input_ids": ids, "labels": ids,
                   "position_ids": torch.arange(LENGTH).expand(BATCH, LENGTH)}


def make_methods(vocab: int = 8000) -> dict:
    model, inputs = lora_gpt2(vocab)
    trainable = [p for p in model.parameters() if p.requires_grad]
    made: dict = {}

    def plain():
        model.zero_grad()
        model(**inputs).loss.backward()

    def clip():
        made.setdefault("hooks", psh.add_hooks(model))
        model.zero_grad()
        model(**inputs).loss.backward()
        psh.clip_grads(model, 1.0)

    def dpsgd():
        dp = made.setdefault("dp", psh.DPSGD(
            model, torch.optim.SGD(trainable, lr=0.1), noise_multiplier=0.0,
            max_grad_norm=1.0, dataset_size=100 * BATCH, batch_size=BATCH, accountant=None))
        dp.zero_grad()
        dp.backward(model(**inputs).loss)
        dp.step()
    return {"plain": plain, "clip": clip, "dpsgd": dpsgd}


def held_after_backward(vocab: int) -> tuple[float, int, int]:
    """(MiB the hooks hold after one backward, modules recorded, modules hooked)."""
    model, inputs = lora_gpt2(vocab)
    state = psh.add_hooks(model)
    model(**inputs).loss.backward()
    numbers = sum(sum(a.numel() for a in call.args if isinstance(a, Tensor))
                  + sum(g.numel() for passes in call.grads for g in passes)
                  for calls in state.calls.values() for call in calls)
    recorded = sum(1 for calls in state.calls.values() if calls)
    return numbers * 4 / 2**20, recorded, len(state.calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mib, recorded, hooked = held_after_backward(args.vocab)
    print(f"held after the backward: {mib:.1f} MiB ({recorded} of {hooked} hooked modules "
          "recorded)")
    os.environ.update(CHILD_MALLOC)
    plain = None
    for method in ("plain", "clip", "dpsgd"):
        extra = statistics.median(
            peak_memory("benchmarks.lora_memory:make_methods", method,
                        kwargs={"vocab": args.vocab}).extra_mib for _ in range(MEMORY_REPEATS))
        plain = plain or extra
        print(f"{method:6} peak {extra:7.1f} MiB over the setup, {extra / plain:.2f}x plain")


if __name__ == "__main__":
    main()
