"""PyTorch-specific checks: the state_dict mapping, the two attention paths, dropout, buffers."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common import reference  # noqa: E402
from common.init import init_weights  # noqa: E402
from common.inputs import ragged_batch  # noqa: E402
from parity_tests.grid import FULL_GRID, PAIRWISE_GRID  # noqa: E402
from torch_impl.backend import TorchBackend, to_numpy, to_torch  # noqa: E402
from torch_impl.model import Transformer  # noqa: E402
from torch_impl.weights import (  # noqa: E402
    canonical_from_state_dict,
    native_aliases,
    native_name_map,
    state_dict_from_canonical,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def canonical_torch(config, dtype, seed=0):
    weights = init_weights(config, seed, scheme="perturbed", dtype=dtype)
    return weights, {name: to_torch(w) for name, w in weights.items()}


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
    tol = {"float64": 1e-12, "float32": 1e-6}[dtype]
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
    assert not torch.equal(model(src, tgt), model(src, tgt))
    for need_weights in (True, False):  # dropout on probabilities in the explicit path too
        y1 = model.decode(tgt, model.encode(src)[0], src, need_weights=need_weights)[0]
        y2 = model.decode(tgt, model.encode(src)[0], src, need_weights=need_weights)[0]
        assert not torch.equal(y1, y2)
    model.eval()
    with torch.inference_mode():
        assert torch.equal(model(src, tgt), model(src, tgt))


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
