"""nn.RNN (tanh, relu), nn.LSTM (with ``proj_size``) and nn.GRU, and their cells (nn.RNNCell,
nn.LSTMCell, nn.GRUCell): exact per-sample gradients.

The fused recurrent kernels hide the per-step gate pre-activations, and ``torch.func.vmap`` has
no batching rule for them. The rule re-runs the recurrence written out with the cell's matmuls
(a loop over time steps, batched over samples) from the captured input and initial state, then
backpropagates the captured output gradients (``output``, ``h_n``, ``c_n``) through it once.
With ``P`` the gradients of the gate pre-activations (``[B, T, G]``) of one layer and direction,
``X`` its input (``[B, T, in]``) and ``H`` its previous hidden states (``[B, T, h]``)::

    grad1(weight_ih)[b] = sum_t P[b, t]^T X[b, t]       grad1(bias_ih)[b] = sum_t P[b, t]
    grad1(weight_hh)[b] = sum_t Q[b, t]^T H[b, t]       grad1(bias_hh)[b] = sum_t Q[b, t]
    grad1(weight_hr)[b] = sum_t D[b, t]^T M[b, t]       (LSTM with proj_size)

``Q = P`` for RNN and LSTM; for GRU the ``n`` block of ``Q`` is ``P_n * r`` (the reset gate
multiplies ``W_hn h + b_hn``). ``M`` is ``o * tanh(c)`` and ``D`` the gradient of the projected
hidden state. These are the rule's ``forms.Outer`` forms, from which every quantity
follows. Everything is computed batch first; ``batch_first=False`` and unbatched inputs are
converted inside the rule (``add_hooks``' ``batch_dim`` does not apply to these modules).

PackedSequence inputs are unpacked to a padded batch in the caller's sample order; a mask keeps
the state of a sequence unchanged outside its length (forward direction: held after its end;
reverse direction: the initial state until its last step), exactly as the packed kernels do.

Dropout between layers (``dropout > 0``, ``num_layers > 1``, training mode) draws a random mask
that cannot be reproduced: the rule refuses it (use ``dropout=0`` or ``model.eval()``).

A cell's call is one step, from the state it is given (zero when none): its calls in one
forward (a loop over time steps) are stacked as the positions ``t`` of the sums above, ``X`` and
``H`` being each call's input and given state, and re-run as one batch of steps.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..capture import Call, summed_passes
from ..errors import PerSampleHooksError
from ..forms import Form, Outer, by_parameter, one_group
from .base import Rule, register_rule


@dataclass
class RecurrentInput:
    """One call's input, batch first: ``x [B, T, in]``, ``lengths [B]`` (packed input only),
    initial states ``[L*D, B, h]`` (None when not given) and how the module laid it out."""
    x: Tensor
    lengths: Tensor | None
    h0: Tensor | None
    c0: Tensor | None
    packed: PackedSequence | None
    batched: bool


@dataclass
class DirectionRun:
    """What one layer and direction of the unrolled forward kept for the per-sample sums.

    ``pre [B, T, G]``: gate pre-activations fed by the input (``x W_ih^T + b_ih``, plus ``b_hh``
    for RNN/LSTM), the tensor whose gradient is ``P``. ``states [B, T, h]``: hidden state after
    each step, in time order (stacked from the loop; the gradient source for the next layer).
    GRU: ``reset_gates [B, T, hidden]``. LSTM with projection: ``projection_inputs`` (``M``,
    ``[B, T, hidden]``) and the per-step projected states whose gradients stack to ``D``.
    """
    x: Tensor
    pre: Tensor
    h0: Tensor | None
    states: Tensor
    reverse: bool
    reset_gates: Tensor | None = None
    projection_inputs: Tensor | None = None
    projected_steps: list[Tensor] = field(default_factory=list)


@dataclass
class UnrolledRun:
    """Result of :func:`unrolled_forward`: ``output [B, T, D*h]`` (zero beyond each length),
    ``h_n [L*D, B, h]``, ``c_n [L*D, B, hidden]`` (LSTM) and one :class:`DirectionRun` per
    layer and direction (index ``layer * D + direction``)."""
    output: Tensor
    h_n: Tensor
    c_n: Tensor | None
    directions: list[DirectionRun]


def parameter_names(layer: int, reverse: bool) -> dict[str, str]:
    """``{'w_ih': 'weight_ih_l0_reverse', ...}`` for one layer and direction."""
    suffix = f"_l{layer}" + ("_reverse" if reverse else "")
    return {short: f"{long}{suffix}" for short, long in (
        ("w_ih", "weight_ih"), ("w_hh", "weight_hh"), ("b_ih", "bias_ih"), ("b_hh", "bias_hh"),
        ("w_hr", "weight_hr"))}


def _mode(module: nn.RNNBase | nn.RNNCellBase) -> str:
    """'RNN_TANH', 'RNN_RELU', 'LSTM' or 'GRU'."""
    if isinstance(module, nn.RNNBase):
        return module.mode
    if isinstance(module, nn.LSTMCell):
        return "LSTM"
    if isinstance(module, nn.GRUCell):
        return "GRU"
    return "RNN_RELU" if module.nonlinearity == "relu" else "RNN_TANH"


def _parameter(module: nn.Module, name: str) -> Tensor | None:
    p = getattr(module, name, None)
    return None if p is None else p.detach()


def _step_rnn(pre_t: Tensor, h: Tensor, w_hh: Tensor, relu: bool) -> Tensor:
    a = torch.addmm(pre_t, h, w_hh.t())
    return torch.relu(a) if relu else torch.tanh(a)


def _step_lstm(pre_t: Tensor, h: Tensor, c: Tensor, w_hh: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step: returns ``(o * tanh(c'), c')``, unprojected."""
    i, f, g, o = torch.addmm(pre_t, h, w_hh.t()).chunk(4, 1)  # chunk: one cat in backward
    c_new = torch.addcmul(torch.sigmoid(f) * c, torch.sigmoid(i), torch.tanh(g))
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def _step_gru(pre_t: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None, hidden: int
              ) -> tuple[Tensor, Tensor]:
    """One GRU step: returns ``(h', r)``."""
    gh = h @ w_hh.t() if b_hh is None else torch.addmm(b_hh, h, w_hh.t())
    pre_rz, pre_n = pre_t.split([2 * hidden, hidden], 1)
    gh_rz, gh_n = gh.split([2 * hidden, hidden], 1)
    r, z = torch.sigmoid(pre_rz + gh_rz).chunk(2, 1)
    n = torch.tanh(torch.addcmul(pre_n, r, gh_n))
    return torch.addcmul(n, z, h - n), r


