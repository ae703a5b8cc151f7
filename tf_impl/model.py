"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as Keras 3 layers.

The math is written only in `keras.ops`, so this file runs unchanged on Keras's TensorFlow (the
one we ship), JAX and PyTorch backends; it imports no framework below Keras. Each class stores its
arguments in `__init__`, creates its weights in `build()` and computes in
`call(..., training=None)`. Masks are explicit boolean arguments (True = may attend); Keras's
implicit mask propagation is never used.

Layer names are chosen so that a variable's `.path` is its canonical name (common/spec/names.py) with
"/" for "." under the model's own name; tf_impl/weights.py relies on that rule.

Shapes: B batch, S source length, T target length, d d_model, h heads, k = d_k = d_model / h,
V vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
from keras import layers, ops

from common.spec.config import TransformerConfig

# -- masks: small pure functions mirroring common/spec/masks.py (boolean, True = may attend) ---------


def padding_mask(ids: Any, pad_id: int) -> Any:
    """[B, 1, 1, K]: a key may be attended iff it is not padding."""
    return ops.not_equal(ids, pad_id)[:, None, None, :]


def decoder_padding_mask(ids: Any, pad_id: int) -> Any:
    """[B, 1, 1, T]: as padding_mask, but position 0 (BOS, which may equal pad) is always visible."""
    first = ops.equal(ops.arange(ops.shape(ids)[1]), 0)[None, :]  # (1, T)
    return ops.logical_or(ops.not_equal(ids, pad_id), first)[:, None, None, :]


def causal_mask(length: int) -> Any:
    """[1, 1, T, T]: query i may attend key j iff j <= i (section 3.2.3)."""
    positions = ops.arange(length)
    return ops.greater_equal(positions[:, None], positions[None, :])[None, None]


def decoder_self_mask(tgt_in: Any, pad_id: int) -> Any:
    """[B, 1, T, T]: decoder self-attention is causal and skips padding."""
    return ops.logical_and(decoder_padding_mask(tgt_in, pad_id), causal_mask(ops.shape(tgt_in)[1]))


