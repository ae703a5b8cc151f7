"""Side-by-side timing shared by every benchmark: alternate the contenders, repeat, take medians.

Alternating (A, B, A, B, ...) rather than timing A then B means that a slow phase of the machine
(another process, thermal state) hits both alike, so the ratio stays honest on a busy machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from common.spec.config import TransformerConfig


def time_side_by_side(
    contenders: dict[str, Callable[[], object]],
    repeats: int = 7,
    warmup: int = 2,
    progress: bool = True,
) -> dict[str, float]:
    """Median wall time in seconds of each zero-argument callable, timed in alternation.

    Each callable must block until its result is ready (call .block_until_ready(), .numpy(), ...).
    """
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        if progress:
            print(f"\r  repeat {r + 1}/{repeats}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return {name: statistics.median(times) for name, times in samples.items()}


def matmul_flops(n: int) -> float:
    """FLOPs of an n x n @ n x n matmul (multiply and add counted separately)."""
    return 2.0 * n**3


def forward_flops(c: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one forward pass (projections, attention scores and mixing, FFN, logits).

    Elementwise work (softmax, LayerNorm, activations) is left out: it is a few percent here.
    """
    d, f, v = c.d_model, c.d_ff, c.tgt_vocab_size
    s, t = src_len, tgt_len

    def attention(q_len: int, kv_len: int) -> float:
        projections = 2 * q_len * d * d * 2 + 2 * kv_len * d * d * 2  # q, out; k, v
        mixing = 2 * q_len * kv_len * d * 2  # scores and probs @ v
        return projections + mixing

    ffn = lambda n: 2 * n * d * f * 2  # noqa: E731
    encoder = c.num_encoder_layers * (attention(s, s) + ffn(s))
    decoder = c.num_decoder_layers * (attention(t, t) + attention(t, s) + ffn(t))
    logits = 2 * t * d * v
    return float(batch * (encoder + decoder + logits))


def report_line(label: str, seconds: float, flops: float, ceiling_gflops: float) -> str:
    gflops = flops / seconds / 1e9
    return (
        f"{label:<40s} {seconds * 1e3:9.1f} ms  {gflops:8.1f} GFLOP/s  "
        f"{100 * gflops / ceiling_gflops:5.1f}% of matmul"
    )


BASE_WORKLOAD = dict(batch=8, src_len=128, tgt_len=128)


def base_benchmark_config() -> TransformerConfig:
    """The issues' workload: the base model with a 32000-token vocabulary, no dropout (eval)."""
    return TransformerConfig(src_vocab_size=32000, tgt_vocab_size=32000, dropout=0.0)
