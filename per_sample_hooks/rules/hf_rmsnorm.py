"""Hugging Face transformers' RMSNorm of Llama and of the models built like it (Mistral, Qwen2,
Qwen3, Phi-3, Granite, DeepSeek-V3, ...): ``weight [H]``, input ``[B, *, H]``::

    y = weight * (x32 * rsqrt(mean(x32 ** 2, -1) + variance_epsilon)).to(x.dtype)
    x32 = x.to(float32)

``torch.nn.RMSNorm``'s normalization computed in float32 (also for a float64 input) and cast
back to the input's dtype, times the weight: per-sample weight gradient ``sum over positions of
g * x_hat`` (:class:`~per_sample_hooks.rules.normalization.AffineNormRule`), ``x_hat``
recomputed the same way from the captured input. Under autocast (a bfloat16 input, float32
weight) the captures reach the rule converted to float32 (``step``), so ``x_hat`` is not rounded
to bfloat16 as the forward's is: a difference of bfloat16 rounding, within the autocast tolerance
of ``tests/test_dtypes.py``.

Registered for every class whose ``forward`` is transformers' ``LlamaRMSNorm.forward`` token
for token (:func:`is_llama_rms_norm`): 140 classes of transformers 5.23, those of models added
since, and verbatim copies in a user's code; importing per_sample_hooks does not import
transformers. Left to the fallback, since their code or their math differs: the product before
the cast, ``(weight * x32).to(dtype)`` (OLMo 2/3, FlexOlmo, GPT-OSS, AFMoE, DeepSeek-V4); the
weight cast to float32 (Helium, Nemotron-H); ``1 + weight`` (Gemma 1-3, Qwen3-Next, Qwen3.5,
T5Gemma); an ``eps`` attribute and a ``_norm`` method (Gemma 3n/4, Llama 4, Moshi); T5's, the
scaling in the input's dtype and the cast by the weight's (T5, mT5, UMT5, LongT5, IDEFICS);
gated and unweighted variants.

The forward that runs may not be the class's: transformers' ``use_kernel_forward_from_hub(
"RMSNorm")`` leaves the class as it is but lets ``kernels.kernelize`` (``from_pretrained(...,
use_kernels=True)``) replace ``forward`` on each module by a hub kernel's (Liger's RMSNorm on
CUDA). :meth:`LlamaRMSNormRule.check` therefore compares the code the module runs with
:func:`llama_rms_norm_forward` and refuses any other.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from .base import register_rule
from .normalization import AffineNormRule


# transformers' ``LlamaRMSNorm.forward``, verbatim: the code the rule is exact for (no docstring:
# it would be one of the code's constants)
def llama_rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def compiled(function: Callable) -> tuple:
    """What ``function`` computes, as compiled: bytecode, constants, global and local names
    (not its file, line numbers or annotations)."""
    code = function.__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_argcount


def same_code(function: Callable, reference: Callable) -> bool:
    """Whether ``function`` (a function or a bound method) is ``reference``'s code. Wrappers
    that keep the original as ``__wrapped__`` (accelerate's device hooks) are looked through."""
    function = inspect.unwrap(function)
    function = getattr(function, "__func__", function)
    return hasattr(function, "__code__") and compiled(function) == compiled(reference)


def runs(module: nn.Module, function: Callable) -> bool:
    """Whether calling ``module`` runs ``function``'s code: not when its ``forward`` was
    replaced on the module (``kernels.kernelize``) or its class's is other code."""
    return same_code(module.forward, function)


def is_llama_rms_norm(module_type: type) -> bool:
    """Whether the class's ``forward`` is transformers' ``LlamaRMSNorm.forward``, token for
    token: the classes the rule is registered for."""
    return same_code(module_type.forward, llama_rms_norm_forward)


class LlamaRMSNormRule(AffineNormRule):
    channels_first = False

    def normalize(self, module: nn.Module, call: Call, x: Tensor) -> Tensor:
        # the forward's own ops, so its float32 numbers on every device (F.rms_norm's
        # fused CUDA kernel rounds otherwise: 2e-5 relative in a float64 model's gradients)
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return (x32 * torch.rsqrt(variance + module.variance_epsilon)).to(x.dtype)

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        super().check(module, calls, name)
        if not runs(module, llama_rms_norm_forward):
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) does not run the forward its rule is exact "
                "for, transformers' weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + "
                "variance_epsilon)).to(x.dtype): its forward was replaced on the module (a hub "
                "kernel: kernels.kernelize, from_pretrained(..., use_kernels=True)). Load the "
                "model without use_kernels, or pass "
                f"add_hooks(model, units=['{name}']) to use the torch.func fallback for it")


register_rule(is_llama_rms_norm)(LlamaRMSNormRule())
