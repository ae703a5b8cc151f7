"""Autoregressive decoding with a key/value cache, one position per step (the search itself is
common/decoding/search.py, written once; this file supplies the model's half).

Section 3.2.3: decoder self-attention is causal, so the keys and values of positions already
decoded never change, and cross-attention's keys and values are functions of the memory alone.
A step therefore projects only its new position and reads everything else from the cache.

The cache holds, as the tf and jax caches do (their containers differ: a dataclass here):
- `layers`, one entry per decoder layer: `self_key`, `self_value` (N, g, max_steps, d_k), a
  buffer preallocated for every position and written one position per step (g = num_kv_heads,
  the key/value heads: grouped-query attention's smaller cache; a rotary model's keys are kept
  rotated); `cross_key`, `cross_value` (N, g, S, d_k), the memory's keys and values, computed
  once;
- `memory_mask` (N, 1, 1, S): the source padding (transformer_rosetta.spec.masks.cross_mask);
- `key_valid` (N, max_steps) bool: which buffer positions are keys;
- `index` () int64 (here; index_copy_ needs int64): the position the next step writes.
N = B * beams rows; row r decodes source r // beams.

A decoder-only model (GPT) has no memory: cross_key, cross_value and memory_mask are None, and
the buffers hold P - 1 + max_steps positions for a prompt (B, P), whose first P - 1 tokens
`prefill` writes in one pass before the first step (the search then feeds the prompt's last
token, transformer_rosetta.decoding.search.start_tokens).

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

from transformer_rosetta.torch_impl.model import (
    LayerCache,
    Transformer,
    decoder_self_mask,
    key_padding_mask,
    statistics_dtype,
)


# idiom: torch steps mutate their buffers in place, so the cache is one object held between
# steps; tf.function and jax.jit pass it in and out of each compiled step as a dict of arrays.
@dataclass
class Cache:
    """Everything a decoding step reads besides the weights (layout: the module docstring)."""

    layers: list[LayerCache]
    memory_mask: Tensor | None  # (N, 1, 1, S) bool; None without an encoder
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

    A decoder-only model's src is the prompt (B, P): no encoder and no cross-attention (those
    entries are None), buffers of P - 1 + max_steps positions, and the prompt's first P - 1
    tokens prefilled (index P - 1), each row repeated for the beams.

    The buffers start as zeros, not torch.empty: a masked key gets probability 0, but 0 times a
    NaN left in uninitialised memory would still be NaN."""
    c = model.config
    if model.encoder is None:
        prompt = src.repeat_interleave(beams, dim=0)  # (N, P), row r from prompt r // beams
        memory = memory_mask = None
        length = prompt.shape[1] - 1 + max_steps
        n, device = prompt.shape[0], prompt.device
        dtype = model.decoder.embedding.weight.dtype
    else:
        prompt = None
        memory, src_rows = encode_rows(model, src, beams)
        memory_mask = key_padding_mask(src_rows, c.pad_id)  # (N, 1, 1, S)
        length = max_steps
        n, device, dtype = memory.shape[0], memory.device, memory.dtype
    shape = (n, c.kv_heads, length, c.head_dim)  # (N, g, length, d_k)
    layers = []
    for layer in model.decoder.layers:
        cross_key = cross_value = None
        if memory is not None:
            cross_key, cross_value = layer.cross_attention.keys_values(memory)  # (N, g, S, d_k)
        layers.append(
            LayerCache(
                self_key=torch.zeros(shape, dtype=dtype, device=device),
                self_value=torch.zeros(shape, dtype=dtype, device=device),
                cross_key=cross_key,
                cross_value=cross_value,
            )
        )
    cache = Cache(
        layers=layers,
        memory_mask=memory_mask,
        key_valid=torch.zeros(n, length, dtype=torch.bool, device=device),
        index=torch.zeros((), dtype=torch.int64, device=device),
    )
    if prompt is not None and prompt.shape[1] > 1:
        cache = prefill(model, prompt[:, :-1], cache)
    return cache


def prefill(model: Transformer, tokens: Tensor, cache: Cache) -> Cache:
    """Feed tokens (N, L) at positions index..index+L-1 in one pass through the layers (a
    decoder-only model's prompt): their keys and values are written into the buffers, each query
    attending the valid keys before it, itself and the block's earlier positions (section 3.2.3's
    causal mask, so the cache holds what L decode_steps would have written). Returns the cache
    with index advanced by L; the cache passed in is consumed, as in decode_step."""
    _, cache = _run_decoder(model, tokens, cache)
    return cache


