"""Decoder-only and encoder-only models (parity_tests/grid.py FAMILY_GRID) against the float64
oracle, with the encoder-decoder's bounds (against_oracle.py): eager in float64 and float32, and
compiled, where the backend compiles, in float64.

Why compiled runs in float64 only here. A compiled program differs from the eager one by what its
trace fixes: constants, shapes, the branch a Python condition took. A constant traced in the wrong
dtype, or a branch frozen on the first input, moves a float64 output by 1e-8 or more, far over
float64's 1e-10 bound, while float32's 1e-5 would hide the first. The compiled float32 programs are
compared with the oracle on the encoder-decoder's pairwise rows (impl/test_pairs.py), which go
through the same layers.

And on which configs. The compiled programs run on the first three rows of each kind
(COMPILED_ROWS): between them every switch that only a half has (pooling none, mean and first, the
L2 norm on and off, the segment table and the embedding LayerNorm each on and off) is traced,
and the factors' levels are the encoder-decoder's compiled grid's. All 18 configs in three
frameworks, eager and compiled, took 3.5 minutes; the eager runs alone prove every config.
"""

from __future__ import annotations

import pytest

from parity_tests.grid import FAMILY_GRID, KINDS, PAIRWISE_KEYS
from parity_tests.impl.against_oracle import check_in_its_modes

COMPILED_ROWS = 3
COMPILED = [
    cid for kind in KINDS for cid in [c for c in FAMILY_GRID if c.startswith(kind)][:COMPILED_ROWS]
]


def test_the_compiled_rows_trace_every_switch_of_a_half():
    """COMPILED holds each level of what only a half has (the module docstring), in fewer
    configs than the grid."""
    assert len(COMPILED) == COMPILED_ROWS * len(KINDS) < len(PAIRWISE_KEYS) * len(KINDS)
    for kind in KINDS:
        configs = [FAMILY_GRID[cid] for cid in COMPILED if cid.startswith(kind)]
        assert {c.type_vocab_size > 0 for c in configs} == {True, False}, kind
        assert {c.embedding_norm for c in configs} == {True, False}, kind
        if kind == "encoder_only":
            assert {c.pooling for c in configs} == {"none", "mean", "first"}
            assert {c.pooled_l2_norm for c in configs} == {True, False}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(FAMILY_GRID))
def test_the_halves_match_the_oracle(backend, config_id, dtype):
    check_in_its_modes(backend, FAMILY_GRID, config_id, dtype, set(COMPILED))
