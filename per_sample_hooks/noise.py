"""The Gaussian noise of DP-SGD: drawn in one call per dtype and device into storage kept across
steps, from a generator of its own (or ``os.urandom``), the next draw made ahead on a background
thread.

On the CPU the draw is the noise's whole cost (torch's generator: about 2.3 ms for the 670k
parameters of a 784-512-512-10 MLP on one thread, ``benchmarks/noise_draw.py``; where it is
written matters little). Drawn ahead, it runs on another core while the caller's next forward
and backward run: it costs the step nothing where a core is free.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor


def secure_uniform(count: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """``count`` uniforms in ``[0, 1)`` (float32 or float64, every mantissa bit random) from the
    operating system's cryptographically secure generator (``os.urandom``)."""
    int_dtype, bits, one = ((torch.int64, 52, 0x3FF0000000000000) if dtype == torch.float64
                            else (torch.int32, 23, 0x3F800000))
    raw = torch.frombuffer(bytearray(os.urandom(count * dtype.itemsize)), dtype=int_dtype)
    # random mantissa bits under the exponent of 1.0: a float in [1, 2)
    return raw.bitwise_and_((1 << bits) - 1).bitwise_or_(one).view(dtype).sub_(1.0)


def secure_gaussian_(out: Tensor, std: float = 1.0) -> Tensor:
    """Fill ``out`` in place with ``N(0, std^2)`` from :func:`secure_uniform` by Box-Muller:
    radii from 52-bit uniforms in float64 (tails to 8.5 std), angles in ``out``'s precision
    (float32 for float32 and lower, else float64)."""
    pairs = (out.numel() + 1) // 2
    dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    radius = torch.log1p(secure_uniform(pairs).neg_()).mul_(-2.0).sqrt_().to(dtype)
    angle = secure_uniform(pairs, dtype).mul_(2 * math.pi)
    normal = torch.cat([radius * torch.cos(angle), radius.mul_(torch.sin(angle))])
    return out.copy_(normal[:out.numel()].view(out.shape)).mul_(std)


def gaussian_(out: Tensor, std: float, generator: torch.Generator | None = None,
              secure: bool = False) -> Tensor:
    """Fill ``out`` in place with ``N(0, std^2)``: from ``generator`` (drawn on its device) or,
    with ``secure``, from :func:`secure_gaussian_`."""
    if secure:
        return secure_gaussian_(out, std)
    if generator is None or generator.device == out.device:
        return out.normal_(0.0, std, generator=generator)
    drawn = torch.empty(out.shape, dtype=out.dtype, device=generator.device)
    return out.copy_(drawn.normal_(0.0, std, generator=generator))


class FlatBuffers:
    """One flat tensor per (dtype, device) and a view of it per tensor of a list: allocated on
    the first call, reused while the shapes, dtypes and devices stay the same."""

    def __init__(self) -> None:
        self.layout: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.flats: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self.views: list[Tensor] = []

    def like(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Views shaped like ``tensors``, in order (uninitialized when new)."""
        layout = [(t.shape, t.dtype, t.device) for t in tensors]
        if layout != self.layout:
            sizes: dict[tuple[torch.dtype, torch.device], int] = {}
            for shape, dtype, device in layout:
                sizes[dtype, device] = sizes.get((dtype, device), 0) + shape.numel()
            self.flats = {key: torch.empty(n, dtype=key[0], device=key[1])
                          for key, n in sizes.items()}
            offsets = dict.fromkeys(sizes, 0)
            self.views = []
            for shape, dtype, device in layout:
                start = offsets[dtype, device]
                offsets[dtype, device] = start + shape.numel()
                self.views.append(self.flats[dtype, device][start:start + shape.numel()]
                                  .view(shape))
            self.layout = layout
        return self.views


Flats = dict[tuple[torch.dtype, torch.device], Tensor]


def noise_generator(generator: torch.Generator | None, device: torch.device
                    ) -> torch.Generator:
    """The noise's own generator, on ``generator``'s device (``device`` without one), seeded
    from ``generator`` (torch's global generator without one): the noise, drawn on another
    thread, and whatever else uses ``generator`` (the batches' sampling) are each
    reproducible from the seed, and never share a generator between threads."""
    on = generator.device if generator is not None else torch.device("cpu")
    seed = int(torch.randint(2**62, (1,), generator=generator, device=on))
    return torch.Generator(device=generator.device if generator is not None else device
                           ).manual_seed(seed)


class GaussianNoise:
    """Standard normal draws shaped like a list of tensors (:meth:`draw`), in
    :class:`FlatBuffers`: one ``normal_`` per flat tensor, from ``generator`` or, with
    ``secure``, ``os.urandom``.

    With ``ahead``, :meth:`draw_ahead` starts the next draw on a background thread (CPU
    storage only: CUDA kernels run asynchronously anyway), into the same storage, once the
    caller has consumed the views; :meth:`draw` waits for it. While the shapes stay the same
    the draws are those without ``ahead``; a draw made ahead for other shapes is dropped, and the
    generator set back to where it started, so that they stay those without ``ahead``."""

    def __init__(self, generator: torch.Generator | None, secure: bool = False,
                 ahead: bool = True):
        self.generator, self.secure = generator, secure
        self.buffers = FlatBuffers()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="psh-noise") if ahead else None
        self._ahead: Future[Flats] | None = None
        self._state_before_ahead: Tensor | None = None

    def draw(self, like: Sequence[Tensor]) -> list[Tensor]:
        """``N(0, 1)`` views shaped like ``like``, valid until the next :meth:`draw`."""
        filled = self._wait()
        views = self.buffers.like(like)
        if filled is not self.buffers.flats:  # none drawn ahead, or for other shapes
            if filled is not None and self._state_before_ahead is not None:
                self.generator.set_state(self._state_before_ahead)  # as if never drawn
            self._fill(self.buffers.flats)
        return views

    def draw_ahead(self) -> None:
        """Start the next draw (call once this draw's views are consumed)."""
        flats = self.buffers.flats
        if self._executor is not None and flats and all(
                t.device.type == "cpu" for t in flats.values()):
            if self.generator is not None:
                self._state_before_ahead = self.generator.get_state()
            self._ahead = self._executor.submit(self._fill, flats)

    def generator_state(self) -> Tensor | None:
        """The generator's state that the next :meth:`draw` starts from (the state before a
        draw made ahead); None with ``secure``."""
        if self.generator is None:
            return None
        return self._state_before_ahead if self._ahead is not None else \
            self.generator.get_state()

    def set_generator_state(self, state: Tensor) -> None:
        """Draw from ``state`` on (a draw made ahead is dropped)."""
        self._wait()
        self.generator.set_state(state)

    def close(self) -> None:
        """Wait for a draw under way and stop the thread."""
        self._wait()
        if self._executor is not None:
            self._executor.shutdown()

    def _wait(self) -> Flats | None:
        ahead, self._ahead = self._ahead, None
        return ahead.result() if ahead is not None else None

    def _fill(self, flats: Flats) -> Flats:
        for flat in flats.values():
            gaussian_(flat, 1.0, self.generator, self.secure)
        return flats


__all__ = ["secure_uniform", "secure_gaussian_", "gaussian_", "FlatBuffers", "noise_generator",
           "GaussianNoise"]
