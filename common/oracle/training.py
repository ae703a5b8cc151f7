"""The training objective and schedule, framework-free: the spec each train.py follows.

Section 5.3 and 5.4 of the paper: Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9, the "Noam"
learning rate, and label smoothing eps_ls = 0.1. The numpy versions here are the oracle for the
loss (finite-difference gradient checks use them) and the reference for one Adam step.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_trainable
from transformer_rosetta.spec.masks import shift_right

ADAM_BETAS = (0.9, 0.98)
ADAM_EPS = 1e-9
WARMUP_STEPS = 4000


def noam_learning_rate(
    step: int, d_model: int, warmup: int = WARMUP_STEPS, factor: float = 1.0
) -> float:
    """Section 5.3, Eq. (3): lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def label_smoothed_loss(
    logits: np.ndarray, targets: np.ndarray, pad_id: int, smoothing: float
) -> tuple[float, float, int]:
    """Section 5.4: cross-entropy against q = (1 - eps) one_hot(y) + eps / V, averaged over the
    target tokens that are not padding. Returns (loss, accuracy, tokens).

    eps / V goes to every class, the true one included: the convention of torch's
    cross_entropy(label_smoothing=), optax.smooth_labels and Keras' label_smoothing alike.
    """
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (B, T, V)
    keep = targets != pad_id
    # A pad target is dropped below; the virtual pad (a model without a pad token pads with the
    # id one past its vocabulary) names no class, so it is looked up as class 0 first.
    picked = np.where(keep, targets, 0)[..., None]
    nll = -np.take_along_axis(log_probs, picked, axis=-1)[..., 0]  # (B, T)
    uniform = -log_probs.mean(axis=-1)  # cross-entropy against the uniform distribution
    per_token = (1.0 - smoothing) * nll + smoothing * uniform
    tokens = int(keep.sum())
    if tokens == 0:
        return 0.0, 0.0, 0
    correct = (logits.argmax(axis=-1) == targets) & keep
    return float(per_token[keep].sum() / tokens), float(correct.sum() / tokens), tokens


def oracle_loss(
    weights: Mapping[str, np.ndarray], c: TransformerConfig, src: np.ndarray, tgt: np.ndarray
) -> tuple[float, float, int]:
    """The float64 loss of the eval-mode model (no dropout) on (src, tgt): the decoder reads the
    target shifted right behind BOS and predicts the target itself."""
    check_trainable(c)  # an encoder-only model returns no logits: nothing predicts tgt
    tgt_in = shift_right(tgt, c.bos_id)
    logits = reference.forward(weights, c, src, tgt_in).logits
    # check_trainable let only a model with a decoder through, and that returns logits.
    assert logits is not None
    return label_smoothed_loss(logits, tgt, c.pad_id, c.label_smoothing)


def adam_step(
    w: np.ndarray,
    g: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    step: int,
    lr: float,
    betas: tuple[float, float] = ADAM_BETAS,
    eps: float = ADAM_EPS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kingma & Ba, Algorithm 1, with eps added to sqrt(v_hat) (torch's and optax's placement):
    w -= lr * m_hat / (sqrt(v_hat) + eps). Keras puts eps on sqrt(v) before the bias correction;
    each train.py must reproduce this step exactly. Returns (w, m, v)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat = m / (1 - b1**step)
    v_hat = v / (1 - b2**step)
    return w - lr * m_hat / (np.sqrt(v_hat) + eps), m, v
