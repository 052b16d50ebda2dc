"""Each form's quantities (per-sample gradients, squared norms, weighted sums) against the
dense per-sample tensor it describes, float64; several forms of one kind (joined) and a mix of
kinds (a parameter shared by modules of different families: its norms carry the cross terms)."""
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ground_truth import seeded
from per_sample_hooks import forms
from per_sample_hooks.forms import Dense, Outer, Rows, Unfolded


def dense_of(form, batch):
    """The ``[B, n]`` per-sample gradients a form describes, by the definition."""
    if isinstance(form, Dense):
        return form.per_sample.reshape(batch, -1)
    if isinstance(form, Rows):
        out = torch.zeros(batch, form.num_rows, form.values.shape[1], dtype=torch.double)
        out.index_put_((form.samples, form.rows), form.values, accumulate=True)
        return out.reshape(batch, -1)
    if form.acts is None:
        return form.grads.sum(2).reshape(batch, -1)
    return torch.einsum("bjtp,bjtd->bjpd", form.grads, form.acts).reshape(batch, -1)


@st.composite
def form_lists(draw):
    """A parameter's forms: ``batch``, ``[forms]``, the per-sample size ``n``, and its first
    dim ``n0`` (the parameter is ``[n0, n / n0]``: ``[groups * p, d]``, a bias ``[groups * p]``)."""
    batch = draw(st.integers(1, 4))
    g = seeded(draw(st.integers(0, 1000)))
    kinds = draw(st.lists(st.sampled_from(["outer", "bias", "rows", "dense"]), min_size=1,
                          max_size=3))
    groups, p, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n = groups * p * d
    if "bias" in kinds:
        kinds = ["bias"] * len(kinds)  # a bias and a weight are different parameters
        n = groups * p
    result = []
    for kind in kinds:
        if kind in ("outer", "bias"):
            positions = draw(st.integers(1, 4))
            grads = torch.randn(batch, groups, positions, p, generator=g, dtype=torch.double)
            acts = None if kind == "bias" else torch.randn(batch, groups, positions, d,
                                                           generator=g, dtype=torch.double)
            result.append(Outer(grads, acts))
        elif kind == "rows":  # the n numbers seen as [n / w, w]
            width = draw(st.sampled_from([w for w in (1, d) if n % w == 0]))
            entries = draw(st.integers(0, 6))
            result.append(Rows(torch.randint(batch, (entries,), generator=g),
                               torch.randint(n // width, (entries,), generator=g),
                               torch.randn(entries, width, generator=g, dtype=torch.double),
                               n // width))
        else:
            result.append(Dense(torch.randn(batch, n, generator=g, dtype=torch.double)))
    return batch, result, n, groups * p


@settings(max_examples=150, deadline=None)
@given(case=form_lists(), scale=st.sampled_from([1.0, 0.5, 3.0]))
def test_forms_against_their_dense_gradients(case, scale):
    batch, parts, n, n0 = case
    expected = sum(dense_of(f, batch) for f in parts)
    out = torch.full((batch, n), float("nan"), dtype=torch.double)
    forms.write(out, parts, scale)
    torch.testing.assert_close(out, scale * expected)
    torch.testing.assert_close(forms.norms_squared(parts, batch), expected.pow(2).sum(1))
    weights = torch.rand(batch, dtype=torch.double)
    total = torch.full((n,), float("nan"), dtype=torch.double)
    forms.weighted_sum(total, parts, weights)
    torch.testing.assert_close(total, weights @ expected)
    u = torch.randn(3, n0, dtype=torch.double)
    v = torch.randn(3, n // n0, dtype=torch.double)
    torch.testing.assert_close(forms.project_sum(parts, (u, v)),
                               torch.einsum("kn,nd,kd->k", u, expected.sum(0).view(n0, -1), v))


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), groups=st.integers(1, 2), positions=st.integers(1, 3),
       p=st.integers(1, 3), d=st.integers(1, 3), seed=st.integers(0, 100))
def test_projection_of_a_matrix_parameter(batch, groups, positions, p, d, seed):
    """An outer product (and the same gradient as rows [groups * p, d] and dense), projected
    on probes of the parameter seen as [groups * p, d]."""
    g = seeded(seed)
    outer = Outer(torch.randn(batch, groups, positions, p, generator=g, dtype=torch.double),
                  torch.randn(batch, groups, positions, d, generator=g, dtype=torch.double))
    dense = dense_of(outer, batch)
    samples, cells = torch.meshgrid(torch.arange(batch), torch.arange(groups * p), indexing="ij")
    rows = Rows(samples.flatten(), cells.flatten(), dense.view(batch * groups * p, d),
                groups * p)
    u = torch.randn(4, groups * p, generator=g, dtype=torch.double)
    v = torch.randn(4, d, generator=g, dtype=torch.double)
    expected = torch.einsum("kn,nd,kd->k", u, dense.sum(0).view(groups * p, d), v)
    for form in (outer, rows, Dense(dense)):
        torch.testing.assert_close(forms.project_sum([form], (u, v)), expected)



@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       lengths=st.lists(st.integers(1, 4), min_size=3, max_size=3), d=st.integers(1, 3),
       calls=st.integers(1, 2), bias=st.booleans(), seed=st.integers(0, 100))
def test_blocks_of_rows(batch, sizes, lengths, d, calls, bias, seed):
    """Outer forms of disjoint row blocks (attention's query, key and value rows, each with
    its own positions), from one or two calls, against the dense gradient."""
    g = seeded(seed)
    n0 = sum(sizes)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    parts, expected = [], torch.zeros(batch, n0, 1 if bias else d, dtype=torch.double)
    for _ in range(calls):
        for (start, stop), length in zip(zip(bounds, bounds[1:]), lengths):
            grads = torch.randn(batch, 1, length, stop - start, generator=g, dtype=torch.double)
            acts = None if bias else torch.randn(batch, 1, length, d, generator=g,
                                                 dtype=torch.double)
            form = Outer(grads, acts, slice(start, stop))
            parts.append(form)
            expected[:, start:stop] += dense_of(form, batch).view(batch, stop - start, -1)
    expected = expected.reshape(batch, -1)
    out = torch.full_like(expected, float("nan"))
    forms.write(out, parts, 2.0)
    torch.testing.assert_close(out, 2 * expected)
    torch.testing.assert_close(forms.norms_squared(parts, batch), expected.pow(2).sum(1))
    weights = torch.rand(batch, generator=g, dtype=torch.double)
    total = torch.full((expected.shape[1],), float("nan"), dtype=torch.double)
    forms.weighted_sum(total, parts, weights)
    torch.testing.assert_close(total, weights @ expected)
    u = torch.randn(3, n0, generator=g, dtype=torch.double)
    v = torch.randn(3, expected.shape[1] // n0, generator=g, dtype=torch.double)
    torch.testing.assert_close(forms.project_sum(parts, (u, v)),
                               torch.einsum("kn,nd,kd->k", u, expected.sum(0).view(n0, -1), v))


def lazily(acts, elements, built, projects):
    """``acts`` as :class:`Unfolded`: each chunk a transposed view of a fresh copy (as conv
    patches are), its number of samples recorded in ``built``; a projection of its own when
    ``projects``."""
    def build(start, stop):
        built.append(stop - start)
        return acts[start:stop].transpose(2, 3).contiguous().transpose(2, 3)
    project = (lambda v: v @ acts.mT) if projects else None
    return Unfolded(build, acts.shape[3], elements, project)


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 5), groups=st.integers(1, 3),
       lengths=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       p=st.sampled_from([1, 2, 3, 8]), d=st.sampled_from([1, 2, 3, 8]),
       lazy=st.lists(st.booleans(), min_size=3, max_size=3),
       elements=st.integers(1, 80), extra=st.sampled_from([None, "bias", "dense"]),
       projects=st.booleans(), scale=st.sampled_from([1.0, 0.5]), seed=st.integers(0, 1000))
