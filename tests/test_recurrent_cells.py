"""nn.RNNCell / nn.LSTMCell / nn.GRUCell called in a loop over time steps, against the float64
per-sample loop: grad1 over a grid of options, and norms, clipping, DP steps and second
moments in float32 and float64. (They were units of the torch.func fallback, which could not
vmap them: "output with shape [1, 4] doesn't match the broadcast shape [5, 1, 4]".)"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import loop_clipped
from torch import nn

import per_sample_hooks as psh
from ground_truth import hooked_grads, loop_grads_of, loop_tolerance

MODES = ["RNN_TANH", "RNN_RELU", "LSTM", "GRU"]


def make_cell(mode: str, input_size: int, hidden: int, bias: bool = True) -> nn.RNNCellBase:
    if mode.startswith("RNN"):
        return nn.RNNCell(input_size, hidden, bias, "relu" if mode == "RNN_RELU" else "tanh")
    return (nn.LSTMCell if mode == "LSTM" else nn.GRUCell)(input_size, hidden, bias)


class Decoder(nn.Module):
    """A cell stepped over ``x [B, T, in]`` from ``state`` (None: the cell's zeros), a Linear
    head on every step's hidden state; returns ``[B, T, out]`` and the last cell state (LSTM)."""

    def __init__(self, cell: nn.RNNCellBase, keywords: bool = False):
        super().__init__()
        self.cell = cell
        self.head = nn.Linear(cell.hidden_size, 2)
        self.keywords = keywords

    def forward(self, x, state=None):
        outputs, c = [], None
        for t in range(x.shape[-2]):
            step = x[..., t, :]
            state = self.cell(input=step, hx=state) if self.keywords else self.cell(step, state)
            h, c = state if isinstance(state, tuple) else (state, None)
            outputs.append(self.head(h))
        return torch.stack(outputs, -2), c


def decoder_loss(uses_cell_state: bool):
    """Per-sample losses: weighted squares of the head's outputs, plus the last cell state's
    (LSTMCell, ``uses_cell_state``: its gradient reaches ``c'`` directly, not only through
    ``h'``)."""
    def loss_fn(result):
        out, c = result
        flat = out.reshape(out.shape[0], -1)
        weights = torch.linspace(-1.0, 2.0, flat.shape[1], dtype=flat.dtype)
        total = (flat.pow(2) * weights + flat * weights.flip(0)).sum(1)
        if uses_cell_state and c is not None:
            total = total + (c * torch.arange(1.0, c.shape[-1] + 1, dtype=c.dtype)).sum(-1)
        return total
    return loss_fn


def initial_state(mode: str, batch: int, hidden: int, dtype: torch.dtype):
    h = torch.randn(batch, hidden, dtype=dtype)
    return (h, torch.randn(batch, hidden, dtype=dtype)) if mode == "LSTM" else h


def sample_of(state, i: int):
    """Sample ``i``'s initial state, in float64."""
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(t[i:i + 1].double() for t in state)
    return state[i:i + 1].double()


def expected_grads(model: nn.Module, x: torch.Tensor, state, loss_fn) -> dict:
    """The float64 loop: one forward and backward per sample."""
    samples = [(x[i:i + 1].double(), sample_of(state, i)) for i in range(len(x))]
    return loop_grads_of(copy.deepcopy(model).double(), samples, loss_fn)


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(MODES), batch=st.integers(1, 4), steps=st.integers(1, 4),
       input_size=st.integers(1, 3), hidden=st.integers(1, 4), bias=st.booleans(),
       given_state=st.booleans(), keywords=st.booleans(), uses_cell_state=st.booleans(),
       loss_type=st.sampled_from(["mean", "sum"]))
