"""What every benchmark shares: side-by-side timing, FLOP counts, devices, precisions, the CLI.

Alternating (A, B, A, B, ...) rather than timing A then B means that a slow phase of the machine
(another process, thermal state) hits both alike, so the ratio stays honest on a busy machine.

Devices are asked for once, by one word for every framework (`--device`, DEVICE_HELP), and each
framework's own name for it is looked up here (`plan_devices`), before any model is built: a
device that no framework sees is bad input (exit 2), not a traceback minutes later.

`measure` is the forward benchmark of every framework, written once: each
benchmarks/bench_<framework>_impl_forward.py supplies only a `ForwardHook` (how its framework
builds ours, its peer and the matmul, and where they run). Before anything is timed, the peer
must give our logits on the same weights and inputs (`check_peer`): a ratio against a peer that
computes another function would measure nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from transformer_rosetta.adapter.backends import get_backend, unavailable_reason
from transformer_rosetta.app.cli.args import DEVICE_HELP as args_device_help
from transformer_rosetta.app.cli.args import device_arg  # noqa: F401  (the benchmarks' --device type)
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.precision import BENCH_PRECISIONS, bench_setting
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

Progress = Callable[[str], None]

# The target: our forward without attention outputs takes at most 1.15x the peer's time.
TARGET = 1.15
CONTENDERS = ("ours", "ours_attention", "peer", "matmul")


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


def silent(message: str) -> None:
    """The default progress sink: say nothing."""


def alternate(
    framework: str,
    contenders: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    progress: Progress | None,
) -> dict[str, float]:
    """Median seconds per contender, timed A B C D, A B C D, ... as `time_side_by_side`.

    The harness is called once per round (warm-up only in the first) so that each finished round
    can be reported through `progress`; the sequence of calls, and so the samples, are the ones a
    single `time_side_by_side(contenders, repeats, warmup)` call would take.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    say = progress or silent
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


