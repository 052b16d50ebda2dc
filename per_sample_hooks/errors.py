"""Exceptions raised by per_sample_hooks. Every message names the module or parameter at fault."""


class PerSampleHooksError(RuntimeError):
    """Per-sample quantities cannot be computed exactly; the message says why and what to do."""


class UnsupportedModuleError(PerSampleHooksError, TypeError):
    """A module with trainable parameters has no rule."""
