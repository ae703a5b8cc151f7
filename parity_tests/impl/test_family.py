"""The two halves of the family (docs/FORMAT.md, "The three kinds") beyond the forward grid
(impl/test_halves_vs_oracle.py, FAMILY_GRID): a decoder-only model decodes a prompt and trains at
parity in every framework; an encoder-only model refuses both, by name.

Bounds, as for the encoder-decoder (decoding/test_parity.py, impl/test_training.py, whose derivations apply
unchanged: the same sums in the same dtypes): float64 tokens identical to the oracle's with
scores within 1e-9 once the oracle's smallest greedy margin is above 1e-10; loss 1e-10 and
gradients 1e-9 between frameworks in float64; finite differences 1e-6; float32 gradients 1e-6
and 20-step losses 5e-6 pairwise.
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.impl.test_training import (
    ARGMAX_MARGIN_F64,
    GRAD_ATOL_F32,
    LOSS_ATOL_F32,
    argmax_margin,
)
from transformer_rosetta.adapter.backends import get_backend
from transformer_rosetta.decoding.search import beam_search, greedy_search, log_softmax
from transformer_rosetta.errors import InputError
from transformer_rosetta.oracle.training import oracle_loss
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights.init import init_weights

F64_MARGIN = 1e-10
# A decoder-only model with the switches a GPT has, plus a pad in the prompt (a masked key) and
# max_len 24 so that a learned table's end is near.
DECODER = preset("tiny_decoder_only").replace(max_len=24, pad_id=3, bos_id=4, eos_id=5)
ENCODER = preset("tiny_encoder_only")
PROMPTS = {
    "one-token": np.array([[4], [9]]),
    "four-tokens": np.array([[4, 10, 11, 12], [4, 13, 3, 14], [4, 20, 21, 22]]),
}


def decode_all(model, config, prompt, cached, beam, extra_len=6):
    start = partial(model.stepper, cached=cached)
    if beam == 1:
        return greedy_search(start, config, prompt, extra_len=extra_len)
    return beam_search(start, config, prompt, beam=beam, extra_len=extra_len)


def greedy_margins(oracle, config, prompt, tokens):
    """The oracle's top-1 minus top-2 log-probability at every greedy decision along `tokens`."""
    margins = []
    for row, toks in enumerate(tokens):
        stepper = oracle.stepper(prompt[row : row + 1], 1, len(toks) + 1)
        feed = prompt[row, -1]
        for tok in toks.tolist():
            lp = np.sort(log_softmax(stepper.step(np.array([feed])))[0])
            margins.append(lp[-1] - lp[-2])
            feed = tok
    return np.array(margins)


def test_the_oracle_continues_a_prompt_as_its_own_forward_pass_does():
    """The oracle's stepper (a prefix re-run) against reference.forward on prompt + tokens: the
    logits of the last position of the whole sequence, bit for bit."""
    weights = init_weights(DECODER, seed=5, scheme="perturbed")
    oracle = get_backend("numpy").build(DECODER, weights)
    prompt = PROMPTS["four-tokens"]
    got = greedy_search(oracle.stepper, DECODER, prompt, extra_len=4, stop_at_eos=False)
    sequence = np.concatenate([prompt, got.padded(DECODER.pad_id)[:, :-1]], axis=1)
    logits = oracle.forward(None, sequence).logits[:, -1]
    np.testing.assert_array_equal(np.argmax(logits, axis=-1), got.padded(DECODER.pad_id)[:, -1])


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("prompt_id", list(PROMPTS))
@pytest.mark.parametrize("beam", [1, 4])
def test_float64_decoder_only_search_gives_the_oracles_tokens(framework, prompt_id, beam):
    """Prefill plus cached steps, and the uncached prefix re-run, in each framework."""
    weights = init_weights(DECODER, seed=5, scheme="perturbed")
    prompt = PROMPTS[prompt_id]
    oracle = get_backend("numpy").build(DECODER, weights)
    want = decode_all(oracle, DECODER, prompt, True, beam)
    if beam == 1:
        assert greedy_margins(oracle, DECODER, prompt, want.tokens).min() > F64_MARGIN
    model = backend_or_skip(framework).build(DECODER, weights, dtype="float64")
    for cached in (True, False):
        got = decode_all(model, DECODER, prompt, cached, beam)
        for row in range(prompt.shape[0]):
            assert got.tokens[row].tolist() == want.tokens[row].tolist(), (cached, row)
        np.testing.assert_array_equal(got.finished, want.finished)
        np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_a_prompt_that_fills_the_learned_table_is_refused_before_any_step(framework):
    weights = init_weights(DECODER, seed=5, scheme="perturbed")
    model = backend_or_skip(framework).build(DECODER, weights, dtype="float32")
    prompt = np.full((1, DECODER.max_len), 9)
    with pytest.raises(InputError, match="max_steps: length 25 exceeds max_len=24"):
        model.stepper(prompt, 1, 2)


def lm_batch(config, seed=0):
    """A decoder-only batch (None, tgt): ragged rows ending in EOS, the first full length."""
    _, tgt_in = ragged_batch(config, batch=3, src_len=1, tgt_len=6, seed=seed)
    tgt = np.concatenate([tgt_in[:, 1:], np.full((3, 1), config.pad_id)], axis=1)  # drop BOS
    tgt[0, -1] = config.eos_id
    return None, tgt