def train_step_flops(c: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one training step: the forward pass and a backward pass of twice its cost
    (each product is differentiated against both of its operands). The Adam update is
    elementwise and left out, as forward_flops leaves out softmax and LayerNorm."""
    return 3.0 * forward_flops(c, batch, src_len, tgt_len)


def workload_sizes(c: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> dict[str, Any]:
    """The sizes every benchmark's JSON records of its workload: the batch, the lengths and the
    model's dimensions."""
    return {
        "batch": batch,
        "src_len": src_len,
        "tgt_len": tgt_len,
        "src_vocab": c.src_vocab_size,
        "tgt_vocab": c.tgt_vocab_size,
        "d_model": c.d_model,
        "heads": c.num_heads,
        "d_ff": c.d_ff,
        "layers": [c.num_encoder_layers, c.num_decoder_layers],
    }


def report_line(label: str, seconds: float, flops: float, ceiling_gflops: float) -> str:
    gflops = flops / seconds / 1e9
    return (
        f"{label:<40s} {seconds * 1e3:9.1f} ms  {gflops:8.1f} GFLOP/s  "
        f"{100 * gflops / ceiling_gflops:5.1f}% of matmul"
    )


BASE_WORKLOAD = dict(batch=8, src_len=128, tgt_len=128)


def base_benchmark_config() -> TransformerConfig:
    """The standard workload: the base model with a 32000-token vocabulary, no dropout (eval)."""
    return TransformerConfig(
        src_vocab_size=32000, tgt_vocab_size=32000, dropout=0.0, attention_dropout=0.0
    )


# -- devices ----------------------------------------------------------------------------------


def share_accelerators() -> None:
    """Let the frameworks of one benchmark run share a GPU. JAX takes 75% of the GPU's memory
    when its GPU backend starts and TensorFlow all of it, leaving torch (or each other) too
    little. Called by every benchmark's entry before any framework touches the GPU (both read
    these when their GPU backend starts, not when imported); a user's own setting wins."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")


# One --device vocabulary for every command (common/app/cli/args.py, common/app/parity.py).
DEVICE_HELP = args_device_help + (
    ". A framework that does not see the device asked for is skipped with the reason; none "
    "seeing it is an error"
)
# Checked only as the benchmarks need it: the Keras benchmarks compile with tf.function (XLA),
# which exists only on Keras's TensorFlow backend.
_BENCH_REQUIRES = {"tf": ("tensorflow",)}


def resolve_device(visible: Sequence[str], request: str) -> str | None:
    """A framework's own name for `request` among the devices it sees (its backend's devices()),
    or None when it does not see it: transformer_rosetta.app.parity.resolve_devices, for one device."""
    from transformer_rosetta.app.parity import resolve_devices

    found = resolve_devices("", visible, request)
    return found[0] if found else None


def bench_unavailable_reason(framework: str) -> str | None:
    """Why `framework` cannot be benchmarked here (its backend's reason, or a package only the
    benchmark needs), or None."""
    reason = unavailable_reason(framework)
    if reason is None:
        missing = [p for p in _BENCH_REQUIRES.get(framework, ()) if not importlib.util.find_spec(p)]
        if missing:
            reason = f"{', '.join(missing)} not installed (its benchmark compiles with tf.function)"
    return reason


def plan_devices(frameworks: Iterable[str], request: str) -> tuple[dict[str, str], dict[str, str]]:
    """({framework: its own device name}, {framework: why it is skipped}) for `request`.

    Frameworks that cannot run here, or do not see the device, are skipped with the reason. A
    request that no runnable framework sees raises UsageError (exit 2): this runs before any
    model is built. "cpu" imports no framework.
    """
    from transformer_rosetta.app.cli.args import UsageError

    if request == "all":
        raise UsageError("--device all is for `rosetta parity`; a benchmark runs on one device")
    share_accelerators()
    devices: dict[str, str] = {}
    skipped: dict[str, str] = {}
    unseen: dict[str, list[str]] = {}
    for name in dict.fromkeys(frameworks):  # keep the order, drop repeats
        reason = bench_unavailable_reason(name)
        if reason is not None:
            skipped[name] = reason
            continue
        if request == "cpu":
            devices[name] = "cpu"
            continue
        visible = get_backend(name).devices()
        device = resolve_device(visible, request)
        if device is None:
            unseen[name] = visible
            skipped[name] = (
                f"--device {request}: not visible to {name} (it sees {', '.join(visible)})"
            )
        else:
            devices[name] = device
    if unseen and not devices:
        seen = "; ".join(f"{n} sees {', '.join(v)}" for n, v in unseen.items())
        raise UsageError(f"--device {request}: no framework sees that device ({seen})")
    return devices, skipped


def cpu_name() -> str:
    """The CPU's model name: /proc/cpuinfo's on Linux, else what `platform` knows."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(framework: str, device: str) -> str:
    """What the hardware behind a framework's device is called, for the JSON and the report (the
    numbers mean nothing without it): the GPU's product name, or the CPU's model name."""
    if device == "cpu":
        return cpu_name()
    index = int(device.partition(":")[2] or 0)
    if framework == "torch":
        import torch

        return torch.cuda.get_device_name(index)
    if framework == "jax":
        import jax

        return jax.devices("gpu")[index].device_kind
    if framework == "tf":
        import tensorflow as tf

        gpu = tf.config.list_physical_devices("GPU")[index]
        return tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
    return device


# -- precision --------------------------------------------------------------------------------

PRECISION_HELP = (
    "highest (default): float32 with full float32 products; tf32: float32 with TF32 tensor-core "
    "products (the same as highest on a CPU); bf16: bfloat16 weights and activations. Ours, the "
    "peer and the matmul all run at it"
)


def precision_setting(name: str) -> dict[str, str]:
    """{"precision": the bench name, "dtype": ..., "matmul_precision": ...} for the JSON."""
    dtype, mode = bench_setting(name)
    return {"precision": name, "dtype": dtype, "matmul_precision": mode}


def framework_precision(framework: str, mode: str) -> contextlib.AbstractContextManager:
    """The framework's own `matmul_precision(mode)` (<framework>_impl/precision.py), looked up
    when called, so that the peers and the matmul run under the same switch as ours."""
    module = importlib.import_module(f"transformer_rosetta.{framework}_impl.precision")
    return module.matmul_precision(mode)


