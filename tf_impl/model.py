"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as Keras 3 layers.

The math is written only in `keras.ops`, so this file runs unchanged on Keras's TensorFlow (the
one we ship), JAX and PyTorch backends. It imports no framework below Keras, except to set the
backend's matmul precision (`matmul_precision`), which Keras has no switch for. Each class stores its
arguments in `__init__`, creates its weights in `build()` and computes in
`call(..., training=None)`. Masks are explicit boolean arguments (True = may attend); Keras's
implicit mask propagation is never used.

Layer names are chosen so that a variable's `.path` is its canonical name (common/spec/names.py) with
"/" for "." under the model's own name; tf_impl/weights.py relies on that rule.

Shapes: B batch, S source length, T target length, d d_model, h heads, k = d_k = d_model / h,
V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import layers, ops

from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision

# -- masks: small pure functions mirroring common/spec/masks.py (boolean, True = may attend) ---------


# rosetta: masks
def key_padding_mask(ids: Any, pad_id: int) -> Any:
    """[B, 1, 1, K]: a key may be attended iff it is not padding."""
    return ops.not_equal(ids, pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: Any, pad_id: int) -> Any:
    """[B, 1, 1, T]: as key_padding_mask, but position 0 (BOS, which may equal pad) is always
    visible."""
    first = ops.equal(ops.arange(ops.shape(ids)[1]), 0)[None, :]  # (1, T)
    return ops.logical_or(ops.not_equal(ids, pad_id), first)[:, None, None, :]


def causal_mask(length: int) -> Any:
    """[1, 1, T, T]: query i may attend key j iff j <= i (section 3.2.3)."""
    positions = ops.arange(length)
    return ops.greater_equal(positions[:, None], positions[None, :])[None, None]


def decoder_self_mask(tgt_in: Any, pad_id: int) -> Any:
    """[B, 1, T, T]: decoder self-attention is causal and skips padding."""
    return ops.logical_and(
        decoder_key_padding_mask(tgt_in, pad_id), causal_mask(ops.shape(tgt_in)[1])
    )


# rosetta: end


# -- positions, activations, precision --------------------------------------------------------


def sinusoidal_positions(
    length: int,
    d_model: int,
    layout: str,
    dtype: str,  # idiom: keras.ops picks no float64 by itself
    start: Any = None,  # idiom: a tensor position, so a compiled decode step does not retrace
) -> Any:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    Rows for positions start..start+length-1 (start None: from 0), computed for the positions at
    hand, so they extrapolate past max_len. Deviation, flagged: layout "concatenated" puts every
    sin first, then every cos (tensor2tensor, Marian).
    """
    # rosetta: positions
    pos = ops.arange(length, dtype=dtype)[:, None]  # (L, 1)
    if start is not None:  # a decode step: a tensor index, so a compiled step does not retrace
        pos = pos + ops.cast(start, dtype)
    two_i = ops.arange(0, d_model, 2, dtype=dtype)[None, :]  # (1, d/2)
    angle = pos / ops.power(ops.cast(10000.0, dtype), two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return ops.reshape(ops.stack([ops.sin(angle), ops.cos(angle)], axis=-1), (length, d_model))
    return ops.concatenate([ops.sin(angle), ops.cos(angle)], axis=-1)
    # rosetta: end


# GELU is written out rather than ops.gelu: on TensorFlow that is tf.nn.gelu, whose constants pass
# through float32 (errors ~5e-9 in a float64 model).


def _gelu(x: Any) -> Any:
    """x Phi(x) with the exact erf."""
    return 0.5 * x * (1.0 + ops.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: Any) -> Any:
    """GELU's tanh form."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + ops.tanh(inner))


ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "relu": ops.relu,  # max(0, x), Eq. (2)
    "gelu": _gelu,  # deviation, flagged: for ported models
    "gelu_tanh": _gelu_tanh,
}


def statistics_dtype(dtype: str) -> str:
    """Softmax and positions run in float32 or wider, even when the model computes in bfloat16."""
    return "float64" if dtype == "float64" else "float32"


