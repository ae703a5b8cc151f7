"""Greedy generation with and without stopping at EOS (generate_ids, what `rosetta generate` and
the API's generate call), in every framework, cached and uncached, against the oracle's own
greedy continuation computed here by hand: an argmax loop over the float64 numpy oracle's
forward on the prompt and the tokens so far.

The model and prompts are chosen so that the flag matters: under the tiny decoder-only preset's
perturbed weights of seed 5, the first prompt's greedy path emits EOS at its 4th new token and
goes on with other tokens after it, while the second prompt's path holds no EOS in its first
MAX_NEW tokens. So stop_at_eos=False must return exactly MAX_NEW tokens for both rows (EOS fed
back as any other token, the path after it the oracle's), and stop_at_eos=True must stop the
first row at its EOS (returned, as transformers' generate returns it) and leave the second whole.
(Issue 42: greedy ignoring stop_at_eos=False survived, since only sampling exercised the flag.)

Bound. Every framework's float32 logits are within atol_for("float32") = 1e-5 of the float64
oracle's on the tiny configs (the forward parity grid, impl/test_backend_vs_oracle.py), so each
log-softmax value moves by at most 2 * atol and a greedy decision whose float64 top-1 minus
top-2 log-probability exceeds 4 * atol is taken alike by every framework (decoding/test_parity.py's
argument). The test asserts that margin at every step of both paths before comparing tokens; the
numpy backend (float64, the oracle's own arithmetic through its stepper) meets it trivially.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.app.generation import generate_ids
from transformer_rosetta.decoding.search import greedy_search, log_softmax
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny_decoder_only")
WEIGHT_SEED = 5
# One length, so that generate_ids decodes both rows in one batch: the row that is done at its
# EOS keeps feeding a filler while the other goes on.
PROMPTS = [[18, 6, 28], [36, 40, 27]]
EOS_ROW, EOS_STEP = 0, 3  # the first prompt's 4th new token is EOS
MAX_NEW = 8
MARGIN = 4 * atol_for("float32")  # a decision no float32 framework within the bound can swap
FRAMEWORKS = ["numpy", *IMPLEMENTATIONS]


@pytest.fixture(scope="module")
def weights():
    return init_weights(CONFIG, seed=WEIGHT_SEED, scheme="perturbed")


@pytest.fixture(scope="module")
def oracle_paths(weights):
    """Each prompt's greedy continuation of MAX_NEW tokens (EOS fed back like any token), by
    hand: the float64 oracle's full forward on prompt + tokens so far, its last position's
    argmax (ties would go to the lower id; none is near, see the margins), and the smallest
    top-1 minus top-2 log-probability along each path."""
    oracle = get_backend("numpy").build(CONFIG, weights)
    paths, margins = [], []
    for prompt in PROMPTS:
        sequence, tokens, smallest = list(prompt), [], np.inf
        for _ in range(MAX_NEW):
            logits = oracle.forward(None, np.array([sequence], dtype=np.int64)).logits
            log_probs = log_softmax(logits[0, -1])
            top2 = np.sort(log_probs)[-2:]
            smallest = min(smallest, float(top2[1] - top2[0]))
            token = int(np.argmax(log_probs))
            tokens.append(token)
            sequence.append(token)
        paths.append(tokens)
        margins.append(smallest)
    # The premises: the first path meets EOS early and goes on with other tokens; the second
    # never meets it; every decision is clear of float32's bound.
    assert paths[EOS_ROW].index(CONFIG.eos_id) == EOS_STEP
    assert set(paths[EOS_ROW][EOS_STEP + 1 :]) - {CONFIG.eos_id}
    assert CONFIG.eos_id not in paths[1]
    assert min(margins) > MARGIN, margins
    return paths


@pytest.fixture(scope="module", params=FRAMEWORKS)
def model(request, weights):
    backend_or_skip(request.param)
    return get_backend(request.param).build(CONFIG, weights)  # float32 (numpy: float64)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_greedy_without_stopping_returns_max_new_tokens_the_oracles(model, oracle_paths, cached):
    got = generate_ids(
        model, PROMPTS, max_new_tokens=MAX_NEW, strategy="greedy", cached=cached, stop_at_eos=False
    )
    assert got == oracle_paths
    assert [len(row) for row in got] == [MAX_NEW, MAX_NEW]


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_greedy_stopping_at_eos_ends_that_row_there(model, oracle_paths, cached):
    got = generate_ids(
        model, PROMPTS, max_new_tokens=MAX_NEW, strategy="greedy", cached=cached, stop_at_eos=True
    )
    assert got[EOS_ROW] == oracle_paths[EOS_ROW][: EOS_STEP + 1]  # through its EOS
    assert got[EOS_ROW][-1] == CONFIG.eos_id
    assert got[1] == oracle_paths[1]  # the other row of the batch goes on to its limit
    # The default is to stop.
    assert generate_ids(model, PROMPTS, max_new_tokens=MAX_NEW, cached=cached) == got


def test_greedy_search_itself_reports_no_row_finished_without_stopping(weights, oracle_paths):
    """The search under generate_ids (common/decoding/search.py): with stop_at_eos=False no
    row is reported ended by EOS, and EOS stays among the tokens; with True the first row is
    ended and its EOS dropped (Decoded's tokens never hold the EOS that ended them)."""
    model = get_backend("numpy").build(CONFIG, weights)
    src = np.array(PROMPTS, dtype=np.int64)
    free = greedy_search(model.stepper, CONFIG, src, extra_len=MAX_NEW, stop_at_eos=False)
    assert [t.tolist() for t in free.tokens] == oracle_paths
    assert not free.finished.any()
    stopped = greedy_search(model.stepper, CONFIG, src, extra_len=MAX_NEW)
    assert stopped.tokens[EOS_ROW].tolist() == oracle_paths[EOS_ROW][:EOS_STEP]
    assert stopped.finished.tolist() == [True, False]
