"""Forms: how a layer's per-sample gradient is built, and every quantity computed once per form.

Rules (:mod:`per_sample_hooks.rules`) describe each parameter's per-sample gradient as forms
(:mod:`.core`: :class:`Outer`, :class:`Rows`, :class:`Dense`); this package computes from them
per-sample gradients, squared norms (:mod:`.ghost` for outer products over positions), weighted
sums, the unseen-use check's projections (:mod:`.core`), second moments, Gram matrices and
Gauss-Newton blocks (:mod:`.second_order`) and Kronecker factors (:mod:`.kronecker`). It knows
nothing about hooks, modules or the check's policy.
"""
from .core import (
    Dense,
    Form,
    Outer,
    Rows,
    Unfolded,
    act_chunks,
    by_parameter,
    contract_samples,
    join,
    materializes,
    moment_dtype,
    norms_squared,
    one_group,
    project_sum,
    projection_cost,
    weighted_sum,
    write,
)
from .ghost import sum_of_squares

__all__ = ["Dense", "Form", "Outer", "Rows", "Unfolded", "act_chunks", "by_parameter",
           "contract_samples", "join", "materializes", "moment_dtype", "norms_squared", "one_group",
           "project_sum", "projection_cost", "sum_of_squares", "weighted_sum", "write"]
