"""Decoding with special ids that are not the defaults: pad 3, BOS 4, EOS 5 (grid.OTHER_IDS), so
that 0 is an ordinary token and a literal 0 (or 1, 2) written where the config's id belongs shows.

With pad 0 everywhere, a mask or a length count built with a literal 0 gives the right answer by
coincidence. Here, in every framework's cached and uncached stepper, in the search's row limits
and in the parity grid (a third of it has these ids, grid.variant), id 0 appears as a real token
and the pad appears mid-sequence, in the source and among the fed tokens.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from parity_tests.grid import FULL_GRID, OTHER_IDS, PAIRWISE_GRID, input_cases
from transformer_rosetta.adapter.reference_backend import PrefixStepper
from transformer_rosetta.app.tasks import get_task
from transformer_rosetta.decoding.search import beam_search, greedy_search, log_softmax, row_limits
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

PAD, BOS, EOS = OTHER_IDS["pad_id"], OTHER_IDS["bos_id"], OTHER_IDS["eos_id"]
# Post-norm, concatenated sinusoids, a target table tied to the output, attention biases; and
# pre-norm with final norms, learned positions, an untied output with its bias.
CONFIGS = {
    "post-tied": FULL_GRID["post-gelu-sin-concatenated-tied-bias"],
    "pre-untied": FULL_GRID["pre-gelu-learned-untied-nobias"],
}
# float64 through both paths; float32 through the cache only (the uncached path is the forward
# pass's decoder, which the grid covers). Each case costs JAX a compile per shape, hence few.
CASES = [
    pytest.param("post-tied", "float64", (True, False), id="post-tied-float64"),
    pytest.param("pre-untied", "float32", (True,), id="pre-untied-float32-cached"),
]
# Three sources: 0 as a real token and a pad between real ones; a pad mid-way then padding; all
# padding (cross-attention with no key).
SRC = np.array(
    [
        [0, 7, PAD, 0, 9, 11],
        [6, 0, 8, PAD, 10, PAD],
        [PAD, PAD, PAD, PAD, PAD, PAD],
    ]
)
BEAMS = 2
# (steps, rows) tokens fed: BOS, then 0 as a token, pad fed mid-way (step 3 in every row, step 2
# in row 1), EOS fed as an ordinary token, and the default ids 1 and 2 (ordinary here).
FED = np.array(
    [
        [BOS] * 6,
        [0, 6, 1, 0, 2, 7],
        [8, PAD, 0, 9, 0, 1],
        [PAD] * 6,
        [0, EOS, 2, 0, 6, 0],
        [1, 0, 0, 7, PAD, 9],
    ]
)
# Reorders after steps 2 (a permutation across sources) and 4 (beam search's duplicating gather).
REORDERS = {2: np.array([3, 0, 5, 1, 4, 2]), 4: np.array([1, 1, 0, 4, 4, 3])}


def test_the_case_has_what_it_claims():
    for c in CONFIGS.values():
        assert (c.pad_id, c.bos_id, c.eos_id) == (PAD, BOS, EOS)
        assert PAD != 0 and BOS not in (0, PAD)
    inner = SRC[:, 1:-1]
    assert (inner == PAD).any() and (SRC == 0).any() and (SRC[-1] == PAD).all()
    assert (FED[1:] == 0).any() and (FED[1:-1] == PAD).any() and (FED[1:] == EOS).any()


def test_the_grid_runs_these_ids_with_zero_as_a_token_and_a_pad_mid_sequence():
    """A third of the grid (the GELU configs) has pad 3, BOS 4, EOS 5; so do three of the nine
    pairwise configs (compiled modes, pairs, bfloat16, training). In their ragged inputs, 0 is a
    token and the pad sits between real tokens."""
    other = [k for k, c in FULL_GRID.items() if (c.pad_id, c.bos_id, c.eos_id) == (PAD, BOS, EOS)]
    assert len(other) == len(FULL_GRID) // 3
    assert sum(c.pad_id == PAD for c in PAIRWISE_GRID.values()) == 3
    for key in other:
        src, tgt_in = input_cases(FULL_GRID[key])["ragged"]
        for ids in (src, tgt_in):
            assert ids[0, 2] == 0 and ids[0, 3] == PAD and ids[0, 4] != PAD


def test_row_limits_count_every_non_pad_token_including_zero():
    c = CONFIGS["post-tied"]
    # Non-pad tokens per row: 5 (both 0s count, the pad between them does not), 4, 0.
    assert row_limits(c, SRC, 2).tolist() == [7, 6, 2]
    learned = CONFIGS["pre-untied"]  # learned positions stop the decoder at max_len = 16
    assert row_limits(learned, SRC, 11).tolist() == [16, 15, 11]
    src = np.array([[0, 0, PAD], [PAD, 0, PAD]])
    assert row_limits(c, src, 50).tolist() == [52, 51]


def test_the_numbers_task_declares_the_ids_its_tokenizers_use():
    """The task's ids come from its vocabularies (pad, BOS, EOS first), declared in its config,
    and its batches are padded with that pad id and end targets with that EOS id."""
    task = get_task("numbers")
    c = task.config()
    for tokenizer in (task.source, task.target):
        assert [tokenizer.vocab[i] for i in (c.pad_id, c.bos_id, c.eos_id)] == [
            "<pad>",
            "<s>",
            "</s>",
        ]
    # '7' is id 3 + 7 = 10 ('0' is 3, after the three special ids), '105' is 4, 3, 8.
    assert task.encode_sources(["7", "105"]).tolist() == [[10, c.pad_id, c.pad_id], [4, 3, 8]]
    seven, seventy_one = task.target.encode("seven"), task.target.encode("seventy-one")
    assert len(seven) == 1 and len(seventy_one) == 3  # "seventy", "-", "one"
    assert task.target_ids(["seven", "seventy-one"]).tolist() == [
        [*seven, c.eos_id, c.pad_id, c.pad_id],
        [*seventy_one, c.eos_id],
    ]


def run(stepper, fed_rows: np.ndarray) -> list[np.ndarray]:
    """Feed FED through `stepper` with REORDERS; each step's logits."""
    out = []
    for t, tokens in enumerate(fed_rows):
        out.append(np.asarray(stepper.step(tokens), np.float64))
        if t in REORDERS:
            stepper.reorder(REORDERS[t])
    return out


