"""`rosetta bench`: the forward benchmarks of the three implementations behind one interface.

Each framework's module (benchmarks/bench_<framework>_impl_forward.py) exposes

    measure(config, batch, src_len, tgt_len, repeats, progress, *, device, precision) -> dict

which times, in alternation and in one run, four contenders on one device and at one precision
(harness.PRECISION_HELP): ours without attention outputs (the fused kernel), ours returning every
attention map, the framework's named peer built from its own stock layers, and an n x n matmul
standing for that device's ceiling at that precision (n = harness.matmul_size: 2048 on a CPU,
1024 for bfloat16 there, 8192 on a GPU). Each is `harness.measure` with the framework's
`harness.ForwardHook`: before timing, the peer must give our logits on the same weights and
inputs, or the framework gets no ratio (`harness.PeerRefused`, with the reason). `run_bench` runs
the requested frameworks one after another (never at once: they would share the cores) and
`format_bench` prints the medians, the ratio to the peer against the 1.15 target, TFLOP/s as a
fraction of the matmul ceiling, and the logit gap to the peer against its bound.

This module imports no deep-learning framework: each bench module is imported only when its
framework runs, so that `rosetta --help` and the other commands stay fast.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformer_rosetta.app.cli.args import repeats_int
from transformer_rosetta.benchmarks.harness import (
    BASE_WORKLOAD,
    CONTENDERS,
    TARGET,
    PeerDiffers,
    PeerRefused,
    Progress,
    add_device_arguments,
    base_benchmark_config,
    dump,
    parser,
    plan_devices,
    precision_setting,
    silent,
    to_stderr,
)
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.spec.config import TransformerConfig

BENCH_FRAMEWORKS = ("torch", "tf", "jax")
MODULES = {
    name: f"transformer_rosetta.benchmarks.bench_{name}_impl_forward" for name in BENCH_FRAMEWORKS
}


def under(
    context: Callable[[], contextlib.AbstractContextManager], fn: Callable[[], object]
) -> Callable[[], object]:
    """`fn` run inside a fresh `context()` at every call: a contender under its framework's
    matmul_precision, when contenders of several frameworks alternate in one loop."""

    def run() -> object:
        with context():
            return fn()

    return run


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
    measure()'s dict}, "skipped": {framework: reason}, "peer_differs": [framework, ...],
    "target": 1.15, "precision", "dtype", "matmul_precision"}. A framework is skipped, with the
    reason, when it cannot run here, does not see the device, has no forward benchmark (the NumPy
    oracle has no peer), or has no ratio because its peer does not compute our function
    (harness.PeerRefused); "peer_differs" names those whose peer was built but whose logits were
    not ours (harness.PeerDiffers, a failed check: `rosetta bench` exits 1).
    """
    say = progress or silent
    wanted = list(dict.fromkeys(frameworks))  # keep the order, drop repeats
    devices, skipped = plan_devices([n for n in wanted if n in MODULES], device)
    for name in wanted:
        if name not in MODULES:
            skipped[name] = (
                "no forward benchmark (only torch, tf and jax have a peer to time against)"
            )
    results: dict[str, dict[str, Any]] = {}
    differs: list[str] = []
    for name in wanted:
        if name in skipped:
            say(f"{name}: skipped ({skipped[name]})")
            continue
        say(f"{name}: building ours, the peer and the matmul on {devices[name]}")
        module = importlib.import_module(MODULES[name])
        try:
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
        except PeerRefused as refused:  # no ratio for this one; the others still run
            skipped[name] = str(refused)
            say(f"{name}: skipped ({refused})")
            if isinstance(refused, PeerDiffers):
                differs.append(name)
    skipped = {name: skipped[name] for name in wanted if name in skipped}
    return {
        "results": results,
        "skipped": skipped,
        "peer_differs": differs,
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
                f"{r['max_abs_logit_gap_vs_peer']:.2e} (bound {r['logit_gap_bound']:.1e})"
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

    The standard workload (harness.base_benchmark_config(), batch 8, 128/128); progress on stderr
    unless --json. Bad arguments, or a device the framework does not see, end the process with
    one line on stderr and exit 2, before anything is built; a peer that does not give our
    logits (harness.PeerRefused) with one line and exit 1, before anything is timed.
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
    try:
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
    except PeerRefused as refused:
        to_stderr(f"{prog}: error: {refused}")
        raise SystemExit(1) from None
    if args.json:
        print(dump(result))
    else:
        print(format_bench({"results": {framework: result}, "skipped": {}}))
    return result
