"""Autoregressive decoding in Keras 3 with a key/value cache (section 3.2.3: the decoder is
auto-regressive, each position attending only to those before it).

The search itself (greedy, beam) is common/decoding/search.py's, written once; this file is the model's
half of it, one position at a time. The encoder runs once per batch; each decoder layer keeps the
keys and values of every position decoded so far in a buffer of `max_steps` positions, and the
keys and values of the encoder output, so that a step projects only the new position. The layers
are model.py's own, called by decode_step with `cache=`: the same projections, residual wiring
and fused attention kernel as the forward pass (tf_impl/backend.py compiles `decode_step` with
`tf.function`; fixed shapes and a tensor index make it one trace per (rows, max_steps, S)).

The cache is a plain nested dict of tensors, so it passes in and out of a `tf.function` as its
arguments and results (the same entries as in torch_impl/ and jax_impl/, in each one's own
container):
- "layers": per decoder layer, "self_key" / "self_value" (N, h, max_steps, k), written at
  "index" each step, and "cross_key" / "cross_value" (N, h, S, k) of the memory;
- "memory_mask" (N, 1, 1, S): the source padding mask, for cross-attention;
- "key_valid" (N, max_steps) bool: which decoder keys may be attended (decoder_key_padding_mask:
  position 0 always, a later one iff its token is not pad_id; False beyond index, so causal);
- "index": scalar int32 tensor (torch's is int64), the position the next step writes.

Shapes: B source rows, N = B * beams decoding rows, S source length, h heads, k = d_k, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from tf_impl.model import Transformer, decoder_self_mask, key_padding_mask, statistics_dtype

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
    r // beams) and at most max_steps decoder positions."""
    c = model.config
    memory, src = encode_rows(model, src, beams)  # (N, S, d), (N, S)
    rows = ops.shape(memory)[0]
    empty = ops.zeros((rows, c.num_heads, max_steps, c.head_dim), dtype=model.compute_dtype)
    layers = []
    for layer in model.decoder.layers:
        cross_key, cross_value = layer.cross_attention.keys_values(memory)  # (N, h, S, k) each
        layers.append(
            {
                "self_key": empty,
                "self_value": empty,
                "cross_key": cross_key,
                "cross_value": cross_value,
            }
        )
    return {
        "layers": layers,
        "memory_mask": key_padding_mask(src, c.pad_id),  # (N, 1, 1, S)
        "key_valid": ops.zeros((rows, max_steps), dtype="bool"),
        "index": ops.convert_to_tensor(0, dtype="int32"),
    }


def decode_step(model: Transformer, tokens: Any, cache: Cache) -> tuple[Any, Cache]:
    """Feed tokens (N,) at position cache["index"]: returns (that position's logits (N, V), the
    new cache, index + 1). Equals the last position of the forward pass over the whole prefix.

    The decoder's embedding and layers, one position: each layer writes this position's keys
    and values into its buffers and reads the cross-attention keys and values of the memory."""
    c = model.config
    index = cache["index"]
    max_steps = ops.shape(cache["key_valid"])[1]
    here = ops.equal(ops.arange(max_steps), index)[None, :]  # (1, max_steps)
    # decoder_key_padding_mask, one position at a time: position 0 (BOS, which may equal pad)
    # always, a later position iff its token is not padding. Positions after index are still
    # False from init_cache, which makes the mask causal too.
    is_key = ops.logical_or(ops.not_equal(tokens, c.pad_id), ops.equal(index, 0))  # (N,)
    key_valid = ops.where(here, is_key[:, None], cache["key_valid"])  # (N, max_steps)
    self_mask = key_valid[:, None, None, :]  # (N, 1, 1, max_steps)
    decoder = model.decoder
    x = decoder.embed(tokens[:, None], start=index, training=False)  # (N, 1, d)
    layers = []
    for layer, layer_cache in zip(decoder.layers, cache["layers"], strict=True):
        x, _, _, layer_cache = layer(
            x,
            None,
            self_mask,
            cache["memory_mask"],
            cache=layer_cache,
            index=index,
            training=False,
        )
        layers.append(layer_cache)
    y = decoder.final_norm(x) if c.final_norm else x
    logits = model.logits(y)[:, 0]  # (N, V)
    return logits, {**cache, "layers": layers, "key_valid": key_valid, "index": index + 1}


def reorder_cache(cache: Cache, rows: Any) -> Cache:
    """Row i continues as the old row rows[i] (N,): beam search's gather, on every per-row
    tensor (the position index is shared)."""
    per_row = {key: value for key, value in cache.items() if key != "index"}
    gathered = keras.tree.map_structure(lambda t: ops.take(t, rows, axis=0), per_row)
    return {**gathered, "index": cache["index"]}


def prefix_step(model: Transformer, prefix: Any, memory: Any, src: Any) -> Any:
    """The uncached baseline: the decoder over the whole prefix (N, t) given the encoded memory
    (N, S, d) of src (N, S); the last position's logits (N, V). Every step recomputes every
    position's keys and values, O(t) per layer instead of the cache's O(1)."""
    pad = model.config.pad_id
    y, _, _, _ = model.decoder(
        prefix, memory, decoder_self_mask(prefix, pad), key_padding_mask(src, pad), training=False
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
    step here, which would cost more than the step itself."""
    c = model.config
    ids = tf.TensorSpec((None, None), tf.int64)
    memory = tf.TensorSpec((None, None, c.d_model), tf.as_dtype(model.compute_dtype))

    @tf.function(input_signature=(ids, memory, ids))
    def step(prefix: tf.Tensor, memory: tf.Tensor, src: tf.Tensor) -> tf.Tensor:
        return prefix_step(model, prefix, memory, src)

    return step


def top_k_log_probs(logits: Any, k: int) -> tuple[Any, Any]:
    """The k best next tokens of every row of logits (N, V), on the device: their log-softmax
    values (N, k), in float32 or wider, and ids (N, k), best first and ties to the lower id, as
    common.decoding.search.top_log_probs specifies (tf.math.top_k, under keras.ops.top_k,
    documents that order among equal values)."""
    log_probs = ops.log_softmax(ops.cast(logits, statistics_dtype(logits.dtype.name)), axis=-1)
    return ops.top_k(log_probs, k, sorted=True)
