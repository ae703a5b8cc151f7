"""Seed text 004's Keras pre-norm Transformer (parity_tests/fixtures/keras_prenorm.py, the text's
classes as it writes them) saved as its user saves it, `model.save_weights("x.weights.h5")` in
Keras 3, and imported with `rosetta convert --from keras-prenorm` (common/porting/tutorials.py).

- The file holds the names that Keras 3 gives the text's classes, the ones users see in its checkpoints.
- The imported model's logits match the text's own forward in float64 within atol_for("float64")
  (1e-10; the gap measured is about 1e-15), in the oracle and in the torch, Keras and Flax
  implementations, on a batch whose padding sits where each of the text's masks matters:
  right-padded sources (the encoder's self-attention and the cross-attention mask pad keys) and
  target rows with a pad id inside (the decoder's self-attention masks pad keys as well as
  future ones, so a later real query must not see it). (The float32 comparison, 1e-5, is
  porting/test_tutorials.py's, with the other tutorials.)
- Each mask matters: the text's model run with one mask removed is O(1) away from itself on the
  rows that the mask touches, and unchanged (within the bound) on the rows it does not.
- The layouts the text's code does not write through Keras 3 are refused by name, exit 2, one
  line, nothing written: the names of the official-TF1-style model of the earlier fixture, a
  Keras 2 .weights.h5 and a legacy Keras 2 / tf.keras .h5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.fixtures import SIZES
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

# The text's Transformer has one vocab_size and one hopping_num, and a feed-forward 4 * hidden_dim
# wide.
TEXT_SIZES = {**SIZES, "tgt_vocab_size": SIZES["src_vocab_size"], "d_ff": 4 * SIZES["d_model"]}
PAD = 0  # the text's PAD_ID (completed as 0: it never defines it)
BOS = 1  # the table's default (the text names no BOS)

# Sources: row 0 full; rows 1 to 3 right-padded (row 3 keeps one real token: an all-pad source
# leaves a query no key, where the text attends every pad uniformly and the spec attends none).
SRC = np.array(
    [
        [5, 6, 7, 8, 9, 10, 11],
        [5, 6, 7, 0, 0, 0, 0],
        [12, 3, 4, 5, 6, 0, 0],
        [7, 0, 0, 0, 0, 0, 0],
    ],
    dtype=np.int64,
)
# Targets: rows 1 and 2 hold a pad id inside (as a generated one would be), which the real
# positions after it may not see; rows 0 and 3 are full or right-padded only.
TGT_IN = np.array(
    [
        [BOS, 4, 5, 6, 7, 8],
        [BOS, 4, 0, 6, 7, 0],
        [BOS, 0, 0, 9, 10, 11],
        [BOS, 3, 4, 0, 0, 0],
    ],
    dtype=np.int64,
)
INNER_PAD_ROWS = [1, 2]
SOURCE_PAD_ROWS = [1, 2, 3]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the text's model in float64, its module, the imported WeightFile, the saved file)."""
    backend_or_skip("tf")
    from parity_tests.fixtures import keras_prenorm as fx
    from transformer_rosetta.cli import main

    model = fx.make_model(TEXT_SIZES, seed=5, dtype="float64")
    folder = tmp_path_factory.mktemp("keras-prenorm")
    path = folder / "transformer.weights.h5"
    fx.save(model, path)
    (folder / "given.json").write_text(json.dumps({"num_heads": SIZES["num_heads"]}))
    out = folder / "model.safetensors"
    code = main(
        ["convert", "--from", "keras-prenorm", str(path), str(out)]
        + ["--config", str(folder / "given.json")]
    )
    assert code == 0
    return model, fx, load_weights(out), path


def real(tgt_in: np.ndarray) -> np.ndarray:
    """(B, T) True at the target positions that are not padding (a pad query's row is no part of
    the contract; position 0 is BOS)."""
    return tgt_in != PAD


def gap(got: np.ndarray, want: np.ndarray, rows: list[int] | None = None) -> float:
    mask = real(TGT_IN)
    if rows is not None:
        mask[[r for r in range(len(TGT_IN)) if r not in rows]] = False
    return float(np.max(np.abs(np.asarray(got, np.float64)[mask] - want[mask])))


def text_logits(model, enc_mask=None, dec_mask=None) -> np.ndarray:
    """The text's Transformer.call spelled out (its Encoder and Decoder, its two mask methods),
    with either mask replaced when given, on SRC and TGT_IN."""
    import tensorflow as tf

    src, tgt = tf.constant(SRC), tf.constant(TGT_IN)
    if enc_mask is None:
        enc_mask = model._create_enc_attention_mask(src)
    if dec_mask is None:
        dec_mask = model._create_dec_self_attention_mask(tgt)
    encoder_output = model.encoder(src, self_attention_mask=enc_mask, training=False)
    logit = model.decoder(
        tgt,
        encoder_output,
        self_attention_mask=dec_mask,
        enc_dec_attention_mask=enc_mask,
        training=False,
    )
    return logit.numpy().astype(np.float64)