@pytest.mark.parametrize(("config_id", "dtype", "paths"), CASES)
def test_cached_and_uncached_steps_match_the_oracle(backend, config_id, dtype, paths):
    """Every step's logits, cached and uncached, against the oracle's PrefixStepper (which re-runs
    the decoder over the whole prefix) within atol_for(dtype)."""
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")
    c = CONFIGS[config_id]
    weights = init_weights(c, seed=2, scheme="perturbed", dtype=dtype)
    oracle_weights = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    want = run(PrefixStepper(oracle_weights, c, SRC, BEAMS), FED)
    model = backend.build(c, weights, dtype=dtype)
    atol = atol_for(dtype, c)
    for cached in paths:
        got = run(model.stepper(SRC, BEAMS, len(FED) + 1, cached=cached), FED)
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            diff = float(np.max(np.abs(g - w)))
            assert diff <= atol, f"cached={cached}, step {t}: off by {diff:.3g} > {atol:g}"


def test_fed_pad_and_zero_change_the_logits_as_the_oracle_says():
    """The premise of the step test: in the oracle, feeding the pad mid-way is not the same as
    feeding 0 (a mask that took 0 for the pad would swap which of the two is hidden)."""
    c = CONFIGS["post-tied"]
    weights = init_weights(c, seed=2, scheme="perturbed")
    fed = FED.copy()
    fed[3] = 0  # 0 instead of the pad at step 3
    a = run(PrefixStepper(weights, c, SRC, BEAMS), FED)
    b = run(PrefixStepper(weights, c, SRC, BEAMS), fed)
    assert np.max(np.abs(a[4] - b[4])) > 1e-2


def test_search_gives_the_oracles_tokens(backend):
    """float64 greedy and beam search (beam 2: reorders, done rows fed the pad) through each
    framework's cache give the oracle's tokens and scores (1e-9: see decoding/test_parity.py). The
    smallest greedy top-1 margin is far above float64 noise, so equal tokens mean something."""
    c = CONFIGS["post-tied"]
    weights = init_weights(c, seed=5, scheme="perturbed")
    oracle = PrefixStepperModel(c, weights)
    model = backend.build(c, weights, dtype="float64")
    for search in (greedy_search, partial(beam_search, beam=2)):
        want = search(oracle.stepper, c, SRC, extra_len=4)
        if search is greedy_search:
            assert oracle.smallest_margin(SRC, want.tokens) > 1e-10
        got = search(model.stepper, c, SRC, extra_len=4)
        for row in range(SRC.shape[0]):
            assert got.tokens[row].tolist() == want.tokens[row].tolist(), (search, row)
        np.testing.assert_array_equal(got.finished, want.finished)
        np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-9)


class PrefixStepperModel:
    """The oracle as a StepperFactory, with the greedy margins along a decoded sequence."""

    def __init__(self, c: TransformerConfig, weights: dict[str, np.ndarray]) -> None:
        self.config, self.weights = c, weights

    def stepper(self, src: np.ndarray, beams: int, max_steps: int) -> PrefixStepper:
        return PrefixStepper(self.weights, self.config, src, beams)

    def smallest_margin(self, src: np.ndarray, tokens: list[np.ndarray]) -> float:
        margins = []
        for row, toks in enumerate(tokens):
            stepper = self.stepper(src[row : row + 1], 1, len(toks) + 1)
            feed = self.config.bos_id
            for tok in [*toks.tolist(), self.config.eos_id]:
                lp = np.sort(log_softmax(stepper.step(np.array([feed])))[0])
                margins.append(lp[-1] - lp[-2])
                feed = tok
        return float(min(margins))
