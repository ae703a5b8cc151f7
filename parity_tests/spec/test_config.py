"""The spec: validation names the field and what is allowed; JSON round trip for every preset."""

from __future__ import annotations

import json

import pytest

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.spec.config import PRESETS, TransformerConfig, preset


def problems_of(**fields) -> list[str]:
    with pytest.raises(ConfigError) as info:
        TransformerConfig(**fields)
    return info.value.problems


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_round_trip_for_every_preset(name):
    config = PRESETS[name]
    text = config.to_json()
    assert TransformerConfig.from_json(text) == config
    assert json.loads(text)["d_model"] == config.d_model


def test_file_round_trip(tmp_path):
    config = preset("tiny").replace(activation="gelu", position_kind="learned")
    path = tmp_path / "c.json"
    path.write_text(config.to_json(indent=2))
    assert TransformerConfig.from_file(path) == config


def test_defaults_are_the_papers_base_model():
    c = TransformerConfig()
    assert (c.d_model, c.num_heads, c.d_ff, c.num_encoder_layers, c.num_decoder_layers) == (
        512,
        8,
        2048,
        6,
        6,
    )
    assert (c.dropout, c.label_smoothing, c.norm_position, c.head_dim) == (0.1, 0.1, "post", 64)
    assert c.share_embeddings and c.tie_output and c.scale_embeddings
    big = preset("big")
    assert (big.d_model, big.num_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)


def test_d_model_not_divisible_by_heads():
    (p,) = problems_of(d_model=100, num_heads=3)
    assert p.startswith("d_model: 100 is not divisible by num_heads=3")


@pytest.mark.parametrize("field", ["d_model", "num_heads", "d_ff", "max_len"])
def test_size_below_one(field):
    problems = problems_of(**{field: 0})
    assert f"{field}: must be >= 1, got 0" in problems


@pytest.mark.parametrize("field", ["num_encoder_layers", "num_decoder_layers", "type_vocab_size"])
def test_counts_may_be_zero_but_not_negative(field):
    assert f"{field}: must be an integer >= 0, got -1" in problems_of(**{field: -1})


HALF = dict(share_embeddings=False, tie_output=False)


def test_the_kind_follows_the_layer_counts():
    assert preset("tiny").kind == "encoder_decoder"
    assert TransformerConfig(num_encoder_layers=0, share_embeddings=False).kind == "decoder_only"
    assert TransformerConfig(num_decoder_layers=0, **HALF).kind == "encoder_only"
    assert preset("tiny_decoder_only").kind == "decoder_only"
    assert preset("tiny_encoder_only").kind == "encoder_only"


def test_both_stacks_empty_is_refused():
    (p,) = problems_of(num_encoder_layers=0, num_decoder_layers=0, **HALF)
    assert p.startswith("num_encoder_layers: both stacks have 0 layers")


def test_the_halves_share_and_tie_nothing_they_lack():
    assert problems_of(num_encoder_layers=0) == [
        "share_embeddings: a decoder-only model has one embedding, nothing to share it with; "
        "set share_embeddings to false"
    ]
    problems = problems_of(num_decoder_layers=0, share_embeddings=False, output_bias=True)
    assert problems == [
        "tie_output: an encoder-only model has no output projection (it returns hidden states); "
        "set tie_output to false",
        "output_bias: an encoder-only model has no output projection (it returns hidden "
        "states); set output_bias to false",
    ]


def test_only_an_encoder_only_model_pools():
    (p,) = problems_of(pooling="mean")
    assert p == (
        "pooling: only an encoder-only model (num_decoder_layers 0) pools, got 'mean' on an "
        "encoder-decoder model; set pooling to 'none'"
    )
    assert problems_of(pooled_l2_norm=True, num_decoder_layers=0, **HALF) == [
        "pooled_l2_norm: there is no pooled vector to normalise (pooling 'none')"
    ]
    (p,) = problems_of(pooling="max", num_decoder_layers=0, **HALF)
    assert p == "pooling: unknown value 'max'; allowed: 'none', 'mean', 'first'"


