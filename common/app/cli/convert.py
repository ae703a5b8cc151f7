"""`rosetta convert`: weights between the shared format, native checkpoints and outside models
(torch.nn.Transformer, Marian); see common/porting/convert.py."""

from __future__ import annotations

import argparse
import json

from common.app.cli.args import EXIT_OK
from common.spec.config import TransformerConfig


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
