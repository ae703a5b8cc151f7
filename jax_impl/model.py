"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) in Flax NNX.

Shapes: B batch, S source length, T target length, d d_model, h heads, k = d_k = d_model / h,
V vocabulary. Attribute names are the canonical tensor names of common/spec/names.py, so that the path
of every nnx.Param in `nnx.state(model)` joined with "." *is* its canonical name (jax_impl/weights.py
relies on that). Masks are boolean, True = may attend.
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

from common.spec.config import TransformerConfig
from common.spec.names import embedding_names

# -- masks: small pure functions mirroring common/spec/masks.py, [B, 1, Tq, Tk] -------------------


def key_padding_mask(ids: jax.Array, pad_id: int) -> jax.Array:
    """[B, 1, 1, K]: a key may be attended iff it is not padding."""
    return (ids != pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: jax.Array, pad_id: int) -> jax.Array:
    """[B, 1, 1, T]: as key_padding_mask, but position 0 (BOS, which may equal pad) stays visible."""
    return key_padding_mask(ids, pad_id).at[..., 0].set(True)


def causal_mask(length: int) -> jax.Array:
    """[1, 1, T, T]: query i may attend key j iff j <= i (section 3.2.3)."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def decoder_self_mask(tgt_in: jax.Array, pad_id: int) -> jax.Array:
    """[B, 1, T, T]: decoder self-attention is causal and skips padding."""
    return decoder_key_padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1])


# -- positions, activations, precision --------------------------------------------------------


def sinusoidal_positions(length: int, d_model: int, layout: str) -> np.ndarray:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    Deviation, flagged: layout "concatenated" puts every sin first, then every cos (tensor2tensor,
    Marian). Built in float64 numpy, as Flax's own WMT example does: `length` is static, so under
    jit the table is a constant, computed for any length (it extrapolates past max_len), and a
    float32 model gets the correctly rounded table rather than float32 sin/cos of rounded angles.
    """
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    angle = pos / np.power(10000.0, np.arange(0, d_model, 2) / d_model)  # (L, d/2)
    if layout == "interleaved":
        return np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(length, d_model)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # x Phi(x), the erf form
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def statistics_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """float32 or wider: softmax and LayerNorm statistics never run in bfloat16."""
    return jnp.promote_types(dtype, jnp.float32)


# -- attention (Eq. 1) -------------------------------------------------------------------------


