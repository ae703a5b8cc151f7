"""Keras-specific checks: variable paths and the .weights.h5 checkpoint round trip bit-exactly,
LayerNorm epsilon comes from the config, XLA compilation matches the oracle, and the same
model.py matches the oracle on Keras's JAX and torch backends (the keras.ops claim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from parity_tests.grid import FULL_GRID, PAIRWISE_GRID, input_cases
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.adapter.reference_backend import NumpyBackend, PrefixStepper
from transformer_rosetta.decoding.search import beam_search, greedy_search
from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

if unavailable_reason("tf") is not None:
    pytest.skip(f"backend tf: {unavailable_reason('tf')}", allow_module_level=True)

import keras  # noqa: E402

from parity_tests.paths import ROOT
from transformer_rosetta.tf_impl.backend import KerasBackend  # noqa: E402
from transformer_rosetta.tf_impl.model import StdPlusEpsNorm  # noqa: E402
from transformer_rosetta.tf_impl.weights import (  # noqa: E402
    canonical_name,
    export_canonical,
    load_canonical,
    load_native,
    native_name_map,
    new_model,
    save_native,
)

# Untied output with an output bias, GELU (erf), learned positions, pre-norm with final norms:
# every kind of variable the model can have except the shared embedding.
CONFIG = FULL_GRID["pre-gelu-learned-untied-nobias"]


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        assert got[name].shape == w.shape, name
        assert got[name].tobytes() == w.tobytes(), f"{name} changed"


@pytest.mark.parametrize(
    "config_id", ["pre-gelu-learned-untied-nobias", "post-relu-sin-interleaved-shared-bias"]
)
def test_variable_paths_are_canonical_names(config_id):
    config = FULL_GRID[config_id]
    paths = native_name_map(config)
    assert list(paths) == list(canonical_shapes(config))
    for name, path in paths.items():
        # The rule weights.py relies on: the path under the model's name, "/" read as ".", with
        # only Keras's own leaf names (gamma, beta, embeddings) renamed or dropped.
        assert path.startswith("transformer/")
        parts, canonical = path.removeprefix("transformer/").split("/"), name.split(".")
        assert parts[: len(canonical) - 1] == canonical[:-1], (name, path)
        assert canonical_name(path) == name


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_canonical_keras_canonical_is_bit_exact(dtype):
    weights = init_weights(CONFIG, seed=5, scheme="perturbed", dtype=dtype)
    model = new_model(CONFIG, dtype)
    load_canonical(model, weights)
    assert_bit_exact(export_canonical(model), weights)


def test_a_wrong_shape_is_refused_by_name():
    weights = init_weights(CONFIG, seed=5, dtype="float32")
    weights["decoder.layers.0.cross_attention.key.kernel"] = np.zeros((12, 6, 2), np.float32)
    with pytest.raises(ValueError, match=r"cross_attention\.key\.kernel: shape \[12, 6, 2\]"):
        load_canonical(new_model(CONFIG), weights)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_h5_round_trip_is_bit_exact(tmp_path, dtype):
    weights = init_weights(CONFIG, seed=6, scheme="perturbed", dtype=dtype)
    model = new_model(CONFIG, dtype)
    load_canonical(model, weights)
    path = tmp_path / "model.weights.h5"
    save_native(model, path)
    assert_bit_exact(export_canonical(load_native(CONFIG, path, dtype)), weights)


@pytest.mark.parametrize(
    "norm_kind, layer_class, eps_attribute",
    [
        ("layer_norm", keras.layers.LayerNormalization, "epsilon"),
        ("std_plus_eps", StdPlusEpsNorm, "eps"),
    ],
)
def test_layer_norm_epsilon_is_the_configs(norm_kind, layer_class, eps_attribute):
    # far from Keras's 1e-3 default
    config = CONFIG.replace(layer_norm_eps=0.25, norm_kind=norm_kind)
    model = new_model(config, "float64")
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, layer_class)]
    assert len(norms) == 2 * 2 + 3 * 1 + 2  # per encoder/decoder layer, plus the final norms
    assert {getattr(layer, eps_attribute) for layer in norms} == {0.25}
    # And it is what the numbers use: with eps this large, a default epsilon is off by ~1e-1.
    weights = init_weights(config, 0, scheme="perturbed", dtype="float64")
    load_canonical(model, weights)
    src, tgt_in = input_cases(config)["ragged"]
    got = model(src, tgt_in, training=False)["logits"]
    want = reference.forward(weights, config, src, tgt_in).logits
    assert np.max(np.abs(keras.ops.convert_to_numpy(got) - want)) <= 1e-10


def test_xla_compiled_forward_matches_oracle():
    config = PAIRWISE_GRID["pre-gelu-learned-shared-bias"]
    weights = init_weights(config, 0, scheme="perturbed", dtype="float64")
    model = KerasBackend(jit_compile=True).build(config, weights, dtype="float64")
    src, tgt_in = input_cases(config)["ragged"]
    want = reference.forward(weights, config, src, tgt_in)
    for attention in (True, False):
        got = model.forward(src, tgt_in, attention=attention, mode="compiled")
        assert np.max(np.abs(got.logits - want.logits)) <= 1e-10
        assert np.max(np.abs(got.encoder_output - want.encoder_output)) <= 1e-10
    for g, w in zip(got.cross_attention or [], want.cross_attention, strict=False):
        assert np.max(np.abs(g - w)) <= 1e-10


def test_dropout_acts_in_training_only():
    config = CONFIG.replace(dropout=0.3, attention_dropout=0.2)
    model = new_model(config)
    load_canonical(model, init_weights(config, 0, dtype="float32"))
    src, tgt_in = input_cases(config)["ragged"]
    logits = lambda training: keras.ops.convert_to_numpy(  # noqa: E731
        model(src, tgt_in, training=training)["logits"]
    )
    assert np.array_equal(logits(False), logits(False))
    assert not np.allclose(logits(True), logits(False))


# The same model.py under another Keras backend, in a subprocess since the backend is fixed when
# keras is imported. Prints the max |diff| against the oracle for each attention path.
OTHER_BACKEND_SCRIPT = """
import json
import keras
import numpy as np
from transformer_rosetta.oracle import reference
from transformer_rosetta.weights.init import init_weights
from parity_tests.grid import FULL_GRID, input_cases
from transformer_rosetta.tf_impl.weights import load_canonical, new_model

