"""Modules called with batch size 1 whose output is broadcast over the batch (transformers'
position ids ``[1, T]``, a shared query through a Linear): exact per-sample gradients with no
change to the call; the limits are refused with a message."""
import copy
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from norms_truth import assert_clipping_matches, assert_norms_match
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_grads, loop_tolerance, seeded, weighted_square


class BroadcastPositions(nn.Module):
    """Token embedding plus ``positions(arange(T)[None])``, added with ``+`` or in place (as
    GPT-2 and BERT do), then a Linear."""

    def __init__(self, in_place: bool = False, vocab=9, length=6, dim=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.out = nn.Linear(dim, 3)
        self.in_place = in_place

    def forward(self, ids):
        h = self.tokens(ids)
        positions = self.positions(torch.arange(ids.shape[1]).unsqueeze(0))  # [1, T, d]
        if self.in_place:
            h += positions
        else:
            h = h + positions
        return self.out(torch.tanh(h))


class SharedQuery(nn.Module):
    """A Linear applied to a fixed ``[1, k, d]`` query (a buffer) whose output attends over
    each sample's keys by broadcasting matmul."""

    def __init__(self, dim=4, k=2):
        super().__init__()
        self.register_buffer("query", torch.randn(1, k, dim))
        self.query_proj, self.key_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):  # x [B, T, d]
        keys = self.key_proj(x)
        scores = self.query_proj(self.query) @ keys.transpose(1, 2)  # [B, k, T]
        return scores.softmax(-1) @ x


class LearnedPositions(nn.Embedding):
    """BART's decoder positions: called with the batch's ids, looks up ``position_ids [T]``
    as ``[1, T]`` (an output of size 1 at the batch dim all the same); an overridden
    forward, so no Embedding rule: its raw weight is followed or re-run."""

    def forward(self, input_ids, position_ids):
        return super().forward(position_ids.unsqueeze(0) + 1)


class PositionsCalledWithTheBatch(BroadcastPositions):
    def __init__(self):
        super().__init__()
        self.positions = LearnedPositions(8, 4)

    def forward(self, ids):
        positions = self.positions(ids, position_ids=torch.arange(ids.shape[1]))
        return self.out(torch.tanh(self.tokens(ids) + positions))


class RepeatedPositions(nn.Module):
    """timm XCiT's positional encoding: a conv on a coordinate grid of batch 1, its output
    repeated over the batch by the model (hooked, it is expanded already: repeated once)."""

    def __init__(self, repeat: str = "repeat"):
        super().__init__()
        self.embed = nn.Conv2d(3, 4, 4, 4)
        self.positions = nn.Conv2d(2, 4, 1)
        self.out = nn.Linear(4, 3)
        self.repeat = repeat

    def forward(self, x):
        batch, (height, width), tokens = x.shape[0], x.shape[2:], self.embed(x)
        grid = torch.stack(torch.meshgrid(torch.arange(height / 4), torch.arange(width / 4),
                                          indexing="ij"))[None].to(x.dtype)
        positions = self.positions(grid)
        positions = positions.repeat(batch, 1, 1, 1) if self.repeat == "repeat" else \
            torch.tile(positions, (batch, 1, 1, 1))
        return self.out((tokens + positions).tanh().mean((2, 3)))


class StepEmbedding(nn.Module):
    """A universal transformer's per-step embedding, ``[1, d]``, added to (or scaling) the
    ``[B, T, d]`` activations: broadcast over the samples and the positions. Expanded to
    ``[B, d]``, its samples met the positions: refused where ``T != B``, silently the wrong
    rows where ``T == B``."""

    def __init__(self, op: str = "add", dim=4, steps=3):
        super().__init__()
        self.inp, self.cell, self.out = nn.Linear(3, dim), nn.Linear(dim, dim), nn.Linear(dim, 2)
        self.step = nn.Embedding(steps, dim)
        self.op, self.steps = op, steps

    def forward(self, x):
        h = self.inp(x)
        for t in range(self.steps):
            e = self.step(torch.tensor([t]))
            h = torch.tanh(self.cell(h + e if self.op == "add" else h * (1 + e)))
        return self.out(h.mean(1))


