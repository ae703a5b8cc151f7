"""Text out of a decoder-only model: `generate_ids` continues token-id prompts greedily, by beam
search or by seeded sampling, with any framework's model through its stepper (the key/value
cache, or the whole prefix at every step), and the search written once (common/decoding/).

Every argument is checked, each with one line naming it, before any work. What comes back is what
transformers' `generate` returns after the prompt: the new tokens, with the EOS that ended a row
when one did (so that greedy ids can be compared with `GPT2LMHeadModel.generate(do_sample=False)`
token for token)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import Model
from transformer_rosetta.decoding.sampling import check_sampling_args, sample_search
from transformer_rosetta.decoding.search import Decoded, beam_search, greedy_search
from transformer_rosetta.errors import InputError, InputTypeError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.spec.arguments import check_flag, check_int, check_seed
from transformer_rosetta.spec.config import TransformerConfig

STRATEGIES = ("greedy", "beam", "sample")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_decoding_options(
    *,
    max_new_tokens: int,
    strategy: str,
    beam: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int = 0,
    cached: bool = True,
    stop_at_eos: bool = True,
) -> None:
    """The one check of how to decode, for `rosetta generate` and the API's generate alike:
    InputError (InputTypeError for a wrong type), one line naming the argument. Every argument
    given is checked whatever the strategy (a beam of 0 is refused under greedy too, as --beam 0
    is on the command line): a value that would be ignored is a mistake all the same."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InputError(f"strategy: unknown {brief(strategy)}; allowed: {', '.join(STRATEGIES)}")
    check_int(max_new_tokens, "max_new_tokens", minimum=1)
    check_int(beam, "beam", minimum=1)
    check_flag(stop_at_eos, "stop_at_eos")
    if strategy == "beam" and not stop_at_eos:
        raise InputError("stop_at_eos: beam search always ends a hypothesis at EOS")
    check_sampling_args(temperature, top_k, top_p)
    check_seed(seed)
    check_flag(cached, "cached")


def check_generation(
    config: TransformerConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    strategy: str,
    beam: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    stop_at_eos: bool,
    seed: int = 0,
    cached: bool = True,
) -> list[np.ndarray]:
    """The prompts as int64 rows, once every argument is one the model can take; InputError,
    one line naming the argument (and the prompt, counted from 1), otherwise."""
    if config.kind != "decoder_only":
        raise InputError(
            f"generate: {config.a_model_of_its_kind} does not continue prompts; generate_ids "
            "takes a decoder-only model (num_encoder_layers 0)"
        )
    check_decoding_options(
        max_new_tokens=max_new_tokens,
        strategy=strategy,
        beam=beam,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        cached=cached,
        stop_at_eos=stop_at_eos,
    )
    if (
        isinstance(prompts, (str, bytes))
        or not isinstance(prompts, (Sequence, np.ndarray))
        or len(prompts) == 0
    ):
        raise InputError("prompts: give at least one prompt, a sequence of token ids")
    return [_checked_prompt(config, p, n, max_new_tokens) for n, p in enumerate(prompts, 1)]


def _checked_prompt(
    config: TransformerConfig, prompt: Sequence[int], n: int, max_new_tokens: int
) -> np.ndarray:
    if isinstance(prompt, (str, bytes)):
        raise InputError(f"prompt {n}: token ids are needed, got text (encode it first)")
    if not isinstance(prompt, (Sequence, np.ndarray)):
        raise InputTypeError(f"prompt {n}: must be a sequence of token ids, got {brief(prompt)}")
    ids = list(prompt)
    if not ids:
        raise InputError(f"prompt {n}: empty; a prompt needs at least one token id")
    vocab = config.tgt_vocab_size
    for position, token in enumerate(ids):
        if not _is_int(token):
            raise InputError(
                f"prompt {n}: position {position} holds {brief(token)}, not a token id"
            )
        if not 0 <= token < vocab:
            raise InputError(
                f"prompt {n}: token id {token} at position {position} is outside the vocabulary "
                f"[0, {vocab})"
            )
    # The last new token is predicted, never fed: len + max_new_tokens - 1 positions are read.
    needed = len(ids) + max_new_tokens - 1
    if config.position_kind == "learned" and needed > config.max_len:
        raise InputError(
            f"prompt {n}: {len(ids)} tokens and max_new_tokens {max_new_tokens} need {needed} "
            f"positions; the model has {config.max_len} (max_len); shorten the prompt or ask for "
            f"at most {max(config.max_len - len(ids) + 1, 0)} new tokens"
        )
    return np.asarray(ids, dtype=np.int64)


def _sample_seed(seed: int, index: int) -> int:
    """Prompt `index`'s own seed from the call's: its tokens depend on (prompt, seed, index)
    only, never on the other prompts' lengths or order of decoding."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])


def generate_ids(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    strategy: str = "greedy",
    beam: int = 4,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    cached: bool = True,
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """The new tokens of each prompt (with the EOS that ended it, when one did), continued by
    `model` (a built backend Model of a decoder-only config).

    `strategy`: "greedy" (argmax, ties to the lower id), "beam" (`beam` hypotheses, GNMT's
    length penalty 0.6: common/decoding/search.py, not transformers' beam scorer) or "sample"
    (temperature, top-k, top-p in transformers' order, drawn by inverse CDF from a seeded numpy
    generator: common/decoding/sampling.py). `cached` False recomputes the whole prefix at every
    step (the baseline for the cache). `stop_at_eos` False decodes max_new_tokens every time
    (greedy and sampling).

    Prompts of different lengths work: greedy and beam search decode the prompts one length
    group at a time (a batch per length, rows independent of each other, so the grouping never
    changes a token); sampling decodes each prompt alone, from a seed drawn from (`seed`, its
    index), so that its tokens never depend on the other prompts."""
    config = model.config
    rows = check_generation(
        config,
        prompts,
        max_new_tokens=max_new_tokens,
        strategy=strategy,
        beam=beam,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_at_eos=stop_at_eos,
        seed=seed,
        cached=cached,
    )

    def start(src: np.ndarray, beams: int, max_steps: int) -> Any:
        return model.stepper(src, beams, max_steps, cached=cached)  # type: ignore[attr-defined]

    def decode(batch: np.ndarray, index: int) -> Decoded:
        if strategy == "greedy":
            return greedy_search(
                start, config, batch, extra_len=max_new_tokens, stop_at_eos=stop_at_eos
            )
        if strategy == "beam":
            return beam_search(start, config, batch, beam=beam, extra_len=max_new_tokens)
        return sample_search(
            start,
            config,
            batch,
            extra_len=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=_sample_seed(seed, index),
            stop_at_eos=stop_at_eos,
        )

    out: list[list[int]] = [[] for _ in rows]
    if strategy == "sample":
        groups = [[i] for i in range(len(rows))]
    else:
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(i)
        groups = list(by_length.values())
    for members in groups:
        decoded = decode(np.stack([rows[i] for i in members]), members[0])
        for i, tokens, ended in zip(members, decoded.tokens, decoded.finished, strict=True):
            out[i] = [int(t) for t in tokens] + ([config.eos_id] if ended else [])
    return out
