import copy
import io
import math

import pytest
import torch
from norms_truth import RecordingAccountant
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, seeded
from per_sample_hooks.clipping import AdaptiveClipping
from per_sample_hooks.dp import (
    DPSGD,
    fixed_size_batch,
    micro_batches,
    noise_multiplier_for,
    poisson_batch,
)


def _setup(noise=1.0, max_norm=1.0, batch_size=8, dataset_size=64, seed=0, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dp = DPSGD(model, optimizer, noise_multiplier=noise, max_grad_norm=max_norm,
               dataset_size=dataset_size, batch_size=batch_size,
               generator=seeded(seed), **options)
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
               generator=seeded(0))
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
    generator = seeded(0)
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
    generator = seeded(0)
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


def test_zero_grad_between_forward_and_backward():
    """dp.zero_grad() forgets the recorded outputs: dp.backward refused the step ('run the
    forward pass with grad enabled first', which it was); it is now an ordinary backward, the
    same step as zero_grad before the forward. Without a forward, still refused."""
    x = torch.randn(8, 6, dtype=torch.double)
    grads = []
    for late in (True, False):
        model, dp = _setup(noise=0.0, accountant=None)
        if not late:
            dp.zero_grad()
        losses = model(x).pow(2).sum(1)
        if late:
            dp.zero_grad()
        dp.backward(losses.mean())
        dp.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    with pytest.raises(psh.PerSampleHooksError, match="forward pass with grad enabled"):
        dp.backward(torch.zeros(()))


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
    assert edges.clear not in psh.capture.get_state(model).listeners.on_clear


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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
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
               generator=seeded(0))
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


# ---------------------------------------------------------------- virtual batches

