"""`rosetta embed`: sentence embeddings from an encoder-only model in any framework, from text
through the tokenizer its weight file carries (`rosetta convert` stores an imported folder's),
or from token ids. For a converted sentence-transformers model they are what its `encode` gives
(transformer_rosetta.app.embedding)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    positive_int,
)
from transformer_rosetta.app.embedding import check_embeddable, embed_ids, embed_texts
from transformer_rosetta.files.outputs import atomic_write, check_output_file, shown
from transformer_rosetta.weights.tokenizer import read_tokenizer

SHOWN_VALUES = 4  # the first values the default output prints of each embedding
PREVIEW_CHARS = 40  # how much of each text the default output repeats
STDIN = "-"


def run_embed_command(args: argparse.Namespace) -> int:
    """Every check (arguments, output file, weight file, model kind, tokenizer, backend, device,
    the texts themselves) before the model is built; then one embedding per text."""
    if args.ids is not None and args.texts:
        raise UsageError("give TEXT arguments (or stdin) or --ids, not both")
    out_path = None
    if args.out is not None:
        out_path = check_output_file(
            args.out, force=args.force, suffix=".npy", inputs=(args.weights, args.ids)
        )
    tokenizer = None if args.ids is not None else read_tokenizer(args.weights)
    config, weights, _ = config_and_weights(args, default_preset=None)
    check_embeddable(config)
    if args.ids is None and tokenizer is None:
        raise UsageError(
            f"{shown(args.weights)} carries no tokenizer: convert the model again from its source "
            "folder (with tokenizer.json or vocab.txt), which stores it, or give token ids with "
            "--ids IDS.npy (or run `rosetta forward` on them)"
        )
    ids = load_ids(args.ids, "--ids") if args.ids is not None else None
    texts = None if ids is not None else read_texts(args.texts)
    model = build_for(args, config, weights)
    backend, device = get_backend(args.framework), model.device
    args.dtype = model.dtype
    if ids is not None:
        embeddings = np.concatenate(
            [
                embed_ids(model, ids[i : i + args.batch_size])
                for i in range(0, len(ids), args.batch_size)
            ]
        )
    else:
        # Without --ids the texts were read, and a file without a tokenizer refused, above.
        assert tokenizer is not None and texts is not None
        embeddings = embed_texts(model, tokenizer, texts, batch_size=args.batch_size)
    if out_path is not None:
        write_npy(out_path, embeddings)
    summary = {
        "framework": args.framework,
        "framework_version": backend.version(),
        "device": device,
        "dtype": args.dtype,
        "count": int(embeddings.shape[0]),
        "dim": int(embeddings.shape[1]),
        "out": None if out_path is None else str(out_path),
        "embeddings": embeddings.tolist(),
    }
    if args.json:
        print(json.dumps(summary))
    elif out_path is not None:
        print(
            f"wrote {out_path}: {embeddings.shape[0]} embeddings of {embeddings.shape[1]} "
            f"({embeddings.dtype}) from {backend.version()} on {device}, {args.dtype}"
        )
    else:
        print_rows(embeddings, texts)
    return EXIT_OK


def read_texts(given: list[str]) -> list[str]:
    """The TEXT arguments, or standard input's lines (one text a line) for none or `-`."""
    if given and given != [STDIN]:
        if STDIN in given:
            raise UsageError("TEXT: '-' (read standard input) cannot be mixed with other texts")
        return list(given)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(
            "no text given: give TEXT arguments, or pipe texts on standard input, one a line"
        )
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"standard input is not UTF-8 text (byte {exc.start})") from None
    lines = data.splitlines()
    if not lines:
        raise UsageError("standard input is empty: give one text a line")
    return lines


def write_npy(path: Path, embeddings: np.ndarray) -> None:
    """The embeddings as one .npy (float32, or float64 from a float64 model), written atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, embeddings)

    atomic_write(path, write, size=embeddings.nbytes + 128)


def print_rows(embeddings: np.ndarray, texts: list[str] | None) -> None:
    """One line per text: its index, the dimension, the first values, and the text's start."""
    for n, row in enumerate(embeddings):
        values = " ".join(f"{v:+.4f}" for v in row[:SHOWN_VALUES])
        more = " ..." if row.size > SHOWN_VALUES else ""
        line = f"{n}: dim {row.size} [{values}{more}]"
        if texts is not None:
            text = texts[n]
            preview = text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."
            line += f"  {json.dumps(preview, ensure_ascii=False)}"
        print(line)


def add_embed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embed",
        help="sentence embeddings of texts from an encoder-only model (any framework)",
        description=(
            "Sentence embeddings from an encoder-only model that pools (a converted "
            "sentence-transformers BERT such as all-MiniLM-L6-v2): each text goes through the "
            "tokenizer the weight file carries (rosetta convert stores the source folder's), "
            "texts are batched and padded with the model's pad id, and each row is the pooled "
            "output the config names (mean over the tokens, then the L2 norm for MiniLM), as "
            "sentence-transformers' encode gives it, in the framework you choose. With no TEXT, "
            "or '-', the texts are read from standard input, one a line. --ids takes token ids "
            "you tokenised yourself (padded with the model's pad id) instead."
        ),
        epilog="examples:\n"
        "  rosetta convert ./all-MiniLM-L6-v2 minilm.safetensors --from bert\n"
        '  rosetta embed --weights minilm.safetensors "first sentence" "second one"\n'
        "  rosetta embed --weights minilm.safetensors --framework jax --out emb.npy "
        '"first sentence" "second one"\n'
        "  cat sentences.txt | rosetta embed --weights minilm.safetensors --json\n"
        "  rosetta embed --weights minilm.safetensors --framework numpy --ids ids.npy --out e.npy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "texts",
        nargs="*",
        metavar="TEXT",
        help="texts to embed; none, or '-', reads standard input, one text a line",
    )
    p.add_argument(
        "--weights",
        required=True,
        metavar="FILE.safetensors",
        help="an encoder-only model in the shared format, with its tokenizer",
    )
    p.add_argument("--framework", default="torch", choices=list(FRAMEWORKS), help="default torch")
    p.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16"],
        help="compute dtype (default float32; float64 for numpy, the only one the oracle has)",
    )
    add_precision_argument(p)
    add_device_argument(p)
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="texts per forward pass (default 32)",
    )
    p.add_argument(
        "--ids",
        metavar="IDS.npy",
        help="pre-tokenised input instead of text: integer [N, S], padded with the pad id",
    )
    p.add_argument(
        "--out",
        metavar="EMB.npy",
        help="write the embeddings [N, dim] to a .npy (float32; float64 from a float64 run)",
    )
    p.add_argument("--force", action="store_true", help="overwrite EMB.npy if it exists")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"framework", "dim", "embeddings": [[...], ...], ...} as JSON',
    )
    p.set_defaults(run=run_embed_command, seed=0)