class PositionsWithoutTheBatch(nn.Module):
    """nanoGPT's positions, ``wpe(torch.arange(T))``, ``[T, d]`` without the batch, added to the
    tokens' ``[B, T, d]`` as they are (``+`` or in place), as ``[None]``, expanded or repeated
    over the batch; or ``built-ids``: the ids get a BOS token in the forward (a new tensor, whose
    lookup holds the samples) before the positions are added."""

    def __init__(self, use: str = "add", vocab=9, length=8, dim=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.out = nn.Linear(dim, 3)
        self.use = use

    def forward(self, ids):
        if self.use == "built-ids":
            ids = torch.cat([torch.zeros_like(ids[:, :1]), ids], 1)
        h, batch = self.tokens(ids), ids.shape[0]
        positions = self.positions(torch.arange(ids.shape[1]))
        if self.use == "in-place":
            h += positions
        elif self.use == "unsqueezed":
            h = h + positions[None]
        elif self.use == "expanded":
            h = h + positions.unsqueeze(0).expand(batch, -1, -1)
        elif self.use == "repeated":
            h = h + positions[None].repeat(batch, 1, 1)
        else:
            h = h + positions
        return self.out(torch.tanh(h))


def _ids(length: int):
    return lambda g: [torch.randint(0, 9, (5, length), generator=g)]


CASES = {
    "positions": (BroadcastPositions, lambda g: [torch.randint(0, 9, (5, 6), generator=g)]),
    "positions-in-place": (lambda: BroadcastPositions(in_place=True),
                           lambda g: [torch.randint(0, 9, (5, 6), generator=g)]),
    "shared-query": (SharedQuery, lambda g: [torch.randn(5, 3, 4, generator=g)]),
    "positions-called-with-the-batch": (PositionsCalledWithTheBatch,
                                        lambda g: [torch.randint(0, 9, (5, 6), generator=g)]),
    "repeated-positions": (RepeatedPositions, lambda g: [torch.randn(5, 3, 8, 8, generator=g)]),
    "tiled-positions": (lambda: RepeatedPositions("tile"),
                        lambda g: [torch.randn(5, 3, 8, 8, generator=g)]),
    "step-embedding": (StepEmbedding, lambda g: [torch.randn(5, 6, 3, generator=g)]),
    "step-embedding-as-many-positions-as-samples": (
        StepEmbedding, lambda g: [torch.randn(5, 5, 3, generator=g)]),
    "step-embedding-scaling": (lambda: StepEmbedding("mul"),
                               lambda g: [torch.randn(5, 5, 3, generator=g)]),
    **{f"positions-without-the-batch-{use}-{name}": (partial(PositionsWithoutTheBatch, use),
                                                     _ids(length))
       for use in ("add", "in-place", "unsqueezed", "expanded", "repeated")
       for name, length in (("T-6", 6), ("as-many-positions-as-samples", 5))},
    "positions-without-the-batch-built-ids": (partial(PositionsWithoutTheBatch, "built-ids"),
                                              _ids(4)),
}


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_broadcast_calls_match_the_loop(case, loss_type):
    make, inputs = CASES[case]
    torch.manual_seed(0)
    model, x = make(), inputs(seeded(1))
    assert_matches_loop(model, x, loss_type=loss_type)
    assert_norms_match(model, x, loss_type=loss_type)
    assert_clipping_matches(model, x, max_grad_norm=0.2, loss_type=loss_type)


@pytest.mark.parametrize("case", ["positions", "positions-called-with-the-batch",
                                  "repeated-positions", "step-embedding",
                                  "step-embedding-as-many-positions-as-samples",
                                  "positions-without-the-batch-add-as-many-positions-as-samples",
                                  "positions-without-the-batch-expanded-T-6",
                                  "positions-without-the-batch-built-ids"])
def test_float32_matches_the_loop(case):
    make, inputs = CASES[case]
    torch.manual_seed(0)
    model, (ids,) = make(), inputs(seeded(1))
    expected = loop_grads(copy.deepcopy(model).double(), [ids if ids.dtype == torch.long else
                                                          ids.double()], weighted_square, 5)
    psh.add_hooks(model)
    weighted_square(model(ids)).mean().backward()
    psh.compute_grad1(model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad1.double(), expected[n], rtol=1e-4, atol=1e-6)
    psh.remove_hooks(model)


def test_batch_of_one_is_left_as_is():
    """A true batch of 1: nothing to expand, the output keeps its shape."""
    model = BroadcastPositions()
    psh.add_hooks(model)
    out = model(torch.randint(0, 9, (1, 6)))
    assert out.shape == (1, 6, 3)
    out.sum().backward()
    psh.compute_grad1(model)
    assert model.positions.weight.grad1.shape == (1, 6, 4)
    psh.remove_hooks(model)


class PositionsFirst(BroadcastPositions):
    def forward(self, ids):
        positions = self.positions(torch.arange(ids.shape[1]).unsqueeze(0))
        return self.out(torch.tanh(self.tokens(ids) + positions))


def test_a_broadcast_call_before_the_batch_is_seen_is_refused():
    model = PositionsFirst()
    psh.add_hooks(model)
    model(torch.randint(0, 9, (5, 6))).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="disagree on the batch size.*1 \\(at "
                       "'positions'\\)"):
        psh.compute_grad1(model)
    psh.remove_hooks(model)


