"""Forward-pass speed of jax_impl against a peer built from Flax's own layers, side by side.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) is harness.measure with
this module's HOOK: any config the peer can express, any workload, device and precision; `main()`
runs the standard workload: the base model with a 32000-token vocabulary, batch 8, source and
target length 128 with ragged padding, eval mode, jitted. Everything lives on one jax.Device, in
one dtype, and runs (and is traced) inside transformer_rosetta.jax_impl.precision.matmul_precision.
Contenders, timed in alternation, each ending in jax.block_until_ready:
- ours without attention outputs (jax.nn.dot_product_attention),
- ours with attention outputs (explicit probabilities, returned for every layer),
- the peer: the same post-norm encoder-decoder assembled from nnx.MultiHeadAttention,
  nnx.Linear, nnx.LayerNorm and nnx.Embed, with the same masks and the same weights: its logits
  must be ours before it is timed,
- an n x n matmul (harness.matmul_size), the device's ceiling for the TFLOP/s column.

    python -m transformer_rosetta.benchmarks.bench_jax_impl_forward [--repeats N] [--device D] [--precision P] [--json]
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from transformer_rosetta.adapter.backends import get_backend  # noqa: E402
from transformer_rosetta.benchmarks import harness  # noqa: E402
from transformer_rosetta.benchmarks.harness import (  # noqa: E402
    Contenders,
    ForwardHook,
    lacked_by_the_paper_layers,
    matmul_size,
)
from transformer_rosetta.benchmarks.suite import module_main  # noqa: E402
from transformer_rosetta.jax_impl.backend import jax_device  # noqa: E402
from transformer_rosetta.jax_impl.model import (  # noqa: E402
    causal_mask,
    key_padding_mask,
    sinusoidal_positions,
)
from transformer_rosetta.jax_impl.precision import matmul_precision  # noqa: E402
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.names import embedding_names  # noqa: E402

WARMUP = 1  # one round: the first call of each jitted contender compiles it


# -- the peer: Flax's own layers, wired as the paper's post-norm model ------------------------


def _layers(dtype: jnp.dtype, rngs: nnx.Rngs) -> dict:
    """The keywords every Flax layer of the peer takes: parameters and computation in `dtype`
    (Flax's two knobs, param_dtype and dtype, set alike: the pure-dtype model ours is too)."""
    return dict(dtype=dtype, param_dtype=dtype, rngs=rngs)


def _attention(c: TransformerConfig, **kw) -> nnx.MultiHeadAttention:
    """nnx.MultiHeadAttention with the config's heads of head_dim each (qkv_features: h * d_k)."""
    return nnx.MultiHeadAttention(
        c.num_heads,
        c.d_model,
        qkv_features=c.num_heads * c.head_dim,
        decode=False,
        deterministic=True,
        **kw,
    )


class PeerEncoderLayer(nnx.Module):
    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        kw = _layers(dtype, rngs)
        norm = functools.partial(nnx.LayerNorm, c.d_model, epsilon=c.layer_norm_eps, **kw)
        self.attention = _attention(c, **kw)
        self.norm1, self.norm2 = norm(), norm()
        self.ff1 = nnx.Linear(c.d_model, c.d_ff, **kw)
        self.ff2 = nnx.Linear(c.d_ff, c.d_model, **kw)

    def __call__(self, x, mask):
        x = self.norm1(x + self.attention(x, mask=mask))
        return self.norm2(x + self.ff2(jax.nn.relu(self.ff1(x))))


class PeerDecoderLayer(nnx.Module):
    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        kw = _layers(dtype, rngs)
        norm = functools.partial(nnx.LayerNorm, c.d_model, epsilon=c.layer_norm_eps, **kw)
        self.self_attention, self.cross_attention = _attention(c, **kw), _attention(c, **kw)
        self.norm1, self.norm2, self.norm3 = norm(), norm(), norm()
        self.ff1 = nnx.Linear(c.d_model, c.d_ff, **kw)
        self.ff2 = nnx.Linear(c.d_ff, c.d_model, **kw)

    def __call__(self, x, memory, self_mask, memory_mask):
        x = self.norm1(x + self.self_attention(x, mask=self_mask))
        x = self.norm2(x + self.cross_attention(x, memory, memory, mask=memory_mask))
        return self.norm3(x + self.ff2(jax.nn.relu(self.ff1(x))))


class Peer(nnx.Module):
    """The paper's base model: scaled embeddings plus sinusoids, shared and tied as the config
    says (the paper shares and ties), post-norm layers."""

    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.c, self.dtype = c, dtype
        kw = _layers(dtype, rngs)
        self.embed = nnx.Embed(c.src_vocab_size, c.d_model, **kw)
        # The paper shares one table and ties the output to it (section 3.4); a config that does
        # not gets its own target table and output Linear, so that any config's vocabularies run.
        self.tgt_embed = (
            None if c.share_embeddings else nnx.Embed(c.tgt_vocab_size, c.d_model, **kw)
        )
        self.output = (
            None
            if c.tie_output
            else nnx.Linear(c.d_model, c.tgt_vocab_size, use_bias=c.output_bias, **kw)
        )
        self.encoder = nnx.List(
            [PeerEncoderLayer(c, rngs, dtype) for _ in range(c.num_encoder_layers)]
        )
        self.decoder = nnx.List(
            [PeerDecoderLayer(c, rngs, dtype) for _ in range(c.num_decoder_layers)]
        )

    def _embed(self, table, ids):
        pe = sinusoidal_positions(ids.shape[1], self.c.d_model, self.c.sinusoid_layout)
        return table(ids) * self.c.d_model**0.5 + jnp.asarray(pe, self.dtype)

    def __call__(self, src, tgt_in):
        src_mask = key_padding_mask(src, self.c.pad_id)
        tgt_table = self.embed if self.tgt_embed is None else self.tgt_embed
        x = self._embed(self.embed, src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        self_mask = key_padding_mask(tgt_in, self.c.pad_id).at[..., 0].set(True)
        self_mask = self_mask & causal_mask(tgt_in.shape[1])
        y = self._embed(tgt_table, tgt_in)
        for layer in self.decoder:
            y = layer(y, x, self_mask, src_mask)
        return tgt_table.attend(y) if self.output is None else self.output(y)


def peer_from_canonical(
    c: TransformerConfig, w: Mapping[str, np.ndarray], dtype: jnp.dtype = jnp.float32
) -> Peer:
    """The peer holding canonical weights `w`, so that its logits can be checked against ours."""
    peer = Peer(c, nnx.Rngs(0), dtype)
    names = embedding_names(c)
    peer.embed.embedding[...] = jnp.asarray(w[names["source"]], dtype)
    if peer.tgt_embed is not None:
        peer.tgt_embed.embedding[...] = jnp.asarray(w[names["target"]], dtype)
    if peer.output is not None:
        peer.output.kernel[...] = jnp.asarray(w["output.kernel"], dtype)
        if c.output_bias:
            peer.output.bias[...] = jnp.asarray(w["output.bias"], dtype)
    renames = {
        "self_attention": "attention",
        "self_attention_norm": "norm1",
        "feed_forward_norm": "norm2",
        "feed_forward.intermediate": "ff1",
        "feed_forward.output": "ff2",
    }
    dec_renames = {
        "self_attention": "self_attention",
        "self_attention_norm": "norm1",
        "cross_attention": "cross_attention",
        "cross_attention_norm": "norm2",
        "feed_forward_norm": "norm3",
        "feed_forward.intermediate": "ff1",
        "feed_forward.output": "ff2",
    }
    for name, value in w.items():
        parts = name.split(".")
        if parts[0] not in ("encoder", "decoder") or parts[1] != "layers":
            continue  # the embeddings and the output, loaded above
        stack, i, rest = parts[0], int(parts[2]), parts[3:]
        table = renames if stack == "encoder" else dec_renames
        for k in sorted(table, key=len, reverse=True):
            n = len(k.split("."))
            if ".".join(rest[:n]) == k:
                rest = [table[k], *rest[n:]]
                break
        if rest[0] in ("attention", "self_attention", "cross_attention") and rest[1] == "output":
            rest[1] = "out"  # nnx.MultiHeadAttention's name for W^O
        node = getattr(peer, stack)[i]
        for attr in rest[:-1]:
            node = getattr(node, attr)
        getattr(node, rest[-1])[...] = jnp.asarray(value, dtype)
    return peer


def jitted(model: nnx.Module, src: jax.Array, tgt_in: jax.Array, **kwargs):
    """A zero-argument callable running `model` jitted (split once, merged inside the jit)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, src, tgt_in):
        out = nnx.merge(graphdef, state)(src, tgt_in, **kwargs)
        if isinstance(out, dict):  # ours always returns its hidden states: left out, XLA drops them
            out = {k: v for k, v in out.items() if not k.endswith("hidden_states")}
        return out

    return lambda: jax.block_until_ready(run(state, src, tgt_in))


def contenders(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray,
    tgt_in: np.ndarray,
    *,
    device: str,
    dtype: str,
    mode: str,
) -> Contenders:
    """The four contenders, each jitted on `device` in `dtype`, and the logits of ours and the
    peer; ours is built by the adapter (jax_impl/backend.py), the peer holds the same weights.
    Nothing is traced here: the first call (the check, inside `running`) traces and compiles."""
    jdtype = jnp.dtype(dtype)
    target = jax_device(device)
    src_j, tgt_j = jax.device_put((src.astype(np.int32), tgt_in.astype(np.int32)), target)
    model = get_backend("jax").build(config, weights, dtype=dtype, device=device, precision=mode)
    ours = model.module
    with jax.default_device(target):
        peer = peer_from_canonical(config, weights, jdtype)
        n = matmul_size(device, dtype)
        a = jax.random.normal(jax.random.key(0), (n, n), jdtype)

    fused = jitted(ours, src_j, tgt_j)
    peer_run = jitted(peer, src_j, tgt_j)
    matmul = jax.jit(jnp.matmul)

    def logits(out: jax.Array) -> np.ndarray:
        return np.asarray(out.astype(jnp.float32))

    return Contenders(
        ours=fused,
        ours_attention=jitted(ours, src_j, tgt_j, return_attention=True),
        peer=peer_run,
        matmul=lambda: matmul(a, a).block_until_ready(),
        matmul_n=n,
        ours_logits=lambda: logits(fused()["logits"]),
        peer_logits=lambda: logits(peer_run()),
    )


def running(device: str, mode: str) -> contextlib.AbstractContextManager:
    """At matmul precision `mode`, under which each contender is traced (its first call) and
    run; the device is each array's own (jax.device_put, jax.default_device above)."""
    return matmul_precision(mode)


PEER = (
    "Flax built-in layers (nnx.MultiHeadAttention, nnx.Linear, nnx.LayerNorm, nnx.Embed), "
    "jitted like ours"
)
LABELS = {
    "ours": "ours (fused attention)",
    "ours_attention": "ours (attention outputs)",
    "peer": "peer (nnx.MultiHeadAttention)",
}
HOOK = ForwardHook(
    framework="jax",
    version=f"jax {jax.__version__}, flax {flax.__version__}",
    peer=PEER,
    labels=LABELS,
    warmup=WARMUP,
    peer_lacks=lacked_by_the_paper_layers,
    build=contenders,
    running=running,
    workload=lambda device: {"jax_device": str(jax_device(device)), "compiler": "jax.jit"},
)


# The interface of every bench module (benchmarks/suite.py): the one harness.measure, with
# this framework's hook.
measure = functools.partial(harness.measure, HOOK)


def main(argv: list[str] | None = None) -> dict:
    return module_main("jax", measure, argv, default_repeats=5, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
