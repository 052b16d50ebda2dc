"""Raw parameters of a module that has children (class tokens, position embeddings, LayerScale
gammas, a learned bias): the children keep their rules, the uses of the raw parameters in the
module's own code are followed (per_sample_hooks/raw_uses.py, rules/raw_parameters.py). Every
quantity against the float64 per-sample loop, float32 and float64; each use that cannot be
followed is refused with what to do. Leaves (raw parameters, no children) are followed too, a
call whose uses cannot be re-run by the torch.func fallback."""
from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from models import TimmLikeViT
from norms_truth import assert_float32_matches, loop_clipped, loop_norms
from torch import Tensor, nn

import per_sample_hooks as psh
from ground_truth import (
    assert_matches_loop,
    loop_grads,
    loop_grads_of,
    loop_tolerance,
    weighted_square,
)
from per_sample_hooks.dp import DPSGD
from per_sample_hooks.rules.linear import LinearRule

OUTSIDE = torch._C._len_torch_function_stack()
"""Torch function modes active outside the library: torch's device mode under
``PSH_TEST_DEVICE`` (conftest.py), none otherwise."""

# ----------------------------------------------------------------------------- models


class ViTLike(nn.Module):
    """Patch convolution, class token ``expand`` + ``cat``, position embeddings added, dropout
    (p=0), then a Linear head: ViT's embeddings with a head."""

    def __init__(self, d: int = 6, patch: int = 4, image: int = 8):
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, patch)
        positions = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, positions, d))
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x).flatten(2).transpose(1, 2)
        h = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), h), dim=1)
        h = self.drop(h + self.pos_embed)
        return self.head(torch.tanh(h))


class LayerScaleBlock(nn.Module):
    """CaiT / ConvNeXt style: gammas owned by the block, around a norm and an MLP."""

    def __init__(self, d: int = 5):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma_1 = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.gamma_2 = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.gamma_1 * self.mlp(self.norm(x))
        return x + self.mlp(x) * self.gamma_2


class LearnedBias(nn.Module):
    """A Linear without bias and a bias of the module's own, added with ``+``."""

    def __init__(self, d: int = 4, out: int = 3):
        super().__init__()
        self.lin = nn.Linear(d, out, bias=False)
        self.bias = nn.Parameter(torch.randn(out))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.bias