def test_broadcast_off_refuses_the_call():
    """``broadcast=False`` (a genuinely separate batch of one): the output keeps its shape and
    the step is refused."""
    model = BroadcastPositions()
    psh.add_hooks(model, broadcast=False)
    model(torch.randint(0, 9, (5, 6))).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="disagree on the batch size"):
        psh.compute_grad1(model)
    psh.remove_hooks(model)


class ComputedQuery(nn.Module):
    """DeBERTa's pattern: a Linear called with batch 1 on a query computed from a trainable
    table, its output repeated over the batch by the model's own code (which an output expanded
    to the batch would break)."""

    def __init__(self, dim=4, k=2):
        super().__init__()
        self.table = nn.Embedding(k, dim)
        self.query_proj, self.key_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):  # x [B, T, d]
        table = self.table(torch.arange(self.table.num_embeddings)[None])  # before the batch
        keys = self.key_proj(x)
        query = self.query_proj(table).repeat(x.shape[0], 1, 1)  # [B, k, d]
        return (query @ keys.transpose(1, 2)).softmax(-1) @ x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_batch_one_call_on_an_input_with_a_gradient_is_left_and_refused(dtype):
    """Not expanded (the forward runs as without hooks); refused by compute_* naming the call
    and units=; exact as one unit, against the float64 loop."""
    torch.manual_seed(0)
    model, x = nn.Sequential(ComputedQuery()).to(dtype), torch.randn(5, 3, 4, dtype=dtype)
    expected = model(x)
    with psh.add_hooks(model):
        out = model(x)
        torch.testing.assert_close(out, expected)
        weighted_square(out).mean().backward()
        with pytest.raises(psh.PerSampleHooksError,
                           match="'0.query_proj' was called with batch size 1 on an input "
                                 "computed from trainable parameters.*units="):
            psh.compute_grad1(model)
    model.zero_grad(set_to_none=True)
    with psh.add_hooks(model, units=["0"]):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    truth = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    tolerance = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else \
        dict(rtol=1e-4, atol=1e-6)
    for n, value in truth.items():
        torch.testing.assert_close(got[n].double(), value, **tolerance)


