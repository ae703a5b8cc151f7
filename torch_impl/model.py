"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as PyTorch nn.Modules.

Each module creates its parameters in `__init__` and computes in `forward`; train mode is module
state (`model.train()`, `model.eval()`). The state_dict keys mirror the canonical names of
common/spec/names.py (torch_impl/weights.py transposes nn.Linear's weights).

Masks are boolean, True = may attend, built by the small pure functions below, which mirror
common/spec/masks.py, and shaped to broadcast against the scores (B, h, T_q, T_k).

Shapes: B batch, S source length, T target length, L positions at hand, d = d_model, h heads,
g key/value heads (num_kv_heads; h unless grouped), d_k = d / h (or the config's key_dim),
V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_rosetta.spec.config import TransformerConfig

# -- masks (mirrors of common/spec/masks.py) ------------------------------------------------------


def key_padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, 1, 1, T_k): a key may be attended iff it is not padding."""
    return (ids != pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, 1, 1, T): as key_padding_mask, but position 0 is always visible: it holds BOS, and some
    models (Marian) use the pad id as BOS."""
    first = torch.arange(ids.shape[1], device=ids.device) == 0  # (T,)
    return ((ids != pad_id) | first)[:, None, None, :]


def causal_mask(
    length: int,
    device: torch.device | str | None = None,  # idiom: torch makes a tensor where it is told
) -> Tensor:
    """(1, 1, T, T): query i may attend key j iff j <= i (section 3.2.3)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def decoder_self_mask(tgt_in: Tensor, pad_id: int) -> Tensor:
    """(B, 1, T, T): decoder self-attention is causal and skips padding."""
    return decoder_key_padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1], tgt_in.device)


# -- positions, activations -----------------------------------------------------------------------


# idiom: a float64 table, computed once (Stack keeps it as a buffer) and cast by the caller, so
# that a float64 model gets it to the last bit
def sinusoidal_positions(length: int, d_model: int, layout: str) -> Tensor:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same),
    one row per position, (length, d_model), for any length: sinusoids extrapolate past max_len.

    Deviation, flagged: layout "concatenated" (tensor2tensor, Marian) puts every sin first, then
    every cos, with the same frequencies. Any other layout is a ValueError.
    """
    # rosetta: positions
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)[None, :]  # (1, d/2)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # sin, cos, sin, ...
    if layout == "concatenated":
        return torch.cat([angle.sin(), angle.cos()], dim=-1)
    # rosetta: end
    raise ValueError(f"unknown sinusoid layout {layout!r}")


