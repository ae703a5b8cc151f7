"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as Keras 3 layers.

Each layer stores its arguments in `__init__`, creates its weights in `build()` and computes in
`call(..., training=None)`; train mode is that argument, passed down every call. The math is
written only in `keras.ops`, so this file runs unchanged on Keras's TensorFlow (the one we ship),
JAX and PyTorch backends, and imports no framework below Keras. Layer names are chosen so that a
variable's `.path` is its canonical name (common/spec/names.py) with "/" for "." under the
model's own name; tf_impl/weights.py relies on that rule.

Masks are boolean, True = may attend, built by the small pure functions below, which mirror
common/spec/masks.py, and shaped to broadcast against the scores (B, h, T_q, T_k). They are
explicit arguments: Keras's implicit mask propagation is never used.

Shapes: B batch, S source length, T target length, L positions at hand, d = d_model, h heads,
d_k = d / h (or the config's key_dim), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import layers, ops

from transformer_rosetta.spec.config import TransformerConfig

# -- masks (mirrors of common/spec/masks.py) ------------------------------------------------------


def key_padding_mask(ids: Any, pad_id: int) -> Any:
    """(B, 1, 1, T_k): a key may be attended iff it is not padding."""
    return ops.not_equal(ids, pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: Any, pad_id: int) -> Any:
    """(B, 1, 1, T): as key_padding_mask, but position 0 is always visible: it holds BOS, and some
    models (Marian) use the pad id as BOS."""
    first = ops.equal(ops.arange(ops.shape(ids)[1]), 0)  # (T,)
    return ops.logical_or(ops.not_equal(ids, pad_id), first)[:, None, None, :]


def causal_mask(length: int) -> Any:
    """(1, 1, T, T): query i may attend key j iff j <= i (section 3.2.3)."""
    return ops.tril(ops.ones((length, length), dtype="bool"))[None, None]


def decoder_self_mask(tgt_in: Any, pad_id: int) -> Any:
    """(B, 1, T, T): decoder self-attention is causal and skips padding."""
    return ops.logical_and(
        decoder_key_padding_mask(tgt_in, pad_id), causal_mask(ops.shape(tgt_in)[1])
    )


# -- positions, activations -----------------------------------------------------------------------


# idiom: rows computed in the graph, in the dtype asked for, for the positions at hand
def sinusoidal_positions(
    length: int,
    d_model: int,
    layout: str,
    dtype: str,  # idiom: keras.ops picks no float64 by itself
    start: Any = None,  # idiom: a tensor position, so a compiled decode step does not retrace
) -> Any:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same),
    one row per position, (length, d_model), for any length: sinusoids extrapolate past max_len.

    Deviation, flagged: layout "concatenated" (tensor2tensor, Marian) puts every sin first, then
    every cos, with the same frequencies. Any other layout is a ValueError.
    """
    # rosetta: positions
    pos = ops.arange(length, dtype=dtype)[:, None]  # (L, 1)
    if start is not None:  # a decode step: a tensor index, so a compiled step does not retrace
        pos = pos + ops.cast(start, dtype)
    two_i = ops.arange(0, d_model, 2, dtype=dtype)[None, :]  # (1, d/2)
    angle = pos / ops.power(ops.cast(10000.0, dtype), two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return ops.reshape(ops.stack([ops.sin(angle), ops.cos(angle)], axis=-1), (length, d_model))
    if layout == "concatenated":
        return ops.concatenate([ops.sin(angle), ops.cos(angle)], axis=-1)
    # rosetta: end
    raise ValueError(f"unknown sinusoid layout {layout!r}")


# idiom: rows computed in the graph for the positions at hand, as sinusoidal_positions does
def rotary_positions(
    length: int,
    head_dim: int,
    theta: float,
    start: Any = None,  # idiom: a tensor position, so a compiled decode step does not retrace
) -> tuple[Any, Any]:
    """Rotary positions (Su et al. 2021, RoFormer, Eq. 15): the cosines and sines of
    angle(pos, i) = pos * theta^(-2i / d_k), i = 0 .. d_k/2 - 1, for pos = 0 .. length - 1: two
    tables (length, d_k / 2), for any length (rotations extrapolate past max_len, as sinusoids
    do). docs/FORMAT.md, step 4a."""
    # idiom: float64 as the Keras backend has it: Keras's JAX backend caps 64-bit types at
    # float32 (tf_impl/distributed.py lifts the cap for a float64 model)
    wide = keras.backend.result_type("float64")
    pos = ops.arange(length, dtype=wide)[:, None]  # (L, 1)
    if start is not None:  # a decode step: a tensor index, so a compiled step does not retrace
        pos = pos + ops.cast(start, wide)
    two_i = ops.arange(0, head_dim, 2, dtype=wide)[None, :]  # (1, d_k/2)
    # theta a tensor of that dtype from the start: ops.cast would make a float32 tensor first
    base = ops.convert_to_tensor(theta, dtype=wide)
    angle = pos * ops.power(base, -two_i / head_dim)  # (L, d_k/2)
    return ops.cos(angle), ops.sin(angle)


def rotate(x: Any, cos: Any, sin: Any, layout: str) -> Any:
    """Rotary positions (Su et al. 2021, Eq. 34): each pair (a, b) of a query's or key's
    dimensions becomes (a cos - b sin, b cos + a sin), by its position's angle. x holds the
    queries or keys of L positions, d_k per head, in the framework's head layout (its `# idiom:`
    says which); cos and sin (L, d_k / 2), in x's dtype (rotary_positions' rows of x's positions).

    "half_split" pairs dimension i with i + d_k/2 (Hugging Face's rotate_half); "interleaved"
    pairs 2i with 2i + 1 (Meta's Llama, RoFormer). Any other layout is a ValueError."""
    # idiom: heads after positions, x (B, L, heads, d_k) (EinsumDense's layout): the tables
    # broadcast over the heads
    cos, sin = cos[:, None, :], sin[:, None, :]  # (L, 1, d_k/2)
    half = x.shape[-1] // 2
    if layout == "half_split":
        a, b = x[..., :half], x[..., half:]
    elif layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        raise ValueError(f"unknown rotary layout {layout!r}")
    rotated_a, rotated_b = a * cos - b * sin, b * cos + a * sin
    if layout == "half_split":
        return ops.concatenate([rotated_a, rotated_b], axis=-1)
    # 2i and 2i + 1 side by side again: (..., d_k/2, 2) -> (..., d_k)
    return ops.reshape(ops.stack([rotated_a, rotated_b], axis=-1), ops.shape(x))


# idiom: GELU written out rather than ops.gelu: on TensorFlow that is tf.nn.gelu, whose constants
# pass through float32 (errors ~5e-9 in a float64 model)
def _gelu(x: Any) -> Any:
    """x Phi(x) with the exact erf."""
    return 0.5 * x * (1.0 + ops.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: Any) -> Any:
    """GELU's tanh form."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + ops.tanh(inner))


ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "relu": ops.relu,  # Eq. (2): max(0, x)
    "gelu": _gelu,  # deviation, flagged (ported models): x Phi(x), the exact erf form
    "gelu_tanh": _gelu_tanh,  # GELU's tanh approximation
    "silu": ops.silu,  # x sigmoid(x) (Elfwing et al. 2018), the gate of SwiGLU
}


def statistics_dtype(dtype: Any) -> str:
    """float32 or wider: the dtype that the softmax, the norms' statistics and the pooling sums
    run in, even when the model computes in bfloat16."""
    return keras.backend.result_type(dtype, "float32")


# -- attention (Eq. 1) ----------------------------------------------------------------------------


# keras.ops.dot_product_attention in Keras 3.15 repeats fewer key/value heads itself for
# 1 < g < h, but on TensorFlow fails for g = 1 (multi-query: an einsum that does not broadcast a
# head axis of 1); Keras's own GroupedQueryAttention repeats them (ops.repeat over the heads).
# idiom: the key/value heads repeated before either attention path, as GroupedQueryAttention does
def repeat_key_value_heads(x: Any, group: int) -> Any:
    """Grouped-query attention (Ainslie et al. 2023; multi-query, Shazeer 2019, for one head):
    the keys or values x (B, T_k, g, d_k) of g heads, each repeated for the `group` = h / g
    consecutive query heads that read it, (B, T_k, h, d_k): query head n reads key/value head
    n // group (Hugging Face's repeat_kv, a repeat_interleave)."""
    return x if group == 1 else ops.repeat(x, group, axis=2)


# idiom: heads after positions, q (B, T_q, h, d_k), k and v (B, T_k, g, d_k): the layout of
# EinsumDense's projections and of keras.ops.dot_product_attention
def explicit_attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    dropout: layers.Dropout,
    training: bool | None = None,  # idiom: a Keras Dropout takes `training` per call
) -> tuple[Any, Any]:
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
    # idiom: each key/value head repeated for its h / g query heads (repeat_key_value_heads)
    group = q.shape[2] // k.shape[2]
    k, v = repeat_key_value_heads(k, group), repeat_key_value_heads(v, group)  # (B, T_k, h, d_k)
    scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, h, T_q, T_k)
    wide = statistics_dtype(scores.dtype)
    scores = ops.cast(scores, wide)
    scores = ops.where(mask, scores, float(np.finfo(wide).min))
    # idiom: softmax written out (as the oracle does) rather than ops.softmax, which warns on
    # every length-1 key axis, a case the tests use on purpose
    exp = ops.exp(scores - ops.max(scores, axis=-1, keepdims=True))
    probs = ops.cast(ops.where(mask, exp / ops.sum(exp, axis=-1, keepdims=True), 0.0), q.dtype)
    context = ops.einsum("bhqk,bkhd->bqhd", dropout(probs, training=training), v)
    return context, probs


