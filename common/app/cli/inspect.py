"""`rosetta inspect`: a weight file's or a preset's config, tensors and parameter count, and
what kind of model it is (encoder-decoder, decoder-only, encoder-only: docs/FORMAT.md, "The three
kinds")."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from transformer_rosetta.app.cli.args import EXIT_OK, UsageError, warn
from transformer_rosetta.files.outputs import shown
from transformer_rosetta.porting.verify import difference_text
from transformer_rosetta.spec.config import PRESETS, TransformerConfig, preset
from transformer_rosetta.spec.names import (
    embedding_names,
    iter_canonical_specs,
    parameter_count,
    tensor_count,
)
from transformer_rosetta.weights.format import (
    META_PROVENANCE,
    META_TOKENIZER,
    describe_nonfinite,
    load_weights,
    nonfinite_counts,
)

# The most tensors `rosetta inspect --config` lists (a config's layer count is not bounded by
# a file): 100 times a 12-layer base model's, 14 times an 80-layer Llama's. The report's
# tensor_count counts them all.
LISTED_TENSORS = 10_000


def inspect_report(args: argparse.Namespace) -> dict[str, Any]:
    """What `rosetta inspect` shows, as data: source, config, tensors, parameter count."""
    if args.file is not None and (args.preset or args.config):
        raise UsageError("give a weight FILE or --preset/--config, not both")
    provenance, tokenizer = None, None
    if args.file is not None:
        if any(v is not None for v in (args.src_vocab, args.tgt_vocab, args.vocab)):
            raise UsageError("--vocab/--src-vocab/--tgt-vocab apply to --preset/--config only")
        if str(args.file).lower().endswith(".onnx"):
            return onnx_report(args.file)
        wf = load_weights(args.file)
        config, source, producer = wf.config, args.file, wf.producer
        provenance = wf.metadata.get(META_PROVENANCE)
        tokenizer = stored_tokenizer(wf.metadata, args.file)
        tensors = [
            {"name": n, "shape": list(t.shape), "dtype": wf.dtype} for n, t in wf.tensors.items()
        ]
        nonfinite = nonfinite_counts(wf.tensors)
    else:
        config, source = asked_config(args)
        producer = None
        # A config is not a file: it may claim 10^9 layers. The first LISTED_TENSORS are listed
        # (every real model's fit), the rest counted, so that the report costs what it shows.
        tensors = [
            {"name": s.name, "shape": list(s.shape), "dtype": args.dtype}
            for s in itertools.islice(iter_canonical_specs(config), LISTED_TENSORS)
        ]
        nonfinite = {}
    emb = embedding_names(config)
    tied = {
        role: name
        for role, name in emb.items()
        if name is not None and list(emb.values()).count(name) > 1  # None: a half lacks it
    }
    return {
        "source": source,
        "producer": producer,
        "model": model_summary(config),
        "config": config.to_dict(),
        "tensors": tensors,
        "tensor_count": tensor_count(config),
        "parameters": parameter_count(config),
        "tied": tied,
        "nonfinite": nonfinite,
        "provenance": json.loads(provenance) if provenance else None,
        "tokenizer": tokenizer,
    }


def stored_tokenizer(metadata: dict[str, str], path: str) -> dict[str, Any] | None:
    """A summary of the tokenizer a file carries (weights/tokenizer.py): its size, not its
    ~1 MB of JSON; None when it carries none."""
    from transformer_rosetta.weights.tokenizer import parse_tokenizer, tokenizer_summary

    if META_TOKENIZER not in metadata:
        return None
    return tokenizer_summary(parse_tokenizer(metadata[META_TOKENIZER], shown(path)))


def onnx_report(path: str) -> dict[str, Any]:
    """What `rosetta inspect` shows of an ONNX file `rosetta export` wrote: its labels, config,
    graph inputs and outputs (symbolic dimensions by name) and provenance."""
    import onnx

    from transformer_rosetta.files.safe_read import regular_file

    regular_file(Path(path), "an ONNX file")
    try:
        model = onnx.load(path)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends, named once
        raise UsageError(
            f"{shown(path)}: not a readable ONNX model ({type(exc).__name__})"
        ) from None
    labels = {p.key: p.value for p in model.metadata_props}
    if "config" not in labels:
        raise UsageError(f"{shown(path)}: an ONNX model that rosetta export did not write")

    def io(values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            out.append(
                {
                    "name": v.name,
                    "shape": dims,
                    "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                }
            )
        return out

    config = TransformerConfig.from_json(labels["config"])
    return {
        "source": path,
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "model": model_summary(config),
        "config": config.to_dict(),
        "onnx": {
            "graph": labels.get("graph"),
            "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
            "bytes": Path(path).stat().st_size,
            "inputs": io(model.graph.input),
            "outputs": io(model.graph.output),
            **{k: labels[k] for k in ("attention", "max_steps") if k in labels},
        },
        "tensors": [],
        "tensor_count": len(model.graph.initializer),
        "parameters": parameter_count(config),
        "tied": {},
        "nonfinite": {},
        "provenance": json.loads(labels["provenance"]) if "provenance" in labels else None,
    }


KIND_LABELS = {
    "encoder_decoder": "encoder-decoder",
    "decoder_only": "decoder-only (GPT-style)",
    "encoder_only": "encoder-only (BERT-style)",
}

# The config fields a half of the family reads nothing from (family_problems keeps the flags
# false); inspect marks them, so that a converted model's table does not suggest otherwise.
UNUSED_FIELDS = {
    "encoder_decoder": {},
    "decoder_only": {
        "src_vocab_size": "no encoder",
        "share_embeddings": "one embedding",
        "pooling": "only an encoder-only model pools",
        "pooled_l2_norm": "only an encoder-only model pools",
    },
    "encoder_only": {
        "tgt_vocab_size": "no decoder",
        "share_embeddings": "one embedding",
        "tie_output": "no output projection",
        "output_bias": "no output projection",
        "bos_id": "does not decode",
        "eos_id": "does not decode",
        "label_smoothing": "does not train",
    },
}


def model_summary(c: TransformerConfig) -> dict[str, Any]:
    """The model's kind in words: its stacks and their layers, the embedding and pooling options
    that are set, what its outputs are, what a half lacks and which config fields it ignores."""
    stacks = {}
    if c.has_encoder:
        stacks["encoder"] = f"{c.num_encoder_layers} layers, bidirectional self-attention"
    if c.has_decoder:
        cross = "cross-attention to the encoder" if c.has_encoder else "no cross-attention"
        stacks["decoder"] = f"{c.num_decoder_layers} layers, causal self-attention, {cross}"
    positions = (
        f"learned positions (max_len {c.max_len})"
        if c.position_kind == "learned"
        else f"sinusoidal positions ({c.sinusoid_layout})"
    )
    sizes = (
        f"d_model {c.d_model}, {c.num_heads} heads (d_k {c.head_dim}), d_ff {c.d_ff}, "
        f"{c.activation}, {c.norm_position}-norm, {positions}"
    )
    options = []
    if c.type_vocab_size:
        options.append(
            f"token type embeddings ({c.type_vocab_size} types; row 0 is added to every token)"
        )
    if c.embedding_norm:
        options.append(f"embedding LayerNorm (eps {c.layer_norm_eps:g})")
    if c.pooling != "none":
        how = {"mean": "mean over non-pad positions", "first": "the first position"}[c.pooling]
        options.append(f"pooling: {how}" + (", then L2-normalised" if c.pooled_l2_norm else ""))
    outputs = []
    if c.has_decoder:
        outputs.append(f"logits [batch, T, {c.tgt_vocab_size}]")
    if c.has_encoder:
        outputs.append(f"encoder_output [batch, S, {c.d_model}]")
    if c.pooling != "none":
        outputs.append(f"pooled_output [batch, {c.d_model}]")
    absent = {
        "encoder_decoder": [],
        "decoder_only": ["encoder", "cross-attention", "encoder output"],
        "encoder_only": ["decoder", "cross-attention", "output projection (no logits)", "decoding"],
    }[c.kind]
    return {
        "kind": c.kind,
        "label": KIND_LABELS[c.kind],
        "stacks": stacks,
        "sizes": sizes,
        "options": options,
        "outputs": outputs,
        "absent": absent,
        "unused_fields": list(UNUSED_FIELDS[c.kind]),
    }


def print_model_summary(summary: dict[str, Any]) -> None:
    """The kind line, then one line each for the stacks, options, outputs and what is absent."""
    print(f"kind: {summary['label']}")
    for stack, what in summary["stacks"].items():
        print(f"  {stack}: {what}")
    print(f"  {summary['sizes']}")
    for option in summary["options"]:
        print(f"  {option}")
    print(f"  outputs: {', '.join(summary['outputs'])}")
    if summary["absent"]:
        print(f"  absent: {', '.join(summary['absent'])}")


def asked_config(args: argparse.Namespace) -> tuple[TransformerConfig, str]:
    """The --config or --preset (default base) config, with the vocabulary sizes asked for, and
    where it came from."""
    if args.config:
        config, source = TransformerConfig.from_file(args.config), args.config
    else:
        name = args.preset or "base"
        config, source = preset(name), f"preset {name}"
    changes: dict[str, int] = {}
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
    print_model_summary(report["model"])
    print("config:")
    unused = UNUSED_FIELDS[report["model"]["kind"]]
    for key, value in report["config"].items():
        note = f"  (unused: {unused[key]})" if key in unused else ""
        print(f"  {key:<20s} {json.dumps(value)}{note}")
    if "onnx" in report:
        print_onnx(report["onnx"])
    else:
        print_rows("tensor", report["tensors"])
        unlisted = report["tensor_count"] - len(report["tensors"])
        if unlisted > 0:
            print(
                f"... and {unlisted:,} more tensors, not listed (the first {LISTED_TENSORS:,} are)"
            )
    params = report["parameters"]
    print(f"parameters: {params:,} ({params / 1e6:.1f}M) in {report['tensor_count']} tensors")
    if report["tied"]:
        shared = ", ".join(f"{role} -> {name}" for role, name in report["tied"].items())
        print(f"stored once and shared: {shared}")
    if report["nonfinite"]:
        print(f"WARNING: {describe_nonfinite(report['nonfinite'], limit=len(report['nonfinite']))}")
    if report.get("tokenizer"):
        t = report["tokenizer"]
        cut = f"truncates to {t['truncation']}" if t["truncation"] else "no truncation"
        print(f"tokenizer: {t['model']}, {t['vocab_size']:,} tokens, {cut} (for rosetta embed)")
    if report["provenance"]:
        print_provenance(report["provenance"])


def print_rows(what: str, rows: list[dict[str, Any]], shape_width: int = 18) -> None:
    """One line per tensor: name, shape, dtype."""
    width = max([len(what)] + [len(t["name"]) for t in rows])
    print()
    print(f"{what:<{width}s}  {'shape':<{shape_width}s} dtype")
    for t in rows:
        shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
        print(f"{t['name']:<{width}s}  {shape:<{shape_width}s} {t['dtype']}")
    print()


def print_onnx(info: dict[str, Any]) -> None:
    extra = "".join(f", {k} {info[k]}" for k in ("attention", "max_steps") if k in info)
    print(f"onnx: graph {info['graph']}, opset {info['opset']}, {info['bytes']:,} bytes{extra}")
    # symbolic dimensions ("batch", "src_len") make wider shapes than a weight's
    print_rows("input", info["inputs"], shape_width=30)
    print_rows("output", info["outputs"], shape_width=30)


def print_provenance(record: dict[str, Any]) -> None:
    """Where a converted file came from and how it was verified (common/porting/verify.py)."""
    source = record.get("source", {})
    print(
        f"converted from: {source.get('file')} ({source.get('kind')}), sha256 {source.get('sha256')}"
    )
    print(f"converter: {record.get('converter')}")
    for note in record.get("notes", []):
        print(f"note: {note}")
    check = record.get("verify", {})
    if difference_text(check) is not None:
        verdict = "passed" if check.get("passed") else "FAILED"
        print(
            f"verified: {verdict}, {difference_text(check)} "
            f"(bound {check['bound']:.0e}), {' vs '.join(check['sides'])}"
        )
        # A half's probes have no source or no target length (null).
        shapes = ", ".join(
            "x".join("-" if n is None else str(n) for n in s) for s in check["probe_shapes"]
        )
        print(
            f"  probes: seed {check['probe_seed']}, batch x src x tgt {shapes} ({check['probe_rows']})"
        )
        versions = {**record.get("versions", {}), **check.get("versions", {})}
        print("  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    elif "not_run" in check:
        print(f"not verified: {check['not_run']}")


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
            "Print the model's kind (encoder-decoder, decoder-only or encoder-only) with its "
            "stacks, options and outputs, the config (marking the fields a half of the family "
            "does not use), every canonical tensor (name, shape, dtype) and the parameter "
            "count, for a weight file in the shared format or for a preset/config file; for an "
            ".onnx file, its graph's inputs and outputs. A converted file also shows its "
            "provenance: the source's sha256, the converter, and the verification's largest "
            "logit difference, probes and versions. A file is fully validated first; any "
            "problem exits 2 naming it."
        ),
        epilog="examples:\n  rosetta inspect --preset base\n  rosetta inspect --preset tiny_encoder_only\n"
        "  rosetta inspect model.safetensors --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "file",
        nargs="?",
        help="a .safetensors weight file in the shared format, or an .onnx file rosetta export wrote",
    )
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
