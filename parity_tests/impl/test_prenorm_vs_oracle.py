"""The pre-norm half of the encoder-decoder grid against the float64 oracle, eager: as
test_backend_vs_oracle.py runs the post-norm half (its docstring says which dtype runs where)."""

from __future__ import annotations

import pytest

from parity_tests.grid import FULL_GRID
from parity_tests.impl.against_oracle import check_against_oracle, dtype_or_skip
from parity_tests.impl.test_backend_vs_oracle import eager_cases


@pytest.mark.parametrize(("config_id", "dtype"), eager_cases("pre"))
def test_pre_norm_eager_forward_matches_oracle(backend, config_id, dtype):
    dtype_or_skip(backend, dtype)
    check_against_oracle(backend, FULL_GRID[config_id], dtype, "eager")