# idiom: Keras has no matmul precision of its own; the backend below it has one (and JAX's
# default on a GPU is TF32), so model.py sets that backend's switch itself, on every backend.
def _set_matmul_precision(precision: str) -> Callable[[], None]:
    """Set the Keras backend's float32 product precision (common/spec/precision.py); returns
    what restores the previous setting."""
    tf32 = check_precision(precision) == "tf32"
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        saved = jax.config.jax_default_matmul_precision
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
        return lambda: jax.config.update("jax_default_matmul_precision", saved)
    if backend == "torch":
        import torch

        switches = (torch.backends.cuda.matmul, torch.backends.cudnn)
        saved_modes = [s.fp32_precision for s in switches]
        for switch in switches:
            switch.fp32_precision = "tf32" if tf32 else "ieee"

        def restore() -> None:
            for switch, mode in zip(switches, saved_modes, strict=True):
                switch.fp32_precision = mode

        return restore
    if backend == "tensorflow":
        import tensorflow as tf

        was = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        return lambda: tf.config.experimental.enable_tensor_float_32_execution(was)
    return lambda: None  # numpy/openvino backends: no reduced-precision float32 products


# rosetta: device
@contextlib.contextmanager
def matmul_precision(precision: str = DEFAULT_PRECISION) -> Iterator[None]:
    """float32 products in `precision` (common/spec/precision.py) while the block runs, under
    whichever backend Keras runs on; the previous setting is restored on exit."""
    restore = _set_matmul_precision(precision)
    try:
        yield
    finally:
        restore()


# rosetta: end


# Importing the model pins full float32 products for the process, under every Keras backend: the
# parity bounds assume them, and a user calling these layers directly never goes through a
# backend adapter that would set them (measured on an H100 under KERAS_BACKEND=jax: 1.7e-3 from
# the oracle in float32 logits without this, 7.7e-7 with it).
_set_matmul_precision(DEFAULT_PRECISION)


# -- attention (Eq. 1) ------------------------------------------------------------------------


def explicit_attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    dropout: layers.Dropout,
    training: bool | None = None,  # idiom: a Keras Dropout takes `training` per call
) -> tuple[Any, Any]:
    """Eq. (1), section 3.2.1: softmax(Q K^T / sqrt(d_k)) V, with the probabilities kept.

    q (B, T, h, k), k and v (B, S, h, k): Keras's head layout (EinsumDense's), heads after the
    positions; mask broadcastable to (B, h, T, S). Returns (context (B, T, h, k), the
    post-softmax, pre-dropout probabilities (B, h, T, S)). Masked scores get the finite minimum
    of the softmax dtype (never -inf, which turns a fully masked row into NaN); probabilities are
    then zeroed where the mask is False.
    """
    # rosetta: attention
    dtype = keras.backend.standardize_dtype(q.dtype)  # the layer's compute dtype
    softmax_dtype = statistics_dtype(dtype)
    scores = ops.einsum("btnk,bsnk->bnts", q, k) / math.sqrt(q.shape[-1])  # (B, h, T, S)
    scores = ops.cast(scores, softmax_dtype)
    scores = ops.where(mask, scores, float(np.finfo(softmax_dtype).min))
    # softmax written out (as the oracle does) rather than ops.softmax, which warns on every
    # length-1 key axis, a case the tests use on purpose.
    weights = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))
    probs = ops.where(mask, weights / ops.sum(weights, axis=-1, keepdims=True), 0.0)
    probs = ops.cast(probs, dtype)
    context = ops.einsum("bnts,bsnk->btnk", dropout(probs, training=training), v)
    return context, probs  # (B, T, h, k), (B, h, T, S)
    # rosetta: end


