"""`rosetta parity`: every framework on identical weights and inputs, compared number by number
against the NumPy float64 oracle and each other."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common.adapter.backends import FRAMEWORKS, RUNTIMES
from common.app.cli.args import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_device_argument,
    add_model_arguments,
    add_precision_argument,
    check_devices_visible,
    config_and_weights,
    load_inputs,
    positive_int,
    runtimes_arg,
)
from common.app.resources import check_forward_fits
from common.files.outputs import check_output_folder
from common.spec.config import TransformerConfig
from common.spec.inputs import check_inputs, ragged_batch

if TYPE_CHECKING:
    from common.app.parity import ParityReport


def run_parity_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top, so that a test's patch of common.app.parity is seen.
    from common.app.parity import run_parity, stderr_progress

    if set(args.frameworks) <= {"numpy"}:
        raise UsageError(
            "--frameworks names only the oracle, which always runs; add torch, tf, jax or onnx"
        )
    config, weights, source = config_and_weights(args, default_preset="tiny")
    src, tgt_in = parity_inputs(args, config)
    plot_layer = check_plot_request(args, config, src.shape[0])
    check_devices_visible(args.frameworks, args.device)
    report = run_parity(
        config,
        weights,
        src,
        tgt_in,
        frameworks=args.frameworks,
        dtype=args.dtype,
        device=args.device,
        precision=args.precision,
        progress=None if args.json else stderr_progress,
    )
    plots: list[Path] = []
    if args.plot:
        from common.app.plots import plot_attention

        plots = plot_attention(report, args.plot, plot_layer, args.plot_head, args.plot_row)
    if args.json:
        print(
            json.dumps(
                {**report.to_json(), "model": source, "plots": [str(p) for p in plots]}, indent=2
            )
        )
    else:
        print_parity(args, report, source, (src, tgt_in), plots)
    if not report.runs:
        return EXIT_FAILURE
    return EXIT_OK if report.passed else EXIT_FAILURE


def parity_inputs(
    args: argparse.Namespace, config: TransformerConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The checked (src, tgt_in) ids: from --inputs, else a ragged batch from --seed; refused
    first if running every model on them would not fit in memory."""
    models = len(args.frameworks) + 1  # every framework's outputs and the oracle's are kept
    if args.inputs:
        src, tgt_in = check_inputs(config, *load_inputs(args.inputs))
        shape = (src.shape[0], src.shape[1], tgt_in.shape[1])
        check_forward_fits(config, *shape, models=models, what="this parity run")
        return src, tgt_in
    shape = (args.batch, args.src_len, args.tgt_len)
    check_forward_fits(config, *shape, models=models, what="this parity run")
    return check_inputs(config, *ragged_batch(config, *shape, seed=args.seed))


def print_parity(
    args: argparse.Namespace,
    report: ParityReport,
    source: str,
    inputs: tuple[np.ndarray, np.ndarray],
    plots: list[Path],
) -> None:
    """The human-readable report: model, inputs, skipped frameworks, the table, the summary."""
    from common.app.parity import format_table, summary_line

    src, tgt_in = inputs
    print(f"model: {source}")
    print(
        f"inputs: batch {src.shape[0]}, source length {src.shape[1]}, target length {tgt_in.shape[1]}"
        + (f" from {args.inputs}" if args.inputs else ", ragged padding")
    )
    for name, reason in report.skipped.items():
        print(f"skipped {name}: {reason}")
    print()
    if report.runs:
        print(format_table(report))
        print()
    for path in plots:
        print(f"wrote {path}")
    print(summary_line(report))


def check_plot_request(args: argparse.Namespace, config: TransformerConfig, rows: int) -> int:
    """parity --plot: the layer, head and row exist and the PNGs can be written; checked before
    any framework runs. Returns the layer."""
    layer = args.plot_layer if args.plot_layer is not None else config.num_decoder_layers - 1
    if args.plot is None:
        return layer
    layers = min(config.num_encoder_layers, config.num_decoder_layers)
    if not 0 <= layer < layers:
        raise UsageError(f"--plot-layer {layer} is outside the model's layers 0..{layers - 1}")
    if not 0 <= args.plot_head < config.num_heads:
        raise UsageError(
            f"--plot-head {args.plot_head} is outside the model's heads 0..{config.num_heads - 1}"
        )
    if not 0 <= args.plot_row < rows:
        raise UsageError(f"--plot-row {args.plot_row} is outside the batch rows 0..{rows - 1}")
    from common.app.plots import PNG_BYTES_BOUND, attention_plot_names

    names = attention_plot_names(layer, args.plot_head)
    inputs = (getattr(args, "weights", None), getattr(args, "inputs", None))
    needed = len(names) * PNG_BYTES_BOUND
    check_output_folder(
        args.plot, names, what="--plot", force=args.force, inputs=inputs, needed=needed
    )
    return layer


def add_parity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "parity",
        help="run every framework on identical weights and inputs and compare them, number by number",
        description=(
            "Build identical weights (from --seed or --weights) and identical ragged inputs, run "
            "every requested framework that is installed, and compare the encoder output, the "
            "logits (explicit and fused attention paths) and every attention map of every layer "
            "against the NumPy float64 oracle and between each pair of frameworks. Prints one row "
            "per quantity with max abs / max rel differences, the tolerance and pass/fail. "
            "Exit 0 if all pass, 1 on any failure, 2 on bad input."
        ),
        epilog=(
            "max rel is max|a - b| / max|b|, relative to the reference's scale.\n"
            "examples:\n  rosetta parity\n  rosetta parity --dtype float64 --frameworks torch,jax\n"
            "  rosetta parity --weights model.safetensors --inputs batch.npz --json\n"
            "  rosetta parity --plot plots/"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p, default_preset="tiny")
    p.add_argument(
        "--frameworks",
        type=runtimes_arg,
        default=list(FRAMEWORKS),
        metavar="LIST",
        help=f"comma-separated, from {','.join(RUNTIMES)} (default: {','.join(FRAMEWORKS)}); "
        "onnx runs torch's exported graph in onnxruntime (the onnx extra; float32)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype of the frameworks (default float32); the oracle is float64",
    )
    add_precision_argument(p)
    add_device_argument(p, every=True)
    data = p.add_argument_group("inputs")
    data.add_argument("--batch", type=positive_int, default=4, help="rows (default 4)")
    data.add_argument("--src-len", type=positive_int, default=9, help="source length (default 9)")
    data.add_argument("--tgt-len", type=positive_int, default=7, help="target length (default 7)")
    data.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="your own ids: keys src [batch, S] and tgt [batch, T] (the decoder input, "
        "starting with BOS), pad = the config's pad_id",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the whole report as JSON")
    out.add_argument("--plot", metavar="DIR", help="write attention heatmaps (PNG) to DIR")
    out.add_argument("--force", action="store_true", help="overwrite heatmaps already in DIR")
    out.add_argument(
        "--plot-layer", type=int, metavar="L", help="layer to plot (default: the last)"
    )
    out.add_argument(
        "--plot-head", type=int, default=0, metavar="H", help="head to plot (default 0)"
    )
    out.add_argument(
        "--plot-row",
        type=int,
        default=1,
        metavar="B",
        help="batch row to plot (default 1: a row with padding)",
    )
    p.set_defaults(run=run_parity_command)
