"""Training the PyTorch Transformer: the loss of section 5.4, its gradient and the optimiser of
section 5.3 (common/oracle/training.py is the spec and the oracle each piece is tested against).

Written the way torch users train: the model in train() mode, `loss.backward()` filling each
Parameter's `.grad`, then `torch.optim.Adam.step()`. Eager throughout (torch.compile is left
out: the tests' batches change shape, and eager autograd is the reference torch users know).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_rosetta.oracle.training import ADAM_BETAS, ADAM_EPS, noam_learning_rate
from transformer_rosetta.torch_impl.model import Transformer
from transformer_rosetta.torch_impl.weights import canonical_from_state_dict


def label_smoothed_loss(
    logits: Tensor, targets: Tensor, pad_id: int, smoothing: float
) -> tuple[Tensor, float, int]:
    """Section 5.4: cross-entropy against q = (1 - eps) one_hot(y) + eps / V, averaged over the
    targets that are not padding. Returns (loss, accuracy, tokens): the mean loss (a () tensor
    carrying the autograd graph), the fraction of non-pad targets whose argmax logit is right,
    and how many targets are not padding.

    F.cross_entropy(label_smoothing=eps) has exactly this definition (eps / V to every class, the
    true one included) and ignore_index drops pad targets from both terms. It is summed and then
    divided by the token count rather than using reduction="mean", which is the same division
    but gives NaN on an all-pad batch, where the oracle gives 0.
    """
    summed, tokens = summed_loss(logits, targets, pad_id, smoothing)
    with torch.no_grad():
        keep = targets != pad_id  # (B, T)
        correct = (logits.argmax(dim=-1) == targets) & keep  # argmax takes the first maximum
        # A Python division: int64 / int in torch gives float32, too coarse for a float64 run.
        accuracy = int(correct.sum()) / max(tokens, 1)
    return summed / max(tokens, 1), accuracy, tokens


def summed_loss(
    logits: Tensor, targets: Tensor, pad_id: int, smoothing: float
) -> tuple[Tensor, int]:
    """label_smoothed_loss before its division: (the SUM of section 5.4's smoothed
    cross-entropies over the targets that are not padding, a () tensor carrying the autograd
    graph; how many targets are not padding).

    A data replica (distributed.py) multiplies the sum by
    transformer_rosetta.spec.mesh.replica_loss_scale, i.e. divides it by the GLOBAL batch's token
    count, never by its own: a replica's mean over its own tokens is another quantity whenever
    the replicas hold different numbers of non-pad targets, and averaging the replicas'
    gradients does not undo that (mean_r(S_r / T_r) != sum_r(S_r) / T)."""
    tokens = int((targets != pad_id).sum())
    summed = F.cross_entropy(
        logits.flatten(0, 1),  # (B*T, V)
        targets.flatten(),  # (B*T,)
        ignore_index=pad_id,
        label_smoothing=smoothing,
        reduction="sum",
    )
    return summed, tokens


def compute_loss(
    model: Transformer, src: Tensor | None, tgt_in: Tensor, tgt: Tensor
) -> tuple[Tensor, float, int]:
    """The loss of `model` on src (B, S) and the target tgt (B, T), teacher-forced: the decoder
    reads tgt_in (tgt shifted right behind BOS, transformer_rosetta.spec.masks.shift_right) and predicts tgt.
    A decoder-only model has no source (src None): a language model's next-token loss.
    Dropout follows the module's training flag."""
    c = model.config
    logits = model(src, tgt_in)["logits"]  # (B, T, V), the fused attention path
    return label_smoothed_loss(logits, tgt, c.pad_id, c.label_smoothing)


@contextlib.contextmanager
def _training(model: nn.Module) -> Iterator[None]:
    """model.train() for the block (dropout on, as the config sets it), eval() again after: the
    adapter's model stays in eval mode for forward and decoding."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def loss_and_grads(
    model: Transformer, src: Tensor | None, tgt_in: Tensor, tgt: Tensor
) -> tuple[Tensor, float, int, dict[str, Tensor]]:
    """(loss, accuracy, tokens) as compute_loss, the loss detached, and d loss / d weight for
    every canonical tensor; leaves no `.grad` behind, so that it cannot leak into an optimiser
    step."""
    # rosetta: gradients
    model.zero_grad(set_to_none=True)
    with _training(model):
        loss, accuracy, tokens = compute_loss(model, src, tgt_in, tgt)
        loss.backward()
    grads = {name: g.detach().clone() for name, g in canonical_grads(model).items()}
    # rosetta: end
    model.zero_grad(set_to_none=True)
    return loss.detach(), accuracy, tokens, grads


def canonical_grads(model: Transformer) -> dict[str, Tensor]:  # idiom: grads live on .grad
    """Every Parameter's `.grad` under canonical names and layouts, in canonical order.

    The grads are read through the state_dict's keys, so weights.py's transposes and head splits
    apply to them unchanged. A tied tensor is one Parameter under several keys, and autograd has
    already summed its uses into that Parameter's one `.grad`. A Parameter the loss never reached
    has no grad: its gradient is zero.
    """
    state = {
        key: torch.zeros_like(p) if p.grad is None else p.grad
        for key, p in model.state_dict(keep_vars=True).items()
        if isinstance(p, nn.Parameter)
    }
    return canonical_from_state_dict(model.config, state)


def noam_schedule(d_model: int, warmup: int, factor: float = 1.0) -> Callable[[int], float]:
    """Section 5.3, Eq. (3): step -> lrate = factor * d_model^-0.5 * min(step^-0.5,
    step * warmup^-1.5), step counting from 1: transformer_rosetta.oracle.training.noam_learning_rate itself
    (the function torch.optim.lr_scheduler.LambdaLR would take)."""
    return partial(noam_learning_rate, d_model=d_model, warmup=warmup, factor=factor)


def make_optimizer(model: nn.Module) -> torch.optim.Adam:  # idiom: train_step sets the rate
    """Section 5.3: Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9. torch adds eps to
    sqrt(v_hat), as transformer_rosetta.oracle.training.adam_step does. model.parameters() yields a tied Parameter
    once, so a tied tensor has one set of moments. The learning rate is set before every step
    (train_step), so warmup and factor are train_step's arguments, not this one's."""
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=ADAM_BETAS, eps=ADAM_EPS)


def _set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's rate for the next step (the schedule lives outside the optimiser)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step(  # idiom: torch's optimiser is given each step's rate (step, warmup, factor)
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    src: Tensor | None,
    tgt_in: Tensor,
    tgt: Tensor,
    *,
    step: int,  # the model's lifetime step count, from 1
    warmup: int,
    factor: float = 1.0,
) -> Tensor:
    """One Adam step at the Noam rate of `step` (section 5.3, Eq. (3); step counts from 1).
    Returns the batch's loss, taken before the update, as a 0-d tensor on the model's device:
    reading it (float) waits for the GPU, so a loop of steps reads the losses once, at its end.

    The rate is written into the optimiser rather than driven by LambdaLR: warmup and factor may
    then differ between calls while the step count runs on over the model's lifetime.
    """
    # rosetta: optimizer
    lr = noam_schedule(model.config.d_model, warmup, factor)(step)
    _set_learning_rate(optimizer, lr)
    optimizer.zero_grad(set_to_none=True)
    with _training(model):
        loss, _, _ = compute_loss(model, src, tgt_in, tgt)
        loss.backward()
    optimizer.step()
    # rosetta: end
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
