"""Built-in rules, one file per layer family. Importing this package registers them."""
from . import (  # noqa: F401
    attention,
    conv,
    conv_transpose,
    embedding,
    hf_conv1d,
    hf_rmsnorm,
    linear,
    normalization,
    recurrent,
)
from .base import Rule, RuleRegistry, default_registry, register_rule

__all__ = ["Rule", "RuleRegistry", "default_registry", "register_rule"]
