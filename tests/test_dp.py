import math

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads
from per_sample_hooks.dp import DPSGD, fixed_size_batch, noise_multiplier_for, poisson_batch


class RecordingAccountant:
    def __init__(self):
        self.history = []

    def step(self, *, noise_multiplier, sample_rate):
        self.history.append((noise_multiplier, sample_rate))

    def get_epsilon(self, delta):
        return float(len(self.history))


def _setup(noise=1.0, max_norm=1.0, batch_size=8, dataset_size=64, seed=0, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dp = DPSGD(model, optimizer, noise_multiplier=noise, max_grad_norm=max_norm,
               dataset_size=dataset_size, batch_size=batch_size,
               generator=torch.Generator().manual_seed(seed), **options)
    return model, dp


def _backward(model, idx, loss_type="mean"):
    torch.manual_seed(1)
    x = torch.randn(64, 6, dtype=torch.double)[idx]
    losses = model(x).pow(2).sum(1)
    (losses.mean() if loss_type == "mean" else losses.sum()).backward()


def test_noise_std_on_empty_batch():
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.3,
               max_grad_norm=2.0, dataset_size=1000, batch_size=40, accountant=None,
               generator=torch.Generator().manual_seed(0))
    dp.zero_grad()
    dp.step(empty_batch=True)
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = 1.3 * 2.0 / 40
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(noise.numel())


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_noise_is_added_to_clipped_sum_over_expected_size(loss_type):
    idx = torch.arange(5)  # a Poisson batch smaller than the expected 8
    model, dp = _setup(noise=0.0, loss_type=loss_type, accountant=None)
    _backward(model, idx, loss_type)
    norms = dp.privatize()
    noiseless = [p.grad.clone() for p in model.parameters()]
    # the clipped sum, computed independently from the clipped mean of clip_grads
    model2, _ = _setup(noise=0.0, accountant=None)
    _backward(model2, idx, "mean")
    psh.clip_grads(model2, 1.0)
    for g, p in zip(noiseless, model2.parameters()):
        torch.testing.assert_close(g, p.grad * 5 / 8)
    assert norms.shape == (5,)
    model, dp = _setup(noise=4.0, loss_type=loss_type, accountant=None)
    _backward(model, idx, loss_type)
    dp.privatize()
    diff = torch.cat([(p.grad - g).flatten() for p, g in zip(model.parameters(), noiseless)])
    assert diff.abs().min() > 0
    assert 0.5 < diff.std().item() / (4.0 * 1.0 / 8) < 1.5  # 53 entries: loose


def test_poisson_sampling_statistics():
    generator = torch.Generator().manual_seed(0)
    n, q, draws = 200, 0.1, 2000
    sizes, counts = [], torch.zeros(n)
    for _ in range(draws):
        idx = poisson_batch(n, q, generator)
        assert len(set(idx.tolist())) == len(idx)
        sizes.append(len(idx))
        counts[idx] += 1
    sizes = torch.tensor(sizes, dtype=torch.double)
    assert abs(sizes.mean().item() - n * q) < 4 * math.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes.var().item() / (n * q * (1 - q)) - 1) < 0.15
    frequency = counts / draws  # each index sampled independently with rate q
    assert (frequency - q).abs().max() < 5 * math.sqrt(q * (1 - q) / draws)
    assert poisson_batch(10, 0.0, generator).numel() == 0


def test_fixed_size_sampling_statistics():
    generator = torch.Generator().manual_seed(0)
    n, b, draws = 50, 10, 2000
    counts = torch.zeros(n)
    for _ in range(draws):
        idx = fixed_size_batch(n, b, generator)
        assert len(idx) == b and len(set(idx.tolist())) == b
        counts[idx] += 1
    q = b / n
    assert ((counts / draws) - q).abs().max() < 5 * math.sqrt(q * (1 - q) / draws)


def test_batches_per_epoch_and_seeded_reproducibility():
    _, dp = _setup(accountant=None, sampling="fixed")
    assert [len(i) for i in dp.batches()] == [8] * 8
    _, a = _setup(accountant=None, seed=3)
    _, b = _setup(accountant=None, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.batches(), b.batches()))


def test_accountant_is_stepped_every_step_including_empty_batches():
    accountant = RecordingAccountant()
    model, dp = _setup(accountant=accountant)
    for idx in [torch.arange(3), torch.arange(0), torch.arange(8)]:
        dp.zero_grad()
        if len(idx):
            _backward(model, idx)
        dp.step(empty_batch=len(idx) == 0)
    assert accountant.history == [(1.0, 8 / 64)] * 3
    assert dp.steps == 3 and dp.epsilon(1e-5) == 3.0


