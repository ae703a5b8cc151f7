"""ForwardOutput.from_model: the one conversion of a model's outputs that every backend uses."""

import numpy as np

from transformer_rosetta.spec.results import ForwardOutput


class Tensor:
    """A framework's tensor stand-in: only its conversion may read it."""

    def __init__(self, value: float) -> None:
        self.value = value


def convert(t: Tensor) -> np.ndarray:
    return np.full((1,), t.value)


def model_outputs() -> dict:
    """What a model returns: every field, the absent half's as None (an encoder-only model)."""
    return {
        "logits": None,
        "encoder_output": Tensor(1.0),
        "encoder_self_attention": [Tensor(2.0), Tensor(3.0)],
        "decoder_self_attention": [],
        "cross_attention": [],
        "encoder_hidden_states": [Tensor(4.0), Tensor(5.0), Tensor(6.0)],
        "decoder_hidden_states": [],
        "pooled_output": Tensor(7.0),
    }


def test_everything_asked_for_is_converted():
    out = ForwardOutput.from_model(model_outputs(), convert, attention=True, hidden_states=True)
    assert out.logits is None
    assert out.encoder_output.tolist() == [1.0]
    assert [a.tolist() for a in out.encoder_self_attention] == [[2.0], [3.0]]
    assert out.decoder_self_attention == [] and out.cross_attention == []
    assert [h.tolist() for h in out.encoder_hidden_states] == [[4.0], [5.0], [6.0]]
    assert out.pooled_output.tolist() == [7.0]
    assert list(out.named()) == [
        "encoder_output",
        "pooled_output",
        "encoder.layers.0.self_attention",
        "encoder.layers.1.self_attention",
        "encoder.hidden_states.0",
        "encoder.hidden_states.1",
        "encoder.hidden_states.2",
    ]


def test_what_was_not_asked_for_is_none_and_never_converted():
    seen = []

    def counting(t: Tensor) -> np.ndarray:
        seen.append(t.value)
        return convert(t)

    out = ForwardOutput.from_model(model_outputs(), counting, attention=False, hidden_states=False)
    assert out.encoder_self_attention is None and out.cross_attention is None
    assert out.encoder_hidden_states is None and out.decoder_hidden_states is None
    assert sorted(seen) == [1.0, 7.0]  # the encoder output and the pooled vector only


def test_a_missing_key_is_none():
    out = ForwardOutput.from_model(
        {"logits": Tensor(8.0)}, convert, attention=True, hidden_states=True
    )
    assert out.logits.tolist() == [8.0]
    assert out.encoder_output is None and out.encoder_self_attention is None
