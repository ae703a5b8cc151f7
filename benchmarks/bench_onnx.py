"""The exported ONNX model against torch, on the CPU: forward speed and bytes on disk, in one run.

The ONNX graph is `rosetta export`'s forward graph (torch_impl/onnx_export.py) of the same
weights, run by onnxruntime's CPU provider with its default graph optimisations and threads; the
peer is the torch implementation it was exported from, on its fused SDPA path, eval mode under
torch.inference_mode. Both take the same ragged batch and are timed in alternation
(benchmarks/harness.alternate: warm-up, then A B A B ..., medians). The ratio reported is
onnxruntime / torch (below 1: ONNX is faster). Sizes: the .onnx file against our .safetensors
and torch's .pt of the same float32 weights.

Default workload: the base model (32000-token vocabulary), batch 8, source and target
length 128. `--preset tiny` runs in seconds. CPU only: onnxruntime's CUDA provider is not in the
wheel this project pins; GPU figures are pending.

    python -m transformer_rosetta.benchmarks.bench_onnx [--preset base|tiny] [--batch 8] [--src-len 128] [--tgt-len 128]
                                    [--repeats 5] [--json]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from transformer_rosetta.adapter.backends import get_backend, unavailable_reason
from transformer_rosetta.app.cli.args import UsageError, positive_int
from transformer_rosetta.benchmarks.harness import (
    BASE_WORKLOAD,
    alternate,
    base_benchmark_config,
    cli_main,
    cpu_name,
    dump,
    parser,
    to_stderr,
)
from transformer_rosetta.porting.convert import convert
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.weights.format import save_weights
from transformer_rosetta.weights.init import init_weights

WARMUP = 2


def measure(
    config_name: str, batch: int, src_len: int, tgt_len: int, repeats: int, progress=None
) -> dict:
    """Median forward seconds of onnxruntime and torch on one ragged batch, and the files' bytes."""
    from transformer_rosetta.adapter.onnx_backend import session

    config = base_benchmark_config() if config_name == "base" else preset(config_name)
    weights = init_weights(config, 0)
    src, tgt_in = ragged_batch(config, batch, src_len, tgt_len)
    with tempfile.TemporaryDirectory() as folder:
        files = {
            "safetensors": Path(folder) / "model.safetensors",
            "pt": Path(folder) / "model.pt",
            "onnx": Path(folder) / "model.onnx",
        }
        save_weights(files["safetensors"], weights, config, producer="bench_onnx")
        if progress:
            progress("exporting the forward graph (torch.onnx, dynamo=True)")
        convert(files["safetensors"], files["onnx"], verify=False)
        convert(files["safetensors"], files["pt"], verify=False)
        sizes = {kind: os.path.getsize(path) for kind, path in files.items()}
        run = session(str(files["onnx"])).run
        module = get_backend("torch").build(config, weights).module
        src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt_in)
        feeds = {"src": src, "tgt_in": tgt_in}
        contenders = {
            "onnxruntime": lambda: run(["logits"], feeds),
            "torch": lambda: module(src_t, tgt_t)["logits"],
        }
        # The two must compute the same thing for the ratio to mean anything.
        with torch.inference_mode():
            gap = float(
                np.abs(contenders["onnxruntime"]()[0] - contenders["torch"]().numpy()).max()
            )
            times = alternate("onnx vs torch", contenders, repeats, WARMUP, progress)
    return {
        "config": config_name,
        "batch": batch,
        "src_len": src_len,
        "tgt_len": tgt_len,
        "repeats": repeats,
        "device": "cpu",
        "device_name": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "seconds": times,
        "speed_ratio": times["onnxruntime"] / times["torch"],
        "bytes": sizes,
        "size_ratio": {
            "onnx / safetensors": sizes["onnx"] / sizes["safetensors"],
            "onnx / pt": sizes["onnx"] / sizes["pt"],
        },
        "max_abs_logit_gap": gap,
        "versions": {
            "torch": torch.__version__,
            "onnxruntime": get_backend("onnx").version(),
        },
    }


def format_result(r: dict) -> str:
    t, b = r["seconds"], r["bytes"]
    return "\n".join(
        [
            f"ONNX vs torch, {r['config']} model, batch {r['batch']}, source {r['src_len']}, "
            f"target {r['tgt_len']}, cpu ({r['device_name']}), {r['repeats']} repeats",
            f"  onnxruntime forward {t['onnxruntime'] * 1e3:9.1f} ms",
            f"  torch forward       {t['torch'] * 1e3:9.1f} ms",
            f"  speed ratio onnxruntime / torch: {r['speed_ratio']:.2f}",
            f"  bytes: onnx {b['onnx']:,}, safetensors {b['safetensors']:,}, pt {b['pt']:,}; "
            f"onnx / safetensors {r['size_ratio']['onnx / safetensors']:.3f}",
            f"  largest logit gap between the two: {r['max_abs_logit_gap']:.1e}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_onnx", __doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["base", "tiny"], default="base")
    p.add_argument("--batch", type=positive_int, default=BASE_WORKLOAD["batch"])
    p.add_argument("--src-len", type=positive_int, help="default 128, at most the model's max_len")
    p.add_argument("--tgt-len", type=positive_int, help="default 128, at most the model's max_len")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def run() -> int:
        reason = unavailable_reason("onnx")
        if reason is not None:
            raise UsageError(f"onnx: {reason}")
        # The graph's position table holds max_len positions (torch_impl/onnx_export.py).
        max_len = (
            base_benchmark_config() if args.preset == "base" else preset(args.preset)
        ).max_len
        lengths = []
        for name, given in (("--src-len", args.src_len), ("--tgt-len", args.tgt_len)):
            if given is not None and given > max_len:
                raise UsageError(f"{name} {given}: the {args.preset} model takes at most {max_len}")
            lengths.append(given or min(BASE_WORKLOAD["src_len"], max_len))
        result = measure(args.preset, args.batch, *lengths, args.repeats, to_stderr)
        print(dump(result) if args.json else format_result(result))
        return 0

    return cli_main("bench_onnx", run)


if __name__ == "__main__":
    sys.exit(main())