def _run_direction(module: nn.RNNBase, x: Tensor, layer: int, reverse: bool,
                   h0: Tensor | None, c0: Tensor | None, masks: Tensor | None
                   ) -> tuple[DirectionRun, Tensor, Tensor | None]:
    """Unroll one layer and direction over ``x [B, T, in]``; returns the run, ``h_n``, ``c_n``."""
    names = parameter_names(layer, reverse)
    w_ih, w_hh = _parameter(module, names["w_ih"]), _parameter(module, names["w_hh"])
    b_ih, b_hh = _parameter(module, names["b_ih"]), _parameter(module, names["b_hh"])
    w_hr = _parameter(module, names["w_hr"])
    mode, hidden = _mode(module), module.hidden_size
    batch, steps = x.shape[0], x.shape[1]
    state_size = module.proj_size or hidden

    folded_bias = b_ih
    if b_ih is not None and mode != "GRU":
        folded_bias = b_ih + b_hh
    pre = F.linear(x, w_ih, folded_bias)
    if not pre.requires_grad:
        pre.requires_grad_()

    h = h0 if h0 is not None else x.new_zeros(batch, state_size)
    c = None
    if mode == "LSTM":
        c = c0 if c0 is not None else x.new_zeros(batch, hidden)
    states: list[Tensor | None] = [None] * steps
    resets: list[Tensor | None] = [None] * steps
    unprojected: list[Tensor | None] = [None] * steps
    projected: list[Tensor | None] = [None] * steps
    pre_steps = pre.unbind(1)  # one stack in backward, not a zero-filled [B, T, G] per step
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        pre_t = pre_steps[t]
        c_new = None
        if mode == "LSTM":
            m, c_new = _step_lstm(pre_t, h, c, w_hh)
            if w_hr is not None:
                unprojected[t] = m
                h_new = m @ w_hr.t()
                projected[t] = h_new
            else:
                h_new = m
        elif mode == "GRU":
            h_new, resets[t] = _step_gru(pre_t, h, w_hh, b_hh, hidden)
        else:
            h_new = _step_rnn(pre_t, h, w_hh, mode == "RNN_RELU")
        if masks is not None:
            h_new = torch.where(masks[t], h_new, h)
            if c_new is not None:
                c_new = torch.where(masks[t], c_new, c)
        h, c = h_new, c_new
        states[t] = h
    run = DirectionRun(
        x=x, pre=pre, h0=h0, states=torch.stack(states, 1), reverse=reverse,
        reset_gates=torch.stack(resets, 1).detach() if mode == "GRU" else None,
        projection_inputs=torch.stack(unprojected, 1).detach() if w_hr is not None else None,
        projected_steps=projected if w_hr is not None else [])
    return run, h, c


