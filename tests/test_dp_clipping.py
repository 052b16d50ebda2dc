"""DPSGD with per-group thresholds (noise from the sensitivity sqrt(sum C_k^2)), groups of rows
(counted as the samples) and adaptive clipping (Andrew et al. 2021)."""
import copy
import math

import pytest
import torch
from norms_truth import RecordingAccountant
from torch import nn

import per_sample_hooks as psh
from ground_truth import seeded
from per_sample_hooks.clipping import AdaptiveClipping
from per_sample_hooks.dp import DPSGD


def empty_step_noise(max_grad_norm, noise=1.3, **options) -> tuple[torch.Tensor, DPSGD]:
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    if callable(max_grad_norm):
        max_grad_norm = max_grad_norm(model)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=noise,
               max_grad_norm=max_grad_norm, dataset_size=1000, batch_size=40,
               accountant=RecordingAccountant(), generator=seeded(0),
               **options)
    dp.zero_grad()
    dp.step(empty_batch=True)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), dp


def test_per_group_noise_is_scaled_by_the_sensitivity():
    """Thresholds 2 (weight) and 1 (bias): noise std 1.3 sqrt(2^2 + 1^2) / 40; the accountant
    sees the noise multiplier unchanged."""
    noise, dp = empty_step_noise(lambda m: [(m.weight, 2.0), (m.bias, 1.0)])
    expected = 1.3 * math.sqrt(5.0) / 40
    assert abs(noise.std().item() / expected - 1) < 0.03
    assert dp.accountant.history == [(1.3, 0.04)]
    assert dp.max_grad_norm == (2.0, 1.0)


def test_adaptive_gradient_noise_multiplier_and_accounting():
    """z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2); the accountant is told z."""
    adaptive = AdaptiveClipping(target_quantile=0.5, count_noise_multiplier=2.0)
    noise, dp = empty_step_noise(2.0, noise=1.3, adaptive_clipping=adaptive)
    z_grad = (1.3 ** -2 - 4.0 ** -2) ** -0.5
    assert dp.gradient_noise_multiplier == pytest.approx(z_grad)
    assert abs(noise.std().item() / (z_grad * 2.0 / 40) - 1) < 0.03
    assert dp.accountant.history == [(1.3, 0.04)]
    # an empty batch counts no unclipped sample: the threshold shrinks (up to the count noise)
    assert dp.max_grad_norm != 2.0
    # the paper's default count noise: the expected batch size / 20 = 2
    assert AdaptiveClipping().gradient_noise_multiplier(1.3, 40) == pytest.approx(z_grad)


@pytest.mark.parametrize("options, message", [
    (dict(count_noise_multiplier=0.6), r"count_noise_multiplier \(0.6\) must be > "
                                       r"noise_multiplier / 2 \(0.65\)"),
    (dict(target_quantile=1.0), "target_quantile must be in"),
    (dict(learning_rate=0.0), "learning_rate must be finite and > 0"),
    (dict(count_noise_multiplier=-1.0), "count_noise_multiplier must be finite and >= 0"),
])
def test_bad_adaptive_clipping(options, message):
    with pytest.raises(ValueError, match=message):
        empty_step_noise(1.0, adaptive_clipping=AdaptiveClipping(**options))


def test_adaptive_clipping_needs_one_threshold():
    """Refused in the constructor, which leaves the model unhooked (it was left hooked)."""
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="adaptive_clipping needs one max_grad_norm"):
        DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
              max_grad_norm=[(model.weight, 2.0), (model.bias, 1.0)], dataset_size=100,
              batch_size=10, adaptive_clipping=AdaptiveClipping(count_noise_multiplier=10.0))
    assert not model._forward_hooks and not model._forward_pre_hooks and not vars(model.weight)


