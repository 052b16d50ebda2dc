"""Whole models against the float64 per-sample loop: ResNet-18 (GroupNorm), a transformer
classifier, a tied-embedding language model, an LSTM classifier."""
import pytest
import torch
import torch.nn.functional as F
from models import (
    LSTMClassifier,
    ResNet18,
    TiedLanguageModel,
    TransformerClassifier,
    UntiedUseLanguageModel,
)
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, sum_of_outputs


class WithLoss(nn.Module):
    """``model`` followed by its per-sample cross-entropy, so that the loop slices the targets
    with the inputs; the last input is the target (class per sample, or per token)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        logits = self.model(*inputs[:-1])
        if logits.dim() == 3:
            logits = logits.transpose(1, 2)
        losses = F.cross_entropy(logits, inputs[-1], reduction="none")
        return losses.reshape(losses.shape[0], -1)


def test_resnet18_groupnorm():
    torch.manual_seed(0)
    model = ResNet18(width=4, classes=3)
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 2, 1])
    got = assert_matches_loop(WithLoss(model), [x, y], sum_of_outputs, rtol=1e-8, atol=1e-10)
    assert len(got) == sum(1 for p in model.parameters())


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_transformer_classifier(loss_type):
    torch.manual_seed(0)
    model = TransformerClassifier(vocab=20, dim=8, heads=2, ff=12, length=6, classes=3)
    tokens = torch.randint(0, 20, (4, 6))
    padding = torch.zeros(4, 6, dtype=torch.bool)
    padding[2, 4:] = True
    y = torch.tensor([0, 1, 2, 1])
    assert_matches_loop(WithLoss(model), [tokens, padding, y], sum_of_outputs,
                        loss_type=loss_type)
    state = psh.add_hooks(model)  # native rules wherever they apply
    try:
        layer = model.encoder.layers[0]
        assert {layer.linear1, layer.linear2, model.head} <= set(state.modules)
        assert layer.self_attn in state.units and layer.self_attn.out_proj not in state.modules
    finally:
        psh.remove_hooks(model)


def test_tied_embedding_language_model():
    torch.manual_seed(0)
    model = TiedLanguageModel(vocab=13, dim=8, heads=2, length=5)
    tokens = torch.randint(0, 13, (3, 5))
    got = assert_matches_loop(WithLoss(model), [tokens, tokens], sum_of_outputs)
    assert "model.embedding.weight" in got and "model.out.weight" not in got  # one tied parameter


def test_untied_use_of_the_embedding_is_reported():
    torch.manual_seed(0)
    model = UntiedUseLanguageModel(vocab=13, dim=8, heads=2, length=5)
    tokens = torch.randint(0, 13, (3, 5))
    with pytest.raises(psh.PerSampleHooksError, match=r"'model\.embedding\.weight'"):
        assert_matches_loop(WithLoss(model), [tokens, tokens], sum_of_outputs)
    assert_matches_loop(WithLoss(model), [tokens, tokens], sum_of_outputs, units=["model"])


def test_lstm_classifier():
    torch.manual_seed(0)
    model = LSTMClassifier(vocab=20, dim=6, hidden=5, classes=3)
    tokens = torch.randint(0, 20, (4, 7))
    assert_matches_loop(WithLoss(model), [tokens, torch.tensor([0, 1, 2, 0])], sum_of_outputs)
