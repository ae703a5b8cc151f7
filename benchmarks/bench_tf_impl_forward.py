"""Forward speed of tf_impl against a peer built from stock Keras layers, both XLA-compiled.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) is harness.measure with
this module's HOOK: any config the peer can express, any workload, device and precision; `main()`
runs the standard workload: the base model with a 32000-token vocabulary, batch 8, source and
target length 128 with ragged padding, eval mode. Everything runs in one dtype inside
tf.device(device) and transformer_rosetta.tf_impl.precision.matmul_precision. Contenders, timed
in alternation:
- ours, fused attention (keras.ops.dot_product_attention), no attention maps returned;
- ours, explicit attention, returning every probability map;
- the peer: the same post-norm encoder-decoder assembled from keras.layers.MultiHeadAttention,
  Dense, LayerNormalization and Embedding, with the same masks and tied embeddings, holding our
  weights: its logits must be ours before it is timed;
- an n x n matmul (harness.matmul_size), the device's ceiling in this framework.

Each ends by reading one element back (.numpy()), which blocks until the whole result exists.

    python -m transformer_rosetta.benchmarks.bench_tf_impl_forward [--repeats N] [--device D] [--precision P] [--json]
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

from transformer_rosetta.adapter.backends import get_backend  # noqa: E402
from transformer_rosetta.benchmarks import harness  # noqa: E402
from transformer_rosetta.benchmarks.harness import (  # noqa: E402
    Contenders,
    ForwardHook,
    lacked_by_the_paper_layers,
    matmul_size,
)
from transformer_rosetta.benchmarks.suite import module_main  # noqa: E402
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.names import embedding_names  # noqa: E402
from transformer_rosetta.tf_impl.backend import tf_device  # noqa: E402
from transformer_rosetta.tf_impl.model import (  # noqa: E402
    decoder_self_mask,
    key_padding_mask,
    sinusoidal_positions,
)
from transformer_rosetta.tf_impl.precision import matmul_precision  # noqa: E402

WARMUP = 2


class PeerEncoderLayer(layers.Layer):
    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        eps, policy = c.layer_norm_eps, self.dtype_policy
        self.self_attention = layers.MultiHeadAttention(c.num_heads, c.head_dim, dtype=policy)
        self.self_attention_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)
        self.intermediate = layers.Dense(c.d_ff, activation="relu", dtype=policy)
        self.output_dense = layers.Dense(c.d_model, dtype=policy)
        self.feed_forward_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)

    def call(self, x, mask):
        x = self.self_attention_norm(x + self.self_attention(x, x, attention_mask=mask))
        return self.feed_forward_norm(x + self.output_dense(self.intermediate(x)))


class PeerDecoderLayer(layers.Layer):
    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        eps, policy = c.layer_norm_eps, self.dtype_policy
        self.self_attention = layers.MultiHeadAttention(c.num_heads, c.head_dim, dtype=policy)
        self.self_attention_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)
        self.cross_attention = layers.MultiHeadAttention(c.num_heads, c.head_dim, dtype=policy)
        self.cross_attention_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)
        self.intermediate = layers.Dense(c.d_ff, activation="relu", dtype=policy)
        self.output_dense = layers.Dense(c.d_model, dtype=policy)
        self.feed_forward_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)

    def call(self, x, memory, self_mask, memory_mask):
        x = self.self_attention_norm(x + self.self_attention(x, x, attention_mask=self_mask))
        x = self.cross_attention_norm(
            x + self.cross_attention(x, memory, attention_mask=memory_mask)
        )
        return self.feed_forward_norm(x + self.output_dense(self.intermediate(x)))


class PeerTransformer(keras.Model):
    """The base Transformer from stock Keras layers (post-norm; embeddings shared and tied as the
    config says, as in the paper by default). `dtype` (a Keras dtype policy, "bfloat16" say)
    reaches every layer, the Keras way: each sublayer is given its parent's policy."""

    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        self.c = c
        policy = self.dtype_policy
        self.embedding = layers.Embedding(c.src_vocab_size, c.d_model, dtype=policy)
        # The paper shares one table and ties the output to it (section 3.4); a config that does
        # not gets its own target table and output Dense, so that any config's vocabularies run.
        self.tgt_embedding = (
            None
            if c.share_embeddings
            else layers.Embedding(c.tgt_vocab_size, c.d_model, dtype=policy)
        )
        self.output_dense = (
            None
            if c.tie_output
            else layers.Dense(c.tgt_vocab_size, use_bias=c.output_bias, dtype=policy)
        )
        self.encoder_layers = [
            PeerEncoderLayer(c, dtype=policy) for _ in range(c.num_encoder_layers)
        ]
        self.decoder_layers = [
            PeerDecoderLayer(c, dtype=policy) for _ in range(c.num_decoder_layers)
        ]

    def embed(self, table, ids):
        length = ids.shape[1]
        positions = sinusoidal_positions(length, self.c.d_model, self.c.sinusoid_layout, "float32")
        positions = ops.cast(positions, self.compute_dtype)
        return table(ids) * math.sqrt(self.c.d_model) + positions[None]

    def call(self, src, tgt_in):
        # Keras MHA takes [B, T, S] masks (True = attend): the same masks as ours, broadcast.
        batch, s, t = src.shape[0], src.shape[1], tgt_in.shape[1]
        src_mask = key_padding_mask(src, self.c.pad_id)[:, 0]  # (B, 1, S)
        encoder_mask = ops.broadcast_to(src_mask, (batch, s, s))
        memory_mask = ops.broadcast_to(src_mask, (batch, t, s))
        self_mask = decoder_self_mask(tgt_in, self.c.pad_id)[:, 0]  # (B, T, T)
        tgt_table = self.embedding if self.tgt_embedding is None else self.tgt_embedding
        x = self.embed(self.embedding, src)
        for layer in self.encoder_layers:
            x = layer(x, encoder_mask)
        memory, y = x, self.embed(tgt_table, tgt_in)
        for layer in self.decoder_layers:
            y = layer(y, memory, self_mask, memory_mask)
        if self.output_dense is not None:
            return self.output_dense(y)
        return ops.matmul(y, ops.transpose(ops.cast(tgt_table.embeddings, y.dtype)))