def sinusoidal_positions(
    length: int, d_model: int, layout: str, dtype: str, start: Any = None
) -> Any:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    Rows for positions start..start+length-1 (start None: from 0), computed for the positions at
    hand, so they extrapolate past max_len. Deviation, flagged: layout "concatenated" puts every
    sin first, then every cos (tensor2tensor, Marian).
    """
    pos = ops.arange(length, dtype=dtype)[:, None]  # (L, 1)
    if start is not None:  # a decode step: a tensor index, so a compiled step does not retrace
        pos = pos + ops.cast(start, dtype)
    two_i = ops.arange(0, d_model, 2, dtype=dtype)[None, :]  # (1, d/2)
    angle = pos / ops.power(ops.cast(10000.0, dtype), two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return ops.reshape(ops.stack([ops.sin(angle), ops.cos(angle)], axis=-1), (length, d_model))
    return ops.concatenate([ops.sin(angle), ops.cos(angle)], axis=-1)


def activation(name: str, x: Any) -> Any:
    """relu: max(0, x), Eq. (2). gelu: x Phi(x) with the exact erf. gelu_tanh: its tanh form.

    Written out rather than ops.gelu: on TensorFlow that is tf.nn.gelu, whose constants pass
    through float32 (errors ~5e-9 in a float64 model).
    """
    if name == "relu":
        return ops.relu(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + ops.erf(x / math.sqrt(2.0)))
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + ops.tanh(inner))


def _statistics_dtype(dtype: str) -> str:
    """Softmax and positions run in float32 or wider, even when the model computes in bfloat16."""
    return "float64" if dtype == "float64" else "float32"


def _config_from(value: TransformerConfig | dict) -> TransformerConfig:
    return value if isinstance(value, TransformerConfig) else TransformerConfig.from_dict(value)


# -- layers -----------------------------------------------------------------------------------


class HeadProjection(layers.EinsumDense):
    """layers.EinsumDense with its bias added by `+` rather than `ops.add`.

    Keras 3.15's TensorFlow `ops.add` treats a second operand that squeezes to a vector as a bias
    and calls tf.nn.bias_add, in NCHW layout when the vector's length matches x.shape[1] but not
    x.shape[-1] (keras/src/backend/tensorflow/numpy.py, `add`). A per-head bias (h, d_k) with
    d_k = 1 on (B, T, h, 1) with T = h is then added along T instead of h: wrong attention
    probabilities, found by the property test. `+` on tensors broadcasts as numpy does."""

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        x = ops.einsum(self.equation, inputs, self.kernel)
        return x if self.bias is None else x + ops.convert_to_tensor(self.bias, x.dtype)


class MultiHeadAttention(layers.Layer):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), with Attention from Eq. (1).

    Kernels keep heads as their own axis ([d, h, k] and [h, k, d]), which is EinsumDense's layout
    and the canonical one, so no reshapes are needed. Deviation, flagged: a query with no allowed
    key gets all-zero probabilities and a zero context (so the output is just W^O's bias).
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        use_bias: bool = True,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.use_bias = use_bias
        self.dropout_rate = dropout
        bias = "nk" if use_bias else None
        policy = self.dtype_policy
        shape = (None, num_heads, key_dim)
        self.query = HeadProjection(
            "btd,dnk->btnk", shape, bias_axes=bias, name="query", dtype=policy
        )
        self.key = HeadProjection("bsd,dnk->bsnk", shape, bias_axes=bias, name="key", dtype=policy)
        self.value = HeadProjection(
            "bsd,dnk->bsnk", shape, bias_axes=bias, name="value", dtype=policy
        )
        self.dropout = layers.Dropout(dropout, dtype=policy)

    def build(self, query_shape: tuple, key_value_shape: tuple | None = None) -> None:
        key_value_shape = query_shape if key_value_shape is None else key_value_shape
        self.query.build(query_shape)
        self.key.build(key_value_shape)
        self.value.build(key_value_shape)
        # Created here because W^O's width (d_model) comes from the query's shape. `output` is a
        # read-only property of every Keras layer, hence the longer attribute name; the layer's
        # name (and so its variables' paths) is still "output".
        self.output_projection = HeadProjection(
            "btnk,nkd->btd",
            (None, query_shape[-1]),
            bias_axes="d" if self.use_bias else None,
            name="output",
            dtype=self.dtype_policy,
        )
        self.output_projection.build((None, None, self.num_heads, self.key_dim))

    def call(
        self,
        query: Any,
        key_value: Any,
        mask: Any,
        training: bool | None = None,
        return_attention: bool = False,
        kv: tuple[Any, Any] | None = None,
    ) -> tuple[Any, Any]:
        """query (B, T, d), key_value (B, S, d), mask broadcastable to (B, h, T, S).

        kv: keys and values projected already (`keys_values`, a decode cache), used instead of
        projecting key_value (which may then be None).
        Returns (output (B, T, d), probabilities (B, h, T, S) or None on the fused path).
        """
        q = self.query(query)  # (B, T, h, k)
        if kv is None:
            k = self.key(key_value)  # (B, S, h, k)
            v = self.value(key_value)  # (B, S, h, k)
        else:
            k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in kv)  # (B, h, S, k) -> (B, S, h, k)
        # The fused kernel has no dropout on the probabilities, so training with attention
        # dropout takes the explicit path.
        if return_attention or (training and self.dropout_rate > 0):
            context, probs = self._explicit_attention(q, k, v, mask, training)
        else:
            context, probs = self._fused_attention(q, k, v, mask), None
        return self.output_projection(context), probs

    def keys_values(self, key_value: Any) -> tuple[Any, Any]:
        """K W^K_i and V W^V_i of Eq. (4) for key_value (B, S, d), each (B, h, S, k): the layout
        of the decode cache (tf_impl/decode.py), which keeps them instead of recomputing them."""
        k = ops.transpose(self.key(key_value), (0, 2, 1, 3))  # (B, h, S, k)
        v = ops.transpose(self.value(key_value), (0, 2, 1, 3))  # (B, h, S, k)
        return k, v

    def _explicit_attention(
        self, q: Any, k: Any, v: Any, mask: Any, training: bool | None
    ) -> tuple[Any, Any]:
        """Eq. (1), section 3.2.1: softmax(Q K^T / sqrt(d_k)) V, with the probabilities kept.

        Masked scores get the finite minimum of the softmax dtype (never -inf, which turns a fully
        masked row into NaN); probabilities are then zeroed where the mask is False.
        """
        softmax_dtype = _statistics_dtype(self.compute_dtype)
        scores = ops.einsum("btnk,bsnk->bnts", q, k) / math.sqrt(self.key_dim)  # (B, h, T, S)
        scores = ops.cast(scores, softmax_dtype)
        scores = ops.where(mask, scores, float(np.finfo(softmax_dtype).min))
        # softmax written out (as the oracle does) rather than ops.softmax, which warns on every
        # length-1 key axis, a case the tests use on purpose.
        weights = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))
        probs = ops.where(mask, weights / ops.sum(weights, axis=-1, keepdims=True), 0.0)
        probs = ops.cast(probs, self.compute_dtype)
        context = ops.einsum("bnts,bsnk->btnk", self.dropout(probs, training=training), v)
        return context, probs  # (B, T, h, k), (B, h, T, S)

    def _fused_attention(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
        """Eq. (1) through keras.ops.dot_product_attention (XLA-style kernel on TF and JAX, SDPA on
        torch). Its masked rows with no allowed key come out uniform (or NaN on some kernels);
        they are set to zero here, as on the explicit path."""
        # 1/sqrt(d_k) is applied to q here, not passed as `scale`: the TF backend turns a Python
        # float scale into a float32 tensor, which costs float64 models ~1e-7, and the torch
        # backend takes no tensor scale.
        q = q / math.sqrt(self.key_dim)
        context = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0)
        has_key = ops.transpose(ops.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B, T|1, 1, 1)
        return ops.where(has_key, context, ops.zeros_like(context))  # (B, T, h, k)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "use_bias": self.use_bias,
            "dropout": self.dropout_rate,
        }


class FeedForward(layers.Layer):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with W_1 "intermediate" and
    W_2 "output". Deviation, flagged: GELU (exact erf, or its tanh form) for ported models."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.intermediate = layers.Dense(d_ff, name="intermediate", dtype=self.dtype_policy)
        self.output_projection = layers.Dense(d_model, name="output", dtype=self.dtype_policy)

    def build(self, input_shape: tuple) -> None:
        self.intermediate.build(input_shape)
        self.output_projection.build((*input_shape[:-1], self.d_ff))

    def call(self, x: Any) -> Any:
        hidden = self.intermediate(x)  # (B, L, d_ff)
        return self.output_projection(activation(self.activation, hidden))  # (B, L, d)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "activation": self.activation,
        }


class _Block(layers.Layer):
    """What encoder and decoder layers share: the residual around each sublayer (section 3.1)."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _config_from(config)
        self.dropout = layers.Dropout(self.config.dropout, dtype=self.dtype_policy)

    def _norm(self, name: str) -> layers.LayerNormalization:
        # Epsilon from the config: Keras's default (1e-3) is a classic parity bug.
        return layers.LayerNormalization(
            epsilon=self.config.layer_norm_eps, name=name, dtype=self.dtype_policy
        )

    def _attention(self, name: str) -> MultiHeadAttention:
        c = self.config
        return MultiHeadAttention(
            c.num_heads,
            c.head_dim,
            use_bias=c.attention_bias,
            dropout=c.attention_dropout,
            name=name,
            dtype=self.dtype_policy,
        )

    def _residual(
        self, norm: layers.LayerNormalization, x: Any, sublayer: Any, training: bool | None
    ) -> tuple[Any, Any]:
        """Section 3.1: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation, flagged:
        pre-norm (Wang et al. 2019) computes x + Dropout(Sublayer(LayerNorm(x))).

        `sublayer` maps its input to (output, extra); returns (new x, extra)."""
        pre = self.config.norm_position == "pre"
        out, extra = sublayer(norm(x) if pre else x)
        x = x + self.dropout(out, training=training)
        return (x if pre else norm(x)), extra

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}