def _train_epochs(dtype, loss_type, max_micro_batch=None, epochs=3, style="batches"):
    """DPSGD with real steps (SGD with momentum, noise) on 12 samples, expected batch 2: the
    batch sizes drawn and the parameters after ``epochs``; ``style`` "accumulate": pieces of
    one's own, ``accumulate()`` after each and ``step()`` at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    x = torch.randn(12, 6, dtype=dtype)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5),
               noise_multiplier=0.8, max_grad_norm=0.5, dataset_size=12, batch_size=2,
               loss_type=loss_type, accountant=RecordingAccountant(),
               generator=seeded(5))
    sizes = []
    for _ in range(epochs):
        if style == "accumulate":
            for idx in dp.batches():
                sizes.append(len(idx))
                for piece in idx.split(max_micro_batch) if len(idx) else []:
                    dp.zero_grad()
                    losses = model(x[piece]).pow(2).sum(1)
                    dp.backward(losses.mean() if loss_type == "mean" else losses.sum())
                    dp.accumulate()
                dp.step()  # nothing pending: noise and step
            continue
        for idx in dp.batches(max_micro_batch=max_micro_batch):
            sizes.append(len(idx))
            dp.zero_grad()
            if len(idx):
                losses = model(x[idx]).pow(2).sum(1)
                dp.backward(losses.mean() if loss_type == "mean" else losses.sum())
            dp.step()
    assert len(dp.accountant.history) == dp.steps == 6 * epochs
    return sizes, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_virtual_batches_match_one_big_batch(dtype, loss_type):
    """Poisson batches in pieces of at most 2 (uneven: 3 = 2 + 1; empty batches one empty
    piece): the clipped sums accumulate, noise and accounting once per batch, the parameters
    those of the same batches whole (same indices, same noise: same generator seed)."""
    sizes, whole = _train_epochs(dtype, loss_type)
    assert 0 in sizes and any(n > 2 and n % 2 for n in sizes)  # the cases this test is for
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    for style in ["batches", "accumulate"]:
        pieces_sizes, pieces = _train_epochs(dtype, loss_type, max_micro_batch=2, style=style)
        assert pieces_sizes == (sizes if style == "accumulate" else
                                [len(p) for n in sizes for p in micro_batches(torch.arange(n), 2)])
        for p, q in zip(pieces, whole):
            torch.testing.assert_close(p, q, **tolerance)
    moved = _train_epochs(dtype, loss_type, epochs=1)[1]
    assert not torch.allclose(moved[0], whole[0])  # the steps change the parameters


def test_virtual_batch_pieces_and_last_micro_batch():
    _, dp = _setup(accountant=None, dataset_size=64, batch_size=16)
    _, whole = _setup(accountant=None, dataset_size=64, batch_size=16)
    pieces, flags = [], []
    for idx in dp.batches(max_micro_batch=5):
        pieces.append(idx)
        flags.append(dp.last_micro_batch)
        dp._accumulated = 0  # only the pieces are looked at here (no backward)
    batches = list(whole.batches())
    assert torch.equal(torch.cat(pieces), torch.cat(batches))
    assert all(0 < len(p) <= 5 for p in pieces)
    assert sum(flags) == len(batches) and flags[-1]
    assert dp.last_micro_batch


def test_unfinished_virtual_batch_is_refused():
    model, dp = _setup(accountant=None, dataset_size=64, batch_size=16)
    with pytest.raises(psh.PerSampleHooksError, match="never stepped"):
        for idx in dp.batches(max_micro_batch=4):
            dp.zero_grad()
            _backward(model, idx)
            dp.accumulate()  # never step()


def _pieces_run(dtype, pieces):
    """A DPSGD with noise 0 and SGD at lr 1 on 8 samples, batch_size 4: ``pieces(model, dp, x)``
    runs a batch; the parameters' change, and the change of the whole batch ``x[4:8]`` alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=dtype)
    changes = []
    for net, run in ((model, pieces), (reference, None)):
        dp = DPSGD(net, torch.optim.SGD(net.parameters(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=0.5, dataset_size=8, batch_size=4, accountant=None)
        before = [p.detach().clone() for p in net.parameters()]
        if run is None:
            dp.zero_grad()
            dp.backward(net(x[4:]).pow(2).sum(1).mean())
            dp.step()
        else:
            run(net, dp, x)
        changes.append([p.detach() - b for p, b in zip(net.parameters(), before)])
        dp.close()
        psh.remove_hooks(net)
    return changes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_parameter_frozen_between_pieces_is_refused_and_discard_batch_starts_anew(dtype):
    """A parameter frozen or unfrozen between two pieces of one batch: the earlier pieces'
    sums were left in buffers re-allocated for the new parameters (uninitialized: NaN or
    garbage in every parameter's update). Refused before anything changes, naming it;
    ``discard_batch()`` drops the pieces, and the next batch is that batch's alone."""
    for trainable_first in (True, False):
        def pieces(model, dp, x, trainable_first=trainable_first):
            model[2].bias.requires_grad_(trainable_first)
            dp.zero_grad()
            dp.backward(model(x[:2]).pow(2).sum(1).mean())
            dp.accumulate()
            model[2].bias.requires_grad_(not trainable_first)
            dp.zero_grad()
            dp.backward(model(x[2:4]).pow(2).sum(1).mean())
            before = [p.detach().clone() for p in model.parameters()]
            change = "frozen" if trainable_first else "unfrozen"
            with pytest.raises(psh.PerSampleHooksError, match=rf"DPSGD.step: the trainable "
                               rf"parameters changed between pieces of one batch \('2.bias' "
                               rf"\({change}\)\).*dp.discard_batch\(\)"):
                dp.step()
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            dp.discard_batch()
            model[2].bias.requires_grad_(True)
            dp.zero_grad()
            dp.backward(model(x[4:]).pow(2).sum(1).mean())
            dp.step()
        got, expected = _pieces_run(dtype, pieces)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_piece_refused_for_a_frozen_parameter_is_run_again_once_unfrozen(dtype):
    """The piece refused for a parameter frozen since the first piece is dropped, as the
    refusal says (its re-run was refused as a second forward after a backward): run again with
    the parameter trainable, the step is the whole batch's, exact."""
    def pieces(model, dp, x):
        dp.zero_grad()
        dp.backward(model(x[4:6]).pow(2).sum(1).mean())
        dp.accumulate()
        model[2].bias.requires_grad_(False)
        dp.zero_grad()
        dp.backward(model(x[6:]).pow(2).sum(1).mean())
        with pytest.raises(psh.PerSampleHooksError, match=r"This piece is dropped: run its "
                           r"forward and backward again .* then step\(\) \(the 1 earlier"):
            dp.step()
        model[2].bias.requires_grad_(True)
        dp.zero_grad()
        dp.backward(model(x[6:]).pow(2).sum(1).mean())
        dp.step()
    got, expected = _pieces_run(dtype, pieces)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_refused_piece_keeps_the_earlier_ones_until_discarded(dtype):
    """A piece refused (a second forward and backward in it) keeps the batch's earlier pieces
    and says so: with it fixed, the step is the whole batch's; after ``discard_batch()`` the
    next batch is its own alone (it silently included the aborted batch's first piece), and
    ``batches()`` and ``state_dict()`` work again (they refused for ever)."""
    def retried(model, dp, x):
        x = torch.cat([x[4:6], x[:2], x[6:]])  # the batch x[4:8], its first piece x[4:6]
        dp.zero_grad()
        dp.backward(model(x[:2]).pow(2).sum(1).mean())
        dp.accumulate()
        dp.zero_grad()
        model(x[2:4]).pow(2).sum(1).mean().backward()
        model(x[4:6]).pow(2).sum(1).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"^DPSGD: .* ran a forward pass after a "
                           r"backward pass.*\(The clipped sums of this batch's earlier pieces, 1, "
                           r"stay accumulated: run this piece again once it is fixed, or "
                           r"dp.discard_batch\(\) to drop them\)"):
            dp.step()
        psh.clear_backprops(model)
        dp.zero_grad()
        dp.backward(model(x[4:6]).pow(2).sum(1).mean())
        dp.step()

    def discarded(model, dp, x):
        for k, idx in enumerate(dp.batches(max_micro_batch=2)):
            dp.zero_grad()
            dp.backward(model(x[idx]).pow(2).sum(1).mean())
            if k == 1:
                model(x[idx]).sum().backward()
                with pytest.raises(psh.PerSampleHooksError, match="earlier pieces"):
                    dp.step()
                break
            dp.step()
        dp.discard_batch()
        dp.state_dict()
        next(iter(dp.batches()))
        dp.zero_grad()
        dp.backward(model(x[4:]).pow(2).sum(1).mean())
        dp.step()
    for pieces in (retried, discarded):
        got, expected = _pieces_run(dtype, pieces)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


def test_virtual_batches_refused_under_ddp():
    _, dp = _setup(accountant=None)
    dp.distributed = True  # as for a DistributedDataParallel or FSDP2 model
    with pytest.raises(psh.PerSampleHooksError, match="DistributedDataParallel or FSDP2"):
        next(dp.batches(max_micro_batch=4))
    with pytest.raises(psh.PerSampleHooksError, match="DistributedDataParallel or FSDP2"):
        dp.accumulate()
    with pytest.raises(ValueError, match="max_micro_batch"):
        next(_setup(accountant=None)[1].batches(max_micro_batch=0))


def test_empty_batch_from_batches_needs_no_flag():
    """step() after an empty batch of batches() is a noise-only step without empty_batch=;
    after the loop the default is False again."""
    model, dp = _setup(accountant=RecordingAccountant(), dataset_size=40, batch_size=1)
    sizes = []
    for idx in dp.batches():
        sizes.append(len(idx))
        dp.zero_grad()
        if len(idx):
            _backward(model, idx)
        dp.step()
    assert 0 in sizes and dp.steps == 40
    with pytest.raises(psh.PerSampleHooksError, match="backward"):
        dp.step()


def test_empty_batch_of_the_users_own_sampler_without_the_flag_names_the_flag():
    """An empty Poisson batch drawn by the user's own sampler, forward and backward skipped,
    and step() without empty_batch=True: refused naming the flag (not a clip_grads the user
    never called); the next batch steps as usual."""
    model, dp = _setup()
    _backward(model, [0, 1, 2])
    dp.step()
    dp.zero_grad()
    with pytest.raises(psh.PerSampleHooksError, match=r"step\(empty_batch=True\)") as refusal:
        dp.step()
    assert "clip_grads" not in str(refusal.value)
    dp.zero_grad()
    _backward(model, [3, 4])
    assert dp.step().shape == (2,)


# ---------------------------------------------------------------- the noise

def test_flat_buffers_are_views_kept_across_calls():
    from per_sample_hooks.noise import FlatBuffers
    buffers = FlatBuffers()
    tensors = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64), torch.zeros(2)]
    views = buffers.like(tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    assert [v.dtype for v in views] == [t.dtype for t in tensors]
    device = tensors[0].device  # the default device (PSH_TEST_DEVICE)
    assert {k: f.numel() for k, f in buffers.flats.items()} == {
        (torch.float32, device): 14, (torch.float64, device): 5}
    flat = buffers.flats[torch.float32, device]
    flat.copy_(torch.arange(14.0))
    assert views[0].flatten().tolist() == list(range(12)) and views[2].tolist() == [12, 13]
    assert buffers.like(tensors)[0].data_ptr() == views[0].data_ptr()  # reused
    assert buffers.like(tensors[:1])[0].shape == (3, 4)  # a new layout: new storage


def test_noise_storage_is_reused_across_steps():
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
               max_grad_norm=1.0, dataset_size=100, batch_size=10, accountant=None,
               generator=seeded(0))
    noises, pointers = [], []
    for _ in range(2):
        dp.zero_grad()
        dp.step(empty_batch=True)
        noises.append(model.weight.grad.clone())
        pointers.append([f.data_ptr() for f in dp._noise.buffers.flats.values()])
    assert pointers[0] == pointers[1] and len(pointers[0]) == 1
    assert not torch.equal(noises[0], noises[1])
    dp.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noise_drawn_ahead_is_the_noise_drawn_in_place(dtype):
    """GaussianNoise with ``ahead``: the draw of the next call made on a background thread
    gives the same numbers as drawing at the call, from the same seed; other shapes drop it
    (and drew the next numbers from where it left the generator)."""
    from per_sample_hooks.noise import GaussianNoise
    shapes = [torch.empty(3, 4, dtype=dtype), torch.empty(5, dtype=dtype),
              torch.empty(2, dtype=torch.float64)]
    ahead, in_place = GaussianNoise(seeded(3), ahead=True), GaussianNoise(seeded(3), ahead=False)
    for _ in range(3):
        got = [v.clone() for v in ahead.draw(shapes)]
        ahead.draw_ahead()
        for g, expected in zip(got, in_place.draw(shapes)):
            assert g.dtype == expected.dtype and torch.equal(g, expected)
    # the draw made ahead is dropped, and the generator set back: the same numbers again
    other = ahead.draw([torch.empty(7, dtype=dtype)])[0]
    assert torch.equal(other, in_place.draw([torch.empty(7, dtype=dtype)])[0])
    ahead.close()