def test_opacus_rdp_accountant_matches_direct_use():
    from opacus.accountants import RDPAccountant
    model, dp = _setup(noise=1.1)
    assert isinstance(dp.accountant, RDPAccountant)
    reference = RDPAccountant()
    for idx in dp.batches():
        dp.zero_grad()
        if len(idx):
            _backward(model, idx)
        dp.step(empty_batch=len(idx) == 0)
        reference.step(noise_multiplier=1.1, sample_rate=8 / 64)
    assert dp.steps == 8
    assert dp.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    assert 0 < dp.epsilon(1e-5) < math.inf


def test_noise_multiplier_for_reaches_target():
    sigma = noise_multiplier_for(2.0, 1e-5, sample_rate=0.05, steps=200)
    from opacus.accountants import RDPAccountant
    accountant = RDPAccountant()
    for _ in range(200):
        accountant.step(noise_multiplier=sigma, sample_rate=0.05)
    assert accountant.get_epsilon(1e-5) <= 2.0
    assert 1.9 < accountant.get_epsilon(1e-5)


def test_optimizer_step_uses_privatized_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    dp = DPSGD(model, optimizer, noise_multiplier=0.0, max_grad_norm=1e-3, dataset_size=10,
               batch_size=4, accountant=None)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 3) * 100).sum().backward()
    dp.step()
    moved = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
    assert 0 < moved <= 1e-3 + 1e-9  # each clipped sample <= C, averaged


@pytest.mark.parametrize("options, match", [
    (dict(max_norm=0.0), "max_grad_norm"), (dict(noise=-1.0), "noise_multiplier"),
    (dict(batch_size=0), "batch_size"), (dict(batch_size=100), "batch_size"),
    (dict(sampling="shuffle"), "sampling"),
])
def test_bad_arguments(options, match):
    with pytest.raises(ValueError, match=match):
        _setup(accountant=None, **options)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_max_grad_norm_real_scalars(kind, dtype):
    """DPSGD takes a tensor or numpy max_grad_norm (once refused: 'must be a finite number > 0')
    and clips as with the float: p.grad against the float64 loop clipped at 0.5, no noise."""
    if kind == "numpy":
        max_grad_norm = pytest.importorskip("numpy").float32(0.5)
    else:
        max_grad_norm = torch.tensor(0.5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    reference.load_state_dict(model.state_dict())
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
               max_grad_norm=max_grad_norm, dataset_size=10, batch_size=5, accountant=None)
    assert dp.max_grad_norm == 0.5 and type(dp.max_grad_norm) is float
    x = torch.randn(5, 3, dtype=dtype)
    dp.zero_grad()
    model(x).pow(2).sum(1).mean().backward()
    dp.step()
    grads = loop_grads(reference, [x.double()], lambda out: out.pow(2).sum(1), 5)
    total = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    coefficients = (0.5 / (total + 1e-6)).clamp(max=1)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for n, p in model.named_parameters():
        expected = torch.einsum("b,b...->...", coefficients, grads[n]) / 5
        torch.testing.assert_close(p.grad.double(), expected, **tolerance)


@pytest.mark.parametrize("value, message", [
    (-1.0, "max_grad_norm must be > 0, got -1.0"), (float("nan"), "must be finite, got nan"),
    (True, "must be a real number, not bool"), (torch.tensor(0j), "not complex"),
])
def test_bad_max_grad_norm_messages(value, message):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=f"^DPSGD: .*{message}"):
        DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
              max_grad_norm=value, dataset_size=10, batch_size=5, accountant=None)


def test_epsilon_without_accountant_raises():
    _, dp = _setup(accountant=None)
    with pytest.raises(ValueError, match="accountant=None"):
        dp.epsilon(1e-5)


def test_step_without_backward_raises():
    model, dp = _setup(accountant=None)
    with pytest.raises(psh.PerSampleHooksError, match="backward"):
        dp.step()


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_output_edges_backward_gives_the_same_clipped_grads(loss_type):
    """Backward to the layer outputs only: p.grad untouched, clip_grads still exact."""
    from norms_truth import loop_clipped, loop_norms
    from test_conv import SeedCNNWithLoss
    from test_norms import Reused

    from per_sample_hooks.dp import OutputEdges
    torch.manual_seed(0)
    cases = [(Reused(), [torch.randn(5, 3, 4)], lambda out: out.pow(2).sum((1, 2))),
             (SeedCNNWithLoss(), [torch.randn(3, 1, 28, 28), torch.tensor([3, 1, 7])],
              lambda losses: losses)]
    for model, inputs, loss_fn in cases:
        model = model.double()
        inputs = [x.double() if x.is_floating_point() else x for x in inputs]
        psh.add_hooks(model, check_unseen=False)  # a checked step's backward is ordinary
        edges = OutputEdges(model)
        losses = loss_fn(model(*inputs))
        edges.backward(losses.mean() if loss_type == "mean" else losses.sum())
        assert all(p.grad is None for p in model.parameters())
        psh.clip_grads(model, 0.1, loss_type=loss_type)
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        edges.remove()
        psh.remove_hooks(model)
        total, _, grads = loop_norms(model, inputs, loss_fn, loss_type)
        expected = loop_clipped(grads, total, 0.1, loss_type)
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("form_on_arrival", [False, True])
def test_output_edges_see_a_view_output_changed_in_place(form_on_arrival):
    """A Linear on [B, T, d] returns a view of its matmul; ReLU(inplace=True) then takes the
    view's own edge out of the graph. The edge backward used to capture nothing for it: zero
    norms and a clipped gradient of zero for that layer, silently."""
    from norms_truth import loop_clipped, loop_norms

    from per_sample_hooks.dp import OutputEdges
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    x = torch.randn(5, 6, 3, dtype=torch.double)
    loss_fn = lambda out: out.pow(2).sum((1, 2))  # noqa: E731
    edges = OutputEdges(model, form_on_arrival=form_on_arrival)
    edges.backward(loss_fn(model(x)).mean())
    norms = psh.compute_norms(model, per_param=True)
    psh.clip_grads(model, 0.5)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    edges.remove()
    psh.remove_hooks(model)
    total, per_param, grads = loop_norms(model, [x], loss_fn, "mean")
    for n, expected in loop_clipped(grads, total, 0.5, "mean").items():
        torch.testing.assert_close(norms[n], per_param[n])
        torch.testing.assert_close(got[n], expected)


