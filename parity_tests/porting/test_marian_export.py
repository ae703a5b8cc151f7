"""`rosetta convert --to marian`: the way out, through the same table as the way in
(common/porting/marian.py, TABLE, steps inverted by common/porting/table.py:from_canonical).

- A Marian folder read in and written out again is the same file, tensor by tensor, bit for bit.
- Our model written out loads in transformers' MarianMTModel with no missing or unexpected key,
  gives our logits within 1e-5 (float32, common/spec/tolerances.py), reads back bit-exactly, and
  transformers' greedy generation yields our greedy tokens.
- What Marian cannot hold is refused by field, before anything is written.
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402
from transformers import MarianMTModel  # noqa: E402

from parity_tests.porting.test_marian import hf_logits, inputs, saved  # noqa: E402, F401
from transformer_rosetta.adapter.backends import get_backend  # noqa: E402
from transformer_rosetta.cli import main  # noqa: E402
from transformer_rosetta.decoding.search import greedy_search  # noqa: E402
from transformer_rosetta.porting import marian  # noqa: E402
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.tolerances import atol_for  # noqa: E402
from transformer_rosetta.weights.format import load_weights, save_weights  # noqa: E402
from transformer_rosetta.weights.init import init_weights  # noqa: E402

BASE = dict(
    src_vocab_size=40,
    tgt_vocab_size=40,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=2,
    num_decoder_layers=1,
    max_len=64,
    dropout=0.0,
    layer_norm_eps=1e-5,
    sinusoid_layout="concatenated",
    output_bias=True,
    pad_id=39,
    bos_id=39,
    eos_id=0,
)
# Every layout of the vocabulary matrices that Marian holds, each activation and both scalings.
HELD = {
    "shared-tied-relu": dict(share_embeddings=True, tie_output=True, activation="relu"),
    "separate-tied-gelu_tanh": dict(
        share_embeddings=False,
        tie_output=True,
        tgt_vocab_size=33,
        pad_id=32,
        bos_id=32,
        activation="gelu_tanh",
        scale_embeddings=False,
    ),
    "separate-untied-gelu": dict(
        share_embeddings=False,
        tie_output=False,
        tgt_vocab_size=35,
        pad_id=3,
        bos_id=1,
        activation="gelu",
    ),
}


def config_of(case: str, **changes) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **HELD[case], **changes})


def export(tmp_path, config: TransformerConfig, seed: int = 0):
    """Our weights for `config` (every bias drawn) written as a Marian folder by the CLI."""
    weights = init_weights(config, seed=seed, scheme="perturbed")
    save_weights(tmp_path / "ours.safetensors", weights, config, producer="test")
    folder = tmp_path / "marian"
    code = main(["convert", str(tmp_path / "ours.safetensors"), str(folder), "--to", "marian"])
    assert code == 0
    return weights, folder


def test_the_written_folder_carries_its_verification(tmp_path):
    """convert --to marian runs the folder in transformers against the float64 oracle on our
    file, and stores the record in model.safetensors' header, which transformers ignores."""
    from safetensors import safe_open

    _, folder = export(tmp_path, config_of("shared-tied-relu"))
    with safe_open(folder / "model.safetensors", "np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"  # what transformers checks
    check = json.loads(metadata["provenance"])["verify"]
    assert check["passed"] and check["sides"][0] == "numpy float64 oracle"
    assert check["sides"][1].startswith("transformers ") and "MarianMTModel" in check["sides"][1]
    # The bound follows the model (docs/PARITY.md, "The verification bound"): for these O(1)
    # logits it is float32's parity bound or within a few times of it, never loose.
    assert 0 < check["max_abs_logit_diff"] <= check["bound"]
    assert atol_for("float32") <= check["bound"] <= 5 * atol_for("float32")
    # transformers gives a fully padded source row uniform attention over the pads, we give
    # zeros (docs/PORTING.md): those rows are not probed.
    assert check["probe_rows"] == "ragged_batch without fully padded source rows"
    assert check["probe_shapes"] == [[2, 7, 5], [2, 4, 9]]


def test_marian_in_then_out_is_the_same_file(saved, tmp_path):  # noqa: F811
    """Marian -> rosetta -> Marian: every tensor transformers saved comes back, bit for bit."""
    _, folder, _, _, _, _ = saved
    assert main(["convert", str(folder), str(tmp_path / "in.safetensors")]) == 0
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "in.safetensors"), str(out), "--to", "marian"]) == 0
    before, after = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    hf_before = json.loads((folder / "config.json").read_text())
    if hf_before.get("share_encoder_decoder_embeddings", True) and not hf_before.get(
        "tie_word_embeddings", True
    ):
        # Shared but untied: transformers 5 reads three separate matrices and keeps model.shared
        # as a fourth it never uses; what the model computes with comes back, the unused one not.
        del before["model.shared.weight"]
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].tobytes() == value.tobytes(), key
    hf_after = json.loads((out / "config.json").read_text())
    assert marian.marian_config(hf_after) == marian.marian_config(hf_before)


