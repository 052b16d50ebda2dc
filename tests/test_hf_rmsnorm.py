"""transformers' Llama-style RMSNorm classes: their rule against the float64 loop, each class,
and a tiny LlamaForCausalLM with no fallback unit; the forward guard (hub kernels, other code)."""
import functools
import importlib
from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from norms_truth import assert_clipping_matches, assert_float32_matches, assert_norms_match
from test_clipping import KEEP_FRACTIONS, keep_fraction
from test_dtypes import AUTOCAST_RTOL, BF16_RTOL, DEVICE_TYPE, relative_error
from torch import nn

import per_sample_hooks as psh
from ground_truth import assert_matches_loop, loop_grads, sum_of_outputs, weighted_square
from per_sample_hooks.errors import PerSampleHooksError
from per_sample_hooks.rules import default_registry
from per_sample_hooks.rules.hf_rmsnorm import LlamaRMSNormRule, llama_rms_norm_forward, runs

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

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
"""``"package:Class"``: the classes of transformers 5.23 whose forward is LlamaRMSNorm's, token
for token (``transformers.models.package.modeling_package``): each must be recognized."""

OTHER_RMS_NORMS = ("gemma:GemmaRMSNorm", "olmo2:Olmo2RMSNorm", "t5:T5LayerNorm",
                   "llama4:Llama4TextRMSNorm", "helium:HeliumRMSNorm")
"""Classes whose forward is other code or other math: left to the fallback."""


def qualified(entry: str) -> str:
    """``"package:Class"`` -> ``"transformers.models.package.modeling_package:Class"``."""
    package, _, name = entry.partition(":")
    return f"transformers.models.{package}.modeling_{package}:{name}"


def resolve(entry: str) -> type[nn.Module] | None:
    """The class an entry of LLAMA_RMS_NORMS names, or None if this transformers lacks it."""
    path, _, name = qualified(entry).partition(":")
    try:
        return getattr(importlib.import_module(path), name, None)
    except ImportError:
        return None


def randomized(norm: nn.Module) -> nn.Module:
    """A random weight (it starts at 1)."""
    with torch.no_grad():
        norm.weight.normal_()
    return norm


def normed(norm: nn.Module, hidden: int) -> nn.Module:
    """The norm, then a Linear and tanh. The norm comes first: a gradient that passes through it
    is rounded to float32 (its forward computes in float32, even in a float64 model), so below
    it a mean loss's ``1/B`` rounds otherwise than in the per-sample loop (relative 1e-7; see
    :func:`test_llama_matches_the_loop`). Its own weight's gradient is exact either way."""
    return nn.Sequential(randomized(norm), nn.Linear(hidden, hidden), nn.Tanh())


class Twice(nn.Module):
    """The norm applied twice in one forward: contributions add up."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = randomized(LlamaRMSNorm(hidden))

    def forward(self, x):
        return self.norm(torch.sin(self.norm(x)) * x)


def test_every_llama_style_class_is_recognized_and_no_other():
    """Each class whose forward is the rule's code gets the rule, found by that code, not by
    its name; classes with other code are left to the fallback."""
    classes = {entry: resolve(entry) for entry in LLAMA_RMS_NORMS}
    present = {entry: cls for entry, cls in classes.items() if cls is not None}
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert len(present) >= 100, sorted(set(classes) - set(present))
    assert not [e for e, cls in present.items() if not runs(cls(4), llama_rms_norm_forward)]
    assert all(isinstance(default_registry.lookup(cls(4)), LlamaRMSNormRule)
               for cls in present.values())
    others = [cls for cls in map(resolve, OTHER_RMS_NORMS) if cls is not None]
    assert others and all(default_registry.lookup(cls(4)) is None for cls in others)


def test_a_verbatim_copy_in_user_code_is_recognized():
    """Recognized by the code it runs: a user's copy of the class, under another name."""
    class MyRMSNorm(nn.Module):
        def __init__(self, hidden, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden))
            self.variance_epsilon = eps

        forward = llama_rms_norm_forward

    torch.manual_seed(0)
    model = nn.Sequential(MyRMSNorm(5, 1e-3), nn.Linear(5, 5), nn.Tanh())
    assert isinstance(default_registry.lookup(model[0]), LlamaRMSNormRule)
    assert psh.is_supported(model[0], fallback=False)
    assert_matches_loop(model, [torch.randn(3, 2, 5)])
    assert_float32_matches(model.float(), [torch.randn(4, 5)], 0.5)