def test_dpsgd_noise_ahead_steps_as_without():
    """Same seed, noise drawn ahead or at the step: the same parameters after real steps
    (Poisson batches from the same generator, momentum), the first layer frozen half way (the
    noise's shapes change: the draw made ahead for the old ones is dropped)."""
    def train(noise_ahead: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        x = torch.randn(40, 6)
        dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                   noise_multiplier=1.0, max_grad_norm=0.5, dataset_size=40, batch_size=8,
                   accountant=None, generator=seeded(2), noise_ahead=noise_ahead)
        for step, idx in enumerate(dp.batches()):
            if step == 2:
                model[0].requires_grad_(False)
            dp.zero_grad()
            if len(idx):
                dp.backward(model(x[idx]).pow(2).sum(1).mean())
            dp.step()
        dp.close()
        return [p.detach().clone() for p in model.parameters()]
    for got, expected in zip(train(True), train(False)):
        assert torch.equal(got, expected)


def _normality(z: torch.Tensor) -> None:
    """``z`` looks like draws of N(0, 1): mean, variance, Kolmogorov-Smirnov distance, tails."""
    n = z.numel()
    z = z.double().flatten()
    assert abs(z.mean().item()) < 4 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 4 * math.sqrt(2 / n)
    cdf = 0.5 * (1 + torch.erf(z.sort().values / math.sqrt(2)))
    ks = (cdf - torch.arange(1, n + 1, dtype=torch.double) / n).abs().max().item()
    assert ks < 1.95 / math.sqrt(n)  # the 0.1% critical value
    beyond = (z.abs() > 3).double().mean().item()
    assert abs(beyond - 0.0026998) < 5 * math.sqrt(0.0027 / n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_gaussian_is_standard_normal(dtype):
    from per_sample_hooks.noise import gaussian_, secure_gaussian_
    z = secure_gaussian_(torch.empty(200_001, dtype=dtype))
    _normality(z)
    assert z.dtype == dtype
    other = gaussian_(torch.empty(7, 3, dtype=dtype), 2.0, secure=True)
    assert other.shape == (7, 3) and not torch.equal(other, gaussian_(other.clone(), 2.0,
                                                                      secure=True))
    drawn = gaussian_(torch.empty(200_000, dtype=dtype), 1.0, seeded(0))
    _normality(drawn)


def test_secure_rng_noise():
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.3,
               max_grad_norm=2.0, dataset_size=1000, batch_size=40, accountant=None,
               secure_rng=True)
    dp.step(empty_batch=True)
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    _normality(noise / (1.3 * 2.0 / 40))
    with pytest.raises(ValueError, match="secure_rng"):
        DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
              max_grad_norm=1.0, dataset_size=10, batch_size=5, accountant=None,
              secure_rng=True, generator=torch.Generator())


