"""Today's decoders (parity_tests/grid.py TODAY_GRID) against the float64 oracle: rotary positions
in both layouts, RMSNorm, gated feed-forwards, grouped-query and multi-query attention and
bias-free projections, eager in float64 and float32 and compiled (where the backend compiles) in
float64, as the halves run (test_halves_vs_oracle.py says why compiled is float64 here).

The bounds are the paper's model's (against_oracle.py), whose derivation (one rounding per stage,
a few dozen stages) they share: a rotation is two products and a sum per element, a gate one
product more.

The compiled programs run on five of the configs (COMPILED): rows 0, 5 and 7 of L9 and the
encoder-decoder and encoder-only ones, which between them hold every level of every factor
(feed-forward, key/value heads, biases, rotary layout, norm) and each kind. All 11 in three
frameworks, eager and compiled, took 2.5 minutes; the eager runs alone prove every config.
"""

from __future__ import annotations

import pytest

from parity_tests.grid import TODAY_GRID
from parity_tests.impl.against_oracle import check_in_its_modes

COMPILED = [cid for n, cid in enumerate(TODAY_GRID) if n in (0, 5, 7, 9, 10)]


def levels(config_id: str) -> list[str]:
    """The five factor levels an id names (the kind, where it has one, is its prefix)."""
    return config_id.split("-")[-5:]


def test_the_compiled_configs_hold_every_level_of_every_factor():
    for factor in range(5):
        grid = {levels(cid)[factor] for cid in TODAY_GRID}
        assert {levels(cid)[factor] for cid in COMPILED} == grid, factor
    kinds = {TODAY_GRID[cid].kind for cid in COMPILED}
    assert kinds == {"decoder_only", "encoder_decoder", "encoder_only"}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(TODAY_GRID))
def test_todays_decoders_match_the_oracle(backend, config_id, dtype):
    check_in_its_modes(backend, TODAY_GRID, config_id, dtype, set(COMPILED))
