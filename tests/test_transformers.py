"""Real models as their users call them: tiny random-init transformers models (GPT-2 with tied
embeddings and broadcast position ids, BERT with a padding mask, Llama with tied embeddings and
grouped-query attention, ViT with its class token and position embeddings, wav2vec2 on raw
audio, ALBERT's shared layers, DistilBERT, BLOOM's ALiBi, GPT-NeoX, Phi, Gemma, ConvNeXt's
LayerScale), BART (tied embeddings held by a module never called, decoder positions looked
up as [1, T]) and peft LoRA, exact against the float64 per-sample loop for grad1, norms,
clipping and a DPSGD step; no module is a torch.func fallback unit but wav2vec2's weight-normed
positional convolution."""
from __future__ import annotations

import copy
import os
import re
import warnings

import pytest
import torch
from norms_truth import loop_clipped
from torch import Tensor, nn
from torch.nn import functional as F

import per_sample_hooks as psh
from ground_truth import assert_same_state, loop_tolerance, seeded

transformers = pytest.importorskip("transformers")

B, T, VOCAB = 3, 7, 50


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=VOCAB,
                                     n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=VOCAB,
                                     max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0, attention_probs_dropout_prob=0)
    return transformers.BertForSequenceClassification(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=32,
                                      vocab_size=VOCAB, max_position_embeddings=16,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=32, image_size=8, patch_size=4,
                                    num_labels=3, hidden_dropout_prob=0,
                                    attention_probs_dropout_prob=0)
    return transformers.ViTForImageClassification(config)


def clip_vision() -> nn.Module:
    """CLIP's vision tower: its embeddings read ``patch_embedding.weight.dtype`` in their
    forward (a read, not a use) and own a raw class token."""
    vision = transformers.CLIPVisionConfig(hidden_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=32,
                                           image_size=8, patch_size=4, attention_dropout=0)
    config = transformers.CLIPConfig(vision_config=vision.to_dict(), num_labels=3)
    model = transformers.CLIPForImageClassification(config)
    model.vision_model.post_layernorm.requires_grad_(False)  # unused: the head pools before it
    return model


def gpt2_lora() -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                             fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(gpt2(), config)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: make A's grads matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def albert() -> nn.Module:
    """One layer's parameters shared by every layer (a module called several times)."""
    config = transformers.AlbertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, embedding_size=8, vocab_size=VOCAB,
                                       max_position_embeddings=16, num_labels=3,
                                       hidden_dropout_prob=0, attention_probs_dropout_prob=0,
                                       classifier_dropout_prob=0)
    return transformers.AlbertForSequenceClassification(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                                           vocab_size=VOCAB, max_position_embeddings=16,
                                           num_labels=3, dropout=0, attention_dropout=0,
                                           seq_classif_dropout=0)
    return transformers.DistilBertForSequenceClassification(config)


def bloom() -> nn.Module:
    """ALiBi position biases, word-embedding LayerNorm, tied head."""
    config = transformers.BloomConfig(hidden_size=16, n_layer=2, n_head=2, vocab_size=VOCAB,
                                      hidden_dropout=0, attention_dropout=0)
    return transformers.BloomForCausalLM(config)


def gpt_neox() -> nn.Module:
    """Rotary embeddings on part of each head, parallel residual."""
    config = transformers.GPTNeoXConfig(hidden_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=32,
                                        vocab_size=VOCAB, max_position_embeddings=16,
                                        hidden_dropout=0, attention_dropout=0)
    return transformers.GPTNeoXForCausalLM(config)


def phi() -> nn.Module:
    config = transformers.PhiConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=32, vocab_size=VOCAB,
                                    max_position_embeddings=16, resid_pdrop=0, embd_pdrop=0,
                                    attention_dropout=0)
    return transformers.PhiForCausalLM(config)