# ---------------------------------------------------------------- data

class DictDataset(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "name": f"sample {i}"}


def _data_dp(data, **options):
    model = nn.Linear(6, 3)
    return DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=1.0,
                 max_grad_norm=1.0, data=data, accountant=None,
                 generator=seeded(0), **options)


def test_data_gives_the_samples_of_the_sampled_indices():
    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(3, (40,))
    indices = list(_setup(dataset_size=40, batch_size=1, accountant=None)[1].batches())
    assert any(len(i) == 0 for i in indices)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=1,
                                         shuffle=True)
    for data, options in [(torch.utils.data.TensorDataset(x, y), dict(batch_size=1)),
                          (loader, {}), (DictDataset(x, y), dict(batch_size=1)),
                          (torch.utils.data.DataLoader(DictDataset(x, y), batch_size=1,
                                                       collate_fn=lambda s: s), {})]:
        dp = _data_dp(data, **options)
        assert dp.dataset_size == 40 and dp.batch_size == 1
        for idx, batch in zip(indices, dp.batches()):
            if isinstance(batch, list) and batch and isinstance(batch[0], torch.Tensor):
                assert torch.equal(batch[0], x[idx]) and torch.equal(batch[1], y[idx])
                assert batch[0].shape == (len(idx), 6) and batch[1].dtype == torch.long
            elif isinstance(batch, dict):
                assert torch.equal(batch["x"], x[idx]) and torch.equal(batch["y"], y[idx])
                assert batch["name"] == [f"sample {i}" for i in idx.tolist()]
            else:  # the loader's own collate_fn: the list of samples
                assert [s["name"] for s in batch] == [f"sample {i}" for i in idx.tolist()]


