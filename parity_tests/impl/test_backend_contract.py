"""What every backend, the oracle included, must do beyond the numbers: round trip its weights
bit-exactly and refuse bad ids with a message that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.grid import FULL_GRID, PAIRWISE_GRID, variant
from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights.init import init_weights

ROUND_TRIP_CONFIGS = {k: PAIRWISE_GRID[k] for k in list(PAIRWISE_GRID)[:4]}


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("config_id", list(ROUND_TRIP_CONFIGS))
def test_canonical_round_trip_is_bit_exact(any_backend, config_id, dtype):
    if dtype not in any_backend.dtypes:
        pytest.skip(f"{any_backend.name} does not compute in {dtype}")
    config = ROUND_TRIP_CONFIGS[config_id]
    weights = init_weights(config, seed=3, scheme="perturbed", dtype=dtype)
    exported = any_backend.build(config, weights, dtype=dtype).export()
    assert list(exported) == list(canonical_shapes(config))
    for name, want in weights.items():
        got = exported[name]
        assert got.dtype == want.dtype, f"{name}: {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: {got.shape} != {want.shape}"
        assert got.tobytes() == want.tobytes(), f"{name} changed in the round trip"


@pytest.fixture
def learned_model(any_backend):
    config = variant("post", "relu", "learned", "untied", True)
    dtype = any_backend.dtypes[0] if "float32" not in any_backend.dtypes else "float32"
    return any_backend.build(config, init_weights(config, 0, dtype="float64"), dtype=dtype)


SRC = np.array([[5, 6, 7], [8, 9, 0]])
TGT = np.array([[1, 4], [1, 0]])


@pytest.mark.parametrize(
    ("src", "tgt", "message"),
    [
        (SRC.astype(np.float32), TGT, "src: token ids must be integers, got dtype float32"),
        (SRC, TGT.astype(np.float64), "tgt: token ids must be integers"),
        (SRC[0], TGT, "src: expected shape [batch, length] (rank 2), got [3]"),
        (SRC[None], TGT, "src: expected shape [batch, length] (rank 2), got [1, 2, 3]"),
        (
            np.array([[5, 23]]),
            TGT[:1],
            "src: token id 23 at [0, 1] is outside the vocabulary [0, 23)",
        ),
        (SRC, np.array([[1, -1], [1, 0]]), "tgt: token id -1 at [0, 1] is outside the vocabulary"),
        (SRC, TGT[:1], "batch sizes differ: src has 2 rows, tgt has 1"),
        (np.ones((1, 17), np.int64), TGT[:1], "src: length 17 exceeds max_len=16"),
        (SRC, np.ones((2, 17), np.int64), "tgt: length 17 exceeds max_len=16"),
    ],
)
def test_bad_inputs_are_refused_with_their_message(learned_model, src, tgt, message):
    with pytest.raises(InputError) as info:
        learned_model.forward(src, tgt)
    assert message in str(info.value)


def test_sinusoidal_positions_extrapolate_past_max_len(any_backend):
    config = FULL_GRID["post-relu-sin-interleaved-untied-bias"]
    dtype = "float64"
    if dtype not in any_backend.dtypes:
        pytest.skip(f"{any_backend.name} does not compute in {dtype}")
    weights = init_weights(config, 0, scheme="perturbed", dtype="float64")
    src = np.arange(3, 3 + 20).reshape(1, 20) % 20 + 3  # 20 > max_len 16
    tgt = np.concatenate([[[1]], src[:, :18] % 25 + 3], axis=1)
    got = any_backend.build(config, weights, dtype=dtype).forward(src, tgt)
    want = reference.forward(weights, config, src, tgt)
    assert np.max(np.abs(got.logits - want.logits)) <= 1e-10


def test_build_refuses_a_dtype_or_device_it_lacks(any_backend):
    config = ROUND_TRIP_CONFIGS[next(iter(ROUND_TRIP_CONFIGS))]
    weights = init_weights(config, 0)
    with pytest.raises(
        ValueError, match=f"dtype: {any_backend.name} does not compute in 'float16'"
    ):
        any_backend.build(config, weights, dtype="float16")
    dtype = any_backend.dtypes[0]
    with pytest.raises(ValueError, match=f"device: 'gpu:7' is not visible to {any_backend.name}"):
        any_backend.build(config, weights, dtype=dtype, device="gpu:7")
