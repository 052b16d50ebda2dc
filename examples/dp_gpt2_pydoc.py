"""DP-SGD training of a small GPT-2 on Python's own help texts, character by character.

    python examples/dp_gpt2_pydoc.py            # under 2 minutes on one CPU core

The text is the prose of ``pydoc_data.topics`` (what ``help("for")`` prints; it ships with
Python, nothing is downloaded): the paragraphs that are not indented, each once (many topics
repeat others). Every tenth topic is held out; the rest is cut into windows of ``--context``
characters, one training sample each (the unit of privacy is one window). With the code and
tables kept, a model this small trained for two minutes samples mostly spaces, dashes and
``|``; on prose it learns words. The vocabulary is a fixed alphabet (newline and printable
ASCII, one token for any other character), so it reveals nothing about the text. The model is a
randomly initialized ``transformers.GPT2LMHeadModel`` (``lm_head`` tied to the input
embedding, as in GPT-2), called as transformers documents it: ``model(input_ids=ids,
labels=ids).loss``.

Each step Poisson-samples a batch, runs one ordinary forward and backward, clips every sample's
gradient (``per_sample_hooks.DPSGD``: no per-sample gradients stored), adds Gaussian noise and
tells Opacus' RDP accountant (``pip install per_sample_hooks[examples]``); Adam's learning rate
decays linearly to 0. After every epoch it prints the training loss (the mean over the epoch's
batches: for monitoring, outside the privacy guarantee), the held-out loss, the epsilon spent at
``--delta`` and a sample generated from a fixed prompt with a fixed seed (top-k sampling).
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Sequence
from pydoc_data.topics import topics

import torch
import transformers

from per_sample_hooks import DPSGD

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    def tqdm(iterable, **_):
        return iterable

ALPHABET = "\n" + "".join(map(chr, range(32, 127)))
"""The vocabulary: newline and printable ASCII; token ``len(ALPHABET)`` stands for the rest."""
UNKNOWN = "\N{REPLACEMENT CHARACTER}"
PROMPT = "The value of the "


def encode(text: str) -> torch.Tensor:
    """``[len(text)]`` token ids; characters outside ``ALPHABET`` become the unknown token."""
    index = {c: i for i, c in enumerate(ALPHABET)}
    return torch.tensor([index.get(c, len(ALPHABET)) for c in text])


def decode(ids: torch.Tensor) -> str:
    return "".join(ALPHABET[i] if i < len(ALPHABET) else UNKNOWN for i in ids.tolist())


def prose(texts: dict[str, str]) -> dict[str, str]:
    """Each topic's paragraphs that are not indented (code, grammar rules and tables are),
    each paragraph in the first topic (by name) that has it only: many topics repeat others
    (``compound`` holds ``if``, ``while``, ...), which would put held-out text in the training
    split and one paragraph in many training samples."""
    seen: set[str] = set()
    kept = {}
    for name in sorted(texts):
        paragraphs = [p for p in texts[name].split("\n\n")
                      if p and not p[0].isspace() and p not in seen]
        seen.update(paragraphs)
        if paragraphs:
            kept[name] = "\n\n".join(paragraphs)
    return kept


def windows(text: str, context: int) -> torch.Tensor:
    """``[n, context]``: the text's tokens cut into consecutive windows (the tail dropped)."""
    ids = encode(text)
    n = len(ids) // context
    return ids[:n * context].view(n, context)