class SlicedPositions(nn.Module):
    """``x + pos_embed[:, :T]`` (a slice: pulled back through the recorded ``__getitem__``),
    and a nonlinear function of a raw parameter, ``tanh(scale.T) * 2`` (``.T``: a property)."""

    def __init__(self, d: int = 4, positions: int = 7):
        super().__init__()
        self.lin = nn.Linear(3, d)
        self.pos_embed = nn.Parameter(torch.randn(1, positions, d))
        self.scale = nn.Parameter(torch.randn(d, 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        h = h + self.pos_embed[:, : h.shape[1]]
        return h * (torch.tanh(self.scale.T) * 2)


class UsedTwice(nn.Module):
    """One parameter in two use sites (before and after a child), and a derived value used
    twice (``2 * shift``)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        doubled = self.shift * 2
        h = self.lin(x * self.scale + doubled)
        return torch.tanh(h) * self.scale - doubled


class SeveralOutputs(nn.Module):
    """Values from ops with several outputs: ``torch.max(p, 0)`` (a named tuple) and
    ``p.chunk(2)``, replayed by index."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.p = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: Tensor) -> Tensor:
        first, second = self.p.chunk(2, 0)
        return self.lin(x) * torch.max(self.p, dim=0).values + first * 2 - second


class TokenOnZeros(nn.Module):
    """A class token added to zeros made from the batch (``x.new_zeros``: batched, as
    everything computed from the input) rather than expanded."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.lin = nn.Linear(3, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        token = x.new_zeros(x.shape[0], 1, h.shape[2]) + self.cls_token
        return torch.cat((token, h), dim=1)


class Reused(nn.Module):
    """A block with raw parameters called twice in one forward (its calls' sites summed)."""

    def __init__(self):
        super().__init__()
        self.block = LayerScaleBlock(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(torch.tanh(self.block(x))))




class LeafScale(nn.Module):
    """A learned scale and shift, no children: followed (no re-run)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.gamma.exp()) + self.shift[: x.shape[-1]]


class HandNorm(nn.Module):
    """A normalization written by hand (RMS, then a weight); ``layer=True`` applies the weight
    to ``F.layer_norm``'s output by ``einsum`` instead, a use that is not followed: that call is
    re-run by the torch.func fallback."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: Tensor, layer: bool = False) -> Tensor:
        if layer:
            return torch.einsum("...d,d->...d", F.layer_norm(x, x.shape[-1:]), self.weight)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class TwoWays(nn.Module):
    """HandNorm called twice in one forward, once followed and once re-run."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = HandNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(torch.sin(self.norm(self.lin(x))), layer=True) * x


class CustomLinear(nn.Module):
    """A Linear written by hand: ``F.linear`` of raw parameters, followed as a Linear layer."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.randn(d_out)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearUses(nn.Module):
    """Raw weights in ``F.linear`` on the batch: on a child's output and on the input (the
    weight used twice, once without the bias), then a CustomLinear leaf."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.w = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.randn(4))
        self.out = CustomLinear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(F.linear(self.norm(x), self.w, self.b)) + F.linear(x, self.w)
        return self.out(h)


class MatmulUses(nn.Module):
    """Raw weights in ``x @ w`` on the batch: ``w [in, out]`` itself and each way of writing
    the transpose of ``w [out, in]``, around a child."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.w_in_out = nn.Parameter(torch.randn(3, 4))
        self.w_t, self.w_T, self.w_mT, self.w_transpose, self.w_dims = (
            nn.Parameter(torch.randn(4, 3)) for _ in range(5))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return torch.tanh(h @ self.w_in_out + x @ self.w_t.t()) * (h @ self.w_T.T) \
            + torch.matmul(h, self.w_mT.mT) - x @ self.w_transpose.transpose(0, 1) \
            + h @ self.w_dims.transpose(dim0=-1, dim1=-2)


class EinsumNorm(HandNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x, layer=True)


class ReadsChildMetadata(nn.Module):
    """CLIPVisionEmbeddings' pattern: the child's weight read for its dtype and shape, and a
    detached copy of it: none of them a use that a gradient flows back through."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.gamma = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.lin.weight
        h = self.lin(x.to(dtype=weight.dtype))
        assert h.shape[-1] == weight.shape[0] == weight.size(0) and weight.dim() == 2
        return torch.tanh(h * self.gamma + weight.detach().sum())


class FrozenChildWeightInOwnCode(nn.Module):
    """A frozen child's weight used in the module's own code (a constant there), next to a
    raw parameter met with the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.lin.weight.requires_grad_(False)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(F.linear(self.lin(x), self.lin.weight) * self.gamma)


class MixesPositions(nn.Module):
    """einops' ``EinMix('b (t p) d -> b t k')``: a parameter-free child (its ``Rearrange``)
    splits the positions, then an einsum with the raw weight, which no use site follows: the
    module is re-run by the fallback, its child inside (it was refused, as a module whose
    children are hooked apart)."""

    def __init__(self, d: int = 3, k: int = 2):
        super().__init__()
        self.pre_rearrange = nn.Unflatten(1, (1, 2))
        self.weight = nn.Parameter(torch.randn(2, d, k))
        self.bias = nn.Parameter(torch.randn(k))

    def forward(self, x: Tensor) -> Tensor:  # [B, 2, d] -> [B, 1, k]
        return torch.einsum("btpd,pdk->btk", self.pre_rearrange(x), self.weight) + self.bias


LEAVES = {"scale": lambda: nn.Sequential(nn.Linear(3, 4), LeafScale(4)),
          "parameter_free_child": lambda: nn.Sequential(nn.Linear(3, 3), MixesPositions()),
          "custom_linear": lambda: nn.Sequential(CustomLinear(3, 4), nn.Tanh(),
                                                 CustomLinear(4, 2, bias=False)),
          "hand_norm": lambda: nn.Sequential(HandNorm(3), nn.Linear(3, 4)),
          "einsum_norm": lambda: nn.Sequential(nn.Linear(3, 3), nn.Tanh(), EinsumNorm(3)),
          "two_ways": lambda: nn.Sequential(nn.Linear(3, 4), TwoWays(4))}


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: a BatchNorm2d subclass with its own forward (``F.batch_norm`` of its raw
    parameters) and parameterless children; so are GroupNormAct and LayerNormAct2d."""

    def __init__(self, channels: int):
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        training = self.training or self.running_mean is None
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         training, self.momentum, self.eps)
        return self.act(self.drop(x))


class GroupNormAct(nn.GroupNorm):
    def __init__(self, channels: int):
        super().__init__(2, channels)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class LayerNormAct2d(nn.LayerNorm):
    def __init__(self, channels: int):
        super().__init__(channels)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                         self.eps).permute(0, 3, 1, 2)
        return self.act(x)


def norm_act_net(norm: type[nn.Module]) -> nn.Module:
    """A conv, a NormAct layer with trained-looking statistics and affine values, a head."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), norm(4), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.normal_()
        if isinstance(model[1], nn.BatchNorm2d):
            model[1].running_mean.normal_(), model[1].running_var.uniform_(0.5, 2)
    return model.eval()


def images(batch: int) -> list[Tensor]:
    return [torch.randn(batch, 3, 8, 8)]


class PicksItsOwnRows(nn.Module):
    """Rows picked along the batch dim in their own order (``h[torch.arange(B), -1]``, a
    classifier's last-token pooling; ``index_select`` of ``arange(B)``) and scattered into the
    rows of a batched value: the batch's rows still, followed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.gamma, self.beta = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):  # [B, T, 3]
        h = self.lin(x)
        rows = torch.arange(h.shape[0])
        pooled = h[rows, -1].index_select(0, rows) * self.gamma
        return torch.zeros_like(pooled).index_add_(0, rows.flip(0), pooled.flip(0)) + self.beta


class Latents(nn.Module):
    """Perceiver's latents: a module called with the batch size only, an int, which expands its
    raw parameter to the batch (no tensor input to read the batch from)."""

    def __init__(self, n=3, dim=4):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n, dim))

    def forward(self, batch_size: int):
        return self.latents.expand(batch_size, -1, -1)


class LatentsAttend(nn.Module):
    """Latents attending over each sample's inputs."""

    def __init__(self, dim=4):
        super().__init__()
        self.embeddings, self.key = Latents(dim=dim), nn.Linear(dim, dim)

    def forward(self, x):  # [B, T, d]
        latents = self.embeddings(batch_size=x.shape[0])
        scores = (latents @ self.key(x).transpose(1, 2)).softmax(-1)
        return latents + scores @ x


class ExpandedOverPositions(nn.Module):
    """A token and a gate expanded over the positions, not the batch, then added to the batch
    ``[B, T, d]``: by hand (``tok[0].expand(T, -1)``), as einops' ``repeat(tok, '1 1 d -> 1 t
    d')`` does it (to ``[d]``, expanded to ``[T, d]``, reshaped to ``[1, T, d]``), and through
    an op of two such expands before the batch. Where T == B (5 positions in a batch of 5) each
    expand has the batch's size at batch_dim, like ``cls_token.expand(B, -1, -1)``: the batch
    meets it at dim 1, so it was over the positions after all."""

    def __init__(self, d=4):
        super().__init__()
        self.proj, self.head = nn.Linear(3, d), nn.Linear(d, 2)
        self.tok = nn.Parameter(torch.randn(1, 1, d))
        self.gate = nn.Parameter(torch.randn(d))

    def forward(self, x):  # [B, T, 3]
        positions = x.shape[1]
        by_hand = self.tok[0].expand(positions, -1)
        einops_like = self.tok.reshape(-1).expand(positions, -1).reshape(1, positions, -1)
        gated = einops_like * self.gate.expand(positions, -1)
        return self.head(self.proj(x) + by_hand + gated)


class CoincidentSizes(ExpandedOverPositions):
    """As many positions as samples (T == B = 5): a token expanded over the positions, then
    over the batch; the same expand plus a position table ``[T, d]`` of its own; a child's
    positions ``wpe(arange(T))`` scaled by a raw parameter (a child's output of T == B rows
    that every sample shares, not the batch's)."""

    def __init__(self, d=4):
        super().__init__(d)
        self.pos = nn.Parameter(torch.randn(5, d))
        self.wpe = nn.Embedding(7, d)

    def forward(self, x):  # [B, 5, 3]
        positions = x.shape[1]
        over_positions = self.tok[0].expand(positions, -1)
        over_batch = over_positions.unsqueeze(0).expand(x.shape[0], -1, -1)
        table = over_positions + self.pos
        shared = self.wpe(torch.arange(positions)) * self.gate
        return self.head(self.proj(x) + over_batch + table + shared)


CASES = {
    "vit": (ViTLike, images),
    "coincident_sizes": (CoincidentSizes, lambda b: [torch.randn(b, 5, 3)]),
    "expanded_over_positions": (ExpandedOverPositions, lambda b: [torch.randn(b, 5, 3)]),
    "expanded_over_other_positions": (ExpandedOverPositions, lambda b: [torch.randn(b, 4, 3)]),
    "latents": (LatentsAttend, lambda b: [torch.randn(b, 5, 4)]),
    "layer_scale": (LayerScaleBlock, lambda b: [torch.randn(b, 3, 5)]),
    "learned_bias": (LearnedBias, lambda b: [torch.randn(b, 2, 4)]),
    "sliced_positions": (SlicedPositions, lambda b: [torch.randn(b, 5, 3)]),
    "used_twice": (UsedTwice, lambda b: [torch.randn(b, 3, 4)]),
    "token_on_zeros": (TokenOnZeros, lambda b: [torch.randn(b, 2, 3)]),
    "several_outputs": (SeveralOutputs, lambda b: [torch.randn(b, 2, 3)]),
    "reused": (Reused, lambda b: [torch.randn(b, 3, 4)]),
    "timm_like": (TimmLikeViT, images),
    "leaves": (lambda: nn.Sequential(nn.Linear(3, 4), LeafScale(4), TwoWays(4)),
               lambda b: [torch.randn(b, 2, 3)]),
    "linear_uses": (LinearUses, lambda b: [torch.randn(b, 2, 3)]),
    "matmul_uses": (MatmulUses, lambda b: [torch.randn(b, 2, 3)]),
    "reads_child_metadata": (ReadsChildMetadata, lambda b: [torch.randn(b, 2, 3)]),
    "frozen_child_weight": (FrozenChildWeightInOwnCode, lambda b: [torch.randn(b, 2, 3)]),
    "picks_its_own_rows": (PicksItsOwnRows, lambda b: [torch.randn(b, 2, 3)]),
}


def frozen_cls_token() -> ViTLike:
    model = ViTLike()
    model.cls_token.requires_grad_(False)
    return model


CASES["frozen"] = (frozen_cls_token, images)
for _norm in (BatchNormAct2d, GroupNormAct, LayerNormAct2d):
    CASES[_norm.__name__] = (lambda norm=_norm: norm_act_net(norm), images)


# ----------------------------------------------------------------------------- helpers

def tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=2e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)


def losses_of(output: Tensor) -> Tensor:
    return weighted_square(output)


def reduce(losses: Tensor, loss_type: str) -> Tensor:
    return losses.mean() if loss_type == "mean" else losses.sum()


def truth(model: nn.Module, inputs: list[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """The float64 loop on a copy: total norms [B] and per-sample gradients."""
    reference = copy.deepcopy(model).double()
    inputs = [x.double() for x in inputs]
    total, _, grads = loop_norms(reference, inputs, losses_of, "mean")
    return total, grads


def assert_close(got: dict[str, Tensor], expected: dict[str, Tensor], dtype: torch.dtype
                 ) -> None:
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n].double(), expected[n], **tolerance(dtype),
                                   msg=lambda m, n=n: f"{n}: {m}")


def assert_sequence_first_matches(model: nn.Module, x: Tensor) -> None:
    """grad1 of a model of ``[T, B, ...]`` inputs (``batch_dim=1``) against the float64 loop."""
    with psh.add_hooks(model, batch_dim=1):
        weighted_square(model(x).transpose(0, 1)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    expected = loop_grads_of(model, ([x[:, i:i + 1]] for i in range(x.shape[1])),
                             lambda out: weighted_square(out.transpose(0, 1)))
    assert_close(got, expected, torch.float64)


def no_units(model: nn.Module) -> None:
    state = psh.add_hooks(model)
    assert state.units == set()
    psh.remove_hooks(model)


# ----------------------------------------------------------------------------- quantities

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_type", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_grad1_norms_and_clipping_match_the_loop(case, loss_type, dtype):
    """grad1, compute_norms (total and per parameter) and clip_grads of one backward, against
    the float64 loop; no module is a unit of the torch.func fallback."""
    build, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = build().to(dtype)
    inputs = [x.to(dtype) for x in make_inputs(5)]
    no_units(model)
    total, grads = truth(model, inputs)
    with psh.add_hooks(model, check_unseen="always"):
        model.zero_grad(set_to_none=True)
        reduce(losses_of(model(*inputs)), loss_type).backward()
        norms = psh.compute_norms(model, loss_type)
        per_param = psh.compute_norms(model, loss_type, per_param=True)
        psh.compute_grad1(model, loss_type)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters() if p.requires_grad}
        clipped_norms = psh.clip_grads(model, 0.5, loss_type)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert_close(grad1, grads, dtype)
    torch.testing.assert_close(norms.double(), total, **tolerance(dtype))
    torch.testing.assert_close(clipped_norms.double(), total, **tolerance(dtype))
    assert_close(per_param, {n: g.flatten(1).norm(dim=1) for n, g in grads.items()}, dtype)
    assert_close(clipped, loop_clipped(grads, total, 0.5, loss_type), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_a_batch_of_one_leaves_the_gradients_apart(case, dtype):
    """B = 1, where the expand of a raw parameter to the batch is the identity: after the
    backward no ``p.grad`` shares memory with a captured gradient or another ``p.grad`` (a
    reshape's backward handed the parameters views of the watched gradients: ``clip_grads``,
    writing into ``p.grad``, overwrote what it read next, and ``clip_grad_norm_`` scaled
    the shared memory twice), so both give what they give without hooks (the loop's
    clipped mean for ``clip_grads``)."""
    build, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = build().to(dtype)
    inputs = [x.to(dtype) for x in make_inputs(1)]
    plain = copy.deepcopy(model)
    losses_of(plain(*inputs)).mean().backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    total, grads = truth(model, inputs)
    with psh.add_hooks(model) as state:
        for clip in ("torch", "psh"):
            model.zero_grad(set_to_none=True)
            losses_of(model(*inputs)).mean().backward()
            memory = {t.untyped_storage().data_ptr() for calls in state.calls.values()
                      for call in calls for passes in (*call.grads, *call.watched)
                      for t in passes}
            for n, p in model.named_parameters():
                if p.grad is not None:
                    address = p.grad.untyped_storage().data_ptr()
                    assert address not in memory, n
                    memory.add(address)
            if clip == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                for p, q in zip(model.parameters(), plain.parameters()):
                    assert (p.grad is None) == (q.grad is None)
                    if p.grad is not None:
                        torch.testing.assert_close(p.grad, q.grad)
                psh.clear_backprops(model)
            else:
                psh.clip_grads(model, 0.5)
    assert_close({n: p.grad for n, p in model.named_parameters() if p.requires_grad},
                 loop_clipped(grads, total, 0.5, "mean"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["vit", "sliced_positions", "timm_like", "frozen", "leaves",
                                  "linear_uses", "matmul_uses", "expanded_over_positions"])
def test_dpsgd_steps_match_the_loop(case, dtype):
    """DPSGD (no noise, lr 0): the first step (checked: an ordinary backward) and the next ones
    (the output-edge backward, which must reach the watched use sites; per-sample gradients
    formed on arrival where that pays) give the loop's clipped mean."""
    build, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = build().to(dtype)
    state = psh.add_hooks(model)
    state.unseen.schedule.budget = 0.0  # checked: the first step only
    dp = DPSGD(model, torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
               max_grad_norm=0.5, dataset_size=20, batch_size=5, accountant=None)
    try:
        for step in range(3):
            inputs = [x.to(dtype) for x in make_inputs(5)]
            dp.zero_grad()
            dp.backward(losses_of(model(*inputs)).mean())
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert all(p.grad is None for p in trainable) == (step > 0)  # the edge backward
            dp.step()
            got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            total, grads = truth(model, inputs)
            assert_close(got, loop_clipped(grads, total, 0.5, "mean"), dtype)
    finally:
        dp.close()
        psh.remove_hooks(model)


def test_transformers_vit_for_image_classification():
    """The tiny transformers ViT, called as model(pixel_values=x, labels=y).loss: its
    embeddings are no unit (the patch convolution keeps its rule) and every row of grad1, the
    norms and the clipped gradient match the loop, float32 and float64."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4,
                                    num_labels=3)
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(0)
        model = transformers.ViTForImageClassification(config).to(dtype)
        x, y = torch.randn(4, 3, 16, 16, dtype=dtype), torch.tensor([0, 2, 1, 2])
        reference = copy.deepcopy(model).double()
        params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        grads = {n: [] for n in params}
        for i in range(4):
            loss = reference(pixel_values=x[i:i + 1].double(), labels=y[i:i + 1]).loss
            for n, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
                grads[n].append(g)
        grads = {n: torch.stack(g) for n, g in grads.items()}
        total = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
        with psh.add_hooks(model, check_unseen="always") as state:
            assert state.units == set()
            assert model.vit.embeddings.patch_embeddings.projection in state.modules
            model(pixel_values=x, labels=y).loss.backward()
            norms = psh.compute_norms(model)
            psh.compute_grad1(model)
            got = {n: p.grad1.clone() for n, p in model.named_parameters()}
            psh.clip_grads(model, 1.0)
            clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert_close(got, grads, dtype)
        torch.testing.assert_close(norms.double(), total, **tolerance(dtype))
        assert_close(clipped, loop_clipped(grads, total, 1.0, "mean"), dtype)


def hooks_on(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
            + len(m._forward_pre_hooks_with_kwargs) for m in model.modules()]


def test_timm_like_model_has_no_unit_and_children_keep_their_rules():
    """Modules with raw parameters nested (the model, its blocks) keep every module below
    them on its own rule; remove_hooks takes every hook away."""
    model = TimmLikeViT()
    with psh.add_hooks(model) as state:
        assert state.units == set()
        rules = {name: type(state.rules[m]).__name__ for m, (name, _) in state.modules.items()}
    assert rules["TimmLikeViT"] == rules["blocks.0"] == "RawParameterRule"
    assert rules["patch_embed.proj"] == "ConvRule" and rules["blocks.1.attn.qkv"] == "LinearRule"
    assert hooks_on(model) == [0] * len(list(model.modules()))


class NoModeInside(nn.Linear):
    """A Linear that checks, as it runs, that no torch function mode is active (with Linear's
    rule: it overrides forward, and a leaf with no rule would be followed itself)."""

    def forward(self, x: Tensor) -> Tensor:
        assert torch._C._len_torch_function_stack() == OUTSIDE, "a mode was active in a child"
        return super().forward(x)


psh.register_rule(NoModeInside)(LinearRule)


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = NoModeInside(3, 3)
        self.bias = nn.Parameter(torch.zeros(3))
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        if self.fail:
            raise ValueError("boom")
        return self.lin(x) + self.bias


def test_children_run_without_the_mode_and_an_exception_leaves_none_behind():
    torch.manual_seed(0)
    model = Failing().double()
    with psh.add_hooks(model):
        model.fail = True
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 3, dtype=torch.double))
        assert torch._C._len_torch_function_stack() == OUTSIDE
        model.fail = False
    assert_matches_loop(model, [torch.randn(4, 3)])
    assert torch._C._len_torch_function_stack() == OUTSIDE


def test_batch_one_and_batch_dim_one():
    """B = 1 (every tensor has the batch's size at dim 0), and the batch at dim 1: the class
    token expanded along dim 1, positions [T, 1, d]."""
    torch.manual_seed(0)
    assert_matches_loop(ViTLike(), images(1))
    assert_matches_loop(TimmLikeViT(), images(1))

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.cls = nn.Parameter(torch.randn(1, 1, 4))
            self.pos = nn.Parameter(torch.randn(6, 1, 4))

        def forward(self, x):  # x [T, B, 3]
            h = torch.cat((self.cls.expand(-1, x.shape[1], -1), self.lin(x)), dim=0)
            return h + self.pos[: h.shape[0]]

    model = SequenceFirst().double()
    x = torch.randn(4, 3, 3, dtype=torch.double)
    assert_sequence_first_matches(model, x)


@pytest.mark.parametrize("case", ["vit", "leaves", "linear_uses", "matmul_uses"])
def test_second_moments_after_backprop_hess(case):
    """Several backward passes (backprop_hess): each pass's use-site gradients are paired with
    its output gradients; the Fisher diagonal is sum_i sum_k J_ik^2 of the loop."""
    build, make_inputs = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x = make_inputs(3)[0].double()
    with psh.add_hooks(model):
        psh.backprop_hess(model(x)[:, 0], "LeastSquares")
        fisher = psh.compute_fisher_diag(model)
    params = dict(model.named_parameters())
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(3):
        out = model(x[i:i + 1])[0, 0]
        for k in range(out.shape[0]):
            rows = torch.autograd.grad(out[k], list(params.values()), retain_graph=True)
            for n, g in zip(params, rows):
                expected[n] += g ** 2
    assert_close(fisher, expected, torch.float64)


def test_hooked_model_pickles_and_the_copy_is_not_hooked():
    torch.manual_seed(0)
    model = ViTLike().double()
    x = images(3)[0].double()
    with psh.add_hooks(model):
        out = model(x)
        for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert torch.equal(copied(x), out)
            assert torch._C._len_torch_function_stack() == OUTSIDE
        out.sum().backward()
        psh.compute_grad1(model)
    assert_matches_loop(copied, [x])


@pytest.mark.parametrize("case", ["vit", "leaves", "linear_uses", "matmul_uses"])
def test_compiled_after_hooking_is_exact(case):
    """Hook, then torch.compile (aot_eager): exact through steps of two batch sizes (leaves:
    one call followed, one re-run)."""
    build, make_inputs = CASES[case]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    psh.add_hooks(model)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        for batch in (4, 4, 2):
            x = make_inputs(batch)[0]
            model.zero_grad(set_to_none=True)
            weighted_square(compiled(x)).sum().backward()
            psh.compute_grad1(model, "sum")
            got = {n: p.grad1.clone() for n, p in model.named_parameters()}
            psh.disable_hooks(model)
            expected = loop_grads(copy.deepcopy(model).double(), [x.double()],
                                  weighted_square, batch)
            psh.enable_hooks(model)
            assert_close(got, expected, torch.float32)
    finally:
        psh.remove_hooks(model)
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- refusals

class ComputedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return self.lin(x) @ (2 * self.weight).T  # a product with a weight computed first


class NoTranspose(ComputedWeight):
    def forward(self, x):
        return self.lin(x) @ self.weight.transpose(1, 1)  # the weight itself, not its transpose


class PassedToChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pos = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return self.lin(x) + self.lin(self.pos)


class Returned(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.lin(x), self.gamma * 2


class ChildWeightInOwnCode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return F.linear(self.lin(x), self.lin.weight) + self.bias


class MixesTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.lin(x)
        return h + self.gamma * h.mean(0)  # every sample's gamma term depends on all samples


class Flipped(MixesTheBatch):
    def forward(self, x):
        return self.lin(x).flip(0) * self.gamma  # sample b's gamma term is in row B - 1 - b


class PermutedToChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):  # B = 4: the head sees the batch's 4 rows, in another order
        return self.head(self.lin(x)[torch.tensor([1, 0, 3, 2])]) * self.gamma


class WritesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):
        scale = self.gamma * 1.0
        scale.mul_(2)
        return self.lin(x) * scale


class ExpandedOverBothDims(MixesTheBatch):
    """One expand of a raw parameter (``[4, 3]``, B = 4) met by the batch at its dim 0 and, as
    positions, at dim 1: no one reading of it is right."""

    def forward(self, x):
        h = self.lin(x)
        expanded = self.gamma.expand(x.shape[0], -1)
        return (h + expanded)[:, None] + h[:, None] * expanded


class ExpandedToChild(ExpandedOverBothDims):
    """An expand of a raw parameter (``[4, 3]``, B = 4) passed to a child, whose output the
    batch meets at dim 1: refused, as a raw value passed to a child is where the sizes
    differ."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)[:, None] + self.child(self.gamma.expand(x.shape[0], -1))


class TransposedLinear(ExpandedOverBothDims):
    """``F.linear`` of the batch moved off batch_dim (``h.t()``, ``[3, B]``) by a raw weight:
    it crashed in compute_grad1 (a reshape to the batch's size); refused as any use the path
    cannot follow."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4))

    def forward(self, x):
        return F.linear(self.lin(x).t(), self.weight).t()


class TokenOnConstant(TokenOnZeros):
    """``torch.zeros(B, 1, d)`` is no batch (made from nothing): the token plus it is still a
    value without the batch, and concatenating it with the batch is refused."""

    def forward(self, x):
        h = self.lin(x)
        token = torch.zeros(x.shape[0], 1, h.shape[2], dtype=x.dtype) + self.cls_token
        return torch.cat((token, h), dim=1)


class Scale(torch.autograd.Function):
    """``x * g`` as a custom autograd Function (its apply is no torch function)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, g):
        return x * g

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, g = ctx.saved_tensors
        return grad * g, (grad * x).sum(0)


class CustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(Scale.apply(self.lin(x), self.gamma))


class LeakySlope(torch.autograd.Function):
    """A learnable-slope activation, ``where(x > 0, x, a * x)``: two ops in its forward, the
    second on a value of the parameter only (its apply is no torch function)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, a):
        return torch.where(x > 0, x, a * x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        return torch.where(x > 0, grad, a * grad), \
            torch.where(x > 0, 0 * grad, grad * x).sum_to_size(a.shape)


class LearnedSlope(nn.Module):
    def __init__(self, dim: int = 3):
        super().__init__()
        self.alpha = nn.Parameter(torch.linspace(0.1, 0.4, dim))

    def forward(self, x):
        return LeakySlope.apply(x, self.alpha)


class LearnedSlopeAfterChild(LearnedSlope):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(LeakySlope.apply(self.lin(x), self.alpha))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("check_unseen", [True, False])
def test_a_parameter_through_a_custom_function_of_several_ops_goes_to_the_fallback(
        check_unseen, dtype):
    """A childless module passing its raw parameter to a custom autograd Function whose
    forward takes two ops: the Function's output was not known to come from the parameter
    (only the first op's was), so the call was followed as one without a use: its grad1
    zeros, refused by the check as samples coupled, silent without it. It is the fallback's
    unit: exact against the float64 loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3), LearnedSlope(), nn.Linear(3, 2)).to(dtype)
    x = torch.randn(5, 6, dtype=dtype)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    with psh.add_hooks(model, check_unseen=check_unseen):
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[n], **loop_tolerance(dtype))


REFUSALS = {
    TokenOnConstant: r"'cls_token' together with the batch in `cat`",
    CustomFunction: r"'gamma' in a computation whose gradient .* custom "
                    r"torch.autograd.Function\?\), then in `tanh`",
    LearnedSlopeAfterChild: r"'alpha' in a computation whose gradient .* custom "
                            r"torch.autograd.Function\?\), then in `tanh`",
    ComputedWeight: r"'weight'.*together with the batch in `matmul`",
    NoTranspose: r"'weight'.*together with the batch in `matmul`",
    PassedToChild: r"passes a value of its raw parameter\(s\) 'pos' to a call of its child 'lin'",
    Returned: r"returns a value of its raw parameter\(s\) 'gamma'",
    ChildWeightInOwnCode: r"uses 'lin.weight', a parameter of a module below it, in `linear`",
    WritesInPlace: r"writes in place .*'gamma' \(`mul_`\)",
    Flipped: r"'gamma' in `mul` on rows that `flip` picked along batch_dim",
    PermutedToChild: r"passes rows that `__getitem__` picked along batch_dim .* to a call of "
                     r"its child 'head'",
    ExpandedOverBothDims: r"expands its raw parameter\(s\) 'gamma' to the batch's size at "
                          r"batch_dim, and the batch meets the result both there and at another",
    ExpandedToChild: r"'gamma' to the batch's size at batch_dim, and the batch meets it at "
                     r"batch_dim in a call of child 'child', and its output at another dim",
    TransposedLinear: r"uses its raw parameter\(s\) 'weight' together with the batch in "
                      r"`linear`",
}


@pytest.mark.parametrize("module", list(REFUSALS), ids=lambda m: m.__name__)
def test_uses_that_cannot_be_followed_are_refused_and_units_is_exact(module):
    """Each use the narrow path cannot follow is refused by compute_* with the module, what
    it did and add_hooks(model, units=[name]); with that, the fallback unit is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), module()).double()
    x = torch.randn(4, 3, dtype=torch.double)
    if issubclass(module, TokenOnZeros):
        model, x = nn.Sequential(nn.Identity(), module()).double(), x.view(4, 1, 3)

    def loss_fn(out):
        out = out if isinstance(out, Tensor) else out[0] + out[1]
        return weighted_square(out)

    for compute in (psh.compute_grad1, psh.compute_norms, lambda m: psh.clip_grads(m, 1.0)):
        with psh.add_hooks(model):
            loss_fn(model(x)).mean().backward()
            with pytest.raises(psh.PerSampleHooksError) as error:
                compute(model)
        message = str(error.value)
        assert f"'1' ({module.__name__}) " in message
        assert re.search(REFUSALS[module], message), message
        assert f"units=['{'' if module is Returned else '1'}']" in message
    if module not in (Returned, Flipped, PermutedToChild, ExpandedOverBothDims, ExpandedToChild,
                      TransposedLinear):  # nor can the loop
        assert_matches_loop(model, [x], loss_fn=loss_fn, units=["1"])


class GaussianDecoder(nn.Module):
    """Returns its mean and its learned log-scale, which its caller combines with the batch;
    ``expand=True`` returns the log-scale expanded to the batch."""

    def __init__(self, expand: bool):
        super().__init__()
        self.fc, self.expand = nn.Linear(2, 3), expand
        self.log_scale = nn.Parameter(torch.linspace(-0.2, 0.3, 3))

    def forward(self, z):
        log_scale = self.log_scale.expand(len(z), -1) if self.expand else self.log_scale
        return self.fc(z), log_scale


class GaussianNLL(nn.Module):
    def __init__(self, expand: bool):
        super().__init__()
        self.enc, self.dec = nn.Linear(3, 2), GaussianDecoder(expand)

    def forward(self, x):
        mean, log_scale = self.dec(torch.tanh(self.enc(x)))
        return 0.5 * ((x - mean) / log_scale.exp()).square() + log_scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_value_of_raw_parameters_returned_to_the_caller_gets_advice_that_works(dtype):
    """A child returning its raw parameter without the batch is refused with two fixes, the
    value expanded to the batch or the calling module as the unit; each is exact."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=dtype)
    model = GaussianNLL(expand=False).to(dtype)
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError) as error:
            psh.compute_grad1(model)
    message = str(error.value)
    assert "'dec' (GaussianDecoder) returns a value of its raw parameter(s) 'log_scale'" in message
    assert "expand(batch_size" in message and "units=['']" in message
    fixed = GaussianNLL(expand=True).to(dtype)
    fixed.load_state_dict(model.state_dict())
    for units, fix in (([], fixed), ([""], model)):
        if dtype == torch.float64:
            assert_matches_loop(fix, [x], units=units)
        else:
            assert_float32_matches(fix, [x], 0.5, units=units)


def test_mixing_the_batch_refused_also_when_positions_match_the_batch():
    """``gamma * h.mean(0)`` with a [B, B] input: shapes alone cannot tell; refused."""
    model = nn.Sequential(MixesTheBatch()).double()
    with psh.add_hooks(model):
        model(torch.randn(3, 3, dtype=torch.double)).sum().backward()
        with pytest.raises(psh.PerSampleHooksError, match="a statistic of every sample"):
            psh.compute_grad1(model)


# ------------------------------------------------- modules with raw parameters and no children

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_are_followed_or_rerun_exactly(leaf, dtype):
    """grad1, norms and clipping against the float64 loop, with leading dims."""
    torch.manual_seed(0)
    model = LEAVES[leaf]().to(dtype)
    x = torch.randn(5, 2, 3, dtype=dtype)
    grads = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    total, _, _ = loop_norms(copy.deepcopy(model).double(), [x.double()], weighted_square,
                             "mean")
    with psh.add_hooks(model) as state:
        assert not state.units
        weighted_square(model(x)).mean().backward()
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    assert_close(got, grads, dtype)
    torch.testing.assert_close(norms.double(), total, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_module_called_in_a_loop_gives_one_summed_form_per_parameter(dtype):
    """A followed module (a scale and a sliced position table) called at each of T steps:
    grad1 and norms match the float64 loop, and its forms are one dense sum per parameter
    (one ``[B, *p]`` held, not T)."""
    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4))
            self.positions = nn.Parameter(torch.randn(6, 4))

        def forward(self, h, t):
            return torch.tanh(h * self.gamma + self.positions[t:t + 1])

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.step, self.inp = Step(), nn.Linear(3, 4)

        def forward(self, x):
            h = self.inp(x)
            for t in range(6):
                h = self.step(h, t)
            return h

    torch.manual_seed(0)
    model, x = Loop().to(dtype), torch.randn(5, 3, dtype=dtype)
    total, _, grads = loop_norms(copy.deepcopy(model).double(), [x.double()], weighted_square,
                                 "mean")
    with psh.add_hooks(model) as state:
        assert not state.units
        weighted_square(model(x)).mean().backward()
        forms = state.rules[model.step].forms(model.step, state.calls[model.step],
                                              ["gamma", "positions"])
        assert len(state.calls[model.step]) == 6
        assert {n: len(parts) for n, parts in forms.items()} == {"gamma": 1, "positions": 1}
        norms = psh.compute_norms(model)
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    assert_close(got, grads, dtype)
    torch.testing.assert_close(norms.double(), total, **tolerance(dtype))