@pytest.mark.parametrize("case", list(HELD))
def test_our_model_loads_in_transformers_and_computes_the_same(tmp_path, case):
    config = config_of(case)
    weights, folder = export(tmp_path, config)
    model, info = MarianMTModel.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    model.eval()
    src, tgt_in = inputs(config.pad_id, config.bos_id)
    ours = get_backend("torch").build(config, weights).forward(src, tgt_in).logits
    diff = float(np.max(np.abs(hf_logits(model, src, tgt_in) - ours)))
    assert diff <= atol_for("float32"), f"{case}: {diff:.3g}"
    # ... and reads back as it was written, config and tensors, bit for bit.
    assert main(["convert", str(folder), str(tmp_path / "back.safetensors")]) == 0
    back = load_weights(tmp_path / "back.safetensors")
    assert back.config == config
    assert back.tensors.keys() == weights.keys()
    for name, value in weights.items():
        assert back.tensors[name].tobytes() == value.astype(np.float32).tobytes(), name


@pytest.mark.parametrize("case", list(HELD))
def test_transformers_greedy_generation_gives_our_tokens(tmp_path, case):
    config = config_of(case)
    weights, folder = export(tmp_path, config, seed=3)
    model = MarianMTModel.from_pretrained(folder).eval()
    src = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    steps = 6
    ours = get_backend("torch").build(config, weights)
    decoded = greedy_search(partial(ours.stepper), config, src, extra_len=steps)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(src),
            attention_mask=torch.ones(src.shape, dtype=torch.long),
            do_sample=False,
            num_beams=1,
            max_new_tokens=steps,
        ).numpy()
    for row, tokens in enumerate(decoded.tokens):
        theirs = out[row, 1:]  # after decoder_start_token_id
        theirs = theirs[: list(theirs).index(config.eos_id)] if config.eos_id in theirs else theirs
        n = min(len(tokens), steps)
        assert theirs[:n].tolist() == tokens[:n].tolist(), f"{case} row {row}"


def test_missing_biases_are_written_as_zeros(tmp_path):
    """attention_bias, feed_forward_bias and output_bias false: Marian always has the biases;
    zeros compute the same."""
    config = config_of(
        "separate-untied-gelu", attention_bias=False, output_bias=False, feed_forward_bias=False
    )
    weights, folder = export(tmp_path, config)
    state = load_file(str(folder / "model.safetensors"))
    assert not state["final_logits_bias"].any()
    assert not state["model.encoder.layers.0.self_attn.q_proj.bias"].any()
    assert not state["model.decoder.layers.0.fc1.bias"].any()
    model = MarianMTModel.from_pretrained(folder).eval()
    src, tgt_in = inputs(config.pad_id, config.bos_id)
    ours = get_backend("torch").build(config, weights).forward(src, tgt_in).logits
    assert float(np.max(np.abs(hf_logits(model, src, tgt_in) - ours))) <= atol_for("float32")


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(norm_position="pre"), "norm_position: MarianMTModel is post-norm"),
        (dict(final_norm=True), "final_norm: MarianMTModel has no final"),
        (dict(position_kind="learned"), "position_kind: MarianMTModel has fixed sinusoidal"),
        (dict(sinusoid_layout="interleaved"), "sinusoid_layout: MarianMTModel's sinusoids are"),
        (dict(layer_norm_eps=1e-6), "layer_norm_eps: MarianMTModel's LayerNorms use"),
        (dict(norm_kind="std_plus_eps"), "norm_kind: MarianMTModel's norms are nn.LayerNorm"),
        (dict(key_dim=4), "key_dim: MarianMTModel's heads are d_model / heads wide"),
        (dict(tie_output=False), "share_embeddings: transformers 5 shares"),
        (dict(activation="silu"), "activation: MarianMTModel's activation_function has no 'silu'"),
        (dict(gated_feed_forward=True), "gated_feed_forward: MarianMTModel's feed-forward has no"),
        (dict(num_kv_heads=1), "num_kv_heads: MarianMTModel's attention has as many key/value"),
    ],
)
def test_what_marian_cannot_hold_is_refused_by_field(tmp_path, capsys, changes, named):
    config = config_of("shared-tied-relu", **changes)
    save_weights(
        tmp_path / "ours.safetensors", init_weights(config, seed=0), config, producer="test"
    )
    code = main(
        ["convert", str(tmp_path / "ours.safetensors"), str(tmp_path / "m"), "--to", "marian"]
    )
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.count("\n") == 1
    assert not (tmp_path / "m").exists()
