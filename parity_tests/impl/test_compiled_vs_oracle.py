"""The compiled mode (a tf.function graph, a jax.jit program) of every backend that has one,
against the float64 oracle on the encoder-decoder's pairwise grid (PAIRWISE_GRID: every pair of
factor levels), in float64, with the bounds of against_oracle.py.

Why float64 only here. A compiled program differs from the eager one by what its trace fixes:
constants, shapes, the branch a Python condition took. A constant traced in the wrong dtype, or a
branch frozen on the first input, moves a float64 output by 1e-8 or more, far over float64's 1e-10
bound, where float32's 1e-5 would hide the first. The compiled float32 programs are compared with
the oracle in impl/test_pairs.py (the oracle is one side of every pair there), on the four rows of
this grid that hold every factor level; both dtypes here took over 2 minutes (a compile is about
a second per input shape and attention path).
"""

from __future__ import annotations

import pytest

from parity_tests.grid import PAIRWISE_GRID
from parity_tests.impl.against_oracle import check_against_oracle


@pytest.mark.parametrize("config_id", list(PAIRWISE_GRID))
def test_compiled_forward_matches_oracle(backend, config_id):
    if "compiled" not in backend.modes:
        pytest.skip(f"{backend.name} has no compiled mode")
    check_against_oracle(backend, PAIRWISE_GRID[config_id], "float64", "compiled")
