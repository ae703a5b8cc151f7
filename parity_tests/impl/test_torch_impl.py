"""PyTorch-specific checks: the state_dict mapping, the two attention paths, dropout, buffers."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.grid import FULL_GRID, PAIRWISE_GRID  # noqa: E402
from transformer_rosetta.adapter.reference_backend import PrefixStepper  # noqa: E402
from transformer_rosetta.decoding.search import beam_search, greedy_search, log_softmax  # noqa: E402
from transformer_rosetta.errors import InputError  # noqa: E402
from transformer_rosetta.oracle import reference  # noqa: E402
from transformer_rosetta.spec.config import preset  # noqa: E402
from transformer_rosetta.spec.inputs import ragged_batch  # noqa: E402
from transformer_rosetta.spec.tolerances import atol_for  # noqa: E402
from transformer_rosetta.torch_impl.backend import TorchBackend, _to_torch, to_numpy  # noqa: E402
from transformer_rosetta.torch_impl.model import Transformer  # noqa: E402
from transformer_rosetta.torch_impl.weights import (  # noqa: E402
    canonical_from_state_dict,
    native_aliases,
    native_name_map,
    state_dict_from_canonical,
)
from transformer_rosetta.weights.init import init_weights  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def canonical_torch(config, dtype, seed=0):
    weights = init_weights(config, seed, scheme="perturbed", dtype=dtype)
    return weights, {name: _to_torch(w) for name, w in weights.items()}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("config_id", list(PAIRWISE_GRID)[:3])  # untied, tied, shared
def test_state_dict_round_trip_is_bit_exact(config_id, dtype):
    config = PAIRWISE_GRID[config_id]
    weights, tensors = canonical_torch(config, dtype)
    model = Transformer(config).to(DTYPES[dtype])
    model.load_state_dict(state_dict_from_canonical(config, tensors), strict=True)
    back = canonical_from_state_dict(config, model.state_dict())
    assert list(back) == list(weights)
    for name, want in weights.items():
        got = to_numpy(back[name], exact=True)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), f"{name} changed in the round trip"


@pytest.mark.parametrize("config_id", list(PAIRWISE_GRID)[:3])
def test_name_map_covers_the_state_dict_and_ties_share_one_parameter(config_id):
    config = PAIRWISE_GRID[config_id]
    model = Transformer(config)
    state = model.state_dict(keep_vars=True)
    aliases = native_aliases(config)
    assert sorted(k for keys in aliases.values() for k in keys) == sorted(state)
    assert list(native_name_map(config)) == list(aliases)
    for keys in aliases.values():  # every alias of a tied tensor is the same Parameter
        assert all(state[k] is state[keys[0]] for k in keys)
    distinct = {id(p) for p in model.parameters()}
    assert len(distinct) == len(aliases)


def test_sinusoid_buffer_stays_out_of_the_state_dict():
    config = FULL_GRID["post-relu-sin-interleaved-untied-bias"]
    model = Transformer(config)
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"encoder.sinusoid", "decoder.sinusoid"}
    assert not any("sinusoid" in k for k in model.state_dict())
    assert buffers["encoder.sinusoid"].shape == (config.max_len, config.d_model)
    # Extrapolating past max_len builds a longer table for that call and leaves the buffer be.
    src = torch.full((1, config.max_len + 4), 5)
    model.eval()(src, src)
    assert model.encoder.sinusoid.shape == (config.max_len, config.d_model)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_explicit_and_fused_paths_agree_on_a_fully_padded_row(dtype):
    config = FULL_GRID["pre-gelu-sin-concatenated-shared-bias"]
    weights = init_weights(config, 0, scheme="perturbed", dtype=dtype)
    model = TorchBackend().build(config, weights, dtype=dtype)
    src, tgt = ragged_batch(config, batch=3, src_len=6, tgt_len=5, seed=4)
    assert np.all(src[-1] == config.pad_id)  # no allowed key for any query of that row
    explicit = model.forward(src, tgt, attention=True)
    fused = model.forward(src, tgt, attention=False)
    # The two paths compute the same function in other orders (fused: an online softmax), so they
    # differ by rounding only. float64: a few ulps (2.2e-16) per stage over ~30 stages on values
    # up to ~4 is ~1e-14, and 1e-12 leaves room. float32: its bound (common/spec/tolerances.py),
    # not tighter, since its kernels differ by CPU (ATEN_CPU_CAPABILITY=avx2 measured 1.07e-6,
    # AVX-512 less) and one ulp of a logit of 2 is already 2.4e-7. A fully padded row gone wrong
    # (NaN, or uniform attention instead of none) moves the logits by O(0.1).
    tol = {"float64": 1e-12, "float32": atol_for("float32")}[dtype]
    for name in ("logits", "encoder_output"):
        a, b = getattr(explicit, name), getattr(fused, name)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), name
        assert np.max(np.abs(a - b)) <= tol, name
    # The fully padded row attends nothing: all-zero probability rows, not uniform ones.
    assert np.all(explicit.encoder_self_attention[0][-1] == 0)
    assert np.all(explicit.cross_attention[0][-1] == 0)


def test_dropout_only_in_training():
    config = FULL_GRID["post-relu-learned-untied-bias"].replace(dropout=0.3, attention_dropout=0.2)
    _, tensors = canonical_torch(config, "float32")
    model = Transformer(config)
    model.load_state_dict(state_dict_from_canonical(config, tensors))
    src, tgt = (torch.from_numpy(a) for a in ragged_batch(config, 2, 6, 5, seed=5))
    torch.manual_seed(0)
    model.train()
    assert not torch.equal(model(src, tgt)["logits"], model(src, tgt)["logits"])
    for explicit in (True, False):  # dropout on probabilities in the explicit path too
        y1 = model.decode(tgt, model.encode(src)[0], src, return_attention=explicit)[0]
        y2 = model.decode(tgt, model.encode(src)[0], src, return_attention=explicit)[0]
        assert not torch.equal(y1, y2)
    model.eval()
    with torch.inference_mode():
        assert torch.equal(model(src, tgt)["logits"], model(src, tgt)["logits"])


def test_bfloat16_forward_tracks_the_oracle():
    """Not a parity tolerance (bfloat16 has 8 bits of mantissa): a smoke test that the bfloat16
    path runs end to end with float32 softmax/LayerNorm statistics and lands near the oracle."""
    config = FULL_GRID["post-relu-sin-interleaved-shared-bias"]
    weights = init_weights(config, 0, scheme="perturbed", dtype="bfloat16")
    model = TorchBackend().build(config, weights, dtype="bfloat16")
    src, tgt = ragged_batch(config, batch=3, src_len=7, tgt_len=5, seed=6)
    rounded = {k: v.astype(np.float64) for k, v in weights.items()}
    want = reference.forward(rounded, config, src, tgt)
    for attention in (True, False):
        got = model.forward(src, tgt, attention=attention)
        assert got.logits.dtype == np.float32
        scale = np.max(np.abs(want.logits))
        assert np.max(np.abs(got.logits - want.logits)) <= 0.05 * scale


def test_hidden_states_match_the_oracle():
    config = FULL_GRID["pre-gelu-learned-shared-bias"]
    weights = init_weights(config, 0, scheme="perturbed", dtype="float64")
    model = TorchBackend().build(config, weights, dtype="float64")
    src, tgt = ragged_batch(config, batch=4, src_len=7, tgt_len=5, seed=1)
    got = model.forward(src, tgt, hidden_states=True)
    want = reference.forward(weights, config, src, tgt, hidden_states=True)
    for kind in ("encoder_hidden_states", "decoder_hidden_states"):
        assert len(getattr(got, kind)) == len(getattr(want, kind))
        for g, w in zip(getattr(got, kind), getattr(want, kind), strict=True):
            assert np.max(np.abs(g - w)) <= 1e-10, kind


# -- decoding with a key/value cache (torch_impl/decode.py) -----------------------------------

TINY = preset("tiny")
DECODE_CONFIGS = {
    "tiny": TINY,
    "pre-final_norm": TINY.replace(norm_position="pre", final_norm=True),
    "learned": TINY.replace(position_kind="learned"),
    "bos-is-pad": TINY.replace(bos_id=TINY.pad_id),
    "untied-output_bias": TINY.replace(
        tgt_vocab_size=37, share_embeddings=False, tie_output=False, output_bias=True
    ),
    # d_k = 6, concatenated sinusoids, GELU, no attention bias: the grid's odd sizes.
    "grid-pre-gelu-concatenated": FULL_GRID["pre-gelu-sin-concatenated-tied-nobias"],
}


def special_ids(c):
    return [c.pad_id, c.bos_id, c.eos_id]


def decode_case(config, dtype, seed=0):
    """A model with perturbed weights, the oracle's float64 copy of the same weights, a ragged
    source of 3 rows (the last all padding) and a fixed (N = 3 * 2, 8) token sequence fed one
    column per step: BOS first, then ordinary tokens with a pad mid-way in every other row, and
    an EOS (which the stepper must treat as an ordinary token)."""
    weights = init_weights(config, seed, scheme="perturbed", dtype=dtype)
    oracle_weights = {name: w.astype(np.float64) for name, w in weights.items()}
    model = TorchBackend().build(config, weights, dtype=dtype)
    src, _ = ragged_batch(config, batch=3, src_len=6, tgt_len=1, seed=seed + 3)
    assert np.all(src[-1] == config.pad_id) and np.any(src[1] == config.pad_id)
    rng = np.random.default_rng(seed)
    ordinary = np.setdiff1d(np.arange(config.tgt_vocab_size), special_ids(config))
    tokens = rng.choice(ordinary, size=(6, 8))
    tokens[:, 0] = config.bos_id
    tokens[::2, 3] = config.pad_id
    tokens[1, 5] = config.eos_id
    return model, oracle_weights, src, tokens


def run_steppers(steppers, tokens):
    """Feed `tokens` column by column to every stepper, reordering all of them the same way
    mid-way: a permutation after step 2, then beam search's kind of gather (rows duplicated and
    dropped) after step 5. Yields each step's logits, one array per stepper."""
    gathers = {2: np.array([3, 0, 5, 1, 4, 2]), 5: np.array([1, 1, 0, 4, 4, 3])}
    for t in range(tokens.shape[1]):
        yield [s.step(tokens[:, t]) for s in steppers]
        if t in gathers:
            for s in steppers:
                s.reorder(gathers[t])
            tokens = tokens[gathers[t]]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_id", list(DECODE_CONFIGS))
