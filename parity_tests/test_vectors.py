"""The stored vectors (parity_tests/vectors/) are reproduced: by the oracle to float64 summation
order, and by every implementation in float64 within the float64 bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.oracle import reference
from common.spec.tolerances import atol_for
from common.weights.format import load_weights
from parity_tests.vectors.make_vectors import VECTOR_CONFIGS, vector_inputs, write_vectors

HERE = Path(__file__).parent / "vectors"
# The oracle on the machine that wrote the files reproduces them bit for bit. Elsewhere a BLAS
# with other blocking may sum in another order: 1e-13 covers that (values are O(1)) and nothing else.
ORACLE_ATOL = 1e-13


def stored(name: str):
    weights = load_weights(HERE / f"{name}.safetensors")
    with np.load(HERE / f"{name}.npz", allow_pickle=False) as npz:
        arrays = dict(npz)
    return weights, arrays


@pytest.mark.parametrize("name", list(VECTOR_CONFIGS))
def test_oracle_reproduces_the_stored_vectors(name):
    wf, arrays = stored(name)
    assert wf.config == VECTOR_CONFIGS[name] and wf.dtype == "float64"
    src, tgt_in = vector_inputs(wf.config)
    np.testing.assert_array_equal(arrays["src"], src)
    np.testing.assert_array_equal(arrays["tgt_in"], tgt_in)
    got = reference.forward(wf.tensors, wf.config, arrays["src"], arrays["tgt_in"]).named()
    assert set(got) == set(arrays) - {"src", "tgt_in"}
    for key, value in got.items():
        assert np.max(np.abs(value - arrays[key])) <= ORACLE_ATOL, key


def test_regenerating_gives_the_same_files(tmp_path):
    write_vectors(tmp_path)
    for name in VECTOR_CONFIGS:
        new, old = (
            load_weights(tmp_path / f"{name}.safetensors"),
            load_weights(HERE / f"{name}.safetensors"),
        )
        assert new.config == old.config
        assert all(new.tensors[k].tobytes() == old.tensors[k].tobytes() for k in old.tensors)
        with np.load(tmp_path / f"{name}.npz") as a, np.load(HERE / f"{name}.npz") as b:
            assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(VECTOR_CONFIGS))
def test_implementation_reproduces_the_stored_vectors(backend, name):
    wf, arrays = stored(name)
    model = backend.build(wf.config, wf.tensors, dtype="float64")
    got = model.forward(arrays["src"], arrays["tgt_in"], attention=True).named()
    for key, value in got.items():
        diff = float(np.max(np.abs(np.asarray(value, np.float64) - arrays[key])))
        assert diff <= atol_for("float64"), f"{key} off by {diff:.3g}"
