"""Autoregressive decoding of the Flax NNX Transformer with a key/value cache (section 3.2.3).

The search itself (greedy, beam) is transformer_rosetta.decoding.search's, written once in numpy; this file is the
model's half: one decoding step at a time. The cache is explicit state, in the functional style of
Flax's own decoders: `init_cache` returns a pytree, `decode_step` takes it and returns
`(logits, new_cache)`, and nothing in the module changes. Every array has a fixed shape, the
position `index` included (a scalar array, not a Python int), so the compiled versions below
compile once per (model kind, N, max_steps, S) and never per position.

The cache (the same names and array layouts as in torch_impl/decode.py and tf_impl/decode.py;
the index dtype is not the same everywhere: int32 here, JAX's integer without x64, int64 in torch):
    "layers":      one dict per decoder layer:
        "self_key", "self_value":   (N, g, M, k) self-attention buffers, written at index
        "cross_key", "cross_value": (N, g, S, k) the memory's keys and values, computed once
    "memory_mask": (N, 1, 1, S) bool, the source's key padding mask
    "key_valid":   (N, M) bool, True at the positions written so far whose token is not
                   padding (position 0 always): decoder_key_padding_mask & causal, one row
    "index":       () int32, the position the next step writes
N = B * beams: row r decodes source row r // beams (repeat_interleave). M = max_steps. g is
num_kv_heads, the key/value heads (grouped-query attention's smaller cache); a rotary model's
keys are kept rotated, at their positions.

A decoder-only model (GPT) decodes a prompt (B, P) given in place of src: it has no memory, so
its cache has no "memory_mask" and its layers no "cross_key"/"cross_value" (absent keys, as a
pytree leaves them); its buffers hold M = P - 1 + max_steps positions, the prompt's first
P - 1 tokens prefilled in one pass (prefill), and the search feeds its last token first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_rosetta.jax_impl.model import Transformer, key_padding_mask, statistics_dtype

# idiom: a pytree of immutable arrays (torch's is a dataclass of in-place buffers)
Cache = dict[str, Any]


def encode_rows(model: Transformer, src: jax.Array, beams: int) -> tuple[jax.Array, jax.Array]:
    """Encode src (B, S) once and repeat it for the beams: (memory (N, S, d), src (N, S)) with
    row r taken from source r // beams."""
    memory, _, _ = model.encode(src)  # (B, S, d)
    return jnp.repeat(memory, beams, axis=0), jnp.repeat(src, beams, axis=0)


def init_cache(model: Transformer, src: jax.Array, beams: int, max_steps: int) -> Cache:
    """The cache before the first step, for B * beams rows and max_steps positions: the encoder
    run once on src (B, S), every layer's cross-attention keys and values of the memory, and
    zeroed self-attention buffers.

    A decoder-only model takes its prompt (B, P) as src: no encoder and no cross-attention,
    buffers of P - 1 + max_steps positions, and the prompt's first P - 1 tokens prefilled in
    one pass (index P - 1 after it), rows repeated per beam as the memory's are.

    Not encode_rows: the projections are row-wise, so projecting the B rows of the memory and
    then repeating them gives the same numbers as repeating the memory first, for 1 / beams of
    the work."""
    c = model.config
    rows = src.shape[0] * beams
    positions = max_steps if c.has_encoder else src.shape[1] - 1 + max_steps
    shape = (rows, c.kv_heads, positions, c.head_dim)  # (N, g, positions, d_k)
    empty = jnp.zeros(shape, model.table("target").dtype)
    cache = {
        "layers": [{"self_key": empty, "self_value": empty} for _ in model.decoder.layers],
        "key_valid": jnp.zeros((rows, positions), bool),
        "index": jnp.zeros((), jnp.int32),
    }
    if not c.has_encoder:  # decoder-only: src is the prompt
        prompt = jnp.repeat(src, beams, axis=0)  # (N, P)
        return prefill(model, prompt[:, :-1], cache) if prompt.shape[1] > 1 else cache
    memory, _, _ = model.encode(src)  # (B, S, d)
    for layer, entry in zip(model.decoder.layers, cache["layers"], strict=True):
        entry["cross_key"], entry["cross_value"] = (
            jnp.repeat(t, beams, axis=0) for t in layer.cross_attention.keys_values(memory)
        )  # (N, g, S, k)
    cache["memory_mask"] = jnp.repeat(key_padding_mask(src, c.pad_id), beams, axis=0)
    return cache


