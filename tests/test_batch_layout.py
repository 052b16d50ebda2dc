"""Where the samples are: layouts whose shapes agree by chance (a sequence as long as the batch),
rows that are not samples (a multiple-choice head's ``[B * C, T]``, a soft prompt computed once
and repeated over the batch), each against the float64 per-sample loop."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import per_sample_hooks as psh
from ground_truth import loop_grads, loop_grads_of, loop_tolerance, weighted_square

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [5, 4])
def test_a_sequence_first_transformer_layer_is_exact_whatever_its_length(length, dtype):
    """``nn.TransformerEncoderLayer(batch_first=False)`` under the default ``batch_dim=0``: its
    linear and norm children see ``[S, B, E]`` and get batch dim 1. Before, S != B was refused
    and S == B gave their per-position gradients as the samples'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0)).to(dtype)
    x = torch.randn(length, 4, 4, dtype=dtype)  # [S, B, E], B = 4

    def loss(out):  # per-sample losses [B] of a sequence-first output
        return weighted_square(out.transpose(0, 1))
    with psh.add_hooks(model):
        loss(model(x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], loss, 4, batch_dim=1)
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, **loop_tolerance(dtype))


class MultipleChoice(nn.Module):
    """transformers' ``*ForMultipleChoice``: ``[B, C, T]`` choices flattened to ``[B * C, T]``
    rows before any layer, a score per row, the scores of a sample's choices as its logits."""

    def __init__(self):
        super().__init__()
        self.embed, self.score = nn.Embedding(11, 6), nn.Linear(6, 1)

    def forward(self, ids):
        rows = self.embed(ids.flatten(0, 1)).tanh().mean(1)  # [B * C, 6]
        return self.score(rows).view(ids.shape[0], ids.shape[1])  # [B, C]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_several_per_sample_are_refused_and_exact_as_joint_groups(dtype):
    """A multiple-choice model: every compute_* refuses to take the ``B * C`` rows as samples
    and names ``groups=JointGroups(C)``; clip_grads with it is the loop's clipped mean or sum.
    Before, the 12 rows were taken as 12 samples (clipped per choice: the DP bound broken);
    then the advice ``groups=3`` (a group the mean of its rows') gave a sum loss 1/3 of the
    norms and of the clipped sum. It is still exact for a mean loss."""
    torch.manual_seed(0)
    model = MultipleChoice().to(dtype)
    ids = torch.randint(0, 11, (4, 3, 5))
    expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 4)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    with psh.add_hooks(model):
        for refused in (psh.compute_grad1, psh.compute_norms, psh.compute_kfac):
            model.zero_grad(set_to_none=True)
            weighted_square(model(ids)).mean().backward()
            with pytest.raises(psh.PerSampleHooksError, match=r"called with 4 samples, but its "
                               r"hooked layers .* saw 12 rows, 3 per sample.*"
                               r"groups=per_sample_hooks.JointGroups\(3\)"):
                refused(model)
        for loss_type, groups in (("mean", psh.JointGroups(3)), ("sum", psh.JointGroups(3)),
                                  ("mean", 3)):
            model.zero_grad(set_to_none=True)
            losses = weighted_square(model(ids))
            (losses.mean() if loss_type == "mean" else losses.sum()).backward()
            got = psh.clip_grads(model, 0.3, loss_type, groups=groups)
            torch.testing.assert_close(got.double(), norms, **loop_tolerance(dtype))
            for name, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factors, expected[name])
                clipped = clipped / 4 if loss_type == "mean" else clipped
                what = f"{loss_type} {groups}"
                torch.testing.assert_close(p.grad.double(), clipped, **loop_tolerance(dtype),
                                           msg=lambda m, what=what: f"{what}: {m}")


def test_rows_of_several_per_sample_are_refused_when_a_dim_has_as_many():
    """Choices of 12 tokens, 4 samples of 3 choices: 12 rows. The refusal was skipped because
    some dim of the input had as many (taken for a sequence-first batch), and the 12 rows
    were clipped as samples."""
    torch.manual_seed(0)
    model = MultipleChoice()
    with psh.add_hooks(model):
        weighted_square(model(torch.randint(0, 11, (4, 3, 12)))).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"saw 12 rows, 3 per sample"):
            psh.clip_grads(model, 0.3)