@example(batch=3, groups=2, lengths=[2], p=8, d=8, lazy=[True] * 3, elements=40, extra=None,
         projects=False, scale=1.0, seed=0)  # the ghost norm, one call
@example(batch=3, groups=1, lengths=[1, 2], p=8, d=8, lazy=[True, False, True], elements=20,
         extra=None, projects=True, scale=0.5, seed=1)  # the ghost norm, lazy and tensor acts
def test_unfolded_acts(batch, groups, lengths, p, d, lazy, elements, extra, projects, scale,
                       seed):
    """Outer forms whose activations are built a chunk of samples at a time (conv patches),
    from one or several calls, some lazy and some not, alone or with a bias-like or dense
    form (mixed kinds), over each norm method: every quantity against the dense gradient, and
    no chunk holding more than ``elements`` numbers (or one sample)."""
    g = seeded(seed)
    lazy[0] = True
    parts, built, expected = [], [], 0
    for length, is_lazy in zip(lengths, lazy):
        grads = torch.randn(batch, groups, length, p, generator=g, dtype=torch.double)
        acts = torch.randn(batch, groups, length, d, generator=g, dtype=torch.double)
        expected = expected + dense_of(Outer(grads, acts), batch)
        if is_lazy:
            built.append(([], groups * length * d))
            acts = lazily(acts, elements, built[-1][0], projects)
        parts.append(Outer(grads, acts))
    n = groups * p * d
    if extra == "dense":
        dense = torch.randn(batch, n, generator=g, dtype=torch.double)
        parts.append(Dense(dense))
        expected = expected + dense
    elif extra == "bias":  # a gradient of p * d rows of one position each: the same size
        bias = Outer(torch.randn(batch, 1, 2, n, generator=g, dtype=torch.double))
        parts.append(bias)
        expected = expected + dense_of(bias, batch)
    out = torch.full((batch, n), float("nan"), dtype=torch.double)
    forms.write(out, parts, scale)
    torch.testing.assert_close(out, scale * expected)
    torch.testing.assert_close(forms.norms_squared(parts, batch), expected.pow(2).sum(1))
    weights = torch.rand(batch, generator=g, dtype=torch.double)
    total = torch.full((n,), float("nan"), dtype=torch.double)
    forms.weighted_sum(total, parts, weights)
    torch.testing.assert_close(total, weights @ expected)
    u = torch.randn(3, groups * p, generator=g, dtype=torch.double)
    v = torch.randn(3, d, generator=g, dtype=torch.double)
    if extra != "bias":  # a bias-like form is not a [groups * p, d] matrix
        torch.testing.assert_close(
            forms.project_sum(parts, (u, v)),
            torch.einsum("kn,nd,kd->k", u, expected.sum(0).view(groups * p, d), v))
    for sizes, per_sample in built:
        assert sizes and max(sizes) <= max(1, elements // per_sample)
