"""The generated task (common/app/tasks.py): its reference translations, tokenizers, widths and the
split between training batches and the held-out test set."""

from __future__ import annotations

import numpy as np
import pytest

from transformer_rosetta.app.tasks import get_task, number_to_words
from transformer_rosetta.errors import InputError

NUMBERS = get_task("numbers")


@pytest.mark.parametrize(
    "n, words",
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (20, "twenty"),
        (21, "twenty-one"),
        (99, "ninety-nine"),
        (100, "one hundred"),
        (105, "one hundred five"),
        (1000, "one thousand"),
        (2026, "two thousand twenty-six"),
        (40213, "forty thousand two hundred thirteen"),
        (110011, "one hundred ten thousand eleven"),
        (999999, "nine hundred ninety-nine thousand nine hundred ninety-nine"),
    ],
)
def test_numbers_are_written_in_american_english(n, words):
    assert number_to_words(n) == words


def test_tokenizers_round_trip():
    text = "seventy-seven thousand one hundred five"
    ids = NUMBERS.target.encode(text)
    pieces = ["seventy", "-", "seven", "thousand", "one", "hundred", "five"]
    assert [NUMBERS.target.vocab[i] for i in ids] == pieces
    assert NUMBERS.target.decode(ids + [2, 7]) == text  # stops at EOS
    assert NUMBERS.source.decode(NUMBERS.source.encode("40213")) == "40213"
    assert NUMBERS.source.encode("09") == [3, 12]  # after pad, BOS, EOS: '0' is 3, '9' is 12


def test_unknown_characters_are_named():
    with pytest.raises(InputError, match=r"'a', 'x' not in the tokenizer"):
        NUMBERS.encode_sources(["12a4x"])
    with pytest.raises(InputError, match="7 digits"):
        NUMBERS.encode_sources(["1234567"])
    with pytest.raises(InputError, match="leading zero"):
        NUMBERS.encode_sources(["0042"])
    with pytest.raises(InputError, match="empty"):
        NUMBERS.encode_sources([""])


def test_samples_fit_the_fixed_widths_and_every_digit_count_occurs():
    rng = np.random.default_rng(0)
    pairs = [NUMBERS.sample(rng) for _ in range(20000)]
    assert max(len(s) for s, _ in pairs) == NUMBERS.source_width
    assert max(len(NUMBERS.target.encode(t)) + 1 for _, t in pairs) == NUMBERS.target_width
    assert {len(s) for s, _ in pairs} == set(range(1, 7))


def test_training_batches_never_hold_a_test_source():
    test_sources = {s for s, _ in NUMBERS.test_pairs()}
    assert len(test_sources) == NUMBERS.test_size
    stream = NUMBERS.train_batches(seed=0)
    seen = set()
    for _ in range(50):
        src, tgt = stream.next_batch()
        assert src.shape == (NUMBERS.batch_size, NUMBERS.source_width)
        assert tgt.shape == (NUMBERS.batch_size, NUMBERS.target_width)
        assert ((tgt == 2).sum(axis=1) == 1).all()  # one EOS per target
        seen |= {NUMBERS.source.decode(row) for row in src}
    assert not seen & test_sources
    assert len(seen) > 2000  # and they are varied


def test_test_pairs_are_the_same_every_time_and_correct():
    pairs = NUMBERS.test_pairs()
    assert pairs == NUMBERS.test_pairs()
    assert all(number_to_words(int(s)) == t for s, t in pairs)


def test_unknown_task_is_an_input_error():
    with pytest.raises(InputError, match="unknown 'dates'; known: numbers"):
        get_task("dates")


# -- numbers-lm: the same pairs as one sequence for a decoder-only model ----------------------

LM = get_task("numbers-lm")


def test_language_model_task_has_one_vocabulary_and_a_decoder_only_model():
    vocab = LM.target.vocab
    assert vocab[:3] == ("<pad>", "<s>", "</s>")
    assert vocab[3:13] == tuple("0123456789") and vocab[13] == "="
    assert vocab[14:] == NUMBERS.target.symbols  # the words, in the numbers task's order
    assert LM.target.size == 45
    c = LM.config()
    assert c.kind == "decoder_only" and c.num_decoder_layers == NUMBERS.layers
    assert c.src_vocab_size == c.tgt_vocab_size == 45 and c.tie_output
    assert (c.d_model, c.num_heads, c.d_ff) == (NUMBERS.d_model, NUMBERS.num_heads, NUMBERS.d_ff)


def test_prompts_have_one_width_zero_padded_digits_then_the_separator():
    prompts = LM.encode_sources(["7", "40213", "999999"])
    assert prompts.shape == (3, 1 + 6 + 1)  # BOS, six digits, "="
    assert [" ".join(LM.target.vocab[i] for i in row) for row in prompts] == [
        "<s> 0 0 0 0 0 7 =",
        "<s> 0 4 0 2 1 3 =",
        "<s> 9 9 9 9 9 9 =",
    ]
    assert prompts[1].tolist() == [1, 3, 7, 3, 5, 4, 6, 13]


def test_language_model_prompts_refuse_what_the_numbers_task_refuses():
    with pytest.raises(InputError, match=r"'a' not in the tokenizer; allowed: '0123456789'"):
        LM.encode_sources(["12a"])
    with pytest.raises(InputError, match="7 digits"):
        LM.encode_sources(["1234567"])
    with pytest.raises(InputError, match="leading zero"):
        LM.encode_sources(["0042"])
    with pytest.raises(InputError, match="'='"):  # the separator is no digit of the input
        LM.encode_sources(["1=2"])


def test_language_model_batches_are_digits_separator_words_eos_and_hold_no_test_source():
    test_sources = {s for s, _ in LM.test_pairs()}
    assert test_sources == {s for s, _ in NUMBERS.test_pairs()}  # the same held-out numbers
    stream = LM.train_batches(seed=0)
    seen = set()
    for _ in range(30):
        src, seq = stream.next_batch()
        assert src is None  # no source: the sequence is the decoder's target
        assert seq.shape == (LM.batch_size, 6 + 1 + LM.target_width)
        assert (seq[:, 6] == 13).all() and ((seq == 2).sum(axis=1) == 1).all()  # "=", one EOS
        for row in seq:
            digits = "".join(LM.target.vocab[i] for i in row[:6])
            words = LM.target.decode(row[7:])
            assert words == number_to_words(int(digits))
            seen.add(str(int(digits)))
    assert not seen & test_sources
    assert len(seen) > 1000