def test_cached_decoding_matches_the_oracle_step_by_step(config_id, dtype):
    config = DECODE_CONFIGS[config_id]
    model, oracle_weights, src, tokens = decode_case(config, dtype)
    atol = atol_for(dtype, config)
    max_steps = tokens.shape[1] + 2  # a buffer longer than used: its tail must stay masked
    cached = model.stepper(src, 2, max_steps)
    uncached = model.stepper(src, 2, max_steps, cached=False)
    oracle = PrefixStepper(oracle_weights, config, src, 2)
    for got, baseline, want in run_steppers([cached, uncached, oracle], tokens):
        assert got.shape == (6, config.tgt_vocab_size) and got.dtype == np.dtype(dtype)
        assert np.all(np.isfinite(got))
        assert np.max(np.abs(got - want)) <= atol
        assert np.max(np.abs(baseline - want)) <= atol
        assert np.max(np.abs(got - baseline)) <= atol


def test_cached_bfloat16_decoding_tracks_the_oracle():
    """bfloat16 at its tracking bound (common/spec/tolerances.py), against the oracle on the
    bfloat16-rounded weights; logits come back as float32."""
    model, oracle_weights, src, tokens = decode_case(TINY, "bfloat16")
    cached = model.stepper(src, 2, tokens.shape[1])
    uncached = model.stepper(src, 2, tokens.shape[1], cached=False)
    oracle = PrefixStepper(oracle_weights, TINY, src, 2)
    for got, baseline, want in run_steppers([cached, uncached, oracle], tokens):
        assert got.dtype == np.float32
        assert np.max(np.abs(got - want)) <= atol_for("bfloat16")
        assert np.max(np.abs(baseline - want)) <= atol_for("bfloat16")