class EncoderLayer(_Block):
    """Section 3.1, encoder layer: self-attention, then the feed-forward network, each in a
    residual with LayerNorm."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        self.self_attention = self._attention("self_attention")
        self.self_attention_norm = self._norm("self_attention_norm")
        self.feed_forward = FeedForward(
            c.d_model, c.d_ff, c.activation, name="feed_forward", dtype=self.dtype_policy
        )
        self.feed_forward_norm = self._norm("feed_forward_norm")

    def build(self, input_shape: tuple) -> None:
        self.self_attention.build(input_shape)
        self.self_attention_norm.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_norm.build(input_shape)

    def call(
        self, x: Any, mask: Any, training: bool | None = None, return_attention: bool = False
    ) -> tuple[Any, Any]:
        """x (B, S, d), mask (B, 1, 1, S). Returns (x, self-attention probabilities or None)."""
        x, probs = self._residual(
            self.self_attention_norm,
            x,
            lambda y: self.self_attention(
                y, y, mask, training=training, return_attention=return_attention
            ),
            training,
        )
        x, _ = self._residual(
            self.feed_forward_norm, x, lambda y: (self.feed_forward(y), None), training
        )
        return x, probs


class DecoderLayer(_Block):
    """Section 3.1, decoder layer: masked self-attention, cross-attention over the encoder
    output, then the feed-forward network, each in a residual with LayerNorm."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        self.self_attention = self._attention("self_attention")
        self.self_attention_norm = self._norm("self_attention_norm")
        self.cross_attention = self._attention("cross_attention")
        self.cross_attention_norm = self._norm("cross_attention_norm")
        self.feed_forward = FeedForward(
            c.d_model, c.d_ff, c.activation, name="feed_forward", dtype=self.dtype_policy
        )
        self.feed_forward_norm = self._norm("feed_forward_norm")

    def build(self, input_shape: tuple, memory_shape: tuple | None = None) -> None:
        memory_shape = input_shape if memory_shape is None else memory_shape
        self.self_attention.build(input_shape)
        self.self_attention_norm.build(input_shape)
        self.cross_attention.build(input_shape, memory_shape)
        self.cross_attention_norm.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_norm.build(input_shape)

    def call(
        self,
        x: Any,
        memory: Any,
        self_mask: Any,
        memory_mask: Any,
        training: bool | None = None,
        return_attention: bool = False,
        cache: dict[str, Any] | None = None,
        index: Any = None,
    ) -> tuple[Any, ...]:
        """x (B, T, d), memory (B, S, d), self_mask (B, 1, T, T), memory_mask (B, 1, 1, S).

        Returns (x, self-attention probabilities, cross-attention probabilities), None when not
        requested. With `cache` (this layer's entry of tf_impl/decode.py's cache), x is one
        position (N, 1, d) at `index` and memory is unused: self-attention writes this
        position's keys and values into the cache's buffers and reads them all (self_mask
        (N, 1, 1, max_steps)), cross-attention reads the cached keys and values of the memory,
        and the call returns (x, the layer's new cache) instead.
        """
        x, (self_probs, self_kv) = self._residual(
            self.self_attention_norm,
            x,
            lambda y: self._masked_self_attention(
                y, self_mask, training, return_attention, cache, index
            ),
            training,
        )
        cross_kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
        x, cross_probs = self._residual(
            self.cross_attention_norm,
            x,
            lambda y: self.cross_attention(
                y,
                memory,
                memory_mask,
                training=training,
                return_attention=return_attention,
                kv=cross_kv,
            ),
            training,
        )
        x, _ = self._residual(
            self.feed_forward_norm, x, lambda y: (self.feed_forward(y), None), training
        )
        if cache is None:
            return x, self_probs, cross_probs
        return x, {**cache, "self_key": self_kv[0], "self_value": self_kv[1]}

    def _masked_self_attention(
        self,
        y: Any,
        mask: Any,
        training: bool | None,
        return_attention: bool,
        cache: dict[str, Any] | None,
        index: Any,
    ) -> tuple[Any, tuple[Any, Any]]:
        """Section 3.2.3's masked self-attention over y, or, with a cache, over the cached
        positions with y's keys and values written at `index`. Returns (output,
        (probabilities or None, the updated (keys, values) buffers or None))."""
        if cache is None:
            out, probs = self.self_attention(
                y, y, mask, training=training, return_attention=return_attention
            )
            return out, (probs, None)
        keys, values = self.self_attention.keys_values(y)  # (N, h, 1, k)
        at = (0, 0, index, 0)
        kv = (
            ops.slice_update(cache["self_key"], at, keys),  # (N, h, max_steps, k)
            ops.slice_update(cache["self_value"], at, values),
        )
        out, probs = self.self_attention(
            y, None, mask, training=training, return_attention=return_attention, kv=kv
        )
        return out, (probs, kv)


