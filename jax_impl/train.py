"""Training the Flax NNX Transformer: the loss, its gradient and Adam with the Noam schedule.

Section 5.3 (optimiser and schedule) and 5.4 (label smoothing) of the paper, with
common.oracle.training as the spec: the same loss as its label_smoothed_loss, optax's Adam (eps on
sqrt(v_hat), exactly common.oracle.training.adam_step) and common.oracle.training.noam_learning_rate as an optax
schedule. The step is one nnx.jit function: forward, backward and update compile together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from common.oracle.training import ADAM_BETAS, ADAM_EPS
from jax_impl.model import Transformer, statistics_dtype
from jax_impl.weights import param_paths


def label_smoothed_loss(
    logits: jax.Array, targets: jax.Array, pad_id: int, smoothing: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Section 5.4: cross-entropy against q = (1 - eps) one_hot(y) + eps / V, averaged over the
    target tokens that are not padding.

    optax.smooth_labels gives eps / V to every class, the true one included: exactly the
    definition of common.oracle.training.label_smoothed_loss. Returns (loss, accuracy, tokens),
    three scalars; a batch with no target token has loss 0, as the oracle's.
    """
    logits = logits.astype(statistics_dtype(logits.dtype))  # log-softmax never in bfloat16
    labels = optax.smooth_labels(
        jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), smoothing
    )
    per_token = optax.softmax_cross_entropy(logits, labels)  # (B, T)
    keep = targets != pad_id
    tokens = keep.sum()
    # max(tokens, 1): an all-pad batch sums nothing, so its loss is 0 rather than 0 / 0.
    denominator = jnp.maximum(tokens, 1).astype(logits.dtype)
    loss = jnp.where(keep, per_token, 0.0).sum() / denominator
    correct = (logits.argmax(axis=-1) == targets) & keep
    return loss, correct.sum() / denominator, tokens


def compute_loss(
    model: Transformer, src: jax.Array, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The teacher-forced (loss, accuracy, tokens) of `model` on (src, tgt); tgt_in is tgt
    shifted right behind BOS."""
    logits = model(src, tgt_in)["logits"]  # (B, T, V)
    c = model.config
    return label_smoothed_loss(logits, tgt, c.pad_id, c.label_smoothing)


def _loss_with_metrics(
    model: Transformer, src: jax.Array, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """compute_loss as nnx.value_and_grad(has_aux=True) takes it: (value, auxiliary outputs)."""
    loss, accuracy, tokens = compute_loss(model, src, tgt_in, tgt)
    return loss, (accuracy, tokens)


@nnx.jit
def loss_and_grads(
    model: Transformer, src: jax.Array, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, nnx.State]:
    """(loss, accuracy, tokens, d loss / d every nnx.Param as an nnx.State). A tied parameter is
    one nnx.Param read in several places, so autodiff already sums the gradient over its uses."""
    grad_fn = nnx.value_and_grad(_loss_with_metrics, has_aux=True)
    (loss, (accuracy, tokens)), grads = grad_fn(model, src, tgt_in, tgt)
    return loss, accuracy, tokens, grads


def canonical_grads(model: Transformer, grads: nnx.State) -> dict[str, np.ndarray]:
    """{canonical name: gradient} in canonical order and layout. The nnx.State of gradients has
    the paths of the params, and a param's path joined with "." is its canonical name
    (jax_impl.weights), so nothing is transposed."""
    flat = dict(nnx.to_flat_state(grads))
    return {name: np.asarray(flat[path][...]) for name, path in param_paths(model).items()}


def noam_schedule(d_model: int, warmup: int, factor: float = 1.0) -> optax.Schedule:
    """Section 5.3, Eq. (3), as an optax schedule: lrate = factor * d_model^-0.5 *
    min(step^-0.5, step * warmup^-1.5).

    optax counts updates from 0 and the paper counts steps from 1, so update `count` is step
    count + 1. Written in jnp (common.oracle.training.noam_learning_rate's Python min cannot take a
    traced step); the float is the default one, so float64 under x64.
    """

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count + 1, dtype=float)
        return factor * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup**-1.5)

    return schedule


@functools.lru_cache(maxsize=16)
def _noam_adam(d_model: int, warmup: int, factor: float = 1.0) -> optax.GradientTransformation:
    """Section 5.3: Adam(beta1 0.9, beta2 0.98, eps 1e-9) at the Noam rate.

    optax puts eps on sqrt(v_hat), after the bias correction, as torch does and as
    common.oracle.training.adam_step specifies. Cached, because the transformation is static in the
    optimizer's graphdef: one object per (d_model, warmup, factor) lets nnx.jit reuse the step
    it compiled for an earlier model of the same kind.
    """
    b1, b2 = ADAM_BETAS
    return optax.adam(noam_schedule(d_model, warmup, factor), b1=b1, b2=b2, eps=ADAM_EPS)


def make_optimizer(
    model: Transformer,
    warmup: int,
    factor: float = 1.0,
    *,
    device: jax.Device,  # idiom: optax state is made uncommitted; nnx.jit keys on placement
    previous: nnx.Optimizer | None = None,  # idiom: the schedule is static in an nnx.Optimizer
) -> nnx.Optimizer:
    """An nnx.Optimizer over the model's nnx.Params, its state on `device`. Given `previous`
    (another schedule on the same model), its moments and step count carry over, so the steps
    keep counting from where the model's life has reached."""
    tx = _noam_adam(model.config.d_model, warmup, factor)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state(previous if previous is not None else optimizer)
    # Committed to the device: tx.init makes its step counters uncommitted, the step's outputs
    # are committed, and nnx.jit would compile the step a second time for that difference.
    nnx.update(optimizer, jax.device_put(state, device))
    return optimizer


@nnx.jit
def train_step(
    model: Transformer, optimizer: nnx.Optimizer, src: jax.Array, tgt_in: jax.Array, tgt: jax.Array
) -> jax.Array:
    """One Adam step in place on `model` and `optimizer`; returns the loss before the update."""
    grad_fn = nnx.value_and_grad(_loss_with_metrics, has_aux=True)
    (loss, _), grads = grad_fn(model, src, tgt_in, tgt)
    optimizer.update(model, grads)
    return loss