def test_output_edges_of_a_copied_model():
    """``copy.deepcopy`` of a model with an ``OutputEdges`` (a ``DPSGD`` model copied for an
    average or an evaluation) copies its recording hook without the hook state: the copy's
    forward used to raise AttributeError; it runs, records nothing, and the original's records
    are its own. A new step (the first forward after a compute_*) forgets stale records."""
    import copy

    from per_sample_hooks.dp import OutputEdges
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    edges = OutputEdges(model)
    x = torch.randn(5, 3)
    copied = copy.deepcopy(model)
    copied(x).sum().backward()
    assert edges.edges == []
    model(x)
    assert len(edges.edges) == 2
    model(x)  # a second forward of the same step adds its outputs' edges
    assert len(edges.edges) == 4
    psh.clear_backprops(model)  # a new step
    assert edges.edges == []
    edges.backward(model(x).sum())
    psh.compute_norms(model)
    model(x)  # the next step's first forward starts afresh
    assert len(edges.edges) == 2
    edges.remove()
    assert edges.clear not in psh.capture.get_state(model).on_clear


def test_dp_backward_matches_loss_backward():
    idx = torch.arange(6)
    model, dp = _setup(noise=0.0, accountant=None)
    dp.zero_grad()
    _backward(model, idx)
    dp.privatize()
    expected = [p.grad.clone() for p in model.parameters()]
    model, dp = _setup(noise=0.0, accountant=None)
    dp.zero_grad()
    torch.manual_seed(1)
    x = torch.randn(64, 6, dtype=torch.double)[idx]
    dp.backward(model(x).pow(2).sum(1).mean())
    dp.privatize()
    for g, p in zip(expected, model.parameters()):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(psh.PerSampleHooksError, match="no output"):
        dp.backward(torch.zeros((), requires_grad=True))


def test_digits_example_runs_one_epoch():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    result = subprocess.run([sys.executable, os.path.join(root, "examples", "dp_sgd_digits.py"),
                             "--epochs", "1", "--threads", "1"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "epoch  1  test accuracy" in result.stdout and "epsilon 2.3" in result.stdout


class TiedOutput(nn.Module):
    def __init__(self, unseen):
        super().__init__()
        self.unseen = unseen
        self.emb = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        y = self.out(h)
        return y + (h @ self.emb.weight)[:, :3] if self.unseen else y


@pytest.mark.parametrize("unseen", [False, True])
def test_checked_steps_take_an_ordinary_backward(unseen):
    """DPSGD's backward is an ordinary one on the steps the unseen-use check runs (the first,
    and one with a new batch size, with no sampled checks here), the edge backward (no
    parameter gradient) on the others; a step refused for an unseen use never counts as
    checked, so every later step is checked again."""
    torch.manual_seed(0)
    model = TiedOutput(unseen).double()
    state = psh.add_hooks(model)
    state.unseen.schedule.budget = 0.0  # no sampled checks: only new structures
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
               max_grad_norm=1.0, dataset_size=64, batch_size=8, accountant=None,
               generator=torch.Generator().manual_seed(0))
    batches = [torch.randn(n, 6, dtype=torch.double) for n in (8, 8, 8, 5, 5, 8)]
    ordinary = []
    for x in batches:
        dp.zero_grad()
        dp.backward(model(x).pow(2).sum(1).mean())
        ordinary.append(model.out.weight.grad is not None)
        if unseen:
            with pytest.raises(psh.PerSampleHooksError, match=r"'emb\.weight'"):
                dp.step()
            continue
        dp.step()
    expected = [True] * 6 if unseen else [True, False, False, True, False, False]
    assert ordinary == expected
