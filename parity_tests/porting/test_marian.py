"""Import a Hugging Face MarianMTModel and match its logits in every backend.

Small MarianMTModels are built from a MarianConfig (nothing is downloaded), given random weights
large enough that a dropped bias or a swapped LayerNorm shows (transformers' init is std 0.02, with
LayerNorms at 1/0 and final_logits_bias at 0, which would hide both), saved with save_pretrained,
read back with transformer_rosetta.porting.marian, and run in the oracle, torch, Keras and Flax on ragged inputs.
Logits must be within the float32 bound (1e-5, common/spec/tolerances.py) of transformers' own.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="transformers' MarianMTModel needs torch")
pytest.importorskip(
    "transformers", reason="transformers is a test-only dependency (pip install transformers)"
)

import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import MarianConfig, MarianMTModel  # noqa: E402
from transformers.models.marian.modeling_marian import (  # noqa: E402
    MarianSinusoidalPositionalEmbedding,
)

from transformer_rosetta.errors import ConfigError, WeightFileError  # noqa: E402
from transformer_rosetta.oracle.reference import sinusoidal_positions  # noqa: E402
from transformer_rosetta.porting import marian  # noqa: E402
from transformer_rosetta.spec.names import canonical_shapes  # noqa: E402
from transformer_rosetta.spec.tolerances import atol_for  # noqa: E402

SMALL = dict(
    vocab_size=60,
    d_model=16,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_layers=2,
    decoder_layers=1,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    max_position_embeddings=64,
    eos_token_id=0,
)
# The three ways transformers 5 lays out the vocabulary matrices, with a different activation and
# embedding scale each. Marian's convention pad = start = the last id of the (decoder) vocabulary.
VARIANTS = {
    "shared_tied_relu": dict(
        pad_token_id=59, decoder_start_token_id=59, activation_function="relu", scale_embedding=True
    ),
    "separate_tied_gelu_new": dict(
        share_encoder_decoder_embeddings=False,
        decoder_vocab_size=52,
        pad_token_id=51,
        decoder_start_token_id=51,
        activation_function="gelu_new",
        scale_embedding=False,
    ),
    # transformers 5 ties nothing here: encoder, decoder and lm_head are three parameters.
    "shared_untied_gelu": dict(
        tie_word_embeddings=False,
        pad_token_id=59,
        decoder_start_token_id=59,
        activation_function="gelu",
        scale_embedding=True,
    ),
}


def hf_model(variant: str) -> MarianMTModel:
    torch.manual_seed(0)
    model = MarianMTModel(MarianConfig(**SMALL, **VARIANTS[variant])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied parameters come once
            if "embed_positions" in name:
                continue  # the sinusoid constant
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
        model.final_logits_bias.normal_(0.0, 0.5)
    return model


def inputs(pad: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged source (trailing pads) and decoder inputs starting from the start token (= pad),
    one row with trailing pads too."""
    src = np.array([[5, 6, 7, 8, 0, 3], [9, 10, 11, pad, pad, pad]])
    tgt_in = np.array([[start, 4, 5, 6, 7], [start, 8, 9, pad, pad]])
    return src, tgt_in


def hf_logits(model: MarianMTModel, src: np.ndarray, tgt_in: np.ndarray) -> np.ndarray:
    pad = model.config.pad_token_id
    # transformers masks decoder pads only through decoder_attention_mask; ours masks them
    # except position 0 (the start token, which is the pad id in Marian).
    decoder_mask = tgt_in != pad
    decoder_mask[:, 0] = True
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src != pad, dtype=torch.long),
            decoder_input_ids=torch.tensor(tgt_in),
            decoder_attention_mask=torch.tensor(decoder_mask, dtype=torch.long),
        )
    return out.logits.numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    """(hf model, its save_pretrained folder, our config, canonical weights, inputs, logits)."""
    model = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    hf, tensors = marian.read_marian_dir(folder)
    config = marian.marian_config(hf)
    weights = marian.marian_to_canonical(tensors, config, source=str(folder))
    src, tgt_in = inputs(model.config.pad_token_id, model.config.decoder_start_token_id)
    return model, folder, config, weights, (src, tgt_in), hf_logits(model, src, tgt_in)


