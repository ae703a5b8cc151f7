"""`rosetta train`: a small model trained on a generated task, written in the shared format."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

import numpy as np

from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.cli.args import (
    EXIT_OK,
    UsageError,
    add_device_argument,
    mesh_arg,
    positive_int,
    seed_int,
    size_arg,
)
from transformer_rosetta.app.cli.task_models import (
    KIND_WORDS,
    TRAINABLE,
    build,
    load_task_weights,
    run_training,
    tasks_epilog,
)
from transformer_rosetta.app.distributed import (
    check_mesh_framework,
    check_processes,
    is_main_process,
    train_task_on_mesh,
)
from transformer_rosetta.app.plots import PNG_BYTES_BOUND
from transformer_rosetta.app.resources import weights_bytes
from transformer_rosetta.app.tasks import TASKS, Task, get_task
from transformer_rosetta.app.trainer import exact_match, initial_weights
from transformer_rosetta.files.outputs import (
    check_free_space,
    check_output_file,
    check_output_folder,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.mesh import MeshShape, check_mesh
from transformer_rosetta.weights.format import planned_files, save_weights
from transformer_rosetta.weights.shards import replaced_files


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
    if args.max_shard_size is None:
        out = check_output_file(
            args.out, force=args.force, suffix=".safetensors", inputs=(args.weights,)
        )
    else:  # a folder of shards: each file it will hold, and the stale ones it replaces
        planned = planned_files(task.config(), args.dtype, args.max_shard_size)
        out = check_output_folder(
            args.out,
            replaced_files(args.out, planned),
            what="--out",
            force=args.force,
            inputs=(args.weights,),
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
    mesh = training_mesh(args, config, task.batch_size)
    steps = args.steps or task.steps
    main = is_main_process()
    if main:
        print(f"task {task.name} ({KIND_WORDS[config.kind]}): {task.description}")
    if mesh is None:
        model = build(args.framework, config, weights, args.dtype, args.device)
        losses = run_training(model, task, steps, args.seed, f"train {args.framework}")
    else:
        losses, weights = run_mesh_training(args, task, config, weights, steps, mesh)
        if not main:  # under torchrun or JAX's processes, process 0 alone evaluates and writes
            return EXIT_OK
        model = build(args.framework, config, weights, args.dtype, "auto")
    accuracy, _ = exact_match(model, task, task.test_pairs())
    # A decoder-only model's translation is its greedy continuation of the prompt.
    how = "greedy" if config.has_encoder else "greedy continuation of the prompt"
    print(f"test exact match ({how}, {task.test_size} held-out pairs): {accuracy:.1%}")
    producer = get_backend(args.framework).version()
    save_weights(
        out, model.export(), config, producer, task=task.name, max_shard_size=args.max_shard_size
    )
    print(f"wrote {out}")
    if args.plot:
        from transformer_rosetta.app.plots import plot_loss_curve

        png = loss_plot_path(out)
        plot_loss_curve(losses, png, f"{task.name}, {args.framework}: training loss")
        print(f"wrote {png}")
    return EXIT_OK


def training_mesh(
    args: argparse.Namespace, config: TransformerConfig, batch: int
) -> MeshShape | None:
    """The mesh --data-parallel or --mesh asks for (None: one device), checked against the
    model and the task's batch before anything starts."""
    mesh = MeshShape(data=args.data_parallel) if args.data_parallel else args.mesh
    if mesh is None:
        return None
    check_mesh_framework(args.framework)
    if args.device != "auto":
        raise UsageError(
            f"--device {args.device}: a mesh run uses the devices its engine sees; "
            "leave --device out with --data-parallel or --mesh"
        )
    check_mesh(mesh, config, batch=batch)
    check_processes(args.framework, mesh)  # JAX_NUM_PROCESSES and the rest, where set
    return mesh


def run_mesh_training(
    args: argparse.Namespace,
    task: Task,
    config: TransformerConfig,
    weights: dict[str, np.ndarray],
    steps: int,
    mesh: MeshShape,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train on the mesh with the framework's own engine; the losses and the trained weights."""
    if is_main_process():
        print(f"training on the mesh {mesh} ({args.framework}'s engine): {steps} steps", flush=True)
    result, trained = train_task_on_mesh(
        args.framework, task, config, weights, steps, mesh, seed=args.seed, dtype=args.dtype
    )
    if is_main_process():
        print(
            f"trained {steps} steps in {result.seconds:.1f} s "
            f"({result.tokens_per_second:,.0f} target tokens/s), "
            f"final loss {result.losses[-1]:.3f}"
        )
    return result.losses, trained


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
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE.safetensors",
        help="the weights to write (with --max-shard-size, a folder of shards)",
    )
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        metavar="SIZE",
        help="write --out as a folder of shards in Hugging Face's layout, each at most SIZE of "
        "tensor bytes (2GB, 200MB, 500KB, 1GiB, or bytes), as `rosetta convert` does",
    )
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
    spread = p.add_mutually_exclusive_group()
    spread.add_argument(
        "--data-parallel",
        type=positive_int,
        metavar="N",
        help="train on N devices, each on 1/N of every batch, with the framework's own engine "
        "(torch: DDP, one process per device; jax: a jax.sharding mesh; tf: "
        "keras.distribution on Keras's JAX backend); the same as --mesh data=N. On a CPU the "
        "devices are the cores (torch) or N host devices (jax, tf). Across processes or hosts, "
        "run the same command in each: under torchrun (torch), or with JAX_COORDINATOR_ADDRESS="
        "host:port, JAX_NUM_PROCESSES=P and JAX_PROCESS_ID=i set (jax; N/P devices each)",
    )
    spread.add_argument(
        "--mesh",
        type=mesh_arg,
        metavar="data=D,model=M",
        help="train on D x M devices: D data replicas, and the parameters sharded over M "
        "(torch: FSDP2; jax: heads and feed-forward split by sharding annotations; tf: "
        "keras.distribution.ModelParallel with a LayoutMap). The weights written are the "
        "same shared format, loadable at any device count. Processes: as --data-parallel",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="seed for the weights and the batches")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    add_device_argument(p)
    p.set_defaults(run=run_train_command)