class SumReadout(nn.Module):
    """A graph net on a batch of graphs as one node tensor: message passing along edges, a
    score per node summed into its graph's (every hooked layer sees the nodes)."""

    def __init__(self):
        super().__init__()
        self.embed, self.score = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, edges, graph_of, graphs):
        h = torch.tanh(self.embed(x))
        h = h + torch.zeros_like(h).index_add_(0, edges[1], h[edges[0]])
        return self.score(h).new_zeros(graphs, 2).index_add_(0, graph_of, self.score(h))


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [[2, 5, 1, 4], [2, 5, 0, 1, 4]], ids=["nodes", "empty"])
def test_graphs_of_any_size_as_joint_groups(dtype, loss_type, sizes):
    """Graphs of 2, 5, 1 and 4 nodes (and one of none), their nodes shuffled:
    groups=JointGroups(node -> graph) gives each graph's norm and the clipped mean (sum) of the
    loop over graphs, and a DPSGD step with noise 0. Plain groups= (a graph the mean of its
    nodes' gradients) gave N/(G n_g) (mean) or 1/n_g (sum) of the norms, silently. A graph of
    no nodes has no id among the rows: ``count`` gives the number of graphs, without which
    the mean loss's norms were (G - 1) / G of the truth."""
    torch.manual_seed(0)
    model = SumReadout().to(dtype)
    graphs = len(sizes)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 3, generator=generator, dtype=torch.float64) for n in sizes]
    links = [torch.randint(0, max(n, 1), (2, 2 * n), generator=generator) for n in sizes]
    reference = copy.deepcopy(model).double()
    expected = loop_grads_of(reference, ([x, e, torch.zeros(len(x), dtype=torch.long), 1]
                                         for x, e in zip(xs, links)), weighted_square)
    norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    order = torch.randperm(sum(sizes), generator=generator)  # node i of the batch: order[i]
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order))
    x = torch.cat(xs)[order].to(dtype)
    edges = place[torch.cat([e + s for e, s in zip(links, starts)], 1)]
    graph_of = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])[order]
    groups = psh.JointGroups(graph_of, graphs if 0 in sizes else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    dp = psh.DPSGD(model, optimizer, noise_multiplier=0.0, max_grad_norm=0.3,
                   dataset_size=2 * graphs, batch_size=graphs, loss_type=loss_type,
                   accountant=None)
    with psh.add_hooks(model):
        losses = weighted_square(model(x, edges, graph_of, graphs))
        (losses.mean() if loss_type == "mean" else losses.sum()).backward()
        got = psh.compute_norms(model, loss_type, groups=groups)
        torch.testing.assert_close(got.double(), norms, **loop_tolerance(dtype))
        psh.clip_grads(model, 0.3, loss_type, groups=groups)
        for name, p in model.named_parameters():
            clipped = torch.einsum("b,b...->...", factors, expected[name])
            clipped = clipped / graphs if loss_type == "mean" else clipped
            torch.testing.assert_close(p.grad.double(), clipped, **loop_tolerance(dtype))
        before = [p.detach().clone() for p in model.parameters()]
        dp.zero_grad()
        losses = weighted_square(model(x, edges, graph_of, graphs))
        dp.backward(losses.mean() if loss_type == "mean" else losses.sum())
        dp.step(groups=groups)
        for (name, p), start in zip(model.named_parameters(), before):  # the clipped sum / G
            step = torch.einsum("b,b...->...", factors, expected[name]) / graphs
            torch.testing.assert_close((start - p.detach()).double(), step,
                                       **loop_tolerance(dtype))
    dp.close()


class SoftPrompt(nn.Module):
    """peft's prompt tuning: the prompt computed once (``[1, P, d]``) and repeated over the
    batch; the layers that see the batch are frozen."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 4).requires_grad_(False)
        self.prompt = nn.Embedding(3, 4)
        self.head = nn.Linear(4, 5).requires_grad_(False)

    def forward(self, ids):
        prompt = self.prompt(torch.arange(3)[None]).repeat(ids.shape[0], 1, 1)
        return self.head(torch.cat([prompt, self.tokens(ids)], 1).tanh()).mean(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_computation_repeated_over_the_batch_is_refused_and_exact_as_a_unit(dtype):
    """The only recorded layer saw one row for 4 samples: refused, naming units; the whole model
    as one unit is the loop's. Before, the batch's gradient was returned as one sample's."""
    torch.manual_seed(0)
    model = SoftPrompt().to(dtype)
    ids = torch.randint(0, 20, (4, 5))
    with psh.add_hooks(model):
        weighted_square(model(ids)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"called with 4 samples, but the "
                           r"hooked layers that received gradients \('prompt'...\) saw 1 row.*"
                           r"units=\[''\]"):
            psh.compute_norms(model)
    with psh.add_hooks(model, units=[""]):
        model.zero_grad(set_to_none=True)
        weighted_square(model(ids)).mean().backward()
        psh.compute_grad1(model)
        got = model.prompt.weight.grad1.double()
    expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 4)
    torch.testing.assert_close(got, expected["prompt.weight"], **loop_tolerance(dtype))


