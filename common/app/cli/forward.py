"""`rosetta forward`: one framework on your ids; its logits, encoder output and attention maps
written to one .npz under the canonical names. A half of the family takes one of the two inputs
and writes what it has: a decoder-only model no encoder output, an encoder-only one no logits
but its pooled output when it pools."""

from __future__ import annotations

import argparse
import json

import numpy as np

from transformer_rosetta.adapter.backends import FRAMEWORKS, get_backend
from transformer_rosetta.app.cli.args import (
    EXIT_OK,
    UsageError,
    add_device_argument,
    add_precision_argument,
    build_for,
    config_and_weights,
    load_ids,
    refuse_absent_half,
)
from transformer_rosetta.app.parity import batch_size
from transformer_rosetta.app.resources import check_forward_fits
from transformer_rosetta.files.outputs import atomic_write, check_output_file
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs


def run_forward_command(args: argparse.Namespace) -> int:
    out_path = check_output_file(
        args.out, force=args.force, suffix=".npz", inputs=(args.weights, args.src, args.tgt)
    )
    config, weights, _ = config_and_weights(args, default_preset=None)
    src, tgt_in = check_inputs(config, *forward_inputs(args, config))
    # 0 for the input a half of the family does not take
    src_len, tgt_len = (0 if ids is None else ids.shape[1] for ids in (src, tgt_in))
    check_forward_fits(config, batch_size(src, tgt_in), src_len, tgt_len, 1, "this forward pass")
    model = build_for(args, config, weights)
    backend, device = get_backend(args.framework), model.device
    args.dtype = model.dtype
    arrays = model.forward(src, tgt_in, attention=not args.no_attention).named()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            # allow_pickle named, so that no array's name can take its place: the arrays are
            # numeric, which np.savez writes the same either way.
            np.savez(f, allow_pickle=False, **arrays)

    atomic_write(out_path, write, size=sum(a.nbytes for a in arrays.values()))
    summary = {
        "kind": config.kind,
        "framework": backend.version(),
        "device": device,
        "dtype": args.dtype,
        "precision": args.precision,
        "out": str(out_path),
        "arrays": {k: list(v.shape) for k, v in arrays.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"wrote {out_path}: {len(arrays)} arrays ({', '.join(list(arrays)[:3])}"
            f"{', ...' if len(arrays) > 3 else ''}) from {backend.version()} on {device}, {args.dtype}"
        )
    return EXIT_OK


def forward_inputs(
    args: argparse.Namespace, config: TransformerConfig
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The ids of --src and --tgt as the model's kind takes them: both for an encoder-decoder,
    --tgt only for a decoder-only model, --src only for an encoder-only one; one line naming the
    option otherwise."""
    given = {"src": args.src is not None, "tgt": args.tgt is not None}
    refuse_absent_half(config, given, "--{key}", "give --{other} only")
    for key, stack, what in (
        ("src", "encoder", "source ids"),
        ("tgt", "decoder", "decoder input ids"),
    ):
        if getattr(config, f"has_{stack}") and getattr(args, key) is None:
            raise UsageError(
                f"--{key}: {config.a_model_of_its_kind} reads {what}; give --{key} {key.upper()}.npy"
            )
    return (
        None if args.src is None else load_ids(args.src, "--src"),
        None if args.tgt is None else load_ids(args.tgt, "--tgt"),
    )


def add_forward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "forward",
        help="run one framework on your ids and save logits, encoder output and attentions (.npz)",
        description=(
            "Run one framework (or the numpy oracle) on token ids you give, and write the logits, "
            "the encoder output and every attention map to one .npz under the canonical names of "
            "docs/PARITY.md, to compare our numbers with an implementation of your own. A "
            "decoder-only model takes --tgt only (and has no encoder output); an encoder-only "
            "model takes --src only (and writes no logits, but its pooled_output when it pools)."
        ),
        epilog="examples:\n  rosetta forward --framework torch --weights m.safetensors --src src.npy "
        "--tgt tgt.npy --out out.npz\n"
        "  rosetta forward --framework jax --weights gpt.safetensors --tgt tgt.npy --out out.npz\n"
        "  rosetta forward --framework tf --weights minilm.safetensors --src src.npy --out out.npz",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", required=True, choices=list(FRAMEWORKS))
    p.add_argument(
        "--weights", required=True, metavar="FILE.safetensors", help="weights in the shared format"
    )
    p.add_argument(
        "--src",
        metavar="SRC.npy",
        help="source ids, integer [batch, S] (a model with an encoder)",
    )
    p.add_argument(
        "--tgt",
        metavar="TGT.npy",
        help="decoder input ids, integer [batch, T], starting with BOS (a model with a decoder)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype (default float32; float64 for numpy, the only one the oracle has)",
    )
    add_precision_argument(p)
    add_device_argument(p)
    p.add_argument(
        "--no-attention",
        action="store_true",
        help="skip the attention maps (takes the fused attention path)",
    )
    p.add_argument("--out", required=True, metavar="OUT.npz", help="where to write the arrays")
    p.add_argument("--force", action="store_true", help="overwrite OUT.npz if it exists")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(run=run_forward_command, seed=0)
