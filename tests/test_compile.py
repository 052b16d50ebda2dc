"""torch.compile: hook the model, then compile it.

- ``add_hooks(model); compiled = torch.compile(model)``: exact per-sample gradients through the
  compiled module (the library's hooks run outside dynamo's graphs, which break at each hooked
  module's call; the code in between stays compiled). ``compute_*`` accept either handle.
- ``add_hooks(compiled)`` is refused with an error saying to hook first: compiled code does not
  see hooks added after compilation (``torch._dynamo`` does not guard on module hooks).
- After ``remove_hooks`` code compiled while hooked still calls the (now inert) hook: nothing is
  captured; ``torch._dynamo.reset()`` drops that code.

The default backend here is ``aot_eager`` (dynamo + AOTAutograd, no C++ code generation: fast
on the CI machine); ``PSH_COMPILE_BACKEND=inductor`` runs the same tests with inductor.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, weighted_square

BACKEND = os.environ.get("PSH_COMPILE_BACKEND", "aot_eager")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 5), nn.Tanh(),
                         nn.Linear(5, 2))


def compiled_or_skip(module: nn.Module) -> nn.Module:
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile is not available")
    compiled = torch.compile(module, backend=BACKEND)
    try:
        psh.disable_hooks(module)
        compiled(torch.randn(2, 6))  # compile now; a missing toolchain shows up here
    except Exception as error:  # noqa: BLE001 - any failure to compile means: not available
        pytest.skip(f"torch.compile({BACKEND}) does not work here: {error}")
    finally:
        psh.enable_hooks(module)
    return compiled


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_hooked_then_compiled_model_is_exact():
    net = model()
    psh.add_hooks(net)
    compiled = compiled_or_skip(net)
    try:
        for step, (batch, loss_type) in enumerate([(5, "mean"), (3, "sum"), (5, "mean"),
                                                   (8, "sum")]):
            x = torch.randn(batch, 6)
            net.zero_grad(set_to_none=True)
            losses = weighted_square(compiled(x))
            (losses.mean() if loss_type == "mean" else losses.sum()).backward()
            handle = compiled if step % 2 else net  # either handle finds the state
            norms = psh.compute_norms(handle, loss_type=loss_type)
            psh.compute_grad1(handle, loss_type=loss_type)
            got = {n: p.grad1.clone() for n, p in net.named_parameters()}
            psh.disable_hooks(net)
            expected = loop_grads(net, [x], weighted_square, batch)  # eager, float32
            psh.enable_hooks(net)
            for n in expected:
                torch.testing.assert_close(got[n], expected[n], rtol=1e-4, atol=1e-6)
            expected_norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
            torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=1e-6)
    finally:
        psh.remove_hooks(net)
    state_free = compiled(torch.randn(4, 6))  # stale compiled code: the inert hook captures none
    state_free.sum().backward()
    assert "_per_sample_hooks" not in net.__dict__


def test_add_hooks_on_a_compiled_module_is_refused():
    compiled = torch.compile(model(), backend=BACKEND)  # lazy: nothing is compiled yet
    with pytest.raises(psh.PerSampleHooksError, match=r"torch.compile'd.*add_hooks\(model\); "
                       r"compiled = torch.compile\(model\)"):
        psh.add_hooks(compiled)
    assert not any(m._forward_hooks for m in compiled.modules())


def test_add_hooks_on_a_model_with_a_block_compiled_in_place_is_refused():
    """``module.compile()`` (in place, no wrapper) on a block before add_hooks: refused naming
    the block (before: its layers' grad1 were zeros with check_unseen=False, or a misleading
    refusal)."""
    net = model()
    net[0].compile(backend=BACKEND)
    with pytest.raises(psh.PerSampleHooksError, match=r"add_hooks: '0' was compiled in place "
                       r"\(module.compile\(\)\) before add_hooks.*add_hooks\(model\); "
                       r"model.compile\(\)"):
        psh.add_hooks(net)
    assert not any(m._forward_hooks for m in net.modules())


@pytest.mark.parametrize("run_before", [False, True])
def test_add_hooks_on_a_model_with_a_compiled_block_is_refused_and_hooked_first_is_exact(
        run_before):
    """A block wrapped by ``torch.compile`` before add_hooks (run or not yet: its code may be
    compiled without the hooks): refused naming the block and the order that works (before:
    accepted, then a misleading unseen-use refusal); that order, hooked then the block
    compiled, gives the loop's per-sample gradients."""
    torch.manual_seed(0)
    net = model().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    expected = loop_grads(copy.deepcopy(net), [x], lambda out: out.square().sum(1), 5)
    original = net[2]
    net[2] = torch.compile(original, backend=BACKEND)
    if run_before:
        net(x)
    with pytest.raises(psh.PerSampleHooksError, match=r"add_hooks: '2' is a torch.compile'd "
                       r"module.*set '2' back to its original.*add_hooks\(model\), then set "
                       r"it to torch.compile\(original\); if it ran compiled already, call "
                       r"torch._dynamo.reset\(\)"):
        psh.add_hooks(net)
    assert not any(m._forward_hooks for m in net.modules())
    net[2] = original
    psh.add_hooks(net)
    if run_before:
        torch._dynamo.reset()  # its code compiled without the hooks (as the message says)
    net[2] = torch.compile(original, backend=BACKEND)
    net(x).square().sum(1).sum().backward()
    psh.compute_grad1(net, loss_type="sum")
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad1, expected[name.replace("_orig_mod.", "")])