def test_matches_loop(mode, batch, steps, input_size, hidden, bias, given_state, keywords,
                      uses_cell_state, loss_type):
    torch.manual_seed(0)
    model = Decoder(make_cell(mode, input_size, hidden, bias), keywords).double()
    x = torch.randn(batch, steps, input_size, dtype=torch.float64)
    state = initial_state(mode, batch, hidden, torch.float64) if given_state else None
    loss_fn = decoder_loss(uses_cell_state)
    expected = expected_grads(model, x, state, loss_fn)
    got = hooked_grads(model, [x, state], loss_fn, loss_type, check_unseen="always")
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_unbatched_calls_are_one_sample(mode):
    """A cell called on ``[in]`` (and ``[h]`` states) is a batch of one."""
    torch.manual_seed(0)
    cell = make_cell(mode, 3, 4).double()
    x = torch.randn(5, 3, dtype=torch.float64)  # [T, in]: no batch dim
    state = initial_state(mode, 1, 4, torch.float64)
    state = tuple(t[0] for t in state) if isinstance(state, tuple) else state[0]
    with psh.add_hooks(cell, check_unseen="always"):
        loss = 0
        for t in range(len(x)):
            state = cell(x[t], state)
            h = state[0] if isinstance(state, tuple) else state
            loss = loss + (h ** 3).sum() * (t + 1)
        (loss + (state[1].sum() if isinstance(state, tuple) else 0)).backward()
        psh.compute_grad1(cell, loss_type="sum")
        for name, p in cell.named_parameters():
            assert p.grad1.shape == (1, *p.shape)
            torch.testing.assert_close(p.grad1[0], p.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_frozen_input_weights_and_a_shared_cell():
    """A frozen ``weight_ih``, and one cell stepped by two loops of one forward (an encoder
    and a decoder): every call's contribution is summed."""
    torch.manual_seed(0)
    cell = make_cell("LSTM", 3, 4)
    cell.weight_ih.requires_grad_(False)

    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Decoder(cell)

        def forward(self, x, state=None):
            _, c = self.decoder(x, state)
            out, _ = self.decoder(x.flip(1), None)
            return out * c.sum(-1)[:, None, None], None

    model = EncoderDecoder().double()
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    loss_fn = decoder_loss(False)
    expected = expected_grads(model, x, None, loss_fn)
    got = hooked_grads(model, [x], loss_fn, "mean", check_unseen="always")
    assert "decoder.cell.weight_ih" not in got
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
def test_norms_clipping_and_second_moments(mode, dtype):
    torch.manual_seed(0)
    model = Decoder(make_cell(mode, 3, 5)).to(dtype)
    x = torch.randn(4, 6, 3, dtype=dtype)
    state = initial_state(mode, 4, 5, dtype)
    loss_fn = decoder_loss(True)
    expected = expected_grads(model, x, state, loss_fn)
    flat = torch.cat([g.flatten(1) for g in expected.values()], 1)
    total = flat.norm(dim=1)
    close = loop_tolerance(dtype)
    with psh.add_hooks(model, check_unseen="always"):
        loss_fn(model(x, state)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **close)
        torch.testing.assert_close(psh.compute_norms(model).double(), total, **close)
        diagonal = psh.compute_fisher_diag(model)
        for n, g in expected.items():
            torch.testing.assert_close(diagonal[n].double(), g.square().sum(0), **close)
        torch.testing.assert_close(psh.compute_gram(model).double(), flat @ flat.t(), **close)
        model.zero_grad()
        loss_fn(model(x, state)).mean().backward()
        psh.clip_grads(model, max_grad_norm=0.5)
        clipped = loop_clipped(expected, total, 0.5, "mean")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.double(), clipped[n], **close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dpsgd_steps_of_an_lstm_cell(dtype):
    """DPSGD's checked first step (ordinary backward) and its edge-backward steps after it."""
    torch.manual_seed(0)
    model = Decoder(make_cell("LSTM", 3, 5)).to(dtype)
    x = torch.randn(4, 6, 3, dtype=dtype)
    loss_fn = decoder_loss(True)
    expected = expected_grads(model, x, None, loss_fn)
    reference = copy.deepcopy(model)
    dp = psh.DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                   max_grad_norm=0.5, dataset_size=10, batch_size=len(x), accountant=None)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    clipped = loop_clipped(expected, total, 0.5, "mean")
    for _ in range(3):  # the parameters are put back (the expectation is for the first step)
        dp.zero_grad()
        dp.backward(loss_fn(model(x)).mean())
        dp.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(reference.get_parameter(n).double() - p.double(),
                                       0.1 * clipped[n], **loop_tolerance(dtype))
            p.data.copy_(reference.get_parameter(n))


@pytest.mark.parametrize("mode", MODES)
def test_gauss_newton_blocks(mode):
    """``backprop_hess`` (one backward pass per output column) then ``compute_hess``: each
    parameter's Gauss-Newton block ``(1/B) sum_b J_b^T J_b`` of a least-squares loss on the
    head's outputs, ``J_b`` from ``torch.func.jacrev``."""
    torch.manual_seed(0)
    model = Decoder(make_cell(mode, 2, 3)).double()
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def outputs(values, x_b):
        return torch.func.functional_call(model, values, (x_b[None],))[0].flatten()

    with psh.add_hooks(model, check_unseen="always"):
        psh.backprop_hess(model(x)[0].flatten(1), "LeastSquares")
        psh.compute_hess(model)
        for name, p in model.named_parameters():
            jacobians = [torch.func.jacrev(outputs)(params, x_b)[name].flatten(1) for x_b in x]
            expected = sum(j.t() @ j for j in jacobians) / len(x)
            torch.testing.assert_close(p.hess, expected, rtol=1e-9, atol=1e-12, msg=name)