def gemma() -> nn.Module:
    """RMSNorm scaled by ``1 + weight``, embeddings scaled by sqrt(hidden), tied head."""
    config = transformers.GemmaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8, intermediate_size=32,
                                      vocab_size=VOCAB, max_position_embeddings=16)
    return transformers.GemmaForCausalLM(config)


def convnext() -> nn.Module:
    """Depthwise 7x7 convolutions, channels-last LayerNorm, LayerScale gammas (raw)."""
    config = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                         num_labels=3, drop_path_rate=0)
    return transformers.ConvNextForImageClassification(config)


def wav2vec2() -> nn.Module:
    """wav2vec2 for audio classification: convolutional feature encoder with GroupNorm, and a
    positional convolution under ``parametrizations.weight_norm`` (a unit of the fallback)."""
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, num_labels=3, classifier_proj_size=8, hidden_dropout=0,
        attention_dropout=0, activation_dropout=0, feat_proj_dropout=0, final_dropout=0,
        layerdrop=0, mask_time_prob=0)
    return transformers.Wav2Vec2ForSequenceClassification(config)


def bart() -> nn.Module:
    """An encoder-decoder whose decoder computes its learned positions from position ids
    ``[1, T]`` while called with the batch's ``input_ids``."""
    config = transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB,
                                     max_position_embeddings=32, dropout=0, attention_dropout=0,
                                     activation_dropout=0, pad_token_id=1,
                                     decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(config)


def seq2seq_batch(generator: torch.Generator) -> dict[str, Tensor]:
    """Source ids and 5 target ids per sample (no padding: the loss is the mean of the
    samples')."""
    return {"input_ids": torch.randint(2, VOCAB, (B, T), generator=generator),
            "labels": torch.randint(2, VOCAB, (B, 5), generator=generator)}


def causal_lm_batch(generator: torch.Generator) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (B, T), generator=generator)
    return {"input_ids": ids, "labels": ids}


def classification_batch(generator: torch.Generator) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCAB, (B, T), generator=generator)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0  # a padded sample
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, 3, (B,), generator=generator)}


def image_batch(generator: torch.Generator) -> dict[str, Tensor]:
    return {"pixel_values": torch.randn(B, 3, 8, 8, generator=generator),
            "labels": torch.randint(0, 3, (B,), generator=generator)}


def audio_batch(generator: torch.Generator) -> dict[str, Tensor]:
    return {"input_values": torch.randn(B, 200, generator=generator),
            "labels": torch.randint(0, 3, (B,), generator=generator)}


MODELS = {"gpt2": (gpt2, causal_lm_batch), "bert": (bert, classification_batch),
          "llama": (llama, causal_lm_batch), "vit": (vit, image_batch),
          "clip-vision": (clip_vision, image_batch),
          "gpt2-lora": (gpt2_lora, causal_lm_batch), "wav2vec2": (wav2vec2, audio_batch),
          "albert": (albert, classification_batch),
          "distilbert": (distilbert, classification_batch),
          "bloom": (bloom, causal_lm_batch), "gpt-neox": (gpt_neox, causal_lm_batch),
          "phi": (phi, causal_lm_batch), "gemma": (gemma, causal_lm_batch),
          "convnext": (convnext, image_batch), "bart": (bart, seq2seq_batch)}
UNITS = {"wav2vec2": ["wav2vec2.encoder.pos_conv_embed.conv"]}
"""The fallback units of each model (a reparametrized weight: ``per_sample_hooks.reparametrized``);
every other module has a native rule."""


def build(name: str, dtype: torch.dtype) -> tuple[nn.Module, dict[str, Tensor]]:
    make, batch = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make().to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch(seeded(1)).items()}
    return model.train(), inputs


def sample(batch: dict[str, Tensor], i: int, dtype: torch.dtype | None = None
           ) -> dict[str, Tensor]:
    """Sample ``i`` of ``batch``, its floating-point tensors in ``dtype`` if given."""
    return {k: v[i:i + 1].to(dtype) if dtype and v.is_floating_point() else v[i:i + 1]
            for k, v in batch.items()}


