"""`rosetta convert`: weights between the shared format, native checkpoints and outside models
(torch.nn.Transformer, Marian); see common/porting/convert.py."""

from __future__ import annotations

import argparse
import json

from common.app.cli.args import EXIT_OK
from common.spec.config import read_config_fields


def run_convert_command(args: argparse.Namespace) -> int:
    from common.porting.convert import convert
    from common.porting.user_map import load_map

    # The fields as written: a table kind takes what the model does not fix from them.
    config = read_config_fields(args.config) if args.config else None
    table = load_map(args.map) if args.map else None
    done = convert(
        args.src,
        args.dst,
        from_kind=args.from_kind,
        to_kind=args.to_kind,
        config=config,
        force=args.force,
        allow_nonfinite=args.allow_nonfinite,
        also_read=(args.config, args.map),
        table=table,
        learned_positions=args.learned_positions,
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
    from common.porting.convert import EXPORT_KINDS, IMPORT_KINDS, KINDS

    p = sub.add_parser(
        "convert",
        help="move weights between the shared format, native checkpoints and outside models",
        description=(
            "Convert SRC to DST. Kinds: rosetta (the shared .safetensors), torch (our torch "
            "state_dict, .pt/.bin), keras (our .weights.h5), flax (our .msgpack), and, as sources "
            "only: nn-transformer (a torch.nn.Transformer state_dict with the user's embeddings "
            "and output Linear), marian (a Hugging Face MarianMTModel folder; also written, with --to "
            "marian: a folder that transformers loads), annotated (the "
            "Annotated Transformer's state_dict), pytorch-tutorial (the PyTorch translation "
            "tutorial's Seq2SeqTransformer), tf-tutorial-v1 and tf-tutorial-v2 (the older and the "
            "current TensorFlow Transformer tutorial, .weights.h5), keras-prenorm (the Keras "
            "pre-norm Transformer in TF1 style, .weights.h5), and map (your own model, named by "
            "--map MAP.json; docs/PORTING.md). Kinds are inferred from the names (and a .pt's or "
            ".h5's tensor names) where that is unambiguous. For an outside model, --config gives "
            "what the file cannot tell (num_heads, the special ids); the sizes are read from the "
            "shapes, and a field that contradicts the model is refused by name. The whole source "
            "is validated first, every problem reported at once; DST is written atomically and "
            "never overwritten without --force. torch files are read with weights_only=True and "
            ".h5 files with h5py: no pickle code ever runs."
        ),
        epilog=(
            "examples:\n  rosetta convert model.safetensors model.pt --config config.json\n"
            "  rosetta convert model.pt model.weights.h5 --config config.json\n"
            "  rosetta convert my_nn_transformer.pt model.safetensors --from nn-transformer --config c.json\n"
            "  rosetta convert ./opus-mt-folder model.safetensors\n"
            "  rosetta convert model.safetensors ./my-marian-folder --to marian\n"
            "  rosetta convert annotated.pt model.safetensors --config heads.json   "
            '# heads.json: {"num_heads": 8}\n'
            "  rosetta convert mine.pt model.safetensors --map mine.map.json --config heads.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="the file (or Marian folder) to read")
    p.add_argument("dst", help="the file (or, with --to marian, the folder) to write")
    p.add_argument("--from", dest="from_kind", choices=list(KINDS), help="the source kind")
    p.add_argument(
        "--to",
        dest="to_kind",
        choices=[k for k in KINDS if k not in IMPORT_KINDS or k in EXPORT_KINDS],
        help="the destination kind",
    )
    p.add_argument(
        "--config",
        metavar="FILE.json",
        help="the model's config, for sources that do not carry one (torch, keras, flax, "
        "nn-transformer); for the tutorials' models and --map, only the fields the file cannot "
        'tell (e.g. {"num_heads": 8})',
    )
    p.add_argument(
        "--map",
        metavar="MAP.json",
        help="your own model's table: source names -> canonical names and the steps between "
        "(implies --from map; docs/PORTING.md has a worked example)",
    )
    p.add_argument(
        "--learned-positions",
        action="store_true",
        help="import a stored position table that is not the claimed sinusoid as learned "
        "positions (refused by default)",
    )
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert weights that hold NaN or Inf (refused by default)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=run_convert_command)
