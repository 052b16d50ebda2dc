"""Memory and state: no growth over many steps, nothing captured survives clear/remove, several
hooked models (and threads) do not interfere."""
from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, seeded, weighted_square

STEPS = 1000
RSS_GROWTH_BOUND_MB = 25.0
"""Generous: a leak of one captured batch per step (inputs and output gradients of this
model: ~10 kB) would grow by ~10 MB over 1,000 steps, a leak of one per-sample buffer set by
~30 MB."""


def resident_mb() -> float:
    """The process' resident set (CPU), or the tensor memory of the default CUDA device."""
    if torch.get_default_device().type == "cuda":
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status: cannot read the resident set size")


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 16),
                         nn.Tanh(), nn.Linear(16, 3))


def train(model: nn.Module, steps: int, generator: torch.Generator, measure_every: int = 0
          ) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    readings = []
    for step in range(steps):
        batch = int(torch.randint(4, 17, (1,), generator=generator))  # varying batch sizes
        x = torch.randn(batch, 1, 6, 6, generator=generator)
        y = torch.randint(0, 3, (batch,), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if step % 2:
            psh.compute_grad1(model)
        else:
            psh.clip_grads(model, max_grad_norm=1.0)
        optimizer.step()
        if measure_every and (step + 1) % measure_every == 0:  # after steps 100, 200, ...
            readings.append(resident_mb())
    return readings


def test_thousand_steps_keep_resident_memory_flat():
    """RSS read every 100 steps; the growth from step 100 (buffers at their largest, allocator
    settled) to step 1,000 must stay under the bound."""
    torch.manual_seed(0)
    model = small_cnn()
    generator = seeded(0)
    with psh.add_hooks(model) as state:
        readings = train(model, STEPS, generator, measure_every=100)
        gc.collect()
        captured = sum(len(calls) for calls in state.calls.values())
        buffers = len(state.storage.held())
    at_100, at_1000 = readings[0], readings[-1]
    print(f"\nRSS: step 100 {at_100:.1f} MB, step 1000 {at_1000:.1f} MB, growth "
          f"{at_1000 - at_100:+.1f} MB; every 100 steps: " + " ".join(f"{r:.1f}" for r in readings))
    assert len(readings) == STEPS // 100
    assert at_1000 - at_100 < RSS_GROWTH_BOUND_MB, readings
    assert captured <= 3  # one step's calls at most (one per hooked module)
    assert buffers <= 2 * 6  # grad1 and kept-grads buffers per parameter, not per step


def capture_refs(model: nn.Module) -> list[weakref.ref]:
    """Weak references to every tensor the hooks hold (inputs, output gradients, buffers)."""
    state = model.__dict__["_per_sample_hooks"]
    refs = []
    for calls in state.calls.values():
        for call in calls:
            refs += [weakref.ref(a) for a in call.args if isinstance(a, torch.Tensor)]
            refs += [weakref.ref(g) for passes in call.grads for g in passes]
    assert refs, "nothing captured: the test would prove nothing"
    return refs


def one_backward(model: nn.Module, batch: int = 6) -> None:
    model.zero_grad(set_to_none=True)
    # the input must not outlive the step: it is one of the captured tensors
    weighted_square(model(torch.randn(batch, 1, 6, 6))).mean().backward()


def test_clear_backprops_frees_every_captured_tensor():
    model = small_cnn()
    with psh.add_hooks(model) as state:
        one_backward(model)
        refs = capture_refs(model)
        psh.clear_backprops(model)
        gc.collect()
        assert all(r() is None for r in refs)
        assert not any(state.calls.values())


def test_captures_of_a_computed_step_are_freed_by_the_next_forward_or_clear():
    model = small_cnn()
    with psh.add_hooks(model):
        one_backward(model)
        refs = capture_refs(model)
        psh.compute_grad1(model)
        one_backward(model)  # starts a new step: the previous captures go
        gc.collect()
        assert all(r() is None for r in refs)


def test_remove_hooks_frees_captures_buffers_state_and_hooks():
    model = small_cnn()
    psh.add_hooks(model)
    one_backward(model)
    refs = capture_refs(model)
    psh.compute_grad1(model)
    one_backward(model)
    refs += capture_refs(model)
    refs += [weakref.ref(p.grad1) for p in model.parameters()]
    state_ref = weakref.ref(model.__dict__["_per_sample_hooks"])
    psh.remove_hooks(model)
    gc.collect()
    assert all(r() is None for r in refs)
    assert state_ref() is None
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    # the model works as before and can be hooked again
    psh.add_hooks(model)
    one_backward(model)
    psh.compute_grad1(model)
    psh.remove_hooks(model)


def test_deleting_a_hooked_model_frees_it():
    model = small_cnn()
    psh.add_hooks(model)
    one_backward(model)
    psh.compute_grad1(model)
    model_ref = weakref.ref(model)
    grad1_ref = weakref.ref(model[0].weight.grad1)
    del model
    gc.collect()
    assert model_ref() is None and grad1_ref() is None


def mlp(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2)).double()


