"""Training the Flax NNX Transformer: the loss, its gradient and Adam with the Noam schedule.

Section 5.3 (optimiser and schedule) and 5.4 (label smoothing) of the paper, with
transformer_rosetta.oracle.training as the spec: the same loss as its label_smoothed_loss, optax's Adam (eps on
sqrt(v_hat), exactly transformer_rosetta.oracle.training.adam_step) and transformer_rosetta.oracle.training.noam_learning_rate as an optax
schedule. forward, backward and update compile together into one jax.jit function.

The loop is the functional one of Flax's "Performance considerations" guide
(https://flax.readthedocs.io/en/latest/guides/performance.html): nnx.jit walks the module's object
graph in Python on every call, and module.train() / module.eval() walk it too, which together cost
more than the numbers task's whole compiled step on a CPU. So the module is split once
(_split_for_training, dropout switched on for that split only) into a static graphdef and two
pure pytrees of arrays, its nnx.Params and the rest (dropout's RNG state); the step is a pure
jax.jit function of those arrays and of optax's state (tx.init / tx.update directly, no
nnx.Optimizer) that returns the new ones, and nnx.merge rebuilds the module inside the trace only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import traversals

from transformer_rosetta.jax_impl.model import Transformer, statistics_dtype
from transformer_rosetta.jax_impl.weights import param_paths
from transformer_rosetta.oracle.training import ADAM_BETAS, ADAM_EPS
from transformer_rosetta.spec.config import TransformerConfig


def label_smoothed_loss(
    logits: jax.Array, targets: jax.Array, pad_id: int, smoothing: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Section 5.4: cross-entropy against q = (1 - eps) one_hot(y) + eps / V, averaged over the
    target tokens that are not padding.

    optax.smooth_labels gives eps / V to every class, the true one included: exactly the
    definition of transformer_rosetta.oracle.training.label_smoothed_loss. Returns (loss, accuracy, tokens),
    three scalars; a batch with no target token has loss 0, as the oracle's.
    """
    logits = logits.astype(statistics_dtype(logits.dtype))  # log-softmax never in bfloat16
    total, tokens = summed_loss(logits, targets, pad_id, smoothing)
    # max(tokens, 1): an all-pad batch sums nothing, so its loss is 0 rather than 0 / 0.
    denominator = jnp.maximum(tokens, 1).astype(logits.dtype)
    correct = (logits.argmax(axis=-1) == targets) & (targets != pad_id)
    return total / denominator, correct.sum() / denominator, tokens


def summed_loss(
    logits: jax.Array, targets: jax.Array, pad_id: int, smoothing: float
) -> tuple[jax.Array, jax.Array]:
    """label_smoothed_loss before its division: (the SUM of the section 5.4 smoothed
    cross-entropies over the target tokens that are not padding, their count), two scalars.

    What a data replica that holds only some of the batch's rows computes
    (jax_impl/distributed.py): it divides this sum by the GLOBAL batch's token count
    (transformer_rosetta.spec.mesh.replica_loss_scale), never by its own count, which differs
    from replica to replica on a ragged batch. The sum runs in float32 or wider
    (statistics_dtype), as the loss does."""
    logits = logits.astype(statistics_dtype(logits.dtype))  # log-softmax never in bfloat16
    labels = optax.smooth_labels(
        jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), smoothing
    )
    per_token = optax.softmax_cross_entropy(logits, labels)  # (B, T)
    keep = targets != pad_id
    return jnp.where(keep, per_token, 0.0).sum(), keep.sum()