def matmul_size(device: str, dtype: str = "float32") -> int:
    """The ceiling matmul's n. 2048 reaches a CPU's BLAS peak in float32; in bfloat16 a CPU
    without bfloat16 units emulates it (torch's CPU kernels run it ~100x slower than float32),
    so 1024 keeps the run in seconds. A GPU needs 8192 to fill its SMs in any dtype."""
    if device != "cpu":
        return 8192
    return 1024 if dtype == "bfloat16" else 2048


# -- the forward benchmark: one measure() for every framework ---------------------------------


class PeerRefused(RosettaError):
    """No ratio for this framework: its peer does not compute our function. Raised, with the
    reason on one line, for a config that the peer's stock layers cannot express; `rosetta
    bench` reports the framework as skipped with the reason, as one that is not installed."""


class PeerDiffers(PeerRefused):
    """The peer was built for the config, but its logits are not ours: a fault in how the peer is
    assembled or loaded (or in ours) that a timing would hide. `rosetta bench` exits 1."""


@dataclass(frozen=True)
class Contenders:
    """What a framework builds from the canonical weights, on one device in one dtype.

    The four timed contenders (CONTENDERS) are zero-argument callables that return only once
    their work on the device is done. `ours_logits` and `peer_logits` run ours (the fused path)
    and the peer on the same inputs and return the logits, [batch, tgt_len, tgt_vocab], as
    float32 NumPy (bfloat16 widens to it exactly), for `check_peer`.
    """

    ours: Callable[[], object]
    ours_attention: Callable[[], object]
    peer: Callable[[], object]
    matmul: Callable[[], object]
    matmul_n: int  # the size of the ceiling's matmul (matmul_size)
    ours_logits: Callable[[], np.ndarray]
    peer_logits: Callable[[], np.ndarray]

    def timed(self) -> dict[str, Callable[[], object]]:
        """The four timed contenders by their CONTENDERS key, in the order they alternate."""
        return {name: getattr(self, name) for name in CONTENDERS}


class Build(Protocol):
    """Ours (through the adapter's backend.build) and the peer, both holding `weights` (canonical,
    float32) in `dtype`, the ceiling matmul, and the inputs (int64 NumPy) moved to `device` (the
    framework's own name), at matmul precision `mode` (bench_setting's pair)."""

    def __call__(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        src: np.ndarray,
        tgt_in: np.ndarray,
        *,
        device: str,
        dtype: str,
        mode: str,
    ) -> Contenders: ...


def _nothing_to_release(device: str) -> None:
    """The default `release`: the framework frees its device memory with its objects."""


@dataclass(frozen=True)
class ForwardHook:
    """One framework's part of `measure`: all that differs between torch, Keras and Flax.

    `peer_lacks(config)` lists what of the config the peer's stock layers cannot express, one
    phrase each ([] when they can; `lacked_by_every_peer` adds what no peer has). `running(device,
    mode)` is the context that the check and the timing run in (the framework's matmul_precision
    and its own device or inference switches). `workload(device)` gives the framework's notes
    for the result's "workload"; `release(device)` returns the device's memory once the
    contenders are dropped (the next framework needs it).
    """

    framework: str
    version: str
    peer: str  # the peer, in words, for the report
    labels: Mapping[str, str]  # the names of ours, ours_attention and the peer
    warmup: int  # rounds before timing (a jitted contender compiles in the first)
    peer_lacks: Callable[[TransformerConfig], list[str]]
    build: Build
    running: Callable[[str, str], contextlib.AbstractContextManager]
    workload: Callable[[str], dict[str, Any]]
    release: Callable[[str], None] = _nothing_to_release


def lacked_by_every_peer(c: TransformerConfig) -> list[str]:
    """What of `c` no peer has: each is the paper's encoder-decoder from its framework's stock
    layers, inside the paper's embedding pipeline (token embeddings scaled by sqrt(d_model) plus
    sinusoids, section 3.4 and 3.5), with LayerNorm and biased projections throughout."""
    lacks = []
    if c.kind != "encoder_decoder":
        lacks.append(f"{c.a_model_of_its_kind} (each peer is an encoder-decoder)")
    if c.position_kind != "sinusoidal":
        lacks.append(f"{c.position_kind} positions (each peer adds sinusoids)")
    if not c.scale_embeddings:
        lacks.append("unscaled embeddings (each peer scales them by sqrt(d_model))")
    if c.type_vocab_size or c.embedding_norm:
        lacks.append("segment embeddings or an embedding LayerNorm")
    if c.norm_kind != "layer_norm":
        lacks.append(f"norm_kind {c.norm_kind} (each peer's LayerNorm is Ba et al.'s)")
    if not c.attention_bias:
        lacks.append("attention without biases (each peer's projections have them)")
    return lacks


