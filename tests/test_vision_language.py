"""A vision-language model (tiny random-init LLaVA, called as its docs call it) whose images are
not one per sample: its vision tower and projector see one row per image, which the hooks would
take for the samples' rows. With as many images as samples ([2, 0, 1, 1] for 4 samples) the
shapes show nothing; the image tokens do, and a step in which a layer that sees the images
received gradients is refused. The text side is exact against the float64 loop whatever the
images, and so is everything with one image per sample."""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import per_sample_hooks as psh

transformers = pytest.importorskip("transformers")

IMAGE = 63  # the image token's id
IMAGE_TOKENS = 4  # tokens an image becomes (16x16 pixels in 8x8 patches)


def llava() -> nn.Module:
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           image_size=16, patch_size=8)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=IMAGE, image_seq_length=IMAGE_TOKENS,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlavaForConditionalGeneration(config).eval()


def batch(images: list[int], dtype: torch.dtype) -> dict[str, Tensor]:
    """Samples holding ``images[i]`` images each (their tokens first, then 4 text tokens),
    padded to the longest."""
    most = max(images)
    ids = torch.tensor([[1] + [IMAGE] * IMAGE_TOKENS * k + [5, 6, 7, 8]
                        + [0] * IMAGE_TOKENS * (most - k) for k in images])
    pixels = torch.randn(sum(images), 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "pixel_values": pixels.to(dtype)}


