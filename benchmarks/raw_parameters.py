"""Raw parameters of a module, followed op by op, against that module as one unit of the
torch.func fallback (what it was before this path existed):

- ``vit``: transformers' ViTForImageClassification, hidden 128, 2 layers, 32x32 images in
  4x4 patches (64 patches), 10 classes; its embeddings (class token, position embeddings
  around the patch convolution) against ``units=["vit.embeddings"]``;
- ``timm``: ``tests/models.py``'s TimmLikeViT of the same sizes, whose top-level module owns
  ``cls_token`` and ``pos_embed`` and whose blocks own their LayerScale gammas, against the
  whole model as one unit (``units=[""]``);
- ``hand_norm``: a token model (vocab 1000, d=256, 2 pre-norm MLP blocks, T=64) whose RMSNorms
  are written by hand, modules with a raw weight and no children, against each of them as one
  fallback unit (what every such module was before its uses were followed);
- ``custom_linear``: the 784-512-512-10 MLP of ``benchmarks.dp`` with its Linear layers written
  by hand (``F.linear`` of raw parameters, no children; B = 8 x ``--batch``), against each as
  one unit.

    PYTHONPATH=$PWD python -m benchmarks.raw_parameters --threads 1 --rounds 20

Methods (one full step each, interleaved in one process, see harness.py; each on its own copy
of the model, hooked with the defaults, the unseen-use check included):

- ``plain``: forward + backward of the mean cross-entropy, unhooked;
- ``clip``: hooked forward + backward + ``clip_grads(model, 1.0)``;
- ``grad1``: hooked forward + backward + ``compute_grad1``;
- ``... unit``: the same with the module as a fallback unit.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from models import TimmLikeViT  # noqa: E402

import per_sample_hooks as psh  # noqa: E402
from benchmarks.harness import compare, print_table  # noqa: E402

HIDDEN, LAYERS, IMAGE, CLASSES = 128, 2, 32, 10


class CustomLinear(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class HandRMSNorm(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HandNormBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = HandRMSNorm(d), torch.nn.Linear(d, 4 * d), \
            torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class HandNormModel(torch.nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.Sequential(*[HandNormBlock(d) for _ in range(layers)])
        self.norm, self.head = HandRMSNorm(d), torch.nn.Linear(d, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))).mean(1))


def make_methods(model: str = "vit", batch: int = 16) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch,))
    if model == "vit":
        from transformers import ViTConfig, ViTForImageClassification
        config = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                           intermediate_size=4 * HIDDEN, image_size=IMAGE, patch_size=4,
                           num_labels=CLASSES)
        net, units = ViTForImageClassification(config).train(), ["vit.embeddings"]

        def loss_of(m: torch.nn.Module) -> torch.Tensor:
            return m(pixel_values=x, labels=y).loss
    else:
        if model == "timm":
            net, units = TimmLikeViT(HIDDEN, heads=4, depth=LAYERS, image=IMAGE,
                                     classes=CLASSES), [""]
        elif model == "custom_linear":
            net = torch.nn.Sequential(CustomLinear(784, 512), torch.nn.ReLU(),
                                      CustomLinear(512, 512), torch.nn.ReLU(),
                                      CustomLinear(512, CLASSES))
            x = torch.randn(batch, 784)
            units = ["0", "2", "4"]
        else:
            net, x = HandNormModel(), torch.randint(0, 1000, (batch, 64))
            units = [n for n, m in net.named_modules() if isinstance(m, HandRMSNorm)]

        def loss_of(m: torch.nn.Module) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(m(x), y)

    def step(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        loss_of(m).backward()

    def hooked(compute, **options):
        m = copy.deepcopy(net)
        psh.add_hooks(m, **options)

        def run() -> None:
            step(m)
            compute(m)
        return run

    plain = copy.deepcopy(net)
    clip = lambda m: psh.clip_grads(m, 1.0)  # noqa: E731
    return {"plain": lambda: step(plain),
            "clip": hooked(clip), "clip unit": hooked(clip, units=units),
            "grad1": hooked(psh.compute_grad1),
            "grad1 unit": hooked(psh.compute_grad1, units=units)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    models = ["vit", "timm", "hand_norm", "custom_linear"]
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    titles = {"vit": f"transformers ViT, hidden {HIDDEN}, {LAYERS} layers, 64 patches",
              "timm": f"timm-like ViT (top-level cls/pos, gammas), hidden {HIDDEN}, {LAYERS} "
                      "layers, 64 patches",
              "hand_norm": "token model with hand-written RMSNorms, d=256, 2 blocks, T=64",
              "custom_linear": "MLP 784-512-512-10 of hand-written linear layers"}
    for model in args.models:
        batch = 8 * args.batch if model == "custom_linear" else args.batch  # dp.py's B=128
        results = compare(make_methods(model, batch), rounds=args.rounds, warmup=3)
        print_table(results, "plain", f"{titles[model]}, B={batch}, float32, "
                    f"{args.threads} thread(s)")


if __name__ == "__main__":
    main()
