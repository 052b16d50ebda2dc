"""Per-sample gradients of a 2-layer LSTM classifier: hooked vs plain forward+backward.

    PYTHONPATH=$PWD python benchmarks/lstm_classifier.py [--device cuda] [--repeats 10]

Plain fwd+bwd of an unhooked copy and hooked fwd+bwd+compute_grad1, run alternately
(``--repeats`` pairs after warm-up); reports medians and the median of per-pair ratios.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import per_sample_hooks as psh


class LSTMClassifier(nn.Module):
    def __init__(self, input_size: int, hidden: int, classes: int, layers: int = 2):
        super().__init__()
        self.rnn = nn.LSTM(input_size, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        _, (h_n, _) = self.rnn(x)
        return self.head(h_n[-1])


def timed_pair(first, second, repeats: int, device: str) -> tuple[float, float, float]:
    """Median ms of ``first`` and ``second`` and median of their ratio, run alternately so that
    load from other processes hits both alike."""
    def once(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(2):
        first(), second()
    a, b = [], []
    for _ in range(repeats):
        a.append(once(first))
        b.append(once(second))
    ratio = statistics.median(y / x for x, y in zip(a, b))
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3, ratio


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = args.device
    model = LSTMClassifier(args.input, args.hidden, 10).to(device)
    x = torch.randn(args.batch, args.steps, args.input, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    plain_model = copy.deepcopy(model)

    def plain():
        plain_model.zero_grad(set_to_none=True)
        loss_fn(plain_model(x), y).backward()

    state = psh.add_hooks(model)

    def hooked():
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        psh.compute_grad1(model)

    plain_ms, hooked_ms, ratio = timed_pair(plain, hooked, args.repeats, device)
    g = model.rnn.weight_hh_l1.grad1
    assert torch.allclose(g.mean(0), model.rnn.weight_hh_l1.grad, rtol=1e-4, atol=1e-6)
    state.remove()
    print(f"device={device} threads={args.threads} B={args.batch} T={args.steps} "
          f"in={args.input} H={args.hidden} (2-layer LSTM + Linear, cross-entropy, mean)")
    print(f"plain fwd+bwd                 {plain_ms:8.2f} ms")
    print(f"hooked fwd+bwd+compute_grad1  {hooked_ms:8.2f} ms   ratio {ratio:.2f}x "
          "(median of per-pair ratios)")


if __name__ == "__main__":
    main()