def fixed_problem(size: int = 256):
    """A model that never moves (lr 0) on fixed data whose gradient norms spread widely."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(size, 6, dtype=torch.double) * torch.rand(size, 1, dtype=torch.double) * 3
    y = torch.randn(size, 3, dtype=torch.double)
    return model, x, y


def true_norms(model, x, y) -> torch.Tensor:
    psh.add_hooks(model)
    try:
        (model(x) - y).pow(2).sum(1).mean().backward()
        return psh.compute_norms(model)
    finally:
        psh.remove_hooks(model)
        model.zero_grad(set_to_none=True)


def run_adaptive(sampling: str, batch_size: int, steps: int, quantile: float, count_noise: float
                 ) -> tuple[list[float], torch.Tensor]:
    model, x, y = fixed_problem()
    norms = true_norms(model, x, y)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
               max_grad_norm=10 * norms.max().item(), dataset_size=len(x),
               batch_size=batch_size, sampling=sampling, accountant=None,
               generator=seeded(0),
               adaptive_clipping=AdaptiveClipping(quantile, 0.2, count_noise))
    history = []
    for _ in range(steps):
        idx = dp.sample()
        dp.zero_grad()
        if len(idx):
            dp.backward((model(x[idx]) - y[idx]).pow(2).sum(1).mean())
        dp.step(empty_batch=len(idx) == 0)
        history.append(dp.max_grad_norm)
    dp.close()
    return history, norms


@pytest.mark.parametrize("quantile", [0.3, 0.8])
def test_adaptive_threshold_converges_to_the_quantile_full_batch(quantile):
    """Every sample each step, little count noise: the threshold settles within 1% of the
    target quantile of the true norms (from 10x the largest norm)."""
    history, norms = run_adaptive("fixed", 256, 150, quantile, count_noise=0.5)
    target = torch.quantile(norms, quantile).item()
    assert history[0] > 2 * target  # it had a long way to go
    assert all(abs(c / target - 1) < 0.01 for c in history[-20:]), (history[-20:], target)


def test_adaptive_threshold_follows_the_quantile_with_poisson_batches():
    """Poisson batches of 32 expected: the threshold, averaged over the last 200 of 400 steps,
    within 5% of the median norm."""
    history, norms = run_adaptive("poisson", 32, 400, 0.5, count_noise=1.0)
    target = torch.quantile(norms, 0.5).item()
    average = sum(history[-200:]) / 200
    assert abs(average / target - 1) < 0.05, (average, target)


@pytest.mark.parametrize("max_grad_norm", [0.3, lambda m: [(m[0], 0.2), (m[1:], 0.1)]],
                         ids=["one", "per-layer"])
def test_dpsgd_groups_of_rows_clip_groups_and_count_them(max_grad_norm):
    """K=4 rows per sampled example: DPSGD's gradient (no noise) is clip_grads(groups=4)'s
    clipped mean over the groups times count / expected batch; the norms are per group. Two
    steps: the first checked (an ordinary backward), the second not (output edges, per-sample
    gradients formed on arrival)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 2), nn.LayerNorm(2), nn.Flatten(),
                          nn.Linear(16, 3)).double()  # many positions: formed on arrival
    reference = copy.deepcopy(model)
    if callable(max_grad_norm):
        max_grad_norm, reference_norm = max_grad_norm(model), max_grad_norm(reference)
    else:
        reference_norm = max_grad_norm
    x = torch.randn(3 * 4, 8, 6, dtype=torch.double)
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
               max_grad_norm=max_grad_norm, dataset_size=64, batch_size=8,
               accountant=RecordingAccountant())
    psh.add_hooks(reference)
    for _ in range(2):
        dp.zero_grad()
        dp.backward(model(x).pow(2).sum(1).mean())
        norms = dp.step(groups=4)
        reference.zero_grad()
        reference(x).pow(2).sum(1).mean().backward()
        expected_norms = psh.clip_grads(reference, reference_norm, groups=4)
        assert norms.shape == (3,) and bool((norms > 0.3).any())
        torch.testing.assert_close(norms, expected_norms)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad * 3 / 8)
    assert dp.accountant.history == [(0.0, 8 / 64)] * 2
    assert dp.output_edges is not None
    psh.remove_hooks(reference)


def test_virtual_batches_with_groups_and_adaptive_clipping_equal_whole_batches():
    """Pieces of 5 examples (K=2 rows each) step as the whole batch of 12 does: the same
    parameters and thresholds (the unclipped count summed over the pieces, updated once per
    batch, the noise drawn in the same order)."""
    def run(max_micro_batch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        x = torch.randn(48, 6, dtype=torch.double)
        dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=1.0,
                   max_grad_norm=0.5, dataset_size=48, batch_size=12, sampling="fixed",
                   generator=seeded(0),
                   adaptive_clipping=AdaptiveClipping(0.5, 0.2, count_noise_multiplier=3.0))
        thresholds = []
        for piece in dp.batches(max_micro_batch=max_micro_batch):
            dp.zero_grad()
            rows = x[piece].repeat_interleave(2, 0)
            dp.backward((model(rows + 0.1 * torch.sin(rows))).pow(2).sum(1).mean())
            dp.step(groups=2)
            thresholds.append(dp.max_grad_norm)
        dp.close()
        psh.remove_hooks(model)
        return thresholds, list(model.parameters())
    whole, whole_params = run(None)
    pieces, piece_params = run(5)
    assert len(whole) == 4 and len(pieces) == 12  # 4 batches of 12: pieces of 5, 5, 2
    assert pieces[2::3] == pytest.approx(whole, rel=1e-12) and len(set(whole)) == 4
    for p, q in zip(whole_params, piece_params):
        torch.testing.assert_close(p, q)