def test_the_file_holds_the_names_keras_3_gives_the_texts_classes(imported):
    from transformer_rosetta.porting.sources import read_source_tensors

    _, _, wf, path = imported
    names = set(read_source_tensors(path))
    hop = "encoder/attention_block_list/container/residual_normalization_wrapper"
    for name in (
        f"{hop}/layer/k_dense_layer/vars/0",
        f"{hop}/layer_normalization/vars/0",
        "encoder/layers/token_embedding/vars/0",
        "decoder/layers/dense/vars/0",
    ):
        assert name in names
    # Per hop: an encoder has 4 attention kernels, a 2-weight FFN Dense twice and 2 norms of 2;
    # a decoder 8 kernels, the FFN and 3 norms. Then 2 tables, 2 final norms, 1 output kernel.
    hops = TEXT_SIZES["num_encoder_layers"]
    assert len(names) == hops * (4 + 4 + 2 * 2) + hops * (8 + 4 + 3 * 2) + 2 + 2 * 2 + 1
    assert wf.config.num_encoder_layers == wf.config.num_decoder_layers == hops
    assert (wf.config.pad_id, wf.config.bos_id, wf.config.eos_id) == (0, 1, 2)


def test_the_text_forward_is_its_call(imported):
    """text_logits (the masks below are removed from) is the model's own call: the same logits
    within the float64 bound (the same model, run twice)."""
    model, fx, _, _ = imported
    same = np.abs(text_logits(model) - fx.forward(model, SRC, TGT_IN, PAD)).max()
    assert same <= atol_for("float64"), same


@pytest.mark.parametrize("name", ["numpy", *IMPLEMENTATIONS])
def test_imported_logits_match_the_text_with_its_masks(imported, name):
    model, fx, wf, _ = imported
    want = fx.forward(model, SRC, TGT_IN, PAD)
    backend = backend_or_skip(name)
    got = backend.build(wf.config, wf.tensors, dtype="float64").forward(SRC, TGT_IN).logits
    assert gap(got, want) <= atol_for("float64"), f"{name}: off by {gap(got, want):.3g}"


def test_without_the_source_pad_mask_the_text_differs_where_sources_are_padded(imported):
    """The text masks pad keys in the encoder's self-attention and in the cross-attention: with
    that mask removed its logits move by O(1) on the padded rows, not on the full row 0."""
    import tensorflow as tf

    model, _, _, _ = imported
    want = text_logits(model)
    unmasked = text_logits(model, enc_mask=tf.zeros([len(SRC), 1, 1, SRC.shape[1]], tf.bool))
    assert gap(unmasked, want, [0]) <= atol_for("float64")
    assert gap(unmasked, want, SOURCE_PAD_ROWS) > 1e-2


def test_without_the_target_pad_key_mask_the_text_differs_after_an_inner_pad(imported):
    """The text's decoder self-attention masks pad keys as well as future ones: with a causal
    mask only, the real positions after an inner pad id move by O(1); rows padded on the right
    only do not move (no real query sees their pads)."""
    import tensorflow as tf

    model, _, _, _ = imported
    want = text_logits(model)
    length = TGT_IN.shape[1]
    future = tf.logical_not(tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0))
    causal_only = text_logits(model, dec_mask=tf.reshape(future, [1, 1, length, length]))
    assert gap(causal_only, want, [0, 3]) <= atol_for("float64")
    assert gap(causal_only, want, INNER_PAD_ROWS) > 1e-2


# -- the layouts refused by name ------------------------------------------------------------


def write_h5(path, names: list[str]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for name in names:
            f.create_dataset(name, data=np.zeros((2, 2), np.float32))


@pytest.mark.parametrize(
    "file, names, message",
    [
        (
            # The earlier fixture's names (a model in the style of TensorFlow's official TF1
            # Transformer), which the text never writes.
            "old.weights.h5",
            [
                "encoder_embedding_layer/vars/0",
                "encoder_stack/layers/container/pre_post_processing_wrapper/layer/q_dense_layer/vars/0",
            ],
            "encoder_embedding_layer/vars/0: the names of a model in the style of TensorFlow's "
            "official TF1 Transformer",
        ),
        (
            # What Keras 2 (tf_keras 2.21) writes for the text's model with save_weights
            # ("x.weights.h5"), as measured.
            "keras2.weights.h5",
            [
                "layers/encoder/token_embedding/vars/0",
                "layers/encoder/layers/residual_normalization_wrapper_2/layers/layer_normalization/vars/0",
            ],
            "a Keras 2 (tf_keras) .weights.h5, which numbers the wrappers across hops",
        ),
        (
            # What Keras 2 writes with save_weights("x.h5") (the legacy HDF5 layout), as measured.
            "legacy.h5",
            [
                "encoder/transformer/encoder/token_embedding/token_embedding:0",
                "encoder/transformer/encoder/hopping_1/self_attention_w/self_attention/"
                "q_dense_layer/kernel:0",
            ],
            "a legacy Keras 2 / tf.keras .h5 (model.save_weights('x.h5')",
        ),
    ],
)
def test_the_other_layouts_are_refused_by_name(tmp_path, capsys, file, names, message):
    from transformer_rosetta.cli import main

    pytest.importorskip("h5py")
    write_h5(tmp_path / file, names)
    (tmp_path / "given.json").write_text(json.dumps({"num_heads": SIZES["num_heads"]}))
    out = tmp_path / "o.safetensors"
    code = main(
        ["convert", "--from", "keras-prenorm", str(tmp_path / file), str(out)]
        + ["--config", str(tmp_path / "given.json")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert message in err
    assert "Keras 3's model.save_weights('x.weights.h5')" in err
    assert not out.exists()
