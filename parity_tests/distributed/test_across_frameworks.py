"""The three engines against each other: 2-way data parallelism in torch (DDP), Keras
(keras.distribution on its JAX backend) and Flax NNX (jax.sharding), on the same weights and the
same ragged global batches, through the application's launcher (transformer_rosetta.app.distributed,
what `rosetta train --data-parallel 2` runs), end with the same losses and weights.

Each engine is also tested against its own framework's one-device run (test_torch_distributed,
test_keras_distributed, test_jax_distributed); this file checks the pairs directly, so the claim
"the same in every framework" does not rest on transitivity alone.

Bound: float64, 1e-12, the training-parity bound of the project (parity_tests/impl/
test_training.py): each engine sums another way (replica sums, then the reduction; XLA's and
ATen's kernels), which moves the final weights by a few ulps of their size after 20 Adam steps
(measured: below 1e-14). The config has no attention biases: a key bias's true gradient is 0 and
its trained value is rounding noise that no two summation orders share (docs/DISTRIBUTED.md).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from parity_tests.distributed.cases import CONFIG, F64_ATOL, ROWS, STEPS, WARMUP, global_batch
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.app.distributed import train_on_mesh
from transformer_rosetta.spec.mesh import MeshShape, replica_rows, target_tokens
from transformer_rosetta.weights.init import init_weights

ENGINES = ("torch", "tf", "jax")


def global_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """STEPS ragged global batches whose two replicas hold different token counts."""
    return [global_batch(seed) for seed in range(STEPS)]


def test_the_three_engines_train_alike_on_ragged_batches():
    missing = {e: unavailable_reason(e) for e in ENGINES if unavailable_reason(e)}
    if missing:
        pytest.skip(f"needs every framework: {missing}")
    batches = global_batches()
    for _, tgt in batches:  # the trap is armed: the replicas hold different token counts
        counts = [target_tokens(tgt[replica_rows(ROWS, 2, r)], CONFIG.pad_id) for r in range(2)]
        assert counts[0] != counts[1], counts
    weights = init_weights(CONFIG, seed=0, scheme="perturbed", dtype="float64")
    runs = {
        engine: train_on_mesh(
            engine, CONFIG, weights, batches, MeshShape(data=2), dtype="float64", warmup=WARMUP
        )
        for engine in ENGINES
    }
    moved = max(float(np.abs(runs["torch"][1][k] - v).max()) for k, v in weights.items())
    assert moved > 1e-3  # the steps trained
    for a, b in itertools.combinations(ENGINES, 2):
        (losses_a, weights_a), (losses_b, weights_b) = runs[a], runs[b]
        assert np.max(np.abs(np.subtract(losses_a, losses_b))) <= F64_ATOL, (a, b)
        gap = max(float(np.abs(weights_a[k] - weights_b[k]).max()) for k in weights)
        assert gap <= F64_ATOL, (a, b, gap)