def checked_step(model: nn.Module, x: torch.Tensor) -> None:
    """A hooked step, compared with the float64 loop (hooks paused for the loop)."""
    model.zero_grad(set_to_none=True)
    weighted_square(model(x)).mean().backward()
    psh.compute_grad1(model)
    got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    psh.disable_hooks(model)
    try:
        expected = loop_grads(model, [x], weighted_square, len(x))
    finally:
        psh.enable_hooks(model)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10)


def test_two_models_hooked_at_once_do_not_interfere():
    a, b = mlp(0, 5), mlp(1, 7)
    with psh.add_hooks(a), psh.add_hooks(b):
        xa, xb = torch.randn(3, 4).double(), torch.randn(5, 4).double()
        # interleaved forwards and backwards of the two models in one step
        la, lb = weighted_square(a(xa)).mean(), weighted_square(b(xb)).mean()
        a.zero_grad(), b.zero_grad()
        lb.backward()
        la.backward()
        psh.compute_grad1(b)
        psh.compute_grad1(a)
        assert a[0].weight.grad1.shape == (3, 5, 4) and b[0].weight.grad1.shape == (5, 7, 4)
        for _ in range(3):
            checked_step(a, torch.randn(3, 4).double())
            checked_step(b, torch.randn(6, 4).double())
        psh.disable_hooks(a)  # pausing one model leaves the other capturing
        checked_step(b, torch.randn(2, 4).double())
        psh.enable_hooks(a)
        checked_step(a, torch.randn(2, 4).double())


def test_two_threads_each_training_its_own_model():
    errors: list[BaseException] = []

    def worker(seed: int, width: int) -> None:
        try:
            model = mlp(seed, width)
            generator = seeded(seed)
            with psh.add_hooks(model):
                for step in range(15):
                    checked_step(model, torch.randn(2 + step % 5 + seed, 4, generator=generator,
                                                    dtype=torch.float64))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed, 3 + seed)) for seed in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_deepcopy_of_a_hooked_model_is_an_unhooked_model():
    """E.g. a target network or an EMA copy: the copy's forwards must not land in the
    original's records (its copied hooks ignore it), and it can be hooked on its own."""
    import copy

    original = mlp(0, 5)
    with psh.add_hooks(original):
        checked_step(original, torch.randn(3, 4).double())
        clone = copy.deepcopy(original)
        with pytest.raises(psh.PerSampleHooksError, match="add_hooks"):
            psh.compute_grad1(clone)
        x = torch.randn(4, 4).double()
        original.zero_grad(set_to_none=True)
        weighted_square(original(x)).mean().backward()
        weighted_square(clone(torch.randn(4, 4).double())).mean().backward()  # same batch size
        psh.compute_grad1(original)
        got = {n: p.grad1.clone() for n, p in original.named_parameters()}
        psh.disable_hooks(original)
        expected = loop_grads(original, [x], weighted_square, len(x))
        psh.enable_hooks(original)
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10)
        with psh.add_hooks(clone):
            checked_step(clone, torch.randn(2, 4).double())


# ----------------------------------------------------------------------------- forwards
# without backward

def held_records(state: psh.HookState) -> tuple[int, int]:
    """``(records, bytes of their captured tensors)`` the hooks hold."""
    records = [call for calls in state.calls.values() for call in calls]
    tensors = {id(t): t for call in records for t in call.args if isinstance(t, torch.Tensor)}
    return len(records), sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("keep_last", [False, True])