def sample_losses(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """Each sample's mean next-token loss over its text tokens."""
    logits = model(**inputs).logits[:, :-1]
    ids, mask = inputs["input_ids"][:, 1:], inputs["attention_mask"][:, 1:]
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return losses.sum(1) / (labels != -100).sum(1)


def loop_grads(model: nn.Module, inputs: dict[str, Tensor], images: list[int]
               ) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}`` in float64, each sample with its own images alone."""
    model = copy.deepcopy(model).double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows, first = [], 0
    for i, k in enumerate(images):
        alone = {"input_ids": inputs["input_ids"][i:i + 1],
                 "attention_mask": inputs["attention_mask"][i:i + 1]}
        if k:
            alone["pixel_values"] = inputs["pixel_values"][first:first + k].double()
        first += k
        grads = torch.autograd.grad(sample_losses(model, alone).sum(), list(params.values()),
                                    allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g
                     for p, g in zip(params.values(), grads)])
    return {n: torch.stack([row[j] for row in rows]) for j, n in enumerate(params)}


def assert_grad1_matches_loop(model: nn.Module, inputs: dict[str, Tensor], images: list[int],
                              dtype: torch.dtype) -> None:
    model.zero_grad(set_to_none=True)
    sample_losses(model, inputs).mean().backward()
    psh.compute_grad1(model)
    expected = loop_grads(model, inputs, images)
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float64 else \
        {"rtol": 2e-4, "atol": 2e-6}  # (Llama's RMSNorm and rotary run in float32)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad1.double(), expected[n], **tolerance,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_image_per_sample_is_exact(dtype) -> None:
    model = llava().to(dtype)
    psh.add_hooks(model)
    assert_grad1_matches_loop(model, batch([1, 1, 1], dtype), [1, 1, 1], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("verb", ["compute_grad1", "compute_norms", "clip_grads"])
def test_as_many_images_as_samples_not_one_each_is_refused(verb, dtype) -> None:
    """[2, 0, 1, 1] images: the projector's 4 rows are not the 4 samples'. Refused, naming the
    projector and the empty sample; freezing the image side then gives exact text-side
    per-sample gradients in the next step."""
    images = [2, 0, 1, 1]
    model = llava().to(dtype)
    model.model.vision_tower.requires_grad_(False)  # LLaVA's first stage: the projector learns
    inputs = batch(images, dtype)
    psh.add_hooks(model)
    sample_losses(model, inputs).mean().backward()
    call = {"clip_grads": lambda: psh.clip_grads(model, max_grad_norm=1.0)}.get(
        verb, lambda: getattr(psh, verb)(model))
    with pytest.raises(psh.PerSampleHooksError,
                       match=rf"{verb}: .*pixel_values for 4 samples, of which sample 1 holds no "
                             r"image token.*'model.multi_modal_projector.linear_1'.*freeze"):
        call()
    model.model.multi_modal_projector.requires_grad_(False)
    assert_grad1_matches_loop(model, inputs, images, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_images_not_per_sample_with_the_image_side_frozen_are_exact(dtype) -> None:
    """Hooked from the start with the vision tower and projector frozen: nothing refused."""
    images = [2, 0, 1]
    model = llava().to(dtype)
    model.model.vision_tower.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(False)
    psh.add_hooks(model)
    assert_grad1_matches_loop(model, batch(images, dtype), images, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_more_images_than_samples_with_a_trainable_vision_tower_is_refused_naming_the_images(
        dtype) -> None:
    """[2, 1, 1] images for 3 samples: the vision tower's position embedding (batch size 1,
    broadcast over the step's 3 samples) meets the 4 images' patches. Refused in the forward
    saying that those rows are not the samples and to freeze the image side (it blamed the
    position embedding's use before); the next step, frozen, is exact."""
    images = [2, 1, 1]
    model = llava().to(dtype)
    inputs = batch(images, dtype)
    psh.add_hooks(model)
    with pytest.raises(psh.PerSampleHooksError,
                       match=r"'model.vision_tower.embeddings.position_embedding' .* 3 samples "
                             r"of the step, met in the model's add a tensor of 4 rows at dim "
                             r"0: that tensor's rows are not the samples .*vision tower and "
                             r"projector"):
        sample_losses(model, inputs)
    model.model.vision_tower.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(False)
    assert_grad1_matches_loop(model, inputs, images, dtype)


def qwen2_vl() -> nn.Module:
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                 "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision,
                                        image_token_id=IMAGE, video_token_id=60,
                                        vision_start_token_id=62, vision_end_token_id=61,
                                        tie_word_embeddings=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen2VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_image_patches_are_refused_with_the_one_fix_that_works(dtype) -> None:
    """Qwen2-VL packs every image's patches into the rows of pixel_values ([patches, 24]):
    its vision tower sees 8 rows for 2 samples. Refused, advising to freeze the image side
    (not units=['model'], whose re-run splits the patches as if they were samples and fails);
    the text side is then exact against the float64 loop."""
    if not hasattr(transformers, "Qwen2VLForConditionalGeneration"):
        pytest.skip("transformers without Qwen2-VL")
    model = qwen2_vl().to(dtype)
    ids = torch.tensor([[1, 62] + [IMAGE] * 1 + [61, 5, 6, 7, 8]] * 2)
    ids[1, 4:] = torch.tensor([9, 10, 11, 12])
    pixels = torch.randn(8, 24, generator=torch.Generator().manual_seed(1), dtype=dtype)
    grids = torch.tensor([[1, 2, 2], [1, 2, 2]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
              "image_grid_thw": grids}
    if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()  # transformers 5: M-RoPE's

    def losses(model, inputs):
        logits = model(**inputs).logits[:, :-1]
        labels = inputs["input_ids"][:, 1:].masked_fill(inputs["input_ids"][:, 1:] >= 60, -100)
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)

    psh.add_hooks(model)
    losses(model, inputs).mean().backward()
    with pytest.raises(psh.PerSampleHooksError, match=r"'model.visual.* saw 8 rows: the images "
                       r"of the model's call, or their patches .*freeze the layers that see "
                       r"them") as refusal:
        psh.compute_grad1(model)
    assert "units=" not in str(refusal.value)
    model.model.visual.requires_grad_(False)
    model.zero_grad()
    losses(model, inputs).mean().backward()
    psh.compute_grad1(model)
    reference = copy.deepcopy(model).double()
    params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    for i in range(2):
        alone = {k: v[i:i + 1] for k, v in inputs.items() if k != "pixel_values"}
        alone["pixel_values"] = pixels[4 * i:4 * i + 4].double()
        grads = torch.autograd.grad(losses(reference, alone).sum(), list(params.values()))
        tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float64 else \
            {"rtol": 2e-4, "atol": 2e-6}
        for (n, _), g in zip(params.items(), grads):
            torch.testing.assert_close(model.get_parameter(n).grad1[i].double(), g,
                                       **tolerance, msg=lambda m, n=n: f"{n}: {m}")
