"""docs/FORMAT.md is a complete spec: a forward written from its text alone reproduces the vectors.

`doc_forward` below was written from the section "The computation (what a reader must implement)"
of docs/FORMAT.md and from its layout rules, with numpy and the standard library only. It does
not import the oracle or any implementation. It reads a file with `load_weights` and nothing
else of the project. It must reproduce the shared test vectors (parity_tests/vectors/, written by
the oracle): the logits, the encoder output and every attention map.

Each choice the section states is also a switch (`Reading`). For each one, a wrong alternative
must move the logits of a vector by more than CHOICE_MATTERS, so that no documented choice is
there for nothing. A few alternatives no vector can tell apart (post-norm with final_norm, a
tied output with a bias, dropout) are shown to matter on a model built from a vector's weights
instead.

The file-order statement of FORMAT.md ("Order inside the file") is checked on the stored files,
on a fresh save, and on a hand-written file in another order.

The bound. The doc forward and the oracle do the same float64 operations, in nearly the same
order. Values are O(1) (|logits| <= 4.2). Rounding costs a few ulps per stage (2.2e-16
relative), over about 30 stages in 2 + 2 layers, so about 1e-14 at worst. We measured
max |diff| <= 2.2e-15 over every array of the three vectors (post_ln_shared 2.2e-15,
pre_ln_untied 1.1e-15, post_ln_tied_concat 1.8e-15; the halves gpt_decoder_only 1.3e-15,
bert_encoder_only 1.3e-15; today's decoders llama_decoder_only 1.8e-15, qwen_interleaved_mqa
1.6e-15, both in their logits). FORMAT_ATOL = 1e-12 leaves more than two
orders of headroom over the estimate. The smallest effect of a wrong alternative is 1.6e-6 (eps
outside the square root, post_ln_tied_concat); of today's parts (TODAY_ALTERNATIVES) 3.8e-5
(RMSNorm's eps outside the square root, llama_decoder_only), then 3.4e-4 (GeGLU's gelu_tanh
read as gelu). CHOICE_MATTERS = 1e-8 sits between the two.

Today's decoders (steps 3, 4, 4a and 5 of FORMAT.md: RMSNorm, grouped key/value heads, the
output bias of its own, rotary positions, silu and the gated feed-forward) have two vectors:
llama_decoder_only (the preset tiny_llama) and qwen_interleaved_mqa (an encoder-decoder, so that
the encoder's self-attention is rotated and the cross-attention is not). The cached-decoding
statement of step 4a (positions continue from the prompt) is read through its equivalent in one
forward (`rotary_positions`); that rotary positions enter through their differences only is
checked by shifting them all.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from parity_tests.paths import ROOT, VECTORS
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.weights.format import load_weights, save_weights

FORMAT_MD = ROOT / "docs" / "FORMAT.md"
NAMES = ["post_ln_shared", "pre_ln_untied", "post_ln_tied_concat", "pre_std_plus_eps_key_dim"]
HALVES = ["gpt_decoder_only", "bert_encoder_only"]  # "The three kinds"
TODAY = ["llama_decoder_only", "qwen_interleaved_mqa"]  # today's decoders: steps 3, 4, 4a, 5
FORMAT_ATOL = 1e-12  # see the module docstring: measured 2.2e-15
CHOICE_MATTERS = 1e-8  # every wrong alternative moves the logits by more (smallest: 1.6e-6)


# -- the forward, from docs/FORMAT.md alone ---------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One way to read the spec. The defaults are what FORMAT.md states; every other value is a
    wrong alternative that an implementer could guess. The numbers are FORMAT.md's steps."""

    eval_mode: bool = True  # 1: no dropout (False: train-mode dropout at train_dropout)
    train_dropout: float = 0.1
    scale_positions: bool = False  # 2: s * E[ids] + P, not s * (E[ids] + P)
    position_start: int = 0  # 2: positions 0 .. L-1
    sinusoid_d: str = "d_model"  # 2: the d of Eq. (5) ("d_k" is wrong)
    # 3: var divides by d, sqrt(var + eps); with norm_kind "std_plus_eps" by d - 1, std + eps.
    # True reads the other way round (wrong in both kinds).
    unbiased_variance: bool = False
    eps_outside_sqrt: bool = False
    score_scale: str = "d_k"  # 4: 1 / sqrt(d_k) ("d_model" is wrong)
    head_order: str = "major"  # 4: head n owns columns n*d_k .. (n+1)*d_k - 1 ("minor": n::h)
    mask_pad_queries: bool = False  # 4: only keys are masked
    bos_always_visible: bool = True  # 4: decoder key 0 is always allowed
    causal: bool = True  # 4: decoder self-attention allows u <= t only
    empty_row: str = "zero"  # 4: a query with no allowed key gets A = 0 ("uniform" is wrong)
    swap_gelu: bool = False  # 5: gelu is erf, gelu_tanh is the tanh form
    wiring: str = "configured"  # 6: "swapped" (post <-> pre), "normed_residual" (LN(x) + F(LN(x)))
    norm_memory: bool = False  # 6: cross-attention's keys and values read memory as it is
    final_norm: str = "both"  # 7: "pre_only", "memory_before_norm" are wrong
    tied_logit_scale: float = 1.0  # 8: the tied projection is not scaled
    output_bias: bool = True  # 8: output.bias is added when the config has it
    segment_row: int = 0  # 2: every token is of segment 0 (1 is wrong)
    embedding_norm_first: bool = False  # 2: the embedding norm follows the sum (True: E only)
    pool_pads: bool = False  # 9: mean pooling over real tokens only (True: every position)
    # Today's parts. 3: RMSNorm subtracts no mean ("rms_subtract_mean" is wrong) and its gain is
    # `scale`, not 1 + scale (Gemma's: rms_gain_offset 1.0 is wrong); the two LayerNorm
    # switches above read its mean square and eps the wrong way too.
    rms_subtract_mean: bool = False
    rms_gain_offset: float = 0.0
    # 4: query head n reads key/value head n // (h/g) ("n % g", a tile, is wrong); the output
    # bias follows attention_output_bias ("attention_bias" is wrong).
    kv_head: str = "n // (h/g)"
    output_bias_follows: str = "attention_output_bias"
    # 4a: rotary. The configured layout (True: the other one); theta(i) = rope_theta^(-2i/d_k)
    # ("d_model" or "d_model/h" for d_k, exponent "i" for 2i are wrong); (a, b) -> (a cos - b sin,
    # b cos + a sin) (rotation_sign -1, the transposed rotation, is wrong); Q and K after their
    # biases (True: before), V not rotated; every self-attention (encoder too) and never the
    # cross-attention.
    rotary_layout_swapped: bool = False
    rotary_d: str = "d_k"
    rotary_exponent: str = "2i"
    rotation_sign: int = 1
    rotate_before_bias: bool = False
    rotate_values: bool = False
    rotate_encoder: bool = True
    rotate_cross: bool = False
    # 4a: pads take positions like any token ("after_real": Hugging Face generate's position_ids,
    # cumsum(mask) - 1 with every pad at 1, is wrong); cached decoding continues the positions
    # from the prompt (restart_after = P > 0: the fed tokens restart at 0 after a prompt of P,
    # is wrong; see rotary_positions).
    pad_positions: str = "index"
    restart_after: int = 0
    # 5: the gate's activation, not the intermediate's ("intermediate" is wrong); silu is
    # x sigmoid(x), beta 1 (1.702, QuickGELU's x sigmoid(1.702 x), is wrong).
    gated_activation_on: str = "gate"
    silu_beta: float = 1.0


