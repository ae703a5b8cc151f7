"""The search policy of common/decoding/search.py, driven by a scripted model: for each source row, a table
of next-token probabilities per prefix, written by hand, so that every branch of greedy and beam
search is reached on purpose and every expected answer is reasoned out here, not computed by the
code under test.

Untrained models rarely say EOS and never tie, so the other search tests (decoding/test_search.py, beam 64
against enumeration) do not reach early stopping, length-penalty trade-offs or ties. A script
does: each case below says which branch it drives and why its answer is the right one.

The script's ids make no id special by accident: pad 3, BOS 5, EOS 2, and 0 is an ordinary
token. Logits are log-probabilities, so log_softmax returns them to ~1e-16; scores are compared
within SCORE_ATOL = 1e-12 (a sum of at most 52 such values).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from transformer_rosetta.decoding.search import Stepper, beam_search, greedy_search
from transformer_rosetta.spec.config import TransformerConfig

SCORE_ATOL = 1e-12
PAD, BOS, EOS = 3, 5, 2
CONFIG = TransformerConfig(
    src_vocab_size=8,
    tgt_vocab_size=8,
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
)
VOCAB = CONFIG.tgt_vocab_size
# After a prefix that a script does not list, the model says EOS with this probability.
END_P = 0.9

Dist = dict[int, float]  # token -> probability; unlisted tokens share what is left, evenly
Script = dict[tuple[int, ...] | None, Dist]  # prefix (tokens after BOS) -> next token; None: else


def distribution(probs: Dist) -> np.ndarray:
    """All VOCAB probabilities: the listed ones, and the rest shared evenly by the others (always
    some, as no real model gives a token probability 0)."""
    rest = 1.0 - sum(probs.values())
    assert rest > 0 and len(probs) < VOCAB
    p = np.full(VOCAB, rest / (VOCAB - len(probs)))
    for token, prob in probs.items():
        p[token] = prob
    return p


class ScriptedStepper:
    """A Stepper whose row r follows the script named by its source row's first id. It checks
    the contract a framework's stepper relies on: BOS first, at most max_steps steps, one token
    per row, reorders within range. `fed` records every step's tokens (after reorders)."""

    def __init__(
        self, scripts: dict[int, Script], src: np.ndarray, beams: int, max_steps: int
    ) -> None:
        self.scripts, self.max_steps = scripts, max_steps
        self.script = [int(src[r // beams, 0]) for r in range(src.shape[0] * beams)]
        self.prefixes: list[list[int]] = [[] for _ in self.script]
        self.fed: list[np.ndarray] = []

    def step(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        assert tokens.shape == (len(self.script),) and tokens.dtype == np.int64
        assert len(self.fed) < self.max_steps, "more steps than max_steps"
        if not self.fed:
            assert np.all(tokens == BOS), "the first step must feed BOS"
        self.fed.append(tokens.copy())
        logits = []
        for row, token in enumerate(tokens):
            self.prefixes[row].append(int(token))
            script = self.scripts[self.script[row]]
            after = tuple(self.prefixes[row][1:])
            logits.append(np.log(distribution(script.get(after, script[None]))))
        return np.array(logits)

    def reorder(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        assert rows.shape == (len(self.script),) and 0 <= rows.min() and rows.max() < len(rows)
        self.script = [self.script[r] for r in rows]
        self.prefixes = [list(self.prefixes[r]) for r in rows]


def starter(
    scripts: dict[int, Script], made: list[ScriptedStepper] | None = None
) -> Callable[[np.ndarray, int, int], ScriptedStepper]:
    """A StepperFactory over `scripts`; each stepper it makes is appended to `made`."""

    def start(src: np.ndarray, beams: int, max_steps: int) -> ScriptedStepper:
        stepper = ScriptedStepper(scripts, src, beams, max_steps)
        assert isinstance(stepper, Stepper)
        if made is not None:
            made.append(stepper)
        return stepper

    return start


def gnmt(length: int, alpha: float = 0.6) -> float:
    """GNMT's length penalty, written out here: ((5 + |Y|) / 6)^alpha (Wu et al. 2016, Eq. 14)."""
    return ((5 + length) / 6) ** alpha


def enumerate_best(script: Script, limit: int, alpha: float) -> tuple[float, list[int], bool]:
    """The best of every hypothesis up to `limit` tokens, by brute force over the script:
    (score, tokens without EOS, ended by EOS)."""
    best = (-math.inf, [], False)
    for length in range(1, limit + 1):
        for seq in itertools.product(range(VOCAB), repeat=length):
            if EOS in seq[:-1] or (seq[-1] != EOS and length < limit):
                continue
            logp = sum(
                math.log(distribution(script.get(seq[:t], script[None]))[seq[t]])
                for t in range(length)
            )
            ended = seq[-1] == EOS
            score = logp / gnmt(length, alpha)
            if score > best[0]:
                best = (score, list(seq[:-1] if ended else seq), ended)
    return best


# -- greedy -------------------------------------------------------------------------------------


def test_greedy_takes_the_lowest_id_among_exact_ties():
    # Step 1: ids 7 and 1 tie at 0.3; step 2: ids 7 and 0 tie at 0.4; then EOS. The lowest id
    # wins both ties, and 0 is an ordinary token here (pad is 3).
    script = {(): {7: 0.3, 1: 0.3}, (1,): {7: 0.4, 0: 0.4}, (1, 0): {EOS: 0.8}, None: {EOS: END_P}}
    got = greedy_search(starter({6: script}), CONFIG, np.array([[6, PAD]]), extra_len=4)
    assert got.tokens[0].tolist() == [1, 0]
    assert got.finished.tolist() == [True]
    assert abs(got.scores[0] - math.log(0.3 * 0.4 * 0.8)) <= SCORE_ATOL


def test_greedy_eos_on_the_first_step_gives_an_empty_translation():
    script = {(): {EOS: 0.7}, None: {EOS: END_P}}
    got = greedy_search(starter({6: script}), CONFIG, np.array([[6, 1, 4]]), extra_len=4)
    assert got.tokens[0].tolist() == [] and got.finished.tolist() == [True]
    assert abs(got.scores[0] - math.log(0.7)) <= SCORE_ATOL
    assert got.padded(PAD).tolist() == [[PAD]]


# Four source rows that end at different steps: row 0 says EOS at once, row 1 after one token,
# rows 2 and 3 never (0 at probability 0.9 every step) and run to their limits. The limits are
# the non-pad source lengths (1, 2, 3 and 1: 0 and 1 are ordinary ids, 3 is pad) + extra_len 2:
# row 3 stops at 3 tokens while row 2 goes on to 5.
ROWS_SCRIPTS = {
    6: {(): {EOS: 0.8}, None: {EOS: END_P}},
    7: {(): {1: 0.9}, (1,): {EOS: 0.9}, None: {EOS: END_P}},
    0: {None: {0: 0.9}},
}
ROWS_SRC = np.array([[6, PAD, PAD], [7, 1, PAD], [0, 0, 1], [0, PAD, PAD]])


def test_greedy_rows_finish_at_different_steps():
    made: list[ScriptedStepper] = []
    got = greedy_search(starter(ROWS_SCRIPTS, made), CONFIG, ROWS_SRC, extra_len=2)
    assert [t.tolist() for t in got.tokens] == [[], [1], [0, 0, 0, 0, 0], [0, 0, 0]]
    assert got.finished.tolist() == [True, True, False, False]
    want = [math.log(0.8), 2 * math.log(0.9), 5 * math.log(0.9), 3 * math.log(0.9)]
    np.testing.assert_allclose(got.scores, want, rtol=0, atol=SCORE_ATOL)
    # One stepper for the batch, sized for the longest limit (5), all of it used; a row that is
    # done is fed the pad id (a key every framework masks) and nothing reads its logits.
    (stepper,) = made
    assert stepper.max_steps == 5 and len(stepper.fed) == 5
    fed = np.array(stepper.fed)  # (steps, rows)
    assert np.all(fed[1:, 0] == PAD) and np.all(fed[2:, 1] == PAD)
    assert fed[1:, 2].tolist() == [0, 0, 0, 0] and fed[1:, 3].tolist() == [0, 0, PAD, PAD]


def test_greedy_default_length_limit_is_source_length_plus_50():
    # Section 6.1: "maximum output length to input length + 50". The script never says EOS.
    script = {None: {0: 0.9}}
    src = np.array([[6, 0, PAD, PAD]])  # two non-pad tokens (0 is ordinary)
    got = greedy_search(starter({6: script}), CONFIG, src)
    assert got.tokens[0].tolist() == [0] * 52 and got.finished.tolist() == [False]
    got = beam_search(starter({6: script}), CONFIG, src, beam=2)
    assert got.tokens[0].tolist() == [0] * 52 and got.finished.tolist() == [False]


# -- beam search --------------------------------------------------------------------------------


def test_beam_default_length_penalty_is_gnmt_alpha_0_6():
    """No alpha given. Short: EOS at once, log 0.4 = -0.916. Long: 1, 4, EOS with probability
    0.55 * 0.8 * 0.8 = 0.352, log -1.044, |Y| = 3 counting EOS: -1.044 / (8/6)^0.6 = -0.879.
    With alpha 0.6 the long one wins; with alpha 0 the short one would (-0.916 > -1.044), and any
    other alpha changes the score."""
    script = {(): {EOS: 0.4, 1: 0.55}, (1,): {4: 0.8}, (1, 4): {EOS: 0.8}, None: {EOS: END_P}}
    got = beam_search(starter({6: script}), CONFIG, np.array([[6]]), extra_len=4)
    assert got.tokens[0].tolist() == [1, 4] and got.finished.tolist() == [True]
    want = math.log(0.55 * 0.8 * 0.8) / ((5 + 3) / 6) ** 0.6
    assert abs(got.scores[0] - want) <= SCORE_ATOL
    assert abs(want - -0.87860) < 1e-5  # the number above, by hand
    # and it is the best hypothesis of all (the limit is 1 + 4 tokens)
    assert enumerate_best(script, 5, 0.6)[1:] == ([1, 4], True)


# Early stopping that must keep searching (beam 2, limit 1 + 3 = 4 tokens).
#   step 1: EOS 0.28 (finished, -1.273); 4 (0.40) and 1 (0.25) live.
#   step 2: 4 EOS = 0.4 * 0.6 = 0.24, finished: log 0.24 / lp(2) = -1.301, the 2nd best finished.
#           1 6 = 0.25 * 0.9 = 0.225 is the best live, log = -1.492.
#           Two finished and one live that can still win: its best possible score is
#           -1.492 / lp(4) = -1.170 > -1.301, so the search goes on. (Judged at its current length
#           instead, -1.492 / lp(2) = -1.360 <= -1.301, it would stop and return the empty
#           hypothesis, -1.273.)
#   step 3: 1 6 7 = 0.225 * 0.99, live; step 4, the limit: 1 6 7 0 = 0.225 * 0.99 * 0.99 = 0.2205:
#           log 0.2205 / lp(4) = -1.1853, better than -1.273: the long, unfinished one wins.
KEEP_SEARCHING = {
    (): {EOS: 0.28, 4: 0.40, 1: 0.25},
    (4,): {EOS: 0.6, 7: 0.35},
    (1,): {6: 0.9},
    (1, 6): {7: 0.99},
    (1, 6, 7): {0: 0.99},
    None: {EOS: END_P},
}


def test_beam_keeps_searching_while_a_live_hypothesis_can_still_win():
    src = np.array([[6, PAD]])  # one non-pad token: the limit is 1 + 3
    got = beam_search(starter({6: KEEP_SEARCHING}), CONFIG, src, beam=2, alpha=0.6, extra_len=3)
    assert got.tokens[0].tolist() == [1, 6, 7, 0]
    assert got.finished.tolist() == [False]  # ended by the limit, not by EOS
    want = math.log(0.25 * 0.9 * 0.99 * 0.99) / gnmt(4)
    assert abs(got.scores[0] - want) <= SCORE_ATOL
    assert abs(want - -1.18530) < 1e-5 and math.log(0.28) < want  # the numbers above, by hand
    # the comment's premise: at step 2, judged at lp(2) the live one looks beaten, at lp(4) not
    second_finished, live = math.log(0.4 * 0.6) / gnmt(2), math.log(0.25 * 0.9)
    assert live / gnmt(2) <= second_finished < live / gnmt(4)
    assert enumerate_best(KEEP_SEARCHING, 4, 0.6)[1:] == ([1, 6, 7, 0], False)


def test_beam_a_long_finished_hypothesis_beats_an_early_short_one():
    # As above, but the limit is 6 and 1 6 7 ends with EOS at length 4 (probability 0.99): the
    # short hypotheses finished first (EOS at step 1, -1.273; 4 EOS, -1.301), and the long
    # finished one, log(0.25 * 0.9 * 0.99 * 0.99) / lp(4) = -1.185, must still win.
    script = {**KEEP_SEARCHING, (1, 6, 7): {EOS: 0.99}}
    got = beam_search(starter({6: script}), CONFIG, np.array([[6, PAD]]), beam=2, extra_len=5)
    assert got.tokens[0].tolist() == [1, 6, 7] and got.finished.tolist() == [True]
    want = math.log(0.25 * 0.9 * 0.99 * 0.99) / ((5 + 4) / 6) ** 0.6
    assert abs(got.scores[0] - want) <= SCORE_ATOL


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_beam_eos_on_the_first_step_gives_an_empty_translation(beam):
    # EOS 0.7 at step 1, score log 0.7 = -0.357 (lp(1) = 1). Anything longer has probability at
    # most 0.3 * 0.9 (-1.31 before its penalty; lp(2) < 1.1): the empty hypothesis wins.
    script = {(): {EOS: 0.7}, None: {EOS: END_P}}
    got = beam_search(starter({6: script}), CONFIG, np.array([[6, 1, 4]]), beam=beam, extra_len=4)
    assert got.tokens[0].tolist() == [] and got.finished.tolist() == [True]
    assert abs(got.scores[0] - math.log(0.7)) <= SCORE_ATOL
    assert got.padded(PAD).tolist() == [[PAD]]


def test_beam_rows_finish_at_different_steps():
    # The rows of test_greedy_rows_finish_at_different_steps, beam 2. Row 0: EOS at once (0.8)
    # beats everything else (at most 0.2 * 0.9). Row 1: 1 EOS = 0.81 over |Y| = 2. Rows 2 and 3:
    # 0 to their limits 5 and 3: 0.9^5 over lp(5), 0.9^3 over lp(3); an EOS costs 0.1 / 7.
    made: list[ScriptedStepper] = []
    got = beam_search(starter(ROWS_SCRIPTS, made), CONFIG, ROWS_SRC, beam=2, extra_len=2)
    assert [t.tolist() for t in got.tokens] == [[], [1], [0, 0, 0, 0, 0], [0, 0, 0]]
    assert got.finished.tolist() == [True, True, False, False]
    want = [
        math.log(0.8),
        2 * math.log(0.9) / gnmt(2),
        5 * math.log(0.9) / gnmt(5),
        3 * math.log(0.9) / gnmt(3),
    ]
    np.testing.assert_allclose(got.scores, want, rtol=0, atol=SCORE_ATOL)
    (stepper,) = made
    assert stepper.max_steps == 5 and len(stepper.fed) == 5  # row 2 decodes to its limit
    # Row 0 (beam rows 0, 1) is done after step 2: EOS at once, then two more finished ones
    # (x EOS, at most log(0.2 / 7 * 0.9) / lp(2) = -3.34) while its best live hypothesis can
    # reach at most log(0.2 / 7 * 0.1 / 7) / lp(3) = -6.6. Row 1 (beam rows 2, 3) is done after
    # step 3 (1 EOS at step 2, then 1 x EOS at step 3). The step after a row is done still feeds
    # the live tokens it had kept; from the next one on, it is fed pad.
    fed = np.array(stepper.fed)
    assert np.all(fed[3:, 0:2] == PAD) and np.all(fed[4:, 2:4] == PAD)
    assert not np.any(fed[:3, 0:2] == PAD) and not np.any(fed[:4, 2:4] == PAD)
    assert np.all(fed[1:, 4] == 0)  # row 2's best beam feeds 0 to the end
    assert np.all(fed[1:4, 6] == 0) and np.all(fed[4:, 6:8] == PAD)  # row 3: done at its limit


def test_beam_exact_ties_go_to_the_lowest_id():
    # Step 1: ids 7, 6, 1 and 0 tie at 0.2 (EOS 0.1); beam 2 keeps the two lowest ids, 0 and 1
    # (beam 4 keeps all four, in the order 0, 1, 6, 7). Step 2: each says EOS at 0.5, so the
    # finished ones tie exactly at log(0.2 * 0.5) / lp(2), the best score there is (EOS at once
    # scores log 0.1), and the first found, 0, wins.
    script = {
        (): {7: 0.2, 6: 0.2, 1: 0.2, 0: 0.2, EOS: 0.1},
        (0,): {EOS: 0.5},
        (1,): {EOS: 0.5},
        (6,): {EOS: 0.5},
        (7,): {EOS: 0.5},
        None: {EOS: END_P},
    }
    for beam in (2, 4):
        got = beam_search(
            starter({6: script}), CONFIG, np.array([[6, PAD]]), beam=beam, extra_len=3
        )
        assert got.tokens[0].tolist() == [0], beam
        assert abs(got.scores[0] - math.log(0.2 * 0.5) / gnmt(2)) <= SCORE_ATOL


def test_beam_ties_between_live_hypotheses_keep_the_lowest_beam_and_id_first():
    """Which of several exactly tied candidates stay live decides the answer here.

    Step 1: 1 and 4 tie at 0.4: 1 takes the first slot, 4 the second (EOS, at 0.2 / 6, finishes
    with log(1/30) = -3.4). Step 2: both slots give 0, 6 and 7 at 0.3 each: six candidates tie
    exactly at log 0.12, and the two live ones are the first by (slot, id): 1 0 and 1 6. Step 3:
    1 0 says EOS at 0.5, 1 6 at 0.9; 1 7 and every 4 x would say it at 0.95, but are not live.
    So the answer is 1 6: log(0.4 * 0.3 * 0.9) / lp(3). Any other order among the ties keeps
    another pair and returns another answer (an unstable sort kept 1 7 in a trial run)."""
    script = {
        (): {1: 0.4, 4: 0.4},
        (1,): {0: 0.3, 6: 0.3, 7: 0.3},
        (4,): {0: 0.3, 6: 0.3, 7: 0.3},
        (1, 0): {EOS: 0.5},
        (1, 6): {EOS: 0.9},
        (1, 7): {EOS: 0.95},
        (4, 0): {EOS: 0.95},
        (4, 6): {EOS: 0.95},
        (4, 7): {EOS: 0.95},
        None: {EOS: END_P},
    }
    got = beam_search(starter({6: script}), CONFIG, np.array([[6, PAD]]), beam=2, extra_len=3)
    assert got.tokens[0].tolist() == [1, 6] and got.finished.tolist() == [True]
    assert abs(got.scores[0] - math.log(0.4 * 0.3 * 0.9) / gnmt(3)) <= SCORE_ATOL
