"""`rosetta bench`: the forward benchmarks of the three implementations behind one interface.

Each framework's module (benchmarks/bench_<framework>_impl_forward.py) exposes

    measure(config, batch, src_len, tgt_len, repeats, progress) -> dict

which times, in alternation and in one run, four contenders: ours without attention outputs (the
fused kernel), ours returning every attention map, the framework's named peer built from its own
stock layers, and a 2048 x 2048 float32 matmul standing for the machine's ceiling. `run_bench`
runs the requested frameworks one after another (never at once: they would share the cores) and
`format_bench` prints the medians, the ratio to the peer against the 1.15 target, and GFLOP/s as a
fraction of the matmul ceiling.

This module imports no deep-learning framework: each bench module is imported only when its
framework runs, so that `rosetta --help` and the other commands stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.harness import (
    BASE_WORKLOAD,
    base_benchmark_config,
    forward_flops,
    matmul_flops,
    time_side_by_side,
)
from common.adapter.backends import unavailable_reason
from common.spec.config import TransformerConfig

Progress = Callable[[str], None]

# The issues' target: our forward without attention outputs takes at most 1.15x the peer's time.
TARGET = 1.15
MATMUL_N = 2048  # the ceiling's matmul: big enough to reach the BLAS peak on a CPU
BENCH_FRAMEWORKS = ("torch", "tf", "jax")
CONTENDERS = ("ours", "ours_attention", "peer", "matmul")
MODULES = {name: f"benchmarks.bench_{name}_impl_forward" for name in BENCH_FRAMEWORKS}


def _silent(message: str) -> None:
    """The default progress sink: say nothing."""


def alternate(
    framework: str,
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    progress: Progress | None,
) -> dict[str, float]:
    """Median seconds per contender, timed A B C D, A B C D, ... as `harness.time_side_by_side`.

    The harness is called once per round (warm-up only in the first) so that each finished round
    can be reported through `progress`; the sequence of calls, and so the samples, are the ones a
    single `time_side_by_side(contenders, repeats, warmup)` call would take.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or _silent
    say(f"{framework}: warm-up ({warmup} round(s), includes compilation)")
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeats):
        round_times = time_side_by_side(
            dict(contenders), repeats=1, warmup=warmup if r == 0 else 0, progress=False
        )
        for name, seconds in round_times.items():
            samples[name].append(seconds)
        say(f"{framework}: repeat {r + 1}/{repeats}")
    return {name: statistics.median(times) for name, times in samples.items()}