class WeightedLayerSum(nn.Module):
    """transformers' ``use_weighted_layer_sum`` (Wav2Vec2, Whisper classification): a raw
    ``layer_weights`` of the model itself, called by keywords, its loss computed inside."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.layer_weights = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.classifier = nn.Linear(3, 2)

    def forward(self, *, input_values, labels):
        states, hidden = [], input_values
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
            states.append(hidden)
        weights = self.layer_weights.softmax(-1).view(-1, 1, 1)
        pooled = (torch.stack(states, 1) * weights).sum(1).mean(1)
        logits = self.classifier(pooled)
        return F.cross_entropy(logits, labels), logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_model_called_by_keywords_that_returns_its_loss(dtype):
    """Its batch size was read from its first output, the 0-dim loss: a bare IndexError."""
    torch.manual_seed(0)
    model = WeightedLayerSum().to(dtype)
    x, labels = torch.randn(4, 5, 3, dtype=dtype), torch.randint(0, 2, (4,))
    with psh.add_hooks(model):
        model(input_values=x, labels=labels)[0].backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    reference = copy.deepcopy(model).double()
    rows = [torch.autograd.grad(reference(input_values=x[i:i + 1].double(),
                                          labels=labels[i:i + 1])[0], reference.parameters())
            for i in range(4)]
    expected = {n: torch.stack([row[k] for row in rows])
                for k, (n, _) in enumerate(reference.named_parameters())}
    assert_close(got, expected, dtype)


def test_a_norm_act_layer_with_batch_statistics_is_refused_as_batch_norm_is():
    """Not with a unit as the fix, which cannot help (the statistics mix the samples)."""
    model = norm_act_net(BatchNormAct2d).train()
    with psh.add_hooks(model):
        weighted_square(model(*images(4))).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"^'1' \(BatchNormAct2d\) normalizes "
                           r"with batch statistics .*model.eval\(\).*GroupNorm[^,]*$"):
            psh.compute_grad1(model)


def test_which_calls_are_rerun(monkeypatch):
    """A followed call never reaches the torch.func fallback; an unfollowed one does, once."""
    from per_sample_hooks.rules import fallback
    reran = []
    call_grad1 = fallback.call_grad1

    def counted(module, *args):
        reran.append(type(module).__name__)
        return call_grad1(module, *args)

    monkeypatch.setattr(fallback, "call_grad1", counted)
    for leaf, expected in [("scale", []), ("hand_norm", []), ("custom_linear", []),
                           ("two_ways", ["HandNorm"]), ("einsum_norm", ["EinsumNorm"])]:
        reran.clear()  # (a checked step's hooked sums would re-run them once more)
        assert_matches_loop(LEAVES[leaf](), [torch.randn(4, 3)], check_unseen=False)
        assert reran == expected, leaf


def test_dropout_around_a_followed_use_is_exact():
    """Dropout in training around the uses: the sites' gradients come from the step's own
    backward, so the masks are the forward's (the fallback re-run would draw new ones)."""
    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4))

        def forward(self, x):
            return F.dropout(F.dropout(x, 0.5) * self.gamma, 0.3)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Dropped()).double().train()
    reference = copy.deepcopy(model)  # the same masks from the same seed, no hooks
    x = torch.randn(6, 3, dtype=torch.double)
    torch.manual_seed(1)
    losses = weighted_square(reference(x))
    per_sample = [torch.autograd.grad(losses[i], list(reference.parameters()),
                                      retain_graph=True) for i in range(len(x))]
    with psh.add_hooks(model):
        torch.manual_seed(1)
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for k, (n, p) in enumerate(model.named_parameters()):
            expected = torch.stack([g[k] for g in per_sample])  # grad1[i]: sample i's loss
            torch.testing.assert_close(p.grad1, expected, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, n=n: f"{n}: {m}")