def unrolled_forward(module: nn.RNNBase, x: Tensor, lengths: Tensor | None = None,
                     h0: Tensor | None = None, c0: Tensor | None = None) -> UnrolledRun:
    """The module's forward written out with the cell's matmuls, batch first.

    ``x [B, T, in]``; ``lengths [B]`` for sequences of varying length (steps ``t >= length``
    leave the state unchanged, the output there is zero); ``h0 [L*D, B, h]``, ``c0`` (LSTM)
    optional. Dropout between layers is not applied (the rule refuses it in training mode).
    """
    directions = 2 if module.bidirectional else 1
    masks = None
    if lengths is not None:
        steps = torch.arange(x.shape[1], device=lengths.device)
        masks = (steps[:, None] < lengths[None, :]).to(x.device)[:, :, None]  # [T, B, 1]
    runs, h_n, c_n = [], [], []
    layer_input = x
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            run, h, c = _run_direction(
                module, layer_input, layer, direction == 1,
                None if h0 is None else h0[index], None if c0 is None else c0[index], masks)
            runs.append(run)
            outputs.append(run.states)
            h_n.append(h)
            c_n.append(c)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, 2)
    output = layer_input
    if masks is not None:
        output = output * masks.transpose(0, 1)
    return UnrolledRun(output, torch.stack(h_n), torch.stack(c_n) if c_n[0] is not None else None,
                       runs)


def _argument(call: Call, position: int, name: str) -> object:
    if len(call.args) > position:
        return call.args[position]
    return call.kwargs.get(name)