class BiasTable(nn.Module):
    """Swinv2's continuous position bias: an MLP on a coordinates buffer ``[1, K, 2]`` whose
    output is not broadcast over the batch but used as a table, reshaped to rows and indexed
    (``reshape``), or one row picked (``select``; with as many samples as the 4 positions
    picked, the result's shape cannot tell), or written in place (``in-place``: Swinv2's
    ``ReLU(inplace=True)``). Expanded over the batch, every sample's rows would be sample 0's
    copy: refused."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.register_buffer("coords", torch.randn(1, 5, 2))
        self.register_buffer("index", torch.tensor([4, 0, 2, 2]))
        self.inp, self.mlp = nn.Linear(3, 3), nn.Linear(2, 3)

    def forward(self, x):  # x [B, 4, 3]
        h = self.inp(x)
        table = self.mlp(self.coords)
        if self.use == "in-place":
            table = table.relu_()
        bias = table[0, :4] if self.use.startswith("select") else \
            table.reshape(-1, 3)[self.index]
        return h + bias


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("use", ["reshape", "select", "select, 4 samples", "in-place"])
def test_an_expanded_output_used_otherwise_than_broadcast_is_refused(use, dtype):
    """Refused naming the module, the op and units= (at compute_* where the op ran on the view,
    in the forward where it could not); the next step is refused the same way, not poisoned;
    with the model one unit, exact against the float64 loop."""
    torch.manual_seed(0)
    batch = 4 if use == "select, 4 samples" else 6
    model, x = BiasTable(use).to(dtype), torch.randn(batch, 4, 3, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, batch)
    op = "__getitem__" if use.startswith("select") else \
        {"reshape": "reshape", "in-place": "relu_"}[use]
    with psh.add_hooks(model, check_unseen="always"):
        for _ in range(2):
            with pytest.raises(psh.PerSampleHooksError, match=rf"'mlp' was called with batch "
                               rf"size 1 .*model's {op} on it.*units="):
                weighted_square(model(x)).mean().backward()
                psh.compute_grad1(model)
            model.zero_grad(set_to_none=True)
    with psh.add_hooks(model, units=[""]):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


class ScatteredRow(nn.Module):
    """A row computed once (an MLP on a buffer ``[1, 2]``) written into one row of the batch's
    tensor by an index, as torch_geometric's MFConv writes each degree bucket's rows: by
    ``index_copy_`` (fails on the expanded view), ``scatter_add_`` (runs, reading the view's
    first copy only) or ``index_copy_`` of a tensor computed from it (fails in the model's
    code, past the view)."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.register_buffer("coords", torch.randn(1, 2))
        self.inp, self.mlp = nn.Linear(3, 3), nn.Linear(2, 3)

    def forward(self, x):  # x [B, 3]
        h, row = self.inp(x), self.mlp(self.coords)
        out = torch.zeros_like(h)
        if self.use == "scatter_add_":
            out.scatter_add_(0, torch.tensor([[2, 2, 2]]), row)
        else:
            out.index_copy_(0, torch.tensor([2]), row if self.use == "index_copy_" else row * 2)
        return h * out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("use", ["index_copy_", "scatter_add_", "index_copy_ past the view"])
def test_an_expanded_output_written_by_an_index_is_refused(use, dtype):
    """Refused in the forward naming the module and the op, past the view too (a tensor
    computed from it alone, ``row * 2``, is watched as the view is; the model's own error
    got a note naming the expansion). The next step is refused the same way (the model mixes
    its samples: one sample's row is computed from the rest, no unit can make it per
    sample)."""
    torch.manual_seed(0)
    model, x = ScatteredRow(use).to(dtype), torch.randn(5, 3, dtype=dtype)
    op = use.split()[0]
    with psh.add_hooks(model):
        for _ in range(2):
            with pytest.raises(psh.PerSampleHooksError,
                               match=rf"'mlp' was called .*model's {op} on it.*units="):
                model(x)


class IndexedPastTheView(nn.Module):
    """The expanded output meets the batch, and the result is written by an index that fits
    one row only (an error of the model's own code, past the view: its note names the
    expansion, which may be the cause)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("coords", torch.randn(1, 3))
        self.inp, self.mlp = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):  # x [B, 3]
        h = self.inp(x) + self.mlp(self.coords)
        return torch.zeros(2, 3, dtype=x.dtype).index_copy_(0, torch.tensor([0]), h)


def test_an_error_of_the_model_past_the_view_gets_a_note_naming_the_expansion():
    model = IndexedPastTheView()
    with psh.add_hooks(model), pytest.raises(IndexError) as raised:
        model(torch.randn(5, 3))
    assert re.search(r"'mlp' was called with batch size 1 .*units=",
                     "".join(raised.value.__notes__))


class SlicedPositions(nn.Module):
    """Positions from ids ``[1, T]`` sliced before they meet the batch: along the positions or
    features (the batch dim kept, exact) or at the batch dim (``[0, ...]``: refused)."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.tokens, self.positions = nn.Embedding(7, 4), nn.Embedding(8, 4)

    def forward(self, ids):
        tokens = self.tokens(ids)
        positions = self.positions(torch.arange(ids.shape[1])[None])[self.index]
        return tokens[:, :positions.shape[-2]] + positions


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("index", [(slice(None), slice(None, 3)),
                                   (Ellipsis, slice(None, 3), slice(None)),
                                   (0,)],
                         ids=["[:, :3]", "[..., :3, :]", "[0]"])
