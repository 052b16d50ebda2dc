"""Whole models used by the tests and the benchmarks (no torchvision dependency)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AppliedTwice(nn.Module):
    """Reuse: the same module applied twice, ``f(tanh(f(x)))``; contributions add up."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.tanh(self.inner(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.GroupNorm(groups, cout))

    def forward(self, x):
        h = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(h)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 layout (2-2-2-2 basic blocks) with GroupNorm; ``width`` channels at the stem."""

    def __init__(self, width: int = 64, classes: int = 10, groups: int = 2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.GroupNorm(groups, width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, cout, stride, groups), BasicBlock(cout, cout, 1, groups)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = self.layers(self.stem(x))
        return self.fc(h.mean((2, 3)))


class LearnedPositions(nn.Module):
    """A learned positional embedding added with ``+`` (a raw parameter: the fallback)."""

    def __init__(self, length: int, dim: int):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.1)

    def forward(self, x):
        return x + self.positions[: x.shape[1]]


class TransformerClassifier(nn.Module):
    """Token embedding, learned positions, 2 encoder layers (batch first), mean pool, head."""

    def __init__(self, vocab: int = 100, dim: int = 32, heads: int = 2, ff: int = 64,
                 layers: int = 2, length: int = 16, classes: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.positions = LearnedPositions(length, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens, padding=None):
        h = self.encoder(self.positions(self.embedding(tokens)), src_key_padding_mask=padding)
        return self.head(h.mean(1))


class TiedLanguageModel(nn.Module):
    """Embedding tied to the output layer, routed through a module: ``out.weight`` *is*
    ``embedding.weight``, and ``out`` is called as a module."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, length: int = 12):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.positions = LearnedPositions(length, dim)
        self.block = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embedding.weight

    def forward(self, tokens):
        return self.out(self.block(self.positions(self.embedding(tokens))))


class UntiedUseLanguageModel(TiedLanguageModel):
    """The same model with the output layer written as ``h @ embedding.weight.t()``."""

    def forward(self, tokens):
        return self.block(self.positions(self.embedding(tokens))) @ self.embedding.weight.t()


class LSTMClassifier(nn.Module):
    """Token embedding, 2-layer LSTM (batch first), head on the last hidden state."""

    def __init__(self, vocab: int = 100, dim: int = 32, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.embedding(tokens))
        return self.head(h[-1])


class PatchEmbed(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Conv2d(3, d, 4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class SelfAttention(nn.Module):
    """timm's Attention: a qkv Linear and a projection, the attention in its own code."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, length, d))


class Block(nn.Module):
    """A transformer block owning its LayerScale gammas."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma_1 = nn.Parameter(torch.full((d,), 0.5))
        self.gamma_2 = nn.Parameter(torch.full((d,), 0.7))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class TimmLikeViT(nn.Module):
    """timm's VisionTransformer in small: the model itself owns cls_token and pos_embed, with
    the patch embedding, the blocks (owning gammas), a norm and a head below."""

    def __init__(self, d: int = 8, heads: int = 2, depth: int = 2, image: int = 8,
                 classes: int = 3):
        super().__init__()
        self.patch_embed = PatchEmbed(d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // 4) ** 2 + 1, d) * 0.5)
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return self.head(self.norm(self.blocks(x))[:, 0])
