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

Registered by name (importing per_sample_hooks does not import transformers) for every class of
transformers 5.x whose ``forward`` is this one token for token (:data:`LLAMA_RMS_NORMS`). Left
to the fallback, since their code or their math differs: the product before the cast,
``(weight * x32).to(dtype)`` (OLMo 2/3, FlexOlmo, GPT-OSS, AFMoE, DeepSeek-V4); the weight cast
to float32 (Helium, Nemotron-H); ``1 + weight`` (Gemma 1-3, Qwen3-Next, Qwen3.5, T5Gemma); an
``eps`` attribute and a ``_norm`` method (Gemma 3n/4, Llama 4, Moshi); T5's, the scaling in the
input's dtype and the cast by the weight's (T5, mT5, UMT5, LongT5, IDEFICS); gated and
unweighted variants.

A name says nothing about what the class computes in the transformers version at hand, and the
forward that runs may not be the class's: transformers' ``use_kernel_forward_from_hub("RMSNorm")``
leaves the class as it is but lets ``kernels.kernelize`` (``from_pretrained(...,
use_kernels=True)``) replace ``forward`` on each module by a hub kernel's (Liger's RMSNorm on
CUDA). :meth:`LlamaRMSNormRule.check` therefore compares the code the module runs with
:func:`llama_rms_norm_forward` and refuses any other.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import Call
from ..errors import PerSampleHooksError
from .base import register_rule
from .normalization import AffineNormRule

LLAMA_RMS_NORMS = (
    "aimv2:Aimv2RMSNorm", "apertus:ApertusRMSNorm", "arcee:ArceeRMSNorm", "aria:AriaTextRMSNorm",
    "axk1:AXK1RMSNorm", "axk2:AXK2RMSNorm", "bailing_hybrid:BailingHybridRMSNorm",
    "bamba:BambaRMSNorm", "bitnet:BitNetRMSNorm", "blt:BltRMSNorm", "chameleon:ChameleonRMSNorm",
    "clvp:ClvpRMSNorm", "cohere2_moe:Cohere2MoeRMSNorm", "cosmos3_edge:Cosmos3EdgeTextRMSNorm",
    "csm:CsmRMSNorm", "cwm:CwmRMSNorm", "deepseek_ocr2:DeepseekOcr2TextRMSNorm",
    "deepseek_ocr2:DeepseekOcr2VisionRMSNorm", "deepseek_v2:DeepseekV2RMSNorm",
    "deepseek_v32:DeepseekV32RMSNorm", "deepseek_v3:DeepseekV3RMSNorm", "deimv2:Deimv2RMSNorm",
    "dia:DiaRMSNorm", "diffllama:DiffLlamaRMSNorm", "doge:DogeRMSNorm", "dots1:Dots1RMSNorm",
    "dots3_note:Dots3NoteRMSNorm", "emu3:Emu3RMSNorm", "ernie4_5:Ernie4_5RMSNorm",
    "ernie4_5_moe:Ernie4_5_MoeRMSNorm", "ernie4_5_vl_moe:Ernie4_5_VLMoeRMSNorm",
    "eurobert:EuroBertRMSNorm", "evolla:EvollaRMSNorm", "exaone4:Exaone4RMSNorm",
    "exaone4_5:Exaone4_5_RMSNorm", "exaone_moe:ExaoneMoeRMSNorm", "falcon_h1:FalconH1RMSNorm",
    "falcon_mamba:FalconMambaRMSNorm", "glm4:Glm4RMSNorm", "glm4_moe:Glm4MoeRMSNorm",
    "glm4_moe_lite:Glm4MoeLiteRMSNorm", "glm4v:Glm4vRMSNorm", "glm4v_moe:Glm4vMoeRMSNorm",
    "glm4v_moe:Glm4vMoeTextRMSNorm", "glm5_next:Glm5NextRMSNorm", "glm5_next:Glm5NextTextRMSNorm",
    "glm:GlmRMSNorm", "glm_image:GlmImageRMSNorm", "glm_moe_dsa:GlmMoeDsaRMSNorm",
    "glm_ocr:GlmOcrRMSNorm", "granite4_vision:Granite4VisionTextRMSNorm", "granite:GraniteRMSNorm",
    "granite_docling:GraniteDoclingTextRMSNorm", "granite_swa:GraniteSWARMSNorm",
    "granitemoe:GraniteMoeRMSNorm", "granitemoe_swa:GraniteMoeSWARMSNorm",
    "granitemoehybrid:GraniteMoeHybridRMSNorm", "granitemoeshared:GraniteMoeSharedRMSNorm",
    "higgs_audio_v2:HiggsAudioV2RMSNorm", "hunyuan_v1_dense:HunYuanDenseV1RMSNorm",
    "hunyuan_v1_moe:HunYuanMoEV1RMSNorm", "hunyuan_vl:HunYuanVLRMSNorm", "hy_v3:HYV3RMSNorm",
    "hy_v4:HYV4RMSNorm", "hyperclovax:HyperCLOVAXRMSNorm", "idefics2:Idefics2RMSNorm",
    "idefics3:Idefics3RMSNorm", "inkling:InklingRMSNorm", "internvl:InternVLVisionRMSNorm",
    "jamba:JambaRMSNorm", "jetmoe:JetMoeRMSNorm", "kimi_linear:KimiLinearRMSNorm",
    "kolibri1:Kolibri1RMSNorm", "laguna:LagunaRMSNorm", "lfm2:Lfm2RMSNorm",
    "lfm2_moe:Lfm2MoeRMSNorm", "lfm3:Lfm3RMSNorm", "lfm3_vl:Lfm3VlVisionRMSNorm",
    "lighton_ocr:LightOnOcrRMSNorm", "llama:LlamaRMSNorm", "longcat_flash:LongcatFlashRMSNorm",
    "mamba2:Mamba2RMSNorm", "mamba:MambaRMSNorm", "mellum:MellumRMSNorm",
    "mimo_v2_flash:MiMoV2FlashRMSNorm", "minicpm3:MiniCPM3RMSNorm", "minimax:MiniMaxRMSNorm",
    "minimax_m2:MiniMaxM2RMSNorm", "ministral3:Ministral3RMSNorm", "ministral:MinistralRMSNorm",
    "mistral3:Mistral3RMSNorm", "mistral4:Mistral4RMSNorm", "mistral:MistralRMSNorm",
    "mistral_large4:MistralLarge4RMSNorm", "mixtral:MixtralRMSNorm", "mllama:MllamaTextRMSNorm",
    "molmo2:Molmo2RMSNorm", "muse_glimmer_assistant:MuseGlimmerAssistantRMSNorm",
    "neucodec:NeuCodecRMSNorm", "olmoe:OlmoeRMSNorm", "ovis2:Ovis2RMSNorm",
    "paddleocr_vl:PaddleOCRRMSNorm", "pe_audio:PeAudioEncoderRMSNorm",
    "pe_audio_video:PeAudioVideoEncoderRMSNorm", "pe_video:PeVideoEncoderRMSNorm",
    "phi3:Phi3RMSNorm", "phi4_multimodal:Phi4MultimodalRMSNorm", "pixtral:PixtralRMSNorm",
    "qianfan_ocr:QianfanOCRVisionRMSNorm", "qwen2:Qwen2RMSNorm", "qwen2_5_omni:Qwen2_5OmniRMSNorm",
    "qwen2_5_vl:Qwen2_5_VLRMSNorm", "qwen2_moe:Qwen2MoeRMSNorm", "qwen2_vl:Qwen2VLRMSNorm",
    "qwen3:Qwen3RMSNorm", "qwen3_moe:Qwen3MoeRMSNorm",
    "qwen3_omni_moe:Qwen3OmniMoeCode2WavRMSNorm", "qwen3_omni_moe:Qwen3OmniMoeRMSNorm",
    "qwen3_omni_moe:Qwen3OmniMoeTextRMSNorm", "qwen3_omni_moe:Qwen3OmniMoeThinkerTextRMSNorm",
    "qwen3_vl:Qwen3VLTextRMSNorm", "qwen3_vl_moe:Qwen3VLMoeTextRMSNorm",
    "sapiens2:Sapiens2RMSNorm", "seed_oss:SeedOssRMSNorm", "smollm3:SmolLM3RMSNorm",
    "solar_open:SolarOpenRMSNorm", "timesfm2_5:TimesFm2_5RMSNorm", "timesfm:TimesFmRMSNorm",
    "ultrabert:UltrabertRMSNorm", "ultravbert:UltraVBertRMSNorm",
    "unlimited_ocr:UnlimitedOcrTextRMSNorm", "vibevoice:VibeVoiceRMSNorm",
    "vibevoice_acoustic_tokenizer:VibeVoiceAcousticTokenizerRMSNorm",
    "vibevoice_asr:VibeVoiceAsrRMSNorm", "voxtral_realtime:VoxtralRealtimeRMSNorm",
    "xcodec2:Xcodec2RMSNorm", "youtu:YoutuRMSNorm", "zamba2:Zamba2RMSNorm", "zamba:ZambaRMSNorm",
    "zaya:ZayaRMSNorm",
)
"""``"package:Class"``: the class ``Class`` of ``transformers.models.package.modeling_package``
(transformers 5.23; a name missing from another version is never matched)."""


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


