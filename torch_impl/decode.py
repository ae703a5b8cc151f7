"""Autoregressive decoding with a key/value cache, one position per step (the search itself is
common/decoding/search.py, written once; this file supplies the model's half).

Section 3.2.3: decoder self-attention is causal, so the keys and values of positions already
decoded never change, and cross-attention's keys and values are functions of the memory alone.
A step therefore projects only its new position and reads everything else from the cache.

The cache holds, as the tf and jax caches do (their containers differ: a dataclass here):
- `layers`, one entry per decoder layer: `self_key`, `self_value` (N, h, max_steps, d_k), a
  buffer preallocated for every position and written one position per step; `cross_key`,
  `cross_value` (N, h, S, d_k), the memory's keys and values, computed once;
- `memory_mask` (N, 1, 1, S): the source padding (common.spec.masks.cross_mask);
- `key_valid` (N, max_steps) bool: which buffer positions are keys;
- `index` () int64 (here; index_copy_ needs int64): the position the next step writes.
N = B * beams rows; row r decodes source r // beams.

Written the way torch users keep a static cache: the buffers are written in place with
`index_copy_` (copying a max_steps buffer every step would cost more than the step itself), and
the step attends the whole buffer under key_valid, so every step has the same shapes and never
reads `index` back to the host. Eager throughout (no torch.compile, as in train.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from torch_impl.model import (
    LayerCache,
    Transformer,
    decoder_self_mask,
    key_padding_mask,
    statistics_dtype,
)


@dataclass
class Cache:
    """Everything a decoding step reads besides the weights (layout: the module docstring)."""

    layers: list[LayerCache]
    memory_mask: Tensor  # (N, 1, 1, S) bool
    key_valid: Tensor  # (N, max_steps) bool
    # idiom: index_copy_ takes an int64 index
    index: Tensor  # () int64


def encode_rows(model: Transformer, src: Tensor, beams: int) -> tuple[Tensor, Tensor]:
    """Encode src (B, S) once and repeat it for the beams: (memory (N, S, d), src (N, S)) with
    row r taken from source r // beams."""
    memory, _, _ = model.encode(src)  # (B, S, d)
    return memory.repeat_interleave(beams, dim=0), src.repeat_interleave(beams, dim=0)


def init_cache(model: Transformer, src: Tensor, beams: int, max_steps: int) -> Cache:
    """The cache before the first step: the encoder run once, every layer's cross-attention
    keys and values of the memory, and empty self-attention buffers of max_steps positions.

    The buffers start as zeros, not torch.empty: a masked key gets probability 0, but 0 times a
    NaN left in uninitialised memory would still be NaN."""
    memory, src_rows = encode_rows(model, src, beams)
    c = model.config
    n, device, dtype = memory.shape[0], memory.device, memory.dtype
    shape = (n, c.num_heads, max_steps, c.head_dim)  # (N, h, max_steps, d_k)
    layers = []
    for layer in model.decoder.layers:
        cross_key, cross_value = layer.cross_attention.keys_values(memory)  # (N, h, S, d_k)
        layers.append(
            LayerCache(
                self_key=torch.zeros(shape, dtype=dtype, device=device),
                self_value=torch.zeros(shape, dtype=dtype, device=device),
                cross_key=cross_key,
                cross_value=cross_value,
            )
        )
    return Cache(
        layers=layers,
        memory_mask=key_padding_mask(src_rows, c.pad_id),  # (N, 1, 1, S)
        key_valid=torch.zeros(n, max_steps, dtype=torch.bool, device=device),
        index=torch.zeros((), dtype=torch.int64, device=device),
    )


def decode_step(model: Transformer, tokens: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
    """Feed tokens (N,) at position cache.index; return that position's logits (N, V) and the
    cache for the next position.

    The cache passed in is consumed: its buffers now hold this position (torch's in-place
    counterpart of a donated buffer); use the one returned. The keys a query sees are exactly
    decoder_key_padding_mask & causal_mask of the full prefix: a position is written as valid
    iff its token is not padding or it is position 0 (BOS, which may be the pad id), and the
    positions after `index` are not written yet.
    """
    c = model.config
    decoder, index = model.decoder, cache.index
    max_steps = cache.key_valid.shape[1]
    valid = (tokens != c.pad_id) | (index == 0)  # (N,)
    cache.key_valid.index_copy_(1, index.reshape(1), valid[:, None])
    self_mask = cache.key_valid[:, None, None, :]  # (N, 1, 1, max_steps)

    # Section 3.5: PE[index], read from a table of max_steps positions on the device.
    x = decoder.embed(tokens[:, None], start=index, max_steps=max_steps)  # (N, 1, d)
    for layer, layer_cache in zip(decoder.layers, cache.layers, strict=True):
        x, _, _, _ = layer(x, None, self_mask, cache.memory_mask, cache=layer_cache, index=index)
    if decoder.final_norm is not None:
        x = decoder.final_norm(x)
    logits = model.logits(x[:, 0])  # (N, V)
    return logits, dataclasses.replace(cache, index=index + 1)


def reorder_cache(cache: Cache, rows: Tensor) -> Cache:
    """Row i continues as the old row rows[i] (N,): beam search's gather of every per-row
    tensor (the cross keys and values too: rows may in principle come from another source)."""
    layers = [
        LayerCache(
            self_key=layer.self_key.index_select(0, rows),
            self_value=layer.self_value.index_select(0, rows),
            cross_key=layer.cross_key.index_select(0, rows),
            cross_value=layer.cross_value.index_select(0, rows),
        )
        for layer in cache.layers
    ]
    return Cache(
        layers=layers,
        memory_mask=cache.memory_mask.index_select(0, rows),
        key_valid=cache.key_valid.index_select(0, rows),
        index=cache.index,
    )


def prefix_step(model: Transformer, prefix: Tensor, memory: Tensor, src: Tensor) -> Tensor:
    """The uncached baseline: the decoder over the whole prefix (N, t) (BOS first), as in
    teacher forcing, and the logits of its last position (N, V). memory (N, S, d) is encoded
    once (encode_rows); the decoder prefix is what gets recomputed at every step.

    The decoder stack is called rather than model.decode, which would project every position
    to the vocabulary when only the last one is needed."""
    pad = model.config.pad_id
    y, _, _, _ = model.decoder(
        prefix, memory, decoder_self_mask(prefix, pad), key_padding_mask(src, pad)
    )  # (N, t, d)
    return model.logits(y[:, -1])


def top_k_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best next tokens of every row of logits (N, V), on the device: their log-softmax
    values (N, k), in float32 or wider, and ids (N, k), best first and ties to the lower id, as
    common.decoding.search.top_log_probs specifies. k = 1 is an argmax (torch returns the first
    maximum); otherwise a stable sort, since torch.topk promises no order among ties."""
    log_probs = torch.log_softmax(logits.to(statistics_dtype(logits.dtype)), dim=-1)
    if k == 1:
        ids = log_probs.argmax(dim=-1, keepdim=True)
    else:
        ids = log_probs.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return log_probs.gather(-1, ids), ids
