"""`rosetta bench`: each framework's forward pass timed beside its own framework's peer model
(benchmarks/suite.py), on one device and at one precision for all of them."""

from __future__ import annotations

import argparse
import json
import sys

from transformer_rosetta.app.cli.args import (
    EXIT_FAILURE,
    EXIT_OK,
    MAX_REPEATS,
    UsageError,
    frameworks_arg,
    positive_int,
    repeats_int,
)
from transformer_rosetta.app.resources import check_forward_fits
from transformer_rosetta.spec.config import PRESETS, TransformerConfig, preset
from transformer_rosetta.spec.precision import BENCH_PRECISIONS


def run_bench_command(args: argparse.Namespace) -> int:
    from transformer_rosetta.benchmarks.suite import BENCH_FRAMEWORKS, format_bench, run_bench

    config = TransformerConfig.from_file(args.config) if args.config else preset(args.preset)
    if args.vocab is not None:
        config = config.replace(src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    config = config.replace(dropout=0.0, attention_dropout=0.0)  # eval mode
    if config.kind != "encoder_decoder":  # each peer (nn.Transformer, ...) is an encoder-decoder
        raise UsageError(
            f"bench: times the encoder-decoder against each framework's own; this model is "
            f"{config.kind_name}, which has no peer here"
        )
    if args.frameworks is not None and set(args.frameworks) <= {"numpy"}:
        raise UsageError("--frameworks: bench times torch, tf and jax; the oracle has no peer")
    frameworks = [f for f in (args.frameworks or BENCH_FRAMEWORKS) if f != "numpy"]
    # each framework holds its model and its peer: twice the weights and activations
    check_forward_fits(
        config, args.batch, args.src_len, args.tgt_len, 2 * len(frameworks), "this benchmark"
    )
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    # run_bench resolves --device for every framework before it builds anything: a device no
    # framework sees is a UsageError (exit 2) before any work.
    result = run_bench(
        frameworks,
        config,
        args.batch,
        args.src_len,
        args.tgt_len,
        args.repeats,
        progress,
        device=args.device,
        precision=args.precision,
    )
    print(json.dumps(result, indent=2) if args.json else format_bench(result))
    # A peer whose logits were not ours is a failed check (a fault in the peer, or in ours), not
    # a framework that merely cannot run here: reported among the skipped, and exit 1.
    return EXIT_FAILURE if result["peer_differs"] else EXIT_OK


def add_bench(sub: argparse._SubParsersAction) -> None:
    from transformer_rosetta.benchmarks.harness import DEVICE_HELP, PRECISION_HELP, device_arg

    p = sub.add_parser(
        "bench",
        help="time each framework's forward pass against its own framework's peer model",
        description=(
            "Time each framework's forward pass (eval) side by side with a peer built from that "
            "framework's own layers (torch.nn.Transformer; a Keras model of "
            "keras.layers.MultiHeadAttention/Dense/LayerNormalization; a Flax model of "
            "nnx.MultiHeadAttention/Linear/LayerNorm) and an n x n matmul (2048 on a CPU, 8192 on "
            "a GPU), alternating, in one run, all on one device at one precision. Each peer "
            "holds our weights and must give our logits before it is timed: a peer that cannot "
            "is skipped with the reason (exit 1 when it was built but its logits differ). Prints "
            "median times, the ratio to the peer (target <= 1.15), TFLOP/s and their fraction of the "
            "matmul ceiling, and the device's name. The base model takes a few minutes per "
            "framework on 2 cores; run nothing else meanwhile."
        ),
        epilog="examples:\n  rosetta bench\n  rosetta bench --frameworks torch --repeats 3\n"
        "  rosetta bench --device gpu --precision bf16 --batch 64\n"
        "  rosetta bench --preset tiny --batch 2 --src-len 16 --tgt-len 16 --device cpu --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--frameworks",
        type=frameworks_arg,
        metavar="LIST",
        help="comma-separated, from torch,tf,jax (default: all three)",
    )
    p.add_argument("--preset", choices=list(PRESETS), default="base", help="default: base")
    p.add_argument("--config", metavar="FILE.json", help="your own config instead of a preset")
    p.add_argument(
        "--vocab",
        type=positive_int,
        default=32000,
        metavar="N",
        help="vocabulary size for both sides (default 32000, the standard workload)",
    )
    p.add_argument("--batch", type=positive_int, default=8, help="default 8")
    p.add_argument("--src-len", type=positive_int, default=128, help="default 128")
    p.add_argument("--tgt-len", type=positive_int, default=128, help="default 128")
    p.add_argument(
        "--repeats",
        type=repeats_int,
        default=5,
        help=f"timed rounds, median taken (default 5, at most {MAX_REPEATS})",
    )
    p.add_argument("--device", type=device_arg, default="auto", metavar="D", help=DEVICE_HELP)
    p.add_argument("--precision", choices=BENCH_PRECISIONS, default="highest", help=PRECISION_HELP)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run_bench_command)