# The canonical tensors each stock layer holds, in the order of its `weights` (set_weights').
PARTS: dict[type, list[str]] = {
    layers.MultiHeadAttention: [
        f"{proj}.{part}"
        for proj in ("query", "key", "value", "output")
        for part in ("kernel", "bias")
    ],
    layers.LayerNormalization: ["scale", "bias"],
    layers.Dense: ["kernel", "bias"],
}
# The canonical sublayers of each stack's layers (common/spec/names.py), in their order.
SUBLAYERS = {
    "encoder": (
        "self_attention",
        "self_attention_norm",
        "feed_forward.intermediate",
        "feed_forward.output",
        "feed_forward_norm",
    ),
    "decoder": (
        "self_attention",
        "self_attention_norm",
        "cross_attention",
        "cross_attention_norm",
        "feed_forward.intermediate",
        "feed_forward.output",
        "feed_forward_norm",
    ),
}


def peer_from_canonical(
    c: TransformerConfig, weights: Mapping[str, np.ndarray], dtype: str = "float32"
) -> PeerTransformer:
    """The peer holding canonical `weights`, so that its logits can be checked against ours.

    Built the Keras way, by a first call (on one token: no weight depends on the length), then
    loaded by each layer's set_weights (PARTS); the canonical attention kernels already keep
    heads as their own axis, [d_model, h, d_k] and [h, d_k, d_model], as MultiHeadAttention's.
    """
    peer = PeerTransformer(c, dtype=dtype)
    one = ops.ones((1, 1), "int32")
    peer(one, one)
    names = embedding_names(c)
    peer.embedding.set_weights([weights[names["source"]]])
    if peer.tgt_embedding is not None:
        peer.tgt_embedding.set_weights([weights[names["target"]]])
    if peer.output_dense is not None:
        bias = [weights["output.bias"]] if c.output_bias else []
        peer.output_dense.set_weights([weights["output.kernel"], *bias])

    # Each sublayer's attribute is its canonical name, but for the feed-forward's two Dense.
    attributes = {
        "feed_forward.intermediate": "intermediate",
        "feed_forward.output": "output_dense",
    }
    for stack, stack_layers in (("encoder", peer.encoder_layers), ("decoder", peer.decoder_layers)):
        for i, layer in enumerate(stack_layers):
            for name in SUBLAYERS[stack]:
                sublayer = getattr(layer, attributes.get(name, name))
                prefix = f"{stack}.layers.{i}.{name}"
                sublayer.set_weights([weights[f"{prefix}.{p}"] for p in PARTS[type(sublayer)]])
    return peer


