"""`rosetta convert` and `rosetta export`: weights between the shared format, native checkpoints
and outside models (torch.nn.Transformer, Marian, the tutorials' models, ONNX); see
common/porting/convert.py."""

from __future__ import annotations

import argparse
import json
import sys

from transformer_rosetta.app.cli.args import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    positive_int,
    size_arg,
)
from transformer_rosetta.spec.config import read_config_fields


def run_convert_command(args: argparse.Namespace) -> int:
    from transformer_rosetta.porting.convert import convert
    from transformer_rosetta.porting.user_map import load_map
    from transformer_rosetta.porting.verify import VerificationFailed

    max_shard_size = getattr(args, "max_shard_size", None)  # `rosetta export` has none
    if max_shard_size is not None:
        refuse_shards_for_another_kind(args.dst, args.to_kind)
    # The fields as written: a table kind takes what the model does not fix from them.
    config = read_config_fields(args.config) if args.config else None
    table = load_map(args.map) if args.map else None
    onnx = {
        key: value
        for key, value in (
            ("graph", args.graph),
            ("attention", args.attention or None),
            ("max_steps", args.max_steps),
        )
        if value is not None
    }
    try:
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
            verify=args.verify,
            onnx=onnx or None,
            max_shard_size=max_shard_size,
            progress=lambda message: print(f"  {message}", file=sys.stderr, flush=True),
        )
    except VerificationFailed as exc:  # the work ran and its result is wrong: exit 1, not 2
        print(f"rosetta: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
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
                    "notes": list(done.notes),
                    "config": done.config.to_dict(),
                    "provenance": json.loads(done.provenance.to_json())
                    if done.provenance
                    else None,
                },
                indent=2,
            )
        )
    else:
        print(done.summary())
    return EXIT_OK


def refuse_shards_for_another_kind(dst: str, to_kind: str | None) -> None:
    """--max-shard-size writes the shared format's sharded folder; any other kind, asked for by
    --to or by DST's name, is a usage mistake, refused before any work."""
    from pathlib import Path

    from transformer_rosetta.porting.convert import kind_from_suffix

    kind = to_kind or kind_from_suffix(Path(dst))
    if kind not in (None, "rosetta"):
        raise UsageError(
            f"--max-shard-size writes the shared format (a folder of .safetensors shards), not "
            f"{kind}: give a folder as DST, or drop --max-shard-size"
        )


