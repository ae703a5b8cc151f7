"""Beam search among many exact ties: which candidates stay live, and in which slots, follows the
documented rule whatever the beam and vocabulary size.

The rule (common/decoding/search.py, docs/PARITY.md "Decoding"): candidates are ranked by total
log-probability, and exact ties go to the lower index in the row's beam * vocabulary
extensions, slot * V + token, so to the lower slot first and then the lower token id. It is
what makes a tie come out the same in every framework.

A scripted stepper returns the same log-probabilities to every row: hundreds of ordinary tokens
tie exactly, and from the second step on a few tokens (TOP) tie above them. So every step's
ranking has beam * m tied candidates at the top (m = len(TOP)), in beam interleaved runs, and the
beam kept is decided by the tie rule alone. The expected slots and tokens are written out below
from the rule; the stepper records what the search fed it and how it reordered the rows.

Why these sizes: a row's ranking sorts beam * 2 * beam candidates. numpy's default sort
(quicksort: introsort, or a SIMD sort where the CPU has one) is not stable, but with up to 16
elements its introsort is an insertion sort, which is; the ties here are 32 to 512 candidates
in interleaved runs, where it is not (test_an_unstable_sort_would_reorder_these_ties checks
that), so a search that sorted unstably would keep other candidates and fail these tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from transformer_rosetta.decoding.search import Stepper, beam_search
from transformer_rosetta.spec.config import TransformerConfig

PAD, BOS, EOS = 3, 5, 2  # 0 is an ordinary token
SPECIAL = (EOS, PAD, BOS)
LOW = -50.0  # the specials' logit: never among a hypothesis' 2 * beam best
TOP = (299, 13)  # the tokens that tie above the rest from the second step on (any order)
SRC = np.array([[7, 8], [9, 10]])  # two rows of 2 tokens: each row's limit is 2 + extra_len
EXTRA_LEN = 2
LIMIT = 4  # new tokens per row: its 2 source tokens + EXTRA_LEN
SCORE_ATOL = 1e-12


def config(vocab: int) -> TransformerConfig:
    return TransformerConfig(
        src_vocab_size=16,
        tgt_vocab_size=vocab,
        d_model=4,
        num_heads=1,
        d_ff=4,
        num_encoder_layers=1,
        num_decoder_layers=1,
        max_len=64,
        dropout=0.0,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        share_embeddings=False,
    )


class TiedStepper:
    """Every row gets the same logits. The first step (after BOS): every ordinary token 0, the
    specials LOW. Every later step: the `top` tokens 0, the other ordinary tokens -1, the
    specials LOW. Records each step's tokens (`fed`) and each reorder's rows (`reordered`)."""

    def __init__(self, vocab: int, top: tuple[int, ...], rows: int, max_steps: int) -> None:
        self.vocab, self.top, self.rows, self.max_steps = vocab, top, rows, max_steps
        self.fed: list[list[int]] = []
        self.reordered: list[list[int]] = []

    def step(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        assert tokens.shape == (self.rows,) and len(self.fed) < self.max_steps
        logits = np.zeros(self.vocab) if not self.fed else np.full(self.vocab, -1.0)
        logits[list(self.top)] = 0.0
        logits[list(SPECIAL)] = LOW
        self.fed.append(tokens.tolist())
        return np.tile(logits, (self.rows, 1))

    def reorder(self, rows: np.ndarray) -> None:
        self.reordered.append(np.asarray(rows).tolist())


def run(vocab: int, beam: int, top: tuple[int, ...]) -> tuple[object, TiedStepper]:
    made: list[TiedStepper] = []

    def start(src: np.ndarray, beams: int, max_steps: int) -> TiedStepper:
        stepper = TiedStepper(vocab, top, src.shape[0] * beams, max_steps)
        assert isinstance(stepper, Stepper)
        made.append(stepper)
        return stepper

    got = beam_search(start, config(vocab), SRC, beam=beam, extra_len=EXTRA_LEN)
    return got, made[0]


def expected_path(vocab: int, beam: int, top: tuple[int, ...]) -> tuple[list, list]:
    """(fed, reordered) as the tie rule decides them, for each source row's `beam` slots.

    Step 1: only slot 0 is live (BOS); its extensions all tie, so the beam is slot 0 extended by
    the `beam` lowest ordinary ids, in id order. Every later step: every slot is live with the
    same log-probability, and the m top tokens of every slot tie: in order of slot * V + token,
    slot 0's m (lowest id first), then slot 1's, ...; the first `beam` are kept, so new slot j
    continues old slot j // m with the (j % m)-th lowest top token. The last step ends the
    search at the limit, with no reorder after it."""
    m = len(top)
    ordinary = [t for t in range(vocab) if t not in SPECIAL]
    fed = [[BOS] * beam, ordinary[:beam]]
    reordered = [[0] * beam]
    for _ in range(LIMIT - 2):
        reordered.append([j // m for j in range(beam)])
        fed.append([sorted(top)[j % m] for j in range(beam)])
    rows = len(SRC)
    fed = [[t for _ in range(rows) for t in step] for step in fed]
    reordered = [[b * beam + r for b in range(rows) for r in step] for step in reordered]
    return fed, reordered


CASES = [
    pytest.param(vocab, beam, top, id=f"V{vocab}-beam{beam}-m{len(top)}")
    for vocab in (300, 1000)
    for beam in (4, 8, 16)
    for top in (TOP, TOP[:1])  # m = 2: slots, then ids; m = 1: one per slot, in slot order
]


@pytest.mark.parametrize(("vocab", "beam", "top"), CASES)
def test_tied_candidates_are_kept_lowest_slot_then_lowest_id(vocab, beam, top):
    """The whole beam at every step: which old slot each new slot continues (the reorder) and
    with which token (what the next step is fed), for both source rows."""
    got, stepper = run(vocab, beam, top)
    fed, reordered = expected_path(vocab, beam, top)
    assert stepper.reordered == reordered
    assert stepper.fed == fed


@pytest.mark.parametrize(("vocab", "beam", "top"), CASES)
def test_the_answer_among_tied_hypotheses_is_the_first_by_the_rule(vocab, beam, top):
    """Every hypothesis at the limit has the same score; the answer is the first found, slot 0:
    the lowest ordinary id (0), then the lowest top token each step. Its score is log P / lp with
    the probabilities written out: first 1 / (n + 3 e^-50) for n ordinary tokens, then
    1 / (m + (n - m) e^-1 + 3 e^-50) for each of the other LIMIT - 1 tokens."""
    got, _ = run(vocab, beam, top)
    n, m = vocab - len(SPECIAL), len(top)
    first = -math.log(n + 3 * math.exp(LOW))
    then = -math.log(m + (n - m) * math.exp(-1.0) + 3 * math.exp(LOW))
    score = (first + (LIMIT - 1) * then) / ((5 + LIMIT) / 6) ** 0.6
    for row in range(len(SRC)):
        assert got.tokens[row].tolist() == [0] + [min(top)] * (LIMIT - 1)
        assert abs(got.scores[row] - score) <= SCORE_ATOL
    assert got.finished.tolist() == [False, False]  # ended by the limit, not by EOS


@pytest.mark.parametrize(("vocab", "beam", "top"), CASES)
def test_an_unstable_sort_would_reorder_these_ties(vocab, beam, top):
    """The tests above can tell a stable ranking from numpy's default, unstable one: on the
    ranking one of these steps sorts (each slot's 2 * beam best, m tied at the top and the rest
    tied below, one run per slot), quicksort puts another candidate among the first `beam`."""
    m = len(top)
    n = vocab - len(SPECIAL)
    top_logp = -math.log(m + (n - m) * math.exp(-1.0) + 3 * math.exp(LOW))
    per_slot = np.r_[np.full(m, top_logp), np.full(2 * beam - m, top_logp - 1.0)]
    ranked = -np.tile(per_slot, beam)  # the search sorts -total, lowest first
    stable = np.argsort(ranked, kind="stable")[:beam]
    assert stable.tolist() == [(j // m) * 2 * beam + j % m for j in range(beam)]
    assert np.argsort(ranked, kind="quicksort")[:beam].tolist() != stable.tolist()