class GraphBatch:
    """A collated batch that cannot be cut to length 0 (torch_geometric's ``DataBatch``)."""

    def __init__(self, samples):
        if not samples:
            raise ValueError("cannot collate an empty list")
        self.x = torch.stack([s["x"] for s in samples])


def test_data_that_cannot_make_an_empty_batch_is_refused_when_poisson_sampling_is_set_up():
    """Poisson sampling draws empty batches: a collate_fn that cannot give one is refused by
    the constructor (it was refused at the first empty draw, maybe epochs in); fixed-size
    sampling never draws one and takes it."""
    x, y = torch.randn(40, 6), torch.randint(3, (40,))
    loader = torch.utils.data.DataLoader(DictDataset(x, y), batch_size=1, collate_fn=GraphBatch)
    with pytest.raises(TypeError, match=r"DPSGD: cannot make an empty batch .*\(GraphBatch; .*"
                                        r"Poisson sampling draws now and then.*sampling='fixed'"):
        _data_dp(loader)
    dp = _data_dp(loader, sampling="fixed")
    for _, batch in zip(range(3), dp.batches()):
        assert batch.x.shape == (1, 6)


def test_data_pieces_and_training_match_indices():
    """A Dataset through batches(max_micro_batch=) trains exactly like indices into tensors."""
    torch.manual_seed(0)
    x = torch.randn(64, 6, dtype=torch.double)
    results = []
    for data in [None, DictDataset(x, torch.zeros(64))]:
        model, dp = _setup(dataset_size=None if data else 64, data=data)
        model[0].weight.data.mul_(3)  # clip some samples
        dp.optimizer.param_groups[0]["lr"] = 0.5
        for batch in dp.batches(max_micro_batch=3):
            inputs = x[batch] if data is None else batch["x"]
            dp.zero_grad()
            if len(inputs):
                dp.backward(model(inputs).pow(2).sum(1).mean())
            dp.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        torch.testing.assert_close(p, q)


