"""An encoder-only model's pooled vector is sentence-transformers' pooling of its own hidden
states, in every framework, whatever the padding of the batch (issue 42, survivor 1: torch's mean
dividing by the padded length instead of the number of real tokens passed every test, because
every pooled model they used normalised, and an L2 norm cancels any per-row factor).

The batch is ragged, rows of 7, 3 and 1 real tokens right-padded with pad_id, and every pooling
mode of the spec (POOLINGS: "mean", "first") is tried with and without the L2 norm, so that a
wrong divisor shows in the unnormalised mean. The expected vectors are computed here from the
oracle's (the numpy backend's) last hidden states, by sentence-transformers' definitions
(sentence_transformers.models.Pooling and Normalize): "mean" is the sum of the real tokens'
states over their count (pooling_mode_mean_tokens, attention_mask weighted), "first" the first
token's state (pooling_mode_cls_token), and Normalize is torch.nn.functional.normalize(p=2,
dim=1), v / max(|v|, 1e-12). Each framework is reached through the public API (`load`, then
`forward` and `embed`) in float64.

Bound: atol_for("float64") = 1e-10 (docs/PARITY.md). Each framework's float64 encoder output
lies within it of the oracle's (impl/test_backend_vs_oracle.py); a mean of values each within it
is within it; normalising v and w gives |v/|v| - w/|w|| <= 2 |v - w| / |w|, within it again
when |w| >= 2, which is asserted of every unnormalised vector here (their norms are 3.4 to 4.3,
near the LayerNorm'd states' sqrt(d_model) = 4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import transformer_rosetta as tr
from parity_tests.conftest import backend_or_skip
from transformer_rosetta.adapter.backends import FRAMEWORKS
from transformer_rosetta.spec.config import POOLINGS, TransformerConfig
from transformer_rosetta.spec.tolerances import atol_for

ATOL = atol_for("float64")
BASE = tr.preset("tiny_encoder_only")  # BERT-like: post-norm, learned positions, embedding norm
# config id -> (pooling, pooled_l2_norm): every mode of the spec, with and without the norm.
CONFIGS = {
    f"{pooling}{'+l2' if l2 else ''}": (pooling, l2)
    for pooling in POOLINGS
    if pooling != "none"
    for l2 in (False, True)
}
LENGTHS = (7, 3, 1)  # real tokens per row; the longest sets the narrow batch's width
WIDE = 16  # the same rows with 9 more pad positions each (max_len is 32)


def ragged(width: int) -> np.ndarray:
    """Rows of LENGTHS real ids (seeded, none the pad id), right-padded with pad_id to `width`."""
    rng = np.random.default_rng(7)
    ids = np.full((len(LENGTHS), width), BASE.pad_id, dtype=np.int64)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = rng.integers(BASE.pad_id + 1, BASE.src_vocab_size, size=n)
    return ids


def config_of(config_id: str) -> TransformerConfig:
    pooling, l2 = CONFIGS[config_id]
    return BASE.replace(pooling=pooling, pooled_l2_norm=l2)


def hand_pooled(hidden: np.ndarray, pooling: str, l2: bool) -> np.ndarray:
    """sentence-transformers' Pooling (then Normalize) of hidden states (B, S, d) whose row b has
    LENGTHS[b] real tokens first, each row by itself: no mask arithmetic to share a bug with."""
    rows = []
    for row, n in enumerate(LENGTHS):
        real = hidden[row, :n]  # (n, d): the real tokens only
        rows.append(real[0] if pooling == "first" else real.sum(axis=0) / n)
    pooled = np.stack(rows)
    assert np.linalg.norm(pooled, axis=-1).min() >= 2.0  # the bound's premise (docstring)
    if l2:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """config id -> a shared-format file of the tiny encoder with that pooling. The weights are
    the same in each (pooling has no weights of its own)."""
    root = tmp_path_factory.mktemp("pooling")
    weights = tr.init_weights(BASE, seed=3, scheme="perturbed", dtype="float64")
    out = {}
    for config_id in CONFIGS:
        out[config_id] = root / f"{config_id}.safetensors"
        tr.save_weights(out[config_id], weights, config_of(config_id), "test")
    return out


@pytest.fixture(scope="module")
def expected(files) -> dict[str, np.ndarray]:
    """config id -> the hand pooling of the oracle's last hidden states of the narrow batch."""
    out = {}
    for config_id, path in files.items():
        oracle = tr.load(path, framework="numpy")
        hidden = oracle.forward(ragged(max(LENGTHS))).encoder_output
        out[config_id] = hand_pooled(hidden, *CONFIGS[config_id])
    return out


@pytest.fixture(scope="module")
def loaded(files):
    """(framework, config id) -> the float64 model, loaded once."""
    cache: dict[tuple[str, str], tr.RosettaModel] = {}

    def get(framework: str, config_id: str) -> tr.RosettaModel:
        key = (framework, config_id)
        if key not in cache:
            backend_or_skip(framework)
            cache[key] = tr.load(files[config_id], framework=framework, dtype="float64")
        return cache[key]

    return get


def test_every_pooling_mode_of_the_spec_is_tried():
    """A mode added to POOLINGS (max, say) is a mode these tests must compute by hand."""
    assert {p for p, _ in CONFIGS.values()} == set(POOLINGS) - {"none"} == {"mean", "first"}


@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_the_pooled_vector_is_the_hand_pooling_of_the_real_tokens(
    loaded, expected, framework, config_id
):
    """forward's pooled_output and embed's vectors of the ragged batch: the mean over each row's
    real tokens only (or its first token), normalised when the config says so, of the oracle's
    last hidden states."""
    model = loaded(framework, config_id)
    src = ragged(max(LENGTHS))
    want = expected[config_id]
    got = model.forward(src).pooled_output
    assert got.shape == want.shape
    for row, n in enumerate(LENGTHS):
        diff = float(np.abs(np.asarray(got[row]) - want[row]).max())
        assert diff <= ATOL, f"pooled_output row {row} ({n} real tokens) off by {diff:.3g}"
    embedded = model.embed(src)
    assert embedded.dtype == np.float64
    diff = float(np.abs(embedded - want).max())
    assert diff <= ATOL, f"embed off by {diff:.3g}"


@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_more_padding_changes_no_row(loaded, expected, framework, config_id):
    """The same rows padded to WIDE instead of 7: each row's pooled vector is the narrow batch's
    (within the float64 bound of the rounding of another shape), and still the hand pooling."""
    model = loaded(framework, config_id)
    narrow = model.forward(ragged(max(LENGTHS))).pooled_output
    wide_src = ragged(WIDE)
    assert (wide_src[:, max(LENGTHS) :] == BASE.pad_id).all()
    wide = model.forward(wide_src).pooled_output
    for row, n in enumerate(LENGTHS):
        diff = float(np.abs(np.asarray(wide[row]) - np.asarray(narrow[row])).max())
        assert diff <= ATOL, f"row {row} ({n} real tokens) moved by {diff:.3g} with more padding"
        diff = float(np.abs(np.asarray(wide[row]) - expected[config_id][row]).max())
        assert diff <= ATOL, f"row {row} ({n} real tokens), padded to {WIDE}: off by {diff:.3g}"
