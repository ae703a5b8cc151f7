"""Every implementation against the float64 oracle on the encoder-decoder grid, eager: the
post-norm half of FULL_GRID (the paper's) here, the pre-norm half in test_prenorm_vs_oracle.py
(one file for both took 3 minutes). against_oracle.py has the comparison and its bounds; the
halves, today's decoders and the compiled modes have their own files (test_halves_vs_oracle.py,
test_today_vs_oracle.py, test_compiled_vs_oracle.py).

Which dtype runs where. float64 runs on all 108 configs of FULL_GRID: its 1e-10 bound is what
proves every interaction of the factors (a wrong axis, a dropped term or a swapped switch moves an
output by far more). float32 runs on PAIRWISE_GRID's 9 configs, in which every pair of factor
levels appears: its 1e-5 bound is a rounding bound, and a defect only float32 shows is a dtype
path (a cast, a constant built in the wrong dtype, a kernel chosen by dtype) that every config
with the level takes, so a pair of levels carries it. The 99 other float32 configs are in the
`slow` tier (each a minute of the three frameworks' time that no float32-only defect needs).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.grid import FULL_GRID, PAIRWISE_GRID, input_cases
from parity_tests.impl.against_oracle import check_against_oracle, dtype_or_skip, max_abs_diff
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights


def eager_cases(norm_position: str) -> list:
    """(config id, dtype) of FULL_GRID's configs with `norm_position`: float64 on each, float32
    on those of PAIRWISE_GRID, the other float32 ones marked slow (the module docstring)."""
    return [
        pytest.param(
            config_id,
            dtype,
            marks=() if dtype == "float64" or config_id in PAIRWISE_GRID else pytest.mark.slow,
            id=f"{config_id}-{dtype}",
        )
        for dtype in ("float64", "float32")
        for config_id, config in FULL_GRID.items()
        if config.norm_position == norm_position
    ]


@pytest.mark.parametrize(("config_id", "dtype"), eager_cases("post"))
def test_eager_forward_matches_oracle(backend, config_id, dtype):
    dtype_or_skip(backend, dtype)
    check_against_oracle(backend, FULL_GRID[config_id], dtype, "eager")


@pytest.mark.slow
def test_base_config_float64_matches_oracle(backend):
    """The paper's base sizes (d_model 512, 8 heads, 6+6 layers, d_ff 2048), vocabulary cut to
    1000 to keep memory small: float64 stays within the float64 bound at full depth."""
    from transformer_rosetta.spec.config import preset

    config = preset("base").replace(src_vocab_size=1000, tgt_vocab_size=1000, dropout=0.0)
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    src, tgt_in = input_cases(config)["ragged"]
    want = reference.forward(weights, config, src, tgt_in)
    got = backend.build(config, weights, dtype="float64").forward(src, tgt_in, attention=True)
    for name, value in got.named().items():
        diff = max_abs_diff(value, want.named()[name])
        assert diff <= atol_for("float64"), f"{name} off by {diff:.3g}"


def test_head_dim_one_with_as_many_heads_as_positions(backend):
    """Regression (found by impl/test_properties.py): d_k = 1 and T = h. Keras 3.15's TF `ops.add`
    added the (h, 1) per-head bias along T (tf_impl/model.py, HeadProjection)."""
    from transformer_rosetta.spec.config import preset

    config = preset("tiny").replace(d_model=2, num_heads=2, d_ff=4, bos_id=0, eos_id=1)
    weights = init_weights(config, seed=0, scheme="perturbed")
    src, tgt_in = np.array([[3, 4]]), np.array([[0, 5]])  # S = T = h = 2
    want = reference.forward(weights, config, src, tgt_in)
    got = backend.build(config, weights, dtype="float64").forward(src, tgt_in, attention=True)
    for name, array in want.named().items():
        assert max_abs_diff(got.named()[name], array) <= atol_for("float64", config), name