def load(context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out windows: every tenth topic (by name) is held out."""
    texts = prose(topics)
    names = sorted(texts)
    held_out = "\n\n".join(texts[n] for i, n in enumerate(names) if i % 10 == 9)
    train = "\n\n".join(texts[n] for i, n in enumerate(names) if i % 10 != 9)
    return windows(train, context), windows(held_out, context)


def small_gpt2(context: int, n_embd: int, n_layer: int, n_head: int) -> torch.nn.Module:
    """A random GPT-2 with the example's vocabulary; no dropout (the DP noise regularizes)."""
    config = transformers.GPT2Config(
        vocab_size=len(ALPHABET) + 1, n_positions=context, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, batch_size: int = 256) -> float:
    """The mean next-character loss over all windows of ``ids``."""
    model.eval()
    total = sum(model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
                for chunk in ids.split(batch_size))
    return total / len(ids)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: str, length: int, context: int, top_k: int,
             seed: int) -> str:
    """``prompt`` and ``length`` characters sampled from the ``top_k`` most likely ones, each
    from the last ``context - 1`` characters: a training window of ``context`` characters
    predicts its last ``context - 1`` from the ones before, so the output at its last position
    (and that position's embedding) is never trained."""
    model.eval()
    ids = encode(prompt).unsqueeze(0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(length):
        logits = model(input_ids=ids[:, -(context - 1):]).logits[0, -1]
        top = logits.topk(top_k)
        choice = torch.multinomial(top.values.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, top.indices[choice].view(1, 1)], dim=1)
    return decode(ids[0])


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=0,
                        help="stop each epoch after this many steps (0: a whole epoch)")
    parser.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) size")
    parser.add_argument("--context", type=int, default=16, help="characters per sample (>= 2)")
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-2,
                        help="Adam's, decaying linearly to 0 at the last step")
    parser.add_argument("--noise-multiplier", type=float, default=0.9)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--sample-length", type=int, default=160)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.context < 2:
        parser.error("--context must be at least 2 (one character to predict from another)")
    return args


def evaluate(model: torch.nn.Module, dp: DPSGD, held_out: torch.Tensor,
             args: argparse.Namespace) -> dict[str, float | str]:
    """The held-out loss, the epsilon spent so far and the sample from the fixed prompt."""
    return dict(held_out_loss=held_out_loss(model, held_out), epsilon=dp.epsilon(args.delta),
                sample=generate(model, PROMPT, args.sample_length, args.context, args.top_k,
                                args.seed))


def main(argv: Sequence[str] | None = None) -> list[dict[str, float | str]]:
    """Train and print one report per epoch; return them (epoch 0: before training), each with
    ``epoch``, ``train_loss`` (NaN before training), ``held_out_loss``, ``epsilon``, ``sample``."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, held_out = load(args.context)
    model = small_gpt2(args.context, args.n_embd, args.n_layer, args.n_head)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dp = DPSGD(model, optimizer,
               noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
               dataset_size=len(train), batch_size=args.batch_size, sampling="poisson",
               generator=torch.Generator().manual_seed(args.seed))
    steps = min(args.steps or dp.steps_per_epoch, dp.steps_per_epoch)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0,
                                                 total_iters=args.epochs * steps)
    print(f"{len(train)} training / {len(held_out)} held-out windows of {args.context} "
          f"characters, {sum(p.numel() for p in model.parameters())} parameters, sample rate "
          f"{dp.sample_rate:.4f}, {steps} steps per epoch, noise multiplier "
          f"{args.noise_multiplier}, clip norm {args.max_grad_norm}, delta {args.delta}\n")
    start, reports = time.perf_counter(), []
    for epoch in range(args.epochs + 1):
        losses = []
        if epoch:
            model.train()
            batches = itertools.islice(dp.batches(), steps)
            for idx in tqdm(batches, total=steps, desc=f"epoch {epoch}", leave=False):
                dp.zero_grad()
                if len(idx):
                    ids = train[idx]  # [B, T]
                    # the mean over B * (T - 1) predicted characters, T - 1 per sample: also
                    # the mean of the samples' losses (DPSGD's loss_type="mean")
                    loss = model(input_ids=ids, labels=ids).loss
                    dp.backward(loss)  # skips p.grad, which dp.step builds clipped
                    losses.append(loss.item())
                dp.step(empty_batch=len(idx) == 0)
                schedule.step()
        report = dict(epoch=epoch, train_loss=sum(losses) / len(losses) if losses else math.nan,
                      **evaluate(model, dp, held_out, args))
        reports.append(report)
        train_text = "-" if math.isnan(report["train_loss"]) else f"{report['train_loss']:.3f}"
        print(f"epoch {epoch}  train loss {train_text}  held-out loss "
              f"{report['held_out_loss']:.3f}  epsilon {report['epsilon']:.2f}  "
              f"({time.perf_counter() - start:.0f} s)\n{report['sample']}\n")
    return reports


if __name__ == "__main__":
    main()
