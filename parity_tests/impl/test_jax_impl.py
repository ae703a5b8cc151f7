"""What is special to the Flax NNX implementation: its native checkpoint, JAX's scoped x64 mode,
and the fused kernel (jax.nn.dot_product_attention) on queries that have no key to attend."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="backend jax: flax not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests.grid import variant  # noqa: E402
from transformer_rosetta.adapter.reference_backend import NumpyBackend  # noqa: E402
from transformer_rosetta.decoding import search  # noqa: E402
from transformer_rosetta.errors import InputError, WeightFileError  # noqa: E402
from transformer_rosetta.jax_impl import decode, weights  # noqa: E402
from transformer_rosetta.jax_impl.backend import FlaxBackend  # noqa: E402
from transformer_rosetta.jax_impl.model import MultiHeadAttention  # noqa: E402
from transformer_rosetta.spec.config import preset  # noqa: E402
from transformer_rosetta.spec.inputs import ragged_batch  # noqa: E402
from transformer_rosetta.spec.masks import key_padding_mask  # noqa: E402
from transformer_rosetta.spec.names import canonical_shapes  # noqa: E402
from transformer_rosetta.spec.tolerances import atol_for  # noqa: E402
from transformer_rosetta.weights.init import init_weights  # noqa: E402

# Between them: a shared table, learned positions and a final norm; separate tables, a tied
# output with its own bias (an nnx.Dict), sinusoids and no attention biases.
CONFIGS = {
    "shared-learned": variant("pre", "gelu", "learned", "shared", True),
    "tied-outbias": variant("post", "relu", "sin-concatenated", "tied", False),
}


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, f"{name}: {got[name].dtype} != {w.dtype}"
        assert got[name].shape == w.shape, name
        assert got[name].tobytes() == w.tobytes(), f"{name} changed"


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_canonical_and_native_round_trips_are_bit_exact(tmp_path, config_id, dtype):
    config = CONFIGS[config_id]
    canonical = init_weights(config, seed=5, scheme="perturbed", dtype=dtype)
    model = weights.from_canonical(config, canonical, dtype)
    assert_bit_exact(weights.export_canonical(model), canonical)

    path = tmp_path / "model.msgpack"
    weights.save_native(model, path)
    restored = weights.load_native(config, path, dtype)
    assert_bit_exact(weights.export_canonical(restored), canonical)


def test_state_paths_are_the_canonical_names():
    config = CONFIGS["shared-learned"]
    names = weights.native_name_map(config)
    assert list(names) == list(canonical_shapes(config))
    assert names["shared_embedding"] == "model.shared_embedding"
    assert names["decoder.layers.0.cross_attention.output.kernel"] == (
        "model.decoder.layers[0].cross_attention.output.kernel"
    )


def test_native_checkpoint_for_another_config_is_refused(tmp_path):
    config = CONFIGS["tied-outbias"]
    path = tmp_path / "model.msgpack"
    weights.save_native(weights.from_canonical(config, init_weights(config)), path)
    wider = config.replace(d_ff=config.d_ff + 1)
    with pytest.raises(WeightFileError) as info:
        weights.load_native(wider, path)
    assert "wrong shape for encoder.layers.0.feed_forward.intermediate.kernel" in str(info.value)
    assert f"config needs [{config.d_model}, {config.d_ff + 1}]" in str(info.value)


def test_x64_stays_inside_float64_models():
    """float64 runs in a scoped jax.enable_x64; nothing of it leaks into float32 work after."""
    config = CONFIGS["tied-outbias"]
    canonical = init_weights(config, seed=0, scheme="perturbed", dtype="float64")
    src, tgt = np.array([[5, 6, 7, 0]]), np.array([[1, 4, 0]])
    backend = FlaxBackend()
    assert not jax.config.x64_enabled
    for mode in ("eager", "compiled"):
        out64 = backend.build(config, canonical, dtype="float64").forward(src, tgt, mode=mode)
        assert out64.logits.dtype == np.float64
        assert not jax.config.x64_enabled
        assert jnp.zeros(1).dtype == jnp.float32 and jnp.arange(2).dtype == jnp.int32

        model32 = backend.build(config, canonical, dtype="float32")
        params = nnx.state(model32.module, nnx.Param)
        assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype("float32")}
        out32 = model32.forward(src, tgt, mode=mode, attention=True)
        assert out32.logits.dtype == np.float32
        assert {a.dtype for a in out32.cross_attention} == {np.dtype("float32")}
        # The two really computed in different precisions, and agree to float32's.
        gap = np.max(np.abs(out32.logits - out64.logits))
        assert 0 < gap <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_query_with_no_key_gets_zero_context_on_both_paths(dtype):
    """A fully masked query: the explicit path and jax.nn.dot_product_attention (plus our zeroing)
    both give an all-zero probability row and an output that is the output bias alone."""
    config = CONFIGS["shared-learned"]
    with weights.x64_scope(dtype):
        attention = MultiHeadAttention(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        attention.output.bias[...] = jnp.arange(config.d_model, dtype=dtype) / 7
        x = jax.random.normal(jax.random.key(1), (2, 3, config.d_model), dtype)
        mask = jnp.asarray(key_padding_mask(np.array([[4, 5, 0], [0, 0, 0]]), 0))
        explicit, probs = attention(x, x, mask, return_attention=True)
        fused, none = attention(x, x, mask)
    assert none is None
    assert np.all(np.isfinite(np.asarray(fused)))
    assert np.all(np.asarray(probs[1]) == 0)
    bias = np.asarray(attention.output.bias[...])
    assert np.array_equal(np.asarray(fused[1]), np.broadcast_to(bias, (3, config.d_model)))
    assert np.array_equal(np.asarray(explicit[1]), np.asarray(fused[1]))
    # The same attention in two orders: the dtype's bound (1e-6 held the float64 case to float32's
    # looseness and the float32 case to ~4 ulps of its outputs, which reach 2.8).
    assert np.max(np.abs(np.asarray(explicit) - np.asarray(fused))) <= atol_for(dtype)


def test_fully_padded_source_row_same_on_both_paths():
    config = CONFIGS["tied-outbias"]
    model = FlaxBackend().build(config, init_weights(config, 0, scheme="perturbed"))
    src = np.array([[5, 6, 7, 8], [0, 0, 0, 0]])  # row 1: no source key at all
    tgt = np.array([[1, 4, 9], [1, 3, 0]])
    explicit = model.forward(src, tgt, attention=True)
    fused = model.forward(src, tgt, attention=False, mode="compiled")
    assert np.all(np.isfinite(fused.logits)) and np.all(np.isfinite(fused.encoder_output))
    assert np.all(explicit.cross_attention[0][1] == 0)
    assert np.max(np.abs(explicit.logits - fused.logits)) <= 1e-5


# -- decoding with a key/value cache (jax_impl/decode.py) --------------------------------------

# The tiny preset (post-norm, shared and tied tables, 2 decoder layers); pre-norm with a final
# norm, learned positions, an untied output with its bias; BOS == pad (Marian), tied, post-norm.
DECODE_CONFIGS = {
    "tiny": preset("tiny"),
    "pre-learned-untied": variant("pre", "gelu", "learned", "untied", False),
    "bos-is-pad": variant("post", "relu", "sin-concatenated", "tied", True).replace(bos_id=0),
}


def fed_tokens(c, rows: int, steps: int) -> np.ndarray:
    """(steps, rows) tokens to feed: BOS, then fixed non-pad ids with pad_id mid-way (every row
    at step 3, row 1 also at step 2), so a pad key inside the prefix is masked."""
    rng = np.random.default_rng(7)
    ids = np.array([i for i in range(c.tgt_vocab_size) if i not in (c.pad_id, c.bos_id)])
    tokens = ids[rng.integers(0, len(ids), size=(steps, rows))]
    tokens[0] = c.bos_id
    tokens[3] = c.pad_id
    tokens[2, 1] = c.pad_id
    return tokens


REORDERS = {3: np.array([4, 0, 5, 1, 3, 2]), 5: np.array([1, 1, 0, 4, 4, 2])}


def run_steppers(c, steppers: dict, steps: int) -> dict[str, list[np.ndarray]]:
    """Feed fed_tokens to every stepper (6 rows), reordering all of them the same way after steps
    3 (a permutation across source rows) and 5 (beam search's gather: duplicated rows).
    Returns each one's logits per step."""
    out = {name: [] for name in steppers}
    for t, tokens in enumerate(fed_tokens(c, 6, steps)):
        for name, stepper in steppers.items():
            out[name].append(stepper.step(tokens))
        if t in REORDERS:
            for stepper in steppers.values():
                stepper.reorder(REORDERS[t])
    return out


def decode_case(config_id: str, dtype: str):
    """(config, weights, src, model): three source rows (ragged, the last all padding)."""
    c = DECODE_CONFIGS[config_id]
    canonical = init_weights(c, seed=3, scheme="perturbed", dtype=dtype)
    src, _ = ragged_batch(c, batch=3, src_len=6, tgt_len=2, seed=4)
    return c, canonical, src, FlaxBackend().build(c, canonical, dtype=dtype)


@pytest.mark.parametrize(
    ("config_id", "dtype"),
    [(k, d) for k in DECODE_CONFIGS for d in ("float64", "float32")]
    + [("pre-learned-untied", "bfloat16")],
)
def test_cached_steps_match_the_oracle(monkeypatch, config_id, dtype):
    """Per step, the cached logits = the oracle's PrefixStepper (which re-runs the whole decoder)
    within atol_for(dtype), through both reorders; 2 beams per source row. The compiled step
    traces once for the whole run: the position is an array, the buffers have a fixed shape."""
    # Another test in this worker may have compiled the same graphdef at these shapes already
    # (the compiled steps are cached per graphdef); start from an empty cache so the count
    # below does not depend on which tests ran before.
    decode.decode_step_compiled.cache_clear()
    c, canonical, src, model = decode_case(config_id, dtype)
    traces = []
    traced = decode.decode_step

    def counting(*args):  # runs only while jax.jit traces decode_step_compiled
        traces.append(1)
        return traced(*args)

    monkeypatch.setattr(decode, "decode_step", counting)
    steps = 7
    logits = run_steppers(
        c,
        {
            "oracle": NumpyBackend().build(c, canonical).stepper(src, 2, steps),
            "cached": model.stepper(src, 2, steps),
        },
        steps,
    )
    want_dtype = np.float64 if dtype == "float64" else np.float32
    diffs = []
    for t, (got, want) in enumerate(zip(logits["cached"], logits["oracle"], strict=True)):
        assert got.dtype == want_dtype and got.shape == (6, c.tgt_vocab_size)
        diffs.append(np.max(np.abs(got - want)))
        assert diffs[-1] <= atol_for(dtype, c), f"step {t}: {diffs[-1]}"
    assert dtype == "float64" or max(diffs) > 1e-12  # it really computed in its dtype
    # With the compiled steps cleared above, this test's shapes trace exactly once.
    assert len(traces) == 1


def test_uncached_steps_match_the_cached_ones_and_the_oracle():
    """The uncached baseline (the decoder over the whole prefix every step) against the cache
    and the oracle, through the same reorders, in float64 (the tight bound)."""
    c, canonical, src, model = decode_case("pre-learned-untied", "float64")
    steps = 7
    logits = run_steppers(
        c,
        {
            "oracle": NumpyBackend().build(c, canonical).stepper(src, 2, steps),
            "cached": model.stepper(src, 2, steps),
            "uncached": model.stepper(src, 2, steps, cached=False),
        },
        steps,
    )
    atol = atol_for("float64", c)
    for t in range(steps):
        cached, uncached, oracle = (logits[k][t] for k in ("cached", "uncached", "oracle"))
        assert uncached.dtype == np.float64
        assert np.max(np.abs(uncached - oracle)) <= atol, f"step {t}"
        assert np.max(np.abs(uncached - cached)) <= atol, f"step {t}"


def test_stepper_refuses_bad_requests():
    c, _, src, model = decode_case("pre-learned-untied", "float32")
    with pytest.raises(InputError, match="src: token id 99"):
        model.stepper(np.array([[5, 99]]), 1, 4)
    with pytest.raises(InputError, match="max_len=16"):
        model.stepper(src, 1, c.max_len + 1)  # learned positions: no PE[16]
    for cached in (True, False):
        stepper = model.stepper(src[:1], 1, 1, cached=cached)
        stepper.step(np.array([c.bos_id]))
        with pytest.raises(ValueError, match="max_steps=1"):
            stepper.step(np.array([5]))


class Recording:
    """A Stepper that keeps the log-probabilities the search read, to measure its margins."""

    def __init__(self, stepper) -> None:
        self.stepper, self.log_probs = stepper, []

    def step(self, tokens):
        logits = self.stepper.step(tokens)
        self.log_probs.append(search.log_softmax(logits))
        return logits

    def reorder(self, rows):
        self.stepper.reorder(rows)


def test_greedy_and_beam_search_decode_the_oracles_tokens():
    """transformer_rosetta.decoding.search over the float32 cached stepper gives the oracle's tokens, on a case whose
    greedy top-1 margin is far above float32's error (so equal tokens are a fair requirement)."""
    c, canonical, _, model = decode_case("pre-learned-untied", "float32")
    src, _ = ragged_batch(c, batch=2, src_len=5, tgt_len=2, seed=6)
    oracle = NumpyBackend().build(c, canonical)
    recorded = []

    def oracle_start(s, beams, max_steps):
        recorded.append(Recording(oracle.stepper(s, beams, max_steps)))
        return recorded[-1]

    want = search.greedy_search(oracle_start, c, src, extra_len=3)
    got = search.greedy_search(model.stepper, c, src, extra_len=3)
    for t, log_probs in enumerate(recorded[0].log_probs):
        live = [i for i, tokens in enumerate(want.tokens) if t < len(tokens) + want.finished[i]]
        top2 = np.sort(log_probs[live], axis=-1)[:, -2:]
        assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3, f"step {t}: the greedy choice is close"
    assert [list(t) for t in got.tokens] == [list(t) for t in want.tokens]
    assert np.array_equal(got.finished, want.finished)
    assert np.max(np.abs(got.scores - want.scores)) <= 1e-4

    want = search.beam_search(oracle.stepper, c, src, beam=3, extra_len=3)
    got = search.beam_search(model.stepper, c, src, beam=3, extra_len=3)
    assert [list(t) for t in got.tokens] == [list(t) for t in want.tokens]
    assert np.array_equal(got.finished, want.finished)
    assert np.max(np.abs(got.scores - want.scores)) <= 1e-4
