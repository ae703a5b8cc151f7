"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017) as PyTorch nn.Modules.

Shapes: B batch, S source length, T target length, d = d_model, h heads, d_k = d / h (or the
config's key_dim), V vocab.
Masks are boolean, True = may attend (the convention of F.scaled_dot_product_attention), built by
the small pure functions below, which mirror common/spec/masks.py, and shaped to broadcast against the
scores (B, h, T_q, T_k). The state_dict keys mirror the canonical names (torch_impl/weights.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision

# -- masks (mirrors of common/spec/masks.py) -------------------------------------------------------


# rosetta: masks
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


# rosetta: end


# -- positions, activations, precision ----------------------------------------------------------


def sinusoidal_positions(length: int, d_model: int, layout: str) -> Tensor:
    """Eq. (5), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    (length, d_model) in float64, computed once and cast by the caller, so that a float64 model
    gets the table to the last bit. Deviation, flagged: layout "concatenated" (tensor2tensor,
    Marian) puts every sin first, then every cos, with the same frequencies.
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


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,  # Eq. (2)
    "gelu": F.gelu,  # exact erf form
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
}


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 or wider: the dtype softmax statistics run in, even for bfloat16 inputs. (torch's
    LayerNorm kernels already keep their statistics in float32 for bfloat16, on CPU and CUDA.)"""
    return torch.promote_types(dtype, torch.float32)


@contextlib.contextmanager
def matmul_precision(precision: str = DEFAULT_PRECISION) -> Iterator[None]:
    """float32 products in `precision` (common/spec/precision.py) while the block runs: "ieee"
    (full float32) for "highest", TF32 tensor cores for "tf32", in matmuls and in cuDNN. torch's
    switches are process-wide, so the previous ones are restored on exit. Only the fp32_precision
    API is used: torch refuses to read a precision set through a mix of it and the legacy
    allow_tf32 flags."""
    # rosetta: device
    mode = "tf32" if check_precision(precision) == "tf32" else "ieee"
    switches = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [s.fp32_precision for s in switches]
    for switch in switches:
        switch.fp32_precision = mode
    try:
        yield
    finally:
        for switch, value in zip(switches, saved, strict=True):
            switch.fp32_precision = value
    # rosetta: end


# -- attention (Eq. 1) --------------------------------------------------------------------------


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float
) -> tuple[Tensor, Tensor]:
    """Eq. (1) written out: softmax(Q K^T / sqrt(d_k)) V, returning the post-softmax, pre-dropout
    probabilities too.

    torch's head layout: q (B, h, T_q, d_k), k and v (B, h, T_k, d_k), mask broadcastable to
    (B, h, T_q, T_k). `dropout` is the probability of attention dropout (0.0 in eval mode).
    Returns (context (B, h, T_q, d_k), probabilities (B, h, T_q, T_k)).

    Deviation, flagged: masked scores get the dtype's finite minimum (never -inf, which makes a
    fully masked row NaN) and probabilities are zeroed where the mask is False, so a query with no
    allowed key (a fully padded source) gets a zero context vector.
    """
    # rosetta: attention
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, T_q, T_k)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # Softmax in float32 or wider even for bfloat16 scores.
    wide = statistics_dtype(scores.dtype)
    probs = F.softmax(scores, dim=-1, dtype=wide).masked_fill(~mask, 0.0).to(q.dtype)
    return F.dropout(probs, dropout) @ v, probs
    # rosetta: end


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    dropout_p: float = 0.0,  # idiom: SDPA applies attention dropout inside the kernel
) -> Tensor:
    """Eq. (1) by F.scaled_dot_product_attention, which never materialises the probabilities.
    Layouts as explicit_attention; returns the context (B, h, T_q, d_k), zero for a query with no
    allowed key."""
    # rosetta: attention
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    # torch 2.13's CPU kernel already returns 0 for a row with no allowed key, but other
    # kernels (CUDA math/efficient) may return NaN; masked_fill also replaces NaN.
    return context.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    # rosetta: end


# -- sublayer wiring (section 3.1), shared by both layer kinds ---------------------------------


