"""Seeded sampling, specified once: the same tokens in every framework for the same seed.

Each step turns a framework's logits into a distribution on the host, in float64, the way
transformers' sampling warpers do and in their order (generation/utils.py, _get_logits_processor):
1. temperature: logits / T (TemperatureLogitsWarper);
2. top-k: every token whose logit is below the k-th largest is removed; ties with the k-th stay
   (TopKLogitsWarper, `scores < topk(scores, k)[..., -1]`);
3. top-p (nucleus; Holtzman et al. 2020, section 3.1): with the tokens sorted by ascending logit,
   those whose cumulative probability is <= 1 - p are removed, the most likely one always kept
   (TopPLogitsWarper).
The draw is not torch.multinomial's: a numpy Generator seeded with `seed` draws one uniform u per
row per step (`rng.random(rows)`, done rows included, so the stream never depends on when a row
ended), and the token is the inverse CDF at u: the first id whose cumulative probability, in id
order, exceeds u times the total. Every framework's logits then give the same token unless u lands
within their logits' error of a CDF boundary (or a top-k/top-p cut moves), a chance of the order
of that error (~1e-6 in float32).

Conventions are greedy_search's (common/decoding/search.py): tokens come back without EOS,
`finished` says whether EOS ended the row, a decoder-only prompt is prefilled by the stepper and
its last token fed first. The score is the sum of the log-probabilities of the sampled tokens
under the distributions they were drawn from (after temperature, top-k and top-p).
"""

from __future__ import annotations

import numpy as np

from transformer_rosetta.decoding.search import (
    EXTRA_LEN,
    Decoded,
    Stepper,
    StepperFactory,
    check_search_args,
    check_search_call,
    token_by_token,
)
from transformer_rosetta.errors import InputError, InputTypeError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.spec.arguments import check_flag, check_seed, is_integer
from transformer_rosetta.spec.config import TransformerConfig


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """InputError, one line naming the argument, for a temperature <= 0, a top_k < 1 or a top_p
    outside (0, 1]: transformers' own limits (it treats top_k 0 as "off"; here that is None).
    A value of the wrong type (a string, a bool) is an InputTypeError, which is also a TypeError."""
    if not _is_number(temperature):
        raise InputTypeError(f"temperature: must be a number > 0, got {brief(temperature)}")
    if not (np.isfinite(temperature) and temperature > 0):
        raise InputError(f"temperature: must be a number > 0, got {temperature!r}")
    if top_k is not None and not is_integer(top_k):
        raise InputTypeError(
            f"top_k: must be an integer >= 1 (or None: no top-k), got {brief(top_k)}"
        )
    if top_k is not None and top_k < 1:
        raise InputError(f"top_k: must be an integer >= 1 (or None: no top-k), got {top_k!r}")
    if top_p is not None and not _is_number(top_p):
        raise InputTypeError(
            f"top_p: must be a number in (0, 1] (or None: no top-p), got {brief(top_p)}"
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise InputError(f"top_p: must be a number in (0, 1] (or None: no top-p), got {top_p!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def filtered_log_probs(
    logits: np.ndarray,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> np.ndarray:
    """The float64 log-probabilities (N, V) that sampling draws from: temperature, then top-k,
    then top-p, as transformers applies them (module docstring); a removed token is -inf."""
    scores = np.asarray(logits, dtype=np.float64) / float(temperature)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = -np.partition(-scores, top_k - 1, axis=-1)[:, top_k - 1 : top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as TopPLogitsWarper sorts
        ascending = np.take_along_axis(scores, order, axis=-1)
        cumulative = np.cumsum(np.exp(_log_softmax(ascending)), axis=-1)
        remove_sorted = cumulative <= 1.0 - top_p
        remove_sorted[:, -1] = False  # min_tokens_to_keep = 1: the most likely token stays
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        scores = np.where(remove, -np.inf, scores)
    return _log_softmax(scores)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    shifted = x - top
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def inverse_cdf(log_probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Per row, the first id (in id order) whose cumulative probability exceeds u * total: a
    draw from the row's distribution given u ~ U[0, 1). A token of probability 0 is never chosen."""
    cdf = np.cumsum(np.exp(log_probs), axis=-1)
    targets = uniforms * cdf[:, -1]
    tokens = np.array(
        [np.searchsorted(row, t, side="right") for row, t in zip(cdf, targets, strict=True)],
        dtype=np.int64,
    )
    # u * total rounds up to total at most: the last token with any probability then.
    last = log_probs.shape[-1] - 1 - np.argmax(np.isfinite(log_probs[:, ::-1]), axis=-1)
    return np.minimum(tokens, last)


def sample_search(
    start: StepperFactory,
    c: TransformerConfig,
    src: np.ndarray,
    *,
    extra_len: int = EXTRA_LEN,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_at_eos: bool = True,
) -> Decoded:
    """Sample a token at every step from the filtered distribution (module docstring) until each
    row has emitted EOS or reached its limit (row_limits, as greedy_search). Same inputs and
    outputs as greedy_search; stop_at_eos=False decodes every row to its limit."""
    check_sampling_args(temperature, top_k, top_p)
    check_search_args(1, extra_len)
    src = check_search_call(start, c, src)
    check_flag(stop_at_eos, "stop_at_eos")
    # default_rng would also take None (fresh OS entropy: no longer "the same tokens for the same
    # seed"), a negative number or a string only with numpy's own errors.
    rng = np.random.default_rng(check_seed(seed))

    def draw(stepper: Stepper, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        log_probs = filtered_log_probs(
            stepper.step(tokens), temperature=temperature, top_k=top_k, top_p=top_p
        )
        rows = int(tokens.shape[0])  # an int, so that rng.random(rows) is typed as an array
        chosen = inverse_cdf(log_probs, rng.random(rows))  # one draw per row, done rows too
        return chosen, log_probs[np.arange(rows), chosen]

    return token_by_token(start, c, src, draw, extra_len=extra_len, stop_at_eos=stop_at_eos)