def test_slices_of_an_expanded_output_keep_or_pick_the_batch(index, dtype):
    """At T == B (4 positions, 4 samples), where shapes cannot tell: slices that keep the batch
    dim are exact against the loop, a pick at the batch dim (``[0]``: ``[T, d]``, as many rows
    as samples) is refused."""
    torch.manual_seed(0)
    model, ids = SlicedPositions(index).to(dtype), torch.randint(0, 7, (4, 4))
    with psh.add_hooks(model):
        weighted_square(model(ids)).mean().backward()
        if index[0] == 0:
            with pytest.raises(psh.PerSampleHooksError, match=r"'positions' .*__getitem__"):
                psh.compute_grad1(model)
            return
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 4)
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, **loop_tolerance(dtype))


class LengthSortedLoop(nn.Module):
    """An Elman loop over sequences sorted by length, step ``t`` run on the first ``bt`` rows
    (the unfinished ones: seq2seq and captioning tutorials), or (``masked``) on all rows with
    the finished ones' state kept."""

    def __init__(self, masked: bool):
        super().__init__()
        self.masked = masked
        self.inp, self.rec, self.head = nn.Linear(3, 4), nn.Linear(4, 4, bias=False), \
            nn.Linear(4, 1)

    def forward(self, x, lengths):
        h, losses = x.new_zeros(x.shape[0], 4), x.new_zeros(x.shape[0])
        for t in range(int(lengths.max())):
            rows = int((lengths > t).sum())
            if self.masked:
                active = lengths > t
                h = torch.where(active[:, None], torch.tanh(self.inp(x[:, t]) + self.rec(h)), h)
                losses = losses + torch.where(active, self.head(h).squeeze(1).square(), 0.0)
            else:
                h = torch.tanh(self.inp(x[:rows, t]) + self.rec(h[:rows]))
                losses = losses + nn.functional.pad(self.head(h).squeeze(1).square(),
                                                    (0, x.shape[0] - rows))
        return losses


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_loop_over_fewer_rows_than_the_batch_leaves_the_forward_alone_and_is_refused(dtype):
    """At the step with one unfinished row, ``inp(x[:1, t])`` has batch 1 and no gradient: it
    was taken for an output shared by the samples and expanded over the batch, which changed
    the model's loss and p.grad with no error. A view of the model's input with fewer rows is
    not expanded: loss and p.grad are those without hooks, and compute_* refuses, naming the
    layer and the masked loop; the masked loop is exact."""
    torch.manual_seed(0)
    x, lengths = torch.randn(5, 6, 3, dtype=dtype), torch.tensor([6, 5, 4, 2, 1])
    model = LengthSortedLoop(masked=False).to(dtype)
    reference = copy.deepcopy(model)
    plain = reference(x, lengths).mean()
    plain.backward()
    with psh.add_hooks(model):
        loss = model(x, lengths).mean()
        loss.backward()
        assert torch.equal(loss, plain)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        with pytest.raises(psh.PerSampleHooksError, match=r"'inp' was called on 4 of the 5 "
                           r"rows of the model's input .* `h = torch.where\(active"):
            psh.compute_grad1(model)
    masked = LengthSortedLoop(masked=True).to(dtype)
    masked.load_state_dict(model.state_dict())
    expected = loop_grads(copy.deepcopy(masked).double(), [x.double(), lengths],
                          lambda out: out, 5)
    with psh.add_hooks(masked):
        masked(x, lengths).mean().backward()
        psh.compute_grad1(masked)
        for n, p in masked.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("model_class", [BroadcastPositions, SharedQuery])
def test_a_second_call_of_the_model_with_one_row_is_left_as_is_and_refused(model_class, dtype):
    """The model called on the batch, then on one input of its own (an RL bootstrap value
    V(s_T), a PINN's anchor point) before the backward: that call's outputs of size 1 were
    taken as broadcast over the batch and expanded, so that the model returned B rows and the
    loss (and p.grad) changed with no error. The call is left as it is (loss and p.grad those
    without hooks) and compute_* refuses, naming the model's two calls; the second call under
    torch.no_grad (a bootstrap value the loss does not differentiate) is exact."""
    torch.manual_seed(0)
    model = model_class().to(dtype)
    batch, one = (torch.randint(0, 9, (5, 6)), torch.randint(0, 9, (1, 6))) \
        if model_class is BroadcastPositions else \
        (torch.randn(5, 3, 4, dtype=dtype), torch.randn(1, 3, 4, dtype=dtype))
    reference = copy.deepcopy(model)

    def loss_of(net: nn.Module, anchored: bool = True) -> torch.Tensor:
        loss = weighted_square(net(batch)).mean()
        with torch.set_grad_enabled(anchored):  # after the batch's call
            anchor = net(one).sum()
        return loss + anchor.square()

    plain = loss_of(reference)
    plain.backward()
    expected = loop_grads(copy.deepcopy(model).double(),
                          [batch.double() if batch.is_floating_point() else batch],
                          weighted_square, 5)
    tight = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else {}
    with psh.add_hooks(model):
        loss = loss_of(model)
        loss.backward()
        torch.testing.assert_close(loss, plain, **tight)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tight)
        with pytest.raises(psh.PerSampleHooksError, match=r"The model was called in this step "
                           r"with 5 and 1 rows .* goes under torch.no_grad\(\)"):
            psh.compute_grad1(model)
        model.zero_grad()
        loss_of(model, anchored=False).backward()  # the anchor's value, not differentiated
        psh.compute_grad1(model)
        for n, p in model.named_parameters():  # (float32: entries of 1e-15 come out 1e-6)
            torch.testing.assert_close(p.grad1.double(), expected[n], rtol=1e-4,
                                       atol=1e-11 if dtype == torch.float64 else 1e-5)