def runs(module: nn.Module, function: Callable) -> bool:
    """Whether calling ``module`` runs ``function``'s code: not when its ``forward`` was
    replaced on the module (``kernels.kernelize``) or its class's is other code. Wrappers that
    keep the original as ``__wrapped__`` (accelerate's device hooks) are looked through."""
    forward = getattr(inspect.unwrap(module.forward), "__func__", None)
    return hasattr(forward, "__code__") and compiled(forward) == compiled(function)


class LlamaRMSNormRule(AffineNormRule):
    channels_first = False

    def normalize(self, module: nn.Module, call: Call, x: Tensor) -> Tensor:
        # the forward's float32 numbers, bitwise on CPU (torch 2.13); rounding elsewhere
        return F.rms_norm(x.to(torch.float32), x.shape[-1:], None,
                          module.variance_epsilon).to(x.dtype)

    def check(self, module: nn.Module, calls: Sequence[Call], name: str) -> None:
        if not runs(module, llama_rms_norm_forward):
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) does not run the forward its rule is exact "
                "for, transformers' weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + "
                "variance_epsilon)).to(x.dtype): its forward was replaced on the module (a hub "
                "kernel: kernels.kernelize, from_pretrained(..., use_kernels=True)) or differs in "
                "this transformers version. Load the model without use_kernels, or pass "
                f"add_hooks(model, units=['{name}']) to use the torch.func fallback for it")


def qualified(entry: str) -> str:
    """``"package:Class"`` -> ``"transformers.models.package.modeling_package:Class"``."""
    package, _, name = entry.partition(":")
    return f"transformers.models.{package}.modeling_{package}:{name}"


_rule = LlamaRMSNormRule()
for _entry in LLAMA_RMS_NORMS:
    register_rule(qualified(_entry))(_rule)
