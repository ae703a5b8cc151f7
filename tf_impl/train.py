"""Training in Keras 3 on TensorFlow: the label-smoothed loss, its gradient under canonical names,
and Adam with the Noam schedule (sections 5.3 and 5.4 of "Attention Is All You Need").

The spec is common/oracle/training.py. Gradients come from `tf.GradientTape` (TensorFlow is the Keras
backend we ship); the functions here are plain, and tf_impl/backend.py wraps them in `tf.function`,
XLA-compiled (KerasModel.train_jit_compile). The optimizer is Keras's own Adam with its
per-variable update overridden, because Keras places epsilon differently from the paper's
reference implementations (see `Adam`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

from transformer_rosetta.oracle.training import ADAM_BETAS, ADAM_EPS
from transformer_rosetta.tf_impl.model import Transformer
from transformer_rosetta.tf_impl.weights import variables_by_name


def _token_losses(logits: Any, targets: Any, pad_id: int, smoothing: float) -> tuple[Any, Any, Any]:
    """(logits, in float32 or wider; per-token label-smoothed cross-entropy (B, T); the non-pad
    mask (B, T)): the pieces label_smoothed_loss and summed_loss reduce.

    Keras's `categorical_crossentropy(label_smoothing=)` is exactly section 5.4's
    q = (1 - eps) one_hot(y) + eps / V (eps / V to every class, the true one included;
    transformer_rosetta.oracle.training.label_smoothed_loss), so it is used as is.
    """
    if logits.dtype in ("float16", "bfloat16"):
        # Softmax statistics in float32 or wider (docs/DESIGN.md, "Precision").
        logits = ops.cast(logits, "float32")
    vocab = ops.shape(logits)[-1]
    per_token = keras.losses.categorical_crossentropy(
        ops.one_hot(targets, vocab, dtype=logits.dtype),
        logits,
        from_logits=True,
        label_smoothing=smoothing,
    )  # (B, T)
    return logits, per_token, ops.not_equal(targets, pad_id)


def label_smoothed_loss(
    logits: Any, targets: Any, pad_id: int, smoothing: float
) -> tuple[Any, Any, Any]:
    """Section 5.4: cross-entropy against q = (1 - eps) one_hot(y) + eps / V, averaged over the
    target tokens that are not padding. Returns (loss, accuracy, tokens) as scalar tensors."""
    logits, per_token, keep = _token_losses(logits, targets, pad_id, smoothing)
    tokens = ops.sum(ops.cast(keep, "int32"))
    # An all-pad batch has loss 0 and accuracy 0 (the oracle's answer), not 0 / 0.
    denominator = ops.cast(ops.maximum(tokens, 1), logits.dtype)
    loss = ops.sum(ops.where(keep, per_token, 0.0)) / denominator
    correct = ops.logical_and(
        ops.equal(ops.argmax(logits, axis=-1), ops.cast(targets, "int64")), keep
    )
    accuracy = ops.cast(ops.sum(ops.cast(correct, "int32")), logits.dtype) / denominator
    return loss, accuracy, tokens


def summed_loss(logits: Any, targets: Any, pad_id: int, smoothing: float) -> tuple[Any, Any]:
    """label_smoothed_loss's numerator: (the SUM of the per-token losses over the non-pad
    targets, their count), scalar tensors. A data replica divides its sum by the GLOBAL token
    count (transformer_rosetta.spec.mesh.replica_loss_scale), not by its own count: on a ragged
    batch the mean of the replicas' means is not the batch's mean (tf_impl/distributed.py)."""
    _, per_token, keep = _token_losses(logits, targets, pad_id, smoothing)
    return ops.sum(ops.where(keep, per_token, 0.0)), ops.sum(ops.cast(keep, "int32"))


def compute_loss(model: Transformer, src: Any, tgt_in: Any, tgt: Any) -> tuple[Any, Any, Any]:
    """Teacher forcing: the model reads tgt_in (tgt shifted right behind BOS) and is scored on
    tgt. Returns (loss, accuracy, tokens). Dropout follows the config (training=True). A
    decoder-only model (a language model) has src None."""
    logits = model(src, tgt_in, training=True)["logits"]
    c = model.config
    return label_smoothed_loss(logits, tgt, c.pad_id, c.label_smoothing)


def _dense(gradient: Any) -> Any:
    """An embedding's gradient arrives as tf.IndexedSlices (rows by lookup); canonical is dense."""
    return tf.convert_to_tensor(gradient)


def loss_and_grads(model: Transformer, src: Any, tgt_in: Any, tgt: Any) -> tuple:
    """(loss, accuracy, tokens, [gradient per canonical tensor, in canonical order]).

    The tape watches each canonical variable once, so a tied tensor's gradient is already the sum
    over its uses. Plain eager code; tf_impl/backend.py runs it as an XLA-compiled tf.function.
    """
    # rosetta: gradients
    variables = list(variables_by_name(model).values())
    with tf.GradientTape() as tape:
        loss, accuracy, tokens = compute_loss(model, src, tgt_in, tgt)
    grads = tape.gradient(loss, variables)
    # rosetta: end
    return loss, accuracy, tokens, [_dense(g) for g in grads]


def canonical_grads(model: Transformer, grads: list[Any]) -> dict[str, Any]:
    """{canonical name: gradient} for loss_and_grads' list, which follows variables_by_name."""
    return dict(zip(variables_by_name(model), grads, strict=True))


