"""What is special to the Flax NNX implementation: its native checkpoint, JAX's scoped x64 mode,
and the fused kernel (jax.nn.dot_product_attention) on queries that have no key to attend."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="backend jax: flax not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from common.errors import WeightFileError  # noqa: E402
from common.init import init_weights  # noqa: E402
from common.masks import key_padding_mask  # noqa: E402
from common.names import canonical_shapes  # noqa: E402
from jax_impl import weights  # noqa: E402
from jax_impl.backend import FlaxBackend  # noqa: E402
from jax_impl.model import MultiHeadAttention  # noqa: E402
from parity_tests.grid import variant  # noqa: E402

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
    assert_bit_exact(weights.to_canonical(model), canonical)

    path = tmp_path / "model.msgpack"
    weights.save_native(model, path)
    restored = weights.load_native(config, path, dtype)
    assert_bit_exact(weights.to_canonical(restored), canonical)


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
        explicit, probs = attention(x, x, mask, return_probs=True)
        fused, none = attention(x, x, mask)
    assert none is None
    assert np.all(np.isfinite(np.asarray(fused)))
    assert np.all(np.asarray(probs[1]) == 0)
    bias = np.asarray(attention.output.bias[...])
    assert np.array_equal(np.asarray(fused[1]), np.broadcast_to(bias, (3, config.d_model)))
    assert np.array_equal(np.asarray(explicit[1]), np.asarray(fused[1]))
    assert np.max(np.abs(np.asarray(explicit) - np.asarray(fused))) <= 1e-6


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