class _Stack(layers.Layer):
    """What Encoder and Decoder share: token and position embeddings (sections 3.4 and 3.5),
    N layers and the optional final LayerNorm."""

    layer_class: type[_Block]

    def __init__(
        self,
        config: TransformerConfig | dict,
        num_layers: int,
        vocab_size: int,
        embedding: layers.Embedding | dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        c = self.config = _config_from(config)
        policy = self.dtype_policy
        # A shared embedding (section 3.4) is one layer object owned by the Transformer; a layer
        # is not a config value, so get_config serialises it and Transformer rewires the sharing.
        if isinstance(embedding, dict):
            embedding = keras.saving.deserialize_keras_object(embedding)
        self.shared = embedding is not None
        self.embedding = embedding or layers.Embedding(
            vocab_size, c.d_model, name="embedding", dtype=policy
        )
        if c.position_kind == "learned":
            self.position_embedding = layers.Embedding(
                c.max_len, c.d_model, name="position_embedding", dtype=policy
            )
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        # Named "0", "1", ... and built under a "layers" name scope, so that their variables'
        # paths read "encoder/layers/0/...". (A dot in a name would break Keras's torch backend.)
        self.layers = [self.layer_class(c, name=str(i), dtype=policy) for i in range(num_layers)]
        if c.final_norm:
            self.final_norm = layers.LayerNormalization(
                epsilon=c.layer_norm_eps, name="final_norm", dtype=policy
            )

    def build(self, ids_shape: tuple | None = None) -> None:
        shape = (None, None, self.config.d_model)
        if not self.embedding.built:  # a shared embedding is built by the Transformer
            self.embedding.build()
        if self.config.position_kind == "learned":
            self.position_embedding.build()
        with keras.name_scope("layers"):
            for layer in self.layers:
                layer.build(shape)
        if self.config.final_norm:
            self.final_norm.build(shape)

    def embed(self, ids: Any, training: bool | None, start: Any = None) -> Any:
        """Sections 3.4-3.5: Dropout(E[ids] * sqrt(d_model) + PE[0..L-1]), (B, L, d); with
        start (a decode step's index), PE[start..start+L-1]."""
        c = self.config
        x = self.embedding(ids)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        length = ops.shape(ids)[1]
        if c.position_kind == "learned":
            pos = ops.arange(length)
            positions = self.position_embedding(pos if start is None else pos + start)
        else:
            table_dtype = _statistics_dtype(self.compute_dtype)
            positions = sinusoidal_positions(
                length, c.d_model, c.sinusoid_layout, table_dtype, start
            )
        x = x + ops.cast(positions, x.dtype)[None]
        return self.dropout(x, training=training)

    def _finish(self, x: Any) -> Any:
        return self.final_norm(x) if self.config.final_norm else x

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "config": self.config.to_dict(),
            "embedding": keras.saving.serialize_keras_object(self.embedding)
            if self.shared
            else None,
        }


