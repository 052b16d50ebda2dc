"""What the step engine reads afresh each step: parameters frozen, unfrozen, replaced, resized
or converted between steps of one hooked model still give exact ``grad1`` (float64 loop over
samples), and the unseen-use check's probes, kept across steps that compared nothing, follow a
parameter's new shape and dtype (a check on stale probes would raise or compare nothing)."""
import copy

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, sum_of_outputs


def leaky_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def assert_exact(model: nn.Module, x: torch.Tensor, check_unseen: object) -> None:
    """One hooked step of ``model`` on ``x`` (sum loss) against the float64 loop: every
    trainable parameter's ``grad1``, and no ``grad1`` on a frozen one."""
    psh.add_hooks(model, check_unseen=check_unseen)  # the same state after the first step
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    psh.compute_grad1(model, loss_type="sum")
    reference = copy.deepcopy(model).double()  # a copy is not hooked
    expected = loop_grads(reference, [x.double()], sum_of_outputs, x.shape[0])
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if x.dtype == torch.float32 else \
        {"rtol": 1e-10, "atol": 1e-12}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"frozen {n} kept grad1"
            continue
        assert p.grad1.dtype == p.dtype and p.grad1.shape == (x.shape[0], *p.shape), n
        torch.testing.assert_close(p.grad1.double(), expected[n], **tolerance,
                                   msg=lambda m, n=n: f"{n}: {m}")


CHECKS = [True, "always", False]


@pytest.mark.parametrize("check_unseen", CHECKS)
def test_freezing_and_unfreezing_one_parameter_between_steps(check_unseen):
    model = leaky_mlp()
    x = torch.randn(6, 5)
    assert_exact(model, x, check_unseen)
    model[2].bias.requires_grad_(False)  # one of a module's two parameters
    assert_exact(model, x, check_unseen)
    model[0].requires_grad_(False)  # a whole module
    assert_exact(model, x, check_unseen)
    model[0].requires_grad_(True)
    model[2].bias.requires_grad_(True)
    assert_exact(model, x, check_unseen)
    psh.remove_hooks(model)


@pytest.mark.parametrize("check_unseen", CHECKS)
def test_replacing_and_resizing_parameters_between_steps(check_unseen):
    model = leaky_mlp()
    x = torch.randn(6, 5)
    assert_exact(model, x, check_unseen)
    model[2].weight = nn.Parameter(torch.randn(3, 4))  # a new parameter, same shape
    assert_exact(model, x, check_unseen)
    with torch.no_grad():  # the same parameters, new shapes (F.linear reads them as they are)
        model[2].weight.data = torch.randn(7, 4)
        model[2].bias.data = torch.randn(7)
    assert_exact(model, x, check_unseen)
    psh.remove_hooks(model)


@pytest.mark.parametrize("check_unseen", CHECKS)
def test_converting_the_model_between_steps(check_unseen):
    """``model.double()`` keeps the parameter objects and changes their dtype: buffers and the
    check's probes follow."""
    model = leaky_mlp()
    x = torch.randn(6, 5)
    assert_exact(model, x, check_unseen)
    model.double()
    assert_exact(model, x.double(), check_unseen)
    model.float()
    assert_exact(model, x, check_unseen)
    psh.remove_hooks(model)


