"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) in Flax NNX.

Each module creates its parameters eagerly in `__init__`, from an explicit `rngs` stream, and
computes in `__call__`; train mode is module state (`model.train()`, `model.eval()` set each
nnx.Dropout's `deterministic`). Attribute names are the canonical names of common/spec/names.py,
so that the path of every nnx.Param in `nnx.state(model)` joined with "." *is* its canonical name
(jax_impl/weights.py relies on that).

Masks are boolean, True = may attend, built by the small pure functions below, which mirror
common/spec/masks.py, and shaped to broadcast against the scores (B, h, T_q, T_k).

Shapes: B batch, S source length, T target length, L positions at hand, d = d_model, h heads,
g key/value heads (num_kv_heads; h unless grouped), d_k = d / h (or the config's key_dim),
V vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import embedding_names

# -- masks (mirrors of common/spec/masks.py) ------------------------------------------------------


def key_padding_mask(ids: jax.Array, pad_id: int) -> jax.Array:
    """(B, 1, 1, T_k): a key may be attended iff it is not padding."""
    return (ids != pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: jax.Array, pad_id: int) -> jax.Array:
    """(B, 1, 1, T): as key_padding_mask, but position 0 is always visible: it holds BOS, and some
    models (Marian) use the pad id as BOS."""
    # idiom: JAX's functional index update (x.at[i].set) sets position 0. (Built as torch builds
    # it, `| (arange == 0)`, the mask moves XLA's fusion of the softmax under jit, and float64
    # decoder outputs by an ulp.)
    return key_padding_mask(ids, pad_id).at[..., 0].set(True)


def causal_mask(length: int) -> jax.Array:
    """(1, 1, T, T): query i may attend key j iff j <= i (section 3.2.3)."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def decoder_self_mask(tgt_in: jax.Array, pad_id: int) -> jax.Array:
    """(B, 1, T, T): decoder self-attention is causal and skips padding."""
    return decoder_key_padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1])


# -- positions, activations -----------------------------------------------------------------------


# idiom: float64 NumPy, as Flax's own WMT example builds it: `length` is static, so under jit the
# table is a constant, and a float32 model gets the correctly rounded table rather than float32
# sin and cos of rounded angles
def sinusoidal_positions(length: int, d_model: int, layout: str) -> np.ndarray:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same),
    one row per position, (length, d_model), for any length: sinusoids extrapolate past max_len.

    Deviation, flagged: layout "concatenated" (tensor2tensor, Marian) puts every sin first, then
    every cos, with the same frequencies. Any other layout is a ValueError.
    """
    # rosetta: positions
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # (1, d/2)
    angle = pos / np.power(10000.0, two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(length, d_model)
    if layout == "concatenated":
        return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)
    # rosetta: end
    raise ValueError(f"unknown sinusoid layout {layout!r}")


# idiom: float64 NumPy tables, as sinusoidal_positions (a constant under jit, cast with the
# model), returned as a (cos, sin) pair, the two factors every rotation multiplies by
def rotary_positions(length: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Rotary positions (Su et al. 2021, RoFormer, Eq. 15): the cosines and sines of
    angle(pos, i) = pos * theta^(-2i / d_k), i = 0 .. d_k/2 - 1, for pos = 0 .. length - 1: two
    tables (length, d_k / 2), for any length (rotations extrapolate past max_len, as sinusoids
    do). docs/FORMAT.md, step 4a."""
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    two_i = np.arange(0, head_dim, 2, dtype=np.float64)[None, :]  # (1, d_k/2)
    angle = pos * np.power(float(theta), -two_i / head_dim)  # (L, d_k/2)
    return np.cos(angle), np.sin(angle)


# idiom: heads after positions, x (B, L, heads, d_k) (nnx.LinearGeneral's layout): the (L, d_k/2)
# tables broadcast over the heads
def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: str) -> jax.Array:
    """Rotary positions (Su et al. 2021, Eq. 34): each pair (a, b) of a query's or key's
    dimensions becomes (a cos - b sin, b cos + a sin), by its position's angle. x holds the
    queries or keys of L positions, d_k per head, in the framework's head layout (its `# idiom:`
    says which); cos and sin (L, d_k / 2), in x's dtype (rotary_positions' rows of x's positions).

    "half_split" pairs dimension i with i + d_k/2 (Hugging Face's rotate_half); "interleaved"
    pairs 2i with 2i + 1 (Meta's Llama, RoFormer). Any other layout is a ValueError."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (L, 1, d_k/2), against (B, L, heads, d_k/2)
    if layout == "half_split":
        a, b = jnp.split(x, 2, axis=-1)  # (B, L, heads, d_k/2) each
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    if layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    raise ValueError(f"unknown rotary layout {layout!r}")


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,  # Eq. (2): max(0, x)
    # deviation, flagged (ported models): x Phi(x), the exact erf form
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GELU's tanh approximation
    "silu": jax.nn.silu,  # x sigmoid(x) (Elfwing et al. 2018), SwiGLU's gate (Llama)
}


def statistics_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """float32 or wider: the dtype that the softmax, the norms' statistics and the pooling sums
    run in, even when the model computes in bfloat16."""
    return jnp.promote_types(dtype, jnp.float32)


# -- attention (Eq. 1) ----------------------------------------------------------------------------


# idiom: heads after positions, q (B, T_q, h, d_k), k and v (B, T_k, g, d_k): the layout of
# nnx.LinearGeneral's projections and of jax.nn.dot_product_attention, fewer key/value heads
# included
def explicit_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    dropout: nnx.Dropout,
) -> tuple[jax.Array, jax.Array]:
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
    # The h query heads as g groups of h / g, query head n = (n // (h / g), n % (h / g)), each
    # group against its one key/value head, as jax.nn.dot_product_attention groups them: the
    # keys and values are never repeated.
    b, t_q, h, d_k = q.shape
    g = k.shape[2]
    q = q.reshape(b, t_q, g, h // g, d_k)  # (B, T_q, g, h/g, d_k)
    scores = jnp.einsum("bqgnd,bkgd->bgnqk", q, k) / math.sqrt(d_k)  # (B, g, h/g, T_q, T_k)
    scores = scores.reshape(b, h, t_q, -1).astype(statistics_dtype(scores.dtype))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0).astype(q.dtype)
    grouped = dropout(probs).reshape(b, g, h // g, t_q, -1)  # (B, g, h/g, T_q, T_k)
    context = jnp.einsum("bgnqk,bkgd->bqgnd", grouped, v)  # (B, T_q, g, h/g, d_k)
    return context.reshape(b, t_q, h, d_k), probs


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Eq. (1) by the framework's fused attention kernel, which never materialises the
    probabilities: the context, in explicit_attention's layout, fewer key/value heads included.
    The kernels disagree on a query with no allowed key (zeros, a uniform average of the values,
    or NaN); it gets a zero context here, as on the explicit path."""
    # idiom: the kernel is jax.nn.dot_product_attention, which takes g < h key/value heads as they
    # are (grouped-query attention, query head n reading head n // (h / g))
    context = jax.nn.dot_product_attention(q, k, v, mask=mask)
    # The kernel gives a query with no allowed key a uniform average of the values.
    has_key = jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]  # (B, T_q or 1, 1, 1)
    return jnp.where(has_key, context, 0.0)


# -- sublayer wiring (section 3.1) ----------------------------------------------------------------


def layer_norm(config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """Ba et al. 2016 with the config's epsilon (each framework's default differs, and none is
    the paper's): population variance, eps inside the square root, statistics in float32 or
    wider for bfloat16 inputs. norm_kind "std_plus_eps" is StdPlusEpsNorm, "rms_norm" RMSNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, config.layer_norm_eps, dtype=dtype)
    if config.norm_kind == "rms_norm":
        return RMSNorm(config.d_model, config.layer_norm_eps, dtype=dtype)
    # idiom: Flax's default epsilon is 1e-6, and its default (fast) variance, E[x^2] - mean^2,
    # cancels badly: use_fast_variance=False computes E[(x - mean)^2], as the oracle does. Its
    # statistics are float32 for bfloat16 inputs.
    return nnx.LayerNorm(
        config.d_model,
        epsilon=config.layer_norm_eps,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
    )


class StdPlusEpsNorm(nnx.Module):
    """The Annotated Transformer's LayerNorm: scale * (x - mean) / (std + eps) + bias, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Its parameters carry the names of the framework's own LayerNorm, so the checkpoint names do
    not depend on the kind."""

    def __init__(self, d_model: int, eps: float, *, dtype: jnp.dtype) -> None:
        # idiom: nnx.LayerNorm's names: scale and bias
        self.scale = nnx.Param(jnp.ones((d_model,), dtype))
        self.bias = nnx.Param(jnp.zeros((d_model,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 or wider (bfloat16 inputs), as the framework's LayerNorm keeps them.
        y = x.astype(statistics_dtype(x.dtype))
        y = (y - y.mean(-1, keepdims=True)) / (y.std(-1, ddof=1, keepdims=True) + self.eps)
        return (self.scale[...] * y + self.bias[...]).astype(x.dtype)


# idiom: not nnx.RMSNorm: Flax 0.12's multiplies x by rsqrt(ms + eps) * scale in float32 and
# rounds once, where Hugging Face's Llama (the spec's order) rounds the normalised x to bfloat16
# before the gain
class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4): x / sqrt(mean(x^2) + eps) * scale, no mean
    subtracted and no bias (docs/FORMAT.md, step 3). The statistics run in float32 or wider, and
    the normalised x is rounded back to the input's dtype before the gain multiplies it
    (Hugging Face's Llama: `weight * hidden.to(input_dtype)`). The gain carries the name of the
    framework's own RMSNorm (its `# idiom:` says which)."""

    def __init__(self, d_model: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((d_model,), dtype))  # idiom: nnx.RMSNorm's name: scale
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(statistics_dtype(x.dtype))
        y = y * jax.lax.rsqrt(jnp.square(y).mean(-1, keepdims=True) + self.eps)
        return self.scale[...] * y.astype(x.dtype)


def residual(
    x: jax.Array,
    sublayer: Callable[[jax.Array], tuple[jax.Array, Any]],
    norm: nnx.Module,
    dropout: nnx.Dropout,
    pre_norm: bool,
) -> tuple[jax.Array, Any]:
    """Sections 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation,
    flagged: pre-norm (Wang et al. 2019) computes x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` maps its input to (output, extra); returns (the new x, extra), extra (attention
    probabilities, say) passed through."""
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out)
    return (x if pre_norm else norm(x)), extra


# -- layers ---------------------------------------------------------------------------------------


class MultiHeadAttention(nnx.Module):
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

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        # rosetta: parameters
        d, h, d_k, g = config.d_model, config.num_heads, config.head_dim, config.kv_heads
        # idiom: nnx.LinearGeneral keeps heads as an axis, [d, heads, d_k] and [h, d_k, d]: the
        # canonical layout, with no reshapes
        dense = functools.partial(
            nnx.LinearGeneral,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.xavier_uniform(),  # tensor2tensor's, common/weights/init.py
            rngs=rngs,
        )
        bias = config.attention_bias
        self.query = dense(d, (h, d_k), use_bias=bias)
        self.key = dense(d, (g, d_k), use_bias=bias)
        self.value = dense(d, (g, d_k), use_bias=bias)
        self.output = dense((h, d_k), d, axis=(-2, -1), use_bias=config.output_projection_bias)
        # rosetta: end
        self.dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)
        self.rotary_layout = config.rotary_layout

    def keys_values(
        self, x_kv: jax.Array, rotary: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """K W^K and V W^V of x_kv (B, T_k, d), split into the g key/value heads,
        (B, g, T_k, d_k) each, the keys rotated when `rotary` (cos, sin) is given: what a decode
        cache keeps (decode.py), in the same layout in every implementation."""
        k, v = self.key(x_kv), self.value(x_kv)  # (B, T_k, g, d_k)
        if rotary is not None:
            k = rotate(k, *rotary, self.rotary_layout)
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # (B, g, T_k, d_k)

    def __call__(
        self,
        x_q: jax.Array,
        x_kv: jax.Array | None,
        mask: jax.Array,
        *,
        return_attention: bool = False,
        kv: tuple[jax.Array, jax.Array] | None = None,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """x_q (B, T_q, d) attends x_kv (B, T_k, d) under mask (B, 1, T_q or 1, T_k).

        kv: keys and values already projected (keys_values), (B, g, T_k, d_k) each, taken
        instead of projecting x_kv (a decode cache's, its keys already rotated). rotary: the
        (cos, sin) of the query positions, (T_q, d_k / 2) each in the model's dtype (Stack.rotary),
        for a self-attention of a rotary model, whose keys are at the same positions unless kv
        is given; None rotates nothing. Returns (output (B, T_q, d), probabilities
        (B, h, T_q, T_k) or None): the explicit path when return_attention, otherwise the fused
        kernel, which never materialises them.
        """
        q = self.query(x_q)  # (B, T_q, h, d_k)
        if rotary is not None:
            q = rotate(q, *rotary, self.rotary_layout)
        if kv is None:
            k, v = self.key(x_kv), self.value(x_kv)  # (B, T_k, g, d_k)
            if rotary is not None:
                k = rotate(k, *rotary, self.rotary_layout)
        else:  # the cache's (B, g, T_k, d_k), back to (B, T_k, g, d_k)
            k, v = (jnp.swapaxes(t, 1, 2) for t in kv)
        # rosetta: dropout
        dropout_live = not self.dropout.deterministic and self.dropout.rate > 0
        # idiom: explicit also with live attention dropout (the fused kernel has none) and in
        # float64 (jax.nn.dot_product_attention rounds its softmax to float32: 1e-8 > 1e-10 parity)
        if return_attention or dropout_live or q.dtype == jnp.float64:
            context, probs = explicit_attention(q, k, v, mask, self.dropout)
            probs = probs if return_attention else None
        else:
            context, probs = fused_attention(q, k, v, mask), None
        # rosetta: end
        return self.output(context), probs


class FeedForward(nnx.Module):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with W_1 and b_1 in
    `intermediate` and W_2 and b_2 in `output`. Deviation, flagged: GELU (the exact erf form, or
    its tanh approximation) or SiLU instead of max(0, x) for ported models; the gated
    feed-forward (Shazeer 2020, GLU variants: SwiGLU with SiLU) (act(x W_gate + b_gate) *
    (x W_1 + b_1)) W_2 + b_2, with W_gate and b_gate in `gate`; no biases without
    feed_forward_bias (Llama)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, f = config.d_model, config.d_ff
        dense = functools.partial(
            nnx.Linear,
            use_bias=config.feed_forward_bias,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.xavier_uniform(),
            rngs=rngs,
        )
        self.gate = dense(d, f) if config.gated_feed_forward else None  # W_gate, b_gate
        self.intermediate = dense(d, f)  # W_1, b_1
        self.output = dense(f, d)  # W_2, b_2
        self.activation = config.activation  # a key of ACTIVATIONS, looked up at each call

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        if self.gate is None:
            return self.output(act(self.intermediate(x)))
        return self.output(act(self.gate(x)) * self.intermediate(x))


class EncoderLayer(nnx.Module):
    """Section 3.1, encoder layer: multi-head self-attention, then the position-wise feed-forward
    network, each inside a residual connection with LayerNorm."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.self_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attention_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        self.feed_forward = FeedForward(config, dtype=dtype, rngs=rngs)
        self.feed_forward_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.pre_norm = config.norm_position == "pre"

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        *,
        return_attention: bool = False,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
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


def write_cache(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Write `new` (N, g, L, d_k), the keys or the values of the L positions index..index+L-1
    (L = 1 in a decoding step, the prompt's length in a prefill), into a decode cache's buffer
    (N, g, max_steps, d_k) at those positions, and return the buffer as written: every
    position's keys or values, for the queries to attend (those not written yet are masked)."""
    # idiom: arrays are immutable: dynamic_update_slice returns a new buffer
    return jax.lax.dynamic_update_slice_in_dim(buffer, new, index, axis=2)


class DecoderLayer(nnx.Module):
    """Section 3.1, decoder layer: masked self-attention, cross-attention over the encoder
    output, then the feed-forward network, each inside a residual connection with LayerNorm. A
    decoder-only model's layer (GPT, Radford et al. 2018) has no encoder output to attend: no
    cross-attention sublayer (cross_attention and its norm are None), and no parameters for one."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.self_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attention_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        if config.has_encoder:
            self.cross_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
            self.cross_attention_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        else:
            self.cross_attention = self.cross_attention_norm = None
        self.feed_forward = FeedForward(config, dtype=dtype, rngs=rngs)
        self.feed_forward_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.pre_norm = config.norm_position == "pre"

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array | None,
        self_mask: jax.Array,
        memory_mask: jax.Array | None,
        *,
        return_attention: bool = False,
        cache: dict[str, jax.Array] | None = None,
        index: jax.Array | None = None,
        rotary: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict[str, jax.Array] | None]:
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

        def self_attention(y: jax.Array) -> tuple[jax.Array, tuple]:
            kv = None
            if cache is not None:
                keys, values = self.self_attention.keys_values(y, rotary)  # (N, g, L, d_k) each
                keys = write_cache(cache["self_key"], keys, index)  # (N, g, max_steps, d_k)
                values = write_cache(cache["self_value"], values, index)
                kv = keys, values
            out, probs = self.self_attention(
                y, y, self_mask, return_attention=return_attention, kv=kv, rotary=rotary
            )
            return out, (probs, kv)

        def cross_attention(y: jax.Array) -> tuple[jax.Array, jax.Array | None]:
            kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
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
        # idiom: arrays are immutable: a new dict with the new buffers
        new_cache = {**cache, "self_key": keys, "self_value": values}
        return x, self_probs, cross_probs, new_cache


# -- stacks ---------------------------------------------------------------------------------------


def _embedding_param(
    vocab_size: int, config: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs
) -> nnx.Param:
    """[vocab_size, d] drawn from N(0, d^-0.5), so that after the sqrt(d) scale of section 3.4
    the embeddings have unit variance (tensor2tensor)."""
    init = nnx.initializers.normal(config.d_model**-0.5)
    return nnx.Param(init(rngs.params(), (vocab_size, config.d_model), dtype))


class Stack(nnx.Module):
    """What Encoder and Decoder share (section 3.1): the token embedding (section 3.4), the
    positions (section 3.5), BERT's segment table and embedding LayerNorm when the config has
    them, dropout, N = num_layers identical layers and the optional final LayerNorm (pre-norm
    models and torch's nn.Transformer have one). A shared embedding (share_embeddings) is one
    table for both stacks, held as the framework allows (its `# idiom:` says how)."""

    layer_class: type[EncoderLayer | DecoderLayer]

    # idiom: no `embedding`: a shared table is one nnx.Param on the Transformer, passed as `table`
    def __init__(
        self,
        config: TransformerConfig,
        num_layers: int,
        vocab_size: int,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        self.config = config
        self.embedding = (
            None if config.share_embeddings else _embedding_param(vocab_size, config, dtype, rngs)
        )
        self.position_embedding = (
            _embedding_param(config.max_len, config, dtype, rngs)
            if config.position_kind == "learned"
            else None
        )
        # BERT's embeddings (Devlin et al. 2019, section 3): a segment table, of which the models
        # read row 0 only (they take no segment ids), and a LayerNorm over the summed embeddings.
        self.token_type_embedding = (
            _embedding_param(config.type_vocab_size, config, dtype, rngs)
            if config.type_vocab_size
            else None
        )
        self.embedding_norm = (
            layer_norm(config, dtype=dtype, rngs=rngs) if config.embedding_norm else None
        )
        self.layers = nnx.List(
            [self.layer_class(config, dtype=dtype, rngs=rngs) for _ in range(num_layers)]
        )
        self.final_norm = layer_norm(config, dtype=dtype, rngs=rngs) if config.final_norm else None
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def _position_table(self, length: int, dtype: jnp.dtype) -> jax.Array:
        """Section 3.5: PE[0..length-1], (length, d): the learned table's rows (check_inputs
        refuses a length past max_len first), or the sinusoids, which extrapolate."""
        c = self.config
        if self.position_embedding is not None:
            return self.position_embedding[:length]
        return jnp.asarray(sinusoidal_positions(length, c.d_model, c.sinusoid_layout), dtype)

    def _rotary_table(self, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """rotary_positions' (cos, sin) of positions 0..length-1, (length, d_k / 2) each, in the
        model's dtype, for any length (rotations extrapolate, as sinusoids do)."""
        c = self.config
        # idiom: computed for the length at hand, constants under jit (`length` is static)
        cos, sin = rotary_positions(length, c.head_dim, c.rope_theta)
        return jnp.asarray(cos, dtype), jnp.asarray(sin, dtype)

    def embed(
        self,
        ids: jax.Array,
        *,
        start: jax.Array | None = None,
        table: jax.Array,  # idiom: a shared table is one nnx.Param on the Transformer, passed down
        max_steps: int | None = None,  # idiom: jit traces `start`; the table needs a static length
    ) -> jax.Array:
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
            x = jnp.where(real[..., None], jnp.take(table, jnp.where(real, ids, 0), axis=0), 0.0)
        else:
            x = jnp.take(table, ids, axis=0)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        # rosetta: end
        if c.position_kind != "rotary":
            if start is None:
                pe = self._position_table(ids.shape[1], table.dtype)  # (L, d)
            else:  # PE[start..start+L-1], rows of a table of max_steps positions (default max_len)
                rows = c.max_len if max_steps is None else max_steps
                pe = self._position_table(rows, table.dtype)
                pe = jax.lax.dynamic_slice_in_dim(pe, start, ids.shape[1])  # (L, d)
            x = x + pe[None]
        if self.token_type_embedding is not None:
            x = x + self.token_type_embedding[0]  # (d,): every token is of type 0
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x)

    def rotary(
        self,
        length: int,
        *,
        start: jax.Array | None = None,
        dtype: jnp.dtype,  # idiom: a module holds no dtype of its own: the table's is passed
        max_steps: int | None = None,  # idiom: jit traces `start`; the table needs a static length
    ) -> tuple[jax.Array, jax.Array] | None:
        """Rotary positions (Su et al. 2021): the (cos, sin) of positions start..start+length-1,
        (length, d_k / 2) each in the model's dtype, that every self-attention of the stack
        rotates its queries and keys by; start None is 0, and a decoding step passes the cache's
        index, as to `embed`. None when the config's positions are not rotary."""
        c = self.config
        if c.position_kind != "rotary":
            return None
        if start is None:
            return self._rotary_table(length, dtype)
        tables = self._rotary_table(c.max_len if max_steps is None else max_steps, dtype)
        cos, sin = (jax.lax.dynamic_slice_in_dim(t, start, length) for t in tables)
        return cos, sin  # (L, d_k/2) each


class Encoder(Stack):
    """Section 3.1: the encoder, N = num_encoder_layers encoder layers over the embedded
    source."""

    layer_class = EncoderLayer

    # idiom: no `embedding`: a shared table is one nnx.Param on the Transformer, passed as `table`
    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        super().__init__(
            config, config.num_encoder_layers, config.src_vocab_size, dtype=dtype, rngs=rngs
        )

    def __call__(
        self,
        src: jax.Array,
        mask: jax.Array,
        *,
        return_attention: bool = False,
        table: jax.Array,  # idiom: a shared table is one nnx.Param on the Transformer, passed down
    ) -> tuple[jax.Array, list[jax.Array] | None, list[jax.Array]]:
        """src (B, S) ids under mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention
        probabilities per layer or None, hidden states: the embedding output and every layer's
        output, before the final norm)."""
        x = self.embed(src, table=table)
        # (cos, sin) of positions 0..S-1, or None
        rotary = self.rotary(src.shape[1], dtype=table.dtype)
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

    # idiom: no `embedding`: a shared table is one nnx.Param on the Transformer, passed as `table`
    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        super().__init__(
            config, config.num_decoder_layers, config.tgt_vocab_size, dtype=dtype, rngs=rngs
        )

    def __call__(
        self,
        tgt_in: jax.Array,
        memory: jax.Array | None,
        self_mask: jax.Array,
        memory_mask: jax.Array | None,
        *,
        return_attention: bool = False,
        table: jax.Array,  # idiom: a shared table is one nnx.Param on the Transformer, passed down
    ) -> tuple[jax.Array, list[jax.Array] | None, list[jax.Array] | None, list[jax.Array]]:
        """tgt_in (B, T) ids (BOS first) over memory (B, S, d), under self_mask (B, 1, T, T) and
        memory_mask (B, 1, 1, S); memory and memory_mask None for a decoder-only model. Returns
        (output (B, T, d), self and cross probabilities per layer or None, hidden states); the
        cross probabilities are an empty list when the layers have no cross-attention."""
        x = self.embed(tgt_in, table=table)
        # (cos, sin) of positions 0..T-1, or None
        rotary = self.rotary(tgt_in.shape[1], dtype=table.dtype)
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


def pool(config: TransformerConfig, memory: jax.Array, src: jax.Array) -> jax.Array | None:
    """An encoder-only model's pooled vector (B, d) from its output memory (B, S, d) over the ids
    src (B, S), or None when config.pooling is "none". Not in the paper: "mean" averages the
    non-pad positions (sentence-transformers' mean pooling; a row with none gives zeros, not
    NaN), "first" takes position 0 (BERT's [CLS]); pooled_l2_norm then divides by the L2 norm (a
    zero vector stays zero). The sums run in float32 or wider (statistics_dtype), and the result
    is in memory's dtype."""
    if config.pooling == "none":
        return None
    # The sums in float32 or wider, as the norms keep their statistics (bfloat16 models).
    y = memory.astype(statistics_dtype(memory.dtype))
    if config.pooling == "first":
        pooled = y[:, 0]  # (B, d)
    else:
        real = (src != config.pad_id)[:, :, None].astype(y.dtype)  # (B, S, 1)
        pooled = (y * real).sum(axis=1) / jnp.maximum(real.sum(axis=1), 1.0)  # (B, d)
    if config.pooled_l2_norm:
        length = jnp.sqrt((pooled**2).sum(axis=-1, keepdims=True))  # (B, 1)
        pooled = pooled / jnp.where(length > 0.0, length, 1.0)
    return pooled.astype(memory.dtype)


class Transformer(nnx.Module):
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

    def __init__(
        self, config: TransformerConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs
    ) -> None:
        self.config = config
        c = config
        # rosetta: embeddings
        if c.share_embeddings:  # section 3.4: one matrix for both embeddings
            self.shared_embedding = _embedding_param(c.src_vocab_size, c, dtype, rngs)
        # rosetta: end
        self.encoder = Encoder(c, dtype=dtype, rngs=rngs) if c.has_encoder else None
        self.decoder = Decoder(c, dtype=dtype, rngs=rngs) if c.has_decoder else None
        if not c.has_decoder:  # encoder-only: no logits, so no output projection
            self.output = None
        elif not c.tie_output:
            self.output = nnx.Linear(
                c.d_model,
                c.tgt_vocab_size,
                use_bias=c.output_bias,
                dtype=dtype,
                param_dtype=dtype,
                kernel_init=nnx.initializers.xavier_uniform(),
                rngs=rngs,
            )
        elif c.output_bias:  # tied kernel, own bias (Marian's final_logits_bias)
            self.output = nnx.Dict(bias=nnx.Param(jnp.zeros((c.tgt_vocab_size,), dtype)))
        else:
            self.output = None

    # idiom: one nnx.Param per table (state path = canonical name), looked up by role
    def table(self, role: str) -> jax.Array:
        """The matrix that transformer_rosetta.spec.names.embedding_names says `role` reads ("source", "target" or
        "output"), found by its canonical name, e.g. "shared_embedding", "decoder.embedding"."""
        name = embedding_names(self.config)[role]
        return functools.reduce(getattr, name.split("."), self)[...]

    def encode(
        self, src: jax.Array, *, return_attention: bool = False
    ) -> tuple[jax.Array, list[jax.Array] | None, list[jax.Array]]:
        """The encoder on source ids src (B, S) under their padding mask: (memory (B, S, d),
        self-attention probabilities per layer or None, hidden states); see Encoder."""
        mask = key_padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        return self.encoder(
            src, mask, return_attention=return_attention, table=self.table("source")
        )

    def decode(
        self,
        tgt_in: jax.Array,
        memory: jax.Array | None,
        src: jax.Array | None,
        *,
        return_attention: bool = False,
    ) -> tuple[jax.Array, list[jax.Array] | None, list[jax.Array] | None, list[jax.Array]]:
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
            table=self.table("target"),
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: jax.Array) -> jax.Array:
        """Section 3.4: the pre-softmax linear transformation, (..., d) -> (..., V). Tied
        (tie_output), its weight is the target embedding E, so logits = y E^T, plus the output
        bias when the config has one."""
        c = self.config
        # rosetta: embeddings
        if c.tie_output:  # section 3.4: y E^T
            logits = jnp.einsum("...d,vd->...v", y, self.table("output"))
            # rosetta: end
            if c.output_bias:
                logits = logits + self.output.bias
            return logits
        return self.output(y)

    def __call__(
        self, src: jax.Array | None, tgt_in: jax.Array | None, *, return_attention: bool = False
    ) -> dict[str, jax.Array | list[jax.Array] | None]:
        """Teacher-forced forward pass; the keys are the fields of
        transformer_rosetta.spec.results.ForwardOutput. The attention lists are None unless
        return_attention (the explicit path; otherwise the fused kernel throughout); the hidden
        states are always there. A half of the family takes only its own input (src None for
        decoder-only, tgt_in None for encoder-only) and returns None for what it lacks (logits or
        encoder_output, pooled_output) and empty lists for the other half's attention maps and
        hidden states."""
        # The hidden states are returned always: under jit, a caller that drops them from its
        # outputs lets XLA drop them.
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
