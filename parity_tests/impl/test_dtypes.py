"""The dtype tiers beyond the tiny-grid float64/float32 tests: bfloat16 on tiny configs, float32 at
the paper's base sizes (slow), and the tolerance table itself.

float64 (1e-10) and float32 (1e-5) on the tiny configs are impl/test_backend_vs_oracle.py (each
framework against the oracle) and impl/test_pairs.py (every pair). The bounds used here and the
measurements behind them are in common/spec/tolerances.py. As everywhere, the oracle runs in float64 on
the weights rounded to the model's dtype, so a bound measures computation, not weight rounding.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

from parity_tests.grid import PAIRWISE_GRID, PAIRWISE_KEYS, input_cases
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.dtypes import COMPUTE_DTYPES, numpy_dtype
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.masks import decoder_self_mask, key_padding_mask
from transformer_rosetta.spec.tolerances import ATOL, BF16_PROBABILITY_RTOL, atol_for
from transformer_rosetta.weights.init import init_weights

# Three rows of the pairwise grid with every activation, position kind and embedding sharing.
BF16_KEYS = [
    ("post", "relu", "sin-interleaved", "untied", True),
    ("pre", "gelu_tanh", "sin-concatenated", "tied", True),
    ("pre", "gelu", "learned", "shared", True),
]
BF16_CONFIGS = [
    cid for key, cid in zip(PAIRWISE_KEYS, PAIRWISE_GRID, strict=True) if key in BF16_KEYS
]


def rounded(weights: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The weights as a `dtype` model holds them, in float64 for the oracle."""
    return {k: v.astype(numpy_dtype(dtype)).astype(np.float64) for k, v in weights.items()}


def max_diffs(got, want) -> dict[str, float]:
    """max |got - want| per named output (attention maps, logits, encoder output)."""
    out = {}
    for name, value in got.named().items():
        value = np.asarray(value, np.float64)
        assert value.shape == want.named()[name].shape, name
        assert np.all(np.isfinite(value)), f"{name}: non-finite values"
        out[name] = float(np.max(np.abs(value - want.named()[name]))) if value.size else 0.0
    return out


def test_every_compute_dtype_has_a_bound_and_they_are_ordered():
    assert set(COMPUTE_DTYPES) <= set(ATOL)
    # Fewer mantissa bits or more depth can only loosen a bound; float64 and float32 are fixed.
    assert ATOL["float64"] == 1e-10 and ATOL["float32"] == 1e-5
    assert ATOL["float64"] < ATOL["float32"] < ATOL["float32_base"] < ATOL["bfloat16"]


def test_bfloat16_bound_is_the_depth_times_the_unit_roundoff():
    """tolerances.py: one rounding (u = 2^-8) of values up to 4 per sublayer stage of the tiny
    grid's depth, 2 * 2 (encoder) + 1 * 3 (decoder) + 1 (embeddings) = 8 stages."""
    c = PAIRWISE_GRID[BF16_CONFIGS[0]]
    stages = 2 * c.num_encoder_layers + 3 * c.num_decoder_layers + 1
    u = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) / 2  # eps = 2^-7 is the spacing at 1
    assert u == 2.0**-8 and stages == 8
    assert atol_for("bfloat16") == stages * u * 4


@pytest.mark.parametrize("config_id", BF16_CONFIGS)
def test_bfloat16_tracks_the_float64_oracle(backend, config_id):
    """Logits, encoder output and attention probabilities within the bfloat16 bound, finite, and
    exactly 0 at masked keys (the masked score is bfloat16's finite minimum, never -inf)."""
    if "bfloat16" not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in bfloat16")
    config = PAIRWISE_GRID[config_id]
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    model = backend.build(config, weights, dtype="bfloat16")
    atol = atol_for("bfloat16")
    for case, (src, tgt_in) in input_cases(config).items():
        want = reference.forward(rounded(weights, "bfloat16"), config, src, tgt_in)
        # By the output's name: encoder.layers.i.self_attention, decoder.layers.i.self_attention,
        # decoder.layers.i.cross_attention.
        masks = {
            "encoder": key_padding_mask(src, config.pad_id),
            "decoder": decoder_self_mask(tgt_in, config.pad_id),
            "cross": key_padding_mask(src, config.pad_id),
        }
        for attention in (True, False):
            got = model.forward(src, tgt_in, attention=attention)
            for name, diff in max_diffs(got, want).items():
                where = f"{case}, attention={attention}"
                assert diff <= atol, f"{name} off by {diff:.3g} > {atol:g} ({where})"
                if name.endswith("attention"):
                    mask = masks["cross" if "cross" in name else name.split(".")[0]]
                    probs = np.asarray(got.named()[name])
                    assert np.all(probs[np.broadcast_to(~mask, probs.shape)] == 0), (
                        f"{name} nonzero at masked keys ({where})"
                    )


# -- bfloat16 attention probabilities: a float32 softmax rounded once --------------------------

# One layer a side, post-norm (the first attention reads the embeddings themselves), learned
# positions and no embedding scale (sinusoids and sqrt(d_model) are not exact in bfloat16), and
# d_k = 4, so that the 1 / sqrt(d_k) = 1/2 scaling is exact too.
EXACT = TransformerConfig(
    src_vocab_size=16,
    tgt_vocab_size=16,
    d_model=8,
    num_heads=2,
    d_ff=8,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=8,
    dropout=0.0,
    position_kind="learned",
    scale_embeddings=False,
    share_embeddings=False,
    tie_output=False,
)
EXACT_MAPS = ("encoder.layers.0.self_attention", "decoder.layers.0.self_attention")


