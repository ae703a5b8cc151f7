"""Autoregressive decoding in Keras 3 with a key/value cache (section 3.2.3: the decoder is
auto-regressive, each position attending only to those before it).

The search itself (greedy, beam) is common/decoding/search.py's, written once; this file is the model's
half of it, one position at a time. The encoder runs once per batch; each decoder layer keeps the
keys and values of every position decoded so far in a buffer of `max_steps` positions, and the
keys and values of the encoder output, so that a step projects only the new position. The layers
are model.py's own, called by decode_step and prefill with `cache=`: the same projections,
residual wiring and fused attention kernel as the forward pass (tf_impl/backend.py compiles
`decode_step` with `tf.function`; fixed shapes and a tensor index make it one trace per (rows,
max_steps, S)).

A decoder-only model (GPT) continues a prompt (B, P) instead: it has no encoder and no
cross-attention, its buffers hold P - 1 + max_steps positions, and init_cache prefills the
prompt's first P - 1 tokens in one pass (`prefill`); the search then feeds the last one.

The cache is a plain nested dict of tensors, so it passes in and out of a `tf.function` as its
arguments and results (the same entries as in torch_impl/ and jax_impl/, in each one's own
container):
- "layers": per decoder layer, "self_key" / "self_value" (N, g, max_steps, k), written at
  "index" each step (g = num_kv_heads, the key/value heads: grouped-query attention's smaller
  cache; a rotary model's keys are kept rotated), and "cross_key" / "cross_value" (N, g, S, k)
  of the memory (left out in a decoder-only model, as is "memory_mask");
- "memory_mask" (N, 1, 1, S): the source padding mask, for cross-attention;
- "key_valid" (N, max_steps) bool: which decoder keys may be attended (decoder_key_padding_mask:
  position 0 always, a later one iff its token is not pad_id; False beyond index, so causal);
- "index": scalar int32 tensor (torch's is int64), the position the next step writes.

Shapes: B source rows, N = B * beams decoding rows, S source length, g key/value heads,
k = d_k, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from transformer_rosetta.tf_impl.model import (
    Transformer,
    decoder_self_mask,
    key_padding_mask,
    statistics_dtype,
)

# idiom: a plain dict of tensors (a nested structure tf.function takes and returns as is)
Cache = dict[str, Any]


def encode_rows(model: Transformer, src: Any, beams: int) -> tuple[Any, Any]:
    """Encode src (B, S) once and repeat it for the beams: (memory (N, S, d), src (N, S)) with
    row r taken from source r // beams."""
    memory, _, _ = model.encode(src, training=False)  # (B, S, d)
    # (N, S, d) and (N, S), as torch's repeat_interleave
    return ops.repeat(memory, beams, axis=0), ops.repeat(src, beams, axis=0)


def init_cache(model: Transformer, src: Any, beams: int, max_steps: int) -> Cache:
    """Encode src (B, S) once and make the cache for N = B * beams rows (row r decodes source
    r // beams) and at most max_steps decoder positions.

    A decoder-only model's src is the prompt (B, P): no encoder, no cross-attention entries, and
    buffers of P - 1 + max_steps positions, the first P - 1 prefilled from the prompt (`prefill`)."""
    c = model.config
    if c.has_encoder:
        memory, src = encode_rows(model, src, beams)  # (N, S, d), (N, S)
        rows, positions = ops.shape(src)[0], max_steps
    else:
        prompt = ops.repeat(src, beams, axis=0)  # (N, P), row r from prompt r // beams
        rows, positions = ops.shape(prompt)[0], ops.shape(prompt)[1] - 1 + max_steps
    empty = ops.zeros((rows, c.kv_heads, positions, c.head_dim), dtype=model.compute_dtype)
    layers = []
    for layer in model.decoder.layers:
        entry = {"self_key": empty, "self_value": empty}
        if c.has_encoder:
            cross_key, cross_value = layer.cross_attention.keys_values(memory)  # (N, g, S, k)
            entry.update(cross_key=cross_key, cross_value=cross_value)
        layers.append(entry)
    cache = {
        "layers": layers,
        "key_valid": ops.zeros((rows, positions), dtype="bool"),
        "index": ops.convert_to_tensor(0, dtype="int32"),
    }
    if c.has_encoder:
        return {**cache, "memory_mask": key_padding_mask(src, c.pad_id)}  # (N, 1, 1, S)
    if ops.shape(prompt)[1] > 1:
        cache = prefill(model, prompt[:, :-1], cache)
    return cache


def prefill(model: Transformer, tokens: Any, cache: Cache) -> Cache:
    """Feed tokens (N, L) at positions index..index+L-1 in one pass through the layers (causal
    among themselves, attending the buffer's valid keys before them): their keys and values and
    key_valid are written as L decode steps would write them. Returns the cache, index + L. A
    decoder-only model's prompt, all but its last token, goes through here (init_cache)."""
    _, cache = _decode_positions(model, tokens, cache)
    return cache


def decode_step(model: Transformer, tokens: Any, cache: Cache) -> tuple[Any, Cache]:
    """Feed tokens (N,) at position cache["index"]: returns (that position's logits (N, V), the
    new cache, index + 1). Equals the last position of the forward pass over the whole prefix.

    The decoder's embedding and layers, one position: each layer writes this position's keys
    and values into its buffers and reads the cross-attention keys and values of the memory."""
    x, cache = _decode_positions(model, tokens[:, None], cache)  # (N, 1, d)
    y = model.decoder.final_norm(x) if model.config.final_norm else x
    return model.logits(y)[:, 0], cache  # (N, V)