class BroadcastBy(nn.Module):
    """A step embedding ``[1, d]`` (``e``) meeting the ``[B, T, d]`` activations ``h`` through
    an op that broadcasts it: its samples must meet the samples, not the positions."""

    OPS = {
        "atan2": lambda h, e: torch.atan2(h, e + 2),
        "max": lambda h, e: torch.max(h, e),
        "clamp": lambda h, e: torch.clamp(h, min=e),
        "einsum": lambda h, e: torch.einsum("...d,...d->...", h, e).unsqueeze(-1) * h,
        "expand_as": lambda h, e: h * e.expand_as(h),
        "broadcast_to": lambda h, e: h * torch.broadcast_to(e, h.shape),
        "scaled then added": lambda h, e: h + (1 + e).tanh(),
    }

    def __init__(self, op: str):
        super().__init__()
        self.inp, self.step, self.out = nn.Linear(3, 4), nn.Embedding(2, 4), nn.Linear(4, 2)
        self.op = self.OPS[op]

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.tanh(self.op(h, self.step(torch.tensor([1])))))


class LearnedQuery(nn.Module):
    """A learned query ``[1, K, d]`` (an Embedding of ``arange(K)[None]``) through a Linear,
    attending over each sample's keys ``[B, H, T, d]`` by a broadcasting matmul."""

    def __init__(self):
        super().__init__()
        self.keys, self.query, self.proj = nn.Linear(3, 8), nn.Embedding(2, 4), nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):  # x [B, T, 3]
        keys = self.keys(x).unflatten(-1, (2, 4)).transpose(1, 2)  # [B, 2 heads, T, 4]
        query = self.proj(self.query(torch.arange(2)[None]))  # [1, 2, 4], expanded
        scores = (query.unsqueeze(1) @ keys.transpose(-1, -2)).softmax(-1)  # [B, 2, 2, T]
        return self.out((scores @ keys).mean((1, 2)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("positions", [4, 5])
@pytest.mark.parametrize("op", [*BroadcastBy.OPS, "learned query"])
def test_ops_that_broadcast_an_expanded_output_against_a_wider_tensor(op, positions, dtype):
    """Each op broadcasting the expanded ``[B, d]`` against ``[B, T, d]`` met the positions
    with its samples (silently wrong rows where ``T == B``, refused otherwise): aligned at the
    batch, as are ``expand_as`` / ``broadcast_to`` to the wider shape, ``einsum``'s ``...``
    and matmul's batch dims (a learned query: its Linear crashed in compute_* on the
    view's shape, a tuple). The hooked forward is the plain one; exact against the loop."""
    torch.manual_seed(0)
    model = (LearnedQuery() if op == "learned query" else BroadcastBy(op)).to(dtype)
    x = torch.randn(4, positions, 3, dtype=dtype)
    plain = model(x)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 4)
    with psh.add_hooks(model):
        out = model(x)  # (float32: a batched matmul's rounding)
        torch.testing.assert_close(out, plain, **loop_tolerance(dtype))
        weighted_square(out).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
    flat = torch.cat([g.flatten(1) for g in expected.values()], 1)
    torch.testing.assert_close(norms.double(), flat.norm(dim=1), **loop_tolerance(dtype))


class AlongTheBatch(nn.Module):
    """Positions ``[1, T, d]`` reduced, scanned or reordered along dim 0 before they meet the
    batch: on the unexpanded output harmless (a size-1 dim), on the expanded one the samples'
    gradients would reach other copies, or the forward change (with ``T == B`` the shapes
    cannot tell)."""

    OPS = {"mean(0)": lambda e: e.mean(0), "flip(0)": lambda e: e.flip(0),
           "roll": lambda e: e.roll(1, 0), "cumsum(0)": lambda e: e.cumsum(0),
           "softmax(0)": lambda e: e.softmax(0)}

    def __init__(self, op: str):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(9, 4), nn.Embedding(6, 4)
        self.out = nn.Linear(4, 2)
        self.op = self.OPS[op]

    def forward(self, ids):
        h = self.tokens(ids)
        positions = self.positions(torch.arange(ids.shape[1])[None])
        return self.out(torch.tanh(h + self.op(positions)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("op", list(AlongTheBatch.OPS))
def test_ops_along_the_batch_dim_of_an_expanded_output_are_refused(op, dtype):
    """With as many positions as samples (``T == B``): the result kept the batch's size, was
    taken for a broadcast (``mean(0)``: wrapped again and realigned, a changed forward), gave
    other copies the samples' gradients (``flip``: silently) or other values (``cumsum``).
    Refused in the forward naming the op; the next step, with the positions used as a
    broadcast, is exact."""
    torch.manual_seed(0)
    model, ids = AlongTheBatch(op).to(dtype), torch.randint(0, 9, (5, 5))
    name = op.split("(")[0]
    with psh.add_hooks(model):
        with pytest.raises(psh.PerSampleHooksError, match=rf"'positions' .*model's {name} on "
                           r"it works along its batch dim"):
            model(ids)
        model.op = lambda e: e
        expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 5)
        model.zero_grad()
        weighted_square(model(ids)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


class WritesInto(AlongTheBatch):
    """Positions written into in place, or taken as a Linear's weight, before they meet the
    batch: on the expanded view every sample's copy is one memory location (a scalar write
    ran, and the backward failed with torch's error), and as a weight ``[B, d]`` the output
    had ``B`` columns (a changed forward, accepted)."""

    OPS = {"fill_": lambda e, h: e.fill_(0.5), "zero_": lambda e, h: e.zero_(),
           "__setitem__": lambda e, h: e.__setitem__((slice(None), 0), 0.0),
           "masked_fill_": lambda e, h: e.masked_fill_(e > 0, 0.0),
           "linear": lambda e, h: F.linear(h, e)}

    def forward(self, ids):
        h = self.tokens(ids)
        weight = self.op is WritesInto.OPS["linear"]  # ([1, d]: a weight of one output)
        positions = self.positions(torch.tensor([0]) if weight else
                                   torch.arange(ids.shape[1])[None])
        written = self.op(positions, h)
        return self.out(torch.tanh(h + written if written.dim() == 3 else h))


@pytest.mark.parametrize("op", list(WritesInto.OPS))
def test_writes_into_an_expanded_output_are_refused_in_the_forward(op):
    """Refused in the forward naming the op; the next step (positions added) is exact."""
    torch.manual_seed(0)
    model, ids = WritesInto(op).double(), torch.randint(0, 9, (5, 6))
    with psh.add_hooks(model):
        with pytest.raises(psh.PerSampleHooksError, match=rf"'positions' .*model's {op} on it "
                           r"(writes into it in place|takes it as a weight)"):
            model(ids)
        model.op = lambda e, h: e
        expected = loop_grads(copy.deepcopy(model), [ids], weighted_square, 5)
        weighted_square(model(ids)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, expected[n], rtol=1e-9, atol=1e-11)


def test_a_forward_that_fails_after_an_expansion_ends_the_step():
    """The model's own error after an op that dropped the expanded output's batch dim (only
    recorded, refused by compute_*): the step is over, and the next forward, corrected, is
    not refused for what the failed one recorded."""
    torch.manual_seed(0)
    model, ids = AlongTheBatch("mean(0)").double(), torch.randint(0, 9, (5, 6))
    model.op = lambda e: e.reshape(1, -1, 4)  # [1, B * T, 4]: the add fails
    with psh.add_hooks(model):
        with pytest.raises(RuntimeError, match="must match"):
            model(ids)
        model.op = lambda e: e
        expected = loop_grads(copy.deepcopy(model), [ids], weighted_square, 5)
        weighted_square(model(ids)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, expected[n], rtol=1e-9, atol=1e-11)


class DroppedPositions(nn.Module):
    """Positions ``[1, T, d]`` dropped out before they meet the batch (Transformer-XL drops its
    position embeddings): one mask shared by the samples. ``mask``: a fixed one instead (the
    float64 loop's reference)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(9, 4), nn.Embedding(6, 4)
        self.drop, self.out = nn.Dropout(0.4), nn.Linear(4, 2)
        self.mask = None

    def forward(self, ids):
        h = self.tokens(ids)
        positions = self.positions(torch.arange(ids.shape[1])[None])
        positions = self.drop(positions) if self.mask is None else positions * self.mask
        return self.out(torch.tanh(h + positions))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("positions", [5, 6])
def test_dropout_of_an_expanded_output_draws_one_mask(positions, dtype):
    """Dropout on the expanded view drew a mask per sample (the hooked forward was not the
    plain one, same seed); it draws the unexpanded output's one mask, from the same random
    numbers: the hooked forward is the plain one, and grad1 that of the loop with that mask."""
    torch.manual_seed(0)
    model, ids = DroppedPositions().to(dtype).train(), torch.randint(0, 9, (5, positions))
    torch.manual_seed(1)
    plain = model(ids)
    torch.manual_seed(1)
    mask = nn.functional.dropout(torch.ones(1, positions, 4, dtype=dtype), 0.4, True)
    reference = copy.deepcopy(model).double()
    reference.mask = mask.double()
    expected = loop_grads(reference, [ids], weighted_square, 5)
    with psh.add_hooks(model):
        torch.manual_seed(1)
        out = model(ids)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        weighted_square(out).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


@pytest.mark.parametrize("form_on_arrival", [False, True])
@pytest.mark.parametrize("length", [6, 5])
def test_positions_without_the_batch_in_the_output_edge_backward(length, form_on_arrival):
    """DPSGD's backward to the hooked outputs reaches the followed positions' use sites, and
    the positions' call is not formed on arrival (its gradients are pulled back later)."""
    from norms_truth import loop_clipped, loop_norms

    from per_sample_hooks.dp import OutputEdges
    torch.manual_seed(0)
    model = PositionsWithoutTheBatch().double()
    ids = torch.randint(0, 9, (5, length), generator=seeded(2))
    psh.add_hooks(model, check_unseen=False)  # (a checked step's backward is ordinary)
    edges = OutputEdges(model, form_on_arrival=form_on_arrival)
    edges.backward(weighted_square(model(ids)).mean())
    assert all(p.grad is None for p in model.parameters())
    psh.clip_grads(model, 0.3)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    edges.remove()
    psh.remove_hooks(model)
    total, _, grads = loop_norms(model, [ids], weighted_square, "mean")
    for n, expected in loop_clipped(grads, total, 0.3, "mean").items():
        torch.testing.assert_close(got[n], expected, rtol=1e-9, atol=1e-10)


class PositionsAsAWeight(PositionsWithoutTheBatch):
    def forward(self, ids):
        positions = self.positions(torch.arange(ids.shape[1]))  # [T, d]
        return torch.tanh(F.linear(self.tokens(ids), positions)).sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_positions_without_the_batch_used_otherwise_than_broadcast_are_refused(dtype):
    """Positions ``[T, d]`` taken as a weight against the batch's tokens: not broadcast over the
    samples, so they have no per-sample gradient to take there; refused naming the module and
    the op, and the next step (the tokens alone) is clean."""
    model = PositionsAsAWeight().to(dtype)
    psh.add_hooks(model)
    model(torch.randint(0, 9, (5, 6))).sum().backward()
    with pytest.raises(psh.PerSampleHooksError, match="'positions' was called on indices of "
                       "shape \\(6,\\) made inside the forward.*meets a tensor of the batch "
                       "in linear"):
        psh.compute_grad1(model)
    model.positions.weight.requires_grad_(False)
    model.zero_grad()
    ids = torch.randint(0, 9, (5, 6))
    weighted_square(model(ids)).sum().backward()
    psh.compute_grad1(model, loss_type="sum")
    expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 5)
    torch.testing.assert_close(model.tokens.weight.grad1.double(), expected["tokens.weight"],
                               **loop_tolerance(dtype))
    psh.remove_hooks(model)
