"""Every pair of frameworks, the oracle included, agrees through the adapter.

The pairs are built from `transformer_rosetta.adapter.backends.FRAMEWORKS`, so a newly registered backend joins every
pair without an edit here. float64 within 1e-10 and float32 within 1e-5 (common/spec/tolerances.py);
both attention paths; every mode each backend has. The oracle computes in float64 only: in a
float32 pair it runs on the weights rounded to float32, as in impl/test_backend_vs_oracle.py, so the
bound measures the other side's computation and not the rounding of its weights.

Each framework runs once per (config, dtype, mode) and every pair reuses that run. The configs and
inputs are the grid's own (PAIRWISE_GRID, input_cases), so in a full session the compiled
programs of impl/test_compiled_vs_oracle.py are reused from the frameworks' caches.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.grid import FACTORS, PAIRWISE_GRID, PAIRWISE_KEYS, input_cases
from transformer_rosetta.adapter.backends import FRAMEWORKS, unavailable_reason
from transformer_rosetta.app.parity import ORACLE
from transformer_rosetta.spec.dtypes import numpy_dtype
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

# Four rows of the pairwise grid: between them every norm position, activation, position kind,
# embedding sharing and attention-bias setting appears (checked below).
PAIR_KEYS = [
    ("post", "relu", "sin-interleaved", "untied", True),
    ("post", "gelu_tanh", "sin-interleaved", "shared", False),
    ("pre", "gelu_tanh", "sin-concatenated", "tied", True),
    ("pre", "gelu", "learned", "shared", True),
]
PAIR_CONFIGS = [
    cid for key, cid in zip(PAIRWISE_KEYS, PAIRWISE_GRID, strict=True) if key in PAIR_KEYS
]
PAIRS = list(itertools.combinations(FRAMEWORKS, 2))
MODES = ("eager", "compiled")

Outputs = dict[tuple[str, bool], dict[str, np.ndarray]]  # (input case, attention) -> named arrays


def test_pair_configs_cover_every_factor_level():
    assert len(PAIR_CONFIGS) == len(PAIR_KEYS)
    for i, levels in enumerate(FACTORS):
        assert {key[i] for key in PAIR_KEYS} == set(levels), f"factor {i} not covered"


def test_every_registered_framework_is_paired_with_every_other():
    """Adding a framework to the registry is all it takes to join the pairs."""
    for a in FRAMEWORKS:
        partners = {b for pair in PAIRS for b in pair if a in pair and b != a}
        assert partners == set(FRAMEWORKS) - {a}


def mode_for(name: str, mode: str) -> str:
    """The mode a backend runs in for a pair test in `mode`: its own if it has it, else eager
    (a compiled-mode pair compares each compiled side with the other side as it can run)."""
    return mode if mode in backend_or_skip(name).modes else "eager"


@functools.cache
def run(name: str, config_id: str, dtype: str, mode: str) -> Outputs:
    """One framework's outputs on the grid inputs, both attention paths, computed once."""
    backend = backend_or_skip(name)
    config = PAIRWISE_GRID[config_id]
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    if dtype not in backend.dtypes:
        # Only the oracle gets here (the test skips other frameworks): float64 on the rounded
        # weights, i.e. exactly what a `dtype` model holds, computed without rounding.
        weights = {k: v.astype(numpy_dtype(dtype)).astype(np.float64) for k, v in weights.items()}
        dtype = "float64"
    model = backend.build(config, weights, dtype=dtype)
    outputs: Outputs = {}
    for case, (src, tgt_in) in input_cases(config).items():
        for attention in (True, False):
            got = model.forward(src, tgt_in, attention=attention, mode=mode)
            outputs[case, attention] = got.named()
    return outputs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", PAIR_CONFIGS)
@pytest.mark.parametrize(("left", "right"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_pair_agrees(left, right, config_id, dtype, mode):
    for name in (left, right):
        reason = unavailable_reason(name)
        if reason is not None:
            pytest.skip(f"backend {name}: {reason}")
    for name in (left, right):
        if name != ORACLE and dtype not in backend_or_skip(name).dtypes:
            pytest.skip(f"{name} does not compute in {dtype}")
    modes = {name: mode_for(name, mode) for name in (left, right)}
    if mode != "eager" and all(m == "eager" for m in modes.values()):
        pytest.skip(f"neither {left} nor {right} has a {mode} mode")

    atol = atol_for(dtype)
    a = run(left, config_id, dtype, modes[left])
    b = run(right, config_id, dtype, modes[right])
    assert a.keys() == b.keys()
    for key in a:
        case, attention = key
        assert a[key].keys() == b[key].keys(), f"different outputs ({case}, attention={attention})"
        for quantity, x in a[key].items():
            x, y = np.asarray(x, np.float64), np.asarray(b[key][quantity], np.float64)
            assert x.shape == y.shape, f"{quantity}: {left} {x.shape} != {right} {y.shape}"
            assert np.all(np.isfinite(x)) and np.all(np.isfinite(y)), f"{quantity}: non-finite"
            diff = float(np.max(np.abs(x - y))) if x.size else 0.0
            assert diff <= atol, (
                f"{quantity}: {left} ({modes[left]}) and {right} ({modes[right]}) differ by "
                f"{diff:.3g} > {atol:g} in {dtype} ({config_id}, {case}, attention={attention})"
            )
