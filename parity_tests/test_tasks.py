"""The generated task (common/app/tasks.py): its reference translations, tokenizers, widths and the
split between training batches and the held-out test set."""

from __future__ import annotations

import numpy as np
import pytest

from common.app.tasks import get_task, number_to_words
from common.errors import InputError

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