def test_a_half_checks_ids_against_the_vocabulary_it_reads():
    # An encoder-only model never reads the target vocabulary; a decoder-only one the source's.
    TransformerConfig(num_decoder_layers=0, src_vocab_size=200, tgt_vocab_size=200, **HALF)
    dec = dict(num_encoder_layers=0, share_embeddings=False, src_vocab_size=5)
    TransformerConfig(**dec, tgt_vocab_size=50, eos_id=20)  # valid: the source vocabulary unread
    assert problems_of(**dec, tgt_vocab_size=10, eos_id=20) == [
        "eos_id: 20 is outside the target vocabulary (size 10)"
    ]


def test_bos_and_eos_are_the_decoders_and_pad_is_every_stacks():
    """TensorFlow's older tutorial numbers each language's markers after its tokenizer:
    start = vocab_size, end = vocab_size + 1, so the model's vocabularies are vocab_size + 2 and
    the target's end id lies outside a smaller source vocabulary. bos_id and eos_id are the
    decoder's (they start and end decoding): only the target vocabulary bounds them. pad_id is
    read by both stacks: each vocabulary bounds it, and each problem names its stack."""
    src_tokenizer, tgt_tokenizer = 40, 55  # the tutorial's tokenizer_pt / tokenizer_en sizes
    config = TransformerConfig(
        src_vocab_size=src_tokenizer + 2,
        tgt_vocab_size=tgt_tokenizer + 2,
        share_embeddings=False,
        bos_id=tgt_tokenizer,
        eos_id=tgt_tokenizer + 1,
    )
    assert config.eos_id == 56 >= config.src_vocab_size == 42
    untied = dict(src_vocab_size=42, tgt_vocab_size=57, share_embeddings=False)
    assert problems_of(**untied, bos_id=57, eos_id=56) == [
        "bos_id: 57 is outside the target vocabulary (size 57)"
    ]
    assert problems_of(**untied, bos_id=55, eos_id=58) == [
        "eos_id: 58 is outside the target vocabulary (size 57)"
    ]
    assert problems_of(**untied, bos_id=55, eos_id=56, pad_id=50) == [
        "pad_id: 50 is outside the source vocabulary (size 42)"
    ]
    assert problems_of(**untied, bos_id=55, eos_id=56, pad_id=60) == [
        "pad_id: 60 is outside the source vocabulary (size 42)",
        "pad_id: 60 is outside the target vocabulary (size 57)",
    ]
    # A decoder-only model's pad_id is bounded by the target vocabulary alone.
    TransformerConfig(
        num_encoder_layers=0,
        share_embeddings=False,
        src_vocab_size=5,
        pad_id=30,
        tgt_vocab_size=50,
        bos_id=31,
        eos_id=32,
    )


def test_size_of_wrong_type():
    assert "d_ff: must be an integer >= 1, got 2048.0" in problems_of(d_ff=2048.0)
    assert "final_norm: must be true or false, got 1" in problems_of(final_norm=1)


def test_unknown_activation_and_position_kind():
    problems = problems_of(activation="swish", position_kind="alibi")
    assert (
        "activation: unknown value 'swish'; allowed: 'relu', 'gelu', 'gelu_tanh', 'silu'"
        in problems
    )
    assert (
        "position_kind: unknown value 'alibi'; allowed: 'sinusoidal', 'learned', 'rotary'"
        in problems
    )
    (p,) = problems_of(sinusoid_layout="blocked")
    assert p.startswith("sinusoid_layout: unknown value 'blocked'")


def test_sharing_embeddings_with_different_vocabs():
    problems = problems_of(src_vocab_size=100, tgt_vocab_size=120, tie_output=False)
    assert problems == [
        "share_embeddings: one shared embedding needs src_vocab_size == tgt_vocab_size, got 100 "
        "and 120; set share_embeddings to false"
    ]


def test_tying_the_output_when_vocabs_differ():
    problems = problems_of(src_vocab_size=100, tgt_vocab_size=120, tie_output=True)
    assert any(p.startswith("tie_output: the output projection would be tied") for p in problems)
    # Without sharing, the output ties to the target embedding, whose vocabulary always fits.
    ok = TransformerConfig(src_vocab_size=100, tgt_vocab_size=120, share_embeddings=False)
    assert ok.tie_output


