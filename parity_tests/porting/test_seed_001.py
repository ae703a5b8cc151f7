"""Seed text 001 ("UNIT 3"): which spec fields its layers are, measured on its own code.

The text has one layer in code, `LayerNormalization(d_model, eps=1e-6)`, and its positional
encoding and feed-forward network as formulas (parity_tests/fixtures/seed_001_unit3.py holds
all three, and says why). Each is compared in float64 with the oracle's function for the spec
field it claims to be, and with the other value of that field, which must not match; the norm and
the position table also with each framework's own layer in float64. There is no model to import:
the text builds none.

- LayerNormalization is `norm_kind: "std_plus_eps"` with `layer_norm_eps: 1e-6`: (x - mean) /
  (std + eps) with the unbiased std, eps outside the root. `"layer_norm"` (population variance,
  eps inside) differs twice: by sqrt(n / (n - 1)) on every input, and where eps sits on an input
  whose std is near sqrt(eps).
- the positional encoding is `position_kind: "sinusoidal"`, `sinusoid_layout: "interleaved"`
  (dims 2i and 2i+1 share a frequency); "concatenated" is not it. The text's claim that
  PE(pos + k) is a linear function of PE(pos) holds for the spec's table, pair by pair.
- the FFN is the spec's with `activation: "relu"`.

Bound: ATOL["float64"] (common/spec/tolerances.py), 1e-10: every side computes in float64 and
only the order of operations differs (measured: 3.6e-15 for the norms, ~1e-14 for the positions,
whose angles reach 127 radians: 1.4e-14).
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.fixtures.draws import draw
from parity_tests.fixtures.seed_001_unit3 import D_MODEL, SEQ_LEN, ffn, positional_encoding
from transformer_rosetta.oracle.reference import feed_forward, layer_norm, sinusoidal_positions
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.tolerances import atol_for

EPS = 1e-6  # LayerNormalization's default, which the text's example keeps
# The text's example: x = torch.randn(batch_size, seq_len, d_model), fewer rows. A second input
# with std 1e-3 (its variance 1e-6 = eps) shows where eps sits.
SCALES = (1.0, 1e-3)


def inputs(scale: float) -> np.ndarray:
    return scale * np.random.default_rng(1).standard_normal((2, SEQ_LEN, D_MODEL))


def params() -> tuple[np.ndarray, np.ndarray]:
    """(gamma, beta) drawn, so that neither the gain nor the shift is trivial."""
    rng = np.random.default_rng(2)
    return draw(rng, "gain", (D_MODEL,)), draw(rng, "bias", (D_MODEL,))


def the_texts_norm(x: np.ndarray) -> np.ndarray:
    """LayerNormalization(d_model) with the drawn gamma and beta, run in float64 by torch."""
    torch = pytest.importorskip("torch")
    from parity_tests.fixtures.seed_001_unit3 import LayerNormalization

    layernorm = LayerNormalization(D_MODEL).double()
    assert layernorm.eps == EPS
    gamma, beta = params()
    with torch.no_grad():
        layernorm.gamma.copy_(torch.from_numpy(gamma))
        layernorm.beta.copy_(torch.from_numpy(beta))
        return layernorm(torch.from_numpy(x)).numpy()


def spec_config():
    """The spec fields the text's layers are, at its d_model."""
    return preset("tiny").replace(
        d_model=D_MODEL,
        norm_kind="std_plus_eps",
        layer_norm_eps=EPS,
        position_kind="sinusoidal",
        sinusoid_layout="interleaved",
        activation="relu",
    )


# -- LayerNormalization -------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES)
def test_layer_normalization_is_std_plus_eps_with_eps_1e_6(scale):
    x = inputs(scale)
    gamma, beta = params()
    text = the_texts_norm(x)
    spec = layer_norm(x, gamma, beta, EPS, "std_plus_eps")
    assert np.abs(text - spec).max() <= atol_for("float64")
    # The other norm kind is another function: by sqrt(n / (n - 1)) - 1 ~ 1e-3 of |gamma x_hat|
    # (up to ~4) at std 1, and by the place of eps where the variance is eps (std 1e-3): then
    # (x - m) / (std + eps) and (x - m) / sqrt(var + eps) differ by a factor ~ sqrt(2).
    other = np.abs(text - layer_norm(x, gamma, beta, EPS, "layer_norm")).max()
    assert other > (1e-4 if scale == 1.0 else 0.1), other


def test_layer_normalizations_eps_is_the_configs_not_torchs():
    """eps is added to the std: at std 1e-3, torch's LayerNorm default 1e-5 in place of the text's
    1e-6 changes every output by (1e-5 - 1e-6) / 1e-3 ~ 0.9% of |gamma x_hat| (up to ~4): the
    spec's layer_norm_eps must be the text's 1e-6."""
    x = inputs(1e-3)
    gamma, beta = params()
    off = np.abs(the_texts_norm(x) - layer_norm(x, gamma, beta, 1e-5, "std_plus_eps")).max()
    assert off > 0.01, off


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_each_frameworks_norm_is_the_texts_in_float64(framework):
    """torch's StdPlusEpsNorm, Keras's and Flax's, as each implementation builds them from the
    config (norm_kind "std_plus_eps", eps 1e-6), given the text's gamma and beta."""
    backend_or_skip(framework)
    config = spec_config()
    gamma, beta = params()
    for scale in SCALES:
        x = inputs(scale)
        got = framework_norm(framework, config, gamma, beta, x)
        diff = np.abs(got - the_texts_norm(x)).max()
        assert diff <= atol_for("float64"), f"{framework} at std {scale}: {diff:.3g}"