def add_convert(sub: argparse._SubParsersAction) -> None:
    from transformer_rosetta.porting.convert import (
        EXPORT_KINDS,
        EXPORT_ONLY_KINDS,
        IMPORT_KINDS,
        KINDS,
    )

    p = sub.add_parser(
        "convert",
        help="move weights between the shared format, native checkpoints and outside models",
        description=(
            "Convert SRC to DST. Kinds: rosetta (the shared .safetensors), torch (our torch "
            "state_dict, .pt/.bin), keras (our .weights.h5), flax (our .msgpack), and, as sources "
            "only: nn-transformer (a torch.nn.Transformer state_dict with the user's embeddings "
            "and output Linear), marian (a Hugging Face MarianMTModel folder; also written, with --to "
            "marian: a folder that transformers loads), bert (a Hugging Face BERT folder, encoder only, "
            "with a sentence-transformers pooling when it has one; the pooler is dropped, and "
            "said so), onnx (written only: an ONNX graph, as "
            "`rosetta export` writes), annotated (the "
            "Annotated Transformer's state_dict), pytorch-tutorial (the PyTorch translation "
            "tutorial's Seq2SeqTransformer), tf-tutorial-v1 and tf-tutorial-v2 (the older and the "
            "current TensorFlow Transformer tutorial, .weights.h5), keras-prenorm (the Keras "
            "pre-norm Transformer of seed text 004, .weights.h5), mingpt and nanogpt (Karpathy's "
            "minGPT and nanoGPT state_dicts, decoder-only), gpt2 (a Hugging Face GPT2LMHeadModel "
            "or GPT2Model, model.safetensors or a state_dict), llama (a Hugging Face "
            "LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM folder; also written, with "
            "--to llama: a folder that transformers loads), meta-llama (Meta's original layout: "
            "params.json and consolidated.NN.pth; --config gives bos_id and eos_id), "
            "encoder-gpt (also seed-gpt: a GPT "
            "class made of embedding, encoder and out, its encoder the 'Transformers from "
            "Scratch' stack of one AttentionHead per head, run with a causal mask; its "
            "positions computed from its own formula), and map "
            "(your own model, named by "
            "--map MAP.json; docs/PORTING.md). Kinds are inferred from the names (and a .pt's or "
            ".h5's tensor names) where that is unambiguous. For an outside model, --config gives "
            "what the file cannot tell (num_heads, the special ids); the sizes are read from the "
            "shapes, and a field that contradicts the model is refused by name. The whole source "
            "is validated first, every problem reported at once; DST is written atomically and "
            "never overwritten without --force. torch files are read with weights_only=True and "
            ".h5 files with h5py: no pickle code ever runs. Conversions stream: the shared format "
            "(one file, or a folder or index.json of shards) is mapped, and torch, Keras and Flax "
            "checkpoints are written and read one tensor at a time without building a model, so a "
            "conversion holds about one tensor beyond the framework's own memory (a Flax array "
            "over 1 GiB, which Flax stores in chunks, is joined into one copy when read). --verify "
            "runs the source's model, frees it, then runs the destination's."
        ),
        epilog=(
            "examples:\n  rosetta convert model.safetensors model.pt --config config.json\n"
            "  rosetta convert model.pt model.weights.h5 --config config.json\n"
            "  rosetta convert my_nn_transformer.pt model.safetensors --from nn-transformer --config c.json\n"
            "  rosetta convert ./opus-mt-folder model.safetensors\n"
            "  rosetta convert model.safetensors ./my-marian-folder --to marian\n"
            "  rosetta convert ./Qwen2-0.5B qwen2.safetensors   # a Llama, Mistral or Qwen2 folder\n"
            "  rosetta convert llama.safetensors ./my-llama-folder --to llama\n"
            "  rosetta convert ./llama-2-7b llama.safetensors --from meta-llama --config ids.json   "
            '# ids.json: {"bos_id": 1, "eos_id": 2}\n'
            "  rosetta convert ./all-MiniLM-L6-v2 minilm.safetensors --from bert\n"
            "  rosetta convert model.safetensors model.onnx   # or: rosetta export\n"
            "  rosetta convert big.safetensors shards/ --max-shard-size 200MB\n"
            "  rosetta convert annotated.pt model.safetensors --config heads.json   "
            '# heads.json: {"num_heads": 8}\n'
            "  rosetta convert mine.pt model.safetensors --map mine.map.json --config heads.json\n"
            "  rosetta convert gpt.pt gpt.safetensors --from mingpt --config ids.json   "
            '# ids.json: {"num_heads": 6, "pad_id": 0, "bos_id": 1, "eos_id": 2}'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "src",
        help="the file (or Marian, BERT, Llama or Meta Llama folder, or a sharded model's folder "
        "or index) to read",
    )
    p.add_argument(
        "dst",
        help="the file (or, with --to marian, --to llama or --max-shard-size, the folder) to write",
    )
    p.add_argument("--from", dest="from_kind", choices=list(KINDS), help="the source kind")
    p.add_argument(
        "--to",
        dest="to_kind",
        choices=[k for k in KINDS if k not in IMPORT_KINDS or k in EXPORT_KINDS]
        + list(EXPORT_ONLY_KINDS),
        help="the destination kind",
    )
    p.add_argument(
        "--config",
        metavar="FILE.json",
        help="the model's config, for sources that do not carry one (torch, keras, flax, "
        "nn-transformer); for the tutorials' models, --map, gpt2, llama and meta-llama, only the "
        'fields the files cannot tell (e.g. {"num_heads": 8}; {"pad_id": 0}): a file, or the '
        "JSON itself when it starts with {",
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
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        metavar="SIZE",
        help="write the shared format as a folder DST of shards in Hugging Face's layout "
        "(model-00001-of-0000N.safetensors and model.safetensors.index.json; one "
        "model.safetensors when all fits), each at most SIZE of tensor bytes unless one tensor "
        "is larger: 2GB, 200MB, 500KB (powers of 10, as transformers reads them), 1GiB, or bytes",
    )
    add_writing_arguments(p)
    p.set_defaults(run=run_convert_command)


VERIFY_HELP = (
    "after writing, run the source and the written file on seeded ragged probes and check their "
    "largest logit difference against the parity bound of the less precise side; the record (difference, probe "
    "seed and shapes, the source's sha256, versions) goes into the file's metadata, and a file "
    "that misses the bound is removed (exit 1). Default: on wherever both sides can run here; "
    "--verify requires it, --no-verify skips it"
)


def add_writing_arguments(p: argparse.ArgumentParser, onnx_only: bool = False) -> None:
    """What convert and export share: verification, the ONNX graph's options, --force, --json."""
    p.add_argument(
        "--verify", action=argparse.BooleanOptionalAction, default=None, help=VERIFY_HELP
    )
    onnx = p.add_argument_group("ONNX" if onnx_only else "ONNX (--to onnx)")
    onnx.add_argument(
        "--graph",
        choices=["forward", "encoder", "decoder_step"],
        help="forward (default): src, tgt_in -> logits, encoder_output; encoder: src -> the "
        "decoding cache; decoder_step: tokens and the cache (past.*) -> logits and the next "
        "cache (present.*)",
    )
    onnx.add_argument(
        "--attention",
        action="store_true",
        help="the forward graph also outputs every attention map (the explicit path)",
    )
    onnx.add_argument(
        "--max-steps",
        type=positive_int,
        metavar="N",
        help="positions the decoding cache holds (encoder and decoder_step; default max_len)",
    )
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert weights that hold NaN or Inf (refused by default)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_export_command(args: argparse.Namespace) -> int:
    args.to_kind = "onnx"
    return run_convert_command(args)


def add_export(sub: argparse._SubParsersAction) -> None:
    from transformer_rosetta.porting.convert import KINDS

    p = sub.add_parser(
        "export",
        help="write a model as ONNX (torch's exporter), checked by onnxruntime",
        description=(
            "Export SRC (any weights `rosetta convert` reads) as one ONNX graph of the torch "
            "implementation, made by torch's own exporter (torch.onnx, dynamo=True) and checked "
            "by onnx.checker. Batch and lengths are dynamic (lengths up to max_len); the masks "
            "are built from the ids inside the graph (pad_id from the config). The same as "
            "`rosetta convert SRC OUT.onnx --to onnx`. Needs the onnx extra: "
            "pip install 'transformer-rosetta[onnx]'. By default the written graph is run by "
            "onnxruntime against the float64 oracle on seeded probes, and the result is stored "
            "in its metadata_props (`rosetta inspect OUT.onnx` shows it)."
        ),
        epilog=(
            "examples:\n  rosetta export model.safetensors model.onnx\n"
            "  rosetta export model.safetensors encoder.onnx --graph encoder --max-steps 64\n"
            "  rosetta export model.safetensors step.onnx --graph decoder_step --max-steps 64\n"
            "  rosetta parity --frameworks onnx,torch,jax   # the exported graph against the oracle"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="the weights to export (.safetensors, or any kind convert reads)")
    p.add_argument("dst", help="the .onnx file to write")
    p.add_argument("--from", dest="from_kind", choices=list(KINDS), help="the source kind")
    p.add_argument(
        "--config",
        metavar="FILE.json",
        help="the model's config, for sources that do not carry one (as in convert: a file, "
        "or the JSON itself when it starts with {)",
    )
    p.set_defaults(map=None, learned_positions=False)
    add_writing_arguments(p, onnx_only=True)
    p.set_defaults(run=run_export_command)