def test_bad_data_arguments():
    x = torch.utils.data.TensorDataset(torch.randn(10, 2))
    with pytest.raises(ValueError, match="dataset_size=12 but the data holds 10"):
        _data_dp(x, dataset_size=12, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        _data_dp(x)
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

        def __len__(self):
            return 3
    with pytest.raises(TypeError, match="map-style Dataset.*Stream"):
        _data_dp(Stream(), batch_size=1)


# ---------------------------------------------------------------- the budget

@pytest.mark.parametrize("epochs", [1, 5])
def test_target_epsilon_is_spent_in_the_planned_epochs(epochs):
    """From a budget: the noise multiplier that noise_multiplier_for picks; after the planned
    epochs (empty steps are steps too) epsilon is at most the target and within Opacus'
    tolerance (0.01) of it."""
    model = nn.Linear(3, 2)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0,
               target_epsilon=2.0, target_delta=1e-5, epochs=epochs, dataset_size=500,
               batch_size=25, generator=seeded(0))
    assert dp.noise_multiplier == pytest.approx(
        noise_multiplier_for(2.0, 1e-5, sample_rate=0.05, steps=20 * epochs))
    for _ in range(epochs):
        for _ in dp.batches():
            dp.step(empty_batch=True)
    assert dp.steps == 20 * epochs
    assert 2.0 - 0.011 <= dp.epsilon() <= 2.0
    assert dp.epsilon(1e-5) == dp.epsilon()


@pytest.mark.parametrize("options, match", [
    (dict(noise_multiplier=1.0, target_epsilon=1.0, target_delta=1e-5, epochs=1), "exactly one"),
    (dict(), "exactly one"), (dict(target_epsilon=1.0, epochs=1), "target_delta and epochs"),
    (dict(noise_multiplier=1.0, epochs=3), "go with target_epsilon"),
    (dict(target_epsilon=-1.0, target_delta=1e-5, epochs=1), "target_epsilon > 0"),
    (dict(target_epsilon=1.0, target_delta=1e-5, epochs=1, accountant=None), "accountant="),
])
def test_bad_budget_arguments(options, match):
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=match):
        DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0,
              dataset_size=100, batch_size=10, **options)
    _, dp = _setup()
    with pytest.raises(ValueError, match="give delta"):
        dp.epsilon()


