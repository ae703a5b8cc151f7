"""`rosetta`: the command line. Exit codes: 0 ok, 1 a parity or threshold failure, 2 bad input
(one line on stderr, no traceback)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any command imports TensorFlow

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

import numpy as np  # noqa: E402

from common.adapter.backends import FRAMEWORKS, get_backend, unavailable_reason  # noqa: E402
from common.app.resources import check_fits, check_forward_fits, weights_bytes  # noqa: E402
from common.errors import RosettaError  # noqa: E402
from common.files.outputs import (  # noqa: E402
    Interrupted,
    atomic_write,
    check_output_file,
    check_output_folder,
    shown,
    signals_end_cleanly,
)
from common.spec.config import PRESETS, TransformerConfig, preset  # noqa: E402
from common.spec.inputs import check_inputs, ragged_batch  # noqa: E402
from common.spec.names import canonical_specs, embedding_names, parameter_count  # noqa: E402
from common.weights.format import (  # noqa: E402
    WeightFile,
    describe_nonfinite,
    load_weights,
    nonfinite_counts,
)
from common.weights.init import init_weights  # noqa: E402

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(RosettaError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit 2, like every other bad input."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- inspect ----------------------------------------------------------------------------------


def inspect_report(args: argparse.Namespace) -> dict[str, Any]:
    """What `rosetta inspect` shows, as data: source, config, tensors, parameter count."""
    if args.file is not None and (args.preset or args.config):
        raise UsageError("give a weight FILE or --preset/--config, not both")
    if args.file is not None:
        if any(v is not None for v in (args.src_vocab, args.tgt_vocab, args.vocab)):
            raise UsageError("--vocab/--src-vocab/--tgt-vocab apply to --preset/--config only")
        wf = load_weights(args.file)
        config, source, producer = wf.config, args.file, wf.producer
        tensors = [
            {"name": n, "shape": list(t.shape), "dtype": wf.dtype} for n, t in wf.tensors.items()
        ]
        nonfinite = nonfinite_counts(wf.tensors)
    else:
        if args.config:
            config, source = TransformerConfig.from_file(args.config), args.config
        else:
            name = args.preset or "base"
            config, source = preset(name), f"preset {name}"
        changes = {}
        if args.vocab is not None:
            changes.update(src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
        if args.src_vocab is not None:
            changes["src_vocab_size"] = args.src_vocab
        if args.tgt_vocab is not None:
            changes["tgt_vocab_size"] = args.tgt_vocab
        config = config.replace(**changes)
        producer = None
        tensors = [
            {"name": s.name, "shape": list(s.shape), "dtype": args.dtype}
            for s in canonical_specs(config)
        ]
        nonfinite = {}
    emb = embedding_names(config)
    tied = {role: name for role, name in emb.items() if list(emb.values()).count(name) > 1}
    return {
        "source": source,
        "producer": producer,
        "config": config.to_dict(),
        "tensors": tensors,
        "tensor_count": len(tensors),
        "parameters": parameter_count(config),
        "tied": tied,
        "nonfinite": nonfinite,
    }


def print_inspect(report: dict[str, Any]) -> None:
    print(f"source: {report['source']}")
    if report["producer"]:
        print(f"producer: {report['producer']}")
    print("config:")
    for key, value in report["config"].items():
        print(f"  {key:<20s} {json.dumps(value)}")
    width = max(len(t["name"]) for t in report["tensors"])
    print()
    print(f"{'tensor':<{width}s}  {'shape':<18s} dtype")
    for t in report["tensors"]:
        shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
        print(f"{t['name']:<{width}s}  {shape:<18s} {t['dtype']}")
    print()
    params = report["parameters"]
    print(f"parameters: {params:,} ({params / 1e6:.1f}M) in {report['tensor_count']} tensors")
    if report["tied"]:
        shared = ", ".join(f"{role} -> {name}" for role, name in report["tied"].items())
        print(f"stored once and shared: {shared}")
    if report["nonfinite"]:
        print(f"WARNING: {describe_nonfinite(report['nonfinite'], limit=len(report['nonfinite']))}")


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_report(args)
    if report["nonfinite"]:
        warn(f"{shown(report['source'])}: {describe_nonfinite(report['nonfinite'])}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_inspect(report)
    return EXIT_OK


def add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a weight file's or a preset's config, tensors and parameter count",
        description=(
            "Print the config, every canonical tensor (name, shape, dtype) and the parameter "
            "count, for a weight file in the shared format or for a preset/config file. A file "
            "is fully validated first; any problem exits 2 naming it."
        ),
        epilog="examples:\n  rosetta inspect --preset base\n  rosetta inspect model.safetensors --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", nargs="?", help="a .safetensors weight file in the shared format")
    p.add_argument("--preset", choices=list(PRESETS), help="a built-in config (default: base)")
    p.add_argument("--config", metavar="FILE.json", help="a config as JSON")
    p.add_argument("--vocab", type=int, metavar="N", help="one vocabulary size for both sides")
    p.add_argument("--src-vocab", type=int, metavar="N", help="source vocabulary size")
    p.add_argument("--tgt-vocab", type=int, metavar="N", help="target vocabulary size")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "float16", "bfloat16"],
        help="dtype to show for a preset (default float32)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run_inspect)


# -- shared argument handling -----------------------------------------------------------------


def config_and_weights(
    args: argparse.Namespace, default_preset: str | None
) -> tuple[TransformerConfig, dict[str, np.ndarray], str]:
    """The model to run: from --weights (whose config wins, and must match --preset/--config if
    one is given too), else random weights from --seed for --preset/--config."""
    asked: TransformerConfig | None = None
    if getattr(args, "preset", None) and getattr(args, "config", None):
        raise UsageError("give --preset or --config, not both")
    if getattr(args, "config", None):
        asked = TransformerConfig.from_file(args.config)
    elif getattr(args, "preset", None):
        asked = preset(args.preset)
    if getattr(args, "weights", None):
        wf: WeightFile = load_weights(args.weights, config=asked)
        found = nonfinite_counts(wf.tensors)
        if found:
            warn(f"{shown(args.weights)}: {describe_nonfinite(found)}; outputs will not be finite")
        return wf.config, wf.tensors, f"{args.weights} ({wf.dtype}, by {wf.producer})"
    if asked is None:
        if default_preset is None:
            raise UsageError("give --weights FILE, or --preset/--config for random weights")
        asked = preset(default_preset)
    check_fits(weights_bytes(asked), "random float64 weights for this config")
    # The "perturbed" scheme: random biases and gains, so that a dropped bias cannot hide.
    weights = init_weights(asked, seed=args.seed, scheme="perturbed", dtype="float64")
    name = args.config or f"preset {args.preset or default_preset}"
    return asked, weights, f"{name}, random weights from seed {args.seed}"


def load_ids(path: str, name: str) -> np.ndarray:
    """An integer id array [batch, length] from a .npy file, with a one-line error for anything
    else; the header is checked before any data is read (common.files.safe_read)."""
    from common.files.safe_read import read_ids

    return read_ids(path, name)


def load_inputs(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(src, tgt) from an .npz with keys `src` and `tgt` (decoder input ids, starting with BOS),
    each member's header checked before it is read (common.files.safe_read)."""
    from common.files.safe_read import read_ids_npz

    src, tgt = read_ids_npz(path, "--inputs", ("src", "tgt"))
    return src, tgt


