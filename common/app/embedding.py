"""Sentence embeddings from an encoder-only model: text through the tokenizer its weight file
carries, batches padded with the config's pad id, one forward pass per batch, and the pooled
output the config names (mean over the non-pad tokens, or the first token; then the L2 norm when
the imported model normalises). For a sentence-transformers model (all-MiniLM-L6-v2) this is what
its `encode` gives: Transformer, Pooling and Normalize modules, each of which the config records
(transformer_rosetta.porting.bert.sentence_pooling).

Padding never changes a row: the pad positions are masked out of every attention (the model's
mask is `ids != pad_id`) and out of the mean, so a text's embedding does not depend on the batch
it lands in, up to the rounding of a different matrix shape. Texts are batched longest first, as
sentence-transformers does, so that a batch pads little.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from transformer_rosetta.adapter.backends import Model
from transformer_rosetta.app.resources import check_forward_fits
from transformer_rosetta.errors import InputError, RosettaError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

POOLING_WORDS = {"mean": "mean pooling", "first": "first-token pooling"}


class EmbedError(RosettaError, ValueError):
    """A model that gives no sentence embedding (not encoder-only, or no pooling)."""


def check_embeddable(config: TransformerConfig) -> None:
    """Refuse, by name, a model that has no sentence embedding to give."""
    if config.kind != "encoder_only":
        raise EmbedError(
            f"embed: {config.a_model_of_its_kind} gives no sentence embedding; embed takes an "
            "encoder-only model that pools (a converted sentence-transformers BERT folder)"
        )
    if config.pooling == "none":
        raise EmbedError(
            "embed: this encoder-only model does not pool (config pooling none): it gives token "
            "states, not sentence embeddings; convert it from a sentence-transformers folder "
            "(modules.json with a Pooling module) or use `rosetta forward` for encoder_output"
        )


def embedding_dtype(model: Model) -> np.dtype:
    """float64 for a float64 model, else float32 (bfloat16 outputs widened)."""
    return np.dtype(np.float64 if model.dtype == "float64" else np.float32)


def embed_ids(model: Model, ids: np.ndarray) -> np.ndarray:
    """The sentence embeddings (N, d_model) of token ids (N, S) padded with the config's pad id:
    the model's pooled output, L2-normalised when its config says so. A row with no token other
    than pad has no mean to take and is refused by its index (InputError)."""
    config = model.config
    check_embeddable(config)
    src, _ = check_inputs(config, np.asarray(ids), None)
    assert src is not None
    empty = np.flatnonzero(~(src != config.pad_id).any(axis=1))
    if empty.size:
        raise InputError(
            f"embed: row {int(empty[0])} holds only the pad id {config.pad_id}: no token to pool"
            + (f" ({empty.size} such rows)" if empty.size > 1 else "")
        )
    pooled = model.forward(src, None).pooled_output
    assert pooled is not None  # check_embeddable: the config pools
    return np.asarray(pooled, dtype=embedding_dtype(model))


def text_ids(
    tokenizer: Tokenizer, texts: Sequence[str], config: TransformerConfig
) -> list[list[int]]:
    """Each text's ids (special tokens added, truncated as the tokenizer says), checked to fit the
    model: every id below the vocabulary size, none the pad id (which the model would mask out,
    where sentence-transformers counts it), at most max_len of them."""
    rows = []
    for n, encoding in enumerate(tokenizer.encode_batch(list(texts))):
        ids = [i for i, real in zip(encoding.ids, encoding.attention_mask, strict=True) if real]
        if config.pad_id in ids:
            raise InputError(
                f"embed: text {n} holds the pad token (id {config.pad_id}), which the model masks "
                "out; remove it from the text"
            )
        if len(ids) > config.max_len:
            raise InputError(
                f"embed: text {n} has {len(ids)} tokens, more than the model's {config.max_len} "
                "positions, and the tokenizer does not truncate"
            )
        rows.append(ids)
    return rows


# Batch widths are rounded up to a multiple of this (never past max_len): a compiling framework
# (JAX's jit, TF's traced functions) builds one program per input shape, and a stream of texts
# would otherwise give nearly one shape per batch. Pad positions are masked out of attention and
# of the mean, so the width changes a row only by the rounding of a different matrix shape.
WIDTH_STEP = 16


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, max_len: int | None = None) -> np.ndarray:
    """Right-pad rows of ids to the longest rounded up to WIDTH_STEP (at most `max_len`), as
    int64 (N, S)."""
    longest = max(len(r) for r in rows)
    width = -(-longest // WIDTH_STEP) * WIDTH_STEP
    width = max(longest, min(width, max_len if max_len is not None else width))
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    for n, r in enumerate(rows):
        out[n, : len(r)] = r
    return out


def embed_texts(
    model: Model, tokenizer: Tokenizer, texts: Sequence[str], *, batch_size: int = 32
) -> np.ndarray:
    """The sentence embeddings (N, d_model) of `texts`, in their order, as sentence-transformers'
    `encode` computes them: tokenize, batch `batch_size` texts (longest first), pad with the
    config's pad id, run, pool. Every text is tokenized and checked before the first batch runs."""
    config = model.config
    check_embeddable(config)
    if isinstance(texts, str):
        raise InputError("embed: give a list of texts, not one string")
    if batch_size < 1:
        raise InputError(f"embed: batch_size must be >= 1, got {batch_size}")
    if not texts:
        return np.zeros((0, config.d_model), dtype=embedding_dtype(model))
    rows = text_ids(tokenizer, texts, config)
    order = sorted(range(len(rows)), key=lambda n: -len(rows[n]))
    longest = len(rows[order[0]])
    width = min(-(-longest // WIDTH_STEP) * WIDTH_STEP, max(longest, config.max_len))
    check_forward_fits(config, min(batch_size, len(rows)), width, 0, 1, "an embedding batch")
    out = np.empty((len(rows), config.d_model), dtype=embedding_dtype(model))
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        batch = pad_rows([rows[n] for n in chosen], config.pad_id, config.max_len)
        out[chosen] = embed_ids(model, batch)
    return out