def fused_attention(q: Any, k: Any, v: Any, mask: Any) -> Any:
    """Eq. (1) through keras.ops.dot_product_attention (XLA-style kernel on TF and JAX, SDPA on
    torch), in explicit_attention's (B, T, h, k) layout; returns the context (B, T, h, k). Its
    masked rows with no allowed key come out uniform (or NaN on some kernels); they are set to
    zero here, as on the explicit path."""
    # rosetta: attention
    # 1/sqrt(d_k) is applied to q here, not passed as `scale`: the TF backend turns a Python
    # float scale into a float32 tensor, which costs float64 models ~1e-7, and the torch
    # backend takes no tensor scale.
    q = q / math.sqrt(q.shape[-1])
    context = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0)
    has_key = ops.transpose(ops.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B, T|1, 1, 1)
    return ops.where(has_key, context, ops.zeros_like(context))  # (B, T, h, k)
    # rosetta: end


# -- sublayer wiring (section 3.1) ------------------------------------------------------------


# rosetta: layer_norm
def layer_norm(config: TransformerConfig, *, name: str, dtype: Any) -> layers.Layer:
    """Ba et al. 2016, with epsilon from the config: Keras's default (1e-3) is a classic parity
    bug. norm_kind "std_plus_eps" is StdPlusEpsNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, config.layer_norm_eps, name=name, dtype=dtype)
    return layers.LayerNormalization(epsilon=config.layer_norm_eps, name=name, dtype=dtype)


# rosetta: end


class StdPlusEpsNorm(layers.Layer):
    """The Annotated Transformer's LayerNorm: gamma * (x - mean) / (std + eps) + beta, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Weights are named as LayerNormalization's (gamma, beta): the same variable paths."""

    def __init__(self, d_model: int, eps: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d_model, self.eps = d_model, eps

    def build(self, input_shape: tuple) -> None:
        self.gamma = self.add_weight(shape=(self.d_model,), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(self.d_model,), initializer="zeros", name="beta")

    def call(self, x: Any) -> Any:
        # Statistics in float32 or wider (bfloat16 inputs), as LayerNormalization keeps them.
        dtype = statistics_dtype(keras.backend.standardize_dtype(x.dtype))
        y = ops.cast(x, dtype)
        centred = y - ops.mean(y, axis=-1, keepdims=True)
        std = ops.sqrt(ops.sum(centred * centred, axis=-1, keepdims=True) / (self.d_model - 1))
        y = centred / (std + self.eps)
        y = y * ops.cast(self.gamma, dtype) + ops.cast(self.beta, dtype)
        return ops.cast(y, x.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "d_model": self.d_model, "eps": self.eps}


def residual(
    x: Any,
    sublayer: Callable[[Any], tuple[Any, Any]],
    norm: layers.Layer,
    dropout: layers.Dropout,
    pre_norm: bool,
    training: bool | None = None,  # idiom: a Keras Dropout takes `training` per call
) -> tuple[Any, Any]:
    """Section 3.1: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation, flagged:
    pre-norm (Wang et al. 2019) computes x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` maps its input to (output, extra); returns (new x, extra)."""
    # rosetta: residual
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out, training=training)
    return (x if pre_norm else norm(x)), extra
    # rosetta: end


# -- layers -----------------------------------------------------------------------------------


def _config_from(value: TransformerConfig | dict) -> TransformerConfig:
    return value if isinstance(value, TransformerConfig) else TransformerConfig.from_dict(value)


class _ConfigLayer(layers.Layer):
    """A layer made from the model's config, which get_config serialises (so that Keras's
    from_config can rebuild it)."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _config_from(config)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}


# rosetta: heads
# idiom: works around Keras 3.15's TensorFlow ops.add, which adds a per-head bias along T
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


# rosetta: end


class MultiHeadAttention(_ConfigLayer):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), with Attention from Eq. (1).

    Kernels keep heads as their own axis ([d, h, k] and [h, k, d]), which is EinsumDense's layout
    and the canonical one, so no reshapes are needed. Deviation, flagged: a query with no allowed
    key gets all-zero probabilities and a zero context (so the output is just W^O's bias).
    """

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        # rosetta: heads
        bias = "nk" if c.attention_bias else None
        policy = self.dtype_policy
        shape = (None, c.num_heads, c.head_dim)
        self.query = HeadProjection(
            "btd,dnk->btnk", shape, bias_axes=bias, name="query", dtype=policy
        )
        self.key = HeadProjection("bsd,dnk->bsnk", shape, bias_axes=bias, name="key", dtype=policy)
        self.value = HeadProjection(
            "bsd,dnk->bsnk", shape, bias_axes=bias, name="value", dtype=policy
        )
        # rosetta: end
        # `output` is a read-only property of every Keras layer, hence the longer attribute name;
        # the layer's name (and so its variables' paths) is still "output".
        self.output_projection = HeadProjection(
            "btnk,nkd->btd",
            (None, c.d_model),
            bias_axes="d" if c.attention_bias else None,
            name="output",
            dtype=policy,
        )
        self.dropout = layers.Dropout(c.attention_dropout, dtype=policy)

    # rosetta: parameters
    def build(self, x_q_shape: tuple, x_kv_shape: tuple | None = None) -> None:
        x_kv_shape = x_q_shape if x_kv_shape is None else x_kv_shape
        self.query.build(x_q_shape)
        self.key.build(x_kv_shape)
        self.value.build(x_kv_shape)
        self.output_projection.build((None, None, self.config.num_heads, self.config.head_dim))

    # rosetta: end

    def keys_values(self, x_kv: Any) -> tuple[Any, Any]:
        """K W^K_i and V W^V_i of Eq. (4) for x_kv (B, S, d), each (B, h, S, k): the layout of
        the decode cache (tf_impl/decode.py), which keeps them instead of recomputing them."""
        k = ops.transpose(self.key(x_kv), (0, 2, 1, 3))  # (B, h, S, k)
        v = ops.transpose(self.value(x_kv), (0, 2, 1, 3))  # (B, h, S, k)
        return k, v

    def call(
        self,
        x_q: Any,
        x_kv: Any,
        mask: Any,
        *,
        return_attention: bool = False,
        kv: tuple[Any, Any] | None = None,
        training: bool | None = None,
    ) -> tuple[Any, Any]:
        """x_q (B, T, d), x_kv (B, S, d), mask broadcastable to (B, h, T, S).

        kv: keys and values projected already (`keys_values`, a decode cache), used instead of
        projecting x_kv (which may then be None).
        Returns (output (B, T, d), probabilities (B, h, T, S) or None on the fused path).
        """
        q = self.query(x_q)  # (B, T, h, k)
        if kv is None:
            k = self.key(x_kv)  # (B, S, h, k)
            v = self.value(x_kv)  # (B, S, h, k)
        else:
            k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in kv)  # (B, h, S, k) -> (B, S, h, k)
        # rosetta: dropout
        # idiom: the fused kernel (keras.ops) has no dropout on the probabilities, so training
        # with attention dropout takes the explicit path.
        if return_attention or (training and self.config.attention_dropout > 0):
            context, probs = explicit_attention(q, k, v, mask, self.dropout, training)
        else:
            context, probs = fused_attention(q, k, v, mask), None
        # rosetta: end
        return self.output_projection(context), probs


class FeedForward(_ConfigLayer):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with W_1 "intermediate" and
    W_2 "output". Deviation, flagged: GELU (exact erf, or its tanh form) for ported models."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        self.intermediate = layers.Dense(c.d_ff, name="intermediate", dtype=self.dtype_policy)
        self.output_projection = layers.Dense(c.d_model, name="output", dtype=self.dtype_policy)

    def build(self, input_shape: tuple) -> None:
        self.intermediate.build(input_shape)
        self.output_projection.build((*input_shape[:-1], self.config.d_ff))

    def call(self, x: Any) -> Any:
        hidden = self.intermediate(x)  # (B, L, d_ff)
        return self.output_projection(ACTIVATIONS[self.config.activation](hidden))  # (B, L, d)


class EncoderLayer(_ConfigLayer):
    """Section 3.1, encoder layer: self-attention, then the feed-forward network, each in a
    residual with LayerNorm."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        self.self_attention = MultiHeadAttention(c, name="self_attention", dtype=policy)
        self.self_attention_norm = layer_norm(c, name="self_attention_norm", dtype=policy)
        self.feed_forward = FeedForward(c, name="feed_forward", dtype=policy)
        self.feed_forward_norm = layer_norm(c, name="feed_forward_norm", dtype=policy)

    def build(self, input_shape: tuple) -> None:
        self.self_attention.build(input_shape)
        self.self_attention_norm.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_norm.build(input_shape)

    def call(
        self,
        x: Any,
        mask: Any,
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> tuple[Any, Any]:
        """x (B, S, d), mask (B, 1, 1, S). Returns (x, self-attention probabilities or None)."""
        pre = self.config.norm_position == "pre"
        x, probs = residual(
            x,
            lambda y: self.self_attention(
                y, y, mask, return_attention=return_attention, training=training
            ),
            self.self_attention_norm,
            self.dropout,
            pre,
            training,
        )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            pre,
            training,
        )
        return x, probs


class DecoderLayer(_ConfigLayer):
    """Section 3.1, decoder layer: masked self-attention, cross-attention over the encoder
    output, then the feed-forward network, each in a residual with LayerNorm. A decoder-only
    model's layer (GPT's) has no cross-attention: cross_attention and its norm are None."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        self.self_attention = MultiHeadAttention(c, name="self_attention", dtype=policy)
        self.self_attention_norm = layer_norm(c, name="self_attention_norm", dtype=policy)
        self.cross_attention, self.cross_attention_norm = None, None
        if c.has_encoder:
            self.cross_attention = MultiHeadAttention(c, name="cross_attention", dtype=policy)
            self.cross_attention_norm = layer_norm(c, name="cross_attention_norm", dtype=policy)
        self.feed_forward = FeedForward(c, name="feed_forward", dtype=policy)
        self.feed_forward_norm = layer_norm(c, name="feed_forward_norm", dtype=policy)

    def build(self, input_shape: tuple, memory_shape: tuple | None = None) -> None:
        memory_shape = input_shape if memory_shape is None else memory_shape
        self.self_attention.build(input_shape)
        self.self_attention_norm.build(input_shape)
        if self.cross_attention is not None:
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
        *,
        return_attention: bool = False,
        cache: dict[str, Any] | None = None,
        index: Any = None,
        training: bool | None = None,
    ) -> tuple[Any, Any, Any, dict[str, Any] | None]:
        """x (B, T, d), memory (B, S, d), self_mask (B, 1, T, T), memory_mask (B, 1, 1, S);
        memory and memory_mask None in a decoder-only model, which has no cross-attention.

        Returns (x, self-attention probabilities or None, cross-attention probabilities or None,
        new cache or None). With `cache` (this layer's entry of tf_impl/decode.py's cache), x is
        the L positions (N, L, d) from `index` on (one for a decode step, the prompt for a
        prefill) and memory is unused: self-attention writes their keys and values into the
        cache's buffers and reads them all (self_mask (N, 1, L, max_steps)), cross-attention
        reads the cached keys and values of the memory, and the new cache is the entry with the
        updated buffers.
        """
        pre = self.config.norm_position == "pre"
        x, (self_probs, self_kv) = residual(
            x,
            lambda y: self._masked_self_attention(
                y, self_mask, return_attention, cache, index, training
            ),
            self.self_attention_norm,
            self.dropout,
            pre,
            training,
        )
        cross_probs = None
        if self.cross_attention is not None:
            cross_kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
            x, cross_probs = residual(
                x,
                lambda y: self.cross_attention(
                    y,
                    memory,
                    memory_mask,
                    return_attention=return_attention,
                    kv=cross_kv,
                    training=training,
                ),
                self.cross_attention_norm,
                self.dropout,
                pre,
                training,
            )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            pre,
            training,
        )
        if cache is None:
            return x, self_probs, cross_probs, None
        new_cache = {**cache, "self_key": self_kv[0], "self_value": self_kv[1]}
        return x, self_probs, cross_probs, new_cache

    def _masked_self_attention(
        self,
        y: Any,
        mask: Any,
        return_attention: bool,
        cache: dict[str, Any] | None,
        index: Any,
        training: bool | None,
    ) -> tuple[Any, tuple[Any, Any]]:
        """Section 3.2.3's masked self-attention over y, or, with a cache, over the cached
        positions with y's keys and values written at index..index+L-1. Returns (output,
        (probabilities or None, the updated (keys, values) buffers or None))."""
        if cache is None:
            out, probs = self.self_attention(
                y, y, mask, return_attention=return_attention, training=training
            )
            return out, (probs, None)
        # rosetta: cache
        keys, values = self.self_attention.keys_values(y)  # (N, h, L, k)
        at = (0, 0, index, 0)
        kv = (
            ops.slice_update(cache["self_key"], at, keys),  # (N, h, max_steps, k)
            ops.slice_update(cache["self_value"], at, values),
        )
        # rosetta: end
        out, probs = self.self_attention(
            y, None, mask, return_attention=return_attention, kv=kv, training=training
        )
        return out, (probs, kv)


# -- stacks -----------------------------------------------------------------------------------


class Stack(_ConfigLayer):
    """What Encoder and Decoder share: token and position embeddings (sections 3.4 and 3.5), with
    BERT's segment table and embedding LayerNorm when the config has them, N layers and the
    optional final LayerNorm."""

    layer_class: type[EncoderLayer | DecoderLayer]

    def __init__(
        self,
        config: TransformerConfig | dict,
        num_layers: int,
        vocab_size: int,
        embedding: layers.Embedding | dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
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
        # BERT's segment table [type_vocab_size, d]: row 0 is added to every token (the models
        # take no segment ids), so it is read as a row, never looked up by id.
        self.token_type_embedding = (
            layers.Embedding(
                c.type_vocab_size, c.d_model, name="token_type_embedding", dtype=policy
            )
            if c.type_vocab_size
            else None
        )
        self.embedding_norm = (
            layer_norm(c, name="embedding_norm", dtype=policy) if c.embedding_norm else None
        )
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        # Named "0", "1", ... and built under a "layers" name scope, so that their variables'
        # paths read "encoder/layers/0/...". (A dot in a name would break Keras's torch backend.)
        self.layers = [self.layer_class(c, name=str(i), dtype=policy) for i in range(num_layers)]
        if c.final_norm:
            self.final_norm = layer_norm(c, name="final_norm", dtype=policy)

    def build(self, ids_shape: tuple | None = None) -> None:
        shape = (None, None, self.config.d_model)
        if not self.embedding.built:  # a shared embedding is built by the Transformer
            self.embedding.build()
        if self.config.position_kind == "learned":
            self.position_embedding.build()
        if self.token_type_embedding is not None:
            self.token_type_embedding.build()
        if self.embedding_norm is not None:
            self.embedding_norm.build(shape)
        with keras.name_scope("layers"):
            for layer in self.layers:
                layer.build(shape)
        if self.config.final_norm:
            self.final_norm.build(shape)

    # idiom: no max_steps: keras.ops computes the rows for a tensor start in the graph
    def embed(self, ids: Any, *, start: Any = None, training: bool | None = None) -> Any:
        """Sections 3.4-3.5: Dropout(E[ids] * sqrt(d_model) + PE[0..L-1]), (B, L, d); with
        start (a decode step's index), PE[start..start+L-1]. BERT's additions, when the config
        has them: row 0 of the segment table, then a LayerNorm over the sum (before dropout)."""
        c = self.config
        # rosetta: embeddings
        x = self.embedding(ids)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        # rosetta: end
        length = ops.shape(ids)[1]
        if c.position_kind == "learned":
            pos = ops.arange(length)
            positions = self.position_embedding(pos if start is None else pos + start)
        else:
            table_dtype = statistics_dtype(self.compute_dtype)
            positions = sinusoidal_positions(
                length, c.d_model, c.sinusoid_layout, table_dtype, start
            )
        x = x + ops.cast(positions, x.dtype)[None]
        if self.token_type_embedding is not None:
            x = x + ops.cast(self.token_type_embedding.embeddings[0], x.dtype)  # type 0, (d,)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x, training=training)

    def _finish(self, x: Any) -> Any:
        return self.final_norm(x) if self.config.final_norm else x

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "embedding": keras.saving.serialize_keras_object(self.embedding)
            if self.shared
            else None,
        }


class Encoder(Stack):
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
        self,
        src: Any,
        mask: Any,
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> tuple[Any, list | None, list]:
        """src (B, S) ids, mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention
        probabilities per layer (None unless return_attention), hidden states: embeddings and
        each layer's output, before the final norm)."""
        x = self.embed(src, training=training)
        attentions, hidden = ([] if return_attention else None), [x]
        for layer in self.layers:
            x, probs = layer(x, mask, return_attention=return_attention, training=training)
            if attentions is not None:
                attentions.append(probs)
            hidden.append(x)
        return self._finish(x), attentions, hidden


class Decoder(Stack):
    """Section 3.1, decoder: embeddings, then N = num_decoder_layers decoder layers. Decoding
    with a cache (tf_impl/decode.py's decode_step, one position, and prefill, a prompt) runs the
    layers from there."""

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
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> tuple[Any, list | None, list | None, list]:
        """tgt_in (B, T) ids, memory (B, S, d) (None in a decoder-only model). Returns (output
        (B, T, d), self-attention and cross-attention probabilities per layer (None unless
        return_attention; no cross-attention maps without a memory), hidden states)."""
        x = self.embed(tgt_in, training=training)
        self_attentions = [] if return_attention else None
        cross_attentions = [] if return_attention else None
        hidden = [x]
        for layer in self.layers:
            x, self_probs, cross_probs, _ = layer(
                x,
                memory,
                self_mask,
                memory_mask,
                return_attention=return_attention,
                training=training,
            )
            if return_attention:
                self_attentions.append(self_probs)
                if layer.cross_attention is not None:
                    cross_attentions.append(cross_probs)
            hidden.append(x)
        return self._finish(x), self_attentions, cross_attentions, hidden


def pool(config: TransformerConfig, memory: Any, src: Any) -> Any:
    """The encoder-only model's pooled vector (B, d) from memory (B, S, d), or None when the
    config does not pool: "mean" averages the non-pad positions of src (B, S)
    (sentence-transformers' mean pooling; a row with none gives zeros, not NaN), "first" takes
    position 0 (BERT's [CLS]); pooled_l2_norm then divides by the L2 norm (a zero vector stays
    zero)."""
    if config.pooling == "none":
        return None
    # Sums in float32 or wider, as the norms keep their statistics (bfloat16 models).
    x = ops.cast(memory, statistics_dtype(keras.backend.standardize_dtype(memory.dtype)))
    if config.pooling == "first":
        pooled = x[:, 0]  # (B, d)
    else:
        real = ops.cast(ops.not_equal(src, config.pad_id), x.dtype)[:, :, None]  # (B, S, 1)
        pooled = ops.sum(x * real, axis=1) / ops.maximum(ops.sum(real, axis=1), 1.0)  # (B, d)
    if config.pooled_l2_norm:
        length = ops.sqrt(ops.sum(pooled * pooled, axis=-1, keepdims=True))  # (B, 1)
        pooled = pooled / ops.where(length > 0.0, length, 1.0)
    return ops.cast(pooled, memory.dtype)


class Transformer(keras.Model):
    """Section 3, Figure 1: the encoder-decoder Transformer, logits = Decoder(Encoder(src)) W_out.

    Section 3.4: with share_embeddings one embedding serves both stacks, and with tie_output the
    pre-softmax projection is the target embedding transposed. `encode` and `decode` are separate
    so that decoding can reuse the encoder output.

    The family's halves (docs/FORMAT.md, "The three kinds"): a decoder-only model (GPT) has no
    encoder (None) and its decoder layers no cross-attention; an encoder-only one (BERT) has no
    decoder and no output projection (None), and returns its encoder output and pooled vector.
    """

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        c = self.config = _config_from(config)
        policy = self.dtype_policy
        # rosetta: embeddings
        shared = None
        if c.share_embeddings:
            shared = layers.Embedding(
                c.src_vocab_size, c.d_model, name="shared_embedding", dtype=policy
            )
            self.shared_embedding = shared
        self.encoder = Encoder(c, shared, name="encoder", dtype=policy) if c.has_encoder else None
        self.decoder = Decoder(c, shared, name="decoder", dtype=policy) if c.has_decoder else None
        # rosetta: end
        # The output projection's variables, made in build(); None where the config has none.
        self.output_kernel, self.output_bias = None, None

    def build(self, src_shape: tuple | None = None, tgt_in_shape: tuple | None = None) -> None:
        c = self.config
        if c.share_embeddings:
            self.shared_embedding.build()  # here, so that its path is "shared_embedding"
        for stack in (self.encoder, self.decoder):
            if stack is not None:
                stack.build()
        # The output projection has no layer of its own (tied, it is E^T plus maybe a bias), so
        # its variables are made under an "output" name scope: paths "output/kernel", "output/bias".
        # rosetta: parameters
        with keras.name_scope("output"):
            if c.has_decoder and not c.tie_output:
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
        # rosetta: end

    def encode(
        self, src: Any, *, return_attention: bool = False, training: bool | None = None
    ) -> tuple[Any, list | None, list]:
        """src (B, S) ids -> (memory (B, S, d), attentions or None, hidden states)."""
        return self.encoder(
            src,
            key_padding_mask(src, self.config.pad_id),
            return_attention=return_attention,
            training=training,
        )

    def decode(
        self,
        tgt_in: Any,
        memory: Any,
        src: Any,
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> tuple[Any, list | None, list | None, list]:
        """tgt_in (B, T) ids (the target shifted right behind BOS), memory (B, S, d) ->
        (logits (B, T, V), self attentions or None, cross attentions or None, hidden states).
        A decoder-only model passes memory and src None."""
        pad = self.config.pad_id
        y, self_attentions, cross_attentions, hidden = self.decoder(
            tgt_in,
            memory,
            decoder_self_mask(tgt_in, pad),
            None if src is None else key_padding_mask(src, pad),
            return_attention=return_attention,
            training=training,
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: Any) -> Any:
        """Section 3.4: the pre-softmax linear transformation y W_out (+ b); tied: W_out = E^T."""
        c = self.config
        # rosetta: embeddings
        if c.tie_output:
            table = self.decoder.embedding.embeddings  # (V, d)
            logits = ops.einsum("btd,vd->btv", y, table)
        else:
            logits = ops.matmul(y, self.output_kernel)
        # rosetta: end
        if c.output_bias:
            logits = logits + self.output_bias
        return logits  # (B, T, V)

    def call(
        self,
        src: Any,
        tgt_in: Any,
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> dict[str, Any]:
        """The whole model: a dict with logits, encoder_output, the three attention lists (None
        unless return_attention), the hidden states of both stacks and pooled_output. A half of
        the family takes only its own input (src None for decoder-only, tgt_in None for
        encoder-only) and returns None for what it lacks (logits, encoder_output) and empty
        lists for the other half's attention maps and hidden states."""
        c = self.config
        absent = [] if return_attention else None  # the maps of a half the model lacks
        memory, encoder_attentions, encoder_hidden, pooled = None, absent, [], None
        if c.has_encoder:
            memory, encoder_attentions, encoder_hidden = self.encode(
                src, return_attention=return_attention, training=training
            )
            pooled = pool(c, memory, src)
        logits, self_attentions, cross_attentions, decoder_hidden = None, absent, absent, []
        if c.has_decoder:
            logits, self_attentions, cross_attentions, decoder_hidden = self.decode(
                tgt_in, memory, src, return_attention=return_attention, training=training
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

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Transformer:
        return cls(**config)