def _resumable_run(dtype, seed=5, **options):
    """A DPSGD run that momentum, noise, Poisson batches and the RDP accountant make depend on
    every piece of state: 12 samples, expected batch 3 (4 steps an epoch)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5),
               noise_multiplier=0.8, max_grad_norm=0.5, dataset_size=12, batch_size=3,
               generator=seeded(seed), **options)
    return model, dp


def _epoch(model, dp, x):
    for idx in dp.batches():
        dp.zero_grad()
        if len(idx):
            dp.backward(model(x[idx]).pow(2).sum(1).mean())
        dp.step()


@pytest.mark.parametrize("options", [
    {}, {"noise_ahead": False},
    {"adaptive_clipping": AdaptiveClipping(count_noise_multiplier=1.0)}],
    ids=["noise ahead", "noise at the step", "adaptive clipping"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_run_saved_and_resumed_steps_as_one_run(dtype, options):
    """Two epochs, saved (model, optimizer, DPSGD), loaded into a DPSGD built with other seeds,
    one more epoch: the parameters, steps, threshold and epsilon of three epochs in one run."""
    x = torch.randn(12, 6, dtype=dtype)
    whole, dp_whole = _resumable_run(dtype, **options)
    for _ in range(3):
        _epoch(whole, dp_whole, x)
    dp_whole.close()

    model, dp = _resumable_run(dtype, **options)
    for _ in range(2):
        _epoch(model, dp, x)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": dp.optimizer.state_dict(),
                "dp": dp.state_dict()}, saved)
    dp.close()
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    resumed, dp_resumed = _resumable_run(dtype, seed=11, **options)
    resumed.load_state_dict(state["model"])
    dp_resumed.optimizer.load_state_dict(state["optimizer"])
    dp_resumed.load_state_dict(state["dp"])
    _epoch(resumed, dp_resumed, x)
    dp_resumed.close()

    assert dp_resumed.steps == dp_whole.steps == 12
    assert dp_resumed.epsilon(1e-5) == dp_whole.epsilon(1e-5)
    assert dp_resumed.max_grad_norm == pytest.approx(dp_whole.max_grad_norm, rel=1e-5)
    for got, expected in zip(resumed.parameters(), whole.parameters()):
        torch.testing.assert_close(got, expected)


def test_saving_mid_batch_or_into_another_kind_of_dpsgd_is_refused():
    """state_dict between the pieces of a batch, an accountant without state_dict, and a state
    loaded into a DPSGD built without what it saved: refused, saying what to do."""
    x = torch.randn(12, 6, dtype=torch.double)
    model, dp = _resumable_run(torch.double)
    dp.zero_grad()
    dp.backward(model(x[:2]).pow(2).sum(1).mean())
    dp.accumulate()  # a first piece of a batch
    with pytest.raises(psh.PerSampleHooksError, match="a batch is under way"):
        dp.state_dict()
    dp.close()

    model, dp = _resumable_run(torch.double, accountant=RecordingAccountant())
    with pytest.raises(psh.PerSampleHooksError,
                       match=r"accountant \(RecordingAccountant\) has no state_dict"):
        dp.state_dict()
    dp.close()

    model, dp = _resumable_run(torch.double)
    _epoch(model, dp, x)
    state = dp.state_dict()
    dp.close()
    model, unaccounted = _resumable_run(torch.double, accountant=None)
    with pytest.raises(psh.PerSampleHooksError,
                       match="saved by a DPSGD with an accountant, this one was built without"):
        unaccounted.load_state_dict(state)
    assert unaccounted.steps == 0  # refused before anything was loaded
    unaccounted.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_gan_whose_generator_step_runs_through_the_private_discriminator(dtype):
    """DP-GAN: the discriminator trained with DPSGD (noise 0), the generator's step through
    it with its hooks on (``D(G(z))``, the natural code). The generator step's records were
    left in the discriminator's hooks, and the next batch, started with ``dp.zero_grad()``,
    was refused as a second micro-batch: ``zero_grad`` drops them. Each discriminator step
    is the clipped mean of its per-sample gradients (real and fake of each sample), from the
    float64 loop."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).to(dtype)
    discriminator = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)).to(dtype)
    dp = DPSGD(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.5),
               noise_multiplier=0.0, max_grad_norm=0.3, dataset_size=12, batch_size=6,
               accountant=None)
    generator_optimizer = torch.optim.SGD(generator.parameters(), lr=0.1)
    bce = nn.functional.binary_cross_entropy_with_logits

    def sample_losses(d, real, fake):
        r, f = d(real), d(fake)
        return (bce(r, torch.ones_like(r), reduction="none") +
                bce(f, torch.zeros_like(f), reduction="none")).sum(1)

    try:
        for _ in range(3):
            real, z = torch.randn(6, 6, dtype=dtype), torch.randn(6, 4, dtype=dtype)
            fake = generator(z).detach()
            reference = copy.deepcopy(discriminator).double()
            psh.remove_hooks(reference)
            grads = [torch.autograd.grad(sample_losses(reference, real[i:i + 1].double(),
                                                       fake[i:i + 1].double()).sum(),
                                         list(reference.parameters())) for i in range(6)]
            norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in grads])
            factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
            expected = [p.detach().double() - 0.5 * sum(f * gs[k] for f, gs in
                                                         zip(factors, grads)) / 6
                        for k, p in enumerate(discriminator.parameters())]
            dp.zero_grad()
            dp.backward(sample_losses(discriminator, real, fake).mean())
            dp.step()
            for p, want in zip(discriminator.parameters(), expected):
                torch.testing.assert_close(p.detach().double(), want,
                                           **({} if dtype == torch.float64 else
                                              dict(rtol=1e-4, atol=1e-6)))
            generator_optimizer.zero_grad()
            out = discriminator(generator(torch.randn(6, 4, dtype=dtype)))
            bce(out, torch.ones_like(out)).backward()  # D's hooks on: records left in them
            generator_optimizer.step()
    finally:
        dp.close()
        psh.remove_hooks(discriminator)