def loss_of(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The docs' call, ``model(**batch).loss``, in float32. transformers' causal-LM loss casts
    the logits to float32 (``ForCausalLMLoss``), so in float64 the same loss (labels shifted
    by one, mean over tokens and samples) is taken from the logits."""
    if next(model.parameters()).dtype != torch.float64:
        return model(**batch).loss
    labels = batch["labels"]
    if model.config.is_encoder_decoder:  # the labels, shifted right, are the decoder's input
        logits = model(**batch).logits
    else:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        if labels.dim() == 2:  # next-token prediction
            logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def loop_grads(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: each sample's loss (its own forward, as the docs call it)
    differentiated alone, in float64. The batch loss is the mean of these (equal token counts
    per sample, or one label per sample)."""
    model = model.double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(B):
        grads = torch.autograd.grad(loss_of(model, sample(batch, i, torch.float64)),
                                    list(params.values()),
                                    allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(),
                                                                               grads)])
    return {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(params)}


FLOAT32_INSIDE = {"llama", "gemma", "mixtral", "qwen2moe", "phimoe", "t5"}
"""Models that compute in float32 whatever their dtype (LlamaRMSNorm and T5LayerNorm upcast
to float32 and cast back; the rotary embedding is float32): in float64 their plain batch
gradient itself differs from the mean of the loop's by about 5e-8 of its largest entry."""


def tolerances(dtype: torch.dtype, name: str) -> dict[str, float]:
    if dtype == torch.float64:
        return {"rtol": 1e-5, "atol": 1e-7} if name in FLOAT32_INSIDE else \
            {"rtol": 1e-9, "atol": 1e-11}
    return {"rtol": 2e-4, "atol": 2e-6}


def assert_rows_close(got: dict[str, Tensor], expected: dict[str, Tensor], dtype: torch.dtype,
                      model: str) -> None:
    assert got.keys() == expected.keys()
    for n, value in got.items():
        torch.testing.assert_close(value.double(), expected[n], **tolerances(dtype, model),
                                   msg=lambda m, n=n: f"{n}: {m}")


def hooked_step(model: nn.Module, batch: dict[str, Tensor]) -> None:
    psh.add_hooks(model)
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_grad1_norms_clip_match_the_loop(name: str, dtype: torch.dtype) -> None:
    model, batch = build(name, dtype)
    try:
        hooked_step(model, batch)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
        norms = psh.compute_norms(model)
        per_param = psh.compute_norms(model, per_param=True)
        clipped_norms = psh.clip_grads(model, max_grad_norm=0.5)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        state = psh.add_hooks(model)
        assert [state.modules[unit][0] for unit in state.units] == UNITS.get(name, [])
    finally:
        psh.remove_hooks(model)
    expected = loop_grads(model, batch)
    assert_rows_close(got, expected, dtype, name)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms.double(), total, **tolerances(dtype, name))
    torch.testing.assert_close(clipped_norms.double(), total, **tolerances(dtype, name))
    assert_rows_close(per_param, {n: g.flatten(1).norm(dim=1) for n, g in expected.items()},
                      dtype, name)
    assert_rows_close(clipped, loop_clipped(expected, total, 0.5, "mean"), dtype, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODELS))
