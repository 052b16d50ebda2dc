"""Whole models used by the tests and the benchmarks (no torchvision dependency)."""
from __future__ import annotations

import torch
from torch import nn


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