# idiom: Keras's optimizers take a LearningRateSchedule object, not a function
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Section 5.3, Eq. (3): lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Keras calls a schedule with the optimizer's `iterations` *before* the update, counting from 0;
    the paper's step counts from 1, hence step = iterations + 1. Computed in float64 whatever the
    model's dtype: a float32 rate would be off by ~1e-8 relative, visible in a float64 step.
    """

    def __init__(self, d_model: int, warmup: int, factor: float = 1.0) -> None:
        self.d_model = d_model
        self.warmup = warmup
        self.factor = factor

    def __call__(self, step: Any) -> Any:
        step = ops.cast(step, "float64") + 1.0
        scale = self.factor * self.d_model**-0.5
        return scale * ops.minimum(ops.power(step, -0.5), step * self.warmup**-1.5)

    def get_config(self) -> dict[str, Any]:
        return {"d_model": self.d_model, "warmup": self.warmup, "factor": self.factor}


def noam_schedule(d_model: int, warmup: int, factor: float = 1.0) -> NoamSchedule:
    """Section 5.3, Eq. (3), as the Keras schedule Adam reads (NoamSchedule)."""
    return NoamSchedule(d_model, warmup, factor)


# idiom: Keras's Adam with the paper's epsilon placement (see the docstring)
class Adam(keras.optimizers.Adam):
    """Kingma & Ba, Algorithm 1, with epsilon added to sqrt(v_hat): torch's and optax's placement,
    which transformer_rosetta.oracle.training.adam_step specifies.

    Keras 3's Adam (keras/src/optimizers/adam.py, `update_step`) folds both bias corrections into
    the rate, alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), and steps w -= alpha * m / (sqrt(v) + eps):
    its epsilon sits on sqrt(v) *before* the bias correction. That equals the reference only with
    eps replaced by eps * sqrt(1 - b2^t), a step-dependent constant no Keras argument can express
    (at t = 1, b2 = 0.98: 0.14 eps). So this subclass overrides `update_step` and writes the
    reference step out (with `_backend_update_step` making the step's scalars once for all
    variables); Keras still owns the moment variables, `iterations`, the schedule call and
    tf.distribute. AMSGrad is not offered.
    """

    def __init__(
        self,
        learning_rate: float | keras.optimizers.schedules.LearningRateSchedule,
        beta_1: float = ADAM_BETAS[0],
        beta_2: float = ADAM_BETAS[1],
        epsilon: float = ADAM_EPS,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad=False, **kwargs)
        self._shared_scalars: dict[str, tuple] | None = None  # see _backend_update_step

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        dtype = variable.dtype
        lr, b1, b2, c1, c2, eps = self._step_scalars(dtype, learning_rate)
        g = ops.cast(gradient, dtype)
        index = self._get_variable_index(variable)
        m_var, v_var = self._momentums[index], self._velocities[index]
        m = b1 * m_var + (1 - b1) * g
        v = b2 * v_var + (1 - b2) * g * g
        self.assign(m_var, m)
        self.assign(v_var, v)
        m_hat = m / c1
        v_hat = v / c2
        self.assign_sub(variable, lr * m_hat / (ops.sqrt(v_hat) + eps))

    def _backend_update_step(
        self, grads: list, trainable_variables: list, learning_rate: Any
    ) -> None:
        """Keras's one call per step over all variables (it loops over update_step): the step's
        scalars (_step_scalars) are made once here and shared by every variable's update, rather
        than once per variable. The same values, so the same step; but ~1600 fewer graph ops
        for the numbers model's 86 variables, which cuts its tf.function trace and XLA compile
        by ~2.5 s of CPU time."""
        self._shared_scalars = {}
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._shared_scalars = None

    def _step_scalars(self, dtype: str, learning_rate: Any) -> tuple:
        """(lr, beta_1, beta_2, 1 - beta_1^t, 1 - beta_2^t, epsilon) in `dtype` for this step,
        t being Algorithm 1's step (from 1); shared by the step's variables of that dtype when
        called under _backend_update_step."""
        shared = self._shared_scalars
        if shared is not None and dtype in shared:
            return shared[dtype]
        t = ops.cast(self.iterations + 1, dtype)
        # Not ops.cast(self.beta_1, dtype), as Keras's own update_step has it: on TensorFlow that
        # makes a float32 tensor first, so a float64 model would use beta_1 = 0.8999999761581421
        # (moments off by ~2e-8 relative, 1e-8 in the loss after 20 steps).
        b1 = ops.convert_to_tensor(self.beta_1, dtype=dtype)
        b2 = ops.convert_to_tensor(self.beta_2, dtype=dtype)
        scalars = (
            ops.cast(learning_rate, dtype),
            b1,
            b2,
            1 - ops.power(b1, t),
            1 - ops.power(b2, t),
            ops.convert_to_tensor(self.epsilon, dtype=dtype),
        )
        if shared is not None:
            shared[dtype] = scalars
        return scalars


def make_optimizer(model: Transformer, warmup: int, factor: float = 1.0) -> Adam:
    """The paper's optimizer: Adam (0.9, 0.98, 1e-9) at the Noam rate, its moments made for the
    model's canonical variables (here, since variables may not be created inside a tf.function
    trace)."""
    optimizer = Adam(noam_schedule(model.config.d_model, warmup, factor))
    optimizer.build(list(variables_by_name(model).values()))
    return optimizer


def train_step(model: Transformer, optimizer: Adam, src: Any, tgt_in: Any, tgt: Any) -> Any:
    """One Adam step on (src, tgt_in, tgt); returns the loss, taken before the update. Plain
    eager code; tf_impl/backend.py runs it as an XLA-compiled tf.function."""
    variables = list(variables_by_name(model).values())
    with tf.GradientTape() as tape:
        loss, _, _ = compute_loss(model, src, tgt_in, tgt)
    grads = tape.gradient(loss, variables)
    optimizer.apply([_dense(g) for g in grads], variables)
    return loss