def test_float32_gradients_too_small_to_square_are_checked_without_a_false_refusal():
    """transformers' MobileNetV2 at random init, eval mode, float32: gradients about 1e-31,
    whose squares underflow float32. The check's norms were 0, so rounding could not explain
    the smallest gap and every step was refused ("differs by 8e+270%"); they are taken in
    float64, and grad1 is the loop's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileNetV2Config(image_size=8, depth_multiplier=0.25, num_labels=3,
                                            classifier_dropout_prob=0.0)
    model = transformers.MobileNetV2ForImageClassification(config).eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0])

    def losses(out):
        return nn.functional.cross_entropy(out.logits, y[:len(out.logits)], reduction="none")
    with psh.add_hooks(model, check_unseen="always"):
        losses(model(pixel_values=x)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model).double()
    expected = {n: torch.stack([torch.autograd.grad(
        nn.functional.cross_entropy(reference(pixel_values=x[i:i + 1].double()).logits,
                                    y[i:i + 1]), p)[0] for i in range(4)])
        for n, p in reference.named_parameters()}
    for name, grads in expected.items():
        scale = grads.abs().max()
        torch.testing.assert_close(got[name] / scale, grads / scale, rtol=0, atol=1e-4)


class TiedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(6, 4), nn.Linear(4, 4)

    def forward(self, ids):
        return torch.tanh(self.lin(self.emb(ids).mean(1))) @ self.emb.weight.t()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_whole_model_as_a_unit_serves_several_computes_of_a_step(dtype):
    """The fallback's re-run of the whole model (``units=['']``) is no call of the model: a
    second ``compute_*`` of the step used to be refused ("called with 1 samples, but its
    hooked layers saw 4 rows")."""
    torch.manual_seed(2)
    model, ids = TiedOutput().to(dtype), torch.randint(0, 6, (4, 3))
    expected = loop_grads(copy.deepcopy(model).double(), [ids], weighted_square, 4)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    with psh.add_hooks(model, units=[""]):
        weighted_square(model(ids)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
        torch.testing.assert_close(psh.compute_norms(model).double(), total,
                                   **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_unused_forward_on_a_part_of_the_batch_is_no_layout(dtype):
    """A forward with grad enabled on 2 of the 6 samples, never backpropagated, between the
    step's forward and backward: the rows of the step (6) are a multiple of that call's
    samples (2), which used to be refused as 3 rows per sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    x = torch.randn(6, 4, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 6)
    with psh.add_hooks(model):
        out = model(x)
        model(x[:2])
        weighted_square(out).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


def assert_grad1_matches_loop(model: nn.Module, inputs: list, **hook_options) -> None:
    """``grad1`` of ``model`` in its dtype against the float64 loop (weighted squares, mean)."""
    dtype = next(model.parameters()).dtype
    with psh.add_hooks(model, **hook_options):
        model.zero_grad(set_to_none=True)
        weighted_square(model(*inputs)).mean().backward()
        psh.compute_grad1(model)
        got = {name: p.grad1.double() for name, p in model.named_parameters()}
    batch = inputs[0].shape[0]
    inputs64 = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs]
    expected = loop_grads(copy.deepcopy(model).double(), inputs64, weighted_square, batch)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **loop_tolerance(dtype),
                                   msg=lambda m, name=name: f"{name}: {m}")


class RelativePositionMLP(nn.Module):
    """timm's RelPosMlp in small: an MLP run on a coordinate table (a buffer ``[N, N, 2]``, no
    batch dim), its output added to every sample's attention scores."""

    def __init__(self, tokens: int = 5, width: int = 4):
        super().__init__()
        self.register_buffer("coords", torch.randn(tokens, tokens, 2), persistent=False)
        # (no bias where softmax would leave it no gradient: a shift of the scores, of keys)
        self.mlp = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1, bias=False))
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = self.mlp(self.coords).squeeze(-1)  # [N, N], shared by the samples
        return ((q @ k.transpose(1, 2) + bias).softmax(-1) @ v).sum(1)