# rosetta: layer_norm
def layer_norm(config: TransformerConfig) -> nn.Module:
    """Ba et al. 2016, population variance with eps inside the sqrt, eps from the config (torch's
    default 1e-5 is not the paper's). torch's kernels keep the statistics in float32 for bfloat16
    inputs, on CPU and CUDA alike. norm_kind "std_plus_eps" is StdPlusEpsNorm."""
    if config.norm_kind == "std_plus_eps":
        return StdPlusEpsNorm(config.d_model, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


# rosetta: end


class StdPlusEpsNorm(nn.Module):
    """The Annotated Transformer's LayerNorm: weight * (x - mean) / (std + eps) + bias, with the
    unbiased (n - 1) standard deviation and eps outside the square root (docs/FORMAT.md, step 3).
    Parameters are named as nn.LayerNorm's, so the state_dict keys do not depend on the kind."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in float32 or wider (bfloat16 inputs), as nn.LayerNorm's kernels keep them.
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = (y - y.mean(-1, keepdim=True)) / (y.std(-1, keepdim=True) + self.eps)
        return (self.weight * y + self.bias).to(x.dtype)


def residual(
    x: Tensor,
    sublayer: Callable[[Tensor], tuple[Tensor, Any]],
    norm: nn.Module,
    dropout: nn.Dropout,
    pre_norm: bool,
) -> tuple[Tensor, Any]:
    """Section 3.1 and 5.4: LayerNorm(x + Dropout(Sublayer(x))) in post-norm; in pre-norm
    x + Dropout(Sublayer(LayerNorm(x))) (Wang et al. 2019, a deviation from the paper, flagged).

    `sublayer` returns (output, extra); extra (attention probabilities, say) is passed through.
    """
    # rosetta: residual
    out, extra = sublayer(norm(x) if pre_norm else x)
    x = x + dropout(out)
    return (x if pre_norm else norm(x)), extra
    # rosetta: end


# -- layers -----------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Eq. (4), section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with
    head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i), and Eq. (1): softmax(Q K^T / sqrt(d_k)) V.

    A query with no allowed key (a fully padded source) gets a zero context vector, so its output
    is W^O's bias (explicit_attention, fused_attention).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, bias = config.d_model, config.attention_bias
        self.h, self.d_k = config.num_heads, config.head_dim
        # rosetta: parameters
        # The h per-head projections W^Q_i are one (d, h * d_k) matrix; heads are split after it.
        # h * d_k is d_model unless the config sets key_dim.
        self.query = nn.Linear(d, self.h * self.d_k, bias=bias)
        self.key = nn.Linear(d, self.h * self.d_k, bias=bias)
        self.value = nn.Linear(d, self.h * self.d_k, bias=bias)
        self.output = nn.Linear(self.h * self.d_k, d, bias=bias)
        # rosetta: end
        self.attention_dropout = config.attention_dropout

    # rosetta: heads
    def _split_heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.h, self.d_k).transpose(1, 2)  # (B, h, L, d_k)

    # rosetta: end

    def keys_values(self, x_kv: Tensor) -> tuple[Tensor, Tensor]:
        """K W^K and V W^V split into heads, (B, h, T_k, d_k) each: what a decode cache keeps."""
        return self._split_heads(self.key(x_kv)), self._split_heads(self.value(x_kv))

    def forward(
        self,
        x_q: Tensor,
        x_kv: Tensor | None,
        mask: Tensor,
        *,
        return_attention: bool = False,
        kv: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x_q (B, T_q, d) attends x_kv (B, T_k, d) under mask (B, 1, T_q or 1, T_k).

        Returns (output (B, T_q, d), probabilities (B, h, T_q, T_k) or None). return_attention
        takes the explicit path; otherwise the fused kernel, which never materialises them.
        kv: keys and values already projected (keys_values), (B, h, T_k, d_k) each, taken instead
        of x_kv (decoding with a cache, torch_impl/decode.py).
        """
        q = self._split_heads(self.query(x_q))  # (B, h, T_q, d_k)
        k, v = self.keys_values(x_kv) if kv is None else kv  # (B, h, T_k, d_k) each
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
        self, x: Tensor, mask: Tensor, *, return_attention: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, S, d) under mask (B, 1, 1, S) -> (x, self-attention probabilities or None)."""
        x, probs = residual(
            x,
            lambda y: self.self_attention(y, y, mask, return_attention=return_attention),
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


@dataclass
class LayerCache:  # idiom: torch updates buffers in place (index_copy_)
    """One decoder layer's keys and values, split into heads. A decoder-only model's layers have
    no cross-attention: cross_key and cross_value are None."""

    self_key: Tensor  # (N, h, max_steps, d_k), position j written by step j
    self_value: Tensor  # (N, h, max_steps, d_k)
    cross_key: Tensor | None  # (N, h, S, d_k), K W^K of the memory
    cross_value: Tensor | None  # (N, h, S, d_k)

    # rosetta: cache
    def update(self, key: Tensor, value: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """Write the keys and values (N, h, L, d_k) of positions index..index+L-1 (L = 1 in a
        decoding step, the prompt in a prefill) and return every position's, (N, h, max_steps,
        d_k) each (DecoderLayer's self-attention reads them)."""
        where = index + torch.arange(key.shape[2], device=key.device)  # (L,)
        self.self_key.index_copy_(2, where, key)
        self.self_value.index_copy_(2, where, value)
        return self.self_key, self.self_value

    # rosetta: end


class DecoderLayer(nn.Module):
    """Section 3.1, decoder: masked self-attention, cross-attention over the encoder output, then
    feed-forward, each inside a residual. A decoder-only model's layer (GPT, Radford et al. 2018)
    has no encoder output to attend: no cross-attention sublayer, and no parameters for one."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attention = MultiHeadAttention(config)
        self.self_attention_norm = layer_norm(config)
        cross = config.has_encoder
        self.cross_attention = MultiHeadAttention(config) if cross else None
        self.cross_attention_norm = layer_norm(config) if cross else None
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
    ) -> tuple[Tensor, Tensor | None, Tensor | None, LayerCache | None]:
        """x (B, T, d) over memory (B, S, d) -> (x, self and cross probabilities or None, cache).
        Without cross-attention (decoder-only) memory and memory_mask are None, and so are the
        cross probabilities.

        With a cache (torch_impl/decode.py), x holds the positions index..index+T-1 (T = 1 in a
        decoding step): their self-attention keys and values are written into the cache there
        and the queries attend the whole buffer (self_mask says which entries each may see), and
        cross-attention takes the memory's cached keys and values (memory unused). The cache
        returned is the one passed in, updated in place (None without one).
        """

        def self_attention(y: Tensor) -> tuple[Tensor, Tensor | None]:
            kv = None if cache is None else cache.update(*self.self_attention.keys_values(y), index)
            return self.self_attention(y, y, self_mask, return_attention=return_attention, kv=kv)

        x, self_probs = residual(
            x, self_attention, self.self_attention_norm, self.dropout, self.pre_norm
        )
        cross_probs = None
        if self.cross_attention is not None:
            cross_kv = None if cache is None else (cache.cross_key, cache.cross_value)
            x, cross_probs = residual(
                x,
                lambda y: self.cross_attention(
                    y, memory, memory_mask, return_attention=return_attention, kv=cross_kv
                ),
                self.cross_attention_norm,
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
        return x, self_probs, cross_probs, cache


# -- stacks -----------------------------------------------------------------------------------


class Stack(nn.Module):
    """What Encoder and Decoder share (section 3.1): the token embedding (unless shared), the
    positions, BERT's optional segment table and embedding LayerNorm, dropout, N = num_layers
    identical layers and the optional final LayerNorm (as pre-norm models and nn.Transformer
    have)."""

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
        # A shared embedding (section 3.4) is the encoder's nn.Embedding, passed in: one Parameter
        # that the state_dict lists under both stacks' keys.
        self.embedding = (
            nn.Embedding(vocab_size, config.d_model) if embedding is None else embedding
        )
        if config.position_kind == "learned":
            self.position_embedding = nn.Embedding(config.max_len, config.d_model)
        else:
            self.position_embedding = None
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
        """Section 3.5: the position encodings of positions 0..length-1, (length, d)."""
        c = self.config
        if self.position_embedding is not None:  # learned; check_inputs refused L > max_len
            return self.position_embedding.weight[:length]
        if length <= self.sinusoid.shape[0]:
            return self.sinusoid[:length]
        # Sinusoids extrapolate (section 3.5): a longer table for this call only.
        return sinusoidal_positions(length, c.d_model, c.sinusoid_layout).to(self.sinusoid.device)

    def embed(
        self,
        ids: Tensor,
        *,
        start: Tensor | None = None,
        max_steps: int | None = None,  # idiom: a static table length, so `start` stays on device
    ) -> Tensor:
        """Sections 3.4 and 3.5: Dropout(E[ids] * sqrt(d_model) + PE[start..start+L-1]), (B, L, d);
        start None = 0. A decoding step's `start` is the cache's index tensor, read on the device
        from a table of max_steps positions (default max_len) rather than back on the host.
        BERT's additions, when the config has them: segment row 0 joins the sum, and the
        embedding LayerNorm normalises it before the dropout."""
        c = self.config
        # rosetta: embeddings
        x = self.embedding(ids)  # (B, L, d)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        # rosetta: end
        if start is None:
            pe = self._position_table(ids.shape[1])
        else:
            positions = start + torch.arange(ids.shape[1], device=ids.device)  # (L,)
            table = self._position_table(c.max_len if max_steps is None else max_steps)
            pe = table.index_select(0, positions)
        x = x + pe.to(x.dtype)
        if self.token_type_embedding is not None:
            x = x + self.token_type_embedding.weight[0]  # every token is of type 0
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.dropout(x)


class Encoder(Stack):
    """Section 3.1: N = num_encoder_layers encoder layers over the embedded source."""

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
        attentions, hidden = [], [x]
        for layer in self.layers:
            x, probs = layer(x, mask, return_attention=return_attention)
            attentions.append(probs)
            hidden.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, attentions if return_attention else None, hidden


class Decoder(Stack):
    """Section 3.1: N = num_decoder_layers decoder layers over the embedded, right-shifted
    target, each attending the encoder output (a decoder-only model's attend none)."""

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


def pool(config: TransformerConfig, memory: Tensor, src: Tensor) -> Tensor | None:
    """An encoder-only model's pooled vector (B, d) from its output memory (B, S, d) over the ids
    src (B, S), or None when config.pooling is "none". "mean": the average over the non-pad
    positions (sentence-transformers' mean pooling; a row with none gives zeros, not NaN);
    "first": position 0 (BERT's [CLS]). pooled_l2_norm then divides by the L2 norm (a zero vector
    stays zero)."""
    if config.pooling == "none":
        return None
    if config.pooling == "first":
        pooled = memory[:, 0]  # (B, d)
    else:
        real = (src != config.pad_id)[:, :, None].to(memory.dtype)  # (B, S, 1)
        pooled = (memory * real).sum(dim=1) / real.sum(dim=1).clamp_min(1.0)  # (B, d)
    if config.pooled_l2_norm:
        # Not F.normalize, which divides by max(norm, 1e-12) and so leaves a vector of tinier
        # norm short of unit length; only an exact zero is kept as it is.
        length = pooled.square().sum(dim=-1, keepdim=True).sqrt()  # (B, 1)
        pooled = pooled / torch.where(length > 0.0, length, torch.ones_like(length))
    return pooled


class Transformer(nn.Module):
    """Figure 1: the encoder-decoder, with the embedding sharing of section 3.4, and the two
    halves of the family: decoder-only (num_encoder_layers 0, GPT: `encoder` is None) and
    encoder-only (num_decoder_layers 0, BERT: `decoder` and `output` are None).

    share_embeddings: the decoder uses the encoder's nn.Embedding (one matrix). tie_output: the
    pre-softmax projection's weight is the target embedding (nanoGPT's weight tying), so the
    state_dict lists the same tensor under each alias; output_bias adds `output.bias`.
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
            self.output.weight = self.decoder.embedding.weight  # (V, d): logits = y E^T
        # rosetta: end
        self.apply(self._init_weights)

    # rosetta: parameters
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

    # rosetta: end

    def encode(
        self, src: Tensor, *, return_attention: bool = False
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor]]:
        """The encoder on source ids (B, S) under their padding mask; see Encoder.forward."""
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
        """The decoder on target ids (B, T) shifted right behind BOS, over memory (B, S, d) whose
        padding `src` (B, S) gives (both None for a decoder-only model). Returns (logits (B, T, V),
        self and cross probabilities per layer or None, hidden states); see Decoder.forward."""
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
        """Section 3.4: the pre-softmax linear transformation, (..., d) -> (..., V)."""
        return self.output(y)

    def forward(
        self, src: Tensor | None, tgt_in: Tensor | None, *, return_attention: bool = False
    ) -> dict[str, Tensor | list[Tensor] | None]:
        """Teacher-forced decoding; the keys are the fields of transformer_rosetta.spec.results.ForwardOutput.
        The attention lists are None unless return_attention (the explicit path; otherwise the
        fused one throughout); the hidden states are always there. A half of the family takes
        only its own input (the other None) and leaves the other half's entries None (outputs)
        or empty (lists): decoder-only has no encoder_output, encoder-only no logits."""
        # An absent half's lists are empty; with return_attention off its maps stay None.
        memory, pooled, encoder_hidden = None, None, []
        encoder_attentions = [] if return_attention else None
        if self.encoder is not None:
            memory, encoder_attentions, encoder_hidden = self.encode(
                src, return_attention=return_attention
            )
            pooled = pool(self.config, memory, src)
        logits, decoder_hidden = None, []
        self_attentions = [] if return_attention else None
        cross_attentions = [] if return_attention else None
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
