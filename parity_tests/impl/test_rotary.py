"""Rotary positions (docs/FORMAT.md, step 4a) in both layouts, `rotary_layout` "half_split" and
"interleaved", in every framework (torch, Keras/TF, Flax/JAX) against the float64 oracle
(common/oracle/reference.py, `rotary_angles` and `rotate`), at two levels.

- The function itself: each framework's `rotary_positions` and `rotate` on random queries in
  float64, in the framework's own head layout, against the oracle's `rotate`; and by hand, a
  4-dimensional head at position 1 whose every basis vector's rotation is written out from the
  definitions in FORMAT.md.
- The whole model: a tiny rotary decoder-only model and an encoder-decoder one (rotary in the
  encoder's self-attentions too) per layout, per framework, against the oracle's forward.

Why both: a layout that writes its rotated pairs back in the other layout's order (torch's
interleaved branch with `torch.cat` in place of `stack(...).flatten(-2)`) applies one fixed
permutation P to every rotated query and key. Scores are q . k = (P q) . (P k), so every output
of the model is unchanged, bit for bit: no whole-model comparison can see it, and
impl/test_today_vs_oracle.py's TODAY_GRID (which has interleaved configs in every framework)
did not. Only the direct comparison of the rotated vectors does. The whole-model tests catch
what does move the scores: a wrong pairing, sign, angle or theta, and a layout not passed on.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.grid import TODAY_GRID
from parity_tests.impl.against_oracle import check_against_oracle
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

LAYOUTS = ("half_split", "interleaved")
BACKENDS = ("numpy", *IMPLEMENTATIONS)  # numpy: the oracle itself

# The direct comparison's float64 bound. x is drawn normal(0, 1) (|a|, |b| < 6 here), positions
# run to 15, so angles are at most 15 rad. Each framework computes pos * theta^(-2i/d_k) with its
# own pow (within an ulp or two): an angle off by at most 4 ulp(15) = 7e-15 rad, which moves a
# rotated element by at most (|a| + |b|) 7e-15 < 1e-13, plus a few roundings of O(1) products
# (~1e-15). 1e-12 is ten times that; a wrong pair, order or sign is off by O(1).
F64_ROTATE_BOUND = 1e-12
# The hand computation's bound: the rotated vectors are cos and sin of the angles 1 and 0.1 times
# 0 or 1 (exact products), so the only error is the angle's (theta^(-1/2) within an ulp of 0.1)
# and cos/sin's own, each within an ulp of values <= 1: 1e-15 is about 4.5 eps.
F64_HAND_BOUND = 1e-15


def model_module(name: str):
    """The framework's model module (torch_impl/model.py, tf_impl/model.py, jax_impl/model.py),
    imported after its backend, which sets what the framework needs first (KERAS_BACKEND)."""
    backend_or_skip(name)
    importlib.import_module(f"transformer_rosetta.{name}_impl.backend")
    return importlib.import_module(f"transformer_rosetta.{name}_impl.model")


def rotated(name: str, x: np.ndarray, theta: float, layout: str) -> np.ndarray:
    """x (B, heads, L, d_k), float64, rotated at positions 0 .. L-1 by backend `name`'s own
    position tables and rotation, in its own head layout, returned as (B, heads, L, d_k)."""
    length, d_k = x.shape[2], x.shape[3]
    if name == "numpy":
        return reference.rotate(x, reference.rotary_angles(length, d_k, theta), layout)
    m = model_module(name)
    if name == "torch":  # heads before positions: (B, heads, L, d_k)
        import torch

        cos, sin = m.rotary_positions(length, d_k, theta)
        out = m.rotate(torch.from_numpy(x), cos, sin, layout).numpy()
        assert out.dtype == np.float64
        return out
    swapped = np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # heads after positions
    if name == "tf":
        from keras import ops

        cos, sin = m.rotary_positions(length, d_k, theta)
        out = ops.convert_to_numpy(m.rotate(ops.convert_to_tensor(swapped), cos, sin, layout))
    else:
        import jax.numpy as jnp

        from transformer_rosetta.jax_impl.weights import x64_scope

        with x64_scope("float64"):  # JAX computes float64 only in its x64 mode
            cos, sin = (jnp.asarray(t) for t in m.rotary_positions(length, d_k, theta))
            out = np.asarray(m.rotate(jnp.asarray(swapped), cos, sin, layout))
    assert out.dtype == np.float64, f"{name} rotated in {out.dtype}"
    return out.transpose(0, 2, 1, 3)


# -- the function ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_each_frameworks_rotation_is_the_oracles(framework, layout):
    """Random queries of 3 heads at 16 positions, d_k 6 (not a power of two, three pairs) and
    theta 500 (not the default): each framework's rotation equals the oracle's within
    F64_ROTATE_BOUND, and the other layout's result is O(1) away (the comparison tells the
    layouts apart)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(2, 3, 16, 6))
    want = rotated("numpy", x, 500.0, layout)
    got = rotated(framework, x, 500.0, layout)
    assert got.shape == x.shape
    diff = float(np.max(np.abs(got - want)))
    assert diff <= F64_ROTATE_BOUND, f"{framework}, {layout}: {diff:.3g}"
    other = rotated("numpy", x, 500.0, next(o for o in LAYOUTS if o != layout))
    assert float(np.max(np.abs(got - other))) > 0.1