class Model(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [5, 3])
def test_a_layer_called_on_a_table_of_the_model_is_refused_whatever_its_rows(batch, dtype):
    """An MLP on a buffer table with as many rows as samples (5) returned the rows' gradients as
    the samples', 110% off; with other rows (3) the refusal named no table. Both name it now,
    and the block holding the table's uses as a unit is the loop's."""
    torch.manual_seed(0)
    model = Model(RelativePositionMLP()).to(dtype)
    x = torch.randn(batch, 5, 4, dtype=dtype)
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'block.mlp.0' \(Linear\) was called "
                           r"on the model's buffer 'block.coords' \(shape \(5, 5, 2\)\), which "
                           r"every sample shares.*units="):
            psh.compute_norms(model)
    assert_grad1_matches_loop(model, [x], units=["block"])


class LearnedQueries(nn.Module):
    def __init__(self, queries: int = 3, width: int = 4):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(queries, width))
        self.project = nn.Linear(width, width)

    def forward(self, x):
        return (x @ self.project(self.queries).T).softmax(-1).sum(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_called_on_a_parameter_as_many_rows_as_samples_is_refused(dtype):
    """(A trainable one is refused as a raw parameter passed to a child.)"""
    torch.manual_seed(0)
    model = LearnedQueries().to(dtype)
    model.queries.requires_grad_(False)
    with psh.add_hooks(model):
        weighted_square(model(torch.randn(3, 2, 4, dtype=dtype))).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'project' \(Linear\) was called on "
                           r"the model's parameter 'queries' \(shape \(3, 4\)\)"):
            psh.compute_grad1(model)


