"""The stored vectors (parity_tests/vectors/) are reproduced: by the oracle to float64 summation
order, and by every implementation in float64 within the float64 bound."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parity_tests.paths import ROOT, VECTORS
from parity_tests.vectors.make_vectors import VECTOR_CONFIGS, vector_inputs, write_vectors
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

HERE = VECTORS
CONSTRAINTS = ROOT / "constraints.txt"
# Computed float64 outputs are never compared bit for bit: another CPU's BLAS and SIMD kernels
# sum in another order. 1e-13 covers that and nothing else (derived in
# test_regenerating_gives_the_same_files).
ORACLE_ATOL = 1e-13
assert ORACLE_ATOL <= atol_for("float64")  # never looser than the float64 bound of tolerances.py


def pinned_numpy() -> str | None:
    """The numpy version constraints.txt pins (`numpy==X`): the one CI installs and the vectors
    are written with (`python -m parity_tests.vectors.make_vectors` in the .ci/install venv)."""
    if not CONSTRAINTS.exists():
        return None
    pins = re.findall(r"^numpy==(\S+)\s*$", CONSTRAINTS.read_text(), re.M)
    return pins[0] if pins else None


def stored(name: str):
    weights = load_weights(HERE / f"{name}.safetensors")
    with np.load(HERE / f"{name}.npz", allow_pickle=False) as npz:
        arrays = dict(npz)
    return weights, arrays


@pytest.mark.parametrize("name", list(VECTOR_CONFIGS))
def test_oracle_reproduces_the_stored_vectors(name):
    wf, arrays = stored(name)
    assert wf.config == VECTOR_CONFIGS[name] and wf.dtype == "float64"
    for key, ids in zip(("src", "tgt_in"), vector_inputs(wf.config), strict=True):
        assert (key in arrays) == (ids is not None)  # a half stores only its own input
        if ids is not None:
            np.testing.assert_array_equal(arrays[key], ids)
    got = reference.forward(wf.tensors, wf.config, arrays.get("src"), arrays.get("tgt_in")).named()
    assert set(got) == set(arrays) - {"src", "tgt_in"}
    for key, value in got.items():
        assert np.max(np.abs(value - arrays[key])) <= ORACLE_ATOL, key


def test_regenerating_gives_the_same_files(tmp_path):
    """make_vectors.py writes the stored files again.

    Bit for bit what it can promise everywhere: the config, the weights and the input ids. They
    come from numpy's seeded generators (default_rng streams, then one scale and shift per value,
    each correctly rounded), so they are the same bits on any machine unless numpy changes a
    generator's stream, which this test would then report.

    The oracle's outputs are float64 arithmetic: matmuls in numpy's BLAS and its SIMD exp, tanh,
    erf..., whose kernels and summation orders change with the CPU (an Intel Xeon with AVX-512
    and AMX gave other last bits than the AMD EPYC that wrote the files, under the same numpy
    2.4.6) and with numpy's release. So they are never compared bit for bit: on every machine
    they must agree within ORACLE_ATOL (1e-13), the bound test_oracle_reproduces_the_stored_vectors
    holds the oracle to, four orders below the float64 bound atol_for("float64") = 1e-10 of
    common/spec/tolerances.py. The vectors' longest inner product is d_ff = 20 terms, through at
    most 4 layers of O(1) values: a worst-case rounding bound of about 4 * 2 * 20 * 1.1e-16 * 5
    (layers, sublayers, terms, unit roundoff, the logits' size) = 9e-14; errors of random sign
    stay far below it (the largest measured between two CPUs: 2.3e-15)."""
    write_vectors(tmp_path)
    where = f"numpy {np.__version__}, vectors written with {pinned_numpy()}"
    for name in VECTOR_CONFIGS:
        new, old = (
            load_weights(tmp_path / f"{name}.safetensors"),
            load_weights(HERE / f"{name}.safetensors"),
        )
        assert new.config == old.config
        assert new.tensors.keys() == old.tensors.keys()
        changed = [k for k in old.tensors if new.tensors[k].tobytes() != old.tensors[k].tobytes()]
        assert not changed, f"{name}: weights {changed} differ ({where}: a generator changed?)"
        with np.load(tmp_path / f"{name}.npz") as a, np.load(HERE / f"{name}.npz") as b:
            assert set(a) == set(b)
            for k in sorted({"src", "tgt_in"} & set(b)):
                assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{name}: {k}"
            for k in sorted(set(a) - {"src", "tgt_in"}):
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{name}: {k}"
                diff = float(np.max(np.abs(a[k] - b[k]))) if a[k].size else 0.0
                assert diff <= ORACLE_ATOL, f"{name}: {k} off by {diff:.3g} ({where})"


@pytest.mark.parametrize("name", list(VECTOR_CONFIGS))
def test_implementation_reproduces_the_stored_vectors(backend, name):
    wf, arrays = stored(name)
    model = backend.build(wf.config, wf.tensors, dtype="float64")
    got = model.forward(arrays.get("src"), arrays.get("tgt_in"), attention=True).named()
    assert set(got) == set(arrays) - {"src", "tgt_in"}
    for key, value in got.items():
        diff = float(np.max(np.abs(np.asarray(value, np.float64) - arrays[key])))
        assert diff <= atol_for("float64"), f"{key} off by {diff:.3g}"