def fused_attention(q: Any, k: Any, v: Any, mask: Any) -> Any:
    """Eq. (1) by the framework's fused attention kernel, which never materialises the
    probabilities: the context, in explicit_attention's layout, fewer key/value heads included.
    The kernels disagree on a query with no allowed key (zeros, a uniform average of the values,
    or NaN); it gets a zero context here, as on the explicit path."""
    # idiom: the kernel is keras.ops.dot_product_attention (XLA's on TensorFlow and JAX, SDPA on
    # torch)
    # 1/sqrt(d_k) is applied to q here, not passed as `scale`: the TF backend turns a Python
    # float scale into a float32 tensor, which costs float64 models ~1e-7, and the torch
    # backend takes no tensor scale.
    q = q / math.sqrt(q.shape[-1])
    # idiom: the key/value heads repeated first (repeat_key_value_heads says why)
    group = q.shape[2] // k.shape[2]
    k, v = repeat_key_value_heads(k, group), repeat_key_value_heads(v, group)  # (B, T_k, h, d_k)
    context = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0)
    has_key = ops.transpose(ops.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B, T_q or 1, 1, 1)
    return ops.where(has_key, context, ops.zeros_like(context))


# -- sublayer wiring (section 3.1) ----------------------------------------------------------------


def layer_norm(config: TransformerConfig, *, name: str, dtype: Any) -> layers.Layer:
    """Ba et al. 2016 with the config's epsilon (each framework's default differs, and none is
    the paper's): population variance, eps inside the square root, statistics in float32 or
    wider for bfloat16 inputs. norm_kind "std_plus_eps" is StdPlusEpsNorm, "rms_norm" RMSNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, config.layer_norm_eps, name=name, dtype=dtype)
    if config.norm_kind == "rms_norm":
        return RMSNorm(config.d_model, config.layer_norm_eps, name=name, dtype=dtype)
    # idiom: Keras's default epsilon is 1e-3 (a classic parity bug); its statistics are float32
    # for bfloat16 inputs
    return CentredLayerNormalization(epsilon=config.layer_norm_eps, name=name, dtype=dtype)


# idiom: Keras's own LayerNormalization cancels where the features are nearly equal
class CentredLayerNormalization(layers.LayerNormalization):
    """Keras's LayerNormalization (its weights, names and checkpoint), normalising as the spec
    writes it: (x - mean) * rsqrt(var + eps) * gamma + beta.

    Keras's ops.layer_normalization computes x * inv + (beta - mean * inv) with inv = gamma *
    rsqrt(var + eps): two large terms that cancel where the features are nearly equal. With
    d_model 1 the normalised value is exactly beta, and Keras's was 1.6e-6 off it in float32
    (inv = 1307 with eps 1e-6), a logit 1.0e-5 off the oracle, where torch and Flax were 2.6e-8
    off (docs/divergences.json, keras-layer-norm-cancels)."""

    # idiom: Keras's own formula cancels (above); the spec's, on Keras's weights
    def call(self, inputs: Any) -> Any:
        x = ops.cast(inputs, statistics_dtype(inputs.dtype))  # float32 or wider, as Keras keeps it
        mean, variance = ops.moments(x, axes=self.axis, keepdims=True)
        y = (x - mean) * ops.rsqrt(variance + self.epsilon)
        y = y * ops.cast(self.gamma, x.dtype) + ops.cast(self.beta, x.dtype)
        return ops.cast(y, self.compute_dtype)


class StdPlusEpsNorm(layers.Layer):
    """The Annotated Transformer's LayerNorm: scale * (x - mean) / (std + eps) + bias, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Its parameters carry the names of the framework's own LayerNorm, so the checkpoint names do
    not depend on the kind."""

    def __init__(self, d_model: int, eps: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d_model, self.eps = d_model, eps

    def build(self, input_shape: tuple) -> None:
        # idiom: LayerNormalization's names: gamma (the scale) and beta (the bias)
        self.gamma = self.add_weight(shape=(self.d_model,), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(self.d_model,), initializer="zeros", name="beta")

    def call(self, x: Any) -> Any:
        # Statistics in float32 or wider (bfloat16 inputs), as the framework's LayerNorm keeps them.
        y = ops.cast(x, statistics_dtype(x.dtype))
        # idiom: keras.ops.std has no ddof: the unbiased (n - 1) standard deviation written out
        centred = y - ops.mean(y, axis=-1, keepdims=True)
        std = ops.sqrt(ops.sum(centred * centred, axis=-1, keepdims=True) / (self.d_model - 1))
        y = centred / (std + self.eps)
        return ops.cast(y * ops.cast(self.gamma, y.dtype) + ops.cast(self.beta, y.dtype), x.dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "d_model": self.d_model, "eps": self.eps}


# idiom: Keras's RMSNormalization multiplies the gain in float32 and rounds once; the spec
# (Hugging Face's order) rounds the normalised value to the input dtype first
class RMSNorm(layers.RMSNormalization):
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4): x / sqrt(mean(x^2) + eps) * scale, no mean
    subtracted and no bias (docs/FORMAT.md, step 3). The statistics run in float32 or wider, and
    the normalised x is rounded back to the input's dtype before the gain multiplies it
    (Hugging Face's Llama: `weight * hidden.to(input_dtype)`). The gain carries the name of the
    framework's own RMSNorm (its `# idiom:` says which)."""

    def __init__(self, d_model: int, eps: float, **kwargs: Any) -> None:
        # idiom: RMSNormalization's gain is `scale` (the canonical leaf), shaped in build()
        super().__init__(epsilon=eps, **kwargs)
        self.d_model, self.eps = d_model, eps

    # idiom: Keras's normalisation (ops.rms_normalization: float32 or wider statistics, the
    # result rounded to x's dtype), the gain multiplied after it in x's dtype (above)
    def call(self, x: Any) -> Any:
        normalised = ops.rms_normalization(x, axis=self.axis, epsilon=self.epsilon)
        return normalised * ops.cast(self.scale, normalised.dtype)

    def get_config(self) -> dict[str, Any]:
        config = {**super().get_config(), "d_model": self.d_model, "eps": self.eps}
        del config["axis"], config["epsilon"]  # this layer's arguments are d_model and eps
        return config