@functools.cache
def exact_case() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(weights, src, tgt_in) whose first-layer self-attention scores are exact in bfloat16:
    embeddings and positions in {-1, 0, 1}, query and key kernels and biases in {-1/4, 0, 1/4}."""
    weights = init_weights(EXACT, seed=0, scheme="perturbed", dtype="float64")
    rng = np.random.default_rng(0)
    for name in (
        "encoder.embedding",
        "decoder.embedding",
        "encoder.position_embedding",
        "decoder.position_embedding",
    ):
        weights[name] = rng.integers(-1, 2, size=weights[name].shape).astype(np.float64)
    for side in ("encoder", "decoder"):
        for part in ("query.kernel", "query.bias", "key.kernel", "key.bias"):
            name = f"{side}.layers.0.self_attention.{part}"
            weights[name] = rng.integers(-1, 2, size=weights[name].shape) / 4
    src, tgt_in = ragged_batch(EXACT, batch=4, src_len=7, tgt_len=7, seed=1)
    return weights, src, tgt_in


def test_the_exact_case_has_exact_bfloat16_scores_and_spread_probabilities():
    """The premise of the bound: every value on the way to the scores is representable in
    bfloat16 (8 significant bits), in any summation order. x is an integer; q and k are
    multiples of 1/4 whose partial sums stay below 64 (< 256 steps); the scores' products are
    multiples of 1/16 whose partial sums stay below 16 (< 256 steps). And the probabilities are
    spread out, so that their rounding is tested on many values, not on 0s and 1s."""
    weights, src, tgt_in = exact_case()
    want = reference.forward(weights, EXACT, src, tgt_in)
    for side, ids in (("encoder", src), ("decoder", tgt_in)):
        x = (
            weights[f"{side}.embedding"][ids]
            + weights[f"{side}.position_embedding"][: ids.shape[1]]
        )
        assert np.all(x == np.round(x)) and np.abs(x).max() <= 2
        proj = {}
        for part in ("query", "key"):
            kernel = weights[f"{side}.layers.0.self_attention.{part}.kernel"]
            bias = weights[f"{side}.layers.0.self_attention.{part}.bias"]
            bound = np.einsum("btd,dhk->bhtk", np.abs(x), np.abs(kernel)) + np.abs(bias)[:, None]
            assert bound.max() < 64
            proj[part] = np.einsum("btd,dhk->bhtk", x, kernel) + bias[None, :, None, :]
            assert np.all(proj[part] * 4 == np.round(proj[part] * 4))
        products = np.einsum("bhtk,bhsk->bhts", np.abs(proj["query"]), np.abs(proj["key"]))
        assert products.max() < 16
        probs = want.named()[f"{side}.layers.0.self_attention"]
        assert np.sum((probs > 0.05) & (probs < 0.95)) > 150


def test_bfloat16_attention_probabilities_are_a_float32_softmax_rounded_once(backend):
    """With exact scores, each probability is within one bfloat16 rounding of the true one:
    |p - p_oracle| <= BF16_PROBABILITY_RTOL * p (tolerances.py), masked ones exactly 0. A softmax
    computed in bfloat16 rounds exp, sum and quotient and lands near 2 u: it fails here, while
    the 0.125 tracking bound above cannot tell it from rounding."""
    if "bfloat16" not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in bfloat16")
    weights, src, tgt_in = exact_case()
    want = reference.forward(weights, EXACT, src, tgt_in).named()
    got = backend.build(EXACT, weights, dtype="bfloat16").forward(src, tgt_in, attention=True)
    for name in EXACT_MAPS:
        g, w = np.asarray(got.named()[name], np.float64), want[name]
        excess = np.abs(g - w) - BF16_PROBABILITY_RTOL * w
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess.max() <= 0, (
            f"{name}: {g[worst]!r} against {w[worst]!r}, off by "
            f"{abs(g[worst] - w[worst]) / w[worst] / 2**-8:.2f} u relative (bound 1 u + 2^-20)"
        )


def base_config() -> TransformerConfig:
    """The paper's base sizes, vocabulary cut to 4000 so that memory and time stay sane."""
    return preset("base").replace(src_vocab_size=4000, tgt_vocab_size=4000, dropout=0.0)


@functools.cache
def base_case() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, object]:
    """Weights, inputs and the oracle on the float32-rounded weights, computed once per session."""
    config = base_config()
    weights = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    src, tgt_in = ragged_batch(config, batch=3, src_len=24, tgt_len=20, seed=1)
    want = reference.forward(rounded(weights, "float32"), config, src, tgt_in)
    return weights, src, tgt_in, want


@pytest.mark.slow
def test_float32_base_config_tracks_the_oracle(backend):
    """Base sizes (d_model 512, 8 heads, d_ff 2048, 6 + 6 layers) in float32, both attention
    paths, within float32_base. Prints the measured maxima (run with -s to see them)."""
    if "float32" not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in float32")
    weights, src, tgt_in, want = base_case()
    model = backend.build(base_config(), weights, dtype="float32")
    atol = atol_for("float32_base")
    for attention in (True, False):
        diffs = max_diffs(model.forward(src, tgt_in, attention=attention), want)
        worst = {
            "logits": diffs["logits"],
            "encoder_output": diffs["encoder_output"],
            "attention": max((d for n, d in diffs.items() if n.endswith("attention")), default=0),
        }
        print(f"{backend.name} float32 base, attention={attention}: max |diff| {worst}")
        for name, diff in diffs.items():
            assert diff <= atol, f"{name} off by {diff:.3g} > {atol:g} (attention={attention})"