class Leaks(nn.Module):
    """``first.weight`` is also used outside its module: the check must report it."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h) + (h @ self.first.weight)[:, :2]


def captured_and_cleared(model: nn.Module, x: torch.Tensor) -> None:
    """A step the check does not compare (no compute_* call): its probes are kept."""
    model(x).sum().backward()
    psh.clear_backprops(model)


def test_probes_kept_from_a_step_never_compared_are_used_by_the_next():
    torch.manual_seed(0)
    model = Leaks()
    state = psh.add_hooks(model, check_unseen="always")
    captured_and_cleared(model, torch.randn(5, 3))
    weight = model.first.weight
    kept = state.unseen.probes[id(weight)][0].clone()
    model(torch.randn(5, 3)).sum().backward()
    torch.testing.assert_close(state.unseen.probe(weight)[0], kept)
    with pytest.raises(psh.PerSampleHooksError, match=r"'first\.weight'"):
        psh.compute_grad1(model)
    model(torch.randn(5, 3)).sum().backward()  # compared: new probes
    assert not torch.equal(state.unseen.probe(weight)[0], kept)
    psh.remove_hooks(model)


def test_kept_probes_follow_a_parameter_converted_in_between():
    """``model.double()`` after a step never compared: the check compares in float64 (its
    float64 threshold) and still finds the unseen use."""
    torch.manual_seed(0)
    model = Leaks()
    state = psh.add_hooks(model, check_unseen="always")
    captured_and_cleared(model, torch.randn(5, 3))
    model.double()
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    for p in model.parameters():
        assert all(t.dtype == torch.float64 for t in state.unseen.probe(p))
    with pytest.raises(psh.PerSampleHooksError, match=r"'first\.weight'"):
        psh.compute_grad1(model)
    psh.remove_hooks(model)


def test_kept_probes_follow_a_parameter_resized_in_between():
    model = leaky_mlp()
    psh.add_hooks(model, check_unseen="always")
    x = torch.randn(6, 5)
    captured_and_cleared(model, x)
    with torch.no_grad():
        model[2].weight.data = torch.randn(7, 4)
        model[2].bias.data = torch.randn(7)
    assert_exact(model, x, "always")
    psh.remove_hooks(model)


class Recurrent(nn.Module):
    """A Linear (its rule reads only shapes) before an LSTM and a Bilinear (the fallback), whose
    per-sample gradients depend on their parameters' values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)
        self.bilinear = nn.Bilinear(4, 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lstm(self.linear(x))[0]
        return self.bilinear(h, h)


@pytest.mark.parametrize("verb", ["compute_grad1", "compute_norms", "clip_grads"])
@pytest.mark.parametrize("check_unseen", CHECKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_optimizer_step_before_compute_is_refused_then_exact(verb, check_unseen, dtype):
    """``optimizer.step()`` between the backward and a ``compute_*`` call changes the values
    that the LSTM's and the fallback's rules read: refused on every step (before, only a step
    the unseen-use check compared noticed, as a use outside the module), naming the parameter;
    the next step, in the right order, is exact. Only the layers whose rules read values are
    watched: changing the Linear's weight alone is fine (its per-sample gradients do not
    depend on it)."""
    torch.manual_seed(0)
    model = Recurrent().to(dtype)
    x = torch.randn(4, 5, 3, dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compute = {"compute_grad1": psh.compute_grad1, "compute_norms": psh.compute_norms,
               "clip_grads": lambda m, **kw: psh.clip_grads(m, 1.0, **kw)}[verb]
    psh.add_hooks(model, check_unseen=check_unseen)
    try:
        for _ in range(3):  # the later steps are not compared by the default check
            model(x).sum().backward()
            optimizer.step()
            with pytest.raises(psh.PerSampleHooksError,
                               match=rf"{verb}: parameter 'weight_ih_l0' of 'lstm' \(LSTM\) was "
                                     rf"changed in place after the forward .* before the step"):
                compute(model, loss_type="sum")
            optimizer.zero_grad()
        model(x).sum().backward()
        with torch.no_grad():
            model.linear.weight.mul_(1.5)  # a value no rule reads
        compute(model, loss_type="sum")
    finally:
        psh.remove_hooks(model)
    assert_exact(model, x, check_unseen)


@pytest.mark.parametrize("check_unseen", CHECKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_running_statistics_changed_before_compute_are_refused_then_exact(check_unseen, dtype):
    """BatchNorm in eval mode reads its running statistics: a forward in training mode between
    the backward and ``compute_*`` (no grad: not recorded) updates them in place, so the
    per-sample gradients would use the new ones. Refused on every step, naming the buffer (a
    step the unseen-use check compares took it for a use outside the module; the others gave
    wrong numbers silently); the next step, in the right order, is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    model.to(dtype)
    with torch.no_grad():
        model(torch.randn(32, 3, dtype=dtype))  # running statistics of their own
    model.eval()
    x = torch.randn(6, 3, dtype=dtype)
    psh.add_hooks(model, check_unseen=check_unseen)
    try:
        for _ in range(3):  # the later steps are not compared by the default check
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            with torch.no_grad():
                model.train()(torch.randn(32, 3, dtype=dtype) + 1)
                model.eval()
            with pytest.raises(psh.PerSampleHooksError,
                               match=r"compute_grad1: buffer '\w+' of '1' \(BatchNorm1d\) was "
                                     r"changed in place after the forward .* before that forward"):
                psh.compute_grad1(model, loss_type="sum")
    finally:
        psh.remove_hooks(model)
    assert_exact(model, x, check_unseen)


class InstanceNormTwice(nn.Module):
    """An InstanceNorm that tracks running statistics, called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.norm = nn.InstanceNorm1d(2, affine=True, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(self.norm(x)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_running_statistics_updated_between_calls_in_training_mode_are_not_read(dtype):
    """In training mode InstanceNorm normalizes with each instance's own statistics: the
    update of its running statistics by its second call is no change to what its rule reads
    (refused when buffers were versioned in every mode)."""
    torch.manual_seed(0)
    assert_exact(InstanceNormTwice().to(dtype), torch.randn(3, 2, 5, dtype=dtype), True)