def _decode_positions(model: Transformer, tokens: Any, cache: Cache) -> tuple[Any, Cache]:
    """What decode_step and prefill share: the decoder's embedding and layers over tokens
    (N, L) at positions index..index+L-1, each layer writing their keys and values into its
    buffers. Returns (the last layer's output (N, L, d), before any final norm; the new cache)."""
    c = model.config
    index = cache["index"]
    length = ops.shape(tokens)[1]
    max_steps = ops.shape(cache["key_valid"])[1]
    positions = index + ops.arange(length, dtype="int32")  # (L,)
    # decoder_key_padding_mask, written for these positions: position 0 (BOS, which may equal
    # pad) always, a later one iff its token is not padding. Positions after them are still
    # False from init_cache.
    is_key = ops.logical_or(ops.not_equal(tokens, c.pad_id), ops.equal(positions, 0)[None])
    key_valid = ops.slice_update(cache["key_valid"], (0, index), is_key)  # (N, max_steps)
    # Section 3.2.3: query index + i attends keys 0..index + i (a decode step's one query sees
    # every valid key; a prefill's are causal among themselves). M = max_steps.
    causal = ops.less_equal(ops.arange(max_steps, dtype="int32")[None, :], positions[:, None])
    self_mask = ops.logical_and(key_valid[:, None, None, :], causal[None, None])  # (N, 1, L, M)
    decoder = model.decoder
    # Section 3.5: PE[index..], rows computed for these positions; rotary positions likewise
    # continue from the prefix, index..index+L-1.
    x = decoder.embed(tokens, start=index, training=False)  # (N, L, d)
    rotary = decoder.rotary(length, start=index)  # None unless rotary
    layers = []
    for layer, layer_cache in zip(decoder.layers, cache["layers"], strict=True):
        x, _, _, layer_cache = layer(
            x,
            None,
            self_mask,
            cache.get("memory_mask"),  # None in a decoder-only model: no cross-attention
            cache=layer_cache,
            index=index,
            rotary=rotary,
            training=False,
        )
        layers.append(layer_cache)
    return x, {**cache, "layers": layers, "key_valid": key_valid, "index": index + length}


def reorder_cache(cache: Cache, rows: Any) -> Cache:
    """Row i continues as the old row rows[i] (N,): beam search's gather, on every per-row
    tensor (the position index is shared)."""
    per_row = {key: value for key, value in cache.items() if key != "index"}
    gathered = keras.tree.map_structure(lambda t: ops.take(t, rows, axis=0), per_row)
    return {**gathered, "index": cache["index"]}


def prefix_step(model: Transformer, prefix: Any, memory: Any, src: Any) -> Any:
    """The uncached baseline: the decoder over the whole prefix (N, t) given the encoded memory
    (N, S, d) of src (N, S) (both None in a decoder-only model); the last position's logits
    (N, V). Every step recomputes every position's keys and values, O(t) per layer instead of
    the cache's O(1)."""
    pad = model.config.pad_id
    memory_mask = None if src is None else key_padding_mask(src, pad)
    y, _, _, _ = model.decoder(
        prefix, memory, decoder_self_mask(prefix, pad), memory_mask, training=False
    )
    return model.logits(y[:, -1:])[:, 0]  # (N, V): only the position that is read


# -- compiled forms (tf_impl/backend.py makes one of each per model) ----------------------------


# idiom: tf.function wrappers, the compiled forms TensorFlow keeps per model
def step_function(model: Transformer, jit_compile: bool = False) -> Callable:
    """decode_step as a tf.function (an XLA program with jit_compile): the cache is an argument
    and a result, its shapes fixed by init_cache and its index a tensor, so it traces once per
    (N, max_steps, S), not once per position."""

    @tf.function(jit_compile=jit_compile)
    def step(tokens: tf.Tensor, cache: Cache) -> tuple[tf.Tensor, Cache]:
        return decode_step(model, tokens, cache)

    return step


# idiom: tf.function wrapper
def reorder_function() -> Callable:
    """reorder_cache as a tf.function, traced once per cache shape."""
    return tf.function(reorder_cache)


# idiom: tf.function wrapper, with an input signature for any prefix length
def prefix_function(model: Transformer) -> Callable:
    """prefix_step as a tf.function over any (N, t): an input signature with unknown sizes makes
    one graph for every prefix length. Never XLA: XLA compiles per concrete shape, i.e. once per
    step here, which would cost more than the step itself. A decoder-only model's takes the
    prefix alone (no memory, no src)."""
    c = model.config
    ids = tf.TensorSpec((None, None), tf.int64)
    if not c.has_encoder:

        @tf.function(input_signature=(ids,))
        def lm_step(prefix: tf.Tensor) -> tf.Tensor:
            return prefix_step(model, prefix, None, None)

        return lm_step
    memory = tf.TensorSpec((None, None, c.d_model), tf.as_dtype(model.compute_dtype))

    @tf.function(input_signature=(ids, memory, ids))
    def step(prefix: tf.Tensor, memory: tf.Tensor, src: tf.Tensor) -> tf.Tensor:
        return prefix_step(model, prefix, memory, src)

    return step


def top_k_log_probs(logits: Any, k: int) -> tuple[Any, Any]:
    """The k best next tokens of every row of logits (N, V), on the device: their log-softmax
    values (N, k), in float32 or wider, and ids (N, k), best first and ties to the lower id, as
    transformer_rosetta.decoding.search.top_log_probs specifies (tf.math.top_k, under keras.ops.top_k,
    documents that order among equal values)."""
    log_probs = ops.log_softmax(ops.cast(logits, statistics_dtype(logits.dtype.name)), axis=-1)
    return ops.top_k(log_probs, k, sorted=True)