def residual(
    x: Any,
    sublayer: Callable[[Any], tuple[Any, Any]],
    norm: layers.Layer,
    dropout: layers.Dropout,
    pre_norm: bool,
    training: bool | None = None,  # idiom: a Keras Dropout takes `training` per call
) -> tuple[Any, Any]:
    """Sections 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm. Deviation,
    flagged: pre-norm (Wang et al. 2019) computes x + Dropout(Sublayer(LayerNorm(x))).

    `sublayer` maps its input to (output, extra); returns (the new x, extra), extra (attention
    probabilities, say) passed through."""
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out, training=training)
    return (x if pre_norm else norm(x)), extra


# -- layers ---------------------------------------------------------------------------------------


def _config_from(value: TransformerConfig | dict) -> TransformerConfig:
    return value if isinstance(value, TransformerConfig) else TransformerConfig.from_dict(value)


# idiom: a Keras layer serialises its arguments (get_config), so that from_config can rebuild it
class _ConfigLayer(layers.Layer):
    """A layer made from the model's config, which get_config serialises (so that Keras's
    from_config can rebuild it)."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _config_from(config)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}


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


class MultiHeadAttention(_ConfigLayer):
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

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c = self.config
        # rosetta: heads
        # idiom: EinsumDense keeps heads as an axis, [d, h, d_k] and [h, d_k, d]: the canonical
        # layout, with no reshapes
        bias = "nk" if c.attention_bias else None
        policy = self.dtype_policy
        shape = (None, c.num_heads, c.head_dim)
        kv_shape = (None, c.kv_heads, c.head_dim)  # g key/value heads
        self.query = HeadProjection(
            "btd,dnk->btnk", shape, bias_axes=bias, name="query", dtype=policy
        )
        self.key = HeadProjection(
            "bsd,dnk->bsnk", kv_shape, bias_axes=bias, name="key", dtype=policy
        )
        self.value = HeadProjection(
            "bsd,dnk->bsnk", kv_shape, bias_axes=bias, name="value", dtype=policy
        )
        # rosetta: end
        # idiom: `output` is a read-only property of every Keras layer, hence the longer
        # attribute name; the layer's name (and so its variables' paths) is still "output"
        self.output_projection = HeadProjection(
            "btnk,nkd->btd",
            (None, c.d_model),
            bias_axes="d" if c.output_projection_bias else None,
            name="output",
            dtype=policy,
        )
        self.dropout = layers.Dropout(c.attention_dropout, dtype=policy)

    def build(self, x_q_shape: tuple, x_kv_shape: tuple | None = None) -> None:
        x_kv_shape = x_q_shape if x_kv_shape is None else x_kv_shape
        self.query.build(x_q_shape)
        self.key.build(x_kv_shape)
        self.value.build(x_kv_shape)
        self.output_projection.build((None, None, self.config.num_heads, self.config.head_dim))

    def keys_values(self, x_kv: Any, rotary: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """K W^K and V W^V of x_kv (B, T_k, d), split into the g key/value heads,
        (B, g, T_k, d_k) each, the keys rotated when `rotary` (cos, sin) is given: what a decode
        cache keeps (decode.py), in the same layout in every implementation."""
        k, v = self.key(x_kv), self.value(x_kv)  # (B, T_k, g, d_k)
        if rotary is not None:
            k = rotate(k, *rotary, self.config.rotary_layout)
        return ops.transpose(k, (0, 2, 1, 3)), ops.transpose(v, (0, 2, 1, 3))  # (B, g, T_k, d_k)

    def call(
        self,
        x_q: Any,
        x_kv: Any,
        mask: Any,
        *,
        return_attention: bool = False,
        kv: tuple[Any, Any] | None = None,
        rotary: tuple[Any, Any] | None = None,
        training: bool | None = None,
    ) -> tuple[Any, Any]:
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
            q = rotate(q, *rotary, self.config.rotary_layout)
        if kv is None:
            k, v = self.key(x_kv), self.value(x_kv)  # (B, T_k, g, d_k)
            if rotary is not None:
                k = rotate(k, *rotary, self.config.rotary_layout)
        else:  # the cache's (B, g, T_k, d_k), back to (B, T_k, g, d_k)
            k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in kv)
        # rosetta: dropout
        # idiom: explicit also with live attention dropout (the fused kernel has none)
        if return_attention or (training and self.config.attention_dropout > 0):
            context, probs = explicit_attention(q, k, v, mask, self.dropout, training)
        else:
            context, probs = fused_attention(q, k, v, mask), None
        # rosetta: end
        return self.output_projection(context), probs


class FeedForward(_ConfigLayer):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, with W_1 and b_1 in
    `intermediate` and W_2 and b_2 in `output`. Deviation, flagged: GELU (the exact erf form, or
    its tanh approximation) or SiLU instead of max(0, x) for ported models; the gated
    feed-forward (Shazeer 2020, GLU variants: SwiGLU with SiLU) (act(x W_gate + b_gate) *
    (x W_1 + b_1)) W_2 + b_2, with W_gate and b_gate in `gate`; no biases without
    feed_forward_bias (Llama)."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
        bias = c.feed_forward_bias
        self.gate = (
            layers.Dense(c.d_ff, use_bias=bias, name="gate", dtype=policy)
            if c.gated_feed_forward
            else None
        )
        self.intermediate = layers.Dense(c.d_ff, use_bias=bias, name="intermediate", dtype=policy)
        # idiom: `output` is a read-only property of every Keras layer (see MultiHeadAttention)
        self.output_projection = layers.Dense(c.d_model, use_bias=bias, name="output", dtype=policy)
        self.activation = c.activation  # a key of ACTIVATIONS, looked up at each call

    def build(self, input_shape: tuple) -> None:
        if self.gate is not None:
            self.gate.build(input_shape)
        self.intermediate.build(input_shape)
        self.output_projection.build((*input_shape[:-1], self.config.d_ff))

    def call(self, x: Any) -> Any:
        act = ACTIVATIONS[self.activation]
        if self.gate is None:
            return self.output_projection(act(self.intermediate(x)))
        return self.output_projection(act(self.gate(x)) * self.intermediate(x))


class EncoderLayer(_ConfigLayer):
    """Section 3.1, encoder layer: multi-head self-attention, then the position-wise feed-forward
    network, each inside a residual connection with LayerNorm."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        self.self_attention = MultiHeadAttention(c, name="self_attention", dtype=policy)
        self.self_attention_norm = layer_norm(c, name="self_attention_norm", dtype=policy)
        self.feed_forward = FeedForward(c, name="feed_forward", dtype=policy)
        self.feed_forward_norm = layer_norm(c, name="feed_forward_norm", dtype=policy)
        self.pre_norm = c.norm_position == "pre"

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
        rotary: tuple[Any, Any] | None = None,
        training: bool | None = None,
    ) -> tuple[Any, Any]:
        """x (B, S, d) under mask (B, 1, 1, S) -> (x, self-attention probabilities or None).
        rotary: the positions' (cos, sin) for a rotary model's self-attention (Stack.rotary)."""
        x, probs = residual(
            x,
            lambda y: self.self_attention(
                y, y, mask, return_attention=return_attention, rotary=rotary, training=training
            ),
            self.self_attention_norm,
            self.dropout,
            self.pre_norm,
            training,
        )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            self.pre_norm,
            training,
        )
        return x, probs