config = FULL_GRID[{config_id!r}]
weights = init_weights(config, 0, scheme="perturbed", dtype="float32")
model = new_model(config, "float32")
load_canonical(model, weights)
src, tgt_in = input_cases(config)["ragged"]
want = reference.forward(weights, config, src, tgt_in)
diffs = {{}}
for attention in (True, False):
    got = model(src, tgt_in, training=False, return_attention=attention)
    pairs = [(got["logits"], want.logits), (got["encoder_output"], want.encoder_output)]
    if attention:
        for key in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
            pairs += list(zip(got[key], getattr(want, key)))
    diffs[str(attention)] = max(
        float(np.max(np.abs(keras.ops.convert_to_numpy(g).astype(np.float64) - w)))
        for g, w in pairs
    )
print(json.dumps({{"backend": keras.backend.backend(), "diffs": diffs}}))
"""


def test_model_matches_oracle_on_keras_jax_and_torch_backends():
    backends = [b for b in ("jax", "torch") if unavailable_reason(b) is None]
    if not backends:
        pytest.skip("neither jax nor torch is installed")
    script = OTHER_BACKEND_SCRIPT.format(config_id="pre-gelu_tanh-learned-untied-nobias")
    runs = {}
    for name in backends:  # started together, so they overlap
        env = {**os.environ, "KERAS_BACKEND": name, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"keras on {name} failed:\n{err[-3000:]}"
        result = json.loads(out.strip().splitlines()[-1])
        assert result["backend"] == name
        for attention, diff in result["diffs"].items():
            assert diff <= 1e-5, f"{name}, attention={attention}: off by {diff:.3g}"


# -- decoding with the key/value cache (tf_impl/decode.py) --------------------------------------

# The tiny preset (post-norm, sinusoids, one shared embedding); CONFIG (pre-norm with final norms,
# learned positions, untied output with a bias); and the tiny preset starting from the pad token.
DECODE_CONFIGS = {
    "tiny": preset("tiny"),
    "pre-learned-untied-bias": CONFIG,
    "bos-is-pad": preset("tiny").replace(bos_id=0),
}
DECODE_BEAMS, DECODE_STEPS = 2, 5


def decode_tokens(c: TransformerConfig, rows: int) -> list[np.ndarray]:
    """BOS, then fixed tokens with pad_id in some rows mid-way (a key the mask must skip)."""
    rng = np.random.default_rng(3)
    steps = [np.full(rows, c.bos_id, dtype=np.int64)]
    for t in range(1, DECODE_STEPS):
        ordinary = np.setdiff1d(np.arange(c.tgt_vocab_size), [c.pad_id, c.bos_id, c.eos_id])
        tokens = rng.choice(ordinary, size=rows)
        if t == 2:
            tokens[::2] = c.pad_id
        steps.append(tokens.astype(np.int64))
    return steps


# float32 on two configs only: each case traces its own compiled step (~1 s on a CPU), and the
# pad-as-BOS case is about masks, which float64 checks at 1e-10.
DECODE_CASES = [
    ("tiny", "float64"),
    ("tiny", "float32"),
    ("pre-learned-untied-bias", "float64"),
    ("pre-learned-untied-bias", "float32"),
    ("bos-is-pad", "float64"),
]


@pytest.mark.parametrize(("config_id", "dtype"), DECODE_CASES)
def test_cached_steps_match_the_oracle(config_id, dtype):
    """Per step, cached and uncached logits against the oracle's PrefixStepper, with a reorder
    across sources mid-way; one trace of each compiled function; max_steps enforced."""
    c = DECODE_CONFIGS[config_id]
    weights = init_weights(c, 4, scheme="perturbed", dtype="float64")
    model = KerasBackend().build(c, weights, dtype=dtype)
    src, _ = ragged_batch(c, batch=3, src_len=6, tgt_len=2, seed=1)  # the last row all padding
    assert (src[-1] == c.pad_id).all() and (src[1] == c.pad_id).any()
    oracle = PrefixStepper(weights, c, src, DECODE_BEAMS)
    cached = model.stepper(src, DECODE_BEAMS, DECODE_STEPS)
    uncached = model.stepper(src, DECODE_BEAMS, DECODE_STEPS, cached=False)
    rows = src.shape[0] * DECODE_BEAMS
    atol = atol_for(dtype, c)
    for t, tokens in enumerate(decode_tokens(c, rows)):
        if t == 3:  # beam search's gather, here a permutation that also crosses sources
            order = np.array([5, 2, 0, 4, 1, 3])
            for stepper in (oracle, cached, uncached):
                stepper.reorder(order)
        want = oracle.step(tokens)
        got, baseline = cached.step(tokens), uncached.step(tokens)
        assert got.dtype == baseline.dtype == np.dtype(dtype)
        assert got.shape == (rows, c.tgt_vocab_size)
        assert np.max(np.abs(got - want)) <= atol, f"cached, step {t}"
        assert np.max(np.abs(baseline - want)) <= atol, f"uncached, step {t}"
        assert np.max(np.abs(got - baseline)) <= atol, f"cached vs uncached, step {t}"
    fns = model.decode_functions()
    assert {name: f.experimental_get_tracing_count() for name, f in fns.items()} == {
        "step": 1,
        "reorder": 1,
        "prefix": 1,
    }
    with pytest.raises(ValueError, match="max_steps=5"):
        cached.step(tokens)


def test_cached_steps_match_the_oracle_in_bfloat16_and_under_xla():
    c = DECODE_CONFIGS["pre-learned-untied-bias"]
    weights = init_weights(c, 4, scheme="perturbed", dtype="float64")
    src, _ = ragged_batch(c, batch=3, src_len=6, tgt_len=2, seed=1)
    for backend, dtype in (
        (KerasBackend(), "bfloat16"),
        (KerasBackend(jit_compile=True), "float64"),
    ):
        model = backend.build(c, weights, dtype=dtype)
        # bfloat16 against the oracle on the weights the model holds (rounded to bfloat16).
        oracle = PrefixStepper(model.export(), c, src, DECODE_BEAMS)
        cached = model.stepper(src, DECODE_BEAMS, DECODE_STEPS)
        for t, tokens in enumerate(decode_tokens(c, src.shape[0] * DECODE_BEAMS)):
            diff = np.max(np.abs(cached.step(tokens) - oracle.step(tokens)))
            assert diff <= atol_for(dtype, c), f"{dtype}, step {t}: off by {diff:.3g}"


def test_stepper_refuses_bad_input():
    c = DECODE_CONFIGS["pre-learned-untied-bias"]
    model = KerasBackend().build(c, init_weights(c, 0))
    with pytest.raises(InputError, match="src: token id 99"):
        model.stepper(np.array([[3, 99]]), 1, 4)
    with pytest.raises(InputError, match="max_steps: length 17 exceeds max_len=16"):
        model.stepper(np.array([[3, 4]]), 1, c.max_len + 1)


def test_greedy_and_beam_search_decode_the_oracles_tokens():
    """transformer_rosetta.decoding.search over the cached float32 steps gives the oracle's tokens, on a case whose
    greedy top-1 margin is checked to be far above float32's error."""
    c = DECODE_CONFIGS["tiny"]
    weights = init_weights(c, 1, scheme="perturbed", dtype="float64")
    model = KerasBackend().build(c, weights, dtype="float32")
    oracle = NumpyBackend().build(c, weights)
    src, _ = ragged_batch(c, batch=3, src_len=5, tgt_len=2, seed=2)
    margins = []

    def recording(src: np.ndarray, beams: int, max_steps: int) -> PrefixStepper:
        stepper = oracle.stepper(src, beams, max_steps)
        step = stepper.step

        def step_and_record(tokens: np.ndarray) -> np.ndarray:
            logits = step(tokens)
            top2 = np.sort(logits, axis=-1)[:, -2:]
            margins.append(float(np.min(top2[:, 1] - top2[:, 0])))
            return logits

        stepper.step = step_and_record
        return stepper

    want = greedy_search(recording, c, src, extra_len=4)
    assert min(margins) > 100 * atol_for("float32"), margins
    got = greedy_search(model.stepper, c, src, extra_len=4)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-4)

    want = beam_search(oracle.stepper, c, src, extra_len=4)
    got = beam_search(model.stepper, c, src, extra_len=4)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    assert np.array_equal(got.finished, want.finished)
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-4)
