"""The search written once (common/decoding/search.py), on the float64 oracle: greedy against a plain
argmax loop over full forward passes, beam search against exhaustive enumeration, and scores
recomputed by teacher forcing. Float64 throughout: the only rounding is the oracle's own, so
scores agree to 1e-12 (sums of ~10 log-probabilities of size ~1 each, each good to ~1e-15)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from transformer_rosetta.adapter.reference_backend import NumpyBackend
from transformer_rosetta.decoding.search import (
    beam_search,
    greedy_search,
    length_penalty,
    log_softmax,
    row_limits,
)
from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights.init import init_weights

SCORE_ATOL = 1e-12


def oracle(config, seed=0):
    weights = init_weights(config, seed=seed, scheme="perturbed")
    return NumpyBackend().build(config, weights), weights


def sequence_log_prob(weights, c, src_row, tokens):
    """log P(tokens | src) by one teacher-forced forward pass (tokens include EOS if any)."""
    tgt_in = np.array([[c.bos_id, *tokens[:-1]]])
    logits = reference.forward(weights, c, src_row[None], tgt_in).logits[0]
    lp = log_softmax(logits)
    return float(sum(lp[t, tok] for t, tok in enumerate(tokens)))


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0, abs=1e-15)  # ((5 + 1) / 6)^a
    assert length_penalty(7, 0.6) == pytest.approx(2**0.6, abs=1e-15)
    assert length_penalty(7, 0.0) == pytest.approx(1.0, abs=1e-15)


def test_row_limits_count_non_pad_source_tokens():
    c = preset("tiny")
    src = np.array([[5, 6, 7], [5, 0, 0], [0, 0, 0]])
    assert row_limits(c, src, 50).tolist() == [53, 51, 50]
    learned = c.replace(position_kind="learned", max_len=20)
    assert row_limits(learned, src, 50).tolist() == [20, 20, 20]


def test_greedy_matches_an_argmax_loop_over_full_forward_passes():
    c = preset("tiny")
    model, weights = oracle(c)
    src = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [11, 12, 13, 0]])
    got = greedy_search(model.stepper, c, src, extra_len=5)
    for row in range(src.shape[0]):
        limit = int((src[row] != c.pad_id).sum()) + 5
        prefix = [c.bos_id]
        for _ in range(limit):
            logits = reference.forward(weights, c, src[row : row + 1], np.array([prefix])).logits
            prefix.append(int(logits[0, -1].argmax()))
            if prefix[-1] == c.eos_id:
                break
        ended = prefix[-1] == c.eos_id
        want = prefix[1:-1] if ended else prefix[1:]
        assert got.tokens[row].tolist() == want
        assert bool(got.finished[row]) == ended
        score = sequence_log_prob(weights, c, src[row], prefix[1:])
        assert abs(got.scores[row] - score) <= SCORE_ATOL


def test_batched_search_equals_one_row_at_a_time():
    c = preset("tiny")
    model, _ = oracle(c, seed=3)
    src = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [0, 0, 0, 0]])
    for search in (greedy_search, beam_search):
        whole = search(model.stepper, c, src, extra_len=4)
        for row in range(src.shape[0]):
            alone = search(model.stepper, c, src[row : row + 1], extra_len=4)
            assert alone.tokens[0].tolist() == whole.tokens[row].tolist()
            assert abs(alone.scores[0] - whole.scores[row]) <= SCORE_ATOL


def all_hypotheses(c, vocab, limit):
    """Every complete hypothesis: ends in EOS (no EOS before), or reaches the limit without."""
    for length in range(1, limit + 1):
        for seq in itertools.product(range(vocab), repeat=length):
            if c.eos_id in seq[:-1]:
                continue
            if seq[-1] == c.eos_id or length == limit:
                yield list(seq)


def test_beam_search_with_a_wide_beam_finds_the_best_hypothesis_of_all():
    # 5 target ids and 3 steps: 85 hypotheses, all kept by a beam of 64 (at most 4^2 live).
    c = preset("tiny").replace(tgt_vocab_size=5, share_embeddings=False)
    model, weights = oracle(c, seed=1)
    src = np.array([[5, 0, 0]])
    got = beam_search(model.stepper, c, src, beam=64, alpha=0.6, extra_len=2)
    scored = []
    for seq in all_hypotheses(c, 5, 3):
        logp = sequence_log_prob(weights, c, src[0], seq)
        scored.append((logp / length_penalty(len(seq), 0.6), seq))
    best_score, best = max(scored, key=lambda s: s[0])
    ended = best[-1] == c.eos_id
    assert got.tokens[0].tolist() == (best[:-1] if ended else best)
    assert abs(got.scores[0] - best_score) <= SCORE_ATOL
    # and the winner is a clear one, so the check is not decided by rounding
    runner_up = sorted(s for s, _ in scored)[-2]
    assert best_score - runner_up > 1e-6


def test_beam_scores_are_the_normalised_log_probability_of_the_tokens():
    c = preset("tiny")
    model, weights = oracle(c, seed=2)
    src = np.array([[5, 6, 7], [8, 9, 0]])
    got = beam_search(model.stepper, c, src, beam=4, alpha=0.6, extra_len=4)
    for row in range(2):
        seq = got.tokens[row].tolist() + ([c.eos_id] if got.finished[row] else [])
        logp = sequence_log_prob(weights, c, src[row], seq)
        assert abs(got.scores[row] - logp / length_penalty(len(seq), 0.6)) <= SCORE_ATOL


def test_beam_one_without_length_penalty_is_greedy():
    c = preset("tiny")
    model, _ = oracle(c, seed=4)
    src = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
    greedy = greedy_search(model.stepper, c, src, extra_len=6)
    beam = beam_search(model.stepper, c, src, beam=1, alpha=0.0, extra_len=6)
    for row in range(2):
        assert beam.tokens[row].tolist() == greedy.tokens[row].tolist()
        assert abs(beam.scores[row] - greedy.scores[row]) <= SCORE_ATOL


def test_stop_at_eos_false_decodes_every_row_to_its_limit():
    c = preset("tiny")
    model, _ = oracle(c)
    src = np.array([[5, 6, 7], [8, 0, 0]])
    got = greedy_search(model.stepper, c, src, extra_len=3, stop_at_eos=False)
    assert [len(t) for t in got.tokens] == [6, 4]
    assert not got.finished.any()


@pytest.mark.parametrize("beam, extra", [(0, 5), (4, 0)])
def test_bad_search_arguments_are_input_errors(beam, extra):
    c = preset("tiny")
    model, _ = oracle(c)
    with pytest.raises(InputError):
        beam_search(model.stepper, c, np.array([[5, 6]]), beam=beam, extra_len=extra)
