"""`rosetta train`: a small model trained on a generated task, written in the shared format."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.cli.args import EXIT_OK, add_device_argument, positive_int, seed_int
from transformer_rosetta.app.cli.task_models import (
    KIND_WORDS,
    TRAINABLE,
    build,
    load_task_weights,
    run_training,
    tasks_epilog,
)
from transformer_rosetta.app.plots import PNG_BYTES_BOUND
from transformer_rosetta.app.resources import weights_bytes
from transformer_rosetta.app.tasks import TASKS, Task, get_task
from transformer_rosetta.app.trainer import exact_match, initial_weights
from transformer_rosetta.files.outputs import check_free_space, check_output_file
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.weights.format import save_weights


def loss_plot_path(out: Path) -> Path:
    """`rosetta train --plot`'s PNG beside the weights: FILE.loss.png."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".loss.png")


def resume_weights(
    task: Task, path: str, allow_nonfinite: bool
) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """`rosetta train --weights`: the task's config and the file's weights."""
    found, weights = load_task_weights(path, task.name, allow_nonfinite)
    return found.config(), weights


def run_train_command(args: argparse.Namespace) -> int:
    task = get_task(args.task)
    # Every destination is checked before minutes of training, not after.
    out = check_output_file(
        args.out, force=args.force, suffix=".safetensors", inputs=(args.weights,)
    )
    needed = weights_bytes(task.config(), 8 if args.dtype == "float64" else 4)
    if args.plot:
        check_output_file(
            loss_plot_path(out), what="--plot", force=args.force, inputs=(args.weights,)
        )
        needed += PNG_BYTES_BOUND
    if args.weights:
        config, weights = resume_weights(task, args.weights, args.allow_nonfinite)
    else:
        config, weights = initial_weights(task, args.seed)
    check_free_space(out.parent, needed, "--out")  # before training
    model = build(args.framework, config, weights, args.dtype, args.device)
    steps = args.steps or task.steps
    print(f"task {task.name} ({KIND_WORDS[config.kind]}): {task.description}")
    losses = run_training(model, task, steps, args.seed, f"train {args.framework}")
    accuracy, _ = exact_match(model, task, task.test_pairs())
    # A decoder-only model's translation is its greedy continuation of the prompt.
    how = "greedy" if config.has_encoder else "greedy continuation of the prompt"
    print(f"test exact match ({how}, {task.test_size} held-out pairs): {accuracy:.1%}")
    save_weights(out, model.export(), config, get_backend(args.framework).version(), task=task.name)
    print(f"wrote {out}")
    if args.plot:
        from transformer_rosetta.app.plots import plot_loss_curve

        png = loss_plot_path(out)
        plot_loss_curve(losses, png, f"{task.name}, {args.framework}: training loss")
        print(f"wrote {png}")
    return EXIT_OK


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a small model on a generated task and write the shared weight format",
        description=textwrap.fill(
            "Train the task's model from the paper's initialisation with the framework's own Adam "
            "(0.9, 0.98, 1e-9) at the Noam rate, on batches generated on the fly (never a test "
            "source). Shows a progress bar (loss, target tokens/s) on stderr, then the exact-match "
            "accuracy on the held-out test set, and writes the weights with the task's name in "
            "their metadata, for `rosetta translate`. The task sets the model's kind: numbers "
            "trains an encoder-decoder, numbers-lm a decoder-only language model (GPT-style) on "
            "'digits = words' sequences, which translates by continuing the prompt 'digits ='.",
            width=79,
        ),
        epilog=tasks_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", required=True, choices=TRAINABLE)
    p.add_argument("--task", required=True, help=f"one of: {', '.join(TASKS)} (see below)")
    p.add_argument(
        "--steps", type=positive_int, default=None, help="training steps (default: the task's)"
    )
    p.add_argument("--out", required=True, metavar="FILE.safetensors")
    p.add_argument("--force", action="store_true", help="overwrite FILE (and FILE.loss.png)")
    p.add_argument("--plot", action="store_true", help="also write the loss curve, FILE.loss.png")
    p.add_argument(
        "--weights",
        metavar="FILE.safetensors",
        help="start from these weights (resume or fine-tune) instead of a fresh initialisation",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="start from --weights that hold NaN or Inf (refused by default)",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed for the weights and the batches")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    add_device_argument(p)
    p.set_defaults(run=run_train_command)
