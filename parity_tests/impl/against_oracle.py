"""The comparison every forward-parity file makes (test_backend_vs_oracle.py, test_halves_vs_oracle.py,
test_today_vs_oracle.py, test_compiled_vs_oracle.py, test_rotary.py): one implementation against the
float64 oracle on a grid config, every output the kind has, both attention paths.

float64 within 1e-10 and float32 within 1e-5 (common/spec/tolerances.py, docs/PARITY.md). The
oracle runs on the weights rounded to the model's dtype, so the comparison measures computation,
not the rounding of the weights. Attention probabilities must also be exactly zero at every masked
key.
"""

from __future__ import annotations

import numpy as np

from parity_tests.grid import input_cases
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
    """`backend`'s model of `config` (perturbed weights of seed 0) in `dtype` and `mode` against
    the oracle on every input case of the grid (input_cases)."""
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


def dtype_or_skip(backend, dtype: str) -> None:
    import pytest

    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")


def check_in_its_modes(backend, grid: dict, config_id: str, dtype: str, compiled: set) -> None:
    """A grid config in eager and, in float64 where `compiled` holds it, in every other mode the
    backend has (test_halves_vs_oracle.py says why compiled runs in float64 only)."""
    dtype_or_skip(backend, dtype)
    with_compiled = dtype == "float64" and config_id in compiled
    for mode in backend.modes if with_compiled else ("eager",):
        check_against_oracle(backend, grid[config_id], dtype, mode)
