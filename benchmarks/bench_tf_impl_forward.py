"""Forward speed of tf_impl against a peer built from stock Keras layers, both XLA-compiled.

Workload: the base model with a 32000-token vocabulary, batch 8, source and target length 128
with ragged padding, float32, eval mode, on the CPU. Contenders, timed in alternation:
- ours, fused attention (keras.ops.dot_product_attention), no attention maps returned;
- ours, explicit attention, returning every probability map;
- the peer: the same post-norm encoder-decoder assembled from keras.layers.MultiHeadAttention,
  Dense, LayerNormalization and Embedding, with the same masks and tied embeddings;
- a 2048 x 2048 float32 matmul, the machine's ceiling in this framework.

    python -m benchmarks.bench_tf_impl_forward [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers, ops  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    BASE_WORKLOAD,
    base_benchmark_config,
    forward_flops,
    matmul_flops,
    report_line,
    time_side_by_side,
)
from common.config import TransformerConfig  # noqa: E402
from common.init import init_weights  # noqa: E402
from common.inputs import ragged_batch  # noqa: E402
from tf_impl.model import decoder_self_mask, padding_mask, sinusoidal_positions  # noqa: E402
from tf_impl.weights import load_canonical, new_model  # noqa: E402

MATMUL_N = 2048


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
    """The base Transformer from stock Keras layers (post-norm, shared and tied embeddings)."""

    def __init__(self, c: TransformerConfig, **kwargs) -> None:
        super().__init__(**kwargs)
        self.c = c
        self.embedding = layers.Embedding(c.src_vocab_size, c.d_model)
        self.encoder_layers = [PeerEncoderLayer(c) for _ in range(c.num_encoder_layers)]
        self.decoder_layers = [PeerDecoderLayer(c) for _ in range(c.num_decoder_layers)]

    def embed(self, ids):
        length = ids.shape[1]
        positions = sinusoidal_positions(length, self.c.d_model, self.c.sinusoid_layout, "float32")
        return self.embedding(ids) * math.sqrt(self.c.d_model) + positions[None]

    def call(self, src, tgt_in):
        # Keras MHA takes [B, T, S] masks (True = attend): the same masks as ours, broadcast.
        batch, s, t = src.shape[0], src.shape[1], tgt_in.shape[1]
        src_mask = padding_mask(src, self.c.pad_id)[:, 0]  # (B, 1, S)
        encoder_mask = ops.broadcast_to(src_mask, (batch, s, s))
        memory_mask = ops.broadcast_to(src_mask, (batch, t, s))
        self_mask = decoder_self_mask(tgt_in, self.c.pad_id)[:, 0]  # (B, T, T)
        x = self.embed(src)
        for layer in self.encoder_layers:
            x = layer(x, encoder_mask)
        memory, y = x, self.embed(tgt_in)
        for layer in self.decoder_layers:
            y = layer(y, memory, self_mask, memory_mask)
        return ops.matmul(y, ops.transpose(self.embedding.embeddings))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    config = base_benchmark_config()
    batch, src_len, tgt_len = (
        BASE_WORKLOAD["batch"],
        BASE_WORKLOAD["src_len"],
        BASE_WORKLOAD["tgt_len"],
    )
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
            "ours (fused attention)": fused,
            "ours (explicit, attention maps out)": lambda: explicit_fn(src, tgt_in)["logits"][
                0, 0, 0
            ].numpy(),
            "peer (keras.layers.MultiHeadAttention)": compiled(lambda s, t: peer(s, t)),
            f"matmul {MATMUL_N}x{MATMUL_N} float32": lambda: matmul_fn()[0, 0].numpy(),
        }
        times = time_side_by_side(contenders, repeats=args.repeats, progress=not args.json)

    flops = forward_flops(config, batch, src_len, tgt_len)
    names = list(contenders)
    ceiling = matmul_flops(MATMUL_N) / times[names[3]] / 1e9
    ratio = times[names[0]] / times[names[2]]
    result = {
        "device": "cpu",
        "workload": {**BASE_WORKLOAD, "dtype": "float32", "vocab": config.tgt_vocab_size},
        "median_seconds": times,
        "forward_gflop": flops / 1e9,
        "matmul_gflops": ceiling,
        "ratio_ours_over_peer": ratio,
        "ratio_explicit_over_peer": times[names[1]] / times[names[2]],
        "versions": {"keras": keras.__version__, "tensorflow": tf.__version__},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"base config, vocab {config.tgt_vocab_size}, batch {batch}, src/tgt {src_len}/{tgt_len} "
        f"ragged, float32, CPU, XLA (keras {keras.__version__}, tensorflow {tf.__version__})"
    )
    for name in names[:3]:
        print(report_line(name, times[name], flops, ceiling))
    print(f"{names[3]:<40s} {times[names[3]] * 1e3:9.1f} ms  {ceiling:8.1f} GFLOP/s  (ceiling)")
    print(f"ratio ours/peer (fused):    {ratio:.3f}  (target <= 1.15)")
    print(f"ratio ours/peer (explicit): {result['ratio_explicit_over_peer']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
