"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as PyTorch nn.Modules.

Shapes: B batch, S source length, T target length, d = d_model, h heads, d_k = d / h, V vocab.
Masks are boolean, True = may attend (the convention of F.scaled_dot_product_attention), built by
the small pure functions below, which mirror common/spec/masks.py, and shaped to broadcast against the
scores (B, h, T_q, T_k). The state_dict keys mirror the canonical names (torch_impl/weights.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.spec.config import TransformerConfig

if TYPE_CHECKING:  # decode.py imports this module; the layer only reads the cache it is given
    from torch_impl.decode import LayerCache

# -- masks (mirrors of common/spec/masks.py) -------------------------------------------------------


def key_padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, 1, 1, K): a key may be attended iff it is not padding."""
    return (ids != pad_id)[:, None, None, :]


def decoder_key_padding_mask(ids: Tensor, pad_id: int) -> Tensor:
    """(B, 1, 1, T): as key_padding_mask, but position 0 is always visible: it holds BOS, and some
    models (Marian) use the pad id as BOS."""
    first = torch.arange(ids.shape[1], device=ids.device) == 0
    return ((ids != pad_id) | first)[:, None, None, :]


def causal_mask(length: int, device: torch.device | str | None = None) -> Tensor:
    """(1, 1, T, T): query i may attend key j iff j <= i (section 3.2.3)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def decoder_self_mask(tgt_in: Tensor, pad_id: int) -> Tensor:
    """(B, 1, T, T): decoder self-attention is causal and skips padding."""
    return decoder_key_padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1], tgt_in.device)


# -- positions and activations ----------------------------------------------------------------


def sinusoidal_positions(length: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    (length, d_model) in float64, computed once and cast by the caller, so that a float64 model
    gets the table to the last bit. Deviation, flagged: layout "concatenated" (tensor2tensor,
    Marian) puts every sin first, then every cos, with the same frequencies.
    """
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)[None, :]  # (1, d/2)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, d/2)
    if layout == "interleaved":
        return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # sin, cos, sin, ...
    if layout == "concatenated":
        return torch.cat([angle.sin(), angle.cos()], dim=-1)
    raise ValueError(f"unknown sinusoid layout {layout!r}")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,  # Eq. (2)
    "gelu": F.gelu,  # exact erf form
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


# -- sublayer wiring (section 3.1), shared by both layer kinds ---------------------------------


def sublayer_input(x: Tensor, norm: nn.LayerNorm, pre_norm: bool) -> Tensor:
    """What a sublayer reads: x in post-norm; LayerNorm(x) in pre-norm (Wang et al. 2019, a
    deviation from the paper, flagged)."""
    return norm(x) if pre_norm else x


def residual(
    x: Tensor, out: Tensor, norm: nn.LayerNorm, dropout: nn.Dropout, pre_norm: bool
) -> Tensor:
    """Section 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm; in pre-norm
    x + Dropout(Sublayer(LayerNorm(x)))."""
    x = x + dropout(out)
    return x if pre_norm else norm(x)


def layer_norm(config: TransformerConfig) -> nn.LayerNorm:
    """Ba et al. 2016, population variance with eps inside the sqrt, eps from the config (torch's
    default 1e-5 is not the paper's). torch's kernels keep the statistics in float32 for bfloat16
    inputs, on CPU and CUDA alike."""
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


# -- layers -----------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), and Eq. (1): softmax(Q K^T / sqrt(d_k)) V.

    Deviation, flagged: masked scores get the dtype's finite minimum (never -inf, which makes a
    fully masked row NaN) and probabilities are zeroed where the mask is False, so a query with no
    allowed key (a fully padded source) gets a zero context vector and the output is W^O's bias.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, bias = config.d_model, config.attention_bias
        self.h, self.d_k = config.num_heads, config.head_dim
        # The h per-head projections W^Q_i are one (d, h * d_k) matrix; heads are split after it.
        self.query = nn.Linear(d, d, bias=bias)
        self.key = nn.Linear(d, d, bias=bias)
        self.value = nn.Linear(d, d, bias=bias)
        self.output = nn.Linear(d, d, bias=bias)
        self.attention_dropout = config.attention_dropout

    def split_heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.h, self.d_k).transpose(1, 2)  # (B, h, L, d_k)

    def keys_values(self, x_kv: Tensor) -> tuple[Tensor, Tensor]:
        """K W^K and V W^V split into heads, (B, h, T_k, d_k) each: what a decode cache keeps."""
        return self.split_heads(self.key(x_kv)), self.split_heads(self.value(x_kv))

    def forward(
        self,
        x_q: Tensor,
        x_kv: Tensor | None,
        mask: Tensor,
        *,
        need_weights: bool = False,
        kv: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x_q (B, T_q, d) attends x_kv (B, T_k, d) under mask (B, 1, T_q or 1, T_k).

        Returns (output (B, T_q, d), probabilities (B, h, T_q, T_k) or None). need_weights takes
        the explicit path; otherwise the fused kernel, which never materialises probabilities.
        kv: keys and values already projected (keys_values), (B, h, T_k, d_k) each, taken instead
        of x_kv (decoding with a cache, torch_impl/decode.py).
        """
        q = self.split_heads(self.query(x_q))  # (B, h, T_q, d_k)
        k, v = self.keys_values(x_kv) if kv is None else kv  # (B, h, T_k, d_k) each
        p_drop = self.attention_dropout if self.training else 0.0
        if need_weights:
            context, probs = self.attend(q, k, v, mask, p_drop)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop)
            # torch 2.13's CPU kernel already returns 0 for a row with no allowed key, but other
            # kernels (CUDA math/efficient) may return NaN; masked_fill also replaces NaN.
            context = context.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
            probs = None
        b, _, t_q, _ = context.shape
        context = context.transpose(1, 2).reshape(b, t_q, self.h * self.d_k)  # (B, T_q, d)
        return self.output(context), probs

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, p_drop: float
    ) -> tuple[Tensor, Tensor]:
        """Eq. (1) written out, returning the post-softmax, pre-dropout probabilities too."""
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, h, T_q, T_k)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        # Softmax in float32 or wider even for bfloat16 scores.
        wide = torch.promote_types(scores.dtype, torch.float32)
        probs = F.softmax(scores, dim=-1, dtype=wide).masked_fill(~mask, 0.0).to(q.dtype)
        return F.dropout(probs, p_drop) @ v, probs  # (B, h, T_q, d_k), (B, h, T_q, T_k)


