"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) in Flax NNX.

Shapes: B batch, S source length, T target length, d d_model, h heads, k = d_k = d_model / h,
V vocabulary. Attribute names are the canonical tensor names of common/spec/names.py, so that the path
of every nnx.Param in `nnx.state(model)` joined with "." *is* its canonical name (jax_impl/weights.py
relies on that). Masks are boolean, True = may attend.
"""

from __future__ import annotations

import contextlib
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
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision

# -- masks: small pure functions mirroring common/spec/masks.py, [B, 1, Tq, Tk] -------------------


# rosetta: masks
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


# rosetta: end


# -- positions, activations, precision --------------------------------------------------------


def sinusoidal_positions(length: int, d_model: int, layout: str) -> np.ndarray:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    Deviation, flagged: layout "concatenated" puts every sin first, then every cos (tensor2tensor,
    Marian). Built in float64 numpy, as Flax's own WMT example does: `length` is static, so under
    jit the table is a constant, computed for any length (it extrapolates past max_len), and a
    float32 model gets the correctly rounded table rather than float32 sin/cos of rounded angles.
    """
    # rosetta: positions
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    angle = pos / np.power(10000.0, np.arange(0, d_model, 2) / d_model)  # (L, d/2)
    if layout == "interleaved":
        return np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(length, d_model)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)
    # rosetta: end


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # x Phi(x), the erf form
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def statistics_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """float32 or wider: softmax and LayerNorm statistics never run in bfloat16."""
    return jnp.promote_types(dtype, jnp.float32)


# JAX's names for the modes of common/spec/precision.py.
_JAX_PRECISIONS = {"highest": "highest", "tf32": "tensorfloat32"}


# rosetta: device
def matmul_precision(precision: str = DEFAULT_PRECISION) -> contextlib.AbstractContextManager:
    """float32 products in `precision` (common/spec/precision.py) for what runs, and what is
    traced, inside the block. JAX's own default on a GPU is TF32, so "highest" must be asked for;
    the setting is part of jit's cache key, so each mode compiles its own program."""
    return jax.default_matmul_precision(_JAX_PRECISIONS[check_precision(precision)])


# rosetta: end


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
    # rosetta: attention
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])  # (B, h, Tq, Tk)
    scores = scores.astype(statistics_dtype(scores.dtype))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    context = jnp.einsum("bhqt,bthk->bqhk", dropout(probs.astype(v.dtype)), v)
    return context, probs
    # rosetta: end


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Eq. (1) by JAX's fused kernel, jax.nn.dot_product_attention: context (B, Tq, h, k) of
    q (B, Tq, h, k), k and v (B, Tk, h, k) under mask (B, 1, Tq|1, Tk); no probabilities.

    The kernel gives a fully masked query a uniform row over the values; the spec (and the
    oracle) give it a zero context, as explicit_attention does, so those rows are zeroed.
    """
    # rosetta: attention
    context = jax.nn.dot_product_attention(q, k, v, mask=mask)
    has_key = jnp.swapaxes(jnp.any(mask, axis=-1), 1, 2)[..., None]  # (B, Tq, 1, 1)
    return jnp.where(has_key, context, 0.0)
    # rosetta: end


# -- sublayer wiring (section 3.1) -------------------------------------------------------------


# rosetta: layer_norm
def layer_norm(config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """Ba et al. 2016, as the oracle: population variance, eps inside the sqrt, eps from the
    config (Flax's default is 1e-6), and E[(x - mean)^2] rather than Flax's default
    E[x^2] - mean^2, which cancels badly. Flax keeps the statistics in float32 for bfloat16.
    norm_kind "std_plus_eps" is StdPlusEpsNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, config.layer_norm_eps, dtype=dtype)
    return nnx.LayerNorm(
        config.d_model,
        epsilon=config.layer_norm_eps,
        use_fast_variance=False,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
    )


# rosetta: end


