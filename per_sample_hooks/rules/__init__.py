"""Built-in rules, one file per layer family. Importing this package registers them."""
from . import (
    conv,  # noqa: F401
    conv_transpose,  # noqa: F401
    linear,  # noqa: F401
    recurrent,  # noqa: F401
)
from .base import Rule, RuleRegistry, default_registry, register_rule

__all__ = ["Rule", "RuleRegistry", "default_registry", "register_rule"]