@pytest.mark.parametrize("entry", LLAMA_RMS_NORMS)
def test_each_class_matches_the_loop(entry):
    """grad1, norms and clipping, float64 and float32, with leading dims, for every class."""
    cls = resolve(entry)
    if cls is None:
        pytest.skip(f"{entry} is not in transformers {transformers.__version__}")
    torch.manual_seed(0)
    model = normed(cls(5, eps=1e-3), 5)
    x = torch.randn(3, 2, 5)
    assert_matches_loop(model, [x])
    assert_norms_match(model, [x], loss_type="sum")
    assert_clipping_matches(model, [x], 0.3)
    assert_float32_matches(model.float(), [torch.randn(4, 5)], 0.5)


GRID = dict(batch=st.integers(1, 4), leading=st.lists(st.integers(1, 3), max_size=2),
            hidden=st.integers(1, 6), eps=st.sampled_from([1e-6, 1e-2]),
            loss_type=st.sampled_from(["mean", "sum"]))


def llama_norm(hidden: int, eps: float) -> nn.Module:
    torch.manual_seed(0)
    return normed(LlamaRMSNorm(hidden, eps=eps), hidden)


@settings(max_examples=25, deadline=None)
@given(**GRID)
def test_grad1(batch, leading, hidden, eps, loss_type):
    assert_matches_loop(llama_norm(hidden, eps), [torch.randn(batch, *leading, hidden)],
                        loss_type=loss_type)


@settings(max_examples=25, deadline=None)
@given(**GRID)
def test_norms(batch, leading, hidden, eps, loss_type):
    assert_norms_match(llama_norm(hidden, eps), [torch.randn(batch, *leading, hidden)],
                       loss_type=loss_type)


@settings(max_examples=25, deadline=None)
@given(**GRID, max_norm=st.sampled_from([1e-3, 0.5, 1e6]), keep=st.sampled_from(KEEP_FRACTIONS))
def test_clipping(batch, leading, hidden, eps, loss_type, max_norm, keep):
    with keep_fraction(keep):
        assert_clipping_matches(llama_norm(hidden, eps), [torch.randn(batch, *leading, hidden)],
                                max_norm, loss_type=loss_type)


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 4), (2, 3, 2, 4)])
def test_float32(loss_type, shape):
    torch.manual_seed(1)
    assert_float32_matches(llama_norm(4, 1e-6), [torch.randn(*shape)], 0.5, loss_type=loss_type)


@pytest.mark.parametrize("autocast", [False, True])
def test_bfloat16(autocast):
    """bfloat16 parameters and input (``x_hat`` rounded to bfloat16 as the forward does), or a
    bfloat16 autocast forward of float32 parameters (the norm sees a bfloat16 input and its
    quantities come out in float32): within the tolerances of test_dtypes, against the float64
    loop on the same weights and input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), randomized(LlamaRMSNorm(6)), nn.Linear(6, 3))
    x = torch.randn(5, 4, 6)
    dtype = torch.float32 if autocast else torch.bfloat16
    model, x = model.to(dtype), x.to(torch.bfloat16).to(dtype)
    with psh.add_hooks(model), torch.autocast(DEVICE_TYPE, torch.bfloat16, enabled=autocast):
        out = model(x)
        assert out.dtype == torch.bfloat16
        weighted_square(out.float()).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    assert all(g.dtype == dtype for g in got.values())
    tolerance = AUTOCAST_RTOL if autocast else BF16_RTOL
    expected = loop_grads(model.double(), [x.double()], weighted_square, len(x))
    for n in expected:
        error = relative_error(got[n], expected[n])
        assert error < tolerance, f"{n}: relative error {error:.2e}"
    expected_norms = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    assert relative_error(norms, expected_norms) < tolerance


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_reuse(loss_type):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5)
    assert_matches_loop(Twice(5), [x], loss_type=loss_type)
    assert_norms_match(Twice(5), [x], loss_type=loss_type)
    assert_clipping_matches(Twice(5), [x], 0.3, loss_type=loss_type)


def test_subclass_policy():
    class Kept(LlamaRMSNorm):
        pass

    class Overridden(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    assert isinstance(default_registry.lookup(LlamaRMSNorm(3)), LlamaRMSNormRule)
    assert isinstance(default_registry.lookup(Kept(3)), LlamaRMSNormRule)
    assert default_registry.lookup(Overridden(3)) is None  # the fallback's
    assert psh.is_supported(LlamaRMSNorm(3), fallback=False)


class HubRMSNorm(nn.Module):
    """Stands in for a hub kernel layer (Liger's RMSNorm): another forward, the module's state.
    Gemma-style ``1 + weight``, so that the rule's gradient would be wrong for it."""

    def forward(self, hidden_states):
        return F.rms_norm(hidden_states, hidden_states.shape[-1:], 1 + self.weight,
                          self.variance_epsilon)


def kernelized(model: nn.Module, layer: type[nn.Module]) -> nn.Module:
    """What ``kernels.kernelize`` does to each layer it maps: ``forward`` replaced on the
    module by ``layer``'s (its own class's where it falls back)."""
    norm = model[0]
    norm.forward = MethodType(layer.forward, norm)
    return model


def test_a_forward_replaced_by_a_hub_kernel_is_refused():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4)
    model = kernelized(llama_norm(4, 1e-6), HubRMSNorm)
    psh.add_hooks(model)
    try:
        sum_of_outputs(model(x)).sum().backward()
        with pytest.raises(PerSampleHooksError, match=r"'0' \(LlamaRMSNorm\).*hub kernel.*"
                           r"units=\['0'\]"):
            psh.compute_grad1(model)
    finally:
        psh.remove_hooks(model)
    assert_matches_loop(model, [x], units=["0"])  # the workaround the message names