class StdPlusEpsNorm(nnx.Module):
    """The Annotated Transformer's LayerNorm: scale * (x - mean) / (std + eps) + bias, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Parameters are named as nnx.LayerNorm's (scale, bias): the same state paths."""

    def __init__(self, d_model: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((d_model,), dtype))
        self.bias = nnx.Param(jnp.zeros((d_model,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 or wider (bfloat16 inputs), as nnx.LayerNorm keeps them.
        y = x.astype(statistics_dtype(x.dtype))
        y = (y - y.mean(-1, keepdims=True)) / (y.std(-1, ddof=1, keepdims=True) + self.eps)
        return (self.scale[...] * y + self.bias[...]).astype(x.dtype)


def residual(
    x: jax.Array,
    sublayer: Callable[[jax.Array], tuple[jax.Array, Any]],
    norm: nnx.Module,
    dropout: nnx.Dropout,
    pre_norm: bool,
) -> tuple[jax.Array, Any]:
    """Section 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation, flagged:
    pre-norm (Wang et al. 2019) is x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` returns (output, extra); extra (attention probabilities) is passed through."""
    # rosetta: residual
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out)
    return (x if pre_norm else norm(x)), extra
    # rosetta: end


# -- layers ------------------------------------------------------------------------------------


class MultiHeadAttention(nnx.Module):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), with W^Q, W^K, W^V as [d, h, k] and W^O as
    [h, k, d] (Flax's nnx.LinearGeneral layout, which is also the canonical one)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        # rosetta: parameters
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
        # rosetta: end
        self.dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def keys_values(self, x_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K W^K and V W^V of x_kv (B, Tk, d), each (B, h, Tk, k): the layout of the decoding
        cache (jax_impl/decode.py), the same in all three implementations."""
        # rosetta: heads
        k, v = self.key(x_kv), self.value(x_kv)  # (B, Tk, h, k)
        return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # (B, h, Tk, k)
        # rosetta: end

    def __call__(
        self,
        x_q: jax.Array,
        x_kv: jax.Array | None,
        mask: jax.Array,
        *,
        return_attention: bool = False,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """x_q (B, Tq, d) attends x_kv (B, Tk, d) under mask (B, 1, Tq|1, Tk).

        Decoding passes `kv` instead of x_kv: keys and values already projected, as
        keys_values() returns them (B, h, Tk, k), read from its cache.
        Returns (output (B, Tq, d), probabilities (B, h, Tq, Tk) or None). The one place that
        picks the kernel: explicit_attention when probabilities are asked for, else
        fused_attention.
        """
        q = self.query(x_q)  # (B, Tq, h, k)
        if kv is None:
            k, v = self.key(x_kv), self.value(x_kv)  # (B, Tk, h, k)
        else:
            k, v = (jnp.swapaxes(t, 1, 2) for t in kv)  # (B, h, Tk, k) -> (B, Tk, h, k)
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
        self.self_attention_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        self.feed_forward = FeedForward(config, dtype=dtype, rngs=rngs)
        self.feed_forward_norm = layer_norm(config, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(
        self, x: jax.Array, mask: jax.Array, *, return_attention: bool = False
    ) -> tuple[jax.Array, jax.Array | None]:
        """x (B, S, d) under mask (B, 1, 1, S). Returns (x, self-attention probs or None)."""
        pre_norm = self.config.norm_position == "pre"
        x, probs = residual(
            x,
            lambda y: self.self_attention(y, y, mask, return_attention=return_attention),
            self.self_attention_norm,
            self.dropout,
            pre_norm,
        )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            pre_norm,
        )
        return x, probs


class DecoderLayer(nnx.Module):
    """Section 3.1: masked self-attention, attention over the encoder output, then the
    feed-forward network, each in a residual connection and LayerNorm. A decoder-only model
    (GPT; config.num_encoder_layers 0) has no encoder output to attend: its layers have no
    cross-attention sublayer, and no parameters for one."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.config = config
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
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, dict[str, jax.Array] | None]:
        """x (B, T, d) over memory (B, S, d). Returns (x, self probs, cross probs, new cache),
        always four values; the probabilities are None unless return_attention, the cross ones
        also in a layer without cross-attention (memory and memory_mask are then None).

        Decoding (jax_impl/decode.py) passes this layer's `cache` entry and the position `index`
        (a traced scalar): x is then the positions index..index+L-1 (B, L, d), L = 1 for a step
        and the prompt's length for a prefill. Their self-attention keys and values are written
        into the cache's (B, h, positions, k) buffers at `index` and the queries attend the
        whole buffer (self_mask (B, 1, L, positions) says which keys each may see);
        cross-attention reads the memory's keys and values from the cache, so `memory` is
        unused. The updated entry is returned (None without a cache): a new dict, as JAX arrays
        are immutable.
        """
        pre_norm = self.config.norm_position == "pre"

        def self_attention(y: jax.Array) -> tuple[jax.Array, tuple]:
            if cache is None:
                out, probs = self.self_attention(y, y, self_mask, return_attention=return_attention)
                return out, (probs, None)
            # rosetta: cache
            new = self.self_attention.keys_values(y)  # (B, h, L, k) each
            keys, values = (
                jax.lax.dynamic_update_slice_in_dim(cache[name], t, index, axis=2)
                for name, t in zip(("self_key", "self_value"), new, strict=True)
            )
            # rosetta: end
            out, probs = self.self_attention(
                y, None, self_mask, return_attention=return_attention, kv=(keys, values)
            )
            return out, (probs, {**cache, "self_key": keys, "self_value": values})

        def cross_attention(y: jax.Array) -> tuple[jax.Array, jax.Array | None]:
            kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
            return self.cross_attention(
                y, memory, memory_mask, return_attention=return_attention, kv=kv
            )

        x, (self_probs, new_cache) = residual(
            x, self_attention, self.self_attention_norm, self.dropout, pre_norm
        )
        cross_probs = None
        if self.cross_attention is not None:
            x, cross_probs = residual(
                x, cross_attention, self.cross_attention_norm, self.dropout, pre_norm
            )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            pre_norm,
        )
        return x, self_probs, cross_probs, new_cache


# -- stacks ------------------------------------------------------------------------------------


def _embedding_param(
    vocab_size: int, config: TransformerConfig, dtype: jnp.dtype, rngs: nnx.Rngs
) -> nnx.Param:
    """[vocab_size, d] drawn from N(0, d^-0.5), so that after the sqrt(d) scale of section 3.4
    the embeddings have unit variance (tensor2tensor)."""
    # rosetta: parameters
    init = nnx.initializers.normal(config.d_model**-0.5)
    return nnx.Param(init(rngs.params(), (vocab_size, config.d_model), dtype))
    # rosetta: end


class Stack(nnx.Module):
    """What Encoder and Decoder share: the token embedding (section 3.4; none here when
    config.share_embeddings puts one table on the Transformer), the position embedding or
    sinusoids (section 3.5), BERT's segment table and embedding LayerNorm when the config has
    them, dropout, N layers and the optional final LayerNorm (pre-norm models and torch's
    nn.Transformer have one)."""

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
        """Section 3.5: PE[0..length-1], (length, d): the sinusoids, or the learned table's rows."""
        c = self.config
        if c.position_kind == "sinusoidal":
            return jnp.asarray(sinusoidal_positions(length, c.d_model, c.sinusoid_layout), dtype)
        return self.position_embedding[:length]  # check_inputs refuses length > max_len first

    def embed(
        self,
        ids: jax.Array,
        *,
        start: jax.Array | None = None,
        table: jax.Array,  # idiom: a shared table is one nnx.Param on the Transformer, passed down
        max_steps: int | None = None,  # idiom: jit traces `start`; the table needs a static length
    ) -> jax.Array:
        """Sections 3.4, 3.5 and 5.4: Dropout(E[ids] * sqrt(d_model) + PE[start..start+L-1]),
        (B, L, d), with E = `table`; start None is 0. Deviation, flagged (BERT, Devlin et al.
        2019): with a segment table its row 0 is added too (the models take no segment ids, so
        every token is of type 0), and an embedding LayerNorm normalises the sum before dropout.

        A decoding step passes `start` as a traced scalar (its position) and `max_steps`: the
        positions are then rows of the table for max_steps positions, sliced at `start`, so the
        step compiles once for every position.
        """
        length = ids.shape[1]
        if start is None:
            pe = self._position_table(length, table.dtype)
        else:
            pe = self._position_table(max_steps, table.dtype)
            pe = jax.lax.dynamic_slice_in_dim(pe, start, length)  # (L, d): PE[start..]
        # rosetta: embeddings
        x = jnp.take(table, ids, axis=0)  # (B, L, d)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        # rosetta: end
        x = x + pe[None]
        if self.token_type_embedding is not None:
            x = x + self.token_type_embedding[0]  # (d,): every token is of segment 0
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x)


