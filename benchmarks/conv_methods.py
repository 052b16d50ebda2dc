"""Per-sample convolution weight gradients: which exact method is faster, per shape.

    PYTHONPATH=. python benchmarks/conv_methods.py [--threads 1] [--reps 9]

Part 1 times, per shape, the two methods of ``rules/conv.py`` / ``rules/conv_transpose.py``:
chunked im2col + batched GEMM (written into the persistent buffer) and the grouped-convolution
trick of Rochette et al. (``convolution_backward`` with ``groups = B*G``, then copied), next to
a plain forward+backward of the layer. Part 2 times the CNN of seed 001 (B=64, cross-entropy):
plain forward+backward, hooked forward+backward+compute_grad1, and torch.func (vmap over grad
with functional_call). Repetitions are interleaved; medians in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import per_sample_hooks as psh
from per_sample_hooks import forms
from per_sample_hooks.forms import Outer
from per_sample_hooks.rules import conv, conv_transpose

SHAPES = [
    ("Conv2d 1->32 k3, 28x28, B64 (seed 001)", nn.Conv2d(1, 32, 3), (64, 1, 28, 28)),
    ("Conv2d 32->64 k3, 26x26, B64 (seed 001)", nn.Conv2d(32, 64, 3), (64, 32, 26, 26)),
    ("Conv2d 64->64 k3 p1, 16x16, B32", nn.Conv2d(64, 64, 3, padding=1), (32, 64, 16, 16)),
    ("Conv2d depthwise 32x3 k3 s2, 32x32, B64",
     nn.Conv2d(32, 96, 3, stride=2, padding=1, groups=32), (64, 32, 32, 32)),
    ("Conv1d 64->64 k5, L256, B64", nn.Conv1d(64, 64, 5, padding=2), (64, 64, 256)),
    ("Conv1d depthwise 64 k5, L256, B64", nn.Conv1d(64, 64, 5, padding=2, groups=64),
     (64, 64, 256)),
    ("Conv3d 1->16 k3, 16^3, B16", nn.Conv3d(1, 16, 3, padding=1), (16, 1, 16, 16, 16)),
    ("Conv3d 16->32 k3, 12^3, B16", nn.Conv3d(16, 32, 3, padding=1), (16, 16, 12, 12, 12)),
    ("Conv3d depthwise 16 k3, 12^3, B16", nn.Conv3d(16, 16, 3, padding=1, groups=16),
     (16, 16, 12, 12, 12)),
    ("ConvTranspose2d 64->32 k4 s2 p1, 16x16, B64", nn.ConvTranspose2d(64, 32, 4, 2, 1),
     (64, 64, 16, 16)),
    ("ConvTranspose2d depthwise 32 k4 s2, 16x16, B64",
     nn.ConvTranspose2d(32, 32, 4, 2, 1, groups=32), (64, 32, 16, 16)),
    ("ConvTranspose1d 32->32 k4 s2 p1, L128, B64", nn.ConvTranspose1d(32, 32, 4, 2, 1),
     (64, 32, 128)),
]


def medians(functions: dict, reps: int) -> dict[str, float]:
    """Median wall time (ms) of each function, repetitions interleaved after one warm-up."""
    times = {name: [] for name in functions}
    for f in functions.values():
        f()
    for _ in range(reps):
        for name, f in functions.items():
            start = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def grouped_method(module: nn.Module, x: torch.Tensor, grad_output: torch.Tensor,
                   out: torch.Tensor) -> None:
    """The grouped-convolution trick for either kind of layer."""
    transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
    if not transposed:
        conv.add_grouped_conv_weight_grads(module, x, grad_output, out, 1.0, False)
        return
    result = torch.ops.aten.convolution_backward(
        grad_output.reshape(1, -1, *grad_output.shape[2:]), x.reshape(1, -1, *x.shape[2:]),
        out.view(-1, *out.shape[2:]), None, module.stride, module.padding, module.dilation,
        True, module.output_padding, x.shape[0] * module.groups, [False, True, False])[1]
    out.view_as(result).copy_(result)


def time_shape(module: nn.Module, shape: tuple[int, ...], reps: int) -> dict[str, float]:
    x = torch.randn(shape)
    grad_output = torch.randn_like(module(x))
    out = torch.empty(shape[0], *module.weight.shape)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):  # the rule's form of the weight
        left, right = x, conv.unfolded(
            module, grad_output,
            lambda gy: conv_transpose.crop_pad_grad_output(module, gy, x.shape[2:]))
    else:
        left, right = grad_output, conv.unfolded(module, x, partial(conv.pad_conv_input, module),
                                                 conv.zero_padding(module))
    form = Outer(conv.conv_output_grads(module, left), right)

    def im2col():
        forms.write(out, [form], 1.0)

    def plain():
        module.zero_grad()
        module(x.detach().requires_grad_()).backward(grad_output)

    return medians({"im2col": im2col,
                    "grouped": lambda: grouped_method(module, x, grad_output, out),
                    "plain": plain}, reps)


def compare_methods(reps: int) -> None:
    print(f"{'layer':50s} {'im2col+GEMM':>12s} {'groups=B*G':>11s} {'plain f+b':>10s}  used")
    for name, module, shape in SHAPES:
        used = "im2col"
        if not isinstance(module, nn.modules.conv._ConvTransposeNd):
            used = "grouped" if conv.prefers_grouped_convolution(module) else "im2col"
        t = time_shape(module, shape, reps)
        print(f"{name:50s} {t['im2col']:12.2f} {t['grouped']:11.2f} {t['plain']:10.2f}  {used}")


class SimpleCNN(nn.Module):
    """The CNN of seed 001."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(torch.flatten(F.max_pool2d(x, 2), 1))))


def seed_cnn(reps: int) -> None:
    torch.manual_seed(0)
    batch = 64
    model, hooked_model = SimpleCNN(), SimpleCNN()
    hooked_model.load_state_dict(model.state_dict())
    data, targets = torch.randn(batch, 1, 28, 28), torch.randint(10, (batch,))
    psh.add_hooks(hooked_model)

    def plain():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(data), targets).backward()

    def hooked():
        hooked_model.zero_grad(set_to_none=True)
        F.cross_entropy(hooked_model(data), targets).backward()
        psh.compute_grad1(hooked_model)

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, x, t):
        return F.cross_entropy(functional_call(model, p, (x[None],)), t[None])

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

    def func():
        return per_sample(params, data, targets)

    hooked()
    expected = func()
    for n, p in hooked_model.named_parameters():
        torch.testing.assert_close(p.grad1, expected[n], rtol=1e-4, atol=1e-5)
    t = medians({"plain": plain, "hooked": hooked, "torch.func": func}, reps)
    print(f"seed-001 CNN, B=64: plain fwd+bwd {t['plain']:.1f} ms, hooked fwd+bwd+compute_grad1 "
          f"{t['hooked']:.1f} ms ({t['hooked'] / t['plain']:.2f}x plain), torch.func "
          f"{t['torch.func']:.1f} ms; hooked / torch.func = {t['hooked'] / t['torch.func']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--only", choices=["methods", "cnn"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.reps}")
    if args.only != "cnn":
        compare_methods(args.reps)
    if args.only != "methods":
        seed_cnn(args.reps)


if __name__ == "__main__":
    main()