def test_kernelize_fallback_and_wrappers_are_accepted():
    """kernelize's fallback sets the class's own forward on the module; accelerate's device
    hooks wrap it with ``functools.update_wrapper``: both run the rule's code."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4)
    assert_matches_loop(kernelized(llama_norm(4, 1e-6), LlamaRMSNorm), [x])
    norm = LlamaRMSNorm(4)
    original = norm.forward
    norm.forward = functools.update_wrapper(functools.partial(lambda m, h: original(h), norm),
                                            original)
    assert runs(norm, llama_rms_norm_forward)


def test_a_llama_name_with_other_code_is_not_recognized():
    """The name of a Llama-style class, other code (as another transformers version might
    have): not recognized; its weight's uses are followed as any module's with no rule (the
    torch.func fallback where they cannot be), exactly."""
    class Renamed(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):  # the product before the cast (OLMo 2)
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return (self.weight * hidden_states).to(input_dtype)

    Renamed.__module__, Renamed.__qualname__ = LlamaRMSNorm.__module__, "LlamaRMSNorm"
    torch.manual_seed(0)
    model = normed(Renamed(4), 4).double()  # first: see normed
    assert default_registry.lookup(model[0]) is None
    assert_matches_loop(model, [torch.randn(3, 2, 4)])
    with psh.add_hooks(model) as state:
        assert type(state.rules[model[0]]).__name__ == "RawUsesOrFallbackRule"


class PerSampleLoss(nn.Module):
    """A causal LM as a model of per-sample losses ``[B]``: next-token cross-entropy, mean over
    each sample's tokens, from the logits in their dtype (float64: exact). Its mean over the
    batch is the LM's own ``labels`` loss (every sample has the same length)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids):
        logits = self.lm(input_ids, position_ids=position_ids).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:],
                               reduction="none").mean(1)


def tiny_llama() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False)
    model = PerSampleLoss(transformers.LlamaForCausalLM(config)).double().eval()
    with torch.no_grad():  # RMSNorm weights start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
    batch, length = 3, 8
    input_ids = torch.randint(0, 50, (batch, length))
    # given per sample: the default [1, T] broadcast over the batch is another issue
    position_ids = torch.arange(length).expand(batch, length)
    return model, [input_ids, position_ids]


def test_llama_has_no_fallback_unit():
    model, _ = tiny_llama()
    state = psh.add_hooks(model)
    try:
        assert not state.units
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        assert len(norms) == 5
        assert all(isinstance(state.rules[m], LlamaRMSNormRule) for m in norms)
    finally:
        psh.remove_hooks(model)


@pytest.mark.parametrize("loss_type", ["sum", "mean"])
def test_llama_matches_the_loop(loss_type):
    """grad1, norms and clipping of every parameter of a tiny Llama, against the loop.

    The sum loss is exact (observed: bitwise). With the mean loss the gradients below each
    RMSNorm carry ``1/B``, which its float32 backward rounds otherwise than the loop's
    per-sample gradient (observed 1.3e-7 relative): float32 rounding there, even in float64."""
    model, inputs = tiny_llama()
    tolerance = dict(rtol=1e-9, atol=1e-10) if loss_type == "sum" else dict(rtol=1e-6, atol=1e-7)
    got = assert_matches_loop(model, inputs, sum_of_outputs, loss_type, **tolerance)
    assert {"lm.model.norm.weight", "lm.model.layers.1.post_attention_layernorm.weight"} <= set(got)
    assert_norms_match(model, inputs, sum_of_outputs, loss_type, **tolerance)
    assert_clipping_matches(model, inputs, 0.05, sum_of_outputs, loss_type, **tolerance)
