"""Autoregressive search, specified once: greedy and beam search over any framework's model step.

The search bookkeeping (finished hypotheses, length penalty, per-row length limits, tie-breaking)
is where implementations silently disagree, so it is written once here in float64 numpy. Each
framework supplies the model's half through a `Stepper` (its decode.py, behind the adapter): the
encoder runs once, and every `step` feeds one token per row and returns the next position's
logits, using the framework's own key/value cache. Parity of decoded tokens then rests on parity
of logits, which the forward tests already bound.

Conventions (docs/PARITY.md, "Decoding"):
- Decoding starts from BOS. A hypothesis ends at EOS, or at its row's limit of
  `source length + extra_len` new tokens (source length = non-pad source tokens; section 6.1:
  "maximum output length to input length + 50").
- A decoder-only model continues a prompt (B, P) instead, given where the source would be: the
  stepper prefills the cache with its first P - 1 tokens in one pass, the search feeds its last
  token first, and every row may get extra_len new tokens.
- Scores are sums of float64 log-softmax values of the returned logits, EOS included.
- Beam search ranks finished hypotheses by GNMT's length-normalised score (Wu et al. 2016, Eq. 14):
  log P(Y) / lp(Y), lp(Y) = ((5 + |Y|) / 6)^alpha, with |Y| counting EOS. Beam 4, alpha 0.6.
- Ties break towards the lower index (stable sorts), so a tie cannot depend on the framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from transformer_rosetta.errors import InputError, InputTypeError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.spec.arguments import check_callable, check_flag, check_instance, check_int
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_ids, check_length

EXTRA_LEN = 50  # section 6.1
BEAM_SIZE = 4  # section 6.1
LENGTH_PENALTY = 0.6  # section 6.1, alpha


@runtime_checkable
class Stepper(Protocol):
    """One batch being decoded by one model. Rows are source rows each repeated `beams` times
    (row r decodes source r // beams). The caller feeds BOS first (a decoder-only model: the
    prompt's last token, start_tokens); at most `max_steps` steps."""

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed tokens (N,) int64 at the next position; return that position's logits (N, V)
        (float32, or float64 for a float64 model)."""
        ...

    def reorder(self, rows: np.ndarray) -> None:
        """Row i continues as the old row rows[i] (N,) from now on: beam search's gather."""
        ...


@runtime_checkable
class TopStepper(Stepper, Protocol):
    """A Stepper that can also reduce a step on its own device, so that only (N, k) numbers travel
    to the host instead of the (N, V) logits: on a GPU the copy, and the float64 log-softmax of a
    32000-token row on the host (2.7 ms for 8 rows on a 2-core CPU, the whole budget of a step at
    4,000 tokens/s), would otherwise dominate a cached step."""

    def step_top(self, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Feed tokens (N,) as `step` does; return the k best next tokens of every row, best
        first, ties to the lower id: their log-softmax values (N, k), computed on the device in
        the model's statistics dtype (float32 or wider), and their ids (N, k) int64."""
        ...


def check_stepper_request(
    c: TransformerConfig, src: np.ndarray, beams: int, max_steps: int
) -> np.ndarray:
    """The checks every DecodingModel.stepper makes first: src as validated (B, S) int64 ids,
    beams and max_steps >= 1, and max_steps within a learned position table. For a decoder-only
    model src is the prompt (target ids), and its P - 1 prefilled positions count too."""
    if not c.has_decoder:
        raise InputError("decode: an encoder-only model (num_decoder_layers 0) does not generate")
    if c.has_encoder:
        src = check_ids(src, "src", c.src_vocab_size)
        check_length(src.shape[1], "src", c)
        positions = max_steps
    else:
        src = check_ids(src, "prompt", c.tgt_vocab_size)
        positions = src.shape[1] - 1 + max_steps
    if beams < 1 or max_steps < 1:
        raise InputError(f"beams and max_steps must be >= 1, got {beams} and {max_steps}")
    check_length(positions, "max_steps", c)  # learned positions end at max_len
    return src


def start_tokens(c: TransformerConfig, src: np.ndarray, beams: int) -> np.ndarray:
    """What a search feeds first, (B * beams,): BOS; for a decoder-only model each prompt's last
    token (its first P - 1 are in the stepper's cache already)."""
    if c.has_encoder:
        return np.full(src.shape[0] * beams, c.bos_id, dtype=np.int64)
    return np.repeat(np.asarray(src, dtype=np.int64)[:, -1], beams)


def filler_id(c: TransformerConfig) -> int:
    """What a search feeds a row that is done (and a beam slot left empty), so that the batch
    stays rectangular; nothing reads what that row computes next. The pad id, which the cache
    masks; a model without a pad token (TransformerConfig.virtual_pad, whose pad_id names no
    token, and which a stepper, taking the vocabulary's ids only, refuses) feeds its EOS, as
    transformers' generate does when pad_token_id is None."""
    return c.eos_id if c.virtual_pad else c.pad_id


def check_row_ids(values: np.ndarray, name: str, rows: int, high: int) -> np.ndarray:
    """One id per row, (rows,) int64 in [0, high): a step's tokens or a reorder's rows. Checked
    on the host, since a compiled gather would clamp an out-of-range index silently."""
    values = np.asarray(values)
    if values.shape != (rows,):
        raise InputError(f"{name}: expected shape [{rows}], got {list(values.shape)}")
    return check_ids(values[None, :], name, high)[0]


def check_step_budget(steps_taken: int, max_steps: int) -> None:
    """A Stepper's buffers hold max_steps positions: one more step is a caller's bug."""
    if steps_taken >= max_steps:
        raise ValueError(f"step: this stepper was made for max_steps={max_steps} steps")


StepperFactory = Callable[[np.ndarray, int, int], Stepper]  # (src, beams, max_steps) -> Stepper


@dataclass
class Decoded:
    """What a search returns, per source row: tokens without BOS and without EOS, the score
    (greedy: log P; beam: log P / lp), and whether EOS ended it (False: the length limit did)."""

    tokens: list[np.ndarray]
    scores: np.ndarray  # (B,) float64
    finished: np.ndarray  # (B,) bool

    def padded(self, pad_id: int) -> np.ndarray:
        """The tokens as one (B, L) int64 array, right-padded with pad_id."""
        width = max((len(t) for t in self.tokens), default=0)
        out = np.full((len(self.tokens), max(width, 1)), pad_id, dtype=np.int64)
        for i, t in enumerate(self.tokens):
            out[i, : len(t)] = t
        return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, whatever the model's dtype."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_log_probs(stepper: Stepper, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One step, reduced to what the search reads: each row's k best next tokens, best first and
    ties to the lower id, as (float64 log-probabilities (N, k), ids (N, k) int64).

    A TopStepper reduces on its device (float32 log-softmax there, ~1e-7 relative from the float64
    one here, the same order as the frameworks' float32 logits differ by); any other Stepper
    returns its logits and the float64 log-softmax is taken here, the spec's own arithmetic."""
    if isinstance(stepper, TopStepper):
        values, ids = stepper.step_top(tokens, k)
        return np.asarray(values, dtype=np.float64), np.asarray(ids, dtype=np.int64)
    log_probs = log_softmax(stepper.step(tokens))
    if k == 1:
        ids = log_probs.argmax(axis=-1)[:, None]  # the first maximum: the lower id
    else:
        ids = np.argsort(-log_probs, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(log_probs, ids, axis=-1), ids


def length_penalty(length: np.ndarray | int, alpha: float) -> np.ndarray:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, Eq. 14)."""
    return ((5.0 + np.asarray(length, dtype=np.float64)) / 6.0) ** alpha


def prompt_prefix(prompt: np.ndarray, beams: int) -> np.ndarray:
    """What a decoder-only model's uncached stepper holds before its first step, (B * beams,
    P - 1) int64: each prompt row repeated for its beams, without the last token, which the
    search feeds first (start_tokens). The cached stepper prefills the same tokens."""
    return np.repeat(np.asarray(prompt, dtype=np.int64), beams, axis=0)[:, :-1]


def row_limits(c: TransformerConfig, src: np.ndarray, extra_len: int) -> np.ndarray:
    """Per source row, the most new tokens it may get: its non-pad length + extra_len. Learned
    positions also stop the decoder input (BOS + tokens) at max_len. A decoder-only model's rows
    (src is the prompt) get extra_len each, within max_len positions after the prompt."""
    if not c.has_encoder:
        limits = np.full(src.shape[0], extra_len, dtype=np.int64)
        if c.position_kind == "learned":
            limits = np.minimum(limits, c.max_len - src.shape[1] + 1)
        return np.maximum(limits, 1)
    limits = (src != c.pad_id).sum(axis=1).astype(np.int64) + extra_len
    if c.position_kind == "learned":
        limits = np.minimum(limits, c.max_len)
    return np.maximum(limits, 1)


def check_search_args(beams: int, extra_len: int) -> None:
    """beam and extra_len as the searches name them: integers >= 1 (InputTypeError otherwise,
    which is also a TypeError; InputError for 0 or a negative count)."""
    check_int(beams, "beam", minimum=1)
    check_int(extra_len, "extra_len", minimum=1)


def check_search_call(start: StepperFactory, c: TransformerConfig, src: np.ndarray) -> np.ndarray:
    """What every search is given, checked before the first step and named as its parameters
    are: `start` a stepper factory, `c` a TransformerConfig of a model with a decoder, `src`
    (B, S) integer token ids (a decoder-only model's prompts), returned as an array. Their
    range is the stepper's check (check_stepper_request), which knows the model's ids."""
    check_callable(start, "start", "a stepper factory, (src, beams, max_steps) -> Stepper")
    check_instance(c, "c", TransformerConfig, "a TransformerConfig")
    if not c.has_decoder:
        raise InputError("c: an encoder-only model (num_decoder_layers 0) does not generate")
    try:
        ids = np.asarray(src)
    except (TypeError, ValueError):  # a ragged list of rows
        raise InputError("src: must be token ids of shape [batch, length]") from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"src: token ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 2 or 0 in ids.shape:
        raise InputError(f"src: must be token ids of shape [batch, length], got {list(ids.shape)}")
    return ids


# One step's choice for every row: (token ids, their log-probabilities), each (rows,).
Pick = Callable[[Stepper, np.ndarray], tuple[np.ndarray, np.ndarray]]


def token_by_token(
    start: StepperFactory,
    c: TransformerConfig,
    src: np.ndarray,
    pick: Pick,
    *,
    extra_len: int,
    stop_at_eos: bool,
) -> Decoded:
    """The loop greedy search and sampling share: one token per row per step, chosen by `pick`,
    until each row has emitted EOS or reached its limit (row_limits). stop_at_eos=False decodes
    every row to its limit. A done row keeps feeding a token so the batch stays rectangular;
    nothing reads it (and `pick` still sees it, so a sampler draws for it too)."""
    limits = row_limits(c, src, extra_len)
    rows = src.shape[0]
    stepper = start(src, 1, int(limits.max()))
    tokens = start_tokens(c, src, 1)
    out = np.full((rows, int(limits.max())), c.pad_id, dtype=np.int64)
    scores = np.zeros(rows)
    lengths = np.zeros(rows, dtype=np.int64)
    finished = np.zeros(rows, dtype=bool)
    done = np.zeros(rows, dtype=bool)
    for t in range(int(limits.max())):
        chosen, logp = pick(stepper, tokens)
        live = ~done
        out[live, t] = chosen[live]
        scores[live] += logp[live]
        lengths[live] += 1
        if stop_at_eos:
            hit_eos = live & (chosen == c.eos_id)
            finished |= hit_eos
            done |= hit_eos
        done |= lengths >= limits
        if done.all():
            break
        tokens = np.where(done, filler_id(c), chosen)
    decoded = [
        out[i, : lengths[i] - int(finished[i])] for i in range(rows)
    ]  # drop EOS, keep the rest
    return Decoded(decoded, scores, finished)


def greedy_search(
    start: StepperFactory,
    c: TransformerConfig,
    src: np.ndarray,
    *,
    extra_len: int = EXTRA_LEN,
    stop_at_eos: bool = True,
) -> Decoded:
    """Pick the argmax token at every step until each row has emitted EOS or reached its limit.
    stop_at_eos=False decodes every row to its limit (benchmarks: a fixed number of tokens)."""
    check_search_args(1, extra_len)
    src = check_search_call(start, c, src)
    check_flag(stop_at_eos, "stop_at_eos")

    def argmax(stepper: Stepper, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        best_logp, best = (a[:, 0] for a in top_log_probs(stepper, tokens, 1))  # ties: lower id
        return best, best_logp

    return token_by_token(start, c, src, argmax, extra_len=extra_len, stop_at_eos=stop_at_eos)


def beam_search(
    start: StepperFactory,
    c: TransformerConfig,
    src: np.ndarray,
    *,
    beam: int = BEAM_SIZE,
    alpha: float = LENGTH_PENALTY,
    extra_len: int = EXTRA_LEN,
) -> Decoded:
    """Batched beam search (section 6.1: beam 4, alpha 0.6), as tensor2tensor runs it.

    Each row keeps `beam` live hypotheses. Every step extends each by every token, and takes the
    2 * beam best by log P: those ending in EOS join the row's finished list with score
    log P / lp, the best `beam` others stay live. At the row's limit, the live ones are finished
    as they are. A row stops once it has `beam` finished hypotheses and no live one can beat the
    worst of them even at the limit (log P only falls; lp is largest at the limit).
    """
    check_search_args(beam, extra_len)
    src = check_search_call(start, c, src)
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, (int, float, np.number)):
        raise InputTypeError(f"alpha: must be a finite number, got {brief(alpha)}")
    if not np.isfinite(alpha):
        raise InputError(f"alpha: must be a finite number, got {alpha!r}")
    limits = row_limits(c, src, extra_len)
    batch, k = src.shape[0], beam
    stepper = start(src, k, int(limits.max()))
    n = batch * k
    vocab = c.tgt_vocab_size
    width = min(2 * k, vocab)  # candidates per hypothesis
    live_tokens = np.zeros((n, 0), dtype=np.int64)  # generated so far, per live hypothesis
    live_logp = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], batch)  # one start per row
    feed = start_tokens(c, src, k)
    finished: list[list[tuple[float, float, np.ndarray, bool]]] = [[] for _ in range(batch)]
    row_done = np.zeros(batch, dtype=bool)
    for t in range(int(limits.max())):
        # The 2k best of a row's k * V extensions are among its hypotheses' 2k best each.
        values, ids = top_log_probs(stepper, feed, width)  # (n, width)
        total = (live_logp[:, None] + values).reshape(batch, k * width)
        # Each candidate's index in the row's k * V extensions, which breaks ties (lower first).
        flat = ((np.arange(n) % k)[:, None] * vocab + ids).reshape(batch, k * width)
        order = np.lexsort((flat, -total), axis=-1)[:, : 2 * k]  # (batch, 2k)
        next_rows = np.zeros(n, dtype=np.int64)
        next_tokens = np.full(n, filler_id(c), dtype=np.int64)
        next_logp = np.full(n, -np.inf)
        length = t + 1
        for b in range(batch):
            if row_done[b]:
                next_rows[b * k : (b + 1) * k] = b * k  # anything: the row is ignored from now
                continue
            kept = 0
            for j in order[b]:
                logp = total[b, j]
                if not np.isfinite(logp):
                    break
                source_row, token = b * k + flat[b, j] // vocab, int(flat[b, j] % vocab)
                seq = np.append(live_tokens[source_row], token)
                if token == c.eos_id:
                    score = logp / length_penalty(length, alpha)
                    finished[b].append((score, logp, seq[:-1], True))
                elif kept < k:
                    slot = b * k + kept
                    next_rows[slot], next_tokens[slot], next_logp[slot] = source_row, token, logp
                    kept += 1
            if length >= limits[b]:  # the limit: live hypotheses are finished as they stand
                for slot in range(b * k, b * k + kept):
                    seq = np.append(live_tokens[next_rows[slot]], next_tokens[slot])
                    score = next_logp[slot] / length_penalty(length, alpha)
                    finished[b].append((score, next_logp[slot], seq, False))
                row_done[b] = True
            elif kept == 0:
                row_done[b] = True
            elif len(finished[b]) >= k:
                worst = sorted(f[0] for f in finished[b])[-k]  # the k-th best finished score
                best_possible = next_logp[b * k] / length_penalty(limits[b], alpha)
                row_done[b] = best_possible <= worst
        if row_done.all():
            break
        live_tokens = np.concatenate([live_tokens[next_rows], next_tokens[:, None]], axis=1)
        live_logp = next_logp
        stepper.reorder(next_rows)
        feed = next_tokens
    tokens, scores, ended = [], np.zeros(batch), np.zeros(batch, dtype=bool)
    for b in range(batch):
        if not finished[b]:  # no finite log-probability at all (weights holding NaN or Inf)
            tokens.append(np.zeros(0, dtype=np.int64))
            scores[b] = np.nan
            continue
        # The best score; among equal scores, the hypothesis found first.
        best = min(range(len(finished[b])), key=lambda i: (-finished[b][i][0], i))
        scores[b], _, seq, ended[b] = finished[b][best]
        tokens.append(seq.astype(np.int64))
    return Decoded(tokens, scores, ended)
