"""Forward speed of tf_impl against a peer built from stock Keras layers, both XLA-compiled.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) takes any config,
workload, device and precision; `main()` runs the issues' workload: the base model with a
32000-token vocabulary, batch 8, source and target length 128 with ragged padding, eval mode.
Everything runs in one dtype inside tf.device(device) and transformer_rosetta.tf_impl.model.matmul_precision.
Contenders, timed in alternation:
- ours, fused attention (keras.ops.dot_product_attention), no attention maps returned;
- ours, explicit attention, returning every probability map;
- the peer: the same post-norm encoder-decoder assembled from keras.layers.MultiHeadAttention,
  Dense, LayerNormalization and Embedding, with the same masks and tied embeddings;
- an n x n matmul (harness.matmul_size), the device's ceiling in this framework.

Each ends by reading one element back (.numpy()), which blocks until the whole result exists.

    python -m transformer_rosetta.benchmarks.bench_tf_impl_forward [--repeats N] [--device D] [--precision P] [--json]
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

from transformer_rosetta.adapter.backends import get_backend  # noqa: E402
from transformer_rosetta.benchmarks.harness import matmul_size  # noqa: E402
from transformer_rosetta.benchmarks.suite import alternate, module_main, summarise  # noqa: E402
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.inputs import ragged_batch  # noqa: E402
from transformer_rosetta.spec.precision import bench_setting  # noqa: E402
from transformer_rosetta.tf_impl.backend import tf_device  # noqa: E402
from transformer_rosetta.tf_impl.model import (  # noqa: E402
    decoder_self_mask,
    key_padding_mask,
    matmul_precision,
    sinusoidal_positions,
)
from transformer_rosetta.weights.init import init_weights  # noqa: E402

WARMUP = 2


class PeerEncoderLayer(layers.Layer):
    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        eps, policy = c.layer_norm_eps, self.dtype_policy
        self.attention = layers.MultiHeadAttention(c.num_heads, c.head_dim, dtype=policy)
        self.attention_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)
        self.intermediate = layers.Dense(c.d_ff, activation="relu", dtype=policy)
        self.output_dense = layers.Dense(c.d_model, dtype=policy)
        self.feed_forward_norm = layers.LayerNormalization(epsilon=eps, dtype=policy)

    def call(self, x, mask):
        x = self.attention_norm(x + self.attention(x, x, attention_mask=mask))
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
        self.output_dense = None if c.tie_output else layers.Dense(c.tgt_vocab_size, dtype=policy)
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


PEER = (
    "Keras built-in layers (keras.layers.MultiHeadAttention, Dense, LayerNormalization, "
    "Embedding), XLA-compiled like ours"
)
LABELS = {
    "ours": "ours (fused attention)",
    "ours_attention": "ours (explicit, attention maps out)",
    "peer": "peer (keras.layers.MultiHeadAttention)",
}


def measure(
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Callable[[str], None] | None = None,
    *,
    device: str = "cpu",
    precision: str = "highest",
) -> dict:
    """Median forward times of ours, ours with attention maps, the peer and the matmul, in one run.

    The contract of every bench module: see benchmarks/suite.py. Any config runs (the sizes and
    vocabularies are the config's); every contender is one XLA program on `device` ("cpu",
    "gpu:0") at `precision` (a bench name: highest, tf32, bf16).
    """
    dtype, mode = bench_setting(precision)
    src_np, tgt_np = ragged_batch(config, batch, src_len, tgt_len, seed=0)

    with tf.device(tf_device(device)), matmul_precision(mode):
        src, tgt_in = tf.constant(src_np), tf.constant(tgt_np)
        model = get_backend("tf").build(
            config, init_weights(config, seed=0), dtype=dtype, device=device, precision=mode
        )
        ours = model.module
        peer = PeerTransformer(config, dtype=dtype)
        n = matmul_size(device, dtype)
        a = tf.cast(tf.random.normal((n, n)), dtype)
        b = tf.cast(tf.random.normal((n, n)), dtype)

        # Every contender is one XLA program; each ends by reading one element back, which
        # blocks until the whole result exists.
        def compiled(fn):
            fn = tf.function(fn, jit_compile=True)
            return lambda: fn(src, tgt_in)[0, 0, 0].numpy()

        fused = compiled(lambda s, t: ours(s, t, training=False)["logits"])
        explicit_fn = tf.function(
            lambda s, t: ours(s, t, training=False, return_attention=True), jit_compile=True
        )
        matmul_fn = tf.function(lambda: tf.matmul(a, b), jit_compile=True)
        contenders = {
            "ours": fused,
            "ours_attention": lambda: explicit_fn(src, tgt_in)["logits"][0, 0, 0].numpy(),
            "peer": compiled(lambda s, t: peer(s, t)),
            "matmul": lambda: matmul_fn()[0, 0].numpy(),
        }
        times = alternate("tf", contenders, repeats, WARMUP, progress)

    return summarise(
        framework="tf",
        version=f"keras {keras.__version__} / tensorflow {tf.__version__}",
        peer=PEER,
        labels=LABELS,
        times=times,
        config=config,
        batch=batch,
        src_len=src_len,
        tgt_len=tgt_len,
        repeats=repeats,
        device=device,
        precision=precision,
        matmul_n=matmul_size(device, dtype),
        workload={"compiler": "XLA (jit_compile=True)"},
    )


def main(argv: list[str] | None = None) -> int:
    module_main("tf", measure, argv, default_repeats=7, description=__doc__.split("\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