class ExpandedPositions(nn.Module):
    """transformers' way: positions from a buffer ``[1, max]``, expanded over the batch (a
    stride-0 view of the buffer: the batch's rows, not a shared table)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(8)[None], persistent=False)
        self.register_buffer("flat_positions", torch.arange(8), persistent=False)
        self.positions = nn.Embedding(8, 4)
        self.tokens = nn.Embedding(10, 4)

    def forward(self, ids, expand: bool):
        batch, length = ids.shape
        positions = self.position_ids[:, :length]
        if expand:
            positions = positions.expand(batch, length)
        return self.tokens(ids) + self.positions(positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,expand", [(3, True), (3, False), (1, False)])
def test_positions_from_a_buffer_of_the_batch_are_no_shared_table(batch, expand, dtype):
    """A view of a buffer expanded over the batch, or of size 1 there (broadcast), is not taken
    for a table every sample shares."""
    torch.manual_seed(0)
    model = ExpandedPositions().to(dtype)
    assert_grad1_matches_loop(model, [torch.randint(0, 10, (batch, 5)), expand])


class GraphAttention(nn.Module):
    """torch_geometric's GATConv (one head) written out: raw attention vectors on the node rows
    before the edges pick them (``(h * att).sum(-1)[edges[0]]``), a softmax over each node's
    incoming edges, the messages summed back into the node rows, then a raw bias.
    ``on_edges``: GATv2's ``(leaky_relu(h[src] + h[dst]) * att).sum(-1)``, the attention
    vector applied to the edge rows."""

    def __init__(self, on_edges: bool = False):
        super().__init__()
        self.lin, self.on_edges = nn.Linear(3, 4), on_edges
        self.att_src, self.att_dst = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x, edges):
        h = self.lin(x)
        src, dst = edges
        if self.on_edges:
            e = (F.leaky_relu(h[src] + h[dst], 0.2) * self.att_src).sum(-1)
        else:
            e = F.leaky_relu((h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst],
                             0.2)
        w = torch.exp(e)
        total = torch.zeros(len(x), dtype=w.dtype).index_add_(0, dst, w)
        messages = (w / total[dst])[:, None] * h[src]
        return torch.zeros_like(h).index_add_(0, dst, messages) + self.bias


class AttentionReadout(nn.Module):
    def __init__(self, on_edges: bool = False):
        super().__init__()
        self.gat, self.score = GraphAttention(on_edges), nn.Linear(4, 2)

    def forward(self, x, edges, graph_of, graphs):
        scores = self.score(torch.tanh(self.gat(x, edges)))
        return scores.new_zeros(graphs, 2).index_add_(0, graph_of, scores)


def batch_of_graphs(sizes, dtype, seed=1, edges_per_node=1):
    """Graphs of ``sizes`` nodes, each node with a self loop and ``edges_per_node - 1`` random
    incoming edges, their nodes shuffled into one batch: the graphs alone (float64 nodes, edges)
    and the batch's nodes, edges and node -> graph ids."""
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 3, generator=generator, dtype=torch.float64) for n in sizes]
    links = [torch.cat([torch.arange(n).expand(2, n),
                        torch.randint(0, n, (2, (edges_per_node - 1) * n), generator=generator)],
                       1) for n in sizes]
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    order = torch.randperm(sum(sizes), generator=generator)
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order))
    edges = place[torch.cat([e + s for e, s in zip(links, starts)], 1)]
    graph_of = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])[order]
    return list(zip(xs, links)), torch.cat(xs)[order].to(dtype), edges, graph_of


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_attention_with_raw_vectors_on_node_rows_is_exact(dtype):
    """GATConv's raw attention vectors meet the node rows, and its bias the rows the messages
    were summed back into (a scatter into node rows): per-graph norms of every parameter and
    the clipped sum are the loop's, with graphs of 3, 1, 4 and 2 nodes and 2 edges per node
    (E != N) or 1 (E == N)."""
    torch.manual_seed(0)
    for edges_per_node in (2, 1):
        model = AttentionReadout().to(dtype)
        graphs, x, edges, graph_of = batch_of_graphs([3, 1, 4, 2], dtype,
                                                     edges_per_node=edges_per_node)
        expected = loop_grads_of(copy.deepcopy(model).double(),
                                 ([x1, e, torch.zeros(len(x1), dtype=torch.long), 1]
                                  for x1, e in graphs), weighted_square)
        norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
        factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
        with psh.add_hooks(model):
            weighted_square(model(x, edges, graph_of, 4)).sum().backward()
            got = psh.compute_norms(model, "sum", groups=psh.JointGroups(graph_of),
                                    per_param=True)
            assert set(got) == set(expected)
            for name, grads in expected.items():
                torch.testing.assert_close(got[name].double(), grads.flatten(1).norm(dim=1),
                                           **loop_tolerance(dtype))
            psh.clip_grads(model, 0.3, "sum", groups=psh.JointGroups(graph_of))
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    p.grad.double(), torch.einsum("b,b...->...", factors, expected[name]),
                    **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_raw_vector_on_edge_rows_is_refused_even_with_as_many_edges_as_nodes(dtype):
    """GATv2's attention vector meets the edges' rows. With one edge per node (E == N) they were
    taken for the node rows: per-graph norms of ``att_src`` 60x off, with no error. Refused now,
    as it was with E != N, naming the parameter and the gather."""
    torch.manual_seed(0)
    for edges_per_node in (1, 2):
        model = AttentionReadout(on_edges=True).to(dtype)
        _, x, edges, graph_of = batch_of_graphs([3, 1, 4, 2], dtype,
                                                edges_per_node=edges_per_node)
        with psh.add_hooks(model):
            weighted_square(model(x, edges, graph_of, 4)).sum().backward()
            with pytest.raises(psh.PerSampleHooksError,
                               match=r"'gat' \(GraphAttention\) uses its raw parameter\(s\) "
                                     r"'att_src' in `mul` on rows that `__getitem__` picked"):
                psh.compute_norms(model, "sum", groups=psh.JointGroups(graph_of))


