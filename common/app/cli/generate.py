"""`rosetta generate`: continue prompts with a decoder-only model (an imported GPT-2, nanoGPT or
minGPT, or one of ours) in any framework: greedy, beam search, or seeded sampling that gives the
same tokens in every framework for the same seed (transformer_rosetta.app.generation)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from transformer_rosetta.adapter.backends import FRAMEWORKS
from transformer_rosetta.app.cli.args import (
    EXIT_OK,
    UsageError,
    add_device_argument,
    add_precision_argument,
    build_for,
    config_and_weights,
    positive_int,
    seed_int,
)
from transformer_rosetta.app.generation import check_generation, generate_ids
from transformer_rosetta.files.outputs import shown
from transformer_rosetta.weights.tokenizer import read_tokenizer

SAMPLING_OPTIONS = ("temperature", "top_k", "top_p")


def ids_arg(text: str) -> list[int]:
    """An argparse type: comma-separated token ids, "5,17,42"."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token ids, e.g. 5,17,42"
        )
    return [int(p) for p in parts]


def number_arg(text: str) -> float:
    """An argparse type: a finite number (its range is checked by the sampler, by name)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def check_options(args: argparse.Namespace) -> None:
    """What argparse cannot say: one source of prompts, and sampling options only with --sample."""
    if args.ids and args.text:
        raise UsageError("give --ids or --text, not both")
    given = [f"--{o.replace('_', '-')}" for o in SAMPLING_OPTIONS if getattr(args, o) is not None]
    if given and not args.sample:
        raise UsageError(f"{given[0]} applies to --sample; add --sample or leave it out")


def prompt_texts(args: argparse.Namespace) -> list[str] | None:
    """The texts to continue: --text, else the lines of standard input when no --ids is given
    (blank lines skipped); None for --ids."""
    if args.ids:
        return None
    if args.text:
        return list(args.text)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("give --ids 5,17,42, --text TEXT, or text lines on standard input")
    lines = [line.rstrip("\r\n") for line in sys.stdin]
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise UsageError("standard input holds no text; give --ids, --text or text lines")
    return texts


def run_generate_command(args: argparse.Namespace) -> int:
    check_options(args)
    texts = prompt_texts(args)
    config, weights, _ = config_and_weights(args, default_preset=None)
    tokenizer = read_tokenizer(args.weights)
    if texts is None:
        prompts = list(args.ids)
    elif tokenizer is None:
        source = "--text" if args.text else "standard input"
        raise UsageError(
            f"{source}: {shown(args.weights)} carries no tokenizer; give --ids, or convert the "
            "model from its folder (with its tokenizer.json) so that the tokenizer travels with it"
        )
    else:
        prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    strategy = "sample" if args.sample else ("beam" if args.beam else "greedy")
    options: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "strategy": strategy,
        "beam": args.beam or 1,
        "temperature": 1.0 if args.temperature is None else args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
    }
    check_generation(config, prompts, **options, stop_at_eos=True)  # before building anything
    model = build_for(args, config, weights)
    new = generate_ids(model, prompts, **options, seed=args.seed, cached=not args.no_cache)
    results: list[dict[str, Any]] = [{"ids": ids} for ids in new]
    if tokenizer is not None:
        for result in results:
            result["text"] = tokenizer.decode(result["ids"], skip_special_tokens=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
    else:
        for result in results:
            print("ids: " + " ".join(map(str, result["ids"])))
            if "text" in result:
                print(f"text: {result['text']}")
    return EXIT_OK


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue prompts with a decoder-only model (GPT-2, nanoGPT, minGPT), in any framework",
        description=textwrap.fill(
            "Continue each prompt with a decoder-only model in one framework, through its "
            "key/value cache (--no-cache: the whole prefix at every step). Greedy by default "
            "(argmax, ties to the lower id: transformers' generate(do_sample=False)); --beam K "
            "runs beam search (GNMT length penalty 0.6); --sample draws with transformers' "
            "temperature, then top-k, then top-p, from a seeded generator on the host, so that "
            "every framework gives the same tokens for the same --seed. Prompts are --ids, or "
            "text (--text, or one prompt per line on standard input) when the weight file carries "
            "a tokenizer (`rosetta convert` stores the one of a model folder). Prints the new "
            "tokens (with the EOS that ended a prompt, as transformers does), and their text when "
            "there is a tokenizer.",
            width=88,
        ),
        epilog=(
            "examples:\n"
            "  rosetta convert ./gpt2-folder gpt2.safetensors --from gpt2\n"
            "  rosetta generate --weights gpt2.safetensors --ids 5,17,42 --max-new-tokens 12\n"
            "  rosetta generate --weights gpt2.safetensors --framework tf --ids 5,17,42 "
            "--max-new-tokens 12 --json\n"
            '  rosetta generate --weights gpt2.safetensors --text "Hello, my dog" '
            "--max-new-tokens 20 --sample --top-p 0.9 --temperature 0.8 --seed 7\n"
            "  printf 'one\\ntwo\\n' | rosetta generate --weights gpt2.safetensors "
            "--max-new-tokens 5 --beam 4 --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--weights", required=True, metavar="FILE.safetensors", help="weights in the shared format"
    )
    p.add_argument("--framework", choices=list(FRAMEWORKS), default="torch", help="default: torch")
    add_device_argument(p)
    p.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype (default float32; float64 for numpy, the only one the oracle has)",
    )
    add_precision_argument(p)
    prompts = p.add_argument_group("prompts (one of; standard input's lines when none is given)")
    prompts.add_argument(
        "--ids",
        type=ids_arg,
        action="append",
        metavar="5,17,42",
        help="a prompt as comma-separated token ids; repeat for several",
    )
    prompts.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="a prompt as text (the weight file's tokenizer encodes it); repeat for several",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        required=True,
        metavar="N",
        help="new tokens per prompt at most (fewer when EOS comes first)",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument("--beam", type=positive_int, metavar="K", help="beam search with K beams")
    how.add_argument("--sample", action="store_true", help="sample (seeded) instead of argmax")
    sampling = p.add_argument_group("sampling (with --sample)")
    sampling.add_argument(
        "--temperature", type=number_arg, metavar="T", help="divide the logits by T > 0 (1)"
    )
    sampling.add_argument(
        "--top-k", type=positive_int, metavar="K", help="keep the K most likely tokens (all)"
    )
    sampling.add_argument(
        "--top-p",
        type=number_arg,
        metavar="P",
        help="keep the most likely tokens whose probabilities sum to P, 0 < P <= 1 (1)",
    )
    sampling.add_argument(
        "--seed", type=seed_int, default=0, help="the sampler's seed, 0 to 2**32 - 1 (0)"
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the whole prefix at every step instead of using the key/value cache",
    )
    p.add_argument("--json", action="store_true", help='print {"ids": [...]} (a list for several)')
    p.set_defaults(run=run_generate_command)
