"""`rosetta inspect`: a weight file's or a preset's config, tensors and parameter count."""

from __future__ import annotations

import argparse
import json
from typing import Any

from common.app.cli.args import EXIT_OK, UsageError, warn
from common.files.outputs import shown
from common.spec.config import PRESETS, TransformerConfig, preset
from common.spec.names import canonical_specs, embedding_names, parameter_count
from common.weights.format import describe_nonfinite, load_weights, nonfinite_counts


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
        config, source = asked_config(args)
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


def asked_config(args: argparse.Namespace) -> tuple[TransformerConfig, str]:
    """The --config or --preset (default base) config, with the vocabulary sizes asked for, and
    where it came from."""
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
    return config.replace(**changes), source


def print_inspect(report: dict[str, Any]) -> None:
    """The report as a table: config, then one line per tensor, then the totals."""
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


def run_inspect_command(args: argparse.Namespace) -> int:
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
    p.set_defaults(run=run_inspect_command)