def compute_loss(
    model: Transformer, src: jax.Array | None, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The teacher-forced (loss, accuracy, tokens) of `model` on (src, tgt); tgt_in is tgt
    shifted right behind BOS. A decoder-only model (a language model) takes src None."""
    logits = model(src, tgt_in)["logits"]  # (B, T, V)
    c = model.config
    return label_smoothed_loss(logits, tgt, c.pad_id, c.label_smoothing)


# A pure nested dict of arrays (nnx.to_pure_dict): jax.jit flattens dicts in C++, where
# an nnx.State of nnx.Variables takes a Python call per node.
_Tree = dict[str, Any]


class _Split(NamedTuple):
    """A Transformer split once for the functional training loop (Flax's performance guide):
    nnx.merge(graphdef, params, rest) is the module in training mode."""

    config: TransformerConfig
    graphdef: nnx.GraphDef  # static (config, dtype, structure), dropout switched on
    params: _Tree  # the nnx.Params, the arrays Adam updates
    rest: _Tree  # every other nnx.Variable: dropout's RNG keys and counts
    # The split module's own nnx.Params, in the order of jax.tree.leaves(params): _write_back.
    variables: tuple[nnx.Variable, ...]


class _Adam(NamedTuple):
    """Adam at one Noam schedule, for one model structure: optax's state (the moments and the
    step counts) and the compiled step that takes and returns it."""

    state: optax.OptState
    step: Callable[..., tuple[jax.Array, _Tree, _Tree, optax.OptState]]


def _split_for_training(model: Transformer) -> _Split:
    """`model` split once into (graphdef, params, rest) with dropout as the config sets it;
    model itself is left in eval mode, as the adapter keeps it for forward and decoding.

    The graphdef holds each nnx.Dropout's `deterministic` flag, so the training one is taken
    here, once, between model.train() and model.eval(): each of those walks the whole graph,
    which is why they are not called per step (the Flax performance guide's functional loop).
    The arrays are the module's own, not copies."""
    # rosetta: dropout
    model.train()
    try:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    finally:
        model.eval()
    # rosetta: end
    # The State holds the module's own Variables; the same dict of them, flattened as the
    # arrays' dict is, lists them in its leaves' order.
    variables = jax.tree.leaves(
        nnx.to_pure_dict(params, extract_fn=lambda v: v),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    pure = nnx.to_pure_dict
    return _Split(model.config, graphdef, pure(params), pure(rest), tuple(variables))


def _write_back(model: _Split) -> None:
    """The split's params into the module it was split from, in place (what
    nnx.update(module, params) does, without walking the module's graph: ~10x faster).

    The rest (dropout's RNG state) stays in the split: the module is in eval mode, where
    dropout draws nothing."""
    for variable, array in zip(model.variables, jax.tree.leaves(model.params), strict=True):
        variable.set_raw_value(array)


def _loss_fn(
    params: _Tree,
    graphdef: nnx.GraphDef,
    rest: _Tree,
    src: jax.Array | None,
    tgt_in: jax.Array,
    tgt: jax.Array,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, _Tree]]:
    """compute_loss as jax.value_and_grad(has_aux=True) takes it, over the params: (loss,
    (accuracy, tokens, the rest after the step: dropout's RNG counts moved on)). A tied
    parameter is one nnx.Param read in several places, so autodiff sums the gradient over its
    uses."""
    model = nnx.merge(graphdef, params, rest)  # in the trace only
    loss, accuracy, tokens = compute_loss(model, src, tgt_in, tgt)
    _, _, rest = nnx.split(model, nnx.Param, ...)
    return loss, (accuracy, tokens, nnx.to_pure_dict(rest))


# The compiled functions close over the graphdef rather than take it as a static argument:
# jax.jit hashes static arguments on every call, and nnx.GraphDef's hash walks every node of the
# graph (~4 ms for the numbers task's model, a fifth of its step on a CPU). Cached per graphdef
# (equal for two models of one config and dtype), so a model of a kind already trained reuses
# the compiled step; each lookup hashes the graphdef once, which is why the callers hold on to
# what these return.


@functools.lru_cache(maxsize=16)
def _compiled_loss_and_grads(graphdef: nnx.GraphDef) -> Callable[..., tuple]:
    def run(
        params: _Tree, rest: _Tree, src: jax.Array | None, tgt_in: jax.Array, tgt: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, _Tree]:
        # rosetta: gradients
        grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
        (loss, (accuracy, tokens, _)), grads = grad_fn(params, graphdef, rest, src, tgt_in, tgt)
        # rosetta: end
        return loss, accuracy, tokens, grads

    return jax.jit(run)


@functools.lru_cache(maxsize=16)
def _compiled_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation
) -> Callable[..., tuple[jax.Array, _Tree, _Tree, optax.OptState]]:
    def run(
        params: _Tree,
        rest: _Tree,
        opt_state: optax.OptState,
        src: jax.Array | None,
        tgt_in: jax.Array,
        tgt: jax.Array,
    ) -> tuple[jax.Array, _Tree, _Tree, optax.OptState]:
        grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
        (loss, (_, _, rest)), grads = grad_fn(params, graphdef, rest, src, tgt_in, tgt)
        # What nnx.Optimizer.update does, without its graph traversal.
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), rest, opt_state

    # The params and Adam's state are replaced by the step's outputs, so XLA may write those
    # into the inputs' buffers (the guide's donate_argnums).
    return jax.jit(run, donate_argnums=(0, 2))