def _detach(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


def recurrent_input(module: nn.RNNBase, call: Call) -> RecurrentInput:
    """The call's input and initial states, batch first, detached."""
    data = _argument(call, 0, "input")
    hx = _argument(call, 1, "hx")
    h0, c0 = (hx if isinstance(hx, (tuple, list)) else (hx, None))
    h0, c0 = _detach(h0), _detach(c0)
    if isinstance(data, PackedSequence):
        padded, lengths = pad_packed_sequence(
            PackedSequence(data.data.detach(), data.batch_sizes, data.sorted_indices,
                           data.unsorted_indices), batch_first=True)
        return RecurrentInput(padded, lengths, h0, c0, data, True)
    batched = data.dim() == 3
    if not batched:
        x = data.unsqueeze(0)
        h0 = None if h0 is None else h0.unsqueeze(1)
        c0 = None if c0 is None else c0.unsqueeze(1)
    else:
        x = data if module.batch_first else data.transpose(0, 1)
    return RecurrentInput(x, None, h0, c0, None, batched)


def _summed_grad(call: Call, leaf: int) -> Tensor | None:
    passes = call.grads[leaf]
    return summed_passes(passes) if passes else None


def output_grads(module: nn.RNNBase, call: Call, inputs: RecurrentInput
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Captured gradients of ``output`` (``[B, T, D*h]``), ``h_n`` and ``c_n`` (``[L*D, B, *]``);
    None where the loss did not use that output."""
    n_states = 2 if _mode(module) == "LSTM" else 1
    first_state = len(call.grads) - n_states  # PackedSequence output flattens to 4 leaves
    grad_out = _summed_grad(call, 0)
    grad_h = _summed_grad(call, first_state)
    grad_c = _summed_grad(call, first_state + 1) if n_states == 2 else None
    if grad_out is not None:
        if inputs.packed is not None:
            p = inputs.packed
            grad_out = pad_packed_sequence(
                PackedSequence(grad_out, p.batch_sizes, p.sorted_indices, p.unsorted_indices),
                batch_first=True, total_length=inputs.x.shape[1])[0]
        elif not inputs.batched:
            grad_out = grad_out.unsqueeze(0)
        elif not module.batch_first:
            grad_out = grad_out.transpose(0, 1)
    if not inputs.batched:
        grad_h = None if grad_h is None else grad_h.unsqueeze(1)
        grad_c = None if grad_c is None else grad_c.unsqueeze(1)
    return grad_out, grad_h, grad_c


def _hidden_forms(grads: Tensor, run: DirectionRun) -> list[Outer]:
    """``sum_t grads[b, t]^T h_prev[b, t]`` with ``h_prev`` the state before step ``t`` in the
    direction's order; the initial-state term is left out when it is zero."""
    states = run.states.detach()
    if run.reverse:
        forms = [one_group(grads[:, :-1], states[:, 1:])]
        first_grads = grads[:, -1:]
    else:
        forms = [one_group(grads[:, 1:], states[:, :-1])]
        first_grads = grads[:, :1]
    if run.h0 is not None:
        forms.append(one_group(first_grads, run.h0[:, None]))
    return forms


def _hidden_grad(pre_grad: Tensor, reset_gates: Tensor | None) -> Tensor:
    """``Q`` from ``P [B, T, G]``: GRU's ``n`` block times its reset gates ``[B, T, hidden]``."""
    if reset_gates is None:
        return pre_grad
    hidden_grad = pre_grad.clone()
    hidden_grad[..., -reset_gates.shape[-1]:] *= reset_gates
    return hidden_grad


def _direction_forms(module: nn.RNNBase, run: DirectionRun, pre_grad: Tensor,
                     projected_grad: Tensor | None) -> dict[str, list[Outer]]:
    """The forms of one layer and direction, by role (``w_ih``, ``w_hh``, ...)."""
    hidden_grad = _hidden_grad(pre_grad, run.reset_gates)
    forms = {"w_ih": [one_group(pre_grad, run.x.detach())], "w_hh": _hidden_forms(hidden_grad, run),
             "b_ih": [one_group(pre_grad, None)], "b_hh": [one_group(hidden_grad, None)]}
    if projected_grad is not None:
        forms["w_hr"] = [one_group(projected_grad, run.projection_inputs)]
    return forms


def call_forms(module: nn.RNNBase, call: Call, names: Sequence[str]
               ) -> list[tuple[str, Outer]]:
    """``(parameter name, form)`` of one call for the parameters in ``names``: the backward
    through the re-run stops at the lowest layer with a parameter in ``names``; a direction
    whose output did not reach the loss has zero gradients."""
    inputs = recurrent_input(module, call)
    grad_out, grad_h, grad_c = output_grads(module, call, inputs)
    directions = 2 if module.bidirectional else 1
    with torch.enable_grad():
        run = unrolled_forward(module, inputs.x, inputs.lengths, inputs.h0, inputs.c0)
        outputs, seeds = [], []
        for tensor, seed in ((run.output, grad_out), (run.h_n, grad_h), (run.c_n, grad_c)):
            if seed is not None:
                outputs.append(tensor)
                seeds.append(seed)
        needed, wanted = [], []  # (layer, run, how many gradients it asked for)
        for index, r in enumerate(run.directions):
            roles = parameter_names(index // directions, r.reverse)
            if any(name in names for name in roles.values()):
                wanted.append(r.pre)
                wanted.extend(r.projected_steps)
                needed.append((roles, r, 1 + len(r.projected_steps)))
        grads = torch.autograd.grad(outputs, wanted, seeds, allow_unused=True)
    result = []
    for roles, r, count in needed:
        (pre_grad, *step_grads), grads = grads[:count], grads[count:]
        projected_grad = None
        if pre_grad is None:
            pre_grad = r.pre.new_zeros(r.pre.shape)
        if step_grads:
            projected_grad = torch.stack([torch.zeros_like(p) if g is None else g
                                          for g, p in zip(step_grads, r.projected_steps)], 1)
        for role, forms in _direction_forms(module, r, pre_grad, projected_grad).items():
            if roles.get(role) in names:
                result += [(roles[role], form) for form in forms]
    return result


class RecurrentRule(Rule):
    """Per-sample gradients of nn.RNN / nn.LSTM / nn.GRU by an unrolled re-run (see module doc)."""

    forms_rerun = True

    def own_parameter_names(self, module: nn.RNNBase) -> frozenset[str]:
        return frozenset(module._flat_weights_names)

    def batch_size(self, module: nn.RNNBase, call: Call) -> int:
        data = _argument(call, 0, "input")
        if isinstance(data, PackedSequence):
            return int(data.batch_sizes[0])
        if data.dim() == 2:
            return 1
        return data.shape[0 if module.batch_first else 1]

    def check(self, module: nn.RNNBase, calls: Sequence[Call], name: str) -> None:
        # Layers below get the real (masked) backprop from autograd: only this module's own
        # trainable parameters need the mask, so a frozen module with dropout is fine.
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if (trainable and module.dropout > 0 and module.num_layers > 1
                and any(c.training for c in calls)):
            raise PerSampleHooksError(
                f"'{name}' ({type(module).__name__}) applies dropout={module.dropout} between its "
                "layers in training mode; its random mask cannot be reproduced, so per-sample "
                "gradients cannot be exact. Construct it with dropout=0 (apply nn.Dropout "
                "outside the module if needed) or run the forward in eval mode")

    def forms(self, module: nn.RNNBase, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        """The recurrence re-run once per call for all parameters in ``names``."""
        return by_parameter((pair for call in calls for pair in call_forms(module, call, names)),
                            names)


for _module_type in (nn.RNN, nn.LSTM, nn.GRU):
    register_rule(_module_type)(RecurrentRule())


def _with_batch(t: Tensor | None, batched: bool) -> Tensor | None:
    """``t`` with its batch dim: an unbatched cell call's tensors as a batch of one."""
    return t if batched or t is None else t.unsqueeze(0)


def _stacked(tensors: Sequence[Tensor | None], shape: tuple[int, int], like: Tensor) -> Tensor:
    """``[B, n, size]`` from one ``[B, size]`` per call (zeros for a None)."""
    return torch.stack([like.new_zeros(shape) if t is None else t for t in tensors], 1)


def cell_forms(module: nn.RNNCellBase, calls: Sequence[Call]) -> dict[str, Outer]:
    """``{parameter name: form}`` of a cell's calls, re-run as one batch of steps: each call's
    input ``X``, given state ``H`` (zero when none; ``c`` too for LSTMCell) and output
    gradients stacked as positions ``[B, n, *]`` (unbatched calls as batch 1)."""
    mode, hidden = _mode(module), module.hidden_size
    inputs, states, cells, grad_h, grad_c = [], [], [], [], []
    for call in calls:
        x = _argument(call, 0, "input").detach()
        hx = _argument(call, 1, "hx")
        h, c = (hx if isinstance(hx, (tuple, list)) else (hx, None))
        batched = x.dim() == 2
        inputs.append(_with_batch(x, batched))
        states.append(_with_batch(_detach(h), batched))
        cells.append(_with_batch(_detach(c), batched))
        grad_h.append(_with_batch(_summed_grad(call, 0), batched))
        grad_c.append(_with_batch(_summed_grad(call, 1), batched) if mode == "LSTM" else None)
    x = torch.stack(inputs, 1)
    batch, steps = x.shape[:2]
    h = _stacked(states, (batch, hidden), x)
    w_ih, w_hh = _parameter(module, "weight_ih"), _parameter(module, "weight_hh")
    b_ih, b_hh = _parameter(module, "bias_ih"), _parameter(module, "bias_hh")
    folded_bias = b_ih + b_hh if b_ih is not None and mode != "GRU" else b_ih
    resets = None
    with torch.enable_grad():
        pre = F.linear(x, w_ih, folded_bias).requires_grad_()
        flat_pre, flat_h = pre.flatten(0, 1), h.flatten(0, 1)
        seeds = [_stacked(grad_h, (batch, hidden), x).flatten(0, 1)]
        if mode == "LSTM":
            c = _stacked(cells, (batch, hidden), x).flatten(0, 1)
            outputs = list(_step_lstm(flat_pre, flat_h, c, w_hh))
            seeds.append(_stacked(grad_c, (batch, hidden), x).flatten(0, 1))
        elif mode == "GRU":
            h_new, resets = _step_gru(flat_pre, flat_h, w_hh, b_hh, hidden)
            outputs = [h_new]
            resets = resets.detach().view(batch, steps, hidden)
        else:
            outputs = [_step_rnn(flat_pre, flat_h, w_hh, mode == "RNN_RELU")]
        (pre_grad,) = torch.autograd.grad(outputs, pre, seeds)
    hidden_grad = _hidden_grad(pre_grad, resets)
    forms = {"weight_ih": one_group(pre_grad, x), "weight_hh": one_group(hidden_grad, h)}
    if b_ih is not None:
        forms.update(bias_ih=one_group(pre_grad, None), bias_hh=one_group(hidden_grad, None))
    return forms


class CellRule(Rule):
    """Per-sample gradients of nn.RNNCell / nn.LSTMCell / nn.GRUCell (see module doc)."""

    forms_rerun = True
    copy_outputs = True  # LSTMCell's h' is computed from its c' (on CPU; fused on CUDA)
    parameter_names = frozenset({"weight_ih", "weight_hh", "bias_ih", "bias_hh"})

    def batch_size(self, module: nn.RNNCellBase, call: Call) -> int:
        data = _argument(call, 0, "input")
        return data.shape[0] if data.dim() == 2 else 1

    def forms(self, module: nn.RNNCellBase, calls: Sequence[Call], names: Sequence[str]
              ) -> dict[str, list[Form]]:
        forms = cell_forms(module, calls)
        return {name: [forms[name]] for name in names}


for _module_type in (nn.RNNCell, nn.LSTMCell, nn.GRUCell):
    register_rule(_module_type)(CellRule())