def framework_norm(framework: str, config, gamma, beta, x: np.ndarray) -> np.ndarray:
    if framework == "torch":
        import torch

        from transformer_rosetta.torch_impl.model import layer_norm as torch_norm

        norm = torch_norm(config).double()
        with torch.no_grad():
            norm.weight.copy_(torch.from_numpy(gamma))
            norm.bias.copy_(torch.from_numpy(beta))
            return norm(torch.from_numpy(x)).numpy()
    if framework == "tf":
        import keras

        from transformer_rosetta.tf_impl.model import layer_norm as keras_norm

        norm = keras_norm(config, name="norm", dtype="float64")
        norm.build((None, None, config.d_model))
        norm.gamma.assign(gamma)
        norm.beta.assign(beta)
        return keras.ops.convert_to_numpy(norm(x))
    import jax.numpy as jnp
    from flax import nnx

    from transformer_rosetta.jax_impl.model import layer_norm as flax_norm
    from transformer_rosetta.jax_impl.weights import x64_scope

    with x64_scope("float64"):
        norm = flax_norm(config, dtype=jnp.float64, rngs=nnx.Rngs(0))
        norm.scale[...] = jnp.asarray(gamma)
        norm.bias[...] = jnp.asarray(beta)
        return np.asarray(norm(jnp.asarray(x)))


# -- positions ----------------------------------------------------------------------------------


def test_the_texts_positions_are_the_interleaved_sinusoid():
    text = positional_encoding(SEQ_LEN, D_MODEL)
    spec = sinusoidal_positions(SEQ_LEN, D_MODEL, "interleaved")
    assert np.abs(text - spec).max() <= atol_for("float64")
    other = sinusoidal_positions(SEQ_LEN, D_MODEL, "concatenated")
    assert np.abs(text - other).max() > 1.0


def test_the_texts_shift_identity_holds_for_the_spec_table():
    """The text's derivation: PE(pos + k, 2i) = PE(pos, 2i) cos(w k) + PE(pos, 2i+1) sin(w k) and
    PE(pos + k, 2i+1) = PE(pos, 2i+1) cos(w k) - PE(pos, 2i) sin(w k), w = 1 / 10000^(2i/d), for
    every pos, k and pair, on the oracle's table."""
    table = sinusoidal_positions(SEQ_LEN, D_MODEL)
    omega = 1.0 / 10000.0 ** (np.arange(0, D_MODEL, 2) / D_MODEL)  # (d/2,)
    even, odd = table[:, 0::2], table[:, 1::2]
    for k in (1, 7, 60):
        c, s = np.cos(omega * k), np.sin(omega * k)
        assert np.abs(even[k:] - (even[:-k] * c + odd[:-k] * s)).max() <= atol_for("float64")
        assert np.abs(odd[k:] - (odd[:-k] * c - even[:-k] * s)).max() <= atol_for("float64")


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_each_frameworks_positions_are_the_texts_in_float64(framework):
    backend_or_skip(framework)
    text = positional_encoding(SEQ_LEN, D_MODEL)
    if framework == "torch":
        from transformer_rosetta.torch_impl.model import sinusoidal_positions as table

        got = table(SEQ_LEN, D_MODEL, "interleaved").numpy()
    elif framework == "tf":
        import keras

        from transformer_rosetta.tf_impl.model import sinusoidal_positions as table

        got = keras.ops.convert_to_numpy(table(SEQ_LEN, D_MODEL, "interleaved", "float64"))
    else:
        from transformer_rosetta.jax_impl.model import sinusoidal_positions as table

        got = np.asarray(table(SEQ_LEN, D_MODEL, "interleaved"))
    assert got.dtype == np.float64 and got.shape == text.shape
    assert np.abs(got - text).max() <= atol_for("float64")


# -- the feed-forward network ---------------------------------------------------------------------


def test_the_texts_ffn_is_the_specs_with_relu():
    """FFN(x) = max(0, x W1 + b1) W2 + b2, d_hidden = 4 d_model, as the text sizes it."""
    rng = np.random.default_rng(3)
    d, hidden = D_MODEL, 4 * D_MODEL
    w = {
        "ff.intermediate.kernel": draw(rng, "kernel", (d, hidden), fans=(d, hidden)),
        "ff.intermediate.bias": draw(rng, "bias", (hidden,)),
        "ff.output.kernel": draw(rng, "kernel", (hidden, d), fans=(hidden, d)),
        "ff.output.bias": draw(rng, "bias", (d,)),
    }
    x = inputs(1.0)
    text = ffn(x, *w.values())
    relu = TransformerConfig(d_model=d, num_heads=1, d_ff=hidden, activation="relu")
    assert np.abs(text - feed_forward(w, "ff", x, relu)).max() <= atol_for("float64")
    gelu = relu.replace(activation="gelu")
    assert np.abs(text - feed_forward(w, "ff", x, gelu)).max() > 0.01