def summarise(
    *,
    framework: str,
    version: str,
    peer: str,
    labels: Mapping[str, str],
    times: Mapping[str, float],
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    workload: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The result dict every bench module returns, from the four medians (keys: CONTENDERS)."""
    flop = forward_flops(config, batch, src_len, tgt_len)
    gflops = {name: flop / times[name] / 1e9 for name in ("ours", "ours_attention", "peer")}
    gflops["matmul"] = matmul_flops(MATMUL_N) / times["matmul"] / 1e9
    ratio = times["ours"] / times["peer"]
    return {
        "framework": framework,
        "version": version,
        "peer": peer,
        "contenders": dict(labels),
        "median_s": {name: float(times[name]) for name in CONTENDERS},
        "ratio": ratio,
        "ratio_attention": times["ours_attention"] / times["peer"],
        "target": TARGET,
        "target_met": ratio <= TARGET,
        "forward_gflop": flop / 1e9,
        "gflops": gflops,
        "fraction_of_matmul": {name: g / gflops["matmul"] for name, g in gflops.items()},
        "workload": {
            "batch": batch,
            "src_len": src_len,
            "tgt_len": tgt_len,
            "src_vocab": config.src_vocab_size,
            "tgt_vocab": config.tgt_vocab_size,
            "d_model": config.d_model,
            "heads": config.num_heads,
            "d_ff": config.d_ff,
            "layers": [config.num_encoder_layers, config.num_decoder_layers],
            "dtype": "float32",
            "device": "cpu",
            "padding": "ragged",
            "repeats": repeats,
            "matmul_n": MATMUL_N,
            **(workload or {}),
        },
        **(extra or {}),
    }


def run_bench(
    frameworks: Sequence[str],
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Each requested framework's `measure()`, one after another; the unavailable ones skipped.

    Returns {"results": {framework: measure()'s dict}, "skipped": {framework: reason},
    "target": 1.15}. A framework is skipped, with the reason, when common.adapter.backends says it cannot
    run here, or when it has no forward benchmark (the NumPy oracle has no peer).
    """
    say = progress or _silent
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in dict.fromkeys(frameworks):  # keep the order, drop repeats
        reason = unavailable_reason(name)
        if reason is None and name not in MODULES:
            reason = "no forward benchmark (only torch, tf and jax have a peer to time against)"
        if reason is not None:
            skipped[name] = reason
            say(f"{name}: skipped ({reason})")
            continue
        say(f"{name}: building ours, the peer and the matmul")
        module = importlib.import_module(MODULES[name])
        results[name] = module.measure(config, batch, src_len, tgt_len, repeats, progress)
    return {"results": results, "skipped": skipped, "target": TARGET}


def format_bench(result: Mapping[str, Any]) -> str:
    """The human-readable report of `run_bench` (or of one measure() wrapped the same way)."""
    lines: list[str] = []
    results: Mapping[str, Mapping[str, Any]] = result["results"]
    if results:
        w = next(iter(results.values()))["workload"]
        lines.append(
            f"workload: batch {w['batch']}, src/tgt {w['src_len']}/{w['tgt_len']} ragged, "
            f"{w['dtype']}, {w['device']}; d_model {w['d_model']}, h {w['heads']}, "
            f"d_ff {w['d_ff']}, layers {w['layers'][0]}+{w['layers'][1]}, "
            f"vocab {w['src_vocab']}/{w['tgt_vocab']}; median of {w['repeats']}"
        )
    for name, r in results.items():
        lines.append("")
        lines.append(f"{name}: {r['version']}")
        lines.append(f"  peer: {r['peer']}")
        labels = r["contenders"]
        for key in CONTENDERS:
            ms = r["median_s"][key] * 1e3
            percent = 100 * r["fraction_of_matmul"][key]
            note = "(ceiling)" if key == "matmul" else f"{percent:5.1f}% of matmul"
            lines.append(
                f"  {labels[key]:<44s} {ms:10.2f} ms {r['gflops'][key]:9.2f} GFLOP/s  {note}"
            )
        verdict = "met" if r["target_met"] else "NOT met"
        lines.append(
            f"  ratio ours/peer {r['ratio']:.3f} (target <= {r['target']:.2f}: {verdict}); "
            f"with attention outputs {r['ratio_attention']:.3f}"
        )
        if r.get("max_abs_logit_gap_vs_peer") is not None:
            lines.append(
                f"  max |logits ours - peer| (rows with a source): "
                f"{r['max_abs_logit_gap_vs_peer']:.2e}"
            )
    for name, reason in result.get("skipped", {}).items():
        lines.append("")
        lines.append(f"{name}: skipped ({reason})")
    return "\n".join(lines).lstrip("\n")


def module_main(
    framework: str,
    measure: Callable[..., dict[str, Any]],
    argv: Sequence[str] | None,
    default_repeats: int,
    description: str,
) -> dict[str, Any]:
    """`python -m benchmarks.bench_<framework>_impl_forward [--repeats N] [--json]` for one module.

    The issues' workload (harness.base_benchmark_config(), batch 8, 128/128); progress on stderr
    unless --json.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(None if argv is None else list(argv))

    def to_stderr(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result = measure(
        base_benchmark_config(),
        BASE_WORKLOAD["batch"],
        BASE_WORKLOAD["src_len"],
        BASE_WORKLOAD["tgt_len"],
        args.repeats,
        None if args.json else to_stderr,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_bench({"results": {framework: result}, "skipped": {}}))
    return result