def test_marian_logits_match_in_every_backend(saved, any_backend):
    _, _, config, weights, (src, tgt_in), want = saved
    dtype = "float64" if any_backend.name == "numpy" else "float32"
    model = any_backend.build(config, weights, dtype=dtype)
    for attention in (True, False):  # explicit probabilities, then the fused kernel
        got = model.forward(src, tgt_in, attention=attention).logits
        assert got.shape == want.shape
        gap = float(np.max(np.abs(got.astype(np.float64) - want)))
        assert gap <= atol_for("float32"), f"{any_backend.name} attention={attention}: {gap:.3g}"


def test_config_mapping(saved):
    model, _, config, weights, _, _ = saved
    hf = model.config
    assert (config.d_model, config.num_heads, config.d_ff) == (16, 2, 32)
    assert (config.num_encoder_layers, config.num_decoder_layers, config.max_len) == (2, 1, 64)
    assert config.norm_position == "post" and not config.final_norm
    assert config.layer_norm_eps == model.model.encoder.layers[0].final_layer_norm.eps == 1e-5
    assert (config.position_kind, config.sinusoid_layout) == ("sinusoidal", "concatenated")
    assert config.scale_embeddings == hf.scale_embedding
    assert config.output_bias and config.attention_bias
    assert (config.pad_id, config.bos_id, config.eos_id) == (
        hf.pad_token_id,
        hf.decoder_start_token_id,
        hf.eos_token_id,
    )
    assert config.share_embeddings == (
        hf.share_encoder_decoder_embeddings and hf.tie_word_embeddings
    )
    assert config.tie_output == hf.tie_word_embeddings
    np.testing.assert_array_equal(weights["output.bias"], model.final_logits_bias[0].numpy())


def test_position_table_is_ours():
    """MarianSinusoidalPositionalEmbedding is our "concatenated" layout, to float32 rounding."""
    table = MarianSinusoidalPositionalEmbedding(64, 16).create_weight().numpy()
    gap = np.max(np.abs(table - sinusoidal_positions(64, 16, "concatenated")))
    assert gap <= np.finfo(np.float32).eps
    # and not the interleaved one, which differs at O(1)
    assert np.max(np.abs(table - sinusoidal_positions(64, 16, "interleaved"))) > 0.5


def test_full_state_dict_imports_the_same(saved):
    """A state dict with every tied alias and the position tables (what torch.save writes, and
    what older checkpoints hold) gives the same canonical tensors as save_pretrained's file."""
    model, _, config, weights, _, _ = saved
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(marian.POSITION_KEYS) <= set(state)
    got = marian.marian_to_canonical(state, config)
    assert list(got) == list(weights) == list(canonical_shapes(config))
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)


def test_pytorch_model_bin(saved, tmp_path):
    """pytorch_model.bin is read through the torch backend (weights_only)."""
    from transformer_rosetta.adapter.backends import get_backend

    if not hasattr(get_backend("torch"), "read_tensors"):
        pytest.skip("the torch backend has no read_tensors yet")
    model, folder, config, weights, _, _ = saved
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    hf, tensors = marian.read_marian_dir(tmp_path)
    got = marian.marian_to_canonical(tensors, marian.marian_config(hf))
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name], err_msg=name)


def test_rosetta_convert_writes_a_loadable_file(saved, tmp_path):
    from transformer_rosetta.porting.convert import convert
    from transformer_rosetta.weights.format import load_weights

    _, folder, config, weights, _, _ = saved
    out = tmp_path / "marian.safetensors"
    result = convert(folder, out)
    assert result.from_kind == "marian" and result.config == config
    loaded = load_weights(out)
    assert loaded.config == config
    for name in weights:
        np.testing.assert_array_equal(loaded.tensors[name], weights[name], err_msg=name)


def test_missing_final_logits_bias_is_zeros(saved):
    model, folder, config, _, _, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["final_logits_bias"]
    got = marian.marian_to_canonical(tensors, config)
    np.testing.assert_array_equal(got["output.bias"], np.zeros(config.tgt_vocab_size, np.float32))


def test_mapping_table_covers_every_canonical_tensor(saved):
    _, _, config, _, _, _ = saved
    rows = marian.mapping_table(config)
    main = [r for r in rows if not r[2].startswith("optional") and not r[2].startswith("read only")]
    assert [r[1] for r in main] == list(canonical_shapes(config))
    assert (
        "model.encoder.layers.0.self_attn.q_proj.weight",
        "encoder.layers.0.self_attention.query.kernel",
        "transposed ([out, in] -> [in, out]), then split into heads",
    ) in rows
    assert {r[0] for r in rows} >= set(marian.POSITION_KEYS)
    read = [r[0] for r in rows if not r[2].startswith("read only")]  # fallbacks may repeat
    assert len(set(read)) == len(read)  # every other Marian name once