def test_evaluation_forwards_with_grad_enabled_hold_one_forward_at_most(keep_last):
    """200 forwards with grad enabled and no backward (an evaluation loop that forgot
    torch.no_grad): a record whose graph is gone unreached is dropped at the next forward, so
    the hooks hold the records of the forwards whose graphs are alive: the last one or two."""
    model = small_cnn()
    with psh.add_hooks(model) as state:
        one_backward(model)
        psh.compute_grad1(model)
        counts, sizes = [], []
        last = None
        for _ in range(200):
            loss = weighted_square(model(torch.randn(64, 1, 6, 6))).mean()
            if keep_last:
                last = loss  # the latest graph is alive: its records stay
            counts.append(held_records(state)[0])
            sizes.append(held_records(state)[1])
            del loss
        one_forward = 3  # one record per hooked module (conv, two Linear)
        assert max(counts) <= 2 * one_forward, counts
        assert max(sizes[10:]) == max(sizes[:10]), sizes  # bounded: 200 forwards as 10
        assert max(sizes) <= 2 * 64 * (36 + 64 + 16) * 4
        del last


def test_unreachable_records_dropped_before_a_training_step_still_give_exact_grad1():
    """Evaluation forwards (grad enabled) between steps, then a training step: grad1 exact."""
    torch.manual_seed(0)
    model = small_cnn().double()
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    expected = loop_grads(model, [x], weighted_square, 5)
    with psh.add_hooks(model) as state:
        for _ in range(3):
            weighted_square(model(torch.randn(7, 1, 6, 6, dtype=torch.float64))).sum()
        model.zero_grad()
        loss = weighted_square(model(x)).mean()
        for _ in range(3):  # evaluation forwards after the training forward, before its backward
            weighted_square(model(torch.randn(7, 1, 6, 6, dtype=torch.float64))).sum()
        assert held_records(state)[0] <= 2 * 3
        loss.backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, expected[n], rtol=1e-10, atol=1e-12)


def test_two_forwards_then_one_backward_of_the_summed_loss_keeps_both():
    """Legitimate multi-forward steps: a module applied twice in one forward, and two forwards
    whose summed loss has one backward; nothing of either is dropped."""
    from models import AppliedTwice
    torch.manual_seed(1)
    model = AppliedTwice(nn.Linear(4, 4)).double()
    x1, x2 = torch.randn(2, 6, 4, dtype=torch.float64).unbind(0)

    def both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return weighted_square(model(a)) + weighted_square(model(b))
    params = dict(model.named_parameters())
    per_sample = {n: [] for n in params}
    for i in range(6):
        grads = torch.autograd.grad(both(x1[i:i + 1], x2[i:i + 1]).sum(), list(params.values()))
        for n, g in zip(params, grads):
            per_sample[n].append(g)
    expected = {n: torch.stack(g) for n, g in per_sample.items()}
    with psh.add_hooks(model) as state:
        first = weighted_square(model(x1))
        for _ in range(3):  # an unrelated forward whose graph dies in between
            weighted_square(model(torch.randn(3, 4, dtype=torch.float64))).sum()
        second = weighted_square(model(x2))
        assert held_records(state)[0] >= 4  # two calls per forward, both forwards alive
        (first + second).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, expected[n], rtol=1e-10, atol=1e-12)


def test_output_edges_warn_when_forwards_without_backward_pile_up():
    """OutputEdges holds the graphs of its forwards until a backward: it cannot drop them, so it
    says so once they reach STALE_FACTOR times what a backward used."""
    from per_sample_hooks.edges import STALE_FACTOR, OutputEdges
    model = small_cnn()
    with psh.add_hooks(model):
        edges = OutputEdges(model)
        edges.backward(weighted_square(model(torch.randn(4, 1, 6, 6))).mean())
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(STALE_FACTOR - 1):
                losses.append(weighted_square(model(torch.randn(4, 1, 6, 6))).mean())
        with pytest.warns(UserWarning, match="torch.no_grad"):
            losses.append(weighted_square(model(torch.randn(4, 1, 6, 6))).mean())
        edges.remove()


def test_kfac_without_backprop_hess_holds_no_graph_of_evaluation_forwards():
    model = small_cnn()
    precond = psh.optim.KFAC(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = model.__dict__["_per_sample_hooks"]
    for _ in range(2):
        optimizer.zero_grad()
        weighted_square(model(torch.randn(8, 1, 6, 6))).mean().backward()
        precond.step()
        optimizer.step()
        for _ in range(50):  # evaluation with grad enabled
            weighted_square(model(torch.randn(64, 1, 6, 6))).mean().item()
        assert held_records(state)[0] <= 2 * 3
    precond.close()