def test_dpsgd_step_matches_the_loop(name: str, dtype: torch.dtype) -> None:
    """Two DPSGD steps without noise (the first checked by the unseen-use check, the second an
    output-edge backward), SGD with lr 1: the gradient each step used is the loop's clipped
    mean at the parameters before it."""
    model, batch = build(name, dtype)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    dp = psh.DPSGD(model, torch.optim.SGD(params.values(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=0.5, dataset_size=10 * B, batch_size=B, accountant=None)
    try:
        for _ in range(2):
            before = {n: p.detach().clone() for n, p in params.items()}
            reference = {n: p.double() for n, p in before.items()}
            dp.zero_grad()
            dp.backward(loss_of(model, batch))
            dp.step()
            used = {n: p.grad.clone() for n, p in params.items()}  # what SGD stepped with
            for n, p in params.items():  # and it did step: lr 1
                torch.testing.assert_close(p.detach(), before[n] - used[n])
            expected = loop_grads_at(model, batch, reference)
            total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
            assert_rows_close(used, loop_clipped(expected, total, 0.5, "mean"), dtype, name)
    finally:
        dp.close()
        psh.remove_hooks(model)


def loop_grads_at(model: nn.Module, batch: dict[str, Tensor], values: dict[str, Tensor]
                  ) -> dict[str, Tensor]:
    """:func:`loop_grads` of a float64 copy of ``model`` with trainable parameters ``values``."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if n in values:
                p.copy_(values[n])
    return loop_grads(twin, batch)


def grad1_rows(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """One step of the hooked ``model``: the ``grad1`` of each trainable parameter."""
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    psh.compute_grad1(model)
    return {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}


def checkpointing(model: nn.Module, kwargs: dict | None) -> None:
    """transformers' activation checkpointing on with ``kwargs`` (off for None), by the name
    the installed version documents: ``activation_checkpointing_enable`` where it has it, else
    ``gradient_checkpointing_enable`` (a deprecated alias where both exist)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if kwargs is None:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing(reentrant, dtype) -> None:
    """GPT-2 with transformers' activation checkpointing: grad1, then DPSGD steps (whose
    output-edge backward cannot run through reentrant checkpointing: an ordinary backward
    there), against the loop taken without checkpointing."""
    model, batch = build("gpt2", dtype)
    checkpointing(model, {"use_reentrant": reentrant})
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone().double() for n, p in params.items()}
    dp = psh.DPSGD(model, torch.optim.SGD(params.values(), lr=1.0), noise_multiplier=0.0,
                   max_grad_norm=0.5, dataset_size=10 * B, batch_size=B, accountant=None)
    try:
        got = grad1_rows(model, batch)
        for _ in range(3):  # the later steps are not compared by the unseen-use check
            before = {n: p.detach().clone() for n, p in params.items()}
            dp.zero_grad()
            dp.backward(loss_of(model, batch))
            dp.step()
        used = {n: before[n] - p.detach() for n, p in params.items()}
    finally:
        dp.close()
        psh.remove_hooks(model)
    checkpointing(model, None)  # the loop's autograd.grad: not through reentrant
    assert_rows_close(got, loop_grads_at(model, batch, start), dtype, "gpt2")
    expected = loop_grads_at(model, batch, {n: p.double() for n, p in before.items()})
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    assert_rows_close(used, loop_clipped(expected, total, 0.5, "mean"), dtype, "gpt2")


def deberta_v2() -> nn.Module:
    config = transformers.DebertaV2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0,
        attention_probs_dropout_prob=0, pooler_dropout=0, relative_attention=True,
        position_buckets=4, max_relative_positions=8, pos_att_type=["p2c", "c2p"])
    return transformers.DebertaV2ForSequenceClassification(config)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_deberta_relative_embeddings_are_refused_and_exact_as_a_unit(dtype) -> None:
    """DeBERTa-v2 projects its relative embeddings (computed from a trainable table) with batch
    1 and repeats them over the batch itself: the hooked forward runs unchanged, compute_*
    refuses naming the projection and ``units=``, and the encoder as one unit is exact. On CUDA
    its TorchScript helpers cannot be vmapped ("Cannot access data pointer of Tensor that
    doesn't have storage", torch 2.11 on an H100): the unit is refused, saying PYTORCH_JIT=0,
    with which it is exact there too."""
    torch.manual_seed(0)
    model = deberta_v2().to(dtype).train()
    batch = classification_batch(seeded(1))
    plain = loss_of(model, batch)
    try:
        psh.add_hooks(model)
        loss = loss_of(model, batch)
        torch.testing.assert_close(loss, plain)
        loss.backward()
        with pytest.raises(psh.PerSampleHooksError, match="'deberta.encoder.layer.0.attention."
                           "self.pos_key_proj' was called with batch size 1 .*units="):
            psh.compute_grad1(model)
        psh.remove_hooks(model)
        psh.add_hooks(model, units=[model.deberta.encoder])
        if batch["input_ids"].is_cuda and os.environ.get("PYTORCH_JIT", "1") != "0":
            with pytest.raises(psh.PerSampleHooksError, match="TorchScript.*PYTORCH_JIT=0"):
                grad1_rows(model, batch)
            return
        got = grad1_rows(model, batch)
    finally:
        psh.remove_hooks(model)
    assert_rows_close(got, loop_grads(model, batch), dtype, "deberta-v2")