# -- refusals -----------------------------------------------------------------------------------


def small_hf(**changes) -> dict:
    hf = MarianConfig(**SMALL, **VARIANTS["shared_tied_relu"]).to_dict()
    hf.update(changes)
    return hf


def test_every_unsupported_field_is_named_at_once():
    hf = small_hf(
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        activation_function="swish",
        normalize_before=True,
        activation_dropout=0.1,
    )
    with pytest.raises(ConfigError) as err:
        marian.marian_config(hf)
    message = str(err.value)
    for name in (
        "encoder_attention_heads",
        "decoder_attention_heads",
        "decoder_ffn_dim",
        "activation_function: 'swish'",
        "normalize_before",
        "activation_dropout",
    ):
        assert name in message
    assert len(err.value.problems) == 5


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "bart"}, "model_type: 'bart'"),
        ({"add_final_layer_norm": True}, "add_final_layer_norm"),
        ({"static_position_embeddings": False}, "static_position_embeddings"),
        ({"encoder_layerdrop": 0.1}, "encoder_layerdrop"),
        ({"eos_token_id": [0, 3]}, "eos_token_id"),
        (
            {"share_encoder_decoder_embeddings": True, "decoder_vocab_size": 50},
            "decoder_vocab_size",
        ),
        # our own validation, with the Marian key named beside ours
        (
            {"d_model": 15, "encoder_attention_heads": 3, "decoder_attention_heads": 3},
            "(Marian d_model)",
        ),
        ({"eos_token_id": 59}, "eos_id (Marian eos_token_id)"),
    ],
)
def test_refusal_names_the_field(changes, named):
    with pytest.raises(ConfigError) as err:
        marian.marian_config(small_hf(**changes))
    assert named in str(err.value)


def test_every_tensor_problem_is_reported_at_once(saved):
    model, _, config, _, _, _ = saved
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    del state["model.encoder.layers.1.fc2.bias"]
    state["model.encoder.layernorm_embedding.weight"] = np.ones(16, np.float32)
    state["model.decoder.layers.0.fc1.weight"] = state["model.decoder.layers.0.fc1.weight"].T
    state["model.encoder.embed_positions.weight"] = sinusoidal_positions(64, 16).astype(np.float32)
    emb = "model.decoder.embed_tokens.weight"
    state[emb] = state[emb] + 1.0  # breaks the tie that every variant's config keeps
    with pytest.raises(WeightFileError) as err:
        marian.marian_to_canonical(state, config, source="state")
    message = str(err.value)
    assert message.startswith("state: ")
    assert "missing tensors (1): model.encoder.layers.1.fc2.bias" in message
    assert "unexpected tensors (1): model.encoder.layernorm_embedding.weight" in message
    assert "wrong shape for model.decoder.layers.0.fc1.weight: file has [16, 32]" in message
    assert "model.encoder.embed_positions.weight is not the concatenated sinusoid" in message
    tied = config.share_embeddings or config.tie_output
    assert (f"{emb} differs" in message or "lm_head.weight differs" in message) == tied
    assert len(err.value.problems) == 4 + tied


def test_read_marian_dir_errors(tmp_path):
    with pytest.raises(WeightFileError, match="no such folder"):
        marian.read_marian_dir(tmp_path / "absent")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(WeightFileError, match="not a folder"):
        marian.read_marian_dir(tmp_path / "file.txt")
    with pytest.raises(ConfigError, match="config.json: missing"):
        marian.read_marian_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        marian.read_marian_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small_hf()))
    with pytest.raises(WeightFileError, match="neither model.safetensors nor pytorch_model.bin"):
        marian.read_marian_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(WeightFileError, match="sharded"):
        marian.read_marian_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(WeightFileError, match="not a safetensors file"):
        marian.read_marian_dir(tmp_path)


def test_a_config_no_marian_has_is_refused(saved):
    _, folder, config, _, _, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="sinusoid_layout: a Marian model has 'concatenated'"):
        marian.marian_to_canonical(tensors, config.replace(sinusoid_layout="interleaved"))