DOC = Reading()


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """gelu(x) = 0.5 x (1 + erf(x / sqrt(2))) (FORMAT.md step 5)."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (step 5)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray, beta: float = 1.0) -> np.ndarray:
    """silu(x) = x sigmoid(x) = x / (1 + exp(-x)) (step 5; Swish with beta = 1)."""
    return x / (1.0 + np.exp(-beta * x))


def act(name: str, x: np.ndarray, r: Reading) -> np.ndarray:
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "silu":
        return silu(x, r.silu_beta)
    if r.swap_gelu:
        name = {"gelu": "gelu_tanh", "gelu_tanh": "gelu"}[name]
    return gelu_erf(x) if name == "gelu" else gelu_tanh(x)


def sinusoids(positions: np.ndarray, d: int, layout: str, d_eq: int) -> np.ndarray:
    """Eq. (5) as FORMAT.md step 2 writes it: angle = pos / 10000^(2i / d_eq), i < d/2."""
    i = np.arange(d // 2, dtype=np.float64)
    angle = positions.astype(np.float64)[:, None] / 10000.0 ** (2.0 * i / d_eq)[None, :]
    table = np.empty((len(positions), d))
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    else:  # concatenated
        table[:, : d // 2], table[:, d // 2 :] = np.sin(angle), np.cos(angle)
    return table


def rotary_positions(ids: np.ndarray, c: TransformerConfig, r: Reading) -> np.ndarray:
    """[B, L] positions of step 4a: each token's index in its row, pads included.

    restart_after = P reads "In cached decoding the positions continue from the prefix" the
    wrong way: the prompt's P tokens at 0 .. P-1, then the tokens fed one at a time restart at
    0, 1, ... A cached decoder rotates each fed token once, at its position, as a query and as
    the key the cache keeps (step 4a), and its self-attention is causal, so the step feeding
    token j computes what row j of one forward over the whole row does with these positions."""
    b, length = ids.shape
    pos = np.broadcast_to(np.arange(length) + r.position_start, (b, length)).copy()
    if r.pad_positions == "after_real":
        real = ids != c.pad_id
        pos = np.where(real, np.cumsum(real, axis=1) - 1, 1) + r.position_start
    if r.restart_after:
        pos[:, r.restart_after :] = np.arange(length - r.restart_after) + r.position_start
    return pos


def rotate(x: np.ndarray, pos: np.ndarray, c: TransformerConfig, r: Reading) -> np.ndarray:
    """Step 4a on x [B, heads, L, d_k] at positions pos [B, L]: theta(i) = rope_theta^(-2i/d_k),
    angle = pos * theta(i), pair i (a, b) -> (a cos - b sin, b cos + a sin), the pair chosen by
    rotary_layout."""
    d_k = x.shape[-1]
    half = d_k // 2
    i = np.arange(half, dtype=np.float64)
    d_eq = {"d_k": d_k, "d_model": c.d_model, "d_model/h": c.d_model // c.num_heads}[r.rotary_d]
    power = 2.0 * i if r.rotary_exponent == "2i" else i
    theta = float(c.rope_theta) ** (-power / d_eq)
    angle = pos.astype(np.float64)[:, None, :, None] * theta  # [B, 1, L, d_k/2]
    cos, sin = np.cos(angle), r.rotation_sign * np.sin(angle)
    layout = c.rotary_layout
    if r.rotary_layout_swapped:
        layout = {"half_split": "interleaved", "interleaved": "half_split"}[layout]
    pair_a, pair_b = (
        (slice(0, half), slice(half, d_k))
        if layout == "half_split"
        else (slice(0, None, 2), slice(1, None, 2))
    )
    a, b = x[..., pair_a], x[..., pair_b]
    out = np.empty_like(x)
    out[..., pair_a] = a * cos - b * sin
    out[..., pair_b] = b * cos + a * sin
    return out


def doc_forward(
    weights: dict[str, np.ndarray],
    c: TransformerConfig,
    src: np.ndarray,
    tgt_in: np.ndarray,
    r: Reading = DOC,
) -> dict[str, np.ndarray]:
    """logits, encoder_output and every attention map under their vector names."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    d, h = c.d_model, c.num_heads
    d_k = c.key_dim if c.key_dim is not None else d // h
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}

    def dropout(x: np.ndarray) -> np.ndarray:
        if r.eval_mode:
            return x
        return x * (rng.random(x.shape) >= r.train_dropout) / (1.0 - r.train_dropout)

    # 3. LayerNorm: biased variance, eps inside the square root; norm_kind "std_plus_eps":
    # unbiased, eps added to the std; "rms_norm": the mean square, eps inside, scale alone.
    std_plus_eps = c.norm_kind == "std_plus_eps"

    def rms(x: np.ndarray, name: str) -> np.ndarray:
        if r.rms_subtract_mean:
            x = x - x.mean(axis=-1, keepdims=True)
        ms = (x**2).sum(axis=-1, keepdims=True) / (d - 1 if r.unbiased_variance else d)
        eps = c.layer_norm_eps
        denom = np.sqrt(ms) + eps if r.eps_outside_sqrt else np.sqrt(ms + eps)
        return (w[f"{name}.scale"] + r.rms_gain_offset) * x / denom

    def ln(x: np.ndarray, name: str) -> np.ndarray:
        if c.norm_kind == "rms_norm":
            return rms(x, name)
        mean = x.mean(axis=-1, keepdims=True)
        dev = x - mean
        unbiased = std_plus_eps != r.unbiased_variance
        var = (dev**2).sum(axis=-1, keepdims=True) / (d - 1 if unbiased else d)
        denom = (
            np.sqrt(var) + c.layer_norm_eps
            if std_plus_eps != r.eps_outside_sqrt
            else np.sqrt(var + c.layer_norm_eps)
        )
        return w[f"{name}.scale"] * dev / denom + w[f"{name}.bias"]

    # 2. Embeddings and positions; a segment table's row 0 and the embedding norm.
    def embed(stack: str, table: str, ids: np.ndarray) -> np.ndarray:
        s = math.sqrt(d) if c.scale_embeddings else 1.0
        positions = np.arange(ids.shape[1]) + r.position_start
        if c.position_kind == "sinusoidal":
            d_eq = d if r.sinusoid_d == "d_model" else d_k
            p = sinusoids(positions, d, c.sinusoid_layout, d_eq)
        elif c.position_kind == "rotary":
            p = np.zeros((ids.shape[1], d))  # nothing added: the self-attentions rotate (4a)
        else:
            p = w[f"{stack}.position_embedding"][positions]
        e = w[table][ids]
        if c.embedding_norm and r.embedding_norm_first:
            e = ln(e, f"{stack}.embedding_norm")
        x = s * (e + p[None]) if r.scale_positions else s * e + p[None]
        if c.type_vocab_size:
            x = x + w[f"{stack}.token_type_embedding"][r.segment_row]
        if c.embedding_norm and not r.embedding_norm_first:
            x = ln(x, f"{stack}.embedding_norm")
        return dropout(x)

    # 4. Attention in the file's head layout.
    def heads(a: np.ndarray, axis: int) -> np.ndarray:
        """The stored [.., heads, d_k, ..] pair read with head n at columns n::heads ("minor")."""
        if r.head_order == "major":
            return a
        shape, n = a.shape, a.shape[axis]
        flat = a.reshape(shape[:axis] + (n * d_k,) + shape[axis + 2 :])
        split = flat.reshape(shape[:axis] + (d_k, n) + shape[axis + 2 :])
        return np.swapaxes(split, axis, axis + 1)

    # The output projection's bias: attention_output_bias, attention_bias when that is null.
    output_projection_bias = c.attention_bias
    if r.output_bias_follows == "attention_output_bias" and c.attention_output_bias is not None:
        output_projection_bias = c.attention_output_bias

    def attention(prefix: str, x_q, x_kv, allowed, record: str, q_pos=None, kv_pos=None):
        """MHA; q_pos and kv_pos ([B, L] positions) when this attention is rotated (step 4a)."""

        def project(x: np.ndarray, name: str, pos) -> np.ndarray:
            y = np.einsum("btj,jnc->bntc", x, heads(w[f"{prefix}.{name}.kernel"], 1))
            turn = pos is not None and (name != "value" or r.rotate_values)
            if turn and r.rotate_before_bias:
                y = rotate(y, pos, c, r)
            if c.attention_bias:
                y = y + heads(w[f"{prefix}.{name}.bias"], 0)[None, :, None, :]
            if turn and not r.rotate_before_bias:
                y = rotate(y, pos, c, r)
            return y

        q = project(x_q, "query", q_pos)
        k, v = project(x_kv, "key", kv_pos), project(x_kv, "value", kv_pos)
        # Grouped-query attention: query head n reads key/value head n // (h / g).
        group = h // k.shape[1]
        if r.kv_head == "n // (h/g)":
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        else:  # "n % g"
            k, v = np.tile(k, (1, group, 1, 1)), np.tile(v, (1, group, 1, 1))
        scale = math.sqrt(d_k if r.score_scale == "d_k" else d)
        score = q @ np.swapaxes(k, -1, -2) / scale  # [B, h, Tq, Tk]
        allowed = np.broadcast_to(allowed, score.shape)
        top = np.where(allowed, score, -np.inf).max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.where(allowed, np.exp(score - top), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        a = e / np.where(total > 0, total, 1.0)
        if r.empty_row == "uniform":
            a = np.where(total > 0, a, 1.0 / score.shape[-1])
        out[record] = a
        context = dropout(a) @ v  # [B, h, Tq, d_k]
        y = np.einsum("bntc,ncd->btd", context, heads(w[f"{prefix}.output.kernel"], 0))
        if output_projection_bias:
            y = y + w[f"{prefix}.output.bias"]
        return y

    # A half takes one input ("The three kinds"): stand-ins of length 1 keep the masks simple.
    has_encoder, has_decoder = c.num_encoder_layers > 0, c.num_decoder_layers > 0
    src = src if has_encoder else np.full((tgt_in.shape[0], 1), c.pad_id + 1)
    tgt_in = tgt_in if has_decoder else np.full((src.shape[0], 1), c.bos_id)
    src_keys = (src != c.pad_id)[:, None, None, :]
    tgt_ok = tgt_in != c.pad_id
    if r.bos_always_visible:
        tgt_ok[:, 0] = True
    t_len = tgt_in.shape[1]
    dec_self = tgt_ok[:, None, None, :]
    if r.causal:
        dec_self = dec_self & np.tril(np.ones((t_len, t_len), bool))[None, None]
    enc_self, cross = src_keys, src_keys
    if r.mask_pad_queries:
        enc_self = enc_self & (src != c.pad_id)[:, None, :, None]
        dec_self = dec_self & tgt_ok[:, None, :, None]
        cross = cross & tgt_ok[:, None, :, None]

    # 4a. Rotary positions, in every self-attention (never the cross-attention).
    rotary = c.position_kind == "rotary"
    src_pos = rotary_positions(src, c, r) if rotary else None
    tgt_pos = rotary_positions(tgt_in, c, r) if rotary else None
    enc_pos = src_pos if r.rotate_encoder else None
    cross_q, cross_kv = (tgt_pos, src_pos) if r.rotate_cross else (None, None)

    # 5. Feed-forward: the biases exist with feed_forward_bias; the gated form with a gate.
    def ffn(prefix: str, x: np.ndarray) -> np.ndarray:
        def dense(name: str, y: np.ndarray) -> np.ndarray:
            y = y @ w[f"{prefix}.{name}.kernel"]
            return y + w[f"{prefix}.{name}.bias"] if c.feed_forward_bias else y

        up = dense("intermediate", x)
        if not c.gated_feed_forward:
            hidden = act(c.activation, up, r)
        elif r.gated_activation_on == "gate":
            hidden = act(c.activation, dense("gate", x), r) * up
        else:  # the activation on the intermediate projection instead
            hidden = dense("gate", x) * act(c.activation, up, r)
        return dense("output", hidden)

    # 6. Sublayer wiring.
    pre = (c.norm_position == "pre") != (r.wiring == "swapped")

    def sublayer(x: np.ndarray, norm: str, f) -> np.ndarray:
        if pre:
            y = ln(x, norm)
            return (y if r.wiring == "normed_residual" else x) + dropout(f(y))
        return ln(x + dropout(f(x)), norm)

    # 7. The stacks and final_norm.
    final = c.final_norm and (r.final_norm != "pre_only" or c.norm_position == "pre")
    source = "shared_embedding" if c.share_embeddings else "encoder.embedding"
    target = "shared_embedding" if c.share_embeddings else "decoder.embedding"

    if has_encoder:
        x = embed("encoder", source, src)
        for i in range(c.num_encoder_layers):
            p = f"encoder.layers.{i}"
            record = f"{p}.self_attention"
            x = sublayer(
                x,
                f"{p}.self_attention_norm",
                lambda y, p=p, n=record: attention(
                    p + ".self_attention", y, y, enc_self, n, enc_pos, enc_pos
                ),
            )
            x = sublayer(x, f"{p}.feed_forward_norm", lambda y, p=p: ffn(p + ".feed_forward", y))
        memory = ln(x, "encoder.final_norm") if final else x
        out["encoder_output"] = memory
        if r.final_norm == "memory_before_norm":
            memory = x
        # 9. Pooling.
        real = np.ones(src.shape) if r.pool_pads else (src != c.pad_id).astype(float)
        if c.pooling == "mean":
            pooled = (memory * real[..., None]).sum(1) / np.maximum(real.sum(1), 1)[:, None]
        elif c.pooling == "first":
            pooled = memory[:, 0]
        if c.pooling != "none" and c.pooled_l2_norm:
            length = np.sqrt((pooled**2).sum(-1, keepdims=True))
            pooled = pooled / np.where(length > 0, length, 1.0)
        if c.pooling != "none":
            out["pooled_output"] = pooled
    if not has_decoder:
        return out

    x = embed("decoder", target, tgt_in)
    for i in range(c.num_decoder_layers):
        p = f"decoder.layers.{i}"
        x = sublayer(
            x,
            f"{p}.self_attention_norm",
            lambda y, p=p: attention(
                f"{p}.self_attention", y, y, dec_self, f"{p}.self_attention", tgt_pos, tgt_pos
            ),
        )
        if not has_encoder:  # a decoder-only layer has no cross-attention sublayer
            x = sublayer(x, f"{p}.feed_forward_norm", lambda y, p=p: ffn(p + ".feed_forward", y))
            continue
        kv = ln(memory, f"{p}.cross_attention_norm") if r.norm_memory else memory
        x = sublayer(
            x,
            f"{p}.cross_attention_norm",
            lambda y, p=p, kv=kv: attention(
                f"{p}.cross_attention", y, kv, cross, f"{p}.cross_attention", cross_q, cross_kv
            ),
        )
        x = sublayer(x, f"{p}.feed_forward_norm", lambda y, p=p: ffn(p + ".feed_forward", y))
    y = ln(x, "decoder.final_norm") if final else x

    # 8. The output projection.
    if c.tie_output:
        logits = (y @ w[target].T) * r.tied_logit_scale
    else:
        logits = y @ w["output.kernel"]
    if c.output_bias and r.output_bias:
        logits = logits + w["output.bias"]
    out["logits"] = logits
    return out


# -- against the vectors ----------------------------------------------------------------------


def vector(name: str) -> tuple[TransformerConfig, dict[str, np.ndarray], dict[str, np.ndarray]]:
    wf = load_weights(VECTORS / f"{name}.safetensors")
    with np.load(VECTORS / f"{name}.npz", allow_pickle=False) as npz:
        arrays = dict(npz)
    return wf.config, wf.tensors, arrays


def run(name: str, r: Reading = DOC, **config_changes) -> tuple[dict, dict]:
    c, w, arrays = vector(name)
    if config_changes:
        c = TransformerConfig(**{**c.to_dict(), **config_changes})
    return doc_forward(w, c, arrays.get("src"), arrays.get("tgt_in"), r), arrays


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("name", NAMES + HALVES + TODAY)
def test_the_documented_forward_reproduces_the_vectors(name):
    got, arrays = run(name)
    expected = set(arrays) - {"src", "tgt_in"}
    assert set(got) == expected
    for key in sorted(expected):
        assert got[key].shape == arrays[key].shape, key
        diff = max_diff(got[key], arrays[key])
        assert diff <= FORMAT_ATOL, f"{name}: {key} off by {diff:.3g}"


# Each documented choice and a wrong alternative, on the vectors where the two differ. Measured
# max |logits - vector logits| of the alternative when written (post_ln_shared, pre_ln_untied,
# post_ln_tied_concat; "-" where that vector cannot tell).
ALTERNATIVES = {
    # 1. Embedding scale on the token embedding only, before the positions (2.8, 2.0, -).
    "positions scaled too": (Reading(scale_positions=True), ["post_ln_shared", "pre_ln_untied"]),
    # 2. Tied output not scaled (1.8, -, 2.2); output.bias added when present (-, 0.22, -).
    "tied logits times d^-1/2": (
        Reading(tied_logit_scale=12**-0.5),  # d_model = 12 in every vector
        ["post_ln_shared", "post_ln_tied_concat"],
    ),
    "output.bias dropped": (Reading(output_bias=False), ["pre_ln_untied"]),
    # 3. LayerNorm: biased variance (0.21, 0.23, 0.14); eps inside the sqrt (2.5e-6, 2.6e-5,
    #    1.6e-6).
    "unbiased variance": (Reading(unbiased_variance=True), NAMES),
    "eps outside the sqrt": (Reading(eps_outside_sqrt=True), NAMES),
    # 4. Sublayer wiring (5.3, 1.4, 8.4); pre-norm residual from the un-normalised x (-, 1.5, -).
    "post and pre swapped": (Reading(wiring="swapped"), NAMES),
    "pre-norm residual from LN(x)": (Reading(wiring="normed_residual"), ["pre_ln_untied"]),
    # 5. final_norm: memory after it (-, 1.5, -); cross-attention reads memory un-normed (0.70,
    #    0.39, 0.28).
    "memory before the final norm": (Reading(final_norm="memory_before_norm"), ["pre_ln_untied"]),
    "memory through cross_attention_norm": (Reading(norm_memory=True), NAMES),
    # 6. gelu is erf, gelu_tanh is tanh (-, 4.7e-4, 4.3e-4).
    "gelu and gelu_tanh swapped": (
        Reading(swap_gelu=True),
        ["pre_ln_untied", "post_ln_tied_concat"],
    ),
    # 7. 1/sqrt(d_k) (0.75, 0.78, 0.11); heads in the file's layout (1.9, 1.6, 0.24).
    "scores over sqrt(d_model)": (Reading(score_scale="d_model"), NAMES),
    "head n at columns n::h": (Reading(head_order="minor"), NAMES),
    # 8. Positions from 0 (1.6, 1.3, 1.8); sinusoid d = d_model (1.0, -, 0.95).
    "positions from 1": (Reading(position_start=1), NAMES),
    "sinusoid over d_k": (Reading(sinusoid_d="d_k"), ["post_ln_shared", "post_ln_tied_concat"]),
    # 9. Keys only (1.8, 2.5, 3.3); key 0 visible when bos == pad (-, -, 3.6); causal (2.7,
    #    1.6, 1.1); a query with no allowed key gets zeros (3.0, 0.73, 2.6).
    "pad queries masked": (Reading(mask_pad_queries=True), NAMES),
    "BOS masked when it is the pad id": (
        Reading(bos_always_visible=False),
        ["post_ln_tied_concat"],
    ),
    "no causal mask": (Reading(causal=False), NAMES),
    "empty rows uniform": (Reading(empty_row="uniform"), NAMES),
}
# The halves' own choices, on their vectors (measured when written; the main output: logits of
# the GPT, the pooled vector of the BERT, whose rows are unit vectors).
HALF_ALTERNATIVES = {
    # 2. Segment row 0 (0.46); the embedding norm over the sum (0.61).
    "segment row 1": (Reading(segment_row=1), ["bert_encoder_only"]),
    "embedding norm before the positions": (
        Reading(embedding_norm_first=True),
        ["bert_encoder_only"],
    ),
    # 9. Mean over real tokens only (0.62).
    "pads pooled too": (Reading(pool_pads=True), ["bert_encoder_only"]),
    # The GPT reads the decoder's rules: causal (2.5), positions from 0 (4.1).
    "no causal mask in a GPT": (Reading(causal=False), ["gpt_decoder_only"]),
    "positions from 1 in a GPT": (Reading(position_start=1), ["gpt_decoder_only"]),
}
ALTERNATIVES.update(HALF_ALTERNATIVES)
# Today's parts (FORMAT.md steps 3, 4, 4a and 5) on their two vectors. Measured max |logits -
# vector logits| when written (llama_decoder_only, qwen_interleaved_mqa; "-" where that vector
# cannot tell: the llama has no bias, no encoder, no key_dim, one kv head per two query heads;
# the qwen one kv head for all, so every mapping of query heads onto it is the same).
L, Q = "llama_decoder_only", "qwen_interleaved_mqa"
TODAY_ALTERNATIVES = {
    # 4a. The configured layout (1.6, 0.91); theta(i) = rope_theta^(-2i/d_k) with d_k the head
    #     size: not d_model (1.5, 0.083), not d_model / h where key_dim sets it (-, 0.034), not
    #     rope_theta^(-i/d_k) (0.72, 0.20); (a, b) -> (a cos - b sin, b cos + a sin), not the
    #     transposed rotation (2.5, 1.1).
    "the other rotary layout": (Reading(rotary_layout_swapped=True), [L, Q]),
    "rotary angles over d_model": (Reading(rotary_d="d_model"), [L, Q]),
    "rotary angles over d_model / h, not key_dim": (Reading(rotary_d="d_model/h"), [Q]),
    "rotary theta^(-i/d_k)": (Reading(rotary_exponent="i"), [L, Q]),
    "rotation by -angle": (Reading(rotation_sign=-1), [L, Q]),
    # 4a. Q and K after their biases (-, 0.26); V not rotated (2.2, 1.8); the encoder's
    #     self-attention rotated too (-, 1.6), the cross-attention never (-, 0.14).
    "Q and K rotated before their biases": (Reading(rotate_before_bias=True), [Q]),
    "V rotated too": (Reading(rotate_values=True), [L, Q]),
    "encoder self-attention not rotated": (Reading(rotate_encoder=False), [Q]),
    "cross-attention rotated": (Reading(rotate_cross=True), [Q]),
    # 4a. Pads take positions like any token, not Hugging Face generate's position_ids (2.5,
    #     0.74: the pad queries' logits); cached decoding continues the positions, here after a
    #     one-token prompt (BOS), where restarting them moves the logits by (0.89, 0.64).
    "pads numbered after the real tokens": (Reading(pad_positions="after_real"), [L, Q]),
    "cached positions restart after the prompt": (Reading(restart_after=1), [L, Q]),
    # 3. RMSNorm: no mean (1.1, 1.5); gain scale, not 1 + scale (3.4, 3.6); the mean square
    #    over d (0.078, 0.16); eps inside the sqrt (3.8e-5, 3.5e-4).
    "RMSNorm subtracts the mean": (Reading(rms_subtract_mean=True), [L, Q]),
    "RMSNorm gain 1 + scale": (Reading(rms_gain_offset=1.0), [L, Q]),
    "RMSNorm mean square over d - 1": (Reading(unbiased_variance=True), [L, Q]),
    "RMSNorm eps outside the sqrt": (Reading(eps_outside_sqrt=True), [L, Q]),
    # 4. Query head n reads key/value head n // (h/g), not n % g (3.3, -).
    "query head n reads kv head n % g": (Reading(kv_head="n % g"), [L]),
    # 5. The activation on the gate (1.1, 0.70); silu with beta 1 (0.27, -); GeGLU keeps gelu_tanh
    #    (-, 3.4e-4).
    "activation on intermediate, not the gate": (
        Reading(gated_activation_on="intermediate"),
        [L, Q],
    ),
    "silu as x sigmoid(1.702 x)": (Reading(silu_beta=1.702), [L]),
    "GeGLU's gelu_tanh read as gelu": (Reading(swap_gelu=True), [Q]),
}
ALTERNATIVES.update(TODAY_ALTERNATIVES)
CASES = [(alt, name) for alt, (_, names) in ALTERNATIVES.items() for name in names]


def main_output(arrays: dict[str, np.ndarray]) -> str:
    """What a vector's model is for: logits, or an encoder-only model's pooled vector."""
    return "logits" if "logits" in arrays else "pooled_output"


@pytest.mark.parametrize(("alternative", "name"), CASES)
def test_each_documented_choice_matters_on_the_vectors(alternative, name):
    """The documented reading reproduces the vector (test above); this wrong one does not."""
    got, arrays = run(name, ALTERNATIVES[alternative][0])
    key = main_output(arrays)
    effect = max_diff(got[key], arrays[key])
    assert effect > CHOICE_MATTERS, f"{alternative} moves {name}'s logits by only {effect:.3g}"


def test_pad_queries_are_computed_and_only_pad_positions_move():
    """Masking pad queries changes the logits at pad target positions only: the vectors hold
    defined logits there, which the documented reading (keys only) reproduces."""
    got, arrays = run("post_ln_shared", Reading(mask_pad_queries=True))
    pad = arrays["tgt_in"] == 0
    pad[:, 0] = False  # BOS
    moved = np.abs(got["logits"] - arrays["logits"]).max(axis=-1) > CHOICE_MATTERS
    assert pad.any() and np.array_equal(moved, pad)


def test_an_empty_attention_row_is_zero_in_the_vectors():
    """The fully padded source row (row 2) has all-zero encoder and cross-attention rows."""
    _, arrays = run("post_ln_shared")
    assert not (arrays["src"][2] != 0).any()
    for key in ("encoder.layers.0.self_attention", "decoder.layers.1.cross_attention"):
        assert not arrays[key][2].any(), key
        assert np.allclose(arrays[key][:2].sum(axis=-1), 1.0, atol=1e-12), key


@pytest.mark.parametrize("name", TODAY)
def test_rotary_positions_enter_through_their_differences_only(name):
    """Step 4a: "The score of query m and key n then depends on the positions through m - n
    only." Every position shifted (by 1, by 1000) reproduces the vectors all the same, to the
    rounding of the larger angles' cos and sin (measured 2.6e-15 and 4.4e-15), where the shift
    by 1 moves every other vector's logits by 1.2 or more ("positions from 1" above). So a
    rotary model cannot tell where its positions start, only that a row's (and a cache's) are
    consecutive: the wrong readings of step 4a's positions are the ones above that renumber
    some tokens and not others (pads, the tokens fed after a prompt)."""
    for start in (1, 1000):
        got, arrays = run(name, Reading(position_start=start))
        for key in got:
            assert max_diff(got[key], arrays[key]) <= FORMAT_ATOL, (start, key)


def test_the_output_bias_follows_attention_output_bias():
    """Step 4: the q/k/v biases follow attention_bias, the output bias attention_output_bias
    (attention_bias when that is null). qwen_interleaved_mqa has q/k/v biases and no output
    bias: a reader following attention_bias for the output as well looks for a tensor the file
    does not hold. Output biases added to its weights change nothing while
    attention_output_bias is false, and are added (moving the logits by 0.44) when it is null."""
    c, w, arrays = vector(Q)
    assert c.attention_bias and c.attention_output_bias is False
    assert "decoder.layers.0.cross_attention.key.bias" in w
    assert not [k for k in w if k.endswith("attention.output.bias")]
    with pytest.raises(KeyError, match=r"self_attention\.output\.bias"):
        run(Q, Reading(output_bias_follows="attention_bias"))

    rng = np.random.default_rng(5)
    biases = {
        k.replace(".output.kernel", ".output.bias"): 0.1 * rng.standard_normal(c.d_model)
        for k in w
        if k.endswith("attention.output.kernel")
    }
    with_biases = {**w, **biases}
    ignored = doc_forward(with_biases, c, arrays["src"], arrays["tgt_in"])
    assert max_diff(ignored["logits"], arrays["logits"]) <= FORMAT_ATOL
    null = TransformerConfig(**{**c.to_dict(), "attention_output_bias": None})
    added = doc_forward(with_biases, null, arrays["src"], arrays["tgt_in"])
    assert max_diff(added["logits"], arrays["logits"]) > CHOICE_MATTERS


def test_grouped_heads_keep_one_attention_map_per_query_head():
    """Step 4: "The attention probabilities stay [B, h, Tq, Tk], one map per query head". In the
    llama (h 4, g 2) the two query heads of a key/value head have maps of their own; in the
    multi-query vector (g 1) the fully padded source row still has all-zero rows (step 4), in
    the encoder and the cross-attention, for every one of the 3 query heads."""
    _, arrays = run(L)
    maps = arrays["decoder.layers.0.self_attention"]
    assert maps.shape == (3, 4, 6, 6) and max_diff(maps[:, 0], maps[:, 1]) > CHOICE_MATTERS
    _, arrays = run(Q)
    assert not (arrays["src"][2] != 0).any()
    for key in ("encoder.layers.1.self_attention", "decoder.layers.1.cross_attention"):
        assert arrays[key].shape[1] == 3 and not arrays[key][2].any(), key
        assert np.allclose(arrays[key][:2].sum(axis=-1), 1.0, atol=1e-12), key


# -- choices no vector can tell apart: they still change the logits -------------------------


def test_final_norm_also_applies_in_post_norm():
    """No vector is post-norm with final_norm. On post_ln_shared's weights with final norms
    added, applying them (FORMAT.md step 7) and skipping them ("pre-norm only") differ by
    0.89. (The oracle and torch agree with applying them, to 2.5e-15: checked by hand, since
    this file must not import them.)"""
    c, w, arrays = vector("post_ln_shared")
    c = TransformerConfig(**{**c.to_dict(), "final_norm": True})
    rng = np.random.default_rng(7)
    for stack in ("encoder", "decoder"):
        w = {
            **w,
            f"{stack}.final_norm.scale": 1.0 + 0.1 * rng.standard_normal(c.d_model),
            f"{stack}.final_norm.bias": 0.1 * rng.standard_normal(c.d_model),
        }
    both = doc_forward(w, c, arrays["src"], arrays["tgt_in"])
    pre_only = doc_forward(w, c, arrays["src"], arrays["tgt_in"], Reading(final_norm="pre_only"))
    assert max_diff(both["logits"], pre_only["logits"]) > CHOICE_MATTERS
    assert max_diff(pre_only["logits"], arrays["logits"]) <= FORMAT_ATOL  # skipped = absent


def test_output_bias_is_added_to_a_tied_projection():
    c, w, arrays = vector("post_ln_shared")
    c = TransformerConfig(**{**c.to_dict(), "output_bias": True})
    w = {**w, "output.bias": np.linspace(-0.5, 0.5, c.tgt_vocab_size)}
    got = doc_forward(w, c, arrays["src"], arrays["tgt_in"])
    without = doc_forward(w, c, arrays["src"], arrays["tgt_in"], Reading(output_bias=False))
    assert max_diff(without["logits"], arrays["logits"]) <= FORMAT_ATOL
    assert np.allclose(got["logits"] - without["logits"], w["output.bias"], atol=1e-14)


def test_forward_is_eval_mode_whatever_the_config_dropout():
    """The vectors have dropout 0: the config's rate is not read by forward (step 1), and
    train-mode dropout at the paper's 0.1 would move the logits (by 2.95)."""
    got, arrays = run("post_ln_shared", DOC, dropout=0.3, attention_dropout=0.2)
    assert max_diff(got["logits"], arrays["logits"]) <= FORMAT_ATOL
    train, _ = run("post_ln_shared", Reading(eval_mode=False))
    assert max_diff(train["logits"], arrays["logits"]) > CHOICE_MATTERS


# -- the order inside the file ---------------------------------------------------------------


def read_header(path: Path) -> tuple[int, bytes, dict]:
    """(header length, raw header bytes, the JSON in file order) with plain Python."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n]
    return n, raw, json.loads(raw)


def check_safetensors_order(path: Path) -> list[str]:
    """FORMAT.md "Order inside the file": __metadata__ first, then the tensors by name in byte
    order, their bytes back to back from offset 0 in that order, header padded with spaces."""
    n, raw, header = read_header(path)
    keys = list(header)
    assert keys[0] == "__metadata__"
    names = keys[1:]
    assert names == sorted(names, key=str.encode)
    end = 0
    for name in names:
        begin, stop = header[name]["data_offsets"]
        assert begin == end, name
        end = stop
    assert 8 + n + end == path.stat().st_size
    assert n % 8 == 0 and set(raw[raw.rindex(b"}") + 1 :]) <= {ord(" ")}
    return names


@pytest.mark.parametrize("name", NAMES + TODAY)
def test_the_stored_files_are_in_safetensors_order(name):
    names = check_safetensors_order(VECTORS / f"{name}.safetensors")
    assert names[0].startswith("decoder.")  # not the table's order, which starts with embeddings


def test_a_fresh_save_is_in_byte_order_of_the_names(tmp_path):
    """save_weights hands safetensors the table's order; the file comes out in name order, and
    layers.10 sorts before layers.2."""
    c, w, _ = vector("post_ln_shared")
    c = TransformerConfig(**{**c.to_dict(), "num_encoder_layers": 11})
    extra = {
        k.replace("encoder.layers.1.", f"encoder.layers.{i}."): v
        for i in range(2, 11)
        for k, v in w.items()
        if k.startswith("encoder.layers.1.")
    }
    path = tmp_path / "eleven.safetensors"
    save_weights(path, {**w, **extra}, c, producer="test_format_spec")
    names = check_safetensors_order(path)
    ten = names.index("encoder.layers.10.self_attention.key.bias")
    two = names.index("encoder.layers.2.self_attention.key.bias")
    assert ten < two
    assert names[-1] == "shared_embedding"


def table_order(c: TransformerConfig) -> list[str]:
    """The names table of FORMAT.md (generated block "names"), expanded for `c`: the reading
    order, with each run of `{i}` rows repeated layer by layer."""
    text = FORMAT_MD.read_text()
    block = text.split("<!-- BEGIN GENERATED: names -->")[1].split("<!-- END GENERATED: names")[0]
    rows = re.findall(r"^\| `([a-z_.{}]+)` \| `\[", block, re.M)
    order, k = [], 0
    while k < len(rows):
        if "{i}" not in rows[k]:
            order.append(rows[k])
            k += 1
            continue
        stack, run = rows[k].split(".")[0], []
        while k < len(rows) and "{i}" in rows[k] and rows[k].startswith(stack):
            run.append(rows[k])
            k += 1
        layers = c.num_encoder_layers if stack == "encoder" else c.num_decoder_layers
        order += [row.replace("{i}", str(i)) for i in range(layers) for row in run]
    return order


@pytest.mark.parametrize("name", NAMES)
def test_loading_does_not_depend_on_the_order(tmp_path, name):
    """A hand-written file with every tensor (and the metadata) in reverse order, __metadata__
    last, loads to the same tensors, returned in the table's reading order."""
    path = VECTORS / f"{name}.safetensors"
    n, _, header = read_header(path)
    data, start = path.read_bytes(), 8 + n
    metadata = dict(reversed(list(header.pop("__metadata__").items())))
    entries, chunks, offset = {}, [], 0
    for tensor in reversed(list(header)):
        begin, stop = header[tensor]["data_offsets"]
        chunks.append(data[start + begin : start + stop])
        entries[tensor] = {**header[tensor], "data_offsets": [offset, offset + stop - begin]}
        offset += stop - begin
    raw = json.dumps({**entries, "__metadata__": metadata}).encode()
    raw += b" " * (-len(raw) % 8)
    shuffled = tmp_path / "reversed.safetensors"
    shuffled.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))

    original, again = load_weights(path), load_weights(shuffled)
    assert again.config == original.config
    assert list(again.tensors) == list(original.tensors)
    for tensor, value in original.tensors.items():
        assert again.tensors[tensor].tobytes() == value.tobytes(), tensor
    expected = [n for n in table_order(original.config) if n in original.tensors]
    assert list(original.tensors) == expected
    assert set(original.tensors) == set(header)


def test_the_doc_states_names_not_order():
    text = FORMAT_MD.read_text()
    assert "The file stores tensors in this order" not in text
    assert "### Order inside the file" in text and "reading order" in text


def test_doc_forward_does_not_use_the_project():
    """The forward above is written from the doc: this file imports no oracle, no
    implementation, only load_weights/save_weights and the config."""
    source = Path(__file__).read_text()
    imports = re.findall(r"^(?:from|import) (\S+)", source, re.M)
    project = [
        m
        for m in imports
        if m.split(".")[0] in {"transformer_rosetta", "common", "torch_impl", "tf_impl", "jax_impl"}
    ]
    assert sorted(project) == [
        "transformer_rosetta.spec.config",
        "transformer_rosetta.weights.format",
    ]