def lacked_by_the_paper_layers(c: TransformerConfig) -> list[str]:
    """What of `c` a peer wired as the paper's layers (section 3.1: post-norm, ReLU, no final
    LayerNorm; the Keras and the Flax peer) cannot express, beyond lacked_by_every_peer."""
    lacks = []
    if c.norm_position != "post":
        lacks.append(f"{c.norm_position}-norm layers (the peer's are post-norm, the paper's)")
    if c.final_norm:
        lacks.append("a final LayerNorm (the paper's post-norm stacks have none)")
    if c.activation != "relu":
        lacks.append(f"activation {c.activation} (the peer's feed-forward is ReLU's)")
    if c.output_bias and c.tie_output:
        lacks.append("an output bias on the tied output (the peer's tied output has none)")
    return lacks


def peer_bound(dtype: str, config: TransformerConfig, mode: str) -> float:
    """The largest |logits ours - peer| allowed for a peer that computes our function, in
    `dtype` at matmul precision `mode` (bench_setting's pair)."""
    # Ours and a correct peer are each within atol_for of the float64 function: that module
    # (transformer_rosetta.spec.tolerances) derives every bound from the dtype's unit roundoff and
    # the model's depth and checks it against measurements, and the parity suite holds ours to
    # it. So the two are within twice that of each other (the triangle inequality). In float32
    # that is 2e-5 at the tiny sizes and 4e-5 at the paper's base sizes, while a peer computing
    # another function is off by far more: the weights are perturbed (init_weights), so a bias
    # or gain that the peer drops, misplaces or adds is 0.1 away from 0 or 1. Measured: one
    # bias element moved by 0.01 moves the logits by 3e-3 to 1e-2; nn.Transformer's own final
    # LayerNorms and epsilon 1e-5 by 5e-2. In bfloat16 (0.25) and with TF32 products (2^-4;
    # 2^-3 at base sizes) the bound tracks rounding only, as that module says: "highest" is
    # the setting that catches a peer's fault.
    return 2.0 * atol_for(dtype, config, mode)


def check_peer(runs: Contenders, has_source: np.ndarray, bound: float, setting: str) -> float:
    """max |logits ours - peer| over the rows whose source has a token (`has_source`, [batch]);
    PeerDiffers, one line, when it exceeds `bound` (peer_bound for `setting`, the dtype and its
    products as the message names them) or is not a number.

    A row whose source is all padding is left out: every key of its cross-attention is masked,
    and there each framework has its own convention (ours gives 0, Keras and Flax average every
    value), which is no difference in the function on real inputs.
    """
    ours, peer = runs.ours_logits(), runs.peer_logits()
    if ours.shape != peer.shape:
        raise PeerDiffers(
            f"the peer computes a different function: logits of shape {list(peer.shape)}, ours "
            f"{list(ours.shape)}; no ratio against it"
        )
    # Row by row, so that the host holds one row's difference at a time (a batch of 64 at the
    # base sizes has 1 GB of logits a side). np.max propagates a NaN, which fails the test.
    gap = float(np.max([np.max(np.abs(ours[r] - peer[r])) for r in np.flatnonzero(has_source)]))
    if not gap <= bound:
        raise PeerDiffers(
            f"the peer computes a different function: max |logits ours - peer| {gap:.1e} on "
            f"the rows with a source, above {bound:.1e} (twice the {setting} bound of "
            f"transformer_rosetta.spec.tolerances); no ratio against it"
        )
    return gap