class PointNet(nn.Module):
    """Points of each cloud merged into the batch dim before the first layer, ``[B, N, 3] ->
    [B * N, 3]``, a shared MLP, a max over each cloud's points, a head on ``[B, 6]``."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, clouds):
        b, n, _ = clouds.shape
        return self.head(self.mlp(clouds.reshape(b * n, 3)).view(b, n, 6).amax(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_first_layer_on_merged_rows_is_refused_with_the_models_batch(dtype):
    """The step's batch is its first hooked call's (20 rows); the refusal said position ids and
    relative position biases. It now reads the model's 4 samples from its input and names the
    merge and the unit, the model itself (the nearest module holding the merged layers and one
    that saw the batch); that unit is the loop's."""
    torch.manual_seed(0)
    model, clouds = PointNet().to(dtype), torch.randn(4, 5, 3, dtype=dtype)
    with psh.add_hooks(model):
        weighted_square(model(clouds)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"disagree on the batch size: 20 \(at "
                           r"'mlp.0'\), 4 \(at 'head'\)\. 'mlp.0' and 1 other layer saw a multiple "
                           r"of the batch 4: called with 20 rows.*the model itself.*units=\[''\]"):
            psh.compute_norms(model)
    assert_grad1_matches_loop(model, [clouds], units=[""])


class SequenceFirstTransformer(nn.Module):
    """``nn.Transformer`` (sequence first) on ``[S, B, E]``: its stacks' final norms see
    ``[S, B, E]`` too."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0)

    def forward(self, src, tgt):
        return self.transformer(src, tgt)


class BatchFirstLayerInSequenceFirstModel(nn.Module):
    """A sequence-first model (``add_hooks(model, batch_dim=1)``) around a ``batch_first=True``
    layer, transposed in and out."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 2)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)

    def forward(self, ids):  # [T, B]
        return self.head(self.layer(self.embed(ids).transpose(0, 1)).transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["transformer", "encoder_with_norm", "batch_first_layer"])
def test_torch_transformer_stacks_and_layers_follow_their_batch_first(case, dtype):
    """The final norm of a sequence-first ``nn.Transformer`` / ``nn.TransformerEncoder(norm=)``
    got batch dim 0, and a ``batch_first=True`` layer's children the model's ``batch_dim=1``:
    with as many positions as samples their per-position gradients were taken as the samples'
    (0.4 to 1.1 off, no error); with other lengths, refused without a cause. Each against the
    float64 loop, with T == B."""
    torch.manual_seed(0)
    src, tgt = torch.randn(4, 4, 8, dtype=dtype), torch.randn(4, 4, 8, dtype=dtype)
    options = {}
    if case == "transformer":
        model, inputs = SequenceFirstTransformer(), [src, tgt]
    elif case == "encoder_with_norm":
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, 0.0), 1,
                                      norm=nn.LayerNorm(8), enable_nested_tensor=False)
        inputs = [src]
    else:
        model, inputs = BatchFirstLayerInSequenceFirstModel(), [torch.randint(0, 10, (4, 4))]
        options = dict(batch_dim=1)
    model = model.to(dtype)

    def loss(out):  # per-sample losses [B] of a sequence-first output
        return weighted_square(out.transpose(0, 1))
    expected = loop_grads(copy.deepcopy(model).double(),
                          [x.double() if x.is_floating_point() else x for x in inputs], loss, 4,
                          batch_dim=1)
    with psh.add_hooks(model, **options):
        loss(model(*inputs)).mean().backward()
        psh.compute_grad1(model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))


