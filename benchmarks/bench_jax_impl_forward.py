"""Forward-pass speed of jax_impl against a peer built from Flax's own layers, side by side.

Workload: the base model with a 32000-token vocabulary, batch 8, source and target length 128
with ragged padding, float32, CPU, eval mode, jitted. Contenders, timed in alternation:
- ours without attention outputs (jax.nn.dot_product_attention),
- ours with attention outputs (explicit probabilities, returned for every layer),
- the peer: the same post-norm encoder-decoder assembled from nnx.MultiHeadAttention,
  nnx.Linear, nnx.LayerNorm and nnx.Embed, with the same masks and the same weights,
- a 2048 x 2048 float32 matmul, the machine's ceiling for the GFLOP/s column.

    python -m benchmarks.bench_jax_impl_forward [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

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
from jax_impl.model import causal_mask, key_padding_mask, sinusoidal_positions  # noqa: E402
from jax_impl.weights import from_canonical, to_canonical  # noqa: E402

MATMUL_N = 2048


# -- the peer: Flax's own layers, wired as the paper's post-norm model ------------------------


class PeerEncoderLayer(nnx.Module):
    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs):
        norm = functools.partial(nnx.LayerNorm, c.d_model, epsilon=c.layer_norm_eps, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            c.num_heads, c.d_model, decode=False, deterministic=True, rngs=rngs
        )
        self.norm1, self.norm2 = norm(), norm()
        self.ff1 = nnx.Linear(c.d_model, c.d_ff, rngs=rngs)
        self.ff2 = nnx.Linear(c.d_ff, c.d_model, rngs=rngs)

    def __call__(self, x, mask):
        x = self.norm1(x + self.attention(x, mask=mask))
        return self.norm2(x + self.ff2(jax.nn.relu(self.ff1(x))))


class PeerDecoderLayer(nnx.Module):
    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs):
        norm = functools.partial(nnx.LayerNorm, c.d_model, epsilon=c.layer_norm_eps, rngs=rngs)
        mha = functools.partial(
            nnx.MultiHeadAttention,
            c.num_heads,
            c.d_model,
            decode=False,
            deterministic=True,
            rngs=rngs,
        )
        self.self_attention, self.cross_attention = mha(), mha()
        self.norm1, self.norm2, self.norm3 = norm(), norm(), norm()
        self.ff1 = nnx.Linear(c.d_model, c.d_ff, rngs=rngs)
        self.ff2 = nnx.Linear(c.d_ff, c.d_model, rngs=rngs)

    def __call__(self, x, memory, self_mask, memory_mask):
        x = self.norm1(x + self.self_attention(x, mask=self_mask))
        x = self.norm2(x + self.cross_attention(x, memory, memory, mask=memory_mask))
        return self.norm3(x + self.ff2(jax.nn.relu(self.ff1(x))))


class Peer(nnx.Module):
    """Shared embedding, tied output, sinusoidal positions: the paper's base model."""

    def __init__(self, c: TransformerConfig, rngs: nnx.Rngs):
        self.c = c
        self.embed = nnx.Embed(c.src_vocab_size, c.d_model, rngs=rngs)
        self.encoder = nnx.List([PeerEncoderLayer(c, rngs) for _ in range(c.num_encoder_layers)])
        self.decoder = nnx.List([PeerDecoderLayer(c, rngs) for _ in range(c.num_decoder_layers)])

    def _embed(self, ids):
        pe = sinusoidal_positions(ids.shape[1], self.c.d_model, "interleaved")
        return self.embed(ids) * self.c.d_model**0.5 + jnp.asarray(pe, jnp.float32)

    def __call__(self, src, tgt_in):
        src_mask = key_padding_mask(src, self.c.pad_id)
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        self_mask = key_padding_mask(tgt_in, self.c.pad_id).at[..., 0].set(True)
        self_mask = self_mask & causal_mask(tgt_in.shape[1])
        y = self._embed(tgt_in)
        for layer in self.decoder:
            y = layer(y, x, self_mask, src_mask)
        return self.embed.attend(y)