def write_cache(buffer: Any, new: Any, index: Any) -> Any:
    """Write `new` (N, g, L, d_k), the keys or the values of the L positions index..index+L-1
    (L = 1 in a decoding step, the prompt's length in a prefill), into a decode cache's buffer
    (N, g, max_steps, d_k) at those positions, and return the buffer as written: every
    position's keys or values, for the queries to attend (those not written yet are masked)."""
    # idiom: tensors are immutable: ops.slice_update returns a new buffer
    return ops.slice_update(buffer, (0, 0, index, 0), new)


class DecoderLayer(_ConfigLayer):
    """Section 3.1, decoder layer: masked self-attention, cross-attention over the encoder
    output, then the feed-forward network, each inside a residual connection with LayerNorm. A
    decoder-only model's layer (GPT, Radford et al. 2018) has no encoder output to attend: no
    cross-attention sublayer (cross_attention and its norm are None), and no parameters for one."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        c, policy = self.config, self.dtype_policy
        self.dropout = layers.Dropout(c.dropout, dtype=policy)
        self.self_attention = MultiHeadAttention(c, name="self_attention", dtype=policy)
        self.self_attention_norm = layer_norm(c, name="self_attention_norm", dtype=policy)
        if c.has_encoder:
            self.cross_attention = MultiHeadAttention(c, name="cross_attention", dtype=policy)
            self.cross_attention_norm = layer_norm(c, name="cross_attention_norm", dtype=policy)
        else:
            self.cross_attention = self.cross_attention_norm = None
        self.feed_forward = FeedForward(c, name="feed_forward", dtype=policy)
        self.feed_forward_norm = layer_norm(c, name="feed_forward_norm", dtype=policy)
        self.pre_norm = c.norm_position == "pre"

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
        rotary: tuple[Any, Any] | None = None,
        training: bool | None = None,
    ) -> tuple[Any, Any, Any, dict[str, Any] | None]:
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

        def self_attention(y: Any) -> tuple[Any, tuple]:
            kv = None
            if cache is not None:
                keys, values = self.self_attention.keys_values(y, rotary)  # (N, g, L, d_k) each
                keys = write_cache(cache["self_key"], keys, index)  # (N, g, max_steps, d_k)
                values = write_cache(cache["self_value"], values, index)
                kv = keys, values
            out, probs = self.self_attention(
                y,
                y,
                self_mask,
                return_attention=return_attention,
                kv=kv,
                rotary=rotary,
                training=training,
            )
            return out, (probs, kv)

        def cross_attention(y: Any) -> tuple[Any, Any]:
            kv = None if cache is None else (cache["cross_key"], cache["cross_value"])
            return self.cross_attention(
                y, memory, memory_mask, return_attention=return_attention, kv=kv, training=training
            )

        x, (self_probs, self_kv) = residual(
            x, self_attention, self.self_attention_norm, self.dropout, self.pre_norm, training
        )
        cross_probs = None
        if self.cross_attention is not None:
            x, cross_probs = residual(
                x, cross_attention, self.cross_attention_norm, self.dropout, self.pre_norm, training
            )
        x, _ = residual(
            x,
            lambda y: (self.feed_forward(y), None),
            self.feed_forward_norm,
            self.dropout,
            self.pre_norm,
            training,
        )
        if cache is None:
            return x, self_probs, cross_probs, None
        keys, values = self_kv
        # idiom: tensors are immutable: a new dict with the new buffers
        new_cache = {**cache, "self_key": keys, "self_value": values}
        return x, self_probs, cross_probs, new_cache


# -- stacks ---------------------------------------------------------------------------------------


class Stack(_ConfigLayer):
    """What Encoder and Decoder share (section 3.1): the token embedding (section 3.4), the
    positions (section 3.5), BERT's segment table and embedding LayerNorm when the config has
    them, dropout, N = num_layers identical layers and the optional final LayerNorm (pre-norm
    models and torch's nn.Transformer have one). A shared embedding (share_embeddings) is one
    table for both stacks, held as the framework allows (its `# idiom:` says how)."""

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
        # idiom: a shared embedding (section 3.4) is one layer object owned by the Transformer; a
        # layer is not a config value, so get_config serialises it and Transformer rewires it
        if isinstance(embedding, dict):
            embedding = keras.saving.deserialize_keras_object(embedding)
        self.shared = embedding is not None
        self.embedding = embedding or layers.Embedding(
            vocab_size, c.d_model, name="embedding", dtype=policy
        )
        self.position_embedding = (
            layers.Embedding(c.max_len, c.d_model, name="position_embedding", dtype=policy)
            if c.position_kind == "learned"
            else None
        )
        # BERT's embeddings (Devlin et al. 2019, section 3): a segment table, of which the models
        # read row 0 only (they take no segment ids), and a LayerNorm over the summed embeddings.
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
        self.final_norm = layer_norm(c, name="final_norm", dtype=policy) if c.final_norm else None

    def build(self, ids_shape: tuple | None = None) -> None:
        shape = (None, None, self.config.d_model)
        if not self.embedding.built:  # a shared embedding is built by the Transformer
            self.embedding.build()
        if self.position_embedding is not None:
            self.position_embedding.build()
        if self.token_type_embedding is not None:
            self.token_type_embedding.build()
        if self.embedding_norm is not None:
            self.embedding_norm.build(shape)
        with keras.name_scope("layers"):
            for layer in self.layers:
                layer.build(shape)
        if self.final_norm is not None:
            self.final_norm.build(shape)

    # idiom: no max_steps: keras.ops computes the rows for a tensor start in the graph
    def embed(self, ids: Any, *, start: Any = None, training: bool | None = None) -> Any:
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
            real = ops.not_equal(ids, c.pad_id)  # (B, L)
            x = self.embedding(ops.where(real, ids, ops.zeros_like(ids)))  # (B, L, d)
            x = ops.where(real[..., None], x, ops.zeros_like(x))
        else:
            x = self.embedding(ids)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        # rosetta: end
        length = ops.shape(ids)[1]
        if self.position_embedding is not None:  # PE[start..start+L-1], looked up
            positions = ops.arange(length)  # (L,)
            pe = self.position_embedding(positions if start is None else positions + start)
            x = x + ops.cast(pe, x.dtype)[None]
        elif c.position_kind == "sinusoidal":  # the rows for the positions at hand, in float32+
            table_dtype = statistics_dtype(self.compute_dtype)
            pe = sinusoidal_positions(length, c.d_model, c.sinusoid_layout, table_dtype, start)
            x = x + ops.cast(pe, x.dtype)[None]
        # rotary positions add nothing here: the self-attentions rotate by Stack.rotary's rows
        if self.token_type_embedding is not None:
            x = x + ops.cast(self.token_type_embedding.embeddings[0], x.dtype)  # (d,): type 0
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x, training=training)

    # idiom: no max_steps: keras.ops computes the rows for a tensor start in the graph
    def rotary(self, length: int, *, start: Any = None) -> tuple[Any, Any] | None:
        """Rotary positions (Su et al. 2021): the (cos, sin) of positions start..start+length-1,
        (length, d_k / 2) each in the model's dtype, that every self-attention of the stack
        rotates its queries and keys by; start None is 0, and a decoding step passes the cache's
        index, as to `embed`. None when the config's positions are not rotary."""
        c = self.config
        if c.position_kind != "rotary":
            return None
        tables = rotary_positions(length, c.head_dim, c.rope_theta, start)  # float64
        return tuple(ops.cast(t, self.compute_dtype) for t in tables)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "embedding": keras.saving.serialize_keras_object(self.embedding)
            if self.shared
            else None,
        }


