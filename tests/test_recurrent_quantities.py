"""Norms, clipping, DP steps and second moments of recurrent layers, float32 and float64,
against the float64 per-sample loop; dense and PackedSequence inputs. (The every-step
unseen-use check once re-ran these modules under torch.func in no_grad, which crashed the CPU
LSTM in float32, "Expected a proper Tensor but got None ... 'workspace'", and every packed
input, "Cannot access data pointer of Tensor that doesn't have storage".)"""
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import per_sample_hooks as psh
from ground_truth import loop_grads_of

CELLS = {"RNN": nn.RNN, "LSTM": nn.LSTM, "GRU": nn.GRU}
LENGTHS = [4, 1, 3, 4, 2]


class Classifier(nn.Module):
    """A recurrent layer (batch first), its last hidden state through a Linear head."""

    def __init__(self, cell: str, packed: bool):
        super().__init__()
        self.packed = packed
        self.rnn = CELLS[cell](3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x, lengths):
        if self.packed:
            x = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, state = self.rnn(x)
        h_n = state[0] if isinstance(state, tuple) else state
        return self.head(h_n[-1])


def losses(out: torch.Tensor) -> torch.Tensor:
    return (out ** 2).sum(1) + out[:, 0]


def case(cell: str, packed: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    model = Classifier(cell, packed).to(dtype)
    x = torch.randn(len(LENGTHS), 4, 3, dtype=dtype)
    lengths = torch.tensor(LENGTHS, device="cpu")  # pack_padded_sequence takes CPU lengths
    if packed:  # a sample is its own sequence, unpadded
        samples = [(x[i:i + 1, :n].double(), lengths[i:i + 1]) for i, n in enumerate(LENGTHS)]
    else:
        samples = [(x[i:i + 1].double(), lengths[i:i + 1]) for i in range(len(LENGTHS))]
    expected = loop_grads_of(copy.deepcopy(model).double(), samples, losses)
    return model, (x, lengths), expected


def tolerances(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cell", list(CELLS))
def test_norms_clipping_and_second_moments(cell, packed, dtype):
    model, inputs, expected = case(cell, packed, dtype)
    flat = torch.cat([g.flatten(1) for g in expected.values()], 1)
    total = flat.norm(dim=1)
    close = tolerances(dtype)
    with psh.add_hooks(model, check_unseen="always"):
        losses(model(*inputs)).mean().backward()
        norms = psh.compute_norms(model)
        torch.testing.assert_close(norms.double(), total, **close)
        diagonal = psh.compute_fisher_diag(model)
        gram = psh.compute_gram(model)
        for n, g in expected.items():
            torch.testing.assert_close(diagonal[n].double(), g.square().sum(0), **close)
        torch.testing.assert_close(gram.double(), flat @ flat.t(), **close)
        model.zero_grad()
        losses(model(*inputs)).mean().backward()
        psh.clip_grads(model, max_grad_norm=0.5)
        coefficients = (0.5 / (total + 1e-6)).clamp(max=1)
        for n, p in model.named_parameters():
            clipped = torch.einsum("b,b...->...", coefficients, expected[n]) / len(total)
            torch.testing.assert_close(p.grad.double(), clipped, **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("packed", [False, True])
def test_dpsgd_steps_of_an_lstm(packed, dtype):
    """DPSGD's checked first step (ordinary backward) and its edge-backward steps after it."""
    model, inputs, expected = case("LSTM", packed, dtype)
    reference = copy.deepcopy(model)
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                   max_grad_norm=0.5, dataset_size=10, batch_size=len(LENGTHS),
                   accountant=None)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    coefficients = (0.5 / (total + 1e-6)).clamp(max=1)
    for _ in range(3):  # the parameters do not move (the expectation is for the first step)
        dp.zero_grad()
        dp.backward(losses(model(*inputs)).mean())
        dp.step()
        for n, p in model.named_parameters():
            clipped = torch.einsum("b,b...->...", coefficients, expected[n]) / len(total)
            torch.testing.assert_close(reference.get_parameter(n).double() - p.double(),
                                       0.1 * clipped, **tolerances(dtype))
            p.data.copy_(reference.get_parameter(n))
