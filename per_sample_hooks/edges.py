"""The output-edge backward: gradients of the hooked modules' outputs and nothing else.

Next to the capture (:mod:`per_sample_hooks.capture`): a backward for consumers that rebuild
everything from the captured pairs (DP clipping, ``backprop_hess``'s Gauss-Newton passes) and
need no parameter gradient. On the steps the unseen-use check runs, it is an ordinary backward
(:meth:`OutputEdges.check_due`), so that the check has autograd's gradients to compare.
"""
from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from .api import add_hooks
from .capture import NON_REENTRANT, gradient_tensor, refused_by_reentrant_checkpointing
from .errors import PerSampleHooksError
from .step import form_on_arrival

STALE_FACTOR = 4
""":class:`OutputEdges` warns when it holds this many times the edges one backward used."""


class OutputEdges:
    """A backward that computes the gradients of the hooked modules' outputs and nothing else.

    Records, in every forward, the autograd edge of each output of the hooked modules and of
    each tensor the hooks watch inside a forward (the use sites of raw parameters,
    :mod:`per_sample_hooks.raw_uses`), not the tensor: nothing is kept alive. :meth:`backward`
    runs autograd's backward to those edges only (``torch.autograd.backward(loss,
    inputs=edges)``), so the capture hooks see every output gradient while the parameter
    gradients of the ordinary backward (one weight-gradient product per layer, about a third
    of its cost) are skipped: ``p.grad`` is left as it was.
    Not ``torch.autograd.grad``: it holds every requested gradient until it returns, so no
    layer's could be freed during the backward (measured: the T=256 token model's clipping
    step peaked at 1.23x a plain step that way, 1.15x now). For
    :func:`~per_sample_hooks.clip_grads`, which rebuilds the gradients from the captured pairs
    anyway (book-keeping, Bu et al. 2023), and for
    :func:`~per_sample_hooks.compute_grad1` where ``p.grad`` is not needed or is taken as the
    mean (sum) of ``grad1``.

    ``form_on_arrival=True``: as each layer's output gradient arrives, form its per-sample
    gradients (into buffers freed with the step's records) and drop its captured input and
    output gradient when those hold at least twice as many numbers
    (:func:`~per_sample_hooks.step.form_on_arrival`: LayerNorm, Linear and convolutions over
    many positions). This lowers the peak memory of a clipping step (the captured pairs of such
    layers are not all held until the end of the backward) and makes their clipped sum a
    contraction; the step then serves
    ``compute_grad1``, ``compute_norms``, ``clip_grads`` and the second moments, but not
    ``compute_kfac``, and only one backward pass of each forward.

    The edges hold the autograd graphs of their forwards (and so the hooks' records of them)
    until a backward, :meth:`take` or :meth:`clear` uses them: forwards with grad enabled that
    no backward follows (an evaluation loop without ``torch.no_grad()``) accumulate. A warning
    says so once the edges held reach :data:`STALE_FACTOR` times the most one backward used.
    """

    def __init__(self, model: nn.Module, *, form_on_arrival: bool = False):
        state = add_hooks(model)
        self.edges: list[Any] = []
        self.form_on_arrival = form_on_arrival
        self._state = state
        self._most_used = 0  # the most edges one backward (or take) used
        self._warned = False
        state.listeners.on_clear.append(self.clear)  # a new step: the last one's edges are stale
        state.listeners.on_capture.append(self._record)

    def __getstate__(self) -> dict:
        """A copy (pickling or ``copy.deepcopy`` of a model whose state holds this object) has
        no state or edges."""
        return {**self.__dict__, "_state": None, "edges": []}

    def _record(self, tensor: Tensor) -> None:
        """A tensor whose gradient the hooks capture (told by the capture hook, so only what
        is recorded: not a frozen module's output)."""
        self.edges.append(get_gradient_edge(gradient_tensor(tensor)))
        if not self._warned and self._most_used and \
                len(self.edges) >= STALE_FACTOR * self._most_used:
            self._warned = True
            warnings.warn(
                f"OutputEdges holds {len(self.edges)} output edges of forwards that no backward "
                f"used, {STALE_FACTOR}x what one backward used: forwards with grad enabled and "
                "no backward (an evaluation loop?) keep their autograd graphs and the hooks' "
                "captured inputs until the next backward. Run them under torch.no_grad(), or "
                "drop them with DPSGD.zero_grad() / per_sample_hooks.clear_backprops(model)",
                stacklevel=2)

    def check_due(self) -> bool:
        """Whether the unseen-use check runs on this step (it needs parameter gradients)."""
        unseen = self._state.unseen if self._state is not None else None
        return unseen is not None and unseen.due()

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` to the recorded outputs only (an ordinary ``loss.backward()``
        on a step the unseen-use check runs, and through reentrant activation checkpointing,
        which refuses a backward to given tensors); forget the records."""
        if not self.edges:
            if not loss.requires_grad or self._state is None or \
                    not self._state.model_input_ids:  # the model was not called (with grad)
                disabled = self._state is not None and not self._state.enabled
                raise PerSampleHooksError(
                    "backward: no output of a hooked module was recorded since the last "
                    "backward; run the forward pass with grad enabled first" + (
                        " and the hooks on (they are disabled: disable_hooks)" if disabled
                        else ""))
            # the hooked layers run in the backward (all inside reentrant checkpointing,
            # which recomputes them there), or DPSGD.zero_grad() forgot them: an ordinary one
            loss.backward()
            return
        edges = self.take()
        if self.check_due() or self._state.reentrant_checkpointing:
            loss.backward()
            return
        if self.form_on_arrival:
            self._state.listeners.on_gradient = partial(form_on_arrival, self._state)
        try:
            torch.autograd.backward(loss, inputs=edges)
        except RuntimeError as error:
            if not refused_by_reentrant_checkpointing(error):
                raise
            self._state.reentrant_checkpointing = True
            self._state.end_step()  # the next forward starts a new step
            raise PerSampleHooksError(
                "backward: the model uses reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True), which cannot backpropagate "
                "to given tensors, as this output-edge backward does: this step is lost. The "
                f"next ones take an ordinary backward; {NON_REENTRANT} keeps the faster one"
                ) from error
        finally:
            self._state.listeners.on_gradient = None

    def take(self) -> list[Any]:
        """The edges recorded since the last backward, forgotten here (for a backward of the
        caller's own, e.g. :func:`~per_sample_hooks.curvature.backprop_hess`'s passes)."""
        edges, self.edges = self.edges, []
        self._most_used = max(self._most_used, len(edges))
        return edges

    def captured_passes(self) -> int:
        """How many output gradients the model's hooks hold (all calls, all passes)."""
        return 0 if self._state is None else self._state.captured_passes()

    def clear(self) -> None:
        self.edges = []

    def remove(self) -> None:
        """Stop recording edges (the capture hooks stay)."""
        if self._state is not None:
            if self.clear in self._state.listeners.on_clear:
                self._state.listeners.on_clear.remove(self.clear)
            if self._record in self._state.listeners.on_capture:
                self._state.listeners.on_capture.remove(self._record)
        self.edges = []


__all__ = ["OutputEdges"]
