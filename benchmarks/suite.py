"""`rosetta bench`: the forward benchmarks of the three implementations behind one interface.

Each framework's module (benchmarks/bench_<framework>_impl_forward.py) exposes

    measure(config, batch, src_len, tgt_len, repeats, progress, *, device, precision) -> dict

which times, in alternation and in one run, four contenders on one device and at one precision
(harness.PRECISION_HELP): ours without attention outputs (the fused kernel), ours returning every
attention map, the framework's named peer built from its own stock layers, and an n x n matmul
standing for that device's ceiling at that precision (n = harness.matmul_size: 2048 on a CPU,
1024 for bfloat16 there, 8192 on a GPU). `run_bench` runs the requested frameworks one after another (never at once: they
would share the cores) and `format_bench` prints the medians, the ratio to the peer against the
1.15 target, and TFLOP/s as a fraction of the matmul ceiling.

This module imports no deep-learning framework: each bench module is imported only when its
framework runs, so that `rosetta --help` and the other commands stay fast.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformer_rosetta.app.cli.args import repeats_int
from transformer_rosetta.benchmarks.harness import (
    BASE_WORKLOAD,
    add_device_arguments,
    base_benchmark_config,
    device_name,
    dump,
    forward_flops,
    matmul_flops,
    parser,
    plan_devices,
    precision_setting,
    time_side_by_side,
    to_stderr,
)
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.spec.config import TransformerConfig

Progress = Callable[[str], None]

# The issues' target: our forward without attention outputs takes at most 1.15x the peer's time.
TARGET = 1.15
BENCH_FRAMEWORKS = ("torch", "tf", "jax")
CONTENDERS = ("ours", "ours_attention", "peer", "matmul")
MODULES = {
    name: f"transformer_rosetta.benchmarks.bench_{name}_impl_forward" for name in BENCH_FRAMEWORKS
}


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


def under(
    context: Callable[[], contextlib.AbstractContextManager], fn: Callable[[], object]
) -> Callable[[], object]:
    """`fn` run inside a fresh `context()` at every call: a contender under its framework's
    matmul_precision, when contenders of several frameworks alternate in one loop."""

    def run() -> object:
        with context():
            return fn()

    return run


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
    device: str,
    precision: str,
    matmul_n: int,
    workload: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The result dict every bench module returns, from the four medians (keys: CONTENDERS).

    `labels` names ours, ours_attention and the peer; the matmul's label is made here. `device`
    is the framework's own name for it ("cuda:0", "gpu:0", "cpu"), `precision` a bench name,
    `matmul_n` the size of the ceiling's matmul (harness.matmul_size).
    """
    setting = precision_setting(precision)
    n = matmul_n
    flop = forward_flops(config, batch, src_len, tgt_len)
    flops = {name: flop / times[name] for name in ("ours", "ours_attention", "peer")}
    flops["matmul"] = matmul_flops(n) / times["matmul"]
    ratio = times["ours"] / times["peer"]
    return {
        "framework": framework,
        "version": version,
        "peer": peer,
        "device": device,
        "device_name": device_name(framework, device),
        **setting,
        "contenders": {**labels, "matmul": f"matmul {n}x{n} {setting['dtype']}"},
        "median_s": {name: float(times[name]) for name in CONTENDERS},
        "ratio": ratio,
        "ratio_attention": times["ours_attention"] / times["peer"],
        "target": TARGET,
        "target_met": ratio <= TARGET,
        "forward_gflop": flop / 1e9,
        "gflops": {name: f / 1e9 for name, f in flops.items()},
        "tflops": {name: f / 1e12 for name, f in flops.items()},
        "fraction_of_matmul": {name: f / flops["matmul"] for name, f in flops.items()},
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
            **setting,
            "device": device,
            "padding": "ragged",
            "repeats": repeats,
            "matmul_n": n,
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
    *,
    device: str = "auto",
    precision: str = "highest",
) -> dict[str, Any]:
    """Each requested framework's `measure()`, one after another; the unavailable ones skipped.

    `device` is a request (harness.DEVICE_HELP), resolved for every framework before any model
    is built: one that no framework sees raises UsageError. Returns {"results": {framework:
    measure()'s dict}, "skipped": {framework: reason}, "target": 1.15, "precision", "dtype",
    "matmul_precision"}. A framework is skipped, with the reason, when it cannot run here, does
    not see the device, or has no forward benchmark (the NumPy oracle has no peer).
    """
    say = progress or _silent
    wanted = list(dict.fromkeys(frameworks))  # keep the order, drop repeats
    devices, skipped = plan_devices([n for n in wanted if n in MODULES], device)
    for name in wanted:
        if name not in MODULES:
            skipped[name] = (
                "no forward benchmark (only torch, tf and jax have a peer to time against)"
            )
    results: dict[str, dict[str, Any]] = {}
    for name in wanted:
        if name in skipped:
            say(f"{name}: skipped ({skipped[name]})")
            continue
        say(f"{name}: building ours, the peer and the matmul on {devices[name]}")
        module = importlib.import_module(MODULES[name])
        results[name] = module.measure(
            config,
            batch,
            src_len,
            tgt_len,
            repeats,
            progress,
            device=devices[name],
            precision=precision,
        )
    skipped = {name: skipped[name] for name in wanted if name in skipped}
    return {
        "results": results,
        "skipped": skipped,
        "target": TARGET,
        **precision_setting(precision),
    }