def hand_rotation(layout: str) -> np.ndarray:
    """Row j: the rotation of basis vector e_j of a 4-dimensional head at position 1, theta 100,
    from FORMAT.md's step 4a: theta(i) = 100^(-2i/4), so pair 0 turns by 1 rad and pair 1 by
    0.1 rad; a pair (a, b) becomes (a cos - b sin, b cos + a sin). Interleaved pairs are (x0, x1)
    and (x2, x3); half-split pairs (x0, x2) and (x1, x3)."""
    c1, s1, c2, s2 = math.cos(1.0), math.sin(1.0), math.cos(0.1), math.sin(0.1)
    if layout == "interleaved":
        return np.array(
            [
                [c1, s1, 0, 0],  # e0 = a of pair 0: (cos, sin)
                [-s1, c1, 0, 0],  # e1 = b of pair 0: (-sin, cos)
                [0, 0, c2, s2],
                [0, 0, -s2, c2],
            ]
        )
    return np.array(
        [
            [c1, 0, s1, 0],  # e0 = a of pair 0, whose b is x2
            [0, c2, 0, s2],  # e1 = a of pair 1, whose b is x3
            [-s1, 0, c1, 0],
            [0, -s2, 0, c2],
        ]
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", BACKENDS)
def test_a_four_dimensional_head_at_position_1_by_hand(name, layout):
    """The 4 basis vectors as 4 heads at positions 0 and 1: position 0 leaves each as it is,
    position 1 gives hand_rotation's rows ([1, 0, 0, 0] -> [cos 1, sin 1, 0, 0] interleaved,
    [cos 1, 0, sin 1, 0] half-split), in the oracle and in every framework."""
    basis = np.broadcast_to(np.eye(4)[None, :, None, :], (1, 4, 2, 4)).copy()
    got = rotated(name, basis, 100.0, layout)
    np.testing.assert_allclose(got[0, :, 0, :], np.eye(4), rtol=0, atol=F64_HAND_BOUND)
    np.testing.assert_allclose(got[0, :, 1, :], hand_rotation(layout), rtol=0, atol=F64_HAND_BOUND)


# -- the whole model -------------------------------------------------------------------------------


def _first(layout: str) -> str:
    return next(
        k for k, c in TODAY_GRID.items() if c.rotary_layout == layout and c.kind == "decoder_only"
    )


# Per layout, TODAY_GRID's first decoder-only config of that layout and an encoder-decoder of it
# (grid.py's only rotary encoder-decoder is half-split: the interleaved one is made here).
_ENC_DEC = next(c for k, c in TODAY_GRID.items() if k.startswith("encoder_decoder-"))
MODELS = {
    f"{kind}-{layout}": (
        TODAY_GRID[_first(layout)]
        if kind == "decoder_only"
        else _ENC_DEC.replace(rotary_layout=layout)
    )
    for layout in LAYOUTS
    for kind in ("decoder_only", "encoder_decoder")
}


def test_the_models_differ_by_their_layout_alone():
    """Each model's config is rotary in the named layout, and the oracle's logits move by O(1)
    when only the layout changes (measured 1.6 to 3.7; asserted > 0.1): the forward comparison
    below sees the layout that each framework applies."""
    for model_id, config in MODELS.items():
        assert config.position_kind == "rotary" and model_id.endswith(config.rotary_layout)
        assert config.kind == model_id.rsplit("-", 1)[0]
        weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
        other = config.replace(rotary_layout=next(o for o in LAYOUTS if o != config.rotary_layout))
        src = np.array([[4, 7, 9, 11, 13]]) if config.has_encoder else None
        tgt = np.array([[1, 8, 10, 12, 14, 15]])
        a = reference.forward(weights, config, src, tgt).logits
        b = reference.forward(weights, other, src, tgt).logits
        assert float(np.max(np.abs(a - b))) > 0.1, model_id


@pytest.mark.parametrize("model_id", list(MODELS))
def test_a_rotary_model_matches_the_oracle_in_float64(backend, model_id):
    """impl/against_oracle.py's comparison (logits, encoder output, attention maps, both
    attention paths; ragged and length-1 inputs) in float64, eager: within atol_for("float64")."""
    check_against_oracle(backend, MODELS[model_id], "float64", "eager")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_positions_run_past_max_len(backend, layout):
    """FORMAT.md step 4a: rotary positions extend past max_len. A decoder-only model of max_len 4
    given 9 tokens (positions 0 .. 8: each framework's table of max_len rows is not enough and
    is computed for the length at hand) gives the oracle's logits in float64, within
    atol_for("float64")."""
    config = MODELS[f"decoder_only-{layout}"].replace(max_len=4)
    weights = init_weights(config, seed=1, scheme="perturbed", dtype="float64")
    tokens = np.array([[1, 6, 7, 8, 9, 10, 11, 12, 13], [1, 14, 15, 16, 17, 18, 19, 20, 21]])
    want = reference.forward(weights, config, None, tokens).logits
    got = backend.build(config, weights, dtype="float64").forward(None, tokens).logits
    diff = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert diff <= atol_for("float64"), f"{backend.name}, {layout}: {diff:.3g}"