def beit() -> nn.Module:
    config = transformers.BeitConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, image_size=8, patch_size=4,
                                     num_labels=3, use_relative_position_bias=True,
                                     hidden_dropout_prob=0, attention_probs_dropout_prob=0,
                                     drop_path_rate=0)
    return transformers.BeitForImageClassification(config)


def swin(version: str = "") -> nn.Module:
    """Swin, or Swinv2 (``version="v2"``), whose relative position bias is an MLP on a
    coordinates buffer [1, ...], whose output the model writes in place (ReLU(inplace=True))
    and reshapes to a table it indexes."""
    config = getattr(transformers, f"Swin{version}Config")(
        image_size=8, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2,
        num_labels=3, hidden_dropout_prob=0, attention_probs_dropout_prob=0, drop_path_rate=0)
    return getattr(transformers, f"Swin{version}ForImageClassification")(config)


def perceiver() -> nn.Module:
    """Its text preprocessor looks positions up as ``arange(T)``, without the batch; its latents
    module is called with the batch size, an int, and expands its raw parameter."""
    config = transformers.PerceiverConfig(num_latents=4, d_latents=16, d_model=16,
                                          num_blocks=1, num_self_attends_per_block=1,
                                          num_self_attention_heads=2,
                                          num_cross_attention_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=32, num_labels=3,
                                          attention_probs_dropout_prob=0.0)
    return transformers.PerceiverForSequenceClassification(config)


def t5() -> nn.Module:
    config = transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   vocab_size=VOCAB, dropout_rate=0,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0,
                                   pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


RELATIVE_BIASES = {  # model, its batch, the size and module refused, the units that make it exact
    "beit": (beit, image_batch, "1 \\(at 'beit.layers.0.relative_position_bias'\\)",
             lambda m: list(m.beit.layers)),
    "swin": (swin, image_batch,
             "1 \\(at 'swin.encoder.layers.0.blocks.0.attention.relative_position_bias'\\)",
             lambda m: list(m.swin.encoder.layers)),
    "swinv2": (lambda: swin("v2"), image_batch,
               "'swinv2.encoder.layers.0.blocks.0.attention.self.continuous_position_bias_mlp"
               ".0' was called with batch size 1 .*relu",
               lambda m: list(m.swinv2.encoder.layers)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(RELATIVE_BIASES))
def test_relative_position_biases_are_refused_and_exact_as_units(name, dtype) -> None:
    """BEiT's and Swin's attention adds a bias picked from a trainable table by an index
    without the batch (Swin's windows are folded into the batch too); Swinv2 computes its table
    with an MLP on a buffer of batch 1 and uses it otherwise than broadcast: refused naming the
    module and ``units=``; the layers as units are exact."""
    make, batch_of, refused, units = RELATIVE_BIASES[name]
    torch.manual_seed(0)
    model = make().to(dtype).train()
    batch = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in batch_of(seeded(1)).items()}
    try:
        psh.add_hooks(model)
        with pytest.raises(psh.PerSampleHooksError, match=rf"{refused}.*units="):
            loss_of(model, batch).backward()  # (Swinv2: refused here)
            psh.compute_grad1(model)
        psh.remove_hooks(model)
        psh.add_hooks(model, units=units(model))
        got = grad1_rows(model, batch)
    finally:
        psh.remove_hooks(model)
    assert_rows_close(got, loop_grads(model, batch), dtype, name)