def explicit_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, dropout: nnx.Dropout
) -> tuple[jax.Array, jax.Array]:
    """Eq. (1), section 3.2.1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, explicitly.

    Flax's head layout: q (B, Tq, h, k), k and v (B, Tk, h, k), mask broadcastable to
    (B, h, Tq, Tk); `dropout` is the attention's nnx.Dropout, applied to the probabilities.
    Returns (context (B, Tq, h, k), probabilities (B, h, Tq, Tk), pre-dropout).
    Deviation, flagged: masked scores get the finite minimum (never -inf, which makes a fully
    masked row NaN) and probabilities are zeroed where the mask is False, so a query with no
    allowed key gets an all-zero row and a zero context.
    """
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])  # (B, h, Tq, Tk)
    scores = scores.astype(statistics_dtype(scores.dtype))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    context = jnp.einsum("bhqt,bthk->bqhk", dropout(probs.astype(v.dtype)), v)
    return context, probs


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Eq. (1) by JAX's fused kernel, jax.nn.dot_product_attention: context (B, Tq, h, k) of
    q (B, Tq, h, k), k and v (B, Tk, h, k) under mask (B, 1, Tq|1, Tk); no probabilities.

    The kernel gives a fully masked query a uniform row over the values; the spec (and the
    oracle) give it a zero context, as explicit_attention does, so those rows are zeroed.
    """
    context = jax.nn.dot_product_attention(q, k, v, mask=mask)
    has_key = jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]  # (B, Tq, 1, 1)
    return jnp.where(has_key, context, 0.0)


# -- sublayer wiring (section 3.1) -------------------------------------------------------------


def layer_norm(config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """Ba et al. 2016, as the oracle: population variance, eps inside the sqrt, eps from the
    config (Flax's default is 1e-6), and E[(x - mean)^2] rather than Flax's default
    E[x^2] - mean^2, which cancels badly. Flax keeps the statistics in float32 for bfloat16."""
    return nnx.LayerNorm(
        config.d_model,
        epsilon=config.layer_norm_eps,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
    )


def residual(
    x: jax.Array,
    sublayer: Callable[[jax.Array], tuple[jax.Array, Any]],
    norm: nnx.LayerNorm,
    dropout: nnx.Dropout,
    pre_norm: bool,
) -> tuple[jax.Array, Any]:
    """Section 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation, flagged:
    pre-norm (Wang et al. 2019) is x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` returns (output, extra); extra (attention probabilities) is passed through."""
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out)
    return (x if pre_norm else norm(x)), extra


# -- layers ------------------------------------------------------------------------------------


class MultiHeadAttention(nnx.Module):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), with W^Q, W^K, W^V as [d, h, k] and W^O as
    [h, k, d] (Flax's nnx.LinearGeneral layout, which is also the canonical one)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        d, h, k = config.d_model, config.num_heads, config.head_dim
        dense = functools.partial(
            nnx.LinearGeneral,
            use_bias=config.attention_bias,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.xavier_uniform(),  # tensor2tensor's, common/weights/init.py
            rngs=rngs,
        )
        self.query = dense(d, (h, k))
        self.key = dense(d, (h, k))
        self.value = dense(d, (h, k))
        self.output = dense((h, k), d, axis=(-2, -1))
        self.dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def keys_values(self, x_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K W^K and V W^V of x_kv (B, Tk, d), each (B, h, Tk, k): the layout of the decoding
        cache (jax_impl/decode.py), the same in all three implementations."""
        k, v = self.key(x_kv), self.value(x_kv)  # (B, Tk, h, k)
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # (B, h, Tk, k)

    def __call__(
        self,
        x_q: jax.Array,
        x_kv: jax.Array | None,
        mask: jax.Array,
        *,
        return_probs: bool = False,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """x_q (B, Tq, d) attends x_kv (B, Tk, d) under mask (B, 1, Tq|1, Tk).

        Decoding passes `kv` instead of x_kv: keys and values already projected, as
        keys_values() returns them (B, h, Tk, k), read from its cache.
        Returns (output (B, Tq, d), probabilities (B, h, Tq, Tk) or None). The one place that
        picks the kernel: explicit when probabilities are asked for, when attention dropout is
        live (the fused kernel has none), or in float64, because jax.nn.dot_product_attention
        always rounds its softmax to float32 (that is 1e-8, and float64 parity is 1e-10).
        """
        q = self.query(x_q)  # (B, Tq, h, k)
        if kv is None:
            k, v = self.key(x_kv), self.value(x_kv)  # (B, Tk, h, k)
        else:
            k, v = (jnp.swapaxes(t, 1, 2) for t in kv)  # (B, h, Tk, k) -> (B, Tk, h, k)
        dropout_live = not self.dropout.deterministic and self.dropout.rate > 0
        if return_probs or dropout_live or q.dtype == jnp.float64:
            context, probs = scaled_dot_product_attention(q, k, v, mask, self.dropout)
            probs = probs if return_probs else None
        else:
            context, probs = jax.nn.dot_product_attention(q, k, v, mask=mask), None
            # The kernel gives a fully masked query a uniform row over the values; the spec
            # (and the oracle) give it a zero context, so the output is the bias alone.
            has_key = jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]  # (B, Tq, 1, 1)
            context = jnp.where(has_key, context, 0.0)
        return self.output(context), probs


class FeedForward(nnx.Module):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2; W_1 is `intermediate`, W_2
    `output`. Deviation, flagged: GELU (exact or tanh) instead of max(0, x) for ported models."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        dense = functools.partial(
            nnx.Linear,
            dtype=dtype,
            param_dtype=dtype,
            kernel_init=nnx.initializers.xavier_uniform(),
            rngs=rngs,
        )
        self.intermediate = dense(config.d_model, config.d_ff)
        self.output = dense(config.d_ff, config.d_model)
        self.activation = config.activation  # a name: static, so the graphdef stays hashable

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.output(ACTIVATIONS[self.activation](self.intermediate(x)))


class EncoderLayer(nnx.Module):
    """Section 3.1: multi-head self-attention, then a position-wise feed-forward network, each
    wrapped in a residual connection and LayerNorm."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = config
        self.self_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attention_norm = layer_norm(config, dtype, rngs)
        self.feed_forward = FeedForward(config, dtype=dtype, rngs=rngs)
        self.feed_forward_norm = layer_norm(config, dtype, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(
        self, x: jax.Array, mask: jax.Array, *, return_probs: bool = False
    ) -> tuple[jax.Array, jax.Array | None]:
        c = self.config
        x, probs = residual(
            c,
            self.self_attention_norm,
            self.dropout,
            x,
            lambda y: self.self_attention(y, y, mask, return_probs=return_probs),
        )
        x, _ = residual(
            c, self.feed_forward_norm, self.dropout, x, lambda y: (self.feed_forward(y), None)
        )
        return x, probs


class DecoderLayer(nnx.Module):
    """Section 3.1: masked self-attention, attention over the encoder output, then the
    feed-forward network, each in a residual connection and LayerNorm."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = config
        self.self_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attention_norm = layer_norm(config, dtype, rngs)
        self.cross_attention = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.cross_attention_norm = layer_norm(config, dtype, rngs)
        self.feed_forward = FeedForward(config, dtype=dtype, rngs=rngs)
        self.feed_forward_norm = layer_norm(config, dtype, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array,
        self_mask: jax.Array,
        memory_mask: jax.Array,
        *,
        return_probs: bool = False,
        cache: dict[str, jax.Array] | None = None,
        index: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict[str, jax.Array] | None]:
        """x (B, T, d) over memory (B, S, d). Returns (x, self probs, cross probs, cache).

        Decoding (jax_impl/decode.py) passes this layer's `cache` entry and the position `index`
        (a traced scalar): x is then that one position (B, 1, d). Its self-attention keys and
        values are written into the cache's (B, h, max_steps, k) buffers at `index` and the
        query attends the whole buffer (self_mask says which positions are valid); cross-attention
        reads the memory's keys and values from the cache, so `memory` is unused. The updated
        entry is returned (None without a cache).
        """
        c = self.config

        def self_attention(y: jax.Array) -> tuple[jax.Array, tuple]:
            if cache is None:
                out, probs = self.self_attention(y, y, self_mask, return_probs=return_probs)
                return out, (probs, None)
            new = self.self_attention.keys_values(y)  # (B, h, 1, k) each
            keys, values = (
                jax.lax.dynamic_update_slice_in_dim(cache[name], t, index, axis=2)
                for name, t in zip(("self_key", "self_value"), new, strict=True)
            )
            out, probs = self.self_attention(
                y, None, self_mask, return_probs=return_probs, kv=(keys, values)
            )
            return out, (probs, {**cache, "self_key": keys, "self_value": values})

        def cross_attention(y: jax.Array) -> tuple[jax.Array, jax.Array | None]:
            kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
            return self.cross_attention(y, memory, memory_mask, return_probs=return_probs, kv=kv)

        x, (self_probs, new_cache) = residual(
            c, self.self_attention_norm, self.dropout, x, self_attention
        )
        x, cross_probs = residual(c, self.cross_attention_norm, self.dropout, x, cross_attention)
        x, _ = residual(
            c, self.feed_forward_norm, self.dropout, x, lambda y: (self.feed_forward(y), None)
        )
        return x, self_probs, cross_probs, new_cache


def embedding_param(
    vocab: int, config: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs
) -> nnx.Param:
    """[vocab, d] drawn from N(0, d^-0.5), so that after the sqrt(d) scale of section 3.4 the
    embeddings have unit variance (tensor2tensor)."""
    init = nnx.initializers.normal(config.d_model**-0.5)
    return nnx.Param(init(rngs.params(), (vocab, config.d_model), dtype))


def position_table(
    config: TransformerConfig,
    length: int,
    position_embedding: nnx.Param | None,
    dtype: jnp.dtype,
) -> jax.Array:
    """Section 3.5: PE[0..length-1], (length, d): the sinusoids, or the learned table's rows."""
    if config.position_kind == "sinusoidal":
        pe = sinusoidal_positions(length, config.d_model, config.sinusoid_layout)
        return jnp.asarray(pe, dtype)
    return position_embedding[:length]  # check_inputs refuses length > max_len first


def embed(
    config: TransformerConfig,
    ids: jax.Array,
    table: jax.Array,
    pe: jax.Array,
    dropout: nnx.Dropout,
) -> jax.Array:
    """Sections 3.4, 3.5 and 5.4: Dropout(E[ids] * sqrt(d_model) + PE), (B, L, d), where pe
    (L, d) holds the positions of ids: PE[0..L-1] in a forward, PE[index] in a decoding step."""
    x = jnp.take(table, ids, axis=0)  # (B, L, d)
    if config.scale_embeddings:
        x = x * math.sqrt(config.d_model)
    return dropout(x + pe[None])


class Encoder(nnx.Module):
    """Section 3.1: a stack of N identical layers over the embedded source (plus a final
    LayerNorm when config.final_norm: pre-norm models and torch's nn.Transformer have one)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = config
        # The token table lives here unless share_embeddings puts one table on the Transformer.
        self.embedding = (
            None
            if config.share_embeddings
            else embedding_param(config.src_vocab_size, config, dtype, rngs)
        )
        self.position_embedding = (
            embedding_param(config.max_len, config, dtype, rngs)
            if config.position_kind == "learned"
            else None
        )
        self.layers = nnx.List(
            [EncoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_encoder_layers)]
        )
        self.final_norm = layer_norm(config, dtype, rngs) if config.final_norm else None
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(
        self,
        src: jax.Array,
        mask: jax.Array,
        table: jax.Array,
        *,
        return_probs: bool = False,
        hidden_states: bool = False,
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        """src (B, S) ids. Returns (memory (B, S, d), self-attention probs per layer, hidden
        states: the embedding output and each layer's output, before the final norm)."""
        pe = position_table(self.config, src.shape[1], self.position_embedding, table.dtype)
        x = embed(self.config, src, table, pe, self.dropout)
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, return_probs=return_probs)
            attentions.append(probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, attentions, hidden if hidden_states else []


class Decoder(nnx.Module):
    """Section 3.1: a stack of N identical layers over the embedded target, attending to the
    encoder output (plus a final LayerNorm when config.final_norm)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = config
        # The token table lives here unless share_embeddings puts one table on the Transformer.
        self.embedding = (
            None
            if config.share_embeddings
            else embedding_param(config.tgt_vocab_size, config, dtype, rngs)
        )
        self.position_embedding = (
            embedding_param(config.max_len, config, dtype, rngs)
            if config.position_kind == "learned"
            else None
        )
        self.layers = nnx.List(
            [DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_decoder_layers)]
        )
        self.final_norm = layer_norm(config, dtype, rngs) if config.final_norm else None
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(
        self,
        tgt_in: jax.Array,
        memory: jax.Array,
        self_mask: jax.Array,
        memory_mask: jax.Array,
        table: jax.Array,
        *,
        return_probs: bool = False,
        hidden_states: bool = False,
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array], list[jax.Array]]:
        """tgt_in (B, T) ids, memory (B, S, d). Returns (output (B, T, d), self probs, cross
        probs, hidden states)."""
        pe = position_table(self.config, tgt_in.shape[1], self.position_embedding, table.dtype)
        x = embed(self.config, tgt_in, table, pe, self.dropout)
        self_attn, cross_attn, hidden = [], [], [x]
        for layer in self.layers:
            x, s_probs, c_probs, _ = layer(
                x, memory, self_mask, memory_mask, return_probs=return_probs
            )
            self_attn.append(s_probs)
            cross_attn.append(c_probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, self_attn, cross_attn, hidden if hidden_states else []


class Transformer(nnx.Module):
    """Section 3, Figure 1: the encoder-decoder Transformer, with the pre-softmax projection of
    section 3.4 (tied to the target embedding when config.tie_output)."""

    def __init__(
        self, config: TransformerConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs
    ) -> None:
        self.config = config
        c = config
        if c.share_embeddings:  # section 3.4: one matrix for both embeddings
            self.shared_embedding = embedding_param(c.src_vocab_size, c, dtype, rngs)
        self.encoder = Encoder(c, dtype=dtype, rngs=rngs)
        self.decoder = Decoder(c, dtype=dtype, rngs=rngs)
        if not c.tie_output:
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

    def table(self, role: str) -> jax.Array:
        """The matrix that common.spec.names.embedding_names says `role` reads ("source", "target" or
        "output"), found by its canonical name, e.g. "shared_embedding", "decoder.embedding"."""
        name = embedding_names(self.config)[role]
        return functools.reduce(getattr, name.split("."), self)[...]

    def encode(
        self, src: jax.Array, *, return_probs: bool = False, hidden_states: bool = False
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
        """src (B, S) -> (memory (B, S, d), self-attention probs, hidden states)."""
        mask = key_padding_mask(src, self.config.pad_id)
        return self.encoder(
            src, mask, self.table("source"), return_probs=return_probs, hidden_states=hidden_states
        )

    def decode(
        self,
        tgt_in: jax.Array,
        memory: jax.Array,
        src: jax.Array,
        *,
        return_probs: bool = False,
        hidden_states: bool = False,
    ) -> tuple[jax.Array, list[jax.Array], list[jax.Array], list[jax.Array]]:
        """tgt_in (B, T) shifted right behind BOS, memory (B, S, d) and src (B, S) for its
        padding -> (logits (B, T, V), self probs, cross probs, hidden states)."""
        c = self.config
        y, self_attn, cross_attn, hidden = self.decoder(
            tgt_in,
            memory,
            decoder_self_mask(tgt_in, c.pad_id),
            key_padding_mask(src, c.pad_id),
            self.table("target"),
            return_probs=return_probs,
            hidden_states=hidden_states,
        )
        return self.output_logits(y), self_attn, cross_attn, hidden

    def output_logits(self, y: jax.Array) -> jax.Array:
        """Section 3.4: the pre-softmax linear transformation of y (..., d) -> (..., V)."""
        c = self.config
        if c.tie_output:  # section 3.4: y E^T
            logits = jnp.einsum("...d,vd->...v", y, self.table("output"))
            if c.output_bias:
                logits = logits + self.output.bias
            return logits
        return self.output(y)

    def __call__(
        self,
        src: jax.Array,
        tgt_in: jax.Array,
        *,
        return_probs: bool = False,
        hidden_states: bool = False,
    ) -> dict[str, jax.Array | list[jax.Array] | None]:
        """Teacher-forced forward. Keys are the fields of common.spec.results.ForwardOutput;
        attentions and hidden states are None unless asked for."""
        memory, enc_attn, enc_hidden = self.encode(
            src, return_probs=return_probs, hidden_states=hidden_states
        )
        logits, self_attn, cross_attn, dec_hidden = self.decode(
            tgt_in, memory, src, return_probs=return_probs, hidden_states=hidden_states
        )
        probs = (enc_attn, self_attn, cross_attn) if return_probs else (None, None, None)
        hidden = (enc_hidden, dec_hidden) if hidden_states else (None, None)
        return {
            "logits": logits,
            "encoder_output": memory,
            "encoder_self_attention": probs[0],
            "decoder_self_attention": probs[1],
            "cross_attention": probs[2],
            "encoder_hidden_states": hidden[0],
            "decoder_hidden_states": hidden[1],
        }