def test_linear_uses_are_outer_forms_and_a_frozen_weight_leaves_the_bias():
    """An ``F.linear`` of raw parameters gives a Linear's forms (norms without per-sample
    gradients); with the weight frozen the bias is followed alone."""
    from per_sample_hooks.forms import Outer
    torch.manual_seed(0)
    model = nn.Sequential(CustomLinear(3, 4), nn.Tanh(), CustomLinear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    x = torch.randn(5, 2, 3, dtype=torch.double)
    assert_matches_loop(model, [x])
    single = copy.deepcopy(model).float()
    with psh.add_hooks(single):
        weighted_square(single(x.float())).mean().backward()
        psh.compute_grad1(single)
        got = {n: p.grad1.clone() for n, p in single.named_parameters() if p.requires_grad}
    assert_close(got, loop_grads(model, [x], weighted_square, 5), torch.float32)
    with psh.add_hooks(model) as state:
        weighted_square(model(x)).mean().backward()
        for module, names in ((model[0], ["bias"]), (model[2], ["weight", "bias"])):
            forms = state.rules[module].forms(module, state.calls[module], names)
            assert all(isinstance(f, Outer) for parts in forms.values() for f in parts)
            assert all(len(parts) == 1 for parts in forms.values())


def test_linear_and_elementwise_uses_of_one_weight_and_the_batch_at_dim_one():
    """One weight in F.linear and, sliced, elementwise (an Outer and a Dense form, cross terms
    in the norms); F.linear of a sequence-first batch (batch_dim=1)."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return F.linear(x, self.w) * self.w[:, 0] + self.w.sum()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Mixed())
    for shape in [(5, 3), (5, 2, 3)]:
        x = torch.randn(*shape)
        assert_matches_loop(model, [x])
        assert_float32_matches(copy.deepcopy(model).float(), [x], 0.5)
        total, _, grads = loop_norms(model.double(), [x.double()], weighted_square, "mean")
        with psh.add_hooks(model):
            weighted_square(model(x.double())).mean().backward()
            torch.testing.assert_close(psh.compute_norms(model), total, **tolerance(torch.float64))

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4))

        def forward(self, x):  # [T, B, 3]
            return torch.tanh(F.linear(x, self.w, self.b))

    model = SequenceFirst().double()
    x = torch.randn(6, 3, 3, dtype=torch.double)
    assert_sequence_first_matches(model, x)


def test_linear_uses_under_autocast():
    """A bfloat16 autocast forward of float32 parameters: the kept input of an F.linear comes
    out in the gradients' dtype; within test_dtypes' autocast tolerance of the float64 loop."""
    from test_dtypes import AUTOCAST_RTOL, DEVICE_TYPE, assert_within_precision
    torch.manual_seed(0)
    model, x = LinearUses(), torch.randn(5, 2, 3)
    with psh.add_hooks(model), torch.autocast(DEVICE_TYPE, torch.bfloat16):
        out = model(x)
        assert out.dtype == torch.bfloat16
        weighted_square(out.float()).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 5)
    with torch.autocast(DEVICE_TYPE, torch.bfloat16):
        autocast_loop = loop_grads(model, [x], lambda out: weighted_square(out.float()), 5)
    assert all(got[n].dtype == torch.float32 for n in expected)
    assert_within_precision(got, expected, autocast_loop, AUTOCAST_RTOL)


class LearnedInitialState(nn.Module):
    """A raw parameter of the model itself passed to its LSTM (a learned ``h0``)."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)
        self.h0 = nn.Parameter(torch.randn(1, 1, 4))

    def forward(self, x):
        h0 = self.h0.expand(-1, x.shape[0], -1).contiguous()
        return self.head(self.lstm(x, (h0, torch.zeros_like(h0)))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_refusals_advice_for_the_model_itself_works(dtype):
    """The refusal names the model by its class, ``units=['LearnedInitialState']``; followed
    as written, exact against the loop (before: "not a submodule")."""
    torch.manual_seed(0)
    model, x = LearnedInitialState().to(dtype), torch.randn(4, 5, 3, dtype=dtype)
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError,
                           match=r"units=\['LearnedInitialState'\]"):
            psh.compute_grad1(model)
    expected = loop_grads(copy.deepcopy(model).double(), [x.double()], weighted_square, 4)
    with psh.add_hooks(model, units=["LearnedInitialState"]):
        model.zero_grad(set_to_none=True)
        weighted_square(model(x)).mean().backward()
        psh.compute_grad1(model)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), expected[name], **loop_tolerance(dtype))