class Encoder(Stack):
    """Section 3.1: the encoder, N = num_encoder_layers encoder layers over the embedded
    source."""

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
        """src (B, S) ids under mask (B, 1, 1, S). Returns (memory (B, S, d), self-attention
        probabilities per layer or None, hidden states: the embedding output and every layer's
        output, before the final norm)."""
        x = self.embed(src, training=training)
        rotary = self.rotary(ops.shape(src)[1])  # None unless rotary
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(
                x, mask, return_attention=return_attention, rotary=rotary, training=training
            )
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
        """tgt_in (B, T) ids (BOS first) over memory (B, S, d), under self_mask (B, 1, T, T) and
        memory_mask (B, 1, 1, S); memory and memory_mask None for a decoder-only model. Returns
        (output (B, T, d), self and cross probabilities per layer or None, hidden states); the
        cross probabilities are an empty list when the layers have no cross-attention."""
        x = self.embed(tgt_in, training=training)
        rotary = self.rotary(ops.shape(tgt_in)[1])  # None unless rotary
        self_attentions, cross_attentions, hidden = [], [], [x]
        for layer in self.layers:
            x, self_probs, cross_probs, _ = layer(
                x,
                memory,
                self_mask,
                memory_mask,
                return_attention=return_attention,
                rotary=rotary,
                training=training,
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


def pool(config: TransformerConfig, memory: Any, src: Any) -> Any:
    """An encoder-only model's pooled vector (B, d) from its output memory (B, S, d) over the ids
    src (B, S), or None when config.pooling is "none". Not in the paper: "mean" averages the
    non-pad positions (sentence-transformers' mean pooling; a row with none gives zeros, not
    NaN), "first" takes position 0 (BERT's [CLS]); pooled_l2_norm then divides by the L2 norm (a
    zero vector stays zero). The sums run in float32 or wider (statistics_dtype), and the result
    is in memory's dtype."""
    if config.pooling == "none":
        return None
    # The sums in float32 or wider, as the norms keep their statistics (bfloat16 models).
    y = ops.cast(memory, statistics_dtype(memory.dtype))
    if config.pooling == "first":
        pooled = y[:, 0]  # (B, d)
    else:
        real = ops.cast(ops.not_equal(src, config.pad_id)[:, :, None], y.dtype)  # (B, S, 1)
        pooled = ops.sum(y * real, axis=1) / ops.maximum(ops.sum(real, axis=1), 1.0)  # (B, d)
    if config.pooled_l2_norm:
        length = ops.sqrt(ops.sum(pooled * pooled, axis=-1, keepdims=True))  # (B, 1)
        pooled = pooled / ops.where(length > 0.0, length, 1.0)
    return ops.cast(pooled, memory.dtype)


class Transformer(keras.Model):
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

    def encode(
        self, src: Any, *, return_attention: bool = False, training: bool | None = None
    ) -> tuple[Any, list | None, list]:
        """The encoder on source ids src (B, S) under their padding mask: (memory (B, S, d),
        self-attention probabilities per layer or None, hidden states); see Encoder."""
        mask = key_padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        return self.encoder(src, mask, return_attention=return_attention, training=training)

    def decode(
        self,
        tgt_in: Any,
        memory: Any,
        src: Any,
        *,
        return_attention: bool = False,
        training: bool | None = None,
    ) -> tuple[Any, list | None, list | None, list]:
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
            training=training,
        )
        return self.logits(y), self_attentions, cross_attentions, hidden

    def logits(self, y: Any) -> Any:
        """Section 3.4: the pre-softmax linear transformation, (..., d) -> (..., V). Tied
        (tie_output), its weight is the target embedding E, so logits = y E^T, plus the output
        bias when the config has one."""
        c = self.config
        # rosetta: embeddings
        if c.tie_output:  # section 3.4: y E^T
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
                src, return_attention=return_attention, training=training
            )
            pooled = pool(self.config, memory, src)
        logits, self_attentions, cross_attentions, decoder_hidden = None, absent, absent, []
        if self.decoder is not None:
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