# idiom: float64 tables, computed once (Stack keeps them as buffers, cast with the model) and
# returned as a (cos, sin) pair, the two factors every rotation multiplies by
def rotary_positions(length: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary positions (Su et al. 2021, RoFormer, Eq. 15): the cosines and sines of
    angle(pos, i) = pos * theta^(-2i / d_k), i = 0 .. d_k/2 - 1, for pos = 0 .. length - 1: two
    tables (length, d_k / 2), for any length (rotations extrapolate past max_len, as sinusoids
    do). docs/FORMAT.md, step 4a."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, head_dim, 2, dtype=torch.float64)[None, :]  # (1, d_k/2)
    angle = pos * torch.pow(float(theta), -two_i / head_dim)  # (L, d_k/2)
    return angle.cos(), angle.sin()


# idiom: heads before positions, x (B, heads, L, d_k): the (L, d_k/2) tables broadcast over
# the batch and the heads
def rotate(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """Rotary positions (Su et al. 2021, Eq. 34): each pair (a, b) of a query's or key's
    dimensions becomes (a cos - b sin, b cos + a sin), by its position's angle. x holds the
    queries or keys of L positions, d_k per head, in the framework's head layout (its `# idiom:`
    says which); cos and sin (L, d_k / 2), in x's dtype (rotary_positions' rows of x's positions).

    "half_split" pairs dimension i with i + d_k/2 (Hugging Face's rotate_half); "interleaved"
    pairs 2i with 2i + 1 (Meta's Llama, RoFormer). Any other layout is a ValueError."""
    if layout == "half_split":
        a, b = x.chunk(2, dim=-1)  # (..., L, d_k/2) each
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    if layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    raise ValueError(f"unknown rotary layout {layout!r}")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,  # Eq. (2): max(0, x)
    "gelu": F.gelu,  # deviation, flagged (ported models): x Phi(x), the exact erf form
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # GELU's tanh approximation
    "silu": F.silu,  # x sigmoid(x) (Elfwing et al. 2018), SwiGLU's gate (Llama)
}


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider: the dtype that the softmax, the norms' statistics and the pooling sums
    run in, even when the model computes in bfloat16."""
    return torch.promote_types(dtype, torch.float32)


# -- attention (Eq. 1) ----------------------------------------------------------------------------


# idiom: heads before positions, q (B, h, T_q, d_k), k and v (B, g, T_k, d_k): the layout that
# F.scaled_dot_product_attention takes, fewer key/value heads included (enable_gqa)
def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    dropout: float,  # idiom: F.dropout takes the probability (0.0 in eval mode)
) -> tuple[Tensor, Tensor]:
    """Eq. (1), section 3.2.1, written out: softmax(Q K^T / sqrt(d_k)) V, with the probabilities
    kept.

    q holds the T_q queries of each of the h heads and k and v the T_k keys and values of each
    of the g key/value heads, in the framework's head layout (its `# idiom:` says which); mask
    broadcasts to (B, h, T_q, T_k); `dropout` drops probabilities before they weight the values.
    Grouped-query attention (Ainslie et al. 2023; multi-query, Shazeer 2019, is g = 1): query
    head n reads key/value head n // (h / g). Returns (context, in q's layout, probabilities
    (B, h, T_q, T_k), post-softmax and pre-dropout). The softmax runs in float32 or wider
    (statistics_dtype), and the probabilities are rounded to q's dtype once.

    Deviation, flagged: masked scores get the finite minimum of the softmax dtype (never -inf,
    which makes a fully masked row NaN) and probabilities are zeroed where the mask is False, so
    a query with no allowed key (a fully padded source) gets a zero context.
    """
    # Each key/value head repeated for its h / g query heads, as SDPA's enable_gqa defines it
    # (Hugging Face's repeat_kv); a copy of g heads only when grouped.
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, h, ...)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, T_q, T_k)
    scores = scores.to(statistics_dtype(scores.dtype))
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1).masked_fill(~mask, 0.0).to(q.dtype)
    context = F.dropout(probs, dropout) @ v  # (B, h, T_q, d_k)
    return context, probs


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    dropout_p: float = 0.0,  # idiom: SDPA applies attention dropout inside the kernel
) -> Tensor:
    """Eq. (1) by the framework's fused attention kernel, which never materialises the
    probabilities: the context, in explicit_attention's layout, fewer key/value heads included.
    The kernels disagree on a query with no allowed key (zeros, a uniform average of the values,
    or NaN); it gets a zero context here, as on the explicit path."""
    # idiom: the kernel is F.scaled_dot_product_attention (SDPA); enable_gqa (torch >= 2.5, the
    # package's floor) takes the g key/value heads as they are, each serving h / g query heads
    grouped = k.shape[1] != q.shape[1]
    context = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=grouped
    )
    # torch 2.13's CPU kernel already returns 0 for a row with no allowed key, but other
    # kernels (CUDA math/efficient) may return NaN, which `where` replaces too.
    has_key = mask.any(dim=-1, keepdim=True)  # (B, 1, T_q or 1, 1)
    return torch.where(has_key, context, 0.0)


# -- sublayer wiring (section 3.1) ----------------------------------------------------------------


def layer_norm(config: TransformerConfig) -> nn.Module:
    """Ba et al. 2016 with the config's epsilon (each framework's default differs, and none is
    the paper's): population variance, eps inside the square root, statistics in float32 or
    wider for bfloat16 inputs. norm_kind "std_plus_eps" is StdPlusEpsNorm, "rms_norm" RMSNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, config.layer_norm_eps)
    if config.norm_kind == "rms_norm":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    # idiom: torch's default eps is 1e-5; its kernels keep float32 statistics for bfloat16
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


class StdPlusEpsNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: scale * (x - mean) / (std + eps) + bias, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Its parameters carry the names of the framework's own LayerNorm, so the checkpoint names do
    not depend on the kind."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        # idiom: nn.LayerNorm's names: weight (the scale) and bias
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in float32 or wider (bfloat16 inputs), as the framework's LayerNorm keeps them.
        y = x.to(statistics_dtype(x.dtype))
        y = (y - y.mean(-1, keepdim=True)) / (y.std(-1, keepdim=True) + self.eps)
        return (self.weight * y + self.bias).to(x.dtype)


