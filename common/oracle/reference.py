"""The NumPy float64 oracle: the executable spec of the model, in eval mode (no dropout).

Clarity first: one function per equation of "Attention Is All You Need" (Vaswani et al. 2017),
vectorised over batch and heads, no framework. Every implementation is tested against this file.

Shapes: B batch, S source length, T target length, d d_model, h heads, k = d_k = d_model / h,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.special import erf, expit

from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.masks import decoder_self_mask, key_padding_mask
from transformer_rosetta.spec.names import embedding_names
from transformer_rosetta.spec.results import ForwardOutput

Weights = Mapping[str, np.ndarray]


# -- building blocks --------------------------------------------------------------------------


def layer_norm(
    x: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray | None,
    eps: float,
    kind: str = "layer_norm",
) -> np.ndarray:
    """Normalisation over the last axis, section 3.1's LayerNorm. docs/FORMAT.md, step 3.

    "layer_norm" (Ba et al. 2016): (x - mean) / sqrt(var + eps) * scale + bias, with the
    population variance and eps inside the square root.
    "std_plus_eps" (the Annotated Transformer's LayerNorm): (x - mean) / (std + eps) * scale +
    bias, with the unbiased standard deviation sqrt(sum (x - mean)^2 / (n - 1)) and eps outside.
    "rms_norm" (Zhang & Sennrich 2019, Llama): x / sqrt(mean(x^2) + eps) * scale, no mean
    subtracted and no bias (`bias` is None).
    """
    if kind == "rms_norm":
        return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * scale
    mean = x.mean(axis=-1, keepdims=True)
    squares = ((x - mean) ** 2).sum(axis=-1, keepdims=True)
    n = x.shape[-1]
    if kind == "layer_norm":
        return (x - mean) / np.sqrt(squares / n + eps) * scale + bias
    if kind == "std_plus_eps":
        return (x - mean) / (np.sqrt(squares / (n - 1)) + eps) * scale + bias
    raise ValueError(f"unknown norm kind {kind!r}")


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """relu: max(0, x), Eq. (2). gelu: x * Phi(x) (Hendrycks & Gimpel 2016), exact erf form.
    gelu_tanh: its tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    silu: x * sigmoid(x) = x / (1 + exp(-x)) (Elfwing et al. 2018; Swish with beta 1)."""
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":
        return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    if name == "silu":
        return x * expit(x)
    raise ValueError(f"unknown activation {name!r}")


def sinusoidal_positions(length: int, d_model: int, layout: str = "interleaved") -> np.ndarray:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    [length, d_model]. Layout "interleaved" is the equation as written. "concatenated" is a
    deviation used by tensor2tensor and Marian: the same d/2 frequencies, every sin first and then
    every cos (Marian's frequencies; tensor2tensor's differ slightly, see docs/FORMAT.md).
    """
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # (1, d/2)
    angle = pos / np.power(10000.0, two_i / d_model)  # (L, d/2)
    table = np.empty((length, d_model))
    if layout == "interleaved":
        table[:, 0::2] = np.sin(angle)
        table[:, 1::2] = np.cos(angle)
    elif layout == "concatenated":
        table[:, : d_model // 2] = np.sin(angle)
        table[:, d_model // 2 :] = np.cos(angle)
    else:
        raise ValueError(f"unknown sinusoid layout {layout!r}")
    return table


def rotary_angles(length: int, head_dim: int, theta: float) -> np.ndarray:
    """The rotation angles of rotary positions (Su et al. 2021, Eq. 15), [length, d_k / 2]:
    angle(pos, i) = pos * theta^(-2i / d_k), for pos = 0 .. length - 1. docs/FORMAT.md, step 4a."""
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    two_i = np.arange(0, head_dim, 2, dtype=np.float64)[None, :]  # (1, d_k/2)
    return pos * np.power(float(theta), -two_i / head_dim)


def rotate(x: np.ndarray, angle: np.ndarray, layout: str) -> np.ndarray:
    """Rotary positions (Su et al. 2021, Eq. 34): rotate each pair of a query's or key's
    dimensions by its angle. x (..., L, d_k), angle (L, d_k / 2).

    "half_split" pairs dimension i with i + d_k/2 (Hugging Face's rotate_half); "interleaved"
    pairs 2i with 2i + 1 (Meta's Llama, RoFormer). In both, a pair (a, b) becomes
    (a cos - b sin, b cos + a sin)."""
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    if layout == "half_split":
        a, b = x[..., :half], x[..., half:]
    elif layout == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        raise ValueError(f"unknown rotary layout {layout!r}")
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = np.empty_like(x)
    if layout == "half_split":
        out[..., :half], out[..., half:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The softmax of Eq. (1), over `axis`, shifted by the maximum first (rounding only)."""
    shifted = x - x.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def scaled_dot_product_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (1), section 3.2.1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V.

    q (B, h, Tq, k), k and v (B, h, Tk, k), mask broadcastable to (B, h, Tq, Tk), True = attend.
    Returns (context (B, h, Tq, k), probabilities (B, h, Tq, Tk)).
    Deviation, flagged: masked scores get the dtype's finite minimum (never -inf, which turns a
    fully masked row into NaN), and probabilities are then zeroed where the mask is False, so a
    query with no allowed key gets an all-zero row, not a uniform one.
    """
    d_k = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k)  # (B, h, Tq, Tk)
    scores = np.where(mask, scores, np.finfo(scores.dtype).min)
    probs = np.where(mask, softmax(scores), 0.0)
    return probs @ v, probs


def multi_head_attention(
    w: Weights,
    prefix: str,
    x_q: np.ndarray,
    x_kv: np.ndarray,
    mask: np.ndarray,
    c: TransformerConfig,
    rotary: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i). Kernels are stored per head: [d, heads, k].

    Grouped-query attention (c.kv_heads < h): query head n reads key/value head n // (h / kv_heads),
    Hugging Face's repeat_kv. `rotary` (a self-attention of a rotary model) rotates the queries
    and keys by their positions 0 .. T-1 (step 4a) before the scores."""

    def project(x: np.ndarray, name: str, bias: bool) -> np.ndarray:
        y = np.einsum("btd,dhk->bhtk", x, w[f"{prefix}.{name}.kernel"])  # (B, heads, T, k)
        if bias:
            y = y + w[f"{prefix}.{name}.bias"][None, :, None, :]
        return y

    q = project(x_q, "query", c.attention_bias)
    k, v = project(x_kv, "key", c.attention_bias), project(x_kv, "value", c.attention_bias)
    if rotary:
        q = rotate(q, rotary_angles(q.shape[2], c.head_dim, c.rope_theta), c.rotary_layout)
        k = rotate(k, rotary_angles(k.shape[2], c.head_dim, c.rope_theta), c.rotary_layout)
    group = c.num_heads // c.kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (B, h, T, k)
    context, probs = scaled_dot_product_attention(q, k, v, mask)
    out = np.einsum("bhtk,hkd->btd", context, w[f"{prefix}.output.kernel"])  # (B, T, d)
    if c.output_projection_bias:
        out = out + w[f"{prefix}.output.bias"]
    return out, probs


def feed_forward(w: Weights, prefix: str, x: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (or GELU, SiLU for ported
    models). Gated (Shazeer 2020, SwiGLU / GeGLU): (act(x W_gate + b_gate) * (x W_1 + b_1)) W_2
    + b_2. The biases exist with feed_forward_bias."""

    def project(y: np.ndarray, name: str) -> np.ndarray:
        out = dense(y, w[f"{prefix}.{name}.kernel"])
        return out + w[f"{prefix}.{name}.bias"] if c.feed_forward_bias else out

    if c.gated_feed_forward:
        hidden = activation(c.activation, project(x, "gate")) * project(x, "intermediate")
    else:
        hidden = activation(c.activation, project(x, "intermediate"))
    return project(hidden, "output")


def dense(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """x @ kernel over the last axis, as one 2-D product: numpy's matmul of a 3-D array by a
    matrix loops over the leading axis, about 15x slower in float64 than one BLAS call."""
    return (x.reshape(-1, x.shape[-1]) @ kernel).reshape(*x.shape[:-1], kernel.shape[-1])


def norm(w: Weights, prefix: str, x: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """layer_norm with the stored `{prefix}.scale` and `{prefix}.bias` (none for an RMSNorm),
    the config's eps and norm kind."""
    bias = w.get(f"{prefix}.bias") if c.norm_kind != "rms_norm" else None
    return layer_norm(x, w[f"{prefix}.scale"], bias, c.layer_norm_eps, c.norm_kind)


def sublayer_input(w: Weights, norm_prefix: str, x: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """What a sublayer reads: x itself in post-norm; LayerNorm(x) in pre-norm (a deviation from
    the paper, Wang et al. 2019, flagged here)."""
    return norm(w, norm_prefix, x, c) if c.norm_position == "pre" else x


def residual(
    w: Weights, norm_prefix: str, x: np.ndarray, out: np.ndarray, c: TransformerConfig
) -> np.ndarray:
    """Section 3.1: LayerNorm(x + Sublayer(x)) in post-norm; x + Sublayer(LayerNorm(x)) in pre-norm."""
    return norm(w, norm_prefix, x + out, c) if c.norm_position == "post" else x + out


def embed(w: Weights, stack: str, table: str, ids: np.ndarray, c: TransformerConfig) -> np.ndarray:
    """Section 3.4 and 3.5: E[ids] * sqrt(d_model) + PE[positions], positions 0..L-1.

    The scale (when scale_embeddings) multiplies the token embedding only: sinusoidal or learned,
    the positions are added unscaled. BERT's additions, when the config has them: row 0 of the
    segment table (every token is of type 0), then a LayerNorm over the sum.

    A model without a pad token (config.virtual_pad) pads with pad_id = tgt_vocab_size, which
    names no row: it embeds as the zero vector (docs/FORMAT.md, step 2), positions added as
    usual."""
    if c.virtual_pad:
        real = ids != c.pad_id  # (B, L)
        x = np.where(real[..., None], w[table][np.where(real, ids, 0)], 0.0)
    else:
        x = w[table][ids]  # (B, L, d)
    if c.scale_embeddings:
        x = x * np.sqrt(c.d_model)
    length = ids.shape[1]
    if c.position_kind == "sinusoidal":
        x = x + sinusoidal_positions(length, c.d_model, c.sinusoid_layout)[None]
    elif c.position_kind == "learned":
        x = x + w[f"{stack}.position_embedding"][:length][None]
    # rotary positions add nothing here: the self-attentions rotate their queries and keys
    if c.type_vocab_size:
        x = x + w[f"{stack}.token_type_embedding"][0]
    if c.embedding_norm:
        x = norm(w, f"{stack}.embedding_norm", x, c)
    return x


def pool(c: TransformerConfig, memory: np.ndarray, src: np.ndarray) -> np.ndarray | None:
    """The encoder-only pooled vector (B, d), or None when the config does not pool. "mean": the
    average over non-pad positions (a row with none gives zeros, not NaN); "first": position 0.
    pooled_l2_norm then divides by the L2 norm (a zero vector stays zero)."""
    if c.pooling == "none":
        return None
    if c.pooling == "first":
        pooled = memory[:, 0]
    else:
        real = (src != c.pad_id)[:, :, None].astype(memory.dtype)  # (B, S, 1)
        pooled = (memory * real).sum(axis=1) / np.maximum(real.sum(axis=1), 1.0)
    if c.pooled_l2_norm:
        length = np.sqrt((pooled**2).sum(axis=-1, keepdims=True))
        pooled = pooled / np.where(length > 0.0, length, 1.0)
    return pooled


# -- the model --------------------------------------------------------------------------------


def encode(
    w: Weights, c: TransformerConfig, src: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Section 3.1, encoder: N layers of [self-attention, feed-forward], each in a residual.

    The final LayerNorm (config.final_norm) follows the last layer in post-norm and pre-norm
    alike, and the memory is taken after it.

    Returns (memory (B, S, d), self-attention probs per layer, hidden states: the embedding
    output and each layer's output, before the final norm)."""
    mask = key_padding_mask(src, c.pad_id)
    rotary = c.position_kind == "rotary"
    x = embed(w, "encoder", _table(c, "source"), src, c)
    attentions: list[np.ndarray] = []
    hidden = [x]
    for i in range(c.num_encoder_layers):
        p = f"encoder.layers.{i}"
        y = sublayer_input(w, f"{p}.self_attention_norm", x, c)
        out, probs = multi_head_attention(w, f"{p}.self_attention", y, y, mask, c, rotary)
        x = residual(w, f"{p}.self_attention_norm", x, out, c)

        y = sublayer_input(w, f"{p}.feed_forward_norm", x, c)
        x = residual(w, f"{p}.feed_forward_norm", x, feed_forward(w, f"{p}.feed_forward", y, c), c)
        attentions.append(probs)
        hidden.append(x)
    if c.final_norm:
        x = norm(w, "encoder.final_norm", x, c)
    return x, attentions, hidden


def decode(
    w: Weights,
    c: TransformerConfig,
    tgt_in: np.ndarray,
    memory: np.ndarray | None,
    src: np.ndarray | None,
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Section 3.1, decoder: N layers of [masked self-attention, cross-attention over the encoder
    output, feed-forward], then the final LayerNorm when config.final_norm (either norm position).
    A decoder-only model (memory and src None) has no cross-attention sublayer: GPT's layer.
    Returns (output (B, T, d), self probs, cross probs, hidden states)."""
    self_mask = decoder_self_mask(tgt_in, c.pad_id)
    # The encoder output with its key mask (the padding of the src it encodes), or None.
    cross = None
    if memory is not None:
        cross = memory, key_padding_mask(_given(src, "src", "encoder"), c.pad_id)
    rotary = c.position_kind == "rotary"
    x = embed(w, "decoder", _table(c, "target"), tgt_in, c)
    self_attn: list[np.ndarray] = []
    cross_attn: list[np.ndarray] = []
    hidden = [x]
    for i in range(c.num_decoder_layers):
        p = f"decoder.layers.{i}"
        y = sublayer_input(w, f"{p}.self_attention_norm", x, c)
        out, s_probs = multi_head_attention(w, f"{p}.self_attention", y, y, self_mask, c, rotary)
        x = residual(w, f"{p}.self_attention_norm", x, out, c)

        if cross is not None:
            y = sublayer_input(w, f"{p}.cross_attention_norm", x, c)
            out, c_probs = multi_head_attention(w, f"{p}.cross_attention", y, *cross, c)
            x = residual(w, f"{p}.cross_attention_norm", x, out, c)
            cross_attn.append(c_probs)

        y = sublayer_input(w, f"{p}.feed_forward_norm", x, c)
        x = residual(w, f"{p}.feed_forward_norm", x, feed_forward(w, f"{p}.feed_forward", y, c), c)
        self_attn.append(s_probs)
        hidden.append(x)
    if c.final_norm:
        x = norm(w, "decoder.final_norm", x, c)
    return x, self_attn, cross_attn, hidden


def output_logits(w: Weights, c: TransformerConfig, y: np.ndarray) -> np.ndarray:
    """Section 3.4: the pre-softmax linear transformation, y W_out (+ b). Tied: W_out = E^T."""
    name = _table(c, "output")
    kernel = w[name].T if c.tie_output else w[name]
    logits = dense(y, kernel)
    if c.output_bias:
        logits = logits + w["output.bias"]
    return logits


def forward(
    weights: Weights,
    c: TransformerConfig,
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    *,
    hidden_states: bool = False,
) -> ForwardOutput:
    """The whole model in float64, in eval mode (no dropout): logits (B, T, V), encoder output
    and every attention map. docs/FORMAT.md, "The computation", states it equation by equation.

    `src` and `tgt_in` are int arrays (B, S) and (B, T); `tgt_in` is the decoder input, i.e. the
    target already shifted right behind BOS (transformer_rosetta.spec.masks.shift_right). A half of the family
    takes only its own (transformer_rosetta.spec.inputs.check_inputs): a decoder-only model tgt_in alone, an
    encoder-only one src alone (and returns no logits, and the pooled vector if it pools).
    """
    w = {name: np.asarray(t, dtype=np.float64) for name, t in weights.items()}
    memory: np.ndarray | None = None
    pooled: np.ndarray | None = None
    enc_attn: list[np.ndarray] = []
    enc_hidden: list[np.ndarray] = []
    if c.has_encoder:
        src = _given(src, "src", "encoder")
        memory, enc_attn, enc_hidden = encode(w, c, src)
        pooled = pool(c, memory, src)
    logits: np.ndarray | None = None
    self_attn: list[np.ndarray] = []
    cross_attn: list[np.ndarray] = []
    dec_hidden: list[np.ndarray] = []
    if c.has_decoder:
        y, self_attn, cross_attn, dec_hidden = decode(
            w, c, _given(tgt_in, "tgt", "decoder"), memory, src
        )
        logits = output_logits(w, c, y)
    return ForwardOutput(
        logits=logits,
        encoder_output=memory,
        encoder_self_attention=enc_attn,
        decoder_self_attention=self_attn,
        cross_attention=cross_attn,
        encoder_hidden_states=enc_hidden if hidden_states else None,
        decoder_hidden_states=dec_hidden if hidden_states else None,
        pooled_output=pooled,
    )


def _given(ids: np.ndarray | None, name: str, stack: str) -> np.ndarray:
    """`ids`, which the model's `stack` reads; None is an InputError worded as check_halves
    words it (transformer_rosetta.spec.inputs), not a TypeError from deep in the embedding."""
    if ids is None:
        raise InputError(
            f"{name}: the model has a{'n' * (stack == 'encoder')} {stack}; give {name}"
        )
    return ids


def _table(c: TransformerConfig, role: str) -> str:
    """The stored tensor of the vocabulary matrix `role` (embedding_names); only the stack that
    reads it asks, so a model without that stack (where the name is None) is a caller's bug."""
    name = embedding_names(c)[role]
    if name is None:
        raise ValueError(f"{c.a_model_of_its_kind} has no {role} embedding")
    return name