class Encoder(Stack):
    """Section 3.1: a stack of N = num_encoder_layers identical layers over the embedded
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
        """src (B, S) ids, mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention probs
        per layer or None, hidden states: the embedding output and each layer's output, before
        the final norm)."""
        x = self.embed(src, table=table)
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, return_attention=return_attention)
            attentions.append(probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, attentions if return_attention else None, hidden


class Decoder(Stack):
    """Section 3.1: a stack of N = num_decoder_layers identical layers over the embedded target,
    attending to the encoder output (a decoder-only model's layers attend nothing else).
    Decoding with a cache runs its layers a prompt at a time (prefill) and then one position at
    a time in jax_impl/decode.py (decode_step)."""

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
        """tgt_in (B, T) ids, memory (B, S, d) (None, as memory_mask, for a decoder-only model).
        Returns (output (B, T, d), self-attention and cross-attention probs per layer or None,
        hidden states); a decoder-only model's cross-attention list is empty."""
        x = self.embed(tgt_in, table=table)
        self_attentions, cross_attentions, hidden = [], [], [x]
        for layer in self.layers:
            x, self_probs, cross_probs, _ = layer(
                x, memory, self_mask, memory_mask, return_attention=return_attention
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
    """An encoder-only model's one vector per sequence (B, d) from its output memory (B, S, d),
    or None when config.pooling is "none". Not in the paper: "mean" averages the non-pad
    positions of src (B, S) (sentence-transformers; a row with none gives zeros, not NaN),
    "first" takes position 0 (BERT's [CLS]); config.pooled_l2_norm then divides by the L2 norm
    (a zero vector stays zero)."""
    if config.pooling == "none":
        return None
    # The sums in float32 or wider, as LayerNorm's statistics (bfloat16 memories).
    y = memory.astype(statistics_dtype(memory.dtype))
    if config.pooling == "first":
        pooled = y[:, 0]
    else:
        real = (src != config.pad_id)[:, :, None].astype(y.dtype)  # (B, S, 1)
        pooled = (y * real).sum(axis=1) / jnp.maximum(real.sum(axis=1), 1.0)  # (B, d)
    if config.pooled_l2_norm:
        length = jnp.sqrt((pooled**2).sum(axis=-1, keepdims=True))  # (B, 1)
        pooled = pooled / jnp.where(length > 0.0, length, 1.0)
    return pooled.astype(memory.dtype)


class Transformer(nnx.Module):
    """Section 3, Figure 1: the encoder-decoder Transformer, with the pre-softmax projection of
    section 3.4 (tied to the target embedding when config.tie_output). Its halves
    (config.kind): a decoder-only model (GPT) has `encoder` None and decoder layers without
    cross-attention; an encoder-only one (BERT) has `decoder` and `output` None and returns its
    encoder output and, when the config pools, a pooled vector."""

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
        """src (B, S) -> (memory (B, S, d), self-attention probs or None, hidden states)."""
        mask = key_padding_mask(src, self.config.pad_id)
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
        """tgt_in (B, T) shifted right behind BOS, memory (B, S, d) and src (B, S) for its
        padding (both None for a decoder-only model) -> (logits (B, T, V), self probs or None,
        cross probs or None, hidden states)."""
        c = self.config
        y, self_attentions, cross_attentions, hidden = self.decoder(
            tgt_in,
            memory,
            decoder_self_mask(tgt_in, c.pad_id),
            None if src is None else key_padding_mask(src, c.pad_id),
            return_attention=return_attention,
            table=self.table("target"),
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: jax.Array) -> jax.Array:
        """Section 3.4: the pre-softmax linear transformation of y (..., d) -> (..., V)."""
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
        """Teacher-forced forward. Keys are the fields of transformer_rosetta.spec.results.ForwardOutput;
        attentions are None unless return_attention, hidden states always lists (under jit, a
        caller that drops them from its outputs lets XLA drop them). A half of the family takes
        only its own input (src None: decoder-only; tgt_in None: encoder-only), and what the
        absent stack would return is None (its output) or an empty list (its maps)."""
        absent = [] if return_attention else None  # the maps of a stack the model lacks
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
