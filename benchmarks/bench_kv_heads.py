"""Grouped-query attention against full multi-head attention in cached decoding, at one model size.

    .venv/bin/python -m transformer_rosetta.benchmarks.bench_kv_heads [--frameworks torch tf jax]
        [--kv-heads 8 2 1] [--size bench|tiny] [--batch 8] [--prompt-len 64] [--new-tokens 64] [--repeats 3]
        [--device D] [--precision P] [--json]

One Llama-style decoder-only model (the `tiny_llama` preset's parts: rotary positions, RMSNorm,
SwiGLU, no biases) at a size where the cache matters: d_model 512, 8 query heads of 64, 8 layers,
d_ff 1536, a 32000-token vocabulary. Only `num_kv_heads` changes between the contenders: 8 is the
paper's multi-head attention (the peer), 2 grouped-query attention (4 query heads per key/value
head, Ainslie et al. 2023), 1 multi-query attention (Shazeer 2019). For each framework, greedy
decoding (common/decoding/search.py) of `batch` prompts of `prompt_len` tokens for exactly
`new_tokens` new tokens each, through the framework's decode.py cache, timed side by side in one
run (harness.time_side_by_side: warm-up, then the contenders in turn, medians).

It reports, for each key/value head count:
- new tokens per second (batch * new_tokens / median time) and the ratio to multi-head;
- cache bytes per token: the bytes of the self-attention key and value buffers that the
  framework's stepper holds (`stepper.cache`, read after the prefill), over rows * positions.
  It is measured, not computed: a cache that kept num_heads heads would show it. The spec's
  value is 2 (keys and values) * layers * num_kv_heads * d_k * bytes per element;
- the parameter count, since fewer key/value heads also means smaller key and value kernels.

Random weights ("paper" scheme), on --device (default auto) at --precision (harness.PRECISION_HELP).
On a CPU a step is dominated by the weights (the 32000-row output projection and the
feed-forwards), not the cache, so the speed-up there is small; it grows with the prefix length,
the batch and on memory-bound accelerators.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.cli.args import positive_int, repeats_int
from transformer_rosetta.benchmarks.harness import (
    add_device_arguments,
    cli_main,
    device_name,
    dump,
    framework_precision,
    parser,
    plan_devices,
    precision_setting,
    time_side_by_side,
)
from transformer_rosetta.decoding.search import greedy_search
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.names import parameter_count
from transformer_rosetta.spec.precision import bench_setting
from transformer_rosetta.weights.init import init_weights

FRAMEWORKS = ("torch", "tf", "jax")
KV_HEADS = (8, 2, 1)
CACHE_FIELDS = ("self_key", "self_value")


def llama_config(kv_heads: int, max_len: int, size: str = "bench") -> TransformerConfig:
    """The benchmark's model (module docstring) with `kv_heads` key/value heads; size "tiny" is
    the tiny_llama preset's (8 query heads of 4, two layers), for a quick check of the command."""
    if size == "tiny":
        return preset("tiny_llama").replace(num_heads=8, num_kv_heads=kv_heads, max_len=max_len)
    return preset("tiny_llama").replace(
        src_vocab_size=32000,
        tgt_vocab_size=32000,
        d_model=512,
        num_heads=8,
        num_kv_heads=kv_heads,
        d_ff=1536,
        num_decoder_layers=8,
        max_len=max_len,
    )