class FieldEmbeddings(nn.Module):
    """A recommender's id fields ``[B, F]`` looked up transposed (``fields_first``:
    ``emb(ids.T)``, rows F) or as they come, then moved to ``[F, B, d]`` after the call."""

    def __init__(self, fields_first: bool, fields: int, vocab: int = 13, dim: int = 4):
        super().__init__()
        self.fields_first = fields_first
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(fields * dim, 1)

    def forward(self, ids):
        by_field = self.emb(ids.T) if self.fields_first else self.emb(ids).transpose(0, 1)
        return self.head(by_field.transpose(0, 1).flatten(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fields", [6, 3])
def test_a_layer_given_the_batch_at_another_dim_of_a_view_is_refused(fields, dtype):
    """``emb(ids.T)``: refused naming the layer, whatever the number of fields (with as many
    as samples, 6, the shapes cannot tell; it was silently per field), and exact against
    the float64 loop once the lookup takes the samples first."""
    torch.manual_seed(0)
    ids = torch.randint(0, 13, (6, fields))
    model = FieldEmbeddings(True, fields).to(dtype)
    with psh.add_hooks(model):
        weighted_square(model(ids)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'emb' was called on a view of the "
                           r"model's input with that input's batch dim at its dim 1"):
            psh.compute_grad1(model)
    model.fields_first = False
    assert_grad1_matches_loop(model, [ids])


class SequenceFirstInside(nn.Module):
    """A batch-first model whose recurrent or attention layer is sequence-first
    (``batch_first=False``), given a transposed view of the model's input, ``x.transpose(0, 1)``,
    as seq-first code does."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.layer = nn.MultiheadAttention(4, 2) if kind == "attention" else \
            getattr(nn, kind)(4, 5)
        self.head = nn.Linear(4 if kind == "attention" else 5, 2)

    def forward(self, x):
        seq = x.transpose(0, 1)  # [T, B, d]
        out = self.layer(seq, seq, seq)[0] if self.kind == "attention" else self.layer(seq)[0]
        return self.head(out.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["GRU", "LSTM", "attention"])
def test_a_sequence_first_layer_on_a_transposed_view_of_the_input(kind, dtype):
    """The layer takes its samples at dim 1, where the transpose put them: it was refused as a
    layer called on the input with its batch dim moved (that check read dim 0 for it, the
    model's batch dim): exact against the float64 loop."""
    torch.manual_seed(0)
    model = SequenceFirstInside(kind).to(dtype)
    assert_grad1_matches_loop(model, [torch.randn(5, 3, 4, dtype=dtype)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_refused_and_padded_ones_exact(layout, dtype):
    """A hooked layer called on a nested (ragged) tensor crashed the forward (strided: the
    model's pre-hook read its size) or compute_grad1 (jagged: an AttributeError). Refused,
    naming the layer and the fix; the next step, padded and masked, is exact against the
    float64 loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)  # (nested backward)
    lengths = [3, 5, 2]
    sequences = [torch.randn(t, 4, dtype=dtype) for t in lengths]
    mask = torch.tensor([[1.0] * t + [0.0] * (5 - t) for t in lengths], dtype=dtype)

    def masked_loss(out):  # each sample's, over its own positions
        return (out.pow(2).sum(-1) * mask).sum(1)

    with psh.add_hooks(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (nested tensors are a prototype of torch)
            out = model(torch.nested.nested_tensor(sequences, layout=layout))
        torch.stack([o.pow(2).sum() for o in out.unbind()]).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"compute_grad1: '0' was called on "
                           r"a nested \(ragged\) tensor.*to_padded_tensor"):
            psh.compute_grad1(model)
        padded = torch.nested.to_padded_tensor(torch.nested.nested_tensor(sequences), 0.0)
        reference = copy.deepcopy(model).double()  # each sample alone, unpadded, in float64
        rows = [torch.autograd.grad(reference(x[None].double()).pow(2).sum(),
                                    list(reference.parameters())) for x in sequences]
        expected = {n: torch.stack([row[k] for row in rows])
                    for k, (n, _) in enumerate(reference.named_parameters())}
        model.zero_grad(set_to_none=True)
        masked_loss(model(padded)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))