class Encoder(_Stack):
    """Section 3.1, encoder: embeddings, then N = num_encoder_layers encoder layers."""

    layer_class = EncoderLayer

    def __init__(
        self,
        config: TransformerConfig | dict,
        embedding: layers.Embedding | dict | None = None,
        **kwargs: Any,
    ) -> None:
        c = _config_from(config)
        super().__init__(c, c.num_encoder_layers, c.src_vocab_size, embedding, **kwargs)

    def call(
        self, src: Any, mask: Any, training: bool | None = None, return_attention: bool = False
    ) -> tuple[Any, list, list]:
        """src (B, S) ids, mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention
        probabilities per layer (or Nones), hidden states: embeddings and each layer's output,
        before the final norm)."""
        x = self.embed(src, training)
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, training=training, return_attention=return_attention)
            attentions.append(probs)
            hidden.append(x)
        return self._finish(x), attentions, hidden


class Decoder(_Stack):
    """Section 3.1, decoder: embeddings, then N = num_decoder_layers decoder layers."""

    layer_class = DecoderLayer

    def __init__(
        self,
        config: TransformerConfig | dict,
        embedding: layers.Embedding | dict | None = None,
        **kwargs: Any,
    ) -> None:
        c = _config_from(config)
        super().__init__(c, c.num_decoder_layers, c.tgt_vocab_size, embedding, **kwargs)

    def call(
        self,
        tgt_in: Any,
        memory: Any,
        self_mask: Any,
        memory_mask: Any,
        training: bool | None = None,
        return_attention: bool = False,
        cache: list[dict[str, Any]] | None = None,
        index: Any = None,
    ) -> tuple[Any, ...]:
        """tgt_in (B, T) ids, memory (B, S, d). Returns (output (B, T, d), self-attention and
        cross-attention probabilities per layer (or Nones), hidden states).

        With `cache` (one entry per layer, tf_impl/decode.py), tgt_in is one position (N, 1) at
        `index` and memory is unused; returns (output (N, 1, d), the new per-layer cache)."""
        if cache is not None:
            x = self.embed(tgt_in, training, start=index)
            new_cache = []
            for layer, layer_cache in zip(self.layers, cache, strict=True):
                x, layer_cache = layer(
                    x,
                    None,
                    self_mask,
                    memory_mask,
                    training=training,
                    cache=layer_cache,
                    index=index,
                )
                new_cache.append(layer_cache)
            return self._finish(x), new_cache
        x = self.embed(tgt_in, training)
        self_attentions, cross_attentions, hidden = [], [], [x]
        for layer in self.layers:
            x, self_probs, cross_probs = layer(
                x,
                memory,
                self_mask,
                memory_mask,
                training=training,
                return_attention=return_attention,
            )
            self_attentions.append(self_probs)
            cross_attentions.append(cross_probs)
            hidden.append(x)
        return self._finish(x), self_attentions, cross_attentions, hidden


