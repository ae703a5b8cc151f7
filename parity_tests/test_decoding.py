"""Decoding parity across frameworks: greedy and beam search (common/decoding/search.py, written once)
driven by each framework's own key/value cache give the oracle's tokens, and cached equals
uncached.

Two models, and why each makes token identity a meaningful check:
- float64, an untrained tiny model (perturbed init): the frameworks' logits agree to ~1e-14, so
  any decision whose margin exceeds 1e-10 is decided alike; the test asserts the oracle's smallest
  greedy top-1 margin is above that, and then asks for identical tokens and scores within 1e-9.
- float32, a model trained on the "numbers" task (common/app/tasks.py; trained here in torch, 400
  steps): logits agree to ~1e-5 (common/spec/tolerances.py), and the trained model's greedy decisions
  have a top-1 margin above 1e-2 (asserted), three orders of magnitude clear of it.

Score bounds: a score is a sum of L log-softmax values; each moves by at most 2 * atol when every
logit moves by at most atol, so |score difference| <= 2 * L * atol (beam: divided by lp >= 1).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from common.adapter.backends import get_backend
from common.app.tasks import get_task
from common.app.trainer import train
from common.decoding.search import beam_search, greedy_search, log_softmax
from common.spec.config import preset
from common.spec.tolerances import atol_for
from common.weights.init import init_weights
from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip

TASK = get_task("numbers")
TRAINED_MARGIN = 1e-2  # smallest greedy top-1 margin the trained model must show
F64_MARGIN = 1e-10


@pytest.fixture(scope="module")
def trained():
    """(config, float32 weights) of a small model trained on the numbers task in torch."""
    backend = backend_or_skip("torch")
    config = TASK.config()
    model = backend.build(config, init_weights(config, seed=0), dtype="float32")
    train(model, TASK, 400, seed=0)
    return config, model.export()


def sources(texts):
    return TASK.encode_sources(texts)


def greedy_margins(model, config, src, tokens):
    """The oracle's top-1 minus top-2 log-probability at every greedy decision along `tokens`."""
    margins = []
    for row, toks in enumerate(tokens):
        stepper = model.stepper(src[row : row + 1], 1, len(toks) + 1)
        feed = config.bos_id
        for tok in [*toks.tolist(), config.eos_id]:
            lp = np.sort(log_softmax(stepper.step(np.array([feed])))[0])
            margins.append(lp[-1] - lp[-2])
            feed = tok
    return np.array(margins)


def decode_all(model, config, src, cached, beam, extra_len=50):
    start = partial(model.stepper, cached=cached)
    if beam == 1:
        return greedy_search(start, config, src, extra_len=extra_len)
    return beam_search(start, config, src, beam=beam, extra_len=extra_len)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("beam", [1, 4])
def test_float64_search_gives_the_oracles_tokens_cached_and_uncached(framework, beam):
    config = preset("tiny").replace(max_len=64)
    weights = init_weights(config, seed=5, scheme="perturbed")
    src = np.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 0, 0, 0, 0]])
    oracle = get_backend("numpy").build(config, weights)
    # An untrained model rarely says EOS: a short limit keeps JAX's uncached path, which
    # compiles once per prefix length, quick.
    want = decode_all(oracle, config, src, True, beam, extra_len=6)
    if beam == 1:
        assert greedy_margins(oracle, config, src, want.tokens).min() > F64_MARGIN
    model = backend_or_skip(framework).build(config, weights, dtype="float64")
    for cached in (True, False):
        got = decode_all(model, config, src, cached, beam, extra_len=6)
        for row in range(src.shape[0]):
            assert got.tokens[row].tolist() == want.tokens[row].tolist(), (cached, row)
        np.testing.assert_array_equal(got.finished, want.finished)
        np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_trained_float32_greedy_and_beam_give_the_oracles_tokens(trained, framework):
    config, weights = trained
    texts = [src for src, _ in TASK.test_pairs()[:12]] + ["7", "13", "80", "105"]
    src = sources(texts)
    oracle = get_backend("numpy").build(config, weights)
    model = backend_or_skip(framework).build(config, weights, dtype="float32")
    atol = atol_for("float32", config)
    for beam in (1, 4):
        want = decode_all(oracle, config, src, True, beam)
        if beam == 1:
            assert greedy_margins(oracle, config, src, want.tokens).min() > TRAINED_MARGIN
            # and it has learnt: after 400 steps a good part is right (untrained: none)
            right = [
                TASK.target.decode(t) == TASK.reference(s)
                for t, s in zip(want.tokens, texts, strict=True)
            ]
            assert sum(right) >= len(texts) // 4
        for cached in (True, False):
            got = decode_all(model, config, src, cached, beam)
            for row in range(src.shape[0]):
                assert got.tokens[row].tolist() == want.tokens[row].tolist(), (beam, cached, row)
                length = len(want.tokens[row]) + int(want.finished[row])
                assert abs(got.scores[row] - want.scores[row]) <= 2 * length * atol
