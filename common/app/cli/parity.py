"""`rosetta parity`: every framework on identical weights and inputs, compared number by number
against the NumPy float64 oracle and each other."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from transformer_rosetta.adapter.backends import FRAMEWORKS, RUNTIMES
from transformer_rosetta.app.cli.args import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_device_argument,
    add_model_arguments,
    add_precision_argument,
    check_devices_visible,
    config_and_weights,
    load_inputs,
    mesh_arg,
    positive_int,
    refuse_absent_half,
    runtimes_arg,
)
from transformer_rosetta.app.distributed import check_processes, is_main_process, jax_processes
from transformer_rosetta.app.parity import DEFAULT_LENGTHS
from transformer_rosetta.app.resources import check_forward_fits
from transformer_rosetta.files.outputs import check_output_folder
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs, ragged_batch
from transformer_rosetta.spec.mesh import check_mesh

if TYPE_CHECKING:
    from transformer_rosetta.app.parity import ParityReport


def run_parity_command(args: argparse.Namespace) -> int:
    # Imported here, not at the top, so that a test's patch of transformer_rosetta.app.parity is seen.
    from transformer_rosetta.app.parity import batch_size, run_parity, stderr_progress

    if set(args.frameworks) <= {"numpy"}:
        raise UsageError(
            "--frameworks names only the oracle, which always runs; add torch, tf, jax or onnx"
        )
    config, weights, source = config_and_weights(args, default_preset="tiny")
    src, tgt_in = parity_inputs(args, config)
    plot_layer = check_plot_request(args, config, batch_size(src, tgt_in))
    if args.mesh is not None:
        check_parity_mesh(args, config, batch_size(src, tgt_in))
    else:
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
        progress=None if args.json or not is_main_process() else stderr_progress,
        mesh=args.mesh,
    )
    if not is_main_process():  # a JAX multi-process run: process 0 alone reports
        return EXIT_OK if report.passed else EXIT_FAILURE
    plots: list[Path] = []
    if args.plot:
        from transformer_rosetta.app.plots import plot_attention

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


def check_parity_mesh(args: argparse.Namespace, config: TransformerConfig, batch: int) -> None:
    """--mesh's requests that cannot run, refused before anything starts."""
    if args.device != "auto":
        raise UsageError(f"--device {args.device}: a mesh run uses the devices its engine sees")
    if args.dtype not in ("float32", "float64"):
        raise UsageError(f"--dtype {args.dtype}: a mesh run computes in float32 or float64")
    check_mesh(args.mesh, config, batch=batch)
    processes = jax_processes()  # a JAX multi-process run, where the environment names one
    if processes is not None:
        others = [name for name in args.frameworks if name not in ("jax", "numpy")]
        if others:
            raise UsageError(
                f"JAX_NUM_PROCESSES={processes.count}: a multi-process parity run is jax's "
                f"alone; name --frameworks jax, not {','.join(others)}"
            )
        check_processes("jax", args.mesh)


# --src-len and --tgt-len when not given (a half of the family takes one of them).


def parity_inputs(
    args: argparse.Namespace, config: TransformerConfig
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The checked (src, tgt_in) ids, None for the half the model lacks: from --inputs, else a
    ragged batch from --seed; refused first if running every model on them would not fit in
    memory. A length option of the absent half is refused rather than ignored."""
    from transformer_rosetta.app.parity import batch_size

    models = len(args.frameworks) + 1  # every framework's outputs and the oracle's are kept
    given = {"src": args.src_len is not None, "tgt": args.tgt_len is not None}
    refuse_absent_half(config, given, "--{key}-len", "give --{other}-len only")
    if args.inputs:
        src, tgt_in = check_inputs(config, *load_inputs(args.inputs, config))
        shape = (batch_size(src, tgt_in), input_length(src), input_length(tgt_in))
        check_forward_fits(config, *shape, models=models, what="this parity run")
        return src, tgt_in
    src_len = args.src_len or DEFAULT_LENGTHS["src"]
    tgt_len = args.tgt_len or DEFAULT_LENGTHS["tgt"]
    # The absent half's length is 0 in the memory estimate: no ids, no maps, no logits for it.
    used = (src_len if config.has_encoder else 0, tgt_len if config.has_decoder else 0)
    check_forward_fits(config, args.batch, *used, models=models, what="this parity run")
    return check_inputs(config, *ragged_batch(config, args.batch, src_len, tgt_len, args.seed))


def input_length(ids: np.ndarray | None) -> int:
    """The length of one input; 0 for the input a half of the family does not take."""
    return 0 if ids is None else int(ids.shape[1])


def describe_parity_inputs(
    config: TransformerConfig, src: np.ndarray | None, tgt_in: np.ndarray | None
) -> str:
    """ "batch 4, source length 9, target length 7"; a half's: "batch 4, target length 7 (a
    decoder-only model: no source)"."""
    from transformer_rosetta.app.parity import batch_size

    rows = batch_size(src, tgt_in)
    lengths = [
        f"{what} length {ids.shape[1]}"
        for what, ids in (("source", src), ("target", tgt_in))
        if ids is not None
    ]
    absent = {"decoder_only": "no source", "encoder_only": "no target"}.get(config.kind)
    note = f" ({config.a_model_of_its_kind}: {absent})" if absent else ""
    return f"batch {rows}, {', '.join(lengths)}{note}"


