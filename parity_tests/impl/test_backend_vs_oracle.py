"""Every implementation against the float64 oracle, over the config variant grid.

float64 within 1e-10 and float32 within 1e-5 (common/spec/tolerances.py, docs/PARITY.md) on attention
probabilities, encoder output and logits; both attention paths; every mode the backend has
(eager on the full grid, compiled on the pairwise subset). The oracle runs on the weights rounded
to the model's dtype, so the comparison measures computation, not the rounding of the weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.grid import FAMILY_GRID, FULL_GRID, PAIRWISE_GRID, TODAY_GRID, input_cases
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.masks import decoder_self_mask, key_padding_mask
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != oracle {b.shape}"
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def attention_masks(config, src, tgt_in) -> dict[str, np.ndarray]:
    """Where each attention group must be exactly zero: its masked keys. A half has only its own
    groups."""
    masks = {}
    if src is not None:
        masks["encoder_self_attention"] = key_padding_mask(src, config.pad_id)
    if tgt_in is not None:
        masks["decoder_self_attention"] = decoder_self_mask(tgt_in, config.pad_id)
    if src is not None and tgt_in is not None:
        masks["cross_attention"] = key_padding_mask(src, config.pad_id)
    return masks


def check_against_oracle(backend, config, dtype: str, mode: str) -> None:
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    model = backend.build(config, weights, dtype=dtype)
    rounded = {k: v.astype(dtype).astype(np.float64) for k, v in weights.items()}
    atol = atol_for(dtype)
    for case, (src, tgt_in) in input_cases(config).items():
        want = reference.forward(rounded, config, src, tgt_in)
        masks = attention_masks(config, src, tgt_in)
        for attention in (True, False):  # explicit probabilities, then the fused kernel
            got = model.forward(src, tgt_in, attention=attention, mode=mode)
            where = f"{case}, attention={attention}, mode={mode}"
            for name in ("logits", "encoder_output", "pooled_output"):
                if getattr(want, name) is None:  # what the kind lacks, it must not return
                    assert getattr(got, name) is None, f"{name} returned by a {config.kind}"
                    continue
                diff = max_abs_diff(getattr(got, name), getattr(want, name))
                assert diff <= atol, f"{name} off by {diff:.3g} > {atol:g} ({where})"
            for kind in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
                maps = getattr(got, kind)
                if not attention:
                    assert maps is None, f"{kind} returned on the fused path ({where})"
                    continue
                assert len(maps) == len(getattr(want, kind)), f"{kind}: number of layers"
                for layer, (g, w) in enumerate(zip(maps, getattr(want, kind), strict=True)):
                    diff = max_abs_diff(g, w)
                    assert diff <= atol, f"{kind}[{layer}] off by {diff:.3g} ({where})"
                    masked = np.broadcast_to(~masks[kind], g.shape)
                    assert np.all(np.asarray(g)[masked] == 0), (
                        f"{kind}[{layer}] nonzero at masked keys"
                    )


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(FULL_GRID))
def test_eager_forward_matches_oracle(backend, config_id, dtype):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")
    check_against_oracle(backend, FULL_GRID[config_id], dtype, "eager")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(FAMILY_GRID))
def test_the_halves_match_the_oracle(backend, config_id, dtype):
    """Decoder-only and encoder-only models (parity_tests/grid.py FAMILY_GRID), eager and, where
    the backend compiles, compiled: the same bounds as the encoder-decoder."""
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")
    for mode in backend.modes:
        check_against_oracle(backend, FAMILY_GRID[config_id], dtype, mode)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(TODAY_GRID))
def test_todays_decoders_match_the_oracle(backend, config_id, dtype):
    """Rotary positions in both layouts, RMSNorm, gated feed-forwards, grouped-query and
    multi-query attention and bias-free projections (parity_tests/grid.py TODAY_GRID), in every
    mode the backend has: the same bounds as the paper's model, whose derivation (one rounding per
    stage, a few dozen stages) they share: a rotation is two products and a sum per element, a
    gate one product more."""
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")
    for mode in backend.modes:
        check_against_oracle(backend, TODAY_GRID[config_id], dtype, mode)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(PAIRWISE_GRID))
def test_compiled_forward_matches_oracle(backend, config_id, dtype):
    if "compiled" not in backend.modes:
        pytest.skip(f"{backend.name} has no compiled mode")
    check_against_oracle(backend, PAIRWISE_GRID[config_id], dtype, "compiled")


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