def peer_from_canonical(c: TransformerConfig, w: dict[str, np.ndarray]) -> Peer:
    """The peer holding our canonical weights, so that its logits can be checked against ours."""
    peer = Peer(c, nnx.Rngs(0))
    peer.embed.embedding[...] = w["shared_embedding"]
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
        if parts[0] not in ("encoder", "decoder"):
            continue
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
        getattr(node, rest[-1])[...] = jnp.asarray(value)
    return peer


def jitted(model: nnx.Module, src: jax.Array, tgt_in: jax.Array, **kwargs):
    """A zero-argument callable running `model` jitted (split once, merged inside the jit)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, src, tgt_in):
        return nnx.merge(graphdef, state)(src, tgt_in, **kwargs)

    return lambda: jax.block_until_ready(run(state, src, tgt_in))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    c = base_benchmark_config()
    b, s_len, t_len = BASE_WORKLOAD["batch"], BASE_WORKLOAD["src_len"], BASE_WORKLOAD["tgt_len"]
    src, tgt_in = ragged_batch(c, b, s_len, t_len, seed=0)
    src, tgt_in = jnp.asarray(src, jnp.int32), jnp.asarray(tgt_in, jnp.int32)

    weights = init_weights(c, seed=0, scheme="perturbed", dtype="float32")
    ours = from_canonical(c, weights, "float32")
    ours.eval()
    peer = peer_from_canonical(c, to_canonical(ours))

    fused = jitted(ours, src, tgt_in)
    explicit = jitted(ours, src, tgt_in, return_probs=True)
    peer_run = jitted(peer, src, tgt_in)
    a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N), jnp.float32)
    matmul = jax.jit(jnp.matmul)

    # The peer computes the same function, up to float32 summation order, except on the last row:
    # its source is all padding, where Flax's attention averages every value and ours gives 0.
    gap = float(jnp.max(jnp.abs(fused()["logits"][:-1] - peer_run()[:-1])))

    times = time_side_by_side(
        {
            "ours (fused attention)": fused,
            "ours (attention outputs)": explicit,
            "peer (nnx.MultiHeadAttention)": peer_run,
            "matmul 2048^2": lambda: matmul(a, a).block_until_ready(),
        },
        repeats=args.repeats,
        warmup=1,
        progress=not args.json,
    )
    ceiling = matmul_flops(MATMUL_N) / times["matmul 2048^2"] / 1e9
    flops = forward_flops(c, b, s_len, t_len)
    result = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "workload": {**BASE_WORKLOAD, "vocab": c.tgt_vocab_size, "dtype": "float32"},
        "median_s": times,
        "ratio_ours_over_peer": times["ours (fused attention)"]
        / times["peer (nnx.MultiHeadAttention)"],
        "ratio_with_attention_over_peer": times["ours (attention outputs)"]
        / times["peer (nnx.MultiHeadAttention)"],
        "matmul_gflops": ceiling,
        "forward_gflop": flops / 1e9,
        "max_abs_logit_gap_vs_peer": gap,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"jax {jax.__version__} on {result['device']}, base model, vocab 32000, batch {b},")
    print(f"src/tgt {s_len}/{t_len} ragged, float32, eval, jitted, median of {args.repeats}")
    for name, seconds in times.items():
        work = matmul_flops(MATMUL_N) if name.startswith("matmul") else flops
        print(report_line(name, seconds, work, ceiling))
    print(
        f"ratio ours/peer (fused):            {result['ratio_ours_over_peer']:.3f} (target <= 1.15)"
    )
    print(f"ratio ours/peer (attention outputs): {result['ratio_with_attention_over_peer']:.3f}")
    print(f"max |logits ours - peer| (rows with a source): {gap:.2e}")
    return result


if __name__ == "__main__":
    main()