def print_parity(
    args: argparse.Namespace,
    report: ParityReport,
    source: str,
    inputs: tuple[np.ndarray | None, np.ndarray | None],
    plots: list[Path],
) -> None:
    """The human-readable report: model, inputs, skipped frameworks, the table, the summary."""
    from transformer_rosetta.app.parity import format_table, summary_line

    print(f"model: {source} ({report.config.kind_name})")
    print(
        f"inputs: {describe_parity_inputs(report.config, *inputs)}"
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
    any framework runs. Returns the layer: by default the last one every stack has."""
    # The layers of the stacks the model has (a half of the family has one).
    layers = min(n for n in (config.num_encoder_layers, config.num_decoder_layers) if n > 0)
    layer = args.plot_layer if args.plot_layer is not None else layers - 1
    if args.plot is None:
        return layer
    if not 0 <= layer < layers:
        raise UsageError(f"--plot-layer {layer} is outside the model's layers 0..{layers - 1}")
    if not 0 <= args.plot_head < config.num_heads:
        raise UsageError(
            f"--plot-head {args.plot_head} is outside the model's heads 0..{config.num_heads - 1}"
        )
    if not 0 <= args.plot_row < rows:
        raise UsageError(f"--plot-row {args.plot_row} is outside the batch rows 0..{rows - 1}")
    from transformer_rosetta.app.plots import PNG_BYTES_BOUND, attention_plot_names

    names = attention_plot_names(config, layer, args.plot_head)
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
            "A decoder-only model (e.g. --preset tiny_decoder_only) has no source and compares "
            "its logits and decoder self-attention; an encoder-only one (tiny_encoder_only) has "
            "no target and compares its encoder output (explicit and fused), pooled output and "
            "encoder self-attention. Exit 0 if all pass, 1 on any failure, 2 on bad input."
        ),
        epilog=(
            "max rel is max|a - b| / max|b|, relative to the reference's scale.\n"
            "examples:\n  rosetta parity\n  rosetta parity --dtype float64 --frameworks torch,jax\n"
            "  rosetta parity --preset tiny_decoder_only --tgt-len 12\n"
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
    p.add_argument(
        "--mesh",
        type=mesh_arg,
        metavar="data=D,model=M",
        help="run each framework's sharded forward on D x M devices with its own distributed "
        "engine (torch: DDP or FSDP2; jax: jax.sharding; tf: keras.distribution on Keras's JAX "
        "backend), the parameters split over M, the rows over D, against the oracle (float32 "
        "or float64; the explicit attention path)",
    )
    data = p.add_argument_group("inputs")
    data.add_argument("--batch", type=positive_int, default=4, help="rows (default 4)")
    data.add_argument(
        "--src-len",
        type=positive_int,
        help=f"source length (default {DEFAULT_LENGTHS['src']}; for a model with an encoder)",
    )
    data.add_argument(
        "--tgt-len",
        type=positive_int,
        help=f"target length (default {DEFAULT_LENGTHS['tgt']}; for a model with a decoder)",
    )
    data.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="your own ids: keys src [batch, S] and tgt [batch, T] (the decoder input, "
        "starting with BOS), pad = the config's pad_id; a decoder-only model's file holds tgt "
        "only, an encoder-only model's src only",
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
