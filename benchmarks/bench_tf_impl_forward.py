"""Forward speed of tf_impl against a peer built from stock Keras layers, both XLA-compiled.

`measure()` (the interface of benchmarks/suite.py, behind `rosetta bench`) takes any config and
workload; `main()` runs the issues' one: the base model with a 32000-token vocabulary, batch 8,
source and target length 128 with ragged padding. Always float32, eval mode, on the CPU.
Contenders, timed in alternation:
- ours, fused attention (keras.ops.dot_product_attention), no attention maps returned;
- ours, explicit attention, returning every probability map;
- the peer: the same post-norm encoder-decoder assembled from keras.layers.MultiHeadAttention,
  Dense, LayerNormalization and Embedding, with the same masks and tied embeddings;
- a 2048 x 2048 float32 matmul, the machine's ceiling in this framework.

    python -m benchmarks.bench_tf_impl_forward [--repeats N] [--json]
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

from benchmarks.suite import MATMUL_N, alternate, module_main, summarise  # noqa: E402
from common.spec.config import TransformerConfig  # noqa: E402
from common.spec.inputs import ragged_batch  # noqa: E402
from common.weights.init import init_weights  # noqa: E402
from tf_impl.model import decoder_self_mask, key_padding_mask, sinusoidal_positions  # noqa: E402
from tf_impl.weights import load_canonical, new_model  # noqa: E402

WARMUP = 2


class PeerEncoderLayer(layers.Layer):
    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        eps = c.layer_norm_eps
        self.attention = layers.MultiHeadAttention(c.num_heads, c.head_dim)
        self.attention_norm = layers.LayerNormalization(epsilon=eps)
        self.intermediate = layers.Dense(c.d_ff, activation="relu")
        self.output_dense = layers.Dense(c.d_model)
        self.feed_forward_norm = layers.LayerNormalization(epsilon=eps)

    def call(self, x, mask):
        x = self.attention_norm(x + self.attention(x, x, attention_mask=mask))
        return self.feed_forward_norm(x + self.output_dense(self.intermediate(x)))


class PeerDecoderLayer(layers.Layer):
    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        eps = c.layer_norm_eps
        self.self_attention = layers.MultiHeadAttention(c.num_heads, c.head_dim)
        self.self_attention_norm = layers.LayerNormalization(epsilon=eps)
        self.cross_attention = layers.MultiHeadAttention(c.num_heads, c.head_dim)
        self.cross_attention_norm = layers.LayerNormalization(epsilon=eps)
        self.intermediate = layers.Dense(c.d_ff, activation="relu")
        self.output_dense = layers.Dense(c.d_model)
        self.feed_forward_norm = layers.LayerNormalization(epsilon=eps)

    def call(self, x, memory, self_mask, memory_mask):
        x = self.self_attention_norm(x + self.self_attention(x, x, attention_mask=self_mask))
        x = self.cross_attention_norm(
            x + self.cross_attention(x, memory, attention_mask=memory_mask)
        )
        return self.feed_forward_norm(x + self.output_dense(self.intermediate(x)))


class PeerTransformer(keras.Model):
    """The base Transformer from stock Keras layers (post-norm; embeddings shared and tied as the
    config says, as in the paper by default)."""

    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        self.c = c
        self.embedding = layers.Embedding(c.src_vocab_size, c.d_model)
        # The paper shares one table and ties the output to it (section 3.4); a config that does
        # not gets its own target table and output Dense, so that any config's vocabularies run.
        self.tgt_embedding = (
            None if c.share_embeddings else layers.Embedding(c.tgt_vocab_size, c.d_model)
        )
        self.output_dense = None if c.tie_output else layers.Dense(c.tgt_vocab_size)
        self.encoder_layers = [PeerEncoderLayer(c) for _ in range(c.num_encoder_layers)]
        self.decoder_layers = [PeerDecoderLayer(c) for _ in range(c.num_decoder_layers)]

    def embed(self, table, ids):
        length = ids.shape[1]
        positions = sinusoidal_positions(length, self.c.d_model, self.c.sinusoid_layout, "float32")
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
        return ops.matmul(y, ops.transpose(tgt_table.embeddings))


PEER = (
    "Keras built-in layers (keras.layers.MultiHeadAttention, Dense, LayerNormalization, "
    "Embedding), XLA-compiled like ours"
)
LABELS = {
    "ours": "ours (fused attention)",
    "ours_attention": "ours (explicit, attention maps out)",
    "peer": "peer (keras.layers.MultiHeadAttention)",
    "matmul": f"matmul {MATMUL_N}x{MATMUL_N} float32",
}


def measure(
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Median forward times of ours, ours with attention maps, the peer and the matmul, in one run.

    The contract of every bench module: see benchmarks/suite.py. Any config runs (the sizes and
    vocabularies are the config's); every contender is one XLA program on the CPU.
    """
    src_np, tgt_np = ragged_batch(config, batch, src_len, tgt_len, seed=0)

    with tf.device("/CPU:0"):
        src, tgt_in = tf.constant(src_np), tf.constant(tgt_np)
        ours = new_model(config, "float32")
        load_canonical(ours, init_weights(config, seed=0, dtype="float32"))
        peer = PeerTransformer(config)
        a = tf.random.normal((MATMUL_N, MATMUL_N))
        b = tf.random.normal((MATMUL_N, MATMUL_N))

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
        workload={"compiler": "XLA (jit_compile=True)"},
    )


def main(argv: list[str] | None = None) -> int:
    module_main("tf", measure, argv, default_repeats=7, description=__doc__.split("\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