# idiom: not nn.RMSNorm: torch 2.13's rms_norm multiplies the gain in float32 and rounds once,
# where Hugging Face's Llama (the spec's order) rounds the normalised x to bfloat16 first
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4): x / sqrt(mean(x^2) + eps) * scale, no mean
    subtracted and no bias (docs/FORMAT.md, step 3). The statistics run in float32 or wider, and
    the normalised x is rounded back to the input's dtype before the gain multiplies it
    (Hugging Face's Llama: `weight * hidden.to(input_dtype)`). The gain carries the name of the
    framework's own RMSNorm (its `# idiom:` says which)."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))  # idiom: nn.RMSNorm's name for the scale
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        y = x.to(statistics_dtype(x.dtype))
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def residual(
    x: Tensor,
    sublayer: Callable[[Tensor], tuple[Tensor, Any]],
    norm: nn.Module,
    dropout: nn.Dropout,
    pre_norm: bool,
) -> tuple[Tensor, Any]:
    """Sections 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation,
    flagged: pre-norm (Wang et al. 2019) computes x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` maps its input to (output, extra); returns (the new x, extra), extra (attention
    probabilities, say) passed through."""
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out)
    return (x if pre_norm else norm(x)), extra


# -- layers ---------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), and Attention from Eq. (1)
    (explicit_attention, fused_attention).

    The h per-head projections W^Q_i are one matrix of h * d_k columns (h * d_k is d_model
    unless the config sets key_dim). Grouped-query attention (Ainslie et al. 2023; num_kv_heads
    g < h, multi-query with g = 1, Shazeer 2019): W^K and W^V have g heads, each read by h / g
    query heads. A self-attention of a rotary model is given its positions' (cos, sin) and
    rotates its queries and keys (Su et al. 2021) after projecting them. Deviation, flagged: a
    query with no allowed key (a fully padded source) gets all-zero probabilities and a zero
    context, so its output is W^O's bias.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, h, d_k, g = config.d_model, config.num_heads, config.head_dim, config.kv_heads
        bias = config.attention_bias
        self.h, self.d_k = h, d_k
        # rosetta: parameters
        # idiom: nn.Linear keeps the heads merged, a (heads * d_k, d) weight; _split_heads splits them
        self.query = nn.Linear(d, h * d_k, bias=bias)
        self.key = nn.Linear(d, g * d_k, bias=bias)
        self.value = nn.Linear(d, g * d_k, bias=bias)
        self.output = nn.Linear(h * d_k, d, bias=config.output_projection_bias)
        # rosetta: end
        # idiom: a probability, not a module: SDPA applies attention dropout itself (dropout_p)
        self.attention_dropout = config.attention_dropout
        self.rotary_layout = config.rotary_layout

    def _split_heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.d_k).transpose(1, 2)  # (B, heads, L, d_k)

    def keys_values(
        self, x_kv: Tensor, rotary: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """K W^K and V W^V of x_kv (B, T_k, d), split into the g key/value heads,
        (B, g, T_k, d_k) each, the keys rotated when `rotary` (cos, sin) is given: what a decode
        cache keeps (decode.py), in the same layout in every implementation."""
        keys = self._split_heads(self.key(x_kv))
        if rotary is not None:
            keys = rotate(keys, *rotary, self.rotary_layout)
        return keys, self._split_heads(self.value(x_kv))

    def forward(
        self,
        x_q: Tensor,
        x_kv: Tensor | None,
        mask: Tensor,
        *,
        return_attention: bool = False,
        kv: tuple[Tensor, Tensor] | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x_q (B, T_q, d) attends x_kv (B, T_k, d) under mask (B, 1, T_q or 1, T_k).

        kv: keys and values already projected (keys_values), (B, g, T_k, d_k) each, taken
        instead of projecting x_kv (a decode cache's, its keys already rotated). rotary: the
        (cos, sin) of the query positions, (T_q, d_k / 2) each in the model's dtype (Stack.rotary),
        for a self-attention of a rotary model, whose keys are at the same positions unless kv
        is given; None rotates nothing. Returns (output (B, T_q, d), probabilities
        (B, h, T_q, T_k) or None): the explicit path when return_attention, otherwise the fused
        kernel, which never materialises them.
        """
        q = self._split_heads(self.query(x_q))  # (B, h, T_q, d_k)
        if rotary is not None:
            q = rotate(q, *rotary, self.rotary_layout)
        k, v = self.keys_values(x_kv, rotary) if kv is None else kv  # (B, g, T_k, d_k) each
        # rosetta: dropout
        p_drop = self.attention_dropout if self.training else 0.0
        # rosetta: end
        if return_attention:
            context, probs = explicit_attention(q, k, v, mask, p_drop)
        else:
            context, probs = fused_attention(q, k, v, mask, dropout_p=p_drop), None
        # rosetta: heads
        b, _, t_q, _ = context.shape
        context = context.transpose(1, 2).reshape(b, t_q, self.h * self.d_k)  # (B, T_q, h d_k)
        # rosetta: end
        return self.output(context), probs


class FeedForward(nn.Module):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with W_1 and b_1 in
    `intermediate` and W_2 and b_2 in `output`. Deviation, flagged: GELU (the exact erf form, or
    its tanh approximation) or SiLU instead of max(0, x) for ported models; the gated
    feed-forward (Shazeer 2020, GLU variants: SwiGLU with SiLU) (act(x W_gate + b_gate) *
    (x W_1 + b_1)) W_2 + b_2, with W_gate and b_gate in `gate`; no biases without
    feed_forward_bias (Llama)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, f, bias = config.d_model, config.d_ff, config.feed_forward_bias
        self.gate = nn.Linear(d, f, bias=bias) if config.gated_feed_forward else None  # W_gate
        self.intermediate = nn.Linear(d, f, bias=bias)  # W_1, b_1
        self.output = nn.Linear(f, d, bias=bias)  # W_2, b_2
        self.activation = config.activation  # a key of ACTIVATIONS, looked up at each call

    def forward(self, x: Tensor) -> Tensor:
        act = ACTIVATIONS[self.activation]
        if self.gate is None:
            return self.output(act(self.intermediate(x)))
        return self.output(act(self.gate(x)) * self.intermediate(x))


class EncoderLayer(nn.Module):
    """Section 3.1, encoder layer: multi-head self-attention, then the position-wise feed-forward
    network, each inside a residual connection with LayerNorm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = layer_norm(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm_position == "pre"

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        *,
        return_attention: bool = False,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, S, d) under mask (B, 1, 1, S) -> (x, self-attention probabilities or None).
        rotary: the positions' (cos, sin) for a rotary model's self-attention (Stack.rotary)."""
        x, probs = residual(
            x,
            lambda y: self.self_attention(
                y, y, mask, return_attention=return_attention, rotary=rotary
            ),
            self.self_attention_norm,
            self.dropout,
            self.pre_norm,
        )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            self.pre_norm,
        )
        return x, probs


# torch decodes in eager Python, so a layer's cache is a typed record whose buffers write_cache
# fills in place; tf.function and jax.jit pass a cache in and out of a compiled step as a nested
# dict of arrays instead.
@dataclasses.dataclass
class LayerCache:  # idiom: a dataclass of buffers written in place, not a dict of arrays
    """One decoder layer's keys and values, split into the g key/value heads (grouped-query
    attention's smaller cache). A decoder-only model's layers have no cross-attention: cross_key
    and cross_value are None."""

    self_key: Tensor  # (N, g, max_steps, d_k), position j written by step j, rotated if rotary
    self_value: Tensor  # (N, g, max_steps, d_k)
    cross_key: Tensor | None  # (N, g, S, d_k), K W^K of the memory
    cross_value: Tensor | None  # (N, g, S, d_k)


def write_cache(buffer: Tensor, new: Tensor, index: Tensor) -> Tensor:
    """Write `new` (N, g, L, d_k), the keys or the values of the L positions index..index+L-1
    (L = 1 in a decoding step, the prompt's length in a prefill), into a decode cache's buffer
    (N, g, max_steps, d_k) at those positions, and return the buffer as written: every
    position's keys or values, for the queries to attend (those not written yet are masked)."""
    # idiom: in place, index_copy_ at an index on the device: copying the max_steps buffer each
    # step would cost more than the step, and the index never goes back to the host
    where = index + torch.arange(new.shape[2], device=new.device)  # (L,)
    return buffer.index_copy_(2, where, new)


class DecoderLayer(nn.Module):
    """Section 3.1, decoder layer: masked self-attention, cross-attention over the encoder
    output, then the feed-forward network, each inside a residual connection with LayerNorm. A
    decoder-only model's layer (GPT, Radford et al. 2018) has no encoder output to attend: no
    cross-attention sublayer (cross_attention and its norm are None), and no parameters for one."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = layer_norm(config)
        if config.has_encoder:
            self.cross_attention = MultiHeadAttention(config)
            self.cross_attention_norm = layer_norm(config)
        else:
            self.cross_attention = self.cross_attention_norm = None
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm_position == "pre"

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_mask: Tensor,
        memory_mask: Tensor | None,
        *,
        return_attention: bool = False,
        cache: LayerCache | None = None,
        index: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, LayerCache | None]:
        """x (B, T, d) over memory (B, S, d), under self_mask (B, 1, T, T) and memory_mask
        (B, 1, 1, S). Returns (x, self-attention probabilities or None, cross-attention
        probabilities or None, the new cache or None). A decoder-only model's layer has no
        cross-attention: memory, memory_mask and the cross probabilities are None.

        Decoding (decode.py) passes this layer's `cache` and the position `index`, a tensor on
        the device: x is then the L positions index..index+L-1 (N, L, d), L = 1 for a step and the
        prompt's length for a prefill. Their self-attention keys and values are written into the
        cache's buffers (write_cache) and the queries attend the whole buffer (self_mask
        (N, 1, L, max_steps) says which keys each may see); cross-attention reads the memory's
        keys and values from the cache, so `memory` is unused. The new cache is this layer's,
        with the buffers as written.

        rotary: the (cos, sin) of x's positions (0..T-1, or index..index+L-1 when decoding) for a
        rotary model's self-attention (Stack.rotary); its cache keeps the rotated keys.
        """

        def self_attention(y: Tensor) -> tuple[Tensor, tuple]:
            kv = None
            if cache is not None:
                keys, values = self.self_attention.keys_values(y, rotary)  # (N, g, L, d_k) each
                keys = write_cache(cache.self_key, keys, index)  # (N, g, max_steps, d_k)
                values = write_cache(cache.self_value, values, index)
                kv = keys, values
            out, probs = self.self_attention(
                y, y, self_mask, return_attention=return_attention, kv=kv, rotary=rotary
            )
            return out, (probs, kv)

        def cross_attention(y: Tensor) -> tuple[Tensor, Tensor | None]:
            kv = None if cache is None else (cache.cross_key, cache.cross_value)
            return self.cross_attention(
                y, memory, memory_mask, return_attention=return_attention, kv=kv
            )

        x, (self_probs, self_kv) = residual(
            x, self_attention, self.self_attention_norm, self.dropout, self.pre_norm
        )
        cross_probs = None
        if self.cross_attention is not None:
            x, cross_probs = residual(
                x, cross_attention, self.cross_attention_norm, self.dropout, self.pre_norm
            )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            self.pre_norm,
        )
        if cache is None:
            return x, self_probs, cross_probs, None
        keys, values = self_kv
        # idiom: the same buffers, written in place, in a new record (dataclasses.replace)
        new_cache = dataclasses.replace(cache, self_key=keys, self_value=values)
        return x, self_probs, cross_probs, new_cache


# -- stacks ---------------------------------------------------------------------------------------


class Stack(nn.Module):
    """What Encoder and Decoder share (section 3.1): the token embedding (section 3.4), the
    positions (section 3.5), BERT's segment table and embedding LayerNorm when the config has
    them, dropout, N = num_layers identical layers and the optional final LayerNorm (pre-norm
    models and torch's nn.Transformer have one). A shared embedding (share_embeddings) is one
    table for both stacks, held as the framework allows (its `# idiom:` says how)."""

    layer_class: type[nn.Module]

    def __init__(
        self,
        config: TransformerConfig,
        num_layers: int,
        vocab_size: int,
        embedding: nn.Embedding | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # idiom: a shared embedding (section 3.4) is the encoder's nn.Embedding, passed in: one
        # Parameter that the state_dict lists under both stacks' keys
        self.embedding = (
            nn.Embedding(vocab_size, config.d_model) if embedding is None else embedding
        )
        self.position_embedding = None
        if config.position_kind == "learned":
            self.position_embedding = nn.Embedding(config.max_len, config.d_model)
        elif config.position_kind == "rotary":
            # Buffers that stay out of the state_dict, as the sinusoids: the self-attentions
            # rotate by these rows (Su et al. 2021); nothing is added to the embeddings.
            cos, sin = rotary_positions(config.max_len, config.head_dim, config.rope_theta)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        else:
            # A buffer that stays out of the state_dict: a function of the config, not a weight.
            table = sinusoidal_positions(config.max_len, config.d_model, config.sinusoid_layout)
            self.register_buffer("sinusoid", table, persistent=False)
        # BERT's embeddings (Devlin et al. 2019, section 3): a segment table, of which the models
        # read row 0 only (they take no segment ids), and a LayerNorm over the summed embeddings.
        self.token_type_embedding = (
            nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        )
        self.embedding_norm = layer_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(num_layers))
        self.final_norm = layer_norm(config) if config.final_norm else None

    def _position_table(self, length: int) -> Tensor:
        """Section 3.5: PE[0..length-1], (length, d): the learned table's rows (check_inputs
        refuses a length past max_len first), or the sinusoids, which extrapolate."""
        c = self.config
        if self.position_embedding is not None:
            return self.position_embedding.weight[:length]
        if length <= self.sinusoid.shape[0]:
            return self.sinusoid[:length]
        # Sinusoids extrapolate (section 3.5): a longer table for this call only.
        return sinusoidal_positions(length, c.d_model, c.sinusoid_layout).to(self.sinusoid.device)

    def _rotary_table(self, length: int) -> tuple[Tensor, Tensor]:
        """rotary_positions' (cos, sin) of positions 0..length-1, (length, d_k / 2) each, in the
        model's dtype, for any length (rotations extrapolate, as sinusoids do)."""
        c = self.config
        # idiom: the buffers' rows, or past max_len a longer table for this call only
        if length <= self.rotary_cos.shape[0]:
            return self.rotary_cos[:length], self.rotary_sin[:length]
        cos, sin = rotary_positions(length, c.head_dim, c.rope_theta)
        return cos.to(self.rotary_cos), sin.to(self.rotary_sin)

    def embed(
        self,
        ids: Tensor,
        *,
        start: Tensor | None = None,
        max_steps: int | None = None,  # idiom: a static table length, so `start` stays on device
    ) -> Tensor:
        """Sections 3.4 and 3.5: Dropout(E[ids] * sqrt(d_model) + PE[start..start+L-1]),
        (B, L, d); start None is 0. A decoding step passes `start` as a tensor (the cache's
        index), so that one compiled step serves every position. Rotary positions add no PE
        here (the self-attentions rotate by Stack.rotary's rows). BERT's additions (Devlin et al.
        2019), when the config has them: row 0 of the segment table joins the sum (the models
        take no segment ids, so every token is of type 0), and an embedding LayerNorm normalises
        the sum before the dropout."""
        c = self.config
        # rosetta: embeddings
        if c.virtual_pad:  # no pad token: pad_id names no row and embeds as zero (FORMAT.md)
            real = ids != c.pad_id  # (B, L)
            x = torch.where(real[..., None], self.embedding(torch.where(real, ids, 0)), 0.0)
        else:
            x = self.embedding(ids)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        # rosetta: end
        if c.position_kind != "rotary":
            if start is None:
                pe = self._position_table(ids.shape[1])  # (L, d)
            else:  # PE[start..start+L-1], rows of a table of max_steps positions (default max_len)
                positions = start + torch.arange(ids.shape[1], device=ids.device)  # (L,)
                pe = self._position_table(c.max_len if max_steps is None else max_steps)
                pe = pe.index_select(0, positions)  # (L, d)
            x = x + pe.to(x.dtype)
        if self.token_type_embedding is not None:
            x = x + self.token_type_embedding.weight[0]  # (d,): every token is of type 0
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x)

    def rotary(
        self,
        length: int,
        *,
        start: Tensor | None = None,
        max_steps: int | None = None,  # idiom: a static table length, so `start` stays on device
    ) -> tuple[Tensor, Tensor] | None:
        """Rotary positions (Su et al. 2021): the (cos, sin) of positions start..start+length-1,
        (length, d_k / 2) each in the model's dtype, that every self-attention of the stack
        rotates its queries and keys by; start None is 0, and a decoding step passes the cache's
        index, as to `embed`. None when the config's positions are not rotary."""
        c = self.config
        if c.position_kind != "rotary":
            return None
        if start is None:
            return self._rotary_table(length)
        positions = start + torch.arange(length, device=start.device)  # (L,)
        cos, sin = self._rotary_table(c.max_len if max_steps is None else max_steps)
        return cos.index_select(0, positions), sin.index_select(0, positions)


class Encoder(Stack):
    """Section 3.1: the encoder, N = num_encoder_layers encoder layers over the embedded
    source."""

    layer_class = EncoderLayer

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding | None = None) -> None:
        super().__init__(config, config.num_encoder_layers, config.src_vocab_size, embedding)

    def forward(
        self, src: Tensor, mask: Tensor, *, return_attention: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor]]:
        """src (B, S) ids under mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention
        probabilities per layer or None, hidden states: the embedding output and every layer's
        output, before the final norm)."""
        x = self.embed(src)
        rotary = self.rotary(src.shape[1])  # (cos, sin) of positions 0..S-1, or None
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, return_attention=return_attention, rotary=rotary)
            attentions.append(probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, attentions if return_attention else None, hidden


class Decoder(Stack):
    """Section 3.1: the decoder, N = num_decoder_layers decoder layers over the embedded target
    (shifted right), each attending the encoder output (a decoder-only model's attend nothing
    else). Decoding with a cache (decode.py) runs its embedding and layers a prompt at a time
    (prefill), then one position at a time (decode_step)."""

    layer_class = DecoderLayer

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding | None = None) -> None:
        super().__init__(config, config.num_decoder_layers, config.tgt_vocab_size, embedding)

    def forward(
        self,
        tgt_in: Tensor,
        memory: Tensor | None,
        self_mask: Tensor,
        memory_mask: Tensor | None,
        *,
        return_attention: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None, list[Tensor]]:
        """tgt_in (B, T) ids (BOS first) over memory (B, S, d), under self_mask (B, 1, T, T) and
        memory_mask (B, 1, 1, S); memory and memory_mask None for a decoder-only model. Returns
        (output (B, T, d), self and cross probabilities per layer or None, hidden states); the
        cross probabilities are an empty list when the layers have no cross-attention."""
        x = self.embed(tgt_in)
        rotary = self.rotary(tgt_in.shape[1])  # (cos, sin) of positions 0..T-1, or None
        self_attentions, cross_attentions, hidden = [], [], [x]
        for layer in self.layers:
            x, self_probs, cross_probs, _ = layer(
                x,
                memory,
                self_mask,
                memory_mask,
                return_attention=return_attention,
                rotary=rotary,
            )
            self_attentions.append(self_probs)
            if layer.cross_attention is not None:
                cross_attentions.append(cross_probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if not return_attention:
            return x, None, None, hidden
        return x, self_attentions, cross_attentions, hidden


def pool(config: TransformerConfig, memory: Tensor, src: Tensor) -> Tensor | None:
    """An encoder-only model's pooled vector (B, d) from its output memory (B, S, d) over the ids
    src (B, S), or None when config.pooling is "none". Not in the paper: "mean" averages the
    non-pad positions (sentence-transformers' mean pooling; a row with none gives zeros, not
    NaN), "first" takes position 0 (BERT's [CLS]); pooled_l2_norm then divides by the L2 norm (a
    zero vector stays zero). The sums run in float32 or wider (statistics_dtype), and the result
    is in memory's dtype."""
    if config.pooling == "none":
        return None
    # The sums in float32 or wider, as the norms keep their statistics (bfloat16 models).
    y = memory.to(statistics_dtype(memory.dtype))
    if config.pooling == "first":
        pooled = y[:, 0]  # (B, d)
    else:
        real = (src != config.pad_id)[:, :, None].to(y.dtype)  # (B, S, 1)
        pooled = (y * real).sum(dim=1) / real.sum(dim=1).clamp_min(1.0)  # (B, d)
    if config.pooled_l2_norm:
        # Not F.normalize, which divides by max(norm, 1e-12) and so leaves a vector of tinier
        # norm short of unit length; only an exact zero is kept as it is.
        length = pooled.square().sum(dim=-1, keepdim=True).sqrt()  # (B, 1)
        pooled = pooled / torch.where(length > 0.0, length, 1.0)
    return pooled.to(memory.dtype)


class Transformer(nn.Module):
    """Section 3, Figure 1: the encoder-decoder Transformer, logits = Decoder(Encoder(src)) W_out,
    with the embedding sharing of section 3.4: share_embeddings gives both stacks one embedding
    matrix, and tie_output makes the pre-softmax projection the target embedding transposed
    (output_bias adds a bias of its own). `encode` and `decode` are separate so that decoding can
    reuse the encoder output.

    The family's halves (docs/FORMAT.md, "The three kinds"): a decoder-only model (GPT;
    num_encoder_layers 0) has `encoder` None and decoder layers without cross-attention; an
    encoder-only one (BERT; num_decoder_layers 0) has `decoder` and the output projection None,
    and returns its encoder output and, when the config pools, a pooled vector.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config) if config.has_encoder else None
        # rosetta: embeddings
        shared = self.encoder.embedding if config.share_embeddings else None
        self.decoder = Decoder(config, shared) if config.has_decoder else None
        self.output = (
            nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.output_bias)
            if config.has_decoder
            else None
        )
        if config.tie_output:
            # idiom: one Parameter under two names (nanoGPT's weight tying): the state_dict lists
            # it under each
            self.output.weight = self.decoder.embedding.weight  # (V, d): logits = y E^T
        # rosetta: end
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """tensor2tensor's initialisation (common/weights/init.py, scheme "paper"), in distribution:
        xavier-uniform kernels, zero biases, embeddings N(0, d_model^-0.5) so that after the
        sqrt(d_model) scale they have unit variance. LayerNorm keeps torch's ones and zeros."""
        if isinstance(module, nn.Linear):
            if not (module is self.output and self.config.tie_output):  # tied: an embedding
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.d_model**-0.5)

    def encode(
        self, src: Tensor, *, return_attention: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor]]:
        """The encoder on source ids src (B, S) under their padding mask: (memory (B, S, d),
        self-attention probabilities per layer or None, hidden states); see Encoder."""
        mask = key_padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        return self.encoder(src, mask, return_attention=return_attention)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor | None,
        src: Tensor | None,
        *,
        return_attention: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None, list[Tensor]]:
        """The decoder on target ids tgt_in (B, T), shifted right behind BOS, over memory
        (B, S, d) whose padding src (B, S) gives (both None for a decoder-only model): (logits
        (B, T, V), self and cross probabilities per layer or None, hidden states); see Decoder."""
        pad = self.config.pad_id
        y, self_attentions, cross_attentions, hidden = self.decoder(
            tgt_in,
            memory,
            decoder_self_mask(tgt_in, pad),  # (B, 1, T, T)
            None if src is None else key_padding_mask(src, pad),  # (B, 1, 1, S)
            return_attention=return_attention,
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: Tensor) -> Tensor:
        """Section 3.4: the pre-softmax linear transformation, (..., d) -> (..., V). Tied
        (tie_output), its weight is the target embedding E, so logits = y E^T, plus the output
        bias when the config has one."""
        return self.output(y)

    def forward(
        self, src: Tensor | None, tgt_in: Tensor | None, *, return_attention: bool = False
    ) -> dict[str, Tensor | list[Tensor] | None]:
        """Teacher-forced forward pass; the keys are the fields of
        transformer_rosetta.spec.results.ForwardOutput. The attention lists are None unless
        return_attention (the explicit path; otherwise the fused kernel throughout); the hidden
        states are always there. A half of the family takes only its own input (src None for
        decoder-only, tgt_in None for encoder-only) and returns None for what it lacks (logits or
        encoder_output, pooled_output) and empty lists for the other half's attention maps and
        hidden states."""
        absent = [] if return_attention else None  # the maps of a half the model lacks
        memory, encoder_attentions, encoder_hidden, pooled = None, absent, [], None
        if self.encoder is not None:
            memory, encoder_attentions, encoder_hidden = self.encode(
                src, return_attention=return_attention
            )
            pooled = pool(self.config, memory, src)
        logits, self_attentions, cross_attentions, decoder_hidden = None, absent, absent, []
        if self.decoder is not None:
            logits, self_attentions, cross_attentions, decoder_hidden = self.decode(
                tgt_in, memory, src, return_attention=return_attention
            )
        return {
            "logits": logits,
            "encoder_output": memory,
            "encoder_self_attention": encoder_attentions,
            "decoder_self_attention": self_attentions,
            "cross_attention": cross_attentions,
            "encoder_hidden_states": encoder_hidden,
            "decoder_hidden_states": decoder_hidden,
            "pooled_output": pooled,
        }