def prefill(model: Transformer, tokens: jax.Array, cache: Cache) -> Cache:
    """Feed tokens (N, L) at positions index..index+L-1 in one pass (a prompt); return the
    cache L positions on, their keys and values written.

    The decoder of section 3.1 on L positions at once, as teacher forcing runs it: causal among
    themselves (section 3.2.3), and each attends the buffer's valid keys before them too.
    Nothing is projected to the vocabulary: the search feeds the prompt's last token as its
    first step."""
    _, cache = _run_decoder(model, tokens, cache)
    return cache


def _run_decoder(model: Transformer, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """What prefill and decode_step share: tokens (N, L) through the decoder at positions
    index..index+L-1 -> (the decoder's output (N, L, d), after the final norm if configured;
    the cache L positions on)."""
    c = model.config
    index = cache["index"]
    buffer = cache["key_valid"].shape[1]
    decoder = model.decoder
    table = model.table("target")
    # Section 3.5: PE[index..], rows of a table of `buffer` positions; rotary positions likewise
    # continue from the prefix, index..index+L-1.
    x = decoder.embed(tokens, start=index, table=table, max_steps=buffer)  # (N, L, d)
    rotary = decoder.rotary(tokens.shape[1], start=index, dtype=table.dtype, max_steps=buffer)
    # A key written here is valid unless it is padding; BOS (position 0) always is, even when
    # bos_id == pad_id. Unwritten positions are still False; among the L new ones, query i sees
    # keys up to index + i: that is the causal mask.
    positions = index + jnp.arange(tokens.shape[1])  # (L,)
    valid = (tokens != c.pad_id) | (positions == 0)  # (N, L)
    key_valid = jax.lax.dynamic_update_slice_in_dim(cache["key_valid"], valid, index, axis=1)
    causal = jnp.arange(buffer) <= positions[:, None]  # (L, buffer)
    self_mask = key_valid[:, None, None, :] & causal[None, None]  # (N, 1, L, buffer)
    layers = []
    for layer, layer_cache in zip(decoder.layers, cache["layers"], strict=True):
        x, _, _, layer_cache = layer(
            x,
            None,
            self_mask,
            cache.get("memory_mask"),
            cache=layer_cache,
            index=index,
            rotary=rotary,
        )
        layers.append(layer_cache)
    if decoder.final_norm is not None:
        x = decoder.final_norm(x)
    new = {**cache, "layers": layers, "key_valid": key_valid, "index": index + tokens.shape[1]}
    return x, new


def decode_step(model: Transformer, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Feed tokens (N,) at position cache["index"]; return (logits (N, V), the cache one step on).

    The decoder of section 3.1 on one position: E[token] * sqrt(d) + PE[index] (or, rotary,
    its self-attentions' queries and keys rotated to position index), then every
    decoder layer (its self-attention over the cached keys and values of positions 0..index, its
    cross-attention over the cached memory), the final norm if configured, the output projection.
    """
    x, cache = _run_decoder(model, tokens[:, None], cache)  # (N, 1, d)
    return model.logits(x[:, 0]), cache  # (N, V)


def reorder_cache(cache: Cache, rows: jax.Array) -> Cache:
    """Row i continues as old row rows[i] (N,): every per-row array gathered, index kept."""
    return jax.tree.map(lambda t: t[rows] if t.ndim else t, cache)


def prefix_step(
    model: Transformer, prefix: jax.Array, memory: jax.Array | None, src: jax.Array | None
) -> jax.Array:
    """The uncached baseline: the decoder over the whole prefix (N, t) (causal, so position t - 1
    sees what a cached step would), memory (N, S, d) encoded once; the last position's logits
    (N, V). A decoder-only model has no memory (memory and src None): its prefix starts with
    the prompt."""
    logits, _, _, _ = model.decode(prefix, memory, src)  # (N, t, V)
    return logits[:, -1]


# Compiled versions, over the module split once by the caller (nnx.split) into its graphdef
# (static: config, dtype, structure) and its state, a pure dict of arrays (nnx.to_pure_dict: jax.jit
# flattens a dict in C++, an nnx.State of Variables with a Python call per node). Not nnx.jit: it
# walks the module's graph on every call, and a step is called hundreds of times on one
# unchanged module (the Flax "Performance considerations" guide).
#
# Each function below returns the jax.jit function for one graphdef, with the graphdef closed over
# rather than passed as a static argument: jax.jit hashes its static arguments on every call, and
# nnx.GraphDef's hash walks every node of the graph, which on a CPU cost more than the tiny model's
# whole cached step. Cached per graphdef (equal for two models of one config and dtype), so each
# (model kind, N, max_steps, S) compiles once and every position reuses it (index is an array, not
# a Python int); the caller looks them up once per stepper and holds on to them. The uncached
# baseline compiles once per prefix length (its shape grows every step), which is still cheaper
# than eager JAX, whose op-by-op dispatch also compiles every primitive per shape.

# The `state` the functions below take: nnx.to_pure_dict(nnx.split(module)[1]).
_State = dict[str, Any]


@functools.lru_cache(maxsize=16)
def encode_rows_compiled(  # idiom: jax.jit over the module split once (see above)
    graphdef: nnx.GraphDef,
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """(state, src, beams) -> encode_rows of the module, beams static."""

    def run(state: _State, src: jax.Array, beams: int) -> tuple[jax.Array, jax.Array]:
        return encode_rows(nnx.merge(graphdef, state), src, beams)

    return jax.jit(run, static_argnames=("beams",))


@functools.lru_cache(maxsize=16)
def init_cache_compiled(  # idiom: jax.jit over the module split once (see above)
    graphdef: nnx.GraphDef,
) -> Callable[..., Cache]:
    """(state, src, beams, max_steps) -> init_cache of the module, beams and max_steps static."""

    def run(state: _State, src: jax.Array, beams: int, max_steps: int) -> Cache:
        return init_cache(nnx.merge(graphdef, state), src, beams, max_steps)

    return jax.jit(run, static_argnames=("beams", "max_steps"))


@functools.lru_cache(maxsize=16)
def decode_step_compiled(  # idiom: jax.jit over the module split once (see above)
    graphdef: nnx.GraphDef,
) -> Callable[[_State, jax.Array, Cache], tuple[jax.Array, Cache]]:
    """(state, tokens, cache) -> decode_step of the module: (logits, the cache one step on)."""

    def run(state: _State, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        return decode_step(nnx.merge(graphdef, state), tokens, cache)

    return jax.jit(run)


reorder_cache_compiled = jax.jit(reorder_cache)  # idiom: jax.jit of reorder_cache


@functools.lru_cache(maxsize=16)
def prefix_step_compiled(  # idiom: jax.jit over the module split once (see above)
    graphdef: nnx.GraphDef,
) -> Callable[[_State, jax.Array, jax.Array, jax.Array], jax.Array]:
    """(state, prefix, memory, src) -> prefix_step of the module."""

    def run(state: _State, prefix: jax.Array, memory: jax.Array, src: jax.Array) -> jax.Array:
        return prefix_step(nnx.merge(graphdef, state), prefix, memory, src)

    return jax.jit(run)


def top_k_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best next tokens of every row of logits (N, V), on the device: their log-softmax
    values (N, k), in float32 or wider, and ids (N, k), best first and ties to the lower id, as
    transformer_rosetta.decoding.search.top_log_probs specifies (jax.lax.top_k documents that order among
    equal values)."""
    log_probs = jax.nn.log_softmax(logits.astype(statistics_dtype(logits.dtype)), axis=-1)
    return jax.lax.top_k(log_probs, k)


# One compiled reduction per (shape, k): k is a static size.
top_k_log_probs_compiled = jax.jit(top_k_log_probs, static_argnums=1)