def measure(
    hook: ForwardHook,
    config: TransformerConfig,
    batch: int,
    src_len: int,
    tgt_len: int,
    repeats: int,
    progress: Progress | None = None,
    *,
    device: str = "cpu",
    precision: str = "highest",
) -> dict[str, Any]:
    """Median forward times of ours, ours with attention outputs, the peer and the matmul, in one
    run, for the framework of `hook`: the `measure` of every bench module (benchmarks/suite.py).

    Any config that the peer can express runs (the sizes and vocabularies are the config's),
    eval mode, on `device` (the framework's own name: "cpu", "cuda:0", "gpu:0") at `precision` (a
    bench name: highest, tf32, bf16). Ours and the peer hold the same canonical weights and must give the same logits on
    the same ragged batch (check_peer) before anything is timed; the result carries the gap and
    its bound. PeerRefused when the peer cannot express the config, PeerDiffers when its logits
    are not ours: no ratio either way.
    """
    lacks = [*lacked_by_every_peer(config), *hook.peer_lacks(config)]
    if lacks:
        raise PeerRefused(
            f"its peer cannot compute this config's function: {'; '.join(lacks)}; no ratio"
        )
    say = progress or silent
    dtype, mode = bench_setting(precision)
    # Perturbed: every bias and gain away from 0 and 1, so that a peer dropping one differs.
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float32")
    src, tgt_in = ragged_batch(config, batch, src_len, tgt_len, seed=0)
    assert src is not None and tgt_in is not None  # an encoder-decoder (lacked_by_every_peer)
    runs = hook.build(config, weights, src, tgt_in, device=device, dtype=dtype, mode=mode)
    bound = peer_bound(dtype, config, mode)
    try:
        with hook.running(device, mode):
            say(f"{hook.framework}: checking that the peer gives our logits (bound {bound:.1e})")
            setting = f"{dtype} (TF32 products)" if mode == "tf32" else dtype
            gap = check_peer(runs, (src != config.pad_id).any(axis=1), bound, setting)
            times = alternate(hook.framework, runs.timed(), repeats, hook.warmup, progress)
        matmul_n = runs.matmul_n
    finally:
        del runs  # the models and tensors: their memory goes back before the next framework runs
        hook.release(device)
    return summarise(
        framework=hook.framework,
        version=hook.version,
        peer=hook.peer,
        labels=hook.labels,
        times=times,
        config=config,
        batch=batch,
        src_len=src_len,
        tgt_len=tgt_len,
        repeats=repeats,
        device=device,
        precision=precision,
        matmul_n=matmul_n,
        workload=hook.workload(device),
        extra={"max_abs_logit_gap_vs_peer": gap, "logit_gap_bound": bound},
    )


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
    `matmul_n` the size of the ceiling's matmul (matmul_size).
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
            **workload_sizes(config, batch, src_len, tgt_len),
            **setting,
            "device": device,
            "padding": "ragged",
            "repeats": repeats,
            "matmul_n": n,
            **(workload or {}),
        },
        **(extra or {}),
    }


# -- command lines ----------------------------------------------------------------------------


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--device and --precision, with one wording in every benchmark."""
    p.add_argument("--device", type=device_arg, default="auto", metavar="D", help=DEVICE_HELP)
    p.add_argument("--precision", choices=BENCH_PRECISIONS, default="highest", help=PRECISION_HELP)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser whose usage mistakes are one line and exit 2 (cli_main), as rosetta's."""
    from transformer_rosetta.app.cli.args import Parser

    return Parser(prog=prog, description=description, formatter_class=argparse.RawTextHelpFormatter)


def cli_main(prog: str, run: Callable[[], int]) -> int:
    """Run a benchmark's main: every error a user can cause becomes one line on stderr and exit 2,
    as in `rosetta`."""
    try:
        return run()
    except RosettaError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def to_stderr(message: str) -> None:
    """A progress sink: one line on stderr, flushed."""
    print(message, file=sys.stderr, flush=True)


def dump(result: Any) -> str:
    """The --json output."""
    return json.dumps(result, indent=2)


def write_results(
    result: Mapping[str, Any], table: str, out: Path | None, markdown: Path | None
) -> str:
    """A sized benchmark's two records, each written atomically where asked for: the JSON of
    `result` at `out`, the markdown `table` at `markdown`. Returns the JSON text."""
    from transformer_rosetta.files.outputs import atomic_write

    text = json.dumps(result, indent=2)
    if out is not None:
        atomic_write(out, lambda tmp: Path(tmp).write_text(text + "\n"))
    if markdown is not None:
        atomic_write(markdown, lambda tmp: Path(tmp).write_text(table))
    return text