class CentredOverTheBatch(nn.Module):
    """torch_geometric's ``LayerNorm(mode='graph')`` called without ``batch``: statistics over
    every row of the batch, then a raw weight (no children: followed op by op)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x - x.mean(0)) / x.std(0) * self.weight


class SoftmaxOverTheBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.randn(3))

    def forward(self, x):
        weights = self.lin(x).softmax(0)  # over the samples
        return self.head(weights) + weights * self.gamma


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("module", [CentredOverTheBatch, SoftmaxOverTheBatch, MixesTheBatch],
                         ids=lambda m: m.__name__)
def test_a_statistic_over_the_batch_before_a_raw_parameter_is_refused(module, dtype):
    """``x - x.mean(0)`` then ``* weight`` was followed as a per-sample use: norms with no
    error (or, re-run per sample, a NaN from one row's std). A statistic over the batch dim
    reaching a use site or a child is refused as batch statistics are, without units advice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), module()).to(dtype)
    with psh.add_hooks(model):
        weighted_square(model(torch.randn(6, 3, dtype=dtype))).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=rf"'1' \({module.__name__}\) .* "
                           r"computed with `\w+` over batch_dim, a statistic of every sample.*"
                           r"per-sample gradients are undefined") as error:
            psh.compute_norms(model)
        assert "units=" not in str(error.value)