def test_stepper_refuses_bad_requests():
    config = DECODE_CONFIGS["learned"]
    model = TorchBackend().build(config, init_weights(config, 0), dtype="float32")
    src, _ = ragged_batch(config, batch=2, src_len=4, tgt_len=1)
    with pytest.raises(InputError, match="src"):
        model.stepper(src + config.src_vocab_size, 1, 4)
    with pytest.raises(InputError, match="src"):
        model.stepper(src.astype(np.float32), 1, 4)
    with pytest.raises(InputError, match="max_len"):  # learned positions end at max_len
        model.stepper(src, 1, config.max_len + 1)
    for cached in (True, False):
        stepper = model.stepper(src, 2, 2, cached=cached)
        with pytest.raises(InputError, match="tokens"):
            stepper.step(np.full(3, config.bos_id))  # 4 rows expected
        with pytest.raises(InputError, match="rows"):
            stepper.reorder(np.array([0, 1, 2, 4]))
        stepper.step(np.full(4, config.bos_id))
        stepper.step(np.full(4, 5))
        with pytest.raises(ValueError, match="max_steps=2"):
            stepper.step(np.full(4, 5))


class RecordingStepper:
    """Wraps a Stepper and keeps every step's logits (to check the search's margins)."""

    def __init__(self, inner):
        self.inner, self.logits = inner, []

    def step(self, tokens):
        self.logits.append(self.inner.step(tokens))
        return self.logits[-1]

    def reorder(self, rows):
        self.inner.reorder(rows)


