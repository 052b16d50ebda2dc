"""Per-sample gradients of a 2-layer LSTM classifier (``--cell``: an nn.LSTMCell stepped in a
loop): hooked vs plain forward+backward.

    PYTHONPATH=$PWD python benchmarks/lstm_classifier.py [--device cuda] [--torch-func] [--cell]

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


class LSTMCellClassifier(nn.Module):
    """One nn.LSTMCell stepped over ``x [B, T, in]`` from zeros, its last ``h`` through a Linear
    head (what a hand-written recurrence or a decoder does)."""

    def __init__(self, input_size: int, hidden: int, classes: int):
        super().__init__()
        self.cell = nn.LSTMCell(input_size, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h = c = x.new_zeros(x.shape[0], self.cell.hidden_size)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h)


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


def unrolled_classifier(params: dict[str, torch.Tensor], x: torch.Tensor, layers: int
                        ) -> torch.Tensor:
    """The classifier written out step by step (what ``torch.func`` can vmap): ``x [T, in]``."""
    for k in range(layers):
        w_ih, w_hh = params[f"rnn.weight_ih_l{k}"], params[f"rnn.weight_hh_l{k}"]
        bias = params[f"rnn.bias_ih_l{k}"] + params[f"rnn.bias_hh_l{k}"]
        pre = x @ w_ih.t() + bias
        h = c = x.new_zeros(w_hh.shape[1])
        outputs = []
        for t in range(x.shape[0]):
            i, f, g, o = (pre[t] + w_hh @ h).chunk(4)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        x = torch.stack(outputs)
    return h @ params["head.weight"].t() + params["head.bias"]


def torch_func_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per-sample gradients with ``torch.func.vmap(grad)`` over :func:`unrolled_classifier`
    (``vmap`` over ``nn.LSTM`` itself fails: no batching rule for the fused op)."""
    from torch.func import grad, vmap
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        if isinstance(model, LSTMCellClassifier):  # vmap batches the cell's ops directly
            logits = torch.func.functional_call(model, p, (xi[None],))[0]
        else:
            logits = unrolled_classifier(p, xi, model.rnn.num_layers)
        return nn.functional.cross_entropy(logits[None], yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--torch-func", action="store_true",
                        help="also time torch.func vmap(grad) over an unrolled copy")
    parser.add_argument("--cell", action="store_true",
                        help="an nn.LSTMCell stepped in a loop instead of a 2-layer nn.LSTM")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = args.device
    model = (LSTMCellClassifier(args.input, args.hidden, 10) if args.cell else
             LSTMClassifier(args.input, args.hidden, 10)).to(device)
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
    checked = "cell.weight_hh" if args.cell else "rnn.weight_hh_l1"
    g = model.get_parameter(checked).grad1
    assert torch.allclose(g.mean(0), model.get_parameter(checked).grad, rtol=1e-4, atol=1e-6)
    func_ms = func_ratio = None
    if args.torch_func:
        expected = torch_func_step(model, x, y)[checked]
        assert torch.allclose(g, expected, rtol=1e-3, atol=1e-5)
        func_ms, _, func_ratio = timed_pair(lambda: torch_func_step(model, x, y), hooked,
                                            max(3, args.repeats // 4), device)
    state.remove()
    print(f"device={device} threads={args.threads} B={args.batch} T={args.steps} "
          f"in={args.input} H={args.hidden} ("
          f"{'LSTMCell loop' if args.cell else '2-layer LSTM'} + Linear, cross-entropy, mean)")
    print(f"plain fwd+bwd                 {plain_ms:8.2f} ms")
    print(f"hooked fwd+bwd+compute_grad1  {hooked_ms:8.2f} ms   ratio {ratio:.2f}x "
          "(median of per-pair ratios)")
    if func_ms is not None:
        what = "torch.func vmap(grad)" if args.cell else "torch.func vmap(grad), unrolled"
        print(f"{what:30s}{func_ms:8.2f} ms   hooked/torch.func {func_ratio:.2f}x")


if __name__ == "__main__":
    main()