class FeedForward(nn.Module):
    """Eq. (2), section 3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (GELU for ported models)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.intermediate = nn.Linear(config.d_model, config.d_ff)  # W_1, b_1
        self.output = nn.Linear(config.d_ff, config.d_model)  # W_2, b_2
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.activation(self.intermediate(x)))


class EncoderLayer(nn.Module):
    """Section 3.1, encoder: self-attention, then feed-forward, each inside a residual."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = layer_norm(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm_position == "pre"

    def forward(
        self, x: Tensor, mask: Tensor, *, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        y = sublayer_input(x, self.self_attention_norm, self.pre_norm)
        out, probs = self.self_attention(y, y, mask, need_weights=need_weights)
        x = residual(x, out, self.self_attention_norm, self.dropout, self.pre_norm)

        y = sublayer_input(x, self.feed_forward_norm, self.pre_norm)
        x = residual(x, self.feed_forward(y), self.feed_forward_norm, self.dropout, self.pre_norm)
        return x, probs


class DecoderLayer(nn.Module):
    """Section 3.1, decoder: masked self-attention, cross-attention over the encoder output, then
    feed-forward, each inside a residual."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = layer_norm(config)
        self.cross_attention = MultiHeadAttention(config)
        self.cross_attention_norm = layer_norm(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm_position == "pre"

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        self_mask: Tensor,
        memory_mask: Tensor,
        *,
        need_weights: bool = False,
        cache: LayerCache | None = None,
        index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, d) over memory (B, S, d). With a cache (torch_impl/decode.py), x is the one
        position `index` (B, 1, d): its self-attention key and value are written into the cache
        at `index` and the query attends the whole buffer (self_mask says which entries are
        keys), and cross-attention takes the memory's cached keys and values (memory unused)."""
        y = sublayer_input(x, self.self_attention_norm, self.pre_norm)
        self_kv = None
        if cache is not None:
            self_kv = cache.update(*self.self_attention.keys_values(y), index)
        out, self_probs = self.self_attention(
            y, y, self_mask, need_weights=need_weights, kv=self_kv
        )
        x = residual(x, out, self.self_attention_norm, self.dropout, self.pre_norm)

        y = sublayer_input(x, self.cross_attention_norm, self.pre_norm)
        cross_kv = None if cache is None else (cache.cross_key, cache.cross_value)
        out, cross_probs = self.cross_attention(
            y, memory, memory_mask, need_weights=need_weights, kv=cross_kv
        )
        x = residual(x, out, self.cross_attention_norm, self.dropout, self.pre_norm)

        y = sublayer_input(x, self.feed_forward_norm, self.pre_norm)
        x = residual(x, self.feed_forward(y), self.feed_forward_norm, self.dropout, self.pre_norm)
        return x, self_probs, cross_probs


# -- stacks -----------------------------------------------------------------------------------


def position_table(stack: Encoder | Decoder, length: int) -> Tensor:
    """Section 3.5: the position encodings of positions 0..length-1, (length, d)."""
    c = stack.config
    if stack.position_embedding is not None:  # learned; check_inputs refused L > max_len
        return stack.position_embedding.weight[:length]
    if length <= stack.sinusoid.shape[0]:
        return stack.sinusoid[:length]
    # Sinusoids extrapolate (section 3.5): a longer table for this call only.
    return sinusoidal_positions(length, c.d_model, c.sinusoid_layout).to(stack.sinusoid.device)


def embed(stack: Encoder | Decoder, ids: Tensor, positions: Tensor | None = None) -> Tensor:
    """Sections 3.4 and 3.5: Dropout(E[ids] * sqrt(d_model) + PE[0..L-1]), (B, L, d).
    `positions` (L, d) replaces PE[0..L-1] (decoding one position at a time)."""
    c = stack.config
    x = stack.embedding(ids)  # (B, L, d)
    if c.scale_embeddings:
        x = x * math.sqrt(c.d_model)
    pe = position_table(stack, ids.shape[1]) if positions is None else positions
    return stack.dropout(x + pe.to(x.dtype))


def position_parts(stack: Encoder | Decoder, config: TransformerConfig) -> None:
    """Give `stack` its positions: a learned nn.Embedding, or the sinusoid table as a buffer that
    stays out of the state_dict (it is a function of the config, not a weight)."""
    if config.position_kind == "learned":
        stack.position_embedding = nn.Embedding(config.max_len, config.d_model)
    else:
        stack.position_embedding = None
        table = sinusoidal_positions(config.max_len, config.d_model, config.sinusoid_layout)
        stack.register_buffer("sinusoid", table, persistent=False)


class Encoder(nn.Module):
    """Section 3.1: a stack of N identical layers over the embedded source (+ a final
    LayerNorm when the config asks, as pre-norm models and nn.Transformer have)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.src_vocab_size, config.d_model)
        position_parts(self, config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_encoder_layers))
        self.final_norm = layer_norm(config) if config.final_norm else None

    def forward(
        self, src: Tensor, *, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor]]:
        """Returns (memory (B, S, d), self-attention probabilities per layer or None, hidden
        states: the embedding output and every layer's output, before the final norm)."""
        mask = key_padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        x = embed(self, src)
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, need_weights=need_weights)
            attentions.append(probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, attentions if need_weights else None, hidden


class Decoder(nn.Module):
    """Section 3.1: a stack of N identical layers over the embedded, right-shifted target, each
    attending the encoder output (+ an optional final LayerNorm)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.tgt_vocab_size, config.d_model)
        position_parts(self, config)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_decoder_layers))
        self.final_norm = layer_norm(config) if config.final_norm else None

    def forward(
        self, tgt_in: Tensor, memory: Tensor, src: Tensor, *, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None, list[Tensor]]:
        """Returns (output (B, T, d), self and cross probabilities per layer or None, hidden
        states). `src` gives the padding of `memory`; `tgt_in` starts with BOS."""
        self_mask = decoder_self_mask(tgt_in, self.config.pad_id)  # (B, 1, T, T)
        memory_mask = key_padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        x = embed(self, tgt_in)
        self_attentions, cross_attentions, hidden = [], [], [x]
        for layer in self.layers:
            x, self_probs, cross_probs = layer(
                x, memory, self_mask, memory_mask, need_weights=need_weights
            )
            self_attentions.append(self_probs)
            cross_attentions.append(cross_probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if not need_weights:
            return x, None, None, hidden
        return x, self_attentions, cross_attentions, hidden


class Transformer(nn.Module):
    """Figure 1: the encoder-decoder, with the embedding sharing of section 3.4.

    share_embeddings: the decoder uses the encoder's nn.Embedding (one matrix). tie_output: the
    pre-softmax projection's weight is the target embedding (nanoGPT's weight tying), so the
    state_dict lists the same tensor under each alias; output_bias adds `output.bias`.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        if config.share_embeddings:
            self.decoder.embedding = self.encoder.embedding
        self.output = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.output_bias)
        if config.tie_output:
            self.output.weight = self.decoder.embedding.weight  # (V, d): logits = y E^T
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
        self, src: Tensor, *, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor]]:
        """The encoder on source ids (B, S); see Encoder.forward."""
        return self.encoder(src, need_weights=need_weights)

    def decode(
        self, tgt_in: Tensor, memory: Tensor, src: Tensor, *, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None, list[Tensor]]:
        """The decoder on target ids (B, T) shifted right behind BOS; see Decoder.forward."""
        return self.decoder(tgt_in, memory, src, need_weights=need_weights)

    def logits(self, y: Tensor) -> Tensor:
        """Section 3.4: the pre-softmax linear transformation, (B, T, d) -> (B, T, V)."""
        return self.output(y)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits (B, T, V) of teacher-forced decoding: the fused attention path throughout."""
        memory, _, _ = self.encode(src)
        y, _, _, _ = self.decode(tgt_in, memory, src)
        return self.logits(y)