LOOKUPS_WITHOUT_THE_BATCH = {"t5": (t5, seq2seq_batch), "perceiver": (perceiver,
                                                                      classification_batch)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("length", ["other", "the batch size"])
@pytest.mark.parametrize("name", list(LOOKUPS_WITHOUT_THE_BATCH))
def test_lookups_without_the_batch_are_followed_to_it_and_exact(name, length, dtype) -> None:
    """T5's relative position bias, looked up from buckets ``[T, T]`` made in the forward and
    added to every layer's scores (its first layer passes it on to the others), and
    Perceiver's positions, looked up as ``arange(T)``: their outputs are followed to where the
    model broadcasts them over the batch, exact; with as many positions as samples too, where
    the shapes cannot tell the positions from the batch (the rows were taken for the samples:
    100% off, silently)."""
    make, batch_of = LOOKUPS_WITHOUT_THE_BATCH[name]
    torch.manual_seed(0)
    model = make().to(dtype).train()
    batch = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in batch_of(seeded(1)).items()}
    if length == "the batch size":
        batch = {k: v[:, :B].contiguous() if v.dim() == 2 else v for k, v in batch.items()}
    try:
        psh.add_hooks(model)
        got = grad1_rows(model, batch)
    finally:
        psh.remove_hooks(model)
    assert_rows_close(got, loop_grads(model, batch), dtype, name)


def opt() -> nn.Module:
    """OPT flattens ``[B, T, H]`` to ``[B * T, H]`` before its MLP: its decoder layers are
    units of the fallback."""
    config = transformers.OPTConfig(hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                    num_attention_heads=2, word_embed_proj_dim=16,
                                    max_position_embeddings=16, vocab_size=VOCAB, dropout=0,
                                    attention_dropout=0, pad_token_id=1)
    return transformers.OPTForCausalLM(config)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opt_refusals_name_the_fix_and_its_layers_as_units_are_exact(dtype) -> None:
    """OPT's ``fc1`` sees ``B * T`` rows: refused naming it and ``units=``. A unit of the
    fallback called with transformers' cache (``use_cache=True``, the default) is refused
    before its re-run extends the cache; with ``use_cache=False`` the layers as units are
    exact."""
    torch.manual_seed(0)
    model = opt().to(dtype).train()
    batch = causal_lm_batch(seeded(1))
    layers = list(model.model.decoder.layers)
    try:
        psh.add_hooks(model)
        loss_of(model, batch).backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'model.decoder.layers.0.fc1' and 5 "
                           r"other layers saw a multiple of the batch 3: .*units=\['model.decoder"
                           r".layers.0', 'model.decoder.layers.1'\]"):
            psh.compute_grad1(model)
        psh.remove_hooks(model)
        model.zero_grad(set_to_none=True)
        psh.add_hooks(model, units=layers)
        loss_of(model, batch).backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'model.decoder.layers.0' "
                           r"\(OPTDecoderLayer\) .*key/value cache \(DynamicCache, argument "
                           r"'\w+'\).*use_cache=False"):
            psh.compute_grad1(model)
        model.config.use_cache = False
        got = grad1_rows(model, batch)
    finally:
        psh.remove_hooks(model)
    assert_rows_close(got, loop_grads(model, batch), dtype, "opt")


def test_frozen_modules_capture_nothing() -> None:
    """Under LoRA the frozen layers (lm_head, the base projections, embeddings) hold no input or
    output gradient after the backward: only modules with a trainable parameter are recorded."""
    model, batch = build("gpt2-lora", torch.float32)
    state = psh.add_hooks(model)
    try:
        loss_of(model, batch).backward()
        recorded = {state.modules[m][0] for m, calls in state.calls.items() if calls}
        assert recorded and all("lora_" in name for name in recorded), recorded
    finally:
        psh.remove_hooks(model)