def loss_and_grads(
    model: _Split, src: jax.Array | None, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, _Tree]:
    """(loss, accuracy, tokens, d loss / d every nnx.Param as a pure dict of the params' paths)
    of the model split for training (_split_for_training); src None for a decoder-only model.
    A pure function: dropout, if any, draws its masks from the split's RNG state without moving
    it on."""
    run = _compiled_loss_and_grads(model.graphdef)  # one hash of the graphdef: not a hot path
    return run(model.params, model.rest, src, tgt_in, tgt)


def canonical_grads(model: Transformer, grads: _Tree) -> dict[str, np.ndarray]:
    """{canonical name: gradient} in canonical order and layout. The gradients have the paths of
    the params, and a param's path joined with "." is its canonical name (transformer_rosetta.jax_impl.weights), so
    nothing is transposed."""
    flat = traversals.flatten_mapping(grads)
    return {name: np.asarray(flat[path]) for name, path in param_paths(model).items()}


def noam_schedule(d_model: int, warmup: int, factor: float = 1.0) -> optax.Schedule:
    """Section 5.3, Eq. (3), as an optax schedule: lrate = factor * d_model^-0.5 *
    min(step^-0.5, step * warmup^-1.5).

    optax counts updates from 0 and the paper counts steps from 1, so update `count` is step
    count + 1. Written in jnp (transformer_rosetta.oracle.training.noam_learning_rate's Python min cannot take a
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
    transformer_rosetta.oracle.training.adam_step specifies. Cached, because the transformation is part of
    _compiled_train_step's cache key: one object per (d_model, warmup, factor) lets a later
    model of the same kind reuse the step compiled for an earlier one.
    """
    b1, b2 = ADAM_BETAS
    return optax.adam(noam_schedule(d_model, warmup, factor), b1=b1, b2=b2, eps=ADAM_EPS)


def make_optimizer(
    model: _Split,
    warmup: int,
    factor: float = 1.0,
    *,
    device: jax.Device,  # idiom: optax state is made uncommitted; jax.jit keys on placement
    previous: _Adam | None = None,  # idiom: the schedule is static in the compiled step
) -> _Adam:
    """Adam over the split model's params, its state on `device`, with the step compiled for
    this (model structure, schedule). Given `previous` (another schedule on the same model), its
    moments and step counts carry over, so the steps keep counting from where the model's life
    has reached: optax's Adam state has the same structure whatever the schedule."""
    tx = _noam_adam(model.config.d_model, warmup, factor)
    if previous is not None:
        state = previous.state
    else:
        # Committed to the device: tx.init makes its step counts uncommitted, the step's outputs
        # are committed, and jax.jit would compile the step a second time for that difference.
        state = jax.device_put(tx.init(model.params), device)
    return _Adam(state, _compiled_train_step(model.graphdef, tx))


def train_step(  # idiom: functional (the Flax performance guide): new state out, nothing in place
    model: _Split, optimizer: _Adam, src: jax.Array | None, tgt_in: jax.Array, tgt: jax.Array
) -> tuple[jax.Array, _Split, _Adam]:
    """One Adam step: (the loss before the update, the model and the optimizer after it).

    The arrays given in are donated to the step, so `model` and `optimizer` (and a module whose
    arrays they are, such as the one _split_for_training split) must not be read afterwards:
    the caller holds on to the returned ones instead, and writes the params back into the module
    (nnx.update) when it needs it. The loss stays on the device: reading it waits for the step.
    """
    loss, params, rest, state = optimizer.step(
        model.params, model.rest, optimizer.state, src, tgt_in, tgt
    )
    return loss, model._replace(params=params, rest=rest), optimizer._replace(state=state)