def lm_model(name, dtype, seed=0):
    weights = init_weights(DECODER, seed=seed, scheme="perturbed", dtype="float64")
    return backend_or_skip(name).build(DECODER, weights, dtype=dtype), weights


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_decoder_only_loss_matches_the_oracle_and_grads_finite_differences(name):
    model, weights = lm_model(name, "float64")
    src, tgt = lm_batch(DECODER)
    out = model.loss_and_grads(src, tgt)
    want_loss, want_acc, want_n = oracle_loss(weights, DECODER, src, tgt)
    assert abs(out.loss - want_loss) <= 1e-10
    assert argmax_margin(weights, DECODER, src, tgt) > ARGMAX_MARGIN_F64  # accuracies comparable
    assert (out.accuracy, out.tokens) == (want_acc, want_n)
    assert list(out.grads) == list(canonical_shapes(DECODER))
    rng = np.random.default_rng(0)
    h = 1e-5
    for tensor in ("decoder.embedding", "decoder.position_embedding", "decoder.final_norm.scale"):
        index = tuple(int(rng.integers(0, n)) for n in weights[tensor].shape)
        plus, minus = dict(weights), dict(weights)
        plus[tensor], minus[tensor] = weights[tensor].copy(), weights[tensor].copy()
        plus[tensor][index] += h
        minus[tensor][index] -= h
        fd = (
            oracle_loss(plus, DECODER, src, tgt)[0] - oracle_loss(minus, DECODER, src, tgt)[0]
        ) / (2 * h)
        assert abs(out.grads[tensor][index] - fd) <= 1e-6, (tensor, index)


# The float32 20-step check runs the same model with relu. With a GELU, every feed-forward weight
# has a small nonzero gradient (relu's are exactly 0 on inactive units), and Adam divides each
# gradient by its own size, so a float32 rounding error of ~1e-9 on a gradient of ~3e-5 becomes a
# step error of lr * 3e-5 ~ 2e-5: measured, each framework's float32 weights end 1.4e-5 from its
# own float64 run and its 20-step losses 6.6e-6 (torch), 5.6e-6 (Flax), 6.2e-6 (Keras, seed 3),
# alike in all three: float32 Adam, not an implementation. With relu the same run ends 1.8e-6
# and 5.5e-7 from float64, the encoder-decoder's regime, where impl/test_training.py's bounds hold.
# The GELU model's steps are checked in float64 (1e-9), where rounding cannot hide a difference.
FLOAT32_STEPS = DECODER.replace(activation="relu")


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(IMPLEMENTATIONS, 2)))
def test_decoder_only_gradients_and_twenty_steps_agree_pairwise(a, b):
    """float64: gradients within 1e-9, 20 Adam steps' losses and weights within 1e-9; float32:
    gradients and (FLOAT32_STEPS) 20-step losses within the encoder-decoder's bounds."""
    src, tgt = lm_batch(DECODER)
    batches = [lm_batch(DECODER, seed=s) for s in range(20)]
    for dtype, grad_atol, loss_atol in (
        ("float64", 1e-9, 1e-9),
        ("float32", GRAD_ATOL_F32, LOSS_ATOL_F32),
    ):
        grads, losses, weights = {}, {}, {}
        for name in (a, b):
            model, _ = lm_model(name, dtype)
            grads[name] = model.loss_and_grads(src, tgt).grads
            if dtype == "float32":
                weights32 = init_weights(FLOAT32_STEPS, seed=0, scheme="perturbed", dtype="float64")
                model = backend_or_skip(name).build(FLOAT32_STEPS, weights32, dtype=dtype)
            losses[name] = np.array(model.train_steps(batches, warmup=10))
            weights[name] = model.export()
        for k in grads[a]:
            diff = float(np.max(np.abs(grads[a][k].astype(np.float64) - grads[b][k])))
            assert diff <= grad_atol, f"{dtype} {k}: {a} vs {b} off by {diff:.3g}"
        diff = float(np.max(np.abs(losses[a] - losses[b])))
        assert diff <= loss_atol, f"{dtype} 20-step losses {a} vs {b} off by {diff:.3g}"
        assert losses[a][-1] < losses[a][0], "training did not lower the loss"
        if dtype == "float64":
            for k in weights[a]:
                if k.endswith(".key.bias"):  # a zero true gradient: impl/test_training.py says why
                    continue
                assert np.max(np.abs(weights[a][k] - weights[b][k])) <= 1e-9, k
            tgt_in = shift_right(tgt, DECODER.bos_id)
            logits = [
                backend_or_skip(n)
                .build(DECODER, weights[n], dtype="float64")
                .forward(None, tgt_in)
                .logits
                for n in (a, b)
            ]
            assert np.max(np.abs(logits[0] - logits[1])) <= 1e-9


@pytest.mark.parametrize("framework", ["numpy", *IMPLEMENTATIONS])
def test_an_encoder_only_model_neither_decodes_nor_trains(framework):
    weights = init_weights(ENCODER, seed=0, scheme="perturbed")
    backend = backend_or_skip(framework)
    model = backend.build(ENCODER, weights, dtype=backend.dtypes[0])
    src, _ = ragged_batch(ENCODER, 2, 5, 1)
    with pytest.raises(InputError, match="an encoder-only model .* does not generate"):
        model.stepper(src, 1, 4)
    if framework != "numpy":
        with pytest.raises(InputError, match="train: an encoder-only model"):
            model.loss_and_grads(src, src)


@pytest.mark.parametrize("framework", ["numpy", *IMPLEMENTATIONS])
def test_each_half_takes_only_its_own_input(framework):
    backend = backend_or_skip(framework)
    for config in (DECODER, ENCODER):
        model = backend.build(config, init_weights(config, seed=0), dtype=backend.dtypes[0])
        ids = np.array([[4, 9, 10]])
        with pytest.raises(InputError, match="takes no"):
            model.forward(ids, ids)
        right = (None, ids) if config is DECODER else (ids, None)
        out = model.forward(*right)
        assert (out.logits is None) == (config is ENCODER)
        assert (out.encoder_output is None) == (config is DECODER)
        assert (out.pooled_output is None) == (config is DECODER)