PEER = (
    "Keras built-in layers (keras.layers.MultiHeadAttention, Dense, LayerNormalization, "
    "Embedding), XLA-compiled like ours"
)
LABELS = {
    "ours": "ours (fused attention)",
    "ours_attention": "ours (explicit, attention maps out)",
    "peer": "peer (keras.layers.MultiHeadAttention)",
}


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
    """The four contenders, each one XLA program on `device` in `dtype`, and the logits of ours
    and the peer; ours is built by the adapter (tf_impl/backend.py), the peer holds the same
    weights."""
    with running(device, mode):
        src_t, tgt_t = tf.constant(src), tf.constant(tgt_in)
        model = get_backend("tf").build(config, weights, dtype=dtype, device=device, precision=mode)
        ours = model.module
        peer = peer_from_canonical(config, weights, dtype)
        n = matmul_size(device, dtype)
        a = tf.cast(tf.random.normal((n, n)), dtype)
        b = tf.cast(tf.random.normal((n, n)), dtype)

        # Every contender is one XLA program; a timed one ends by reading one element back, which
        # blocks until the whole result exists.
        fused = tf.function(lambda s, t: ours(s, t, training=False)["logits"], jit_compile=True)
        explicit = tf.function(
            lambda s, t: ours(s, t, training=False, return_attention=True), jit_compile=True
        )
        peer_fn = tf.function(lambda s, t: peer(s, t), jit_compile=True)
        matmul = tf.function(lambda: tf.matmul(a, b), jit_compile=True)

    def logits(fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Callable[[], np.ndarray]:
        return lambda: tf.cast(fn(src_t, tgt_t), tf.float32).numpy()

    return Contenders(
        ours=lambda: fused(src_t, tgt_t)[0, 0, 0].numpy(),
        ours_attention=lambda: explicit(src_t, tgt_t)["logits"][0, 0, 0].numpy(),
        peer=lambda: peer_fn(src_t, tgt_t)[0, 0, 0].numpy(),
        matmul=lambda: matmul()[0, 0].numpy(),
        matmul_n=n,
        ours_logits=logits(fused),
        peer_logits=logits(peer_fn),
    )


@contextlib.contextmanager
def running(device: str, mode: str) -> Iterator[None]:
    """On `device` (tf.device), at matmul precision `mode`: where the models are built, checked
    and timed."""
    with tf.device(tf_device(device)), matmul_precision(mode):
        yield


HOOK = ForwardHook(
    framework="tf",
    version=f"keras {keras.__version__} / tensorflow {tf.__version__}",
    peer=PEER,
    labels=LABELS,
    warmup=WARMUP,
    peer_lacks=lacked_by_the_paper_layers,
    build=contenders,
    running=running,
    workload=lambda device: {"compiler": "XLA (jit_compile=True)"},
)


# The interface of every bench module (benchmarks/suite.py): the one harness.measure, with
# this framework's hook.
measure = partial(harness.measure, HOOK)


def main(argv: list[str] | None = None) -> int:
    module_main("tf", measure, argv, default_repeats=7, description=__doc__.split("\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
