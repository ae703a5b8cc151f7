"""What `rosetta train`, `rosetta translate` and `rosetta demo` share: the frameworks that train, a
model built or refused in one line, training with a progress bar, a task's weights from a file,
and the beam check. A model's whole life on a generated task (common/app/tasks.py), in any
framework, through the adapter."""

from __future__ import annotations

import numpy as np

from transformer_rosetta.adapter.backends import FRAMEWORKS, Model, unavailable_reason
from transformer_rosetta.app.cli.args import UsageError
from transformer_rosetta.app.model import build_model
from transformer_rosetta.app.progress import ProgressBar
from transformer_rosetta.app.resources import check_fits, decode_bytes
from transformer_rosetta.app.tasks import TASKS, Task, get_task
from transformer_rosetta.app.trainer import train
from transformer_rosetta.decoding.search import EXTRA_LEN
from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.weights.format import META_TASK, check_finite, load_weights

TRAINABLE = tuple(f for f in FRAMEWORKS if f != "numpy")


def build(
    framework: str,
    config: TransformerConfig,
    weights: dict[str, np.ndarray],
    dtype: str,
    device: str = "cpu",
) -> Model:
    """The framework's model on the device a --device request names (transformer_rosetta.app.cli.args
    DEVICE_HELP), or a one-line UsageError naming why the framework cannot run there."""
    check_framework(framework)
    try:
        return build_model(framework, config, weights, dtype=dtype, device=device, prefix="--")
    except InputError as exc:
        raise UsageError(str(exc)) from None


def check_framework(framework: str) -> None:
    """A one-line UsageError when the framework is not installed here."""
    reason = unavailable_reason(framework)
    if reason is not None:
        raise UsageError(f"--framework {framework}: {reason}")


def run_training(model: Model, task: Task, steps: int, seed: int, label: str) -> list[float]:
    """Train with a progress bar (loss, target tokens/s) on stderr; return the losses."""
    bar = ProgressBar(steps, label)

    def on_step(step: int, total: int, loss: float, tokens_per_s: float) -> None:
        if step == total or step % 10 == 0 or step == 1:
            bar.update(step, f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s")

    result = train(model, task, steps, seed=seed, on_step=on_step)
    print(
        f"trained {steps} steps in {result.seconds:.1f} s "
        f"({result.tokens_per_second:,.0f} target tokens/s), final loss {result.losses[-1]:.3f}"
    )
    return result.losses


def load_task_weights(
    path: str, task_name: str | None, allow_nonfinite: bool
) -> tuple[Task, dict[str, np.ndarray]]:
    """The task a weight file was trained on (its metadata, or `task_name`) and its weights,
    refused when they do not fit the task's model or hold NaN/Inf (unless allowed)."""
    wf = load_weights(path)
    name = task_name or wf.metadata.get(META_TASK)
    if name is None:
        raise UsageError(f"--weights: {path} names no task in its metadata; give --task")
    task = get_task(name)
    if task.config() != wf.config:
        raise UsageError(f"--weights: {path} holds a model of another shape than task {name}'s")
    check_finite(path, wf.tensors, allow_nonfinite)
    return task, wf.tensors


KIND_WORDS = {"encoder_decoder": "encoder-decoder", "decoder_only": "decoder-only LM"}


def tasks_epilog(kinds: tuple[str, ...] = tuple(KIND_WORDS)) -> str:
    """A command's help epilog: every task of these model kinds, one per line with its
    description, then its model's kind and default steps (for RawDescriptionHelpFormatter)."""
    names = [name for name, task in TASKS.items() if task.config().kind in kinds]
    width = max(len(name) for name in names)
    lines = ["tasks:"]
    for name in names:
        task = TASKS[name]
        lines.append(f"  {name:<{width}s}  {task.description}")
        lines.append(f"  {'':<{width}s}  ({KIND_WORDS[task.config().kind]}, {task.steps} steps)")
    return "\n".join(lines)


def check_beam(task: Task, texts: list[str], beam: int) -> None:
    """Refuse a beam wider than the target vocabulary (its extra hypotheses could never differ)
    or one whose caches would not fit, before the model is built."""
    config = task.config()
    if beam > config.tgt_vocab_size:
        raise UsageError(
            f"--beam {beam} is wider than the target vocabulary ({config.tgt_vocab_size} tokens)"
        )
    src = task.encode_sources(texts)
    steps = src.shape[1] + EXTRA_LEN
    check_fits(decode_bytes(config, len(texts), src.shape[1], beam, steps), f"--beam {beam}")
