"""`rosetta`: the command line. Exit codes: 0 ok, 1 a parity or threshold failure, 2 bad input
(one line on stderr, no traceback)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any command imports TensorFlow

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

from common.config import PRESETS, TransformerConfig, preset  # noqa: E402
from common.errors import RosettaError  # noqa: E402
from common.format import load_weights  # noqa: E402
from common.names import canonical_specs, embedding_names, parameter_count  # noqa: E402

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
    if args.file and (args.preset or args.config):
        raise UsageError("give a weight FILE or --preset/--config, not both")
    if args.file:
        if any(v is not None for v in (args.src_vocab, args.tgt_vocab, args.vocab)):
            raise UsageError("--vocab/--src-vocab/--tgt-vocab apply to --preset/--config only")
        wf = load_weights(args.file)
        config, source, producer = wf.config, args.file, wf.producer
        tensors = [
            {"name": n, "shape": list(t.shape), "dtype": wf.dtype} for n, t in wf.tensors.items()
        ]
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


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_report(args)
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
    add_inspect(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not hasattr(args, "run"):
            parser.print_help()
            return EXIT_BAD_INPUT
        return args.run(args)
    except RosettaError as exc:
        print(f"rosetta: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("rosetta: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rosetta inspect ... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