class Positions(nn.Module):
    """GPT-2's position embeddings: ids ``[1, T]``, the output broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(7, 4), nn.Embedding(8, 4), nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.wte(ids) + self.wpe(torch.arange(ids.shape[1])[None]))


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 15),
                    reason="torch < 2.15: dynamo's tracing fails on the expanded output's tensor "
                           "subclass (TypeError: Tensor + BroadcastOutput), as README.rst says")
def test_broadcast_positions_compiled_are_exact():
    """Hooked, then compiled: the position embeddings' expanded output is exact on the steps
    that trace (torch._dynamo reads the view's ``_base``, which was taken for a use that drops
    the batch dim: every tracing step was refused)."""
    torch.manual_seed(0)
    net = Positions().double()
    ids = torch.randint(0, 7, (4, 5))
    expected = loop_grads(copy.deepcopy(net), [ids], lambda out: out.square().sum((1, 2)), 4)
    psh.add_hooks(net)
    compiled = torch.compile(net, backend=BACKEND)
    compiled(ids).square().sum((1, 2)).mean().backward()
    psh.compute_grad1(net)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad1, expected[name], rtol=1e-9, atol=1e-11)
    psh.remove_hooks(net)


def test_compiled_attention_recomputed_exact():
    """Under torch.compile the attention's projections are not captured (the capture's
    torch-function mode is not entered while dynamo traces): its calls are recomputed, exact."""
    from per_sample_hooks.rules.attention import captured

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
            self.head = nn.Linear(6, 2)

        def forward(self, x):
            return self.head(self.attention(x, x, x, need_weights=False)[0])

    torch.manual_seed(0)
    net = Attend().double()
    state = psh.add_hooks(net)
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile is not available")
    compiled = torch.compile(net, backend=BACKEND)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    try:
        try:
            losses = weighted_square(compiled(x))
        except Exception as error:  # noqa: BLE001 - any failure to compile means: not available
            pytest.skip(f"torch.compile({BACKEND}) does not work here: {error}")
        losses.mean().backward()
        assert [captured(call) is not None for call in state.calls[net.attention]] == [False]
        psh.compute_grad1(net)
        got = {n: p.grad1.clone() for n, p in net.named_parameters()}
    finally:
        psh.remove_hooks(net)
    expected = loop_grads(net, [x], weighted_square, 4)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-10)


def test_the_compiled_handle_of_a_hooked_model_is_its_state():
    """The documented order, hook then compile: ``add_hooks``, ``DPSGD`` and ``KFAC`` given the
    compiled handle were refused as if it had been compiled first; they find the state now and
    a DPSGD step through it (noise 0) is the loop's clipped mean."""
    net = model()
    state = psh.add_hooks(net)
    compiled = compiled_or_skip(net)
    try:
        assert psh.add_hooks(compiled) is state
        psh.optim.KFAC(compiled)
        dp = psh.DPSGD(compiled, torch.optim.SGD(net.parameters(), lr=1.0), noise_multiplier=0.0,
                       max_grad_norm=0.5, dataset_size=8, batch_size=4, accountant=None)
        x = torch.randn(4, 6)
        psh.disable_hooks(net)
        expected = loop_grads(net, [x], weighted_square, 4)
        psh.enable_hooks(net)
        norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
        factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        dp.zero_grad()
        dp.backward(weighted_square(compiled(x)).mean())
        dp.step()
        for n, p in net.named_parameters():
            step = torch.einsum("b,b...->...", factors, expected[n]) / 4
            torch.testing.assert_close(before[n] - p.detach(), step, rtol=1e-4, atol=1e-6)
        dp.close()
    finally:
        psh.remove_hooks(net)


def test_the_library_hooks_are_not_recompiled_at_each_step():
    """The library's own hooks run outside dynamo's graphs (torch.compiler.disable): traced,
    the model's call hook, each layer's forward hook and a raw parameter's watcher were
    compiled again at every step (their guards on new inputs and on the records failed) until
    dynamo's recompile limit, over 8 layers or steps (warned, and 10-30 ms a step; torch
    2.13 also traced the watcher's handler of each op, a frame a step). Exact,
    float64, with new inputs at each step and 12 hooked modules (a raw parameter of a childless
    module, and of the root, whose watcher's mode and callee hooks were traced too)."""
    from torch._dynamo.utils import counters

    class Shift(nn.Module):  # a raw parameter: a watcher's hooks
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.randn(6) / 4)

        def forward(self, x):
            return x + self.shift

    class Root(nn.Sequential):  # a raw parameter of a module with children (a cls token's)
        def __init__(self, *layers):
            super().__init__(*layers)
            self.scale = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return super().forward(x) * self.scale

    torch.manual_seed(0)
    net = Root(Shift(), *(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(10)),
               nn.Linear(6, 2)).double()
    reference = copy.deepcopy(net)
    psh.add_hooks(net)
    compiled = compiled_or_skip(net)
    graphs = []
    try:
        for _ in range(5):
            x = torch.randn(5, 6, dtype=torch.float64)
            net.zero_grad(set_to_none=True)
            weighted_square(compiled(x)).mean().backward()
            psh.compute_grad1(net)
            graphs.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
            expected = loop_grads(reference, [x], weighted_square, 5)
            for n, p in net.named_parameters():
                torch.testing.assert_close(p.grad1, expected[n], rtol=1e-9, atol=1e-11)
    finally:
        psh.remove_hooks(net)
    assert graphs[1:] == graphs[1:2] * 4, graphs