def prompts(c: TransformerConfig, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """(batch, length) prompt ids without special tokens."""
    rng = np.random.default_rng(seed)
    ordinary = np.setdiff1d(np.arange(c.tgt_vocab_size), [c.pad_id, c.bos_id, c.eos_id])
    return rng.choice(ordinary, size=(batch, length)).astype(np.int64)


def _arrays(tree: Any, field: str | None = None) -> list[tuple[str | None, Any]]:
    """(field name, array) for every array in a stepper's cache: torch's dataclasses, Keras's and
    JAX's nested dicts and lists alike."""
    if isinstance(tree, dict):
        return [pair for key, value in tree.items() for pair in _arrays(value, str(key))]
    if isinstance(tree, (list, tuple)):
        return [pair for value in tree for pair in _arrays(value, field)]
    if hasattr(tree, "__dataclass_fields__"):
        return [
            pair for key in tree.__dataclass_fields__ for pair in _arrays(getattr(tree, key), key)
        ]
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return [(field, tree)]
    return []


def cache_bytes_per_token(stepper: Any, rows: int, positions: int) -> float:
    """The self-attention key and value buffers' bytes, per row and position (module docstring):
    a decoder-only stepper's buffers hold `positions` = the prompt's P - 1 prefilled positions
    and its max_steps more."""
    total = 0
    for field, array in _arrays(stepper.cache):
        if field in CACHE_FIELDS:
            total += int(np.prod(array.shape)) * _itemsize(array)
    return total / (rows * positions)


def _itemsize(array: Any) -> int:
    """Bytes per element of a torch, TensorFlow, JAX or NumPy array (bfloat16 included)."""
    if hasattr(array, "element_size"):  # torch
        return int(array.element_size())
    size = getattr(array.dtype, "itemsize", None)  # numpy, jax
    return int(size if size is not None else array.dtype.size)  # tf.DType.size


def measure(
    framework: str,
    kv_heads: Sequence[int],
    size: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    *,
    device: str = "cpu",
    precision: str = "highest",
) -> dict[str, Any]:
    """Median seconds, tokens/s, the ratio to multi-head and the cache bytes per token of each
    key/value head count, for one framework on `device` at `precision` (a bench name)."""
    dtype, mode = bench_setting(precision)
    max_steps = prompt_len + new_tokens
    configs = {g: llama_config(g, max_steps, size) for g in kv_heads}
    ids = prompts(configs[kv_heads[0]], batch, prompt_len)
    backend = get_backend(framework)
    models = {
        g: backend.build(
            c, init_weights(c, seed=0, scheme="paper"), dtype=dtype, device=device, precision=mode
        )
        for g, c in configs.items()
    }
    runs = {
        f"kv{g}": partial(
            greedy_search,
            partial(models[g].stepper, cached=True),
            configs[g],
            ids,
            extra_len=new_tokens,
            stop_at_eos=False,
        )
        for g in kv_heads
    }
    with framework_precision(framework, mode):
        decoded = {name: run() for name, run in runs.items()}
        seconds = time_side_by_side(runs, repeats=repeats, warmup=1, progress=sys.stderr.isatty())
        cache = {
            g: cache_bytes_per_token(
                models[g].stepper(ids, 1, new_tokens), batch, prompt_len - 1 + new_tokens
            )
            for g in kv_heads
        }
    for name, out in decoded.items():
        assert all(len(t) == new_tokens for t in out.tokens), f"{name} stopped early"
    per_s = {name: batch * new_tokens / s for name, s in seconds.items()}
    peer = f"kv{max(kv_heads)}"
    c = configs[kv_heads[0]]
    return {
        "framework": framework,
        "version": backend.version(),
        "device": device,
        "device_name": device_name(framework, device),
        **precision_setting(precision),
        "median_s": seconds,
        "tokens_per_s": per_s,
        "ratio_to_multi_head": {name: v / per_s[peer] for name, v in per_s.items()},
        "cache_bytes_per_token": {f"kv{g}": v for g, v in cache.items()},
        "spec_cache_bytes_per_token": {
            f"kv{g}": 2 * c.num_decoder_layers * g * c.head_dim * (2 if dtype == "bfloat16" else 4)
            for g in kv_heads
        },
        "parameters": {f"kv{g}": parameter_count(configs[g]) for g in kv_heads},
        "workload": {
            "batch": batch,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "d_model": c.d_model,
            "num_heads": c.num_heads,
            "layers": c.num_decoder_layers,
            "vocab": c.tgt_vocab_size,
        },
    }


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"{r['framework']:<6} {r['version']:<22} {r['device']} ({r['device_name']}), {r['precision']}:"
    ]
    for name, per_s in r["tokens_per_s"].items():
        lines.append(
            f"  {name:<5} {per_s:9,.0f} tok/s ({r['median_s'][name]:6.2f} s)"
            f"  x{r['ratio_to_multi_head'][name]:.2f} of multi-head"
            f"  cache {r['cache_bytes_per_token'][name]:8,.0f} B/token"
            f" (spec {r['spec_cache_bytes_per_token'][name]:,})"
            f"  {r['parameters'][name] / 1e6:.1f}M parameters"
        )
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    """Parse, resolve the devices (before any model is built), decode and print."""
    p = parser("python -m transformer_rosetta.benchmarks.bench_kv_heads", __doc__)
    p.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--kv-heads", nargs="+", type=positive_int, default=list(KV_HEADS))
    p.add_argument(
        "--size",
        choices=("bench", "tiny"),
        default="bench",
        help="bench: d_model 512, 8 layers, 32000 tokens (default); tiny: tiny_llama's sizes",
    )
    p.add_argument("--batch", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=repeats_int, default=3)
    add_device_arguments(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(None if argv is None else list(argv))
    bad = [g for g in args.kv_heads if 8 % g]
    if bad:
        p.error(f"--kv-heads: {bad[0]} does not divide the 8 query heads; use 8, 4, 2 or 1")
    kv_heads = sorted(set(args.kv_heads), reverse=True)
    devices, skipped = plan_devices(args.frameworks, args.device)
    results = []
    for framework, device in devices.items():
        print(f"{framework}: decoding on {device} ...", file=sys.stderr, flush=True)
        results.append(
            measure(
                framework,
                kv_heads,
                args.size,
                args.batch,
                args.prompt_len,
                args.new_tokens,
                args.repeats,
                device=device,
                precision=args.precision,
            )
        )
        if not args.json:
            print(format_result(results[-1]), flush=True)
    if args.json:
        print(dump({"results": results, "skipped": skipped}))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}", file=sys.stderr)
    wrong = [
        (r["framework"], name)
        for r in results
        for name, got in r["cache_bytes_per_token"].items()
        if got != r["spec_cache_bytes_per_token"][name]
    ]
    for framework, name in wrong:
        print(f"{framework} {name}: the cache holds other than the spec's bytes", file=sys.stderr)
    return 1 if wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main("python -m transformer_rosetta.benchmarks.bench_kv_heads", lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