def format_bench(result: Mapping[str, Any]) -> str:
    """The human-readable report of `run_bench` (or of one measure() wrapped the same way)."""
    lines: list[str] = []
    results: Mapping[str, Mapping[str, Any]] = result["results"]
    if results:
        w = next(iter(results.values()))["workload"]
        lines.append(
            f"workload: batch {w['batch']}, src/tgt {w['src_len']}/{w['tgt_len']} ragged, "
            f"{w['dtype']} (precision {w['precision']}); d_model {w['d_model']}, h {w['heads']}, "
            f"d_ff {w['d_ff']}, layers {w['layers'][0]}+{w['layers'][1]}, "
            f"vocab {w['src_vocab']}/{w['tgt_vocab']}; median of {w['repeats']}"
        )
    for name, r in results.items():
        lines.append("")
        lines.append(f"{name}: {r['version']} on {r['device']} ({r['device_name']})")
        lines.append(f"  peer: {r['peer']}")
        labels = r["contenders"]
        for key in CONTENDERS:
            ms = r["median_s"][key] * 1e3
            percent = 100 * r["fraction_of_matmul"][key]
            note = "(ceiling)" if key == "matmul" else f"{percent:5.1f}% of matmul"
            lines.append(
                f"  {labels[key]:<44s} {ms:10.3f} ms {r['tflops'][key]:9.3f} TFLOP/s "
                f"({r['gflops'][key]:9.1f} GFLOP/s)  {note}"
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
    """`python -m transformer_rosetta.benchmarks.bench_<framework>_impl_forward [--repeats N] [--device D]
    [--precision P] [--json]` for one module.

    The issues' workload (harness.base_benchmark_config(), batch 8, 128/128); progress on stderr
    unless --json. Bad arguments, or a device the framework does not see, end the process with
    one line on stderr and exit 2, before anything is built.
    """
    prog = f"python -m transformer_rosetta.benchmarks.bench_{framework}_impl_forward"
    p = parser(prog, description)
    p.add_argument("--repeats", type=repeats_int, default=default_repeats)
    add_device_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = p.parse_args(None if argv is None else list(argv))
        devices, skipped = plan_devices([framework], args.device)
        if framework not in devices:
            raise RosettaError(skipped[framework])
    except RosettaError as exc:
        to_stderr(f"{prog}: error: {exc}")
        raise SystemExit(2) from None
    result = measure(
        base_benchmark_config(),
        BASE_WORKLOAD["batch"],
        BASE_WORKLOAD["src_len"],
        BASE_WORKLOAD["tgt_len"],
        args.repeats,
        None if args.json else to_stderr,
        device=devices[framework],
        precision=args.precision,
    )
    if args.json:
        print(dump(result))
    else:
        print(format_bench({"results": {framework: result}, "skipped": {}}))
    return result
