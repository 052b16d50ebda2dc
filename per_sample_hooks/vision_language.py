"""Images per sample in a call of a transformers vision-language model.

LLaVA, Qwen2-VL, Idefics3, PaliGemma, Gemma3 and their kin run their vision tower and projector
on the batch's images (``pixel_values``), then scatter the image features into the token
embeddings at the image tokens (``masked_scatter``, in a module with no parameters of its own,
which the hooks do not follow). The layers that see the images take their rows for the samples:
right when each sample holds one image, wrong when the images are shared out otherwise and
their number happens to be the batch's ([2, 0, 1, 1] images for 4 samples), with no sign in the
shapes. The tokens tell: with as many images as samples, they are one per sample exactly when
every sample holds an image token. A sample with none is noted here; the step engine refuses
the step if a layer on the image side (not the language model, its embeddings or its head)
received gradients in it.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

# the forward's argument with the pixels of a kind of image, and the config's id of its token
VISUAL_INPUTS = (("pixel_values", "image_token_id"), ("pixel_values_videos", "video_token_id"))

FREEZE_IMAGE_SIDE = (
    "The text side's per-sample gradients are exact whatever the images: freeze the layers "
    "that see them (`requires_grad_(False)` on the vision tower and projector)")


@dataclass(frozen=True)
class ImagelessSamples:
    """A call of the model with ``pixels`` (its argument's name) in which the ``samples`` (rows
    of ``input_ids``, of ``batch``) hold no token of that input's images; ``text_side``: see
    :class:`ImageTokens`."""
    pixels: str
    samples: list[int]
    batch: int
    text_side: frozenset[nn.Module]


@dataclass(frozen=True)
class ImageTokens:
    """How a vision-language model marks its images in the tokens: ``(pixel argument, token
    id)`` pairs, its forward's argument names in order (for positional calls), and the modules
    of its text side (whose rows are the samples whatever the images)."""
    inputs: tuple[tuple[str, int], ...]
    arguments: tuple[str, ...]
    text_side: frozenset[nn.Module]

    def imageless_samples(self, args: tuple, kwargs: dict) -> ImagelessSamples | None:
        """The samples of a call ``model(*args, **kwargs)`` with images that hold no image token
        (None: every one holds one, or no images, or no ``input_ids [B, T]``)."""
        given = dict(zip(self.arguments, args)) | kwargs if args else kwargs
        ids = given.get("input_ids")
        if not isinstance(ids, Tensor) or ids.dim() != 2 or len(ids) < 2:
            return None
        for pixels, token in self.inputs:
            if given.get(pixels) is not None:
                holds = (ids == token).any(1)
                if not bool(holds.all()):
                    return ImagelessSamples(pixels, (~holds).nonzero()[:, 0].tolist(), len(ids),
                                            self.text_side)
        return None


def image_tokens(model: nn.Module) -> ImageTokens | None:
    """:class:`ImageTokens` of a transformers vision-language model; None for other models."""
    config = getattr(model, "config", None)
    inputs = tuple((pixels, token) for pixels, name in VISUAL_INPUTS
                   if isinstance(token := getattr(config, name, None), int))
    if not inputs:
        return None
    try:
        text_side = [model.get_decoder(), model.get_input_embeddings(),
                     model.get_output_embeddings()]
        arguments = tuple(inspect.signature(model.forward).parameters)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    modules = frozenset(m for part in text_side if isinstance(part, nn.Module)
                        for m in part.modules())
    return ImageTokens(inputs, arguments, modules)


def images_not_per_sample_error(caller: str, note: ImagelessSamples, layer: str) -> str:
    """The refusal of a step in which ``layer``, on the image side, received gradients."""
    shown = ", ".join(map(str, note.samples[:8])) + (", ..." if len(note.samples) > 8 else "")
    return (
        f"{caller}: the model was called with {note.pixels} for {note.batch} samples, of which "
        f"sample{'s' * (len(note.samples) > 1)} {shown} hold{'s' * (len(note.samples) == 1)} no "
        f"image token: its images are not one per sample, and '{layer}', which sees one row "
        "per image (the vision tower, the projector), would have them taken for the samples' "
        "rows (where there are as many images as samples, with wrong per-sample gradients and "
        f"no other sign). {FREEZE_IMAGE_SIDE}, or give every sample of a batch one image")


def on_image_side(model: nn.Module, names: Sequence[str]) -> bool:
    """Whether ``model`` is a vision-language model and its layers ``names`` all sit off its
    text side (the vision tower, the projector: their rows are images or patches)."""
    tokens = image_tokens(model)
    return tokens is not None and all(model.get_submodule(name) not in tokens.text_side
                                      for name in names)


def packed_images_hint(layers: str, size: int) -> str:
    """What to do about ``layers`` on the image side, called with ``size`` rows."""
    return (
        f"{layers} saw {size} rows: the images of the model's call, or their patches packed "
        "into one dim (Qwen2-VL's pixel_values [patches, ...]), not its samples, which a unit "
        f"cannot split either. {FREEZE_IMAGE_SIDE}")