def test_every_problem_is_reported_at_once():
    problems = problems_of(dropout=1.5, layer_norm_eps=0.0, activation="tanh", max_len=-1)
    assert len(problems) == 4
    assert {p.split(":")[0] for p in problems} == {
        "dropout",
        "layer_norm_eps",
        "activation",
        "max_len",
    }


def test_special_ids():
    assert "pad_id: 50 is outside the source vocabulary (size 48)" in problems_of(
        **{**preset("tiny").to_dict(), "pad_id": 50}
    )
    assert "eos_id: must differ from pad_id (both 0)" in problems_of(eos_id=0)
    assert "sinusoidal positions pair" in problems_of(d_model=9, num_heads=3)[0]
    # Marian starts decoding from the pad token, so bos == pad is allowed.
    assert TransformerConfig(bos_id=0).bos_id == 0


def test_unknown_key_in_json_config_is_named_with_a_suggestion():
    data = {**preset("tiny").to_dict(), "d_modle": 32, "heads": 4}
    with pytest.raises(ConfigError) as info:
        TransformerConfig.from_dict(data)
    assert info.value.problems == [
        "d_modle: unknown config field (did you mean 'd_model'?)",
        "heads: unknown config field (did you mean 'num_heads'?)",
    ]


def test_bad_json_text():
    with pytest.raises(ConfigError, match="not valid JSON"):
        TransformerConfig.from_json("{d_model: 3")
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        TransformerConfig.from_json("[1, 2]")


def test_unknown_preset():
    with pytest.raises(
        ConfigError,
        match="unknown preset .huge.; allowed: tiny, tiny_decoder_only, tiny_encoder_only, tiny_llama, base, big",
    ):
        preset("huge")


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        preset("tiny").d_model = 8


def test_a_decoder_only_model_may_start_and_end_with_one_id():
    """GPT-2's <|endoftext|> is both; a model with an encoder decodes from BOS and may not."""
    dec = dict(num_encoder_layers=0, share_embeddings=False)
    assert TransformerConfig(**dec, bos_id=2, eos_id=2).kind == "decoder_only"
    assert problems_of(bos_id=2, eos_id=2) == ["eos_id: must differ from bos_id (both 2)"]


def test_the_fields_of_todays_decoders_are_checked_by_name():
    """num_kv_heads must divide num_heads, rotary needs an even head size, rope_theta a base
    above 1, and each new switch its type."""
    assert problems_of(num_heads=8, num_kv_heads=3) == [
        "num_kv_heads: 3 does not divide num_heads=8; each key/value head serves "
        "num_heads / num_kv_heads query heads"
    ]
    assert problems_of(num_kv_heads=0) == ["num_kv_heads: must be an integer >= 1 or null, got 0"]
    assert problems_of(position_kind="rotary", d_model=24, num_heads=8) == [
        "position_kind: rotary positions rotate pairs of dimensions, so the head size (d_k) "
        "must be even, got 3"
    ]
    assert problems_of(rope_theta=1.0) == ["rope_theta: must be a number in (1, 1e12), got 1.0"]
    assert problems_of(rotary_layout="meta")[0].startswith(
        "rotary_layout: unknown value 'meta'; allowed: 'half_split', 'interleaved'"
    )
    assert problems_of(attention_output_bias="no") == [
        "attention_output_bias: must be true, false or null, got 'no'"
    ]
    assert problems_of(gated_feed_forward=1) == ["gated_feed_forward: must be true or false, got 1"]


def test_the_new_fields_default_to_the_paper():
    """Every file and preset written before them reads as it did: multi-head attention, no
    rotation, a LayerNorm, an ungated feed-forward with biases, an output bias as attention_bias."""
    c = TransformerConfig()
    assert (c.num_kv_heads, c.kv_heads, c.position_kind, c.norm_kind) == (
        None,
        8,
        "sinusoidal",
        "layer_norm",
    )
    assert (c.gated_feed_forward, c.feed_forward_bias, c.output_projection_bias) == (
        False,
        True,
        True,
    )
    assert c.replace(attention_bias=False).output_projection_bias is False
    assert c.replace(attention_output_bias=False).output_projection_bias is False
