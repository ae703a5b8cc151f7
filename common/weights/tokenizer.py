"""The tokenizer a weight file carries: an imported model's text-to-ids step, stored with the
weights so that `rosetta embed` (and the API's `.embed`/`.generate`) take text, and give the ids
the model was trained on.

It lives in the safetensors header metadata under the key "tokenizer" (META_TOKENIZER,
docs/FORMAT.md) as the JSON of the `tokenizers` library (Hugging Face's Rust tokenizers, the ones
transformers' fast tokenizers run on): `Tokenizer.to_str()`, read back with `Tokenizer.from_str`.
That JSON holds the whole pipeline (normalizer, pre-tokenizer, model with its vocabulary and
merges, post-processor with the special tokens, truncation), so the ids need nothing else. The key
is optional: a file without it is a complete model whose ids the user supplies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.safe_read import shown
from transformer_rosetta.weights.format import META_TOKENIZER, read_header

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAX_REASON_CHARS = 200  # the library's own message, cut so that the error stays one short line


def tokenizer_metadata(tokenizer: Tokenizer) -> dict[str, str]:
    """{META_TOKENIZER: the tokenizer's JSON}: the metadata entry that stores it in a weight file
    (save_weights' extra metadata, or format.add_metadata on a written one)."""
    return {META_TOKENIZER: tokenizer.to_str()}


def parse_tokenizer(text: str, where: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` from its JSON; a WeightFileError naming `where` and the key, in
    one line, for anything the library cannot read."""
    from tokenizers import Tokenizer

    if not isinstance(text, str):
        raise WeightFileError(where, [f"metadata {META_TOKENIZER} must be JSON text"])
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for bad JSON
        reason = " ".join(str(exc).split())[:MAX_REASON_CHARS] or type(exc).__name__
        raise WeightFileError(
            where, [f"metadata {META_TOKENIZER} is not a tokenizers JSON ({reason})"]
        ) from None


def read_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer stored in weight file `path`, or None when it carries none. Only the header
    is read (the tensors are not); a header or tokenizer that cannot be read is one
    WeightFileError naming the file."""
    _, metadata = read_header(path)
    if not metadata or META_TOKENIZER not in metadata:
        return None
    return parse_tokenizer(metadata[META_TOKENIZER], shown(path))


def tokenizer_summary(tokenizer: Tokenizer) -> dict[str, object]:
    """What `rosetta inspect` reports of a stored tokenizer (never the tokenizer itself):
    its model kind, vocabulary size with the added tokens, and truncation length (None: none)."""
    truncation = tokenizer.truncation
    return {
        "model": type(tokenizer.model).__name__,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "truncation": truncation["max_length"] if truncation else None,
    }


def describe_tokenizer(tokenizer: Tokenizer) -> str:
    """One line for people: the model kind, the vocabulary size and the truncation length
    ("WordPiece, 30,522 tokens, truncates to 256")."""
    summary = tokenizer_summary(tokenizer)
    cut = f"truncates to {summary['truncation']}" if summary["truncation"] else "no truncation"
    return f"{summary['model']}, {summary['vocab_size']:,} tokens, {cut}"
