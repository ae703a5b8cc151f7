"""Training a model on a generated task and using it: the loop behind `rosetta train`, `rosetta
translate` and `rosetta demo`, written once over the adapter (common/adapter/backends.py), so it is the
same loop for every framework.

The task decides the model's kind: an encoder-decoder reads (src, tgt) batches and translates
from the source; a decoder-only model (a LanguageModelTask) reads (None, sequence) batches and
translates by continuing a prompt, which task.encode_sources makes in place of the source.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from transformer_rosetta.adapter.backends import DecodingModel, Model, TrainableModel
from transformer_rosetta.app.tasks import Task
from transformer_rosetta.decoding.search import (
    Decoded,
    Stepper,
    StepperFactory,
    beam_search,
    greedy_search,
)
from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.weights.init import init_weights

# on_step(step, steps, loss, target tokens per second so far)
StepCallback = Callable[[int, int, float, float], None]

# Steps per model.train_steps call: the progress bar's refresh interval (common/app/cli/task_models).
SYNC_EVERY = 10


@dataclass
class TrainResult:
    """The per-step losses (before each update), and throughput over the whole run."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    target_tokens: int = 0  # non-pad target tokens seen (the tokens the loss counts)

    @property
    def tokens_per_second(self) -> float:
        return self.target_tokens / self.seconds if self.seconds > 0 else 0.0


def initial_weights(task: Task, seed: int) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """The task's config and the paper's initialisation (common/weights/init.py, scheme "paper")."""
    config = task.config()
    return config, init_weights(config, seed=seed, scheme="paper")


def train(
    model: Model,
    task: Task,
    steps: int,
    *,
    seed: int = 0,
    on_step: StepCallback | None = None,
) -> TrainResult:
    """`steps` Adam steps at the Noam rate (task.warmup, task.lr_factor) on fresh batches from the
    task's training stream (never a test source). The model is updated in place.

    The steps go to the model SYNC_EVERY at a time: within a call they queue on the device, and
    only their losses (scalars) come back to the host at its end, so a GPU never waits for the
    host's progress bar. on_step still sees every step, when its call has returned."""
    if not isinstance(model, TrainableModel):
        raise InputError(
            f"train: a {type(model).__name__} has no optimizer (train_steps); build the model in "
            "torch, tf or jax"
        )
    stream = task.train_batches(seed)
    result = TrainResult()
    start = time.perf_counter()
    for first in range(1, steps + 1, SYNC_EVERY):
        batches = [stream.next_batch() for _ in range(min(SYNC_EVERY, steps + 1 - first))]
        losses = model.train_steps(batches, warmup=task.warmup, factor=task.lr_factor)
        seconds = time.perf_counter() - start
        for step, (loss, (_, tgt)) in enumerate(zip(losses, batches, strict=True), start=first):
            result.losses.append(loss)
            result.target_tokens += int((tgt != model.config.pad_id).sum())
            result.seconds = seconds
            if on_step is not None:
                on_step(step, steps, loss, result.tokens_per_second)
    return result


def decode(model: Model, src: np.ndarray, *, beam: int = 1) -> Decoded:
    """Greedy (beam 1) or beam search (common/decoding/search.py) with the model's cached stepper.
    For a decoder-only model `src` is the prompt (B, P), and only the new tokens come back."""
    start = stepper_factory(model)
    if beam == 1:
        return greedy_search(start, model.config, src)
    return beam_search(start, model.config, src, beam=beam)


def stepper_factory(model: Model, *, cached: bool = True) -> StepperFactory:
    """The model's stepper as the searches (common/decoding/search.py) call it: (src, beams,
    max_steps) -> Stepper, with or without the key/value cache. Every backend's models decode
    (adapter.backends.DecodingModel); InputError for a model that does not."""
    if not isinstance(model, DecodingModel):
        raise InputError(f"decode: a {type(model).__name__} has no stepper to decode with")

    def start(src: np.ndarray, beams: int, max_steps: int) -> Stepper:
        return model.stepper(src, beams, max_steps, cached=cached)

    return start


def translate(model: Model, task: Task, texts: list[str], *, beam: int = 1) -> list[str]:
    """Each text in the task's source language, translated (a decoder-only model: the words it
    continues the text's prompt with). InputError for text the task cannot read (a character
    outside the source tokenizer, a number out of range)."""
    decoded = decode(model, task.encode_sources(texts), beam=beam)
    return [task.target.decode(tokens) for tokens in decoded.tokens]


def exact_match(
    model: Model, task: Task, pairs: list[tuple[str, str]], *, beam: int = 1, batch: int = 100
) -> tuple[float, list[str]]:
    """The fraction of pairs whose translation equals the target exactly, and the translations."""
    outputs: list[str] = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        outputs += translate(model, task, [src for src, _ in chunk], beam=beam)
    right = sum(out == tgt for out, (_, tgt) in zip(outputs, pairs, strict=True))
    return right / max(len(pairs), 1), outputs
