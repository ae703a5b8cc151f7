"""What every benchmark shares: side-by-side timing, FLOP counts, devices, precisions, the CLI.

Alternating (A, B, A, B, ...) rather than timing A then B means that a slow phase of the machine
(another process, thermal state) hits both alike, so the ratio stays honest on a busy machine.

Devices are asked for once, by one word for every framework (`--device`, DEVICE_HELP), and each
framework's own name for it is looked up here (`plan_devices`), before any model is built: a
device that no framework sees is bad input (exit 2), not a traceback minutes later.
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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from transformer_rosetta.adapter.backends import get_backend, unavailable_reason
from transformer_rosetta.app.cli.args import DEVICE_HELP as args_device_help
from transformer_rosetta.app.cli.args import device_arg  # noqa: F401  (the benchmarks' --device type)
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.precision import BENCH_PRECISIONS, bench_setting


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


def train_step_flops(c: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one training step: the forward pass and a backward pass of twice its cost
    (each product is differentiated against both of its operands). The Adam update is
    elementwise and left out, as forward_flops leaves out softmax and LayerNorm."""
    return 3.0 * forward_flops(c, batch, src_len, tgt_len)


def report_line(label: str, seconds: float, flops: float, ceiling_gflops: float) -> str:
    gflops = flops / seconds / 1e9
    return (
        f"{label:<40s} {seconds * 1e3:9.1f} ms  {gflops:8.1f} GFLOP/s  "
        f"{100 * gflops / ceiling_gflops:5.1f}% of matmul"
    )


BASE_WORKLOAD = dict(batch=8, src_len=128, tgt_len=128)


def base_benchmark_config() -> TransformerConfig:
    """The issues' workload: the base model with a 32000-token vocabulary, no dropout (eval)."""
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
    """The framework's own `matmul_precision(mode)` (<framework>_impl/model.py), looked up when
    called, so that the peers and the matmul run under the same switch as ours."""
    return importlib.import_module(f"{framework}_impl.model").matmul_precision(mode)


def matmul_size(device: str, dtype: str = "float32") -> int:
    """The ceiling matmul's n. 2048 reaches a CPU's BLAS peak in float32; in bfloat16 a CPU
    without bfloat16 units emulates it (torch's CPU kernels run it ~100x slower than float32),
    so 1024 keeps the run in seconds. A GPU needs 8192 to fill its SMs in any dtype."""
    if device != "cpu":
        return 8192
    return 1024 if dtype == "bfloat16" else 2048


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