def mixture_of_experts(family: str, implementation: str) -> nn.Module:
    """Mixtral, Qwen2-MoE (a shared expert besides the routed ones), PhiMoE (its router an
    autograd.Function that torch.func cannot transform, sampling in training mode)."""
    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=32, vocab_size=VOCAB,
                 max_position_embeddings=32, num_experts_per_tok=2,
                 experts_implementation=implementation, router_aux_loss_coef=0.0)
    if family == "qwen2moe":
        config = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16, **sizes)
        return transformers.Qwen2MoeForCausalLM(config)
    config = getattr(transformers, f"{family.capitalize()}Config")(num_local_experts=4, **sizes)
    return getattr(transformers, f"{family.capitalize()}ForCausalLM")(config)


MOE_BLOCKS = ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize("family, implementation, dtype", [
    ("mixtral", "eager", torch.float64), ("mixtral", "eager", torch.float32),
    ("mixtral", "grouped_mm", torch.float32), ("qwen2moe", "eager", torch.float32),
    ("phimoe", "eager", torch.float64), ("phimoe", "eager", torch.float32)])
def test_mixture_of_experts_blocks_as_units_are_exact(family, implementation, dtype) -> None:
    """Mixtral, Qwen2-MoE, PhiMoE: their experts see the batch's tokens merged into one dim
    ([B * T, H]) and routed, which only the block that merges them can tell apart. Hooked as it
    is, the refusal names the decoder layer that holds it (the nearest module that holds a
    layer that saw the batch: the experts, re-run by the fallback where their code cannot be
    followed, no longer refuse first naming their parent); with each block a unit, grad1,
    norms and clipping match the float64 loop (the eager experts' routing by value, and
    PhiMoE's router, are re-run one sample at a time, grouped_mm's by vmap). PhiMoE samples
    its routing in training mode: its units are refused there as drawing random numbers, and
    exact in eval mode. The loop runs the eager experts: grouped_mm has no float64 kernel."""
    MODELS[family] = (lambda: mixture_of_experts(family, implementation), causal_lm_batch)
    try:
        model, batch = build(family, dtype)
    finally:
        del MODELS[family]
    psh.add_hooks(model)
    try:
        loss_of(model, batch).backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'model.layers.0.mlp.\w+' .*"
                           r"called with 21 rows, 7 times the batch of 3.*"
                           r"units=\['model.layers.0'") as refusal:
            psh.compute_grad1(model)
        # not the experts themselves as a unit first (they see the merged rows too)
        assert "units=['model.layers.0.mlp.experts']" not in str(refusal.value)
    finally:
        psh.remove_hooks(model)
    psh.add_hooks(model, units=MOE_BLOCKS, check_unseen="always")
    try:
        if family == "phimoe":
            model.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            with pytest.raises(psh.PerSampleHooksError,
                               match=r"'model.layers.0.mlp' \(PhimoeSparseMoeBlock\), a unit .*"
                               r"another output 0 when re-run alone.*draws random numbers"), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                psh.compute_grad1(model)
            model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-sample-at-a-time re-run's
            got = grad1_rows(model, batch)
            norms = psh.compute_norms(model)
            psh.clip_grads(model, max_grad_norm=0.5)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    finally:
        psh.remove_hooks(model)
    model.config._experts_implementation = "eager"
    expected = loop_grads(model, batch)
    assert_rows_close(got, expected, dtype, family)
    total = torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms.double(), total, **tolerances(dtype, family))
    assert_rows_close(clipped, loop_clipped(expected, total, 0.5, "mean"), dtype, family)


class AttentionClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(torch.tanh(self.attn(h, h, h, need_weights=False)[0]).mean(1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_peft_lora_on_multihead_attention_as_a_unit(dtype) -> None:
    """peft's LoRA on ``nn.MultiheadAttention`` merges the adapter into new frozen weights for
    each forward and takes it out again. As a unit (the advice of its refusal without one) it is
    exact against the float64 loop, and the re-run leaves the frozen weights as the step's own
    forward did (it used to refuse, after changing them by up to 0.4)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(AttentionClassifier(),
                                    peft.LoraConfig(r=2, target_modules=["attn"])).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    ids, labels = torch.randint(0, 40, (3, 5), generator=seeded(1)), torch.tensor([0, 2, 1])
    reference = copy.deepcopy(model)
    twin = copy.deepcopy(model).double()
    trainable = {n: p for n, p in twin.named_parameters() if p.requires_grad}
    rows = [torch.autograd.grad(F.cross_entropy(twin(ids[i:i + 1]), labels[i:i + 1]),
                                list(trainable.values())) for i in range(3)]
    expected = {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(trainable)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference(ids)
        with psh.add_hooks(model, units=["base_model.model.attn"]):
            F.cross_entropy(model(ids), labels).backward()
            psh.compute_grad1(model)
            for name, p in model.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(p.grad1.double(), expected[name],
                                               **loop_tolerance(dtype))
    assert_same_state(model, reference)


def token_losses(model: nn.Module, rows: Tensor) -> Tensor:
    """The sum over samples of their next-token losses."""
    logits = model(input_ids=rows).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")


def assert_unit_matches_token_loop(model: nn.Module, unit: str, dtype: torch.dtype) -> None:
    """grad1 of every trainable parameter with ``unit`` a unit, against the float64 loop."""
    ids = torch.randint(0, VOCAB, (3, 6), generator=seeded(1))
    twin = copy.deepcopy(model).double()
    trainable = [p for p in twin.parameters() if p.requires_grad]
    per_sample = [torch.autograd.grad(token_losses(twin, ids[i:i + 1]), trainable)
                  for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with psh.add_hooks(model, units=[unit]):
            token_losses(model, ids).backward()
            psh.compute_grad1(model, "sum")
            for k, p in enumerate(p for p in model.parameters() if p.requires_grad):
                torch.testing.assert_close(p.grad1.double(),
                                           torch.stack([row[k] for row in per_sample]),
                                           **loop_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_peft_dora_embedding_refusal_names_the_layer_and_its_caller_as_the_unit(dtype) -> None:
    """DoRA on ``embed_tokens``: its magnitude layer returns a scale ``[d]`` that the embedding
    combines with the batch. Refused naming that layer's path and the module calling it as the
    unit (it named only the class, with batch_dim and position-id advice); that unit is exact."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(llama(), peft.LoraConfig(
            r=4, target_modules=["embed_tokens"], use_dora=True, task_type="CAUSAL_LM")).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding_B" in name:
                p.normal_(std=0.2)
    ids = torch.randint(0, VOCAB, (3, 6), generator=seeded(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with psh.add_hooks(model):
            token_losses(model, ids).backward()
            with pytest.raises(psh.PerSampleHooksError, match=re.escape(
                    "'base_model.model.model.embed_tokens.lora_magnitude_vector.default' "
                    "(DoraEmbeddingLayer): output 0 received a gradient without a batch dim of "
                    "size 3 (shape (16,))") + ".*needs that module as the unit"):
                psh.compute_grad1(model, "sum")
    model.zero_grad(set_to_none=True)
    assert_unit_matches_token_loop(model, "base_model.model.model.embed_tokens", dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_peft_lora_embedding_with_dropout_configured_is_exact_as_a_unit(dtype) -> None:
    """``lora_dropout=0.1`` with ``embed_tokens`` among the targets, in training mode: peft's
    ``lora.Embedding`` holds an ``nn.Dropout`` its forward never calls. As the unit its refusal
    asks for, it is exact against the float64 loop; it was refused for that dropout, with advice
    (model.eval()) that would switch off every other adapter's dropout."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(llama(), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["embed_tokens"],
            task_type="CAUSAL_LM")).to(dtype).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding" in name:
                p.normal_(std=0.2)
    assert_unit_matches_token_loop(model, "base_model.model.model.embed_tokens", dtype)