class NullLabel(nn.Module):
    """Classifier-free guidance: a learned null embedding (a raw parameter) in place of the
    label embedding where a 0/1 mask says, mixed as ``e * (1 - m) + null * m``; the mask made
    from the labels (``labels``: the batch's rows) or by a factory of B rows (``factory``)."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask = mask
        self.emb, self.head = nn.Embedding(4, 6), nn.Linear(6, 1)
        self.null = nn.Parameter(torch.randn(6))

    def forward(self, y):
        drop = y % 2 == 0 if self.mask == "labels" else torch.arange(len(y)) % 2 == 0
        m = drop[:, None].to(self.null.dtype)
        e = self.emb(y)
        return self.head(e * (1 - m) + self.null * m)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_raw_parameter_mixed_in_by_a_mask_of_the_batchs_rows(dtype):
    """The mask made from the input: exact against the float64 loop. Made by a factory of B
    rows (the path cannot take its rows for the samples'): refused saying so and how."""
    torch.manual_seed(0)
    y = torch.randint(0, 4, (6,))
    model = NullLabel("factory").to(dtype)
    with psh.add_hooks(model):
        weighted_square(model(y)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'null'.*from a tensor that comes "
                           r"from no input \(made in the forward: `torch.rand\(B\)`\)"):
            psh.compute_grad1(model)
    model.mask = "labels"
    with psh.add_hooks(model):
        weighted_square(model(y)).mean().backward()
        psh.compute_grad1(model)
        got = {n: p.grad1.double() for n, p in model.named_parameters()}
    expected = loop_grads(copy.deepcopy(model).double(), [y], weighted_square, 6)
    for name, grads in expected.items():
        torch.testing.assert_close(got[name], grads, **loop_tolerance(dtype))


class GaussianPolicy(nn.Module):
    """An actor-critic with a state-independent ``log_std`` (a raw parameter) and the policy
    built in its forward, as RL code builds it: ``Normal(mu, log_std.exp())`` (torch's
    ``broadcast_all``: ``torch.broadcast_tensors``); ``returns``: ``"both"`` (the policy and
    the value), ``"policy"`` (the policy only)."""

    def __init__(self, returns: str = "both"):
        super().__init__()
        self.trunk, self.mu, self.value = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)
        self.log_std = nn.Parameter(torch.linspace(-0.5, 0.5, 2))
        self.returns = returns

    def forward(self, obs):
        h = torch.tanh(self.trunk(obs))
        policy = torch.distributions.Independent(
            torch.distributions.Normal(self.mu(h), self.log_std.exp()), 1)
        return policy if self.returns == "policy" else (policy, self.value(h).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_policy_built_in_the_forward_from_a_raw_log_std(dtype):
    """``Normal(mu, log_std.exp())`` broadcasts the scale with ``torch.broadcast_tensors``,
    followed as an expand (it was refused as an op the path cannot follow): exact against the
    float64 loop with the value in the loss. A forward that returns the policy alone, or a
    loss without the value (the policy's gradients reach no output the hooks see), is refused
    saying so, and a unit returning the policy too."""
    torch.manual_seed(0)
    model = GaussianPolicy().to(dtype)
    obs, act = torch.randn(6, 4, dtype=dtype), torch.randn(6, 2, dtype=dtype)
    reference = copy.deepcopy(model).double()
    expected = {n: [] for n, _ in reference.named_parameters()}
    for i in range(6):
        policy, value = reference(obs[i:i + 1].double())
        loss = (-policy.log_prob(act[i:i + 1].double()) + value.square()).sum()
        for (n, _), g in zip(reference.named_parameters(),
                             torch.autograd.grad(loss, list(reference.parameters()))):
            expected[n].append(g)
    with psh.add_hooks(model):
        policy, value = model(obs)
        (-policy.log_prob(act) + value.square()).mean().backward()
        psh.compute_grad1(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1.double(), torch.stack(expected[n]),
                                       **loop_tolerance(dtype))
        model.zero_grad()
        policy, _ = model(obs)  # the value not in this loss
        (-policy.log_prob(act)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError, match=r"'GaussianPolicy' \(GaussianPolicy\): "
                           r"a use of its raw parameters .* in 1 backward passes, its outputs "
                           r"in 0.*torch.distributions object it returns"):
            psh.compute_grad1(model)
    for returns, units in (("policy", ()), ("both", ("",))):
        model.returns = returns
        with psh.add_hooks(model, units=[model] if units else ()):
            policy = model(obs)
            policy = policy if returns == "policy" else policy[0]
            (-policy.log_prob(act)).mean().backward()
            with pytest.raises(psh.PerSampleHooksError, match=r"compute_grad1: 'GaussianPolicy' "
                               r"returned a torch.distributions Independent.*build it outside"):
                psh.compute_grad1(model)


class OuterWithRaw(nn.Module):
    """A raw parameter in ``torch.outer`` with the rows (not followed), called on merged rows
    ``[B * T, 4]`` from a ``ModuleList``."""

    def __init__(self):
        super().__init__()
        self.w, self.lin = nn.Parameter(torch.randn(4)), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.outer(x.sum(1), self.w)


class MergesPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.layers = nn.Linear(4, 4), nn.ModuleList([OuterWithRaw()])

    def forward(self, x):
        x = self.inp(x)
        batch, positions, features = x.shape
        x = x.reshape(batch * positions, features)
        for layer in self.layers:
            x = layer(x)
        return x.reshape(batch, positions, features)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merged_rows_refusal_names_no_module_list_as_the_unit(dtype):
    """The refusal of a use on merged rows advised units=['layers'], a ModuleList (which has no
    forward to re-run): it names the nearest module that is called, here the model, which is
    exact as the unit."""
    torch.manual_seed(0)
    model, x = MergesPositions().to(dtype), torch.randn(3, 5, 4, dtype=dtype)
    with psh.add_hooks(model):
        weighted_square(model(x)).mean().backward()
        with pytest.raises(psh.PerSampleHooksError,
                           match=r"'layers.0' saw a multiple of the batch 3.*the model itself, "
                                 r"add_hooks\(model, units=\[''\]\)$"):
            psh.compute_grad1(model)
    model.zero_grad(set_to_none=True)
    assert_matches_loop(model, [x], weighted_square, units=[""])
