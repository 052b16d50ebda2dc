"""Built-in rules, one file per layer family. Importing this package registers them."""
from . import attention, conv, conv_transpose, embedding, linear, normalization, recurrent  # noqa: F401
from .base import Rule, RuleRegistry, default_registry, register_rule

__all__ = ["Rule", "RuleRegistry", "default_registry", "register_rule"]
