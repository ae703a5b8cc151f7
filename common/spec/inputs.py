"""Checks on token ids, done on the host before any framework sees them, so errors are clear
(inside a jitted or compiled function an out-of-range id is silently clamped or garbage)."""

from __future__ import annotations

import numpy as np

from transformer_rosetta.errors import InputError
from transformer_rosetta.spec.config import TransformerConfig


def check_ids(
    ids: np.ndarray, name: str, vocab_size: int, *, pad_id: int | None = None
) -> np.ndarray:
    """`ids` as a [batch, length] int64 array of ids in [0, vocab_size); InputError naming `name`
    when it is not one. `pad_id`, when given, is allowed too: a model without a pad token pads
    with the id one past its vocabulary (TransformerConfig.virtual_pad)."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{name}: token ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 2:
        raise InputError(f"{name}: expected shape [batch, length] (rank 2), got {list(ids.shape)}")
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"{name}: batch and length must be >= 1, got {list(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        outside = (ids < 0) | (ids >= vocab_size)
        if pad_id is not None:
            outside &= ids != pad_id
        outside = ids[outside]
        if not outside.size:  # only the allowed pad id past the vocabulary
            return ids.astype(np.int64)
        bad = int(outside.min()) if lo < 0 else int(outside.max())
        where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
        raise InputError(
            f"{name}: token id {bad} at {list(where)} is outside the vocabulary [0, {vocab_size})"
        )
    return ids.astype(np.int64)


def check_length(length: int, name: str, c: TransformerConfig) -> None:
    """Learned positions stop at max_len; sinusoidal ones extrapolate (section 3.5)."""
    if c.position_kind == "learned" and length > c.max_len:
        raise InputError(
            f"{name}: length {length} exceeds max_len={c.max_len} of the learned position table"
        )


# The model's two inputs, each with the stack that reads it (a half of the family has one).
INPUT_STACKS = (("src", "encoder"), ("tgt", "decoder"))


def check_inputs(
    c: TransformerConfig, src: np.ndarray | None, tgt_in: np.ndarray | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Validated (src, tgt_in) as int64 [B, S] and [B, T]. A half of the family takes only its
    own: a decoder-only model src None, an encoder-only one tgt_in None."""
    check_halves(c, src, tgt_in)
    if src is not None:
        src = check_ids(src, "src", c.src_vocab_size)
        check_length(src.shape[1], "src", c)
    if tgt_in is not None:
        # A model without a pad token pads with its virtual pad, which embeds as zero.
        pad = c.pad_id if c.virtual_pad else None
        tgt_in = check_ids(tgt_in, "tgt", c.tgt_vocab_size, pad_id=pad)
        check_length(tgt_in.shape[1], "tgt", c)
    if src is not None and tgt_in is not None and src.shape[0] != tgt_in.shape[0]:
        raise InputError(
            f"batch sizes differ: src has {src.shape[0]} rows, tgt has {tgt_in.shape[0]}"
        )
    return src, tgt_in


def check_halves(c: TransformerConfig, src: object, tgt: object) -> None:
    """InputError unless exactly the inputs of the model's kind are given: src for an encoder,
    tgt for a decoder."""
    for (name, stack), value in zip(INPUT_STACKS, (src, tgt), strict=True):
        needed = getattr(c, f"has_{stack}")
        if needed and value is None:
            raise InputError(
                f"{name}: the model has a{'n' * (stack == 'encoder')} {stack}; give {name}"
            )
        if not needed and value is not None:
            raise InputError(
                f"{name}: {c.a_model_of_its_kind} has no {stack} and takes no {name}; pass None"
            )


def ragged_batch(
    c: TransformerConfig, batch: int, src_len: int, tgt_len: int, seed: int = 0
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Deterministic (src, tgt_in) with ragged right padding, for tests and `rosetta parity`.

    Row 0 is full length, later rows are shorter; with batch >= 3 the last row of src is all
    padding (a query with no allowed key in encoder self-attention and in cross-attention).
    tgt_in starts with BOS. Token ids avoid pad/bos/eos, so padding is only where we put it.
    A half of the family gets None for the input it does not take (check_inputs); the other is
    drawn as for the encoder-decoder, so each half sees the same ids.
    """
    rng = np.random.default_rng(seed)
    special = {c.pad_id, c.bos_id, c.eos_id}

    def tokens(vocab: int, shape: tuple[int, int]) -> np.ndarray:
        allowed = np.array([i for i in range(vocab) if i not in special] or [c.eos_id])
        return allowed[rng.integers(0, len(allowed), size=shape)]

    src = tokens(c.src_vocab_size, (batch, src_len))
    tgt = tokens(c.tgt_vocab_size, (batch, tgt_len))
    tgt[:, 0] = c.bos_id
    for row in range(1, batch):
        src[row, max(1, src_len - row * max(1, src_len // batch)) :] = c.pad_id
        tgt[row, max(1, tgt_len - row * max(1, tgt_len // batch)) :] = c.pad_id
    if batch >= 3:
        src[-1, :] = c.pad_id
    return (
        src.astype(np.int64) if c.has_encoder else None,
        tgt.astype(np.int64) if c.has_decoder else None,
    )


def check_trainable(c: TransformerConfig) -> None:
    """InputError for a model with no training objective here: an encoder-only model (no
    logits; masked-language-model pretraining is out of this project's scope)."""
    if not c.has_decoder:
        raise InputError(
            "train: an encoder-only model (num_decoder_layers 0) returns hidden states, not "
            "logits; there is no training objective for it here"
        )
