"""per_sample_hooks: per-sample gradients and friends for unchanged ``nn.Module``s, via hooks."""
from . import clipping, distributed, dp, optim  # noqa: F401  (psh.clipping.*, psh.dp.*, ...)
from .api import (
    add_hooks,
    clear_backprops,
    compute_grad1,
    disable_hooks,
    enable_hooks,
    is_supported,
    per_sample_parameters,
    remove_hooks,
)
from .capture import Call, HookState
from .curvature import (
    KFACFactors,
    backprop_hess,
    compute_fisher_diag,
    compute_grad_variance,
    compute_gram,
    compute_hess,
    compute_kfac,
)
from .dp import DPSGD
from .errors import PerSampleHooksError, UnsupportedModuleError
from .forms import Dense, Outer, Rows, Unfolded
from .forms.groups import JointGroups
from .hessian import batch_hessian
from .norms import clip_grads, compute_norms
from .rules import Rule, RuleRegistry, register_rule
from .rules.conv import conv_output_grads, conv_patches, conv_weight_factors
from .rules.conv_transpose import (
    conv_transpose_inputs,
    conv_transpose_patches,
    conv_transpose_weight_factors,
)
from .rules.fallback import FallbackRule, Layout, register_layout

__version__ = "0.2.0"

__all__ = [
    "add_hooks", "remove_hooks", "disable_hooks", "enable_hooks", "is_supported",
    "clear_backprops", "compute_grad1", "per_sample_parameters", "register_rule", "Rule",
    "RuleRegistry", "Call", "HookState", "PerSampleHooksError", "UnsupportedModuleError",
    "conv_patches", "conv_output_grads", "conv_weight_factors", "conv_transpose_patches",
    "conv_transpose_inputs", "conv_transpose_weight_factors",
    "FallbackRule", "Layout", "register_layout", "Outer", "Rows", "Dense", "Unfolded",
]
__all__ += ["compute_norms", "clip_grads", "DPSGD", "JointGroups"]
__all__ += ["clipping", "dp", "distributed", "optim", "batch_hessian"]
__all__ += ["backprop_hess", "compute_hess", "compute_kfac", "KFACFactors",
            "compute_fisher_diag", "compute_grad_variance", "compute_gram"]
