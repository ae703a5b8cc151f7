"""Seeded sampling (common/decoding/sampling.py) on a stub stepper with fixed logits: no framework.

What is checked, against a filter written here independently of the code (descending order,
kept while the mass before a token is below p, the nucleus of Holtzman et al. 2020, section 3.1):
- top_k=1 is greedy search, token for token, on logits without ties;
- over many seeds the sampled tokens' frequencies match the filtered softmax (temperature, top-k,
  top-p): a chi-square test on the kept tokens, and never a removed one;
- the same seed gives the same tokens; the arguments are checked by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from transformer_rosetta.decoding.sampling import filtered_log_probs, sample_search
from transformer_rosetta.decoding.search import greedy_search
from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig

VOCAB = 8
CONFIG = TransformerConfig(
    src_vocab_size=VOCAB,
    tgt_vocab_size=VOCAB,
    d_model=4,
    num_heads=1,
    d_ff=4,
    num_encoder_layers=0,
    num_decoder_layers=1,
    max_len=64,
    position_kind="learned",
    share_embeddings=False,
    pad_id=0,
    bos_id=1,
    eos_id=2,
)
# Fixed logits per fed token: row t is the next-token logits after token t. Drawn once, seeded;
# no two entries of a row tie (checked below), so argmax has no tie to break.
TABLE = np.random.default_rng(11).normal(0.0, 1.5, size=(VOCAB, VOCAB))
# Seeds for the frequency tests: the expected count of the least likely kept token is then >= 5
# (checked), chi-square's usual condition.
DRAWS = 3000
# The chi-square test's level: a sampler this far off fails; the seeds are fixed, so the outcome
# is the same on every run (measured p-values are in the assertion messages).
ALPHA = 1e-3


class TableStepper:
    """A Stepper whose logits depend only on the token fed: TABLE[token]."""

    def __init__(self, src: np.ndarray, beams: int, max_steps: int) -> None:
        self.steps, self.max_steps = 0, max_steps

    def step(self, tokens: np.ndarray) -> np.ndarray:
        assert self.steps < self.max_steps
        self.steps += 1
        return TABLE[np.asarray(tokens)].astype(np.float32)

    def reorder(self, rows: np.ndarray) -> None:  # pragma: no cover - greedy and sampling only
        raise AssertionError("not used")


def expected_distribution(
    logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None
) -> np.ndarray:
    """The filtered softmax, written out: scale, keep the k largest, then walk down the sorted
    probabilities keeping a token while the mass of the tokens above it is below p."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    keep = np.ones(len(scaled), dtype=bool)
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k is not None:
        for rank, i in enumerate(order):
            keep[i] = rank < top_k
    if top_p is not None:
        probs = np.exp(scaled - scaled.max()) * keep
        probs /= probs.sum()
        mass_above = 0.0
        for i in order:
            if keep[i]:
                keep[i] = mass_above < top_p
                mass_above += probs[i]
    probs = np.exp(scaled - scaled.max()) * keep
    return probs / probs.sum()


def first_token_counts(prompt_token: int, **options) -> np.ndarray:
    src = np.array([[prompt_token]])
    counts = np.zeros(VOCAB, dtype=np.int64)
    for seed in range(DRAWS):
        decoded = sample_search(
            TableStepper, CONFIG, src, extra_len=1, seed=seed, stop_at_eos=False, **options
        )
        counts[decoded.tokens[0][0]] += 1
    return counts


def test_the_table_has_no_ties():
    for row in TABLE:
        assert len(set(row.astype(np.float32).tolist())) == VOCAB


def test_top_k_one_is_greedy():
    prompts = np.array([[3, 4], [5, 6], [7, 0]])
    want = greedy_search(TableStepper, CONFIG, prompts, extra_len=10)
    for seed in (0, 1, 2):
        got = sample_search(TableStepper, CONFIG, prompts, extra_len=10, top_k=1, seed=seed)
        for w, g in zip(want.tokens, got.tokens, strict=True):
            assert w.tolist() == g.tolist()
        assert (got.finished == want.finished).all()
        assert np.allclose(got.scores, 0.0)  # one kept token: probability 1 at every step


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.8},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 0.9, "top_k": 6, "top_p": 0.9},
    ],
    ids=["plain", "temperature-top-p", "temperature-top-k", "all-three"],
)
def test_frequencies_match_the_filtered_softmax(options):
    prompt_token = 4
    want = expected_distribution(
        TABLE[prompt_token].astype(np.float32),
        options["temperature"],
        options.get("top_k"),
        options.get("top_p"),
    )
    kept = want > 0
    assert (DRAWS * want[kept]).min() >= 5, "too few draws for chi-square"
    if "top_k" in options or "top_p" in options:
        assert not kept.all(), "the filter should remove some token here"
    counts = first_token_counts(prompt_token, **options)
    assert counts[~kept].sum() == 0, f"removed tokens were drawn: {counts}"
    result = stats.chisquare(counts[kept], DRAWS * want[kept])
    assert result.pvalue > ALPHA, f"counts {counts} vs {DRAWS * want}: p = {result.pvalue:.3g}"


def test_the_filter_matches_the_written_out_one():
    logits = TABLE.astype(np.float32)
    for options in ({"temperature": 0.5, "top_p": 0.6}, {"temperature": 2.0, "top_k": 3}):
        got = np.exp(filtered_log_probs(logits, **options))
        for row, probs in zip(logits, got, strict=True):
            want = expected_distribution(
                row, options["temperature"], options.get("top_k"), options.get("top_p")
            )
            # Both in float64 from the same float32 logits: rounding only (~1e-16).
            assert np.abs(probs - want).max() <= 1e-12


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    prompts = np.array([[3], [5]])

    def run(seed):
        d = sample_search(TableStepper, CONFIG, prompts, extra_len=12, seed=seed, stop_at_eos=False)
        return [t.tolist() for t in d.tokens]

    assert run(5) == run(5)
    assert run(5) != run(6)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_arguments_are_refused_by_name(options, named):
    with pytest.raises(InputError) as caught:
        sample_search(TableStepper, CONFIG, np.array([[3]]), extra_len=2, **options)
    message = str(caught.value)
    assert message.startswith(f"{named}:") and "\n" not in message