def frameworks_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown framework {', '.join(map(repr, unknown)) or 'list'}; choose from {','.join(FRAMEWORKS)}"
        )
    return names


SEED_MAX = 2**32 - 1  # the widest seed every framework's generator takes (JAX keys are uint32)


def seed_int(text: str) -> int:
    """An argparse type: a seed from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be from 0 to {SEED_MAX}, got {value}")
    return value


MAX_REPEATS = 1000  # a benchmark's rounds: beyond this a run is a hang, not a measurement


def repeats_int(text: str) -> int:
    """An argparse type: 1 to MAX_REPEATS timed rounds."""
    value = positive_int(text)
    if value > MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_REPEATS}, got {value}")
    return value


def warn(message: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"rosetta: warning: {message}", file=sys.stderr)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# -- parity -----------------------------------------------------------------------------------


def run_parity_command(args: argparse.Namespace) -> int:
    from common.app.parity import format_table, run_parity, stderr_progress, summary_line

    if set(args.frameworks) <= {"numpy"}:
        raise UsageError(
            "--frameworks names only the oracle, which always runs; add torch, tf or jax"
        )
    config, weights, source = config_and_weights(args, default_preset="tiny")
    models = len(args.frameworks) + 1  # every framework's outputs and the oracle's are kept
    if args.inputs:
        src, tgt_in = check_inputs(config, *load_inputs(args.inputs))
        shape = (src.shape[0], src.shape[1], tgt_in.shape[1])
        check_forward_fits(config, *shape, models=models, what="this parity run")
    else:
        shape = (args.batch, args.src_len, args.tgt_len)
        check_forward_fits(config, *shape, models=models, what="this parity run")
        src, tgt_in = check_inputs(config, *ragged_batch(config, *shape, seed=args.seed))
    plot_layer = check_plot_request(args, config, src.shape[0])
    check_devices_visible(args.frameworks, args.device)
    progress = None if args.json else stderr_progress
    report = run_parity(
        config,
        weights,
        src,
        tgt_in,
        frameworks=args.frameworks,
        dtype=args.dtype,
        device=args.device,
        progress=progress,
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
    if not report.runs:
        return EXIT_FAILURE
    return EXIT_OK if report.passed else EXIT_FAILURE


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


def check_devices_visible(frameworks: Sequence[str], device: str) -> None:
    """--device gpu with no GPU visible to any requested framework is bad input (exit 2), as in
    `rosetta forward`; with some frameworks on a GPU, the others are skipped with the reason."""
    if device == "cpu":
        return
    from common.app.parity import resolve_devices

    runnable = [f for f in frameworks if f != "numpy" and unavailable_reason(f) is None]
    if runnable and not any(resolve_devices(f, get_backend(f).devices(), device) for f in runnable):
        raise UsageError(f"--device {device}: no GPU is visible to {', '.join(runnable)}")


def add_model_arguments(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    which = p.add_argument_group("model")
    which.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"a built-in config{f' (default: {default_preset})' if default_preset else ''}",
    )
    which.add_argument("--config", metavar="FILE.json", help="your own config as JSON")
    which.add_argument(
        "--weights",
        metavar="FILE.safetensors",
        help="weights in the shared format (its config is used; a --preset/--config "
        "given too must match it)",
    )
    which.add_argument(
        "--seed", type=seed_int, default=0, help="seed for random weights and inputs (default 0)"
    )


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
        type=frameworks_arg,
        default=list(FRAMEWORKS),
        metavar="LIST",
        help=f"comma-separated, from {','.join(FRAMEWORKS)} (default: all)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype of the frameworks (default float32); the oracle is float64",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "gpu", "all"],
        help="cpu, the first gpu of each framework, or every device (default cpu)",
    )
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


# -- forward ----------------------------------------------------------------------------------


def run_forward_command(args: argparse.Namespace) -> int:
    from common.app.parity import resolve_devices

    out_path = check_output_file(
        args.out, force=args.force, suffix=".npz", inputs=(args.weights, args.src, args.tgt)
    )
    raw_src, raw_tgt = load_ids(args.src, "--src"), load_ids(args.tgt, "--tgt")
    config, weights, _ = config_and_weights(args, default_preset=None)
    src, tgt_in = check_inputs(config, raw_src, raw_tgt)
    check_forward_fits(config, src.shape[0], src.shape[1], tgt_in.shape[1], 1, "this forward pass")
    backend = get_backend(args.framework)
    args.dtype = args.dtype or ("float64" if args.framework == "numpy" else "float32")
    if args.dtype not in backend.dtypes:
        raise UsageError(
            f"{args.framework} does not compute in {args.dtype}; it offers {', '.join(backend.dtypes)}"
        )
    devices = resolve_devices(args.framework, backend.devices(), args.device)
    if not devices:
        raise UsageError(f"no {args.device} device is visible to {args.framework}")
    model = backend.build(config, weights, dtype=args.dtype, device=devices[0])
    arrays = model.forward(src, tgt_in, attention=not args.no_attention).named()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    atomic_write(out_path, write, size=sum(a.nbytes for a in arrays.values()))
    summary = {
        "framework": backend.version(),
        "device": devices[0],
        "dtype": args.dtype,
        "out": str(out_path),
        "arrays": {k: list(v.shape) for k, v in arrays.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"wrote {out_path}: {len(arrays)} arrays ({', '.join(list(arrays)[:3])}"
            f"{', ...' if len(arrays) > 3 else ''}) from {backend.version()} on {devices[0]}, {args.dtype}"
        )
    return EXIT_OK


def add_forward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "forward",
        help="run one framework on your ids and save logits, encoder output and attentions (.npz)",
        description=(
            "Run one framework (or the numpy oracle) on token ids you give, and write the logits, "
            "the encoder output and every attention map to one .npz under the canonical names of "
            "docs/PARITY.md, to compare our numbers with an implementation of your own."
        ),
        epilog="example:\n  rosetta forward --framework torch --weights m.safetensors --src src.npy "
        "--tgt tgt.npy --out out.npz",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", required=True, choices=list(FRAMEWORKS))
    p.add_argument(
        "--weights", required=True, metavar="FILE.safetensors", help="weights in the shared format"
    )
    p.add_argument("--src", required=True, metavar="SRC.npy", help="source ids, integer [batch, S]")
    p.add_argument(
        "--tgt",
        required=True,
        metavar="TGT.npy",
        help="decoder input ids, integer [batch, T], starting with BOS",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype (default float32; float64 for numpy, the only one the oracle has)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument(
        "--no-attention",
        action="store_true",
        help="skip the attention maps (takes the fused attention path)",
    )
    p.add_argument("--out", required=True, metavar="OUT.npz", help="where to write the arrays")
    p.add_argument("--force", action="store_true", help="overwrite OUT.npz if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run_forward_command, seed=0)


# -- convert ----------------------------------------------------------------------------------


def run_convert_command(args: argparse.Namespace) -> int:
    from common.porting.convert import convert

    config = TransformerConfig.from_file(args.config) if args.config else None
    done = convert(
        args.src,
        args.dst,
        from_kind=args.from_kind,
        to_kind=args.to_kind,
        config=config,
        force=args.force,
        allow_nonfinite=args.allow_nonfinite,
        also_read=(args.config,),
    )
    if args.json:
        print(
            json.dumps(
                {
                    "src": done.src,
                    "dst": done.dst,
                    "from": done.from_kind,
                    "to": done.to_kind,
                    "tensors": done.tensors,
                    "parameters": done.parameters,
                    "dtype": done.dtype,
                    "config": done.config.to_dict(),
                },
                indent=2,
            )
        )
    else:
        print(done.summary())
    return EXIT_OK


def add_convert(sub: argparse._SubParsersAction) -> None:
    from common.porting.convert import KINDS

    p = sub.add_parser(
        "convert",
        help="move weights between the shared format, native checkpoints and outside models",
        description=(
            "Convert SRC to DST. Kinds: rosetta (the shared .safetensors), torch (our torch "
            "state_dict, .pt/.bin), keras (our .weights.h5), flax (our .msgpack), and, as sources "
            "only, nn-transformer (a torch.nn.Transformer state_dict with the user's embeddings "
            "and output Linear) and marian (a Hugging Face MarianMTModel folder). Kinds are "
            "inferred from the names (and a .pt's tensor names) where that is unambiguous. The "
            "whole source is validated first, every problem reported at once; DST is written "
            "atomically and never overwritten without --force. torch files are read with "
            "weights_only=True: no pickle code ever runs."
        ),
        epilog=(
            "examples:\n  rosetta convert model.safetensors model.pt --config config.json\n"
            "  rosetta convert model.pt model.weights.h5 --config config.json\n"
            "  rosetta convert my_nn_transformer.pt model.safetensors --from nn-transformer --config c.json\n"
            "  rosetta convert ./opus-mt-folder model.safetensors"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="the file (or Marian folder) to read")
    p.add_argument("dst", help="the file to write")
    p.add_argument("--from", dest="from_kind", choices=list(KINDS), help="the source kind")
    p.add_argument(
        "--to",
        dest="to_kind",
        choices=[k for k in KINDS if k not in ("nn-transformer", "marian")],
        help="the destination kind",
    )
    p.add_argument(
        "--config",
        metavar="FILE.json",
        help="the model's config, for sources that do not carry one (torch, keras, flax, "
        "nn-transformer)",
    )
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert weights that hold NaN or Inf (refused by default)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=run_convert_command)


# -- bench ------------------------------------------------------------------------------------


def run_bench_command(args: argparse.Namespace) -> int:
    from benchmarks.suite import BENCH_FRAMEWORKS, format_bench, run_bench

    config = TransformerConfig.from_file(args.config) if args.config else preset(args.preset)
    if args.vocab is not None:
        config = config.replace(src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    config = config.replace(dropout=0.0, attention_dropout=0.0)  # eval mode
    if args.frameworks is not None and set(args.frameworks) <= {"numpy"}:
        raise UsageError("--frameworks: bench times torch, tf and jax; the oracle has no peer")
    frameworks = [f for f in (args.frameworks or BENCH_FRAMEWORKS) if f != "numpy"]
    # each framework holds its model and its peer: twice the weights and activations
    check_forward_fits(
        config, args.batch, args.src_len, args.tgt_len, 2 * len(frameworks), "this benchmark"
    )
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    result = run_bench(
        frameworks, config, args.batch, args.src_len, args.tgt_len, args.repeats, progress
    )
    print(json.dumps(result, indent=2) if args.json else format_bench(result))
    return EXIT_OK


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time each framework's forward pass against its own framework's peer model",
        description=(
            "Time each framework's forward pass (eval, float32, CPU) side by side with a peer "
            "built from that framework's own layers (torch.nn.Transformer; a Keras model of "
            "keras.layers.MultiHeadAttention/Dense/LayerNormalization; a Flax model of "
            "nnx.MultiHeadAttention/Linear/LayerNorm) and a 2048x2048 matmul, alternating, in one "
            "run. Prints median times, the ratio to the peer (target <= 1.15) and GFLOP/s as a "
            "fraction of the matmul ceiling. The base model takes a few minutes per framework on "
            "2 cores; run nothing else meanwhile."
        ),
        epilog="examples:\n  rosetta bench\n  rosetta bench --frameworks torch --repeats 3\n"
        "  rosetta bench --preset tiny --batch 2 --src-len 16 --tgt-len 16 --json",
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
        help="vocabulary size for both sides (default 32000, the issues' workload)",
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
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run_bench_command)


# -- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rosetta",
        description=(
            "Transformer Rosetta: one encoder-decoder Transformer in PyTorch, Keras 3/TensorFlow "
            "and Flax NNX/JAX, with a NumPy float64 oracle and one weight format."
        ),
        epilog="Exit codes: 0 ok, 1 a parity or threshold failure, 2 bad input.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    from common.app.cli_train import add_demo, add_train, add_translate  # it imports this module

    add_demo(sub)
    add_train(sub)
    add_translate(sub)
    add_parity(sub)
    add_forward(sub)
    add_convert(sub)
    add_bench(sub)
    add_inspect(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Every error a user can cause ends here as one line on stderr and exit
    2; a termination signal as one line and 128 + its number, after removing partial files."""
    _replace_closed_streams()
    for stream in (sys.stdout, sys.stderr):  # a name the terminal cannot encode is escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout = _StdoutThatMayClose(sys.stdout)
    try:
        with signals_end_cleanly():
            parser = build_parser()
            args = parser.parse_args(argv)
            if not hasattr(args, "run"):
                raise UsageError(
                    "no command given; choose one of demo, train, translate, parity, forward, "
                    "convert, bench, inspect (see 'rosetta --help')"
                )
            # Non-finite values are reported once, by name (see config_and_weights); numpy's
            # own RuntimeWarnings about NaN arithmetic would only add lines after that.
            with np.errstate(all="ignore"):
                code = args.run(args)
            sys.stdout.flush()  # a full disk or a closed pipe shows here, not after exit
            return code
    except RosettaError as exc:
        return _fail(str(exc))
    except MemoryError:
        return _fail("out of memory; try a smaller batch, length or model")
    except KeyboardInterrupt:
        print("rosetta: interrupted", file=sys.stderr)
        return 130
    except Interrupted as exc:
        print(f"rosetta: stopped by {exc}; no partial file was left", file=sys.stderr)
        return 128 + exc.signum
    except OSError as exc:  # e.g. stdout on a full disk, or a write that the system refused
        _silence_stdout()
        where = shown(exc.filename) if exc.filename else "to standard output"
        return _fail(f"cannot write {where}: {exc.strerror or exc}")
    finally:
        if isinstance(sys.stdout, _StdoutThatMayClose):
            sys.stdout = sys.stdout.stream


MAX_MESSAGE_CHARS = 1000  # an error is one readable line, whatever the input it quotes


def _fail(message: str) -> int:
    text = shown(message or "failed")
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 40] + f"... ({len(text):,} characters in all)"
    with contextlib.suppress(OSError):  # stderr itself may be a full disk: the exit code stays
        print(f"rosetta: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT


class _StdoutThatMayClose:
    """stdout, except that a reader who goes away (`rosetta train ... | head -1`) does not stop
    the work: the rest of the output goes to the null device, and the files are still written."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        _silence_stdout()
        self.stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _replace_closed_streams() -> None:
    """Python sets sys.stdout/sys.stderr to None when fd 1 or 2 was closed at start
    (`rosetta ... 2>&-`); write to the null device instead of failing on the first print."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process


def _silence_stdout() -> None:
    """After stdout failed, point it at the null device so the interpreter's own flush at exit
    does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
