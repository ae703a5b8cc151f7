"""`rosetta translate`: text decoded with a trained model, in any framework, greedy or by beam
search."""

from __future__ import annotations

import argparse
import json

from transformer_rosetta.app.cli.args import EXIT_OK, add_device_argument, positive_int
from transformer_rosetta.app.cli.task_models import TRAINABLE, build, check_beam, load_task_weights
from transformer_rosetta.app.trainer import translate


def run_translate_command(args: argparse.Namespace) -> int:
    task, weights = load_task_weights(args.weights, args.task, args.allow_nonfinite)
    check_beam(task, args.text, args.beam)
    model = build(args.framework, task.config(), weights, args.dtype, args.device)
    outputs = translate(model, task, args.text, beam=args.beam)
    if args.json:
        print(
            json.dumps([{"input": t, "output": o} for t, o in zip(args.text, outputs, strict=True)])
        )
    else:
        width = max(len(t) for t in args.text)
        for text, out in zip(args.text, outputs, strict=True):
            print(f"{text:>{width}}  ->  {out}")
    return EXIT_OK


def add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text with a trained model, in any framework",
        description=(
            "Decode with the framework's key/value cache: greedy, or beam search with --beam "
            "(GNMT length penalty 0.6, at most source length + 50 tokens). The task (and so the "
            "tokenizer) comes from the weight file's metadata, as `rosetta train` wrote it. A "
            "decoder-only model (task numbers-lm) continues the prompt it makes of each input "
            "('71' -> '0 0 0 0 7 1 =') by at most 50 tokens, and prints the continuation."
        ),
    )
    p.add_argument("text", nargs="+", help="one or more inputs, e.g. 40213")
    p.add_argument("--framework", required=True, choices=TRAINABLE)
    p.add_argument("--weights", required=True, metavar="FILE.safetensors")
    p.add_argument("--beam", type=positive_int, default=1, help="beam size (default 1: greedy)")
    p.add_argument("--task", help="the task, for a weight file that does not name one")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    add_device_argument(p)
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="decode with weights that hold NaN or Inf (refused by default)",
    )
    p.add_argument("--json", action="store_true", help="print the translations as JSON")
    p.set_defaults(run=run_translate_command)
