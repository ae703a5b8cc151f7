"""Training parity: loss, gradients under canonical names and Adam + Noam steps agree across the
frameworks, against the float64 oracle's loss and finite differences of it.

Bounds (float64): loss 1e-10 (a forward pass); gradients 1e-9 between frameworks (the
bound of one backward pass of the same sums); finite differences 1e-6 (central differences with
h = 1e-5 err by h^2 f''' ~ 1e-10 plus rounding 1e-16 / h ~ 1e-11, on gradients of size ~1e-2, so
1e-6 is loose for the method and tight for a wrong or missing gradient, which is O(1e-2)).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.grid import PAIRWISE_GRID
from transformer_rosetta.adapter.backends import FRAMEWORKS
from transformer_rosetta.oracle import reference
from transformer_rosetta.oracle.training import (
    adam_step,
    label_smoothed_loss,
    noam_learning_rate,
    oracle_loss,
)
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights.init import init_weights

IMPLS = [f for f in FRAMEWORKS if f != "numpy"]
CONFIGS = {k: PAIRWISE_GRID[k] for k in list(PAIRWISE_GRID)[:3]}
LOSS_ATOL_F64, GRAD_ATOL_F64, FD_ATOL = 1e-10, 1e-9, 1e-6
# float32, measured against each framework's own float64 run on these configs: gradients differ
# by <= 1.0e-7 (torch), 1.4e-7 (Keras), 1.7e-7 (Flax) with |g| up to 0.5; 20-step losses by
# <= 8.7e-7 on a loss of ~3.5. Two float32 runs can be off in opposite directions, so a pair may
# differ by twice that. Bounds: 1e-6 on gradients and 5e-6 on losses (~3x the pair worst case),
# far below what a wrong gradient (O(1e-2)) or a wrong optimizer step would show.
GRAD_ATOL_F32, LOSS_ATOL_F32 = 1e-6, 5e-6


# The accuracy is a count of argmax hits: equal in two float64 runs when no top-1 logit is within
# their difference (~1e-14) of the runner-up. The weights and batches are seeded, so the oracle's
# smallest top-1 margin is the same on every CPU; it is asserted above this before the accuracies
# are compared.
ARGMAX_MARGIN_F64 = 1e-10


def argmax_margin(weights, config, src, tgt) -> float:
    """The oracle's smallest top-1 minus top-2 logit over the target positions the accuracy counts
    (not padding): how far every argmax is from a tie."""
    logits = reference.forward(weights, config, src, shift_right(tgt, config.bos_id)).logits
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return float((top2[..., 1] - top2[..., 0])[tgt != config.pad_id].min())


def batch(config, seed=0):
    src, tgt_in = ragged_batch(config, batch=3, src_len=6, tgt_len=5, seed=seed)
    tgt = np.concatenate([tgt_in[:, 1:], np.full((3, 1), config.pad_id)], axis=1)  # drop BOS
    tgt[0, -1] = config.eos_id
    return src, tgt


def model(name, config, dtype, seed=0):
    backend = backend_or_skip(name)
    weights = init_weights(config, seed=seed, scheme="perturbed", dtype="float64")
    m = backend.build(config, weights, dtype=dtype)
    if not hasattr(m, "loss_and_grads"):
        pytest.skip(f"{name} has no training yet (train.py)")
    return m, weights


def model_from(name, config, weights):
    return backend_or_skip(name).build(config, weights, dtype="float64")


def test_noam_schedule_at_hand_computed_steps():
    # d^-0.5 * min(step^-0.5, step * warmup^-1.5); the two branches meet at step == warmup.
    assert noam_learning_rate(1, 512, 4000) == pytest.approx(512**-0.5 * 4000**-1.5, rel=1e-15)
    assert noam_learning_rate(4000, 512, 4000) == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-15)
    assert noam_learning_rate(16000, 512, 4000) == pytest.approx(
        512**-0.5 / 126.49110640673517, rel=1e-12
    )
    with pytest.raises(ValueError):
        noam_learning_rate(0, 512)


def test_label_smoothed_loss_by_hand():
    # Two classes, logits (0, 0): p = (1/2, 1/2); every cross-entropy is log 2, smoothed or not.
    loss, acc, n = label_smoothed_loss(
        np.zeros((1, 2, 2)), np.array([[1, 0]]), pad_id=0, smoothing=0.1
    )
    assert (loss, n) == (pytest.approx(np.log(2)), 1)
    # A confident right answer: loss = (1 - eps) * nll + eps * mean(-log p).
    logits = np.array([[[0.0, 3.0, 0.0]]])
    lp = logits[0, 0] - np.log(np.exp(logits[0, 0]).sum())
    loss, acc, n = label_smoothed_loss(logits, np.array([[1]]), pad_id=0, smoothing=0.1)
    assert loss == pytest.approx(0.9 * -lp[1] + 0.1 * -lp.mean(), rel=1e-14) and acc == 1.0


@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.parametrize("name", IMPLS)
def test_loss_matches_the_oracle_and_grads_match_finite_differences(name, config_id):
    config = CONFIGS[config_id]
    m, weights = model(name, config, "float64")
    src, tgt = batch(config)
    out = m.loss_and_grads(src, tgt)
    want_loss, want_acc, want_n = oracle_loss(weights, config, src, tgt)
    assert abs(out.loss - want_loss) <= LOSS_ATOL_F64 and out.tokens == want_n
    assert argmax_margin(weights, config, src, tgt) > ARGMAX_MARGIN_F64
    assert out.accuracy == pytest.approx(want_acc, abs=1e-12)
    assert list(out.grads) == list(canonical_shapes(config))
    rng = np.random.default_rng(7)
    for name_ in (
        "encoder.layers.0.self_attention.query.kernel",
        "decoder.layers.0.cross_attention.value.kernel",
        "decoder.layers.0.feed_forward_norm.scale",
        list(weights)[0],
        list(weights)[-1],
    ):
        index = tuple(int(rng.integers(0, d)) for d in weights[name_].shape)
        h = 1e-5
        plus = {k: v.copy() for k, v in weights.items()}
        minus = {k: v.copy() for k, v in weights.items()}
        plus[name_][index] += h
        minus[name_][index] -= h
        fd = (oracle_loss(plus, config, src, tgt)[0] - oracle_loss(minus, config, src, tgt)[0]) / (
            2 * h
        )
        assert abs(out.grads[name_][index] - fd) <= FD_ATOL, (
            f"{name_}{index}: {out.grads[name_][index]} vs {fd}"
        )


@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(IMPLS, 2)))
def test_gradients_agree_pairwise_in_float64(a, b, config_id):
    config = CONFIGS[config_id]
    src, tgt = batch(config)
    ga = model(a, config, "float64")[0].loss_and_grads(src, tgt).grads
    gb = model(b, config, "float64")[0].loss_and_grads(src, tgt).grads
    for name in canonical_shapes(config):
        diff = float(np.max(np.abs(ga[name] - gb[name])))
        assert diff <= GRAD_ATOL_F64, f"{name}: {a} vs {b} off by {diff:.3g}"


@pytest.mark.parametrize("name", IMPLS)
def test_one_step_is_adam_with_torchs_epsilon_placement(name):
    """One train step equals transformer_rosetta.oracle.training.adam_step on the model's own gradients: this is
    what pins Keras' epsilon (placed on sqrt(v) before bias correction) to torch's and optax's."""
    config = CONFIGS[next(iter(CONFIGS))]
    m, weights = model(name, config, "float64")
    src, tgt = batch(config)
    grads = m.loss_and_grads(src, tgt).grads
    lr = noam_learning_rate(1, config.d_model, warmup=10)
    m.train_steps([(src, tgt)], warmup=10)
    after = m.export()
    for k, g in grads.items():
        w = weights[k]
        want, _, _ = adam_step(w, g, np.zeros_like(w), np.zeros_like(w), step=1, lr=lr)
        assert np.max(np.abs(after[k] - want)) <= 1e-12, k


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(IMPLS, 2)))
def test_twenty_adam_steps_agree_pairwise(a, b):
    config = CONFIGS[next(iter(CONFIGS))]
    batches = [batch(config, seed=s) for s in range(20)]
    runs = {}
    for name in (a, b):
        m, _ = model(name, config, "float64")
        losses = m.train_steps(batches, warmup=10)
        runs[name] = (np.array(losses), m.export())
    (la, wa), (lb, wb) = runs[a], runs[b]
    assert np.max(np.abs(la - lb)) <= 1e-9, f"losses {a} vs {b}: {np.max(np.abs(la - lb)):.3g}"
    assert la[-1] < la[0], "training did not lower the loss"
    for k in wa:
        if k.endswith(".key.bias"):
            # Its true gradient is exactly 0 (q . b_k adds one constant to a whole softmax row),
            # so both frameworks hand Adam rounding noise of ~1e-17, which Adam scales up to steps
            # of ~lr * g / (|g| + eps): noise, different in each framework, and without effect on
            # any output. The logits below check that.
            continue
        assert np.max(np.abs(wa[k] - wb[k])) <= 1e-9, k
    src, tgt = batches[0]
    tgt_in = shift_right(tgt, config.bos_id)
    logits = [
        model_from(name, config, runs[name][1]).forward(src, tgt_in).logits for name in (a, b)
    ]
    assert np.max(np.abs(logits[0] - logits[1])) <= 1e-9


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(IMPLS, 2)))
def test_float32_gradients_and_twenty_steps_agree_pairwise(a, b):
    config = CONFIGS[next(iter(CONFIGS))]
    src, tgt = batch(config)
    batches = [batch(config, seed=s) for s in range(20)]
    grads, losses = {}, {}
    for name in (a, b):
        m, _ = model(name, config, "float32")
        grads[name] = m.loss_and_grads(src, tgt).grads
        losses[name] = np.array(m.train_steps(batches, warmup=10))
    for k in grads[a]:
        diff = float(np.max(np.abs(grads[a][k].astype(np.float64) - grads[b][k])))
        assert diff <= GRAD_ATOL_F32, f"{k}: {a} vs {b} off by {diff:.3g}"
    diff = float(np.max(np.abs(losses[a] - losses[b])))
    assert diff <= LOSS_ATOL_F32, f"20-step losses {a} vs {b} off by {diff:.3g}"
