"""The search's per-step reduction on the device (transformer_rosetta.decoding.search.TopStepper): each
framework's decode.top_k_log_probs against the spec's own float64 arithmetic, and a whole search
through it against the same search fed the full logits.

Bounds: the device takes the log-softmax of float32 logits in float32, the spec in float64. A
log-probability of magnitude |l| <= 20 (a 29-token vocabulary of O(1) logits is far inside) is
then off by a few roundings of 2^-24 relative to the values it is made of: 1e-5 absolute, the
float32 bound (common/spec/tolerances.py), covers it with room. Ties must break to the lower id
in every framework, exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from transformer_rosetta.decoding.search import (
    Stepper,
    TopStepper,
    beam_search,
    greedy_search,
    log_softmax,
    top_log_probs,
)
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.tolerances import ATOL
from transformer_rosetta.weights.init import init_weights

# Rows with ties at the top and across the k-th place; one row of equal logits.
LOGITS = np.array(
    [
        [0.5, 3.0, 3.0, -1.0, 3.0, 2.0],
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [-2.0, 0.25, 7.5, 0.25, 7.5, -9.0],
    ],
    dtype=np.float32,
)


def _torch(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    import torch

    from transformer_rosetta.torch_impl.decode import top_k_log_probs

    values, ids = top_k_log_probs(torch.from_numpy(logits), k)
    return values.numpy(), ids.numpy()


def _tf(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    backend_or_skip("tf")
    import tensorflow as tf

    from transformer_rosetta.tf_impl.decode import top_k_log_probs

    values, ids = top_k_log_probs(tf.constant(logits), k)
    return values.numpy(), ids.numpy()


def _jax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    import jax.numpy as jnp

    from transformer_rosetta.jax_impl.decode import top_k_log_probs

    values, ids = top_k_log_probs(jnp.asarray(logits), k)
    return np.asarray(values), np.asarray(ids)


REDUCERS: dict[str, Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]] = {
    "torch": _torch,
    "tf": _tf,
    "jax": _jax,
}


@pytest.mark.parametrize("k", [1, 2, 3, 6])
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_top_k_on_the_device_is_the_specs(framework, k):
    backend_or_skip(framework)
    values, ids = REDUCERS[framework](LOGITS, k)
    want = log_softmax(LOGITS)
    want_ids = np.argsort(-want, axis=-1, kind="stable")[:, :k]  # ties: the lower id first
    assert ids.shape == (3, k) and np.array_equal(ids, want_ids), ids
    assert np.max(np.abs(values - np.take_along_axis(want, want_ids, axis=-1))) <= ATOL["float32"]


def test_the_ties_are_real():
    """The premise: the rows above tie at the top (k = 1) and across the k-th place (k = 2)."""
    assert np.argsort(-LOGITS[0], kind="stable")[:3].tolist() == [1, 2, 4]
    assert (LOGITS[1] == 1.0).all() and LOGITS[2, 2] == LOGITS[2, 4]


class FullLogits:
    """A Stepper that hides its model's step_top, so the search takes the spec's host path."""

    def __init__(self, stepper: Stepper) -> None:
        self.inner = stepper

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self.inner.step(tokens)

    def reorder(self, rows: np.ndarray) -> None:
        self.inner.reorder(rows)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_a_search_reduced_on_the_device_decodes_as_the_spec(framework):
    backend = backend_or_skip(framework)
    config = preset("tiny")
    weights = init_weights(config, seed=3, scheme="perturbed", dtype="float64")
    model = backend.build(config, weights, dtype="float32")
    src = np.array([[5, 9, 11, 4, 2], [7, 3, 2, 0, 0]])
    assert isinstance(model.stepper(src, 1, 4), TopStepper)

    def hidden(src: np.ndarray, beams: int, max_steps: int) -> FullLogits:
        return FullLogits(model.stepper(src, beams, max_steps))

    assert not isinstance(hidden(src, 1, 4), TopStepper)
    for search in (greedy_search, lambda *a: beam_search(*a, beam=3)):
        device = search(model.stepper, config, src)
        host = search(hidden, config, src)
        assert all(np.array_equal(a, b) for a, b in zip(device.tokens, host.tokens, strict=True))
        assert np.array_equal(device.finished, host.finished)
        # A score sums up to 11 steps' log-probabilities, each within the bound above.
        assert np.max(np.abs(device.scores - host.scores)) <= 11 * ATOL["float32"]


def test_top_log_probs_of_a_plain_stepper_is_the_float64_spec():
    class Fixed:
        def step(self, tokens: np.ndarray) -> np.ndarray:
            return LOGITS.astype(np.float64)

        def reorder(self, rows: np.ndarray) -> None:
            pass

    values, ids = top_log_probs(Fixed(), np.zeros(3, np.int64), 2)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 4]]
    assert np.array_equal(values, np.take_along_axis(log_softmax(LOGITS), ids, axis=-1))