def test_searches_give_the_oracles_tokens():
    """Greedy and beam search (transformer_rosetta.decoding.search) over the torch cache, float32, against the same
    searches over the oracle. Greedy's every decision is checked to be clear: the top two
    log-probabilities differ by far more than the float32 parity bound."""
    config = DECODE_CONFIGS["pre-final_norm"]
    weights = init_weights(config, 1, scheme="perturbed", dtype="float32")
    oracle_weights = {name: w.astype(np.float64) for name, w in weights.items()}
    model = TorchBackend().build(config, weights, dtype="float32")
    src, _ = ragged_batch(config, batch=3, src_len=5, tgt_len=1, seed=7)
    recorded = []

    def oracle(s, beams, max_steps):
        recorded.append(RecordingStepper(PrefixStepper(oracle_weights, config, s, beams)))
        return recorded[-1]

    want = greedy_search(oracle, config, src, extra_len=6)
    got = greedy_search(model.stepper, config, src, extra_len=6)
    lengths = [len(t) + int(f) for t, f in zip(want.tokens, want.finished, strict=True)]
    for t, logits in enumerate(recorded[0].logits):
        top2 = np.sort(log_softmax(logits), axis=-1)[:, -2:]  # (N, 2)
        live = np.array(lengths) > t  # rows still decoding at step t
        assert np.all(top2[live, 1] - top2[live, 0] > 100 * atol_for("float32"))
    for g, w in zip(got.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got.finished, want.finished)
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-4)

    want = beam_search(oracle, config, src, beam=3, extra_len=6)
    got = beam_search(model.stepper, config, src, beam=3, extra_len=6)
    for g, w in zip(got.tokens, want.tokens, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got.finished, want.finished)
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-4)