def _run_decoder(model: Transformer, tokens: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
    """The decoder stack over tokens (N, L) at positions index..index+L-1 against the cache:
    (its output (N, L, d), after the final norm if any; the cache with index advanced by L).
    prefill and decode_step share it.

    A position is written as valid iff its token is not padding or it is position 0 (BOS, which
    may be the pad id): decoder_key_padding_mask. A query at position p sees the valid keys at
    positions <= p: the positions after the block are not written yet, and those inside it
    after p are hidden by the causal mask."""
    c = model.config
    decoder, index = model.decoder, cache.index
    max_steps = cache.key_valid.shape[1]
    positions = index + torch.arange(tokens.shape[1], device=tokens.device)  # (L,)
    valid = (tokens != c.pad_id) | (positions == 0)  # (N, L)
    cache.key_valid.index_copy_(1, positions, valid)
    causal = torch.arange(max_steps, device=tokens.device) <= positions[:, None]  # (L, max_steps)
    self_mask = cache.key_valid[:, None, None, :] & causal  # (N, 1, L, max_steps)

    # Section 3.5: PE[index..], read from a table of max_steps positions on the device; rotary
    # positions likewise continue from the prefix, index..index+L-1.
    x = decoder.embed(tokens, start=index, max_steps=max_steps)  # (N, L, d)
    rotary = decoder.rotary(tokens.shape[1], start=index, max_steps=max_steps)
    layers = []
    for layer, layer_cache in zip(decoder.layers, cache.layers, strict=True):
        x, _, _, layer_cache = layer(
            x,
            None,
            self_mask,
            cache.memory_mask,
            cache=layer_cache,
            index=index,
            rotary=rotary,
        )
        layers.append(layer_cache)
    if decoder.final_norm is not None:
        x = decoder.final_norm(x)
    return x, dataclasses.replace(cache, layers=layers, index=index + tokens.shape[1])


def decode_step(model: Transformer, tokens: Tensor, cache: Cache) -> tuple[Tensor, Cache]:
    """Feed tokens (N,) at position cache.index; return that position's logits (N, V) and the
    cache for the next position.

    The cache passed in is consumed: its buffers now hold this position (torch's in-place
    counterpart of a donated buffer); use the one returned. The keys a query sees are exactly
    decoder_key_padding_mask & causal_mask of the full prefix: a position is written as valid
    iff its token is not padding or it is position 0 (BOS, which may be the pad id), and the
    positions after `index` are not written yet.
    """
    y, cache = _run_decoder(model, tokens[:, None], cache)  # (N, 1, d)
    return model.logits(y[:, 0]), cache  # (N, V)


def reorder_cache(cache: Cache, rows: Tensor) -> Cache:
    """Row i continues as the old row rows[i] (N,): beam search's gather of every per-row
    tensor (the cross keys and values too: rows may in principle come from another source)."""

    def gather(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(0, rows)  # None: no cross-attention

    layers = [
        LayerCache(
            self_key=gather(layer.self_key),
            self_value=gather(layer.self_value),
            cross_key=gather(layer.cross_key),
            cross_value=gather(layer.cross_value),
        )
        for layer in cache.layers
    ]
    return Cache(
        layers=layers,
        memory_mask=gather(cache.memory_mask),
        key_valid=cache.key_valid.index_select(0, rows),
        index=cache.index,
    )


def prefix_step(
    model: Transformer, prefix: Tensor, memory: Tensor | None, src: Tensor | None
) -> Tensor:
    """The uncached baseline: the decoder over the whole prefix (N, t) (BOS first), as in
    teacher forcing, and the logits of its last position (N, V). memory (N, S, d) is encoded
    once (encode_rows); the decoder prefix is what gets recomputed at every step. A decoder-only
    model has no memory (memory and src None); its prefix starts with the prompt.

    The decoder stack is called rather than model.decode, which would project every position
    to the vocabulary when only the last one is needed."""
    pad = model.config.pad_id
    memory_mask = None if src is None else key_padding_mask(src, pad)  # (N, 1, 1, S)
    y, _, _, _ = model.decoder(
        prefix, memory, decoder_self_mask(prefix, pad), memory_mask
    )  # (N, t, d)
    return model.logits(y[:, -1])


def top_k_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best next tokens of every row of logits (N, V), on the device: their log-softmax
    values (N, k), in float32 or wider, and ids (N, k), best first and ties to the lower id, as
    transformer_rosetta.decoding.search.top_log_probs specifies. k = 1 is an argmax (torch returns the first
    maximum); otherwise a stable sort, since torch.topk promises no order among ties."""
    log_probs = torch.log_softmax(logits.to(statistics_dtype(logits.dtype)), dim=-1)
    if k == 1:
        ids = log_probs.argmax(dim=-1, keepdim=True)
    else:
        ids = log_probs.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return log_probs.gather(-1, ids), ids