class Transformer(keras.Model):
    """Section 3, Figure 1: the encoder-decoder Transformer, logits = Decoder(Encoder(src)) W_out.

    Section 3.4: with share_embeddings one embedding serves both stacks, and with tie_output the
    pre-softmax projection is the target embedding transposed. `encode` and `decode` are separate
    so that decoding can reuse the encoder output.
    """

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        c = self.config = _config_from(config)
        shared = None
        if c.share_embeddings:
            shared = layers.Embedding(
                c.src_vocab_size, c.d_model, name="shared_embedding", dtype=self.dtype_policy
            )
            self.shared_embedding = shared
        self.encoder = Encoder(c, shared, name="encoder", dtype=self.dtype_policy)
        self.decoder = Decoder(c, shared, name="decoder", dtype=self.dtype_policy)

    def build(self, src_shape: tuple | None = None, tgt_in_shape: tuple | None = None) -> None:
        c = self.config
        if c.share_embeddings:
            self.shared_embedding.build()  # here, so that its path is "shared_embedding"
        self.encoder.build()
        self.decoder.build()
        # The output projection has no layer of its own (tied, it is E^T plus maybe a bias), so
        # its variables are made under an "output" name scope: paths "output/kernel", "output/bias".
        with keras.name_scope("output"):
            if not c.tie_output:
                self.output_kernel = keras.Variable(
                    "glorot_uniform",
                    shape=(c.d_model, c.tgt_vocab_size),
                    dtype=self.variable_dtype,
                    name="kernel",
                )
            if c.output_bias:
                self.output_bias = keras.Variable(
                    "zeros", shape=(c.tgt_vocab_size,), dtype=self.variable_dtype, name="bias"
                )

    def encode(
        self, src: Any, training: bool | None = None, return_attention: bool = False
    ) -> tuple[Any, list, list]:
        """src (B, S) ids -> (memory (B, S, d), attentions, hidden states)."""
        return self.encoder(
            src,
            padding_mask(src, self.config.pad_id),
            training=training,
            return_attention=return_attention,
        )

    def decode(
        self,
        tgt_in: Any,
        memory: Any,
        src: Any,
        training: bool | None = None,
        return_attention: bool = False,
    ) -> tuple[Any, list, list, list]:
        """tgt_in (B, T) ids (the target shifted right behind BOS), memory (B, S, d) ->
        (logits (B, T, V), self attentions, cross attentions, hidden states)."""
        pad = self.config.pad_id
        y, self_attentions, cross_attentions, hidden = self.decoder(
            tgt_in,
            memory,
            decoder_self_mask(tgt_in, pad),
            padding_mask(src, pad),
            training=training,
            return_attention=return_attention,
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: Any) -> Any:
        """Section 3.4: the pre-softmax linear transformation y W_out (+ b); tied: W_out = E^T."""
        c = self.config
        if c.tie_output:
            table = self.decoder.embedding.embeddings  # (V, d)
            logits = ops.einsum("btd,vd->btv", y, table)
        else:
            logits = ops.matmul(y, self.output_kernel)
        if c.output_bias:
            logits = logits + self.output_bias
        return logits  # (B, T, V)

    def call(
        self, src: Any, tgt_in: Any, training: bool | None = None, return_attention: bool = False
    ) -> dict[str, Any]:
        """The whole model: a dict with logits, encoder_output, the three attention lists
        (Nones on the fused path) and the hidden states of both stacks."""
        memory, encoder_attentions, encoder_hidden = self.encode(src, training, return_attention)
        logits, self_attentions, cross_attentions, decoder_hidden = self.decode(
            tgt_in, memory, src, training, return_attention
        )
        return {
            "logits": logits,
            "encoder_output": memory,
            "encoder_self_attention": encoder_attentions,
            "decoder_self_attention": self_attentions,
            "cross_attention": cross_attentions,
            "encoder_hidden_states": encoder_hidden,
            "decoder_hidden_states": decoder_hidden,
        }

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Transformer:
        return cls(**config)