def _small_dpsgd() -> tuple[nn.Module, DPSGD, torch.Tensor]:
    """A small MLP, its DPSGD (noise 0, batch 6) and a batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
               max_grad_norm=1.0, dataset_size=12, batch_size=6, accountant=None)
    return model, dp, torch.randn(6, 4)


def test_zero_grad_between_the_backward_and_the_step_is_named():
    """``dp.zero_grad()`` drops the records of a backward no step took (a GAN's generator
    step): called between this batch's backward and ``step()`` it dropped them, and the step
    said no backward had run. It says ``zero_grad`` did; the batch run again steps."""
    model, dp, x = _small_dpsgd()
    try:
        dp.zero_grad()
        dp.backward(model(x).square().sum(1).mean())
        dp.zero_grad()
        with pytest.raises(psh.PerSampleHooksError, match=r"dp.zero_grad\(\) ran after this "
                           r"batch's backward and dropped its records"):
            dp.step()
        dp.backward(model(x).square().sum(1).mean())
        dp.step()
    finally:
        dp.close()
        psh.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_grad_after_the_last_pieces_backward_is_refused_and_the_piece_run_again(dtype):
    """Pieces accumulated, then the last piece's backward and ``dp.zero_grad()``: the step
    stepped (optimizer and accountant) with the earlier pieces' sums alone, the last piece's
    samples dropped without a word. Refused, keeping the earlier pieces; the piece run again,
    the step is the whole batch's."""
    def zeroed(model, dp, x):
        dp.zero_grad()
        dp.backward(model(x[4:6]).pow(2).sum(1).mean())
        dp.accumulate()
        dp.zero_grad()
        dp.backward(model(x[6:8]).pow(2).sum(1).mean())
        dp.zero_grad()
        with pytest.raises(psh.PerSampleHooksError, match=r"dp.zero_grad\(\) ran after this "
                           r"piece's backward .*the earlier pieces' sums are kept"):
            dp.step()
        assert dp.steps == 0
        dp.backward(model(x[6:8]).pow(2).sum(1).mean())
        dp.step()
    got, expected = _pieces_run(dtype, zeroed)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **({} if dtype == torch.float64 else
                                            dict(rtol=1e-4, atol=1e-6)))


def test_dp_backward_of_a_forward_with_the_hooks_disabled_names_them():
    """``dp.backward`` of a forward run with the hooks disabled: refused (nothing recorded),
    saying they are disabled; the next batch, hooks on, steps."""
    model, dp, x = _small_dpsgd()
    try:
        dp.zero_grad()
        psh.disable_hooks(model)
        with pytest.raises(psh.PerSampleHooksError, match=r"no output of a hooked module was "
                           r"recorded .*they are disabled: disable_hooks"):
            dp.backward(model(x).square().sum(1).mean())
        psh.enable_hooks(model)
        dp.zero_grad()
        dp.backward(model(x).square().sum(1).mean())
        dp.step()
    finally:
        dp.close()
        psh.remove_hooks(model)


def test_a_step_on_a_micro_batch_accelerate_does_not_sync_is_refused():
    """accelerate's optimizer skips ``step()`` inside ``accelerator.accumulate`` on the
    micro-batches it does not sync: DPSGD privatized each alone (the earlier ones dropped,
    65-220% off) and counted it as a step. Refused, nothing changed; ``dp.accumulate()`` on such
    micro-batches and ``dp.step()`` on the last give the one-batch step."""
    import types
    model, dp = _setup(noise=0.0, max_norm=0.5, batch_size=4)
    twin, reference = _setup(noise=0.0, max_norm=0.5, batch_size=4)
    dp.optimizer.gradient_state = types.SimpleNamespace(sync_gradients=False)
    _backward(model, [0, 1])
    with pytest.raises(psh.PerSampleHooksError, match="accelerator.accumulate.*dp.accumulate()"):
        dp.step()
    assert dp.steps == 0
    dp.accumulate()
    dp.zero_grad()
    _backward(model, [2, 3])
    dp.optimizer.gradient_state.sync_gradients = True
    dp.step()
    _backward(twin, [0, 1, 2, 3])
    reference.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
    assert dp.steps == reference.steps == 1
