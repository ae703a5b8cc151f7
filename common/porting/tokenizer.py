"""The tokenizer of an imported model's folder, built with the `tokenizers` library (the Rust
tokenizers that transformers' fast tokenizers run on), so that `rosetta convert` can store it
with the weights (transformer_rosetta.weights.tokenizer) and the ids match transformers'.

Where it comes from, in order:
- tokenizer.json: the library's own file, read as it is (what AutoTokenizer reads first);
- vocab.txt (+ tokenizer_config.json's do_lower_case, tokenize_chinese_chars, strip_accents and
  special tokens): a BERT WordPiece tokenizer, the pipeline transformers' BertTokenizer builds
  (tokenizers' BertWordPieceTokenizer: BertNormalizer, BertPreTokenizer, WordPiece, [CLS] A [SEP]);
- vocab.json + merges.txt (+ tokenizer_config.json's add_prefix_space and special tokens): a
  GPT-2 byte-level BPE tokenizer, the pipeline transformers' GPT2Tokenizer builds (tokenizers'
  ByteLevelBPETokenizer, <|endoftext|> a special token).

Padding is switched off (the model's pad id pads a batch: transformer_rosetta.app.embedding).
Truncation is what sentence-transformers does for an encoder: `max_seq_length` of
sentence_bert_config.json when the folder has one (all-MiniLM-L6-v2: 256, where its
tokenizer.json says 128: sentence-transformers passes its own max_length on every call), else the
tokenizer_config's model_max_length, never more than the model's positions. A decoder's tokenizer
does not truncate (a prompt too long for the model is refused by name where it is used).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformer_rosetta.files.os_names import library_path
from transformer_rosetta.files.safe_read import (
    MAX_CONFIG_BYTES,
    FileProblem,
    brief,
    is_int,
    json_depth_problem,
    json_type,
    parse_json,
    read_bytes,
)
from transformer_rosetta.spec.config import TransformerConfig

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
WORDPIECE_VOCAB = "vocab.txt"
BPE_VOCAB, BPE_MERGES = "vocab.json", "merges.txt"
SOURCES = (TOKENIZER_JSON, WORDPIECE_VOCAB, BPE_VOCAB)  # in the order they are looked for
TOKENIZER_CONFIG = "tokenizer_config.json"
ST_CONFIG = "sentence_bert_config.json"  # sentence-transformers' max_seq_length
ST_MODULES = "modules.json"
MODEL_CONFIG = "config.json"
# A tokenizer file this large is not a tokenizer (a multilingual tokenizer.json is ~17 MB).
MAX_TOKENIZER_BYTES = 64 << 20
MAX_REASON_CHARS = 200

# transformers' defaults (BertTokenizer, GPT2Tokenizer) for what tokenizer_config.json may omit.
BERT_SPECIALS = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}
GPT2_SPECIALS = {
    "unk_token": "<|endoftext|>",
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
}
# Position-table sizes under the names Hugging Face configs use (BERT, GPT-2, older GPT-2).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
ENCODER_TYPES = ("bert",)  # config.json model_type of the encoder-only folders rosetta imports


def _library_problem(exc: Exception) -> str:
    """The library's own message, on one short line."""
    return " ".join(str(exc).split())[:MAX_REASON_CHARS] or type(exc).__name__


def _read_text(path: Path, what: str, max_bytes: int = MAX_TOKENIZER_BYTES) -> str:
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileProblem(f"not UTF-8 text (byte {exc.start})", path) from None


def _read_json(path: Path, what: str, default: Any = None) -> Any:
    """A JSON object file of the folder, or `default` when it is absent. Integers of any length
    are read: transformers writes tokenizer_config.json's model_max_length as int(1e30), 31
    digits, which safe_read.parse_json refuses (its limit guards config fields, and only a few
    keys of these files are read here, each type-checked where it is used)."""
    if not os.path.lexists(path):
        return default
    text = _read_text(path, what, MAX_CONFIG_BYTES)
    problem = json_depth_problem(text)
    if problem:
        raise FileProblem(f"not usable JSON ({problem})", path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileProblem(f"not valid JSON ({exc.msg} at line {exc.lineno})", path) from None
    except (RecursionError, ValueError) as exc:
        raise FileProblem(f"not usable JSON ({type(exc).__name__})", path) from None
    if not isinstance(data, dict):
        raise FileProblem(f"must hold a JSON object, got {json_type(data)}", path)
    return data


def parse_json_file(path: Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    try:
        return parse_json(read_bytes(path, what, max_bytes))
    except FileProblem as exc:
        raise FileProblem(exc.problem, path) from None


def _token(config: Mapping[str, Any], key: str, default: str | None) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    value = config.get(key, default)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise FileProblem(f"{key} must be a token (a string), got {brief(value)}")


# -- the three sources -----------------------------------------------------------------------


def _from_tokenizer_json(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    text = _read_text(path, "a tokenizers tokenizer.json")
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception
        raise FileProblem(f"not a tokenizers JSON ({_library_problem(exc)})", path) from None


def _from_wordpiece(folder: Path, settings: Mapping[str, Any]) -> Tokenizer:
    """BERT's WordPiece, as transformers' BertTokenizer builds it from vocab.txt."""
    from tokenizers.implementations import BertWordPieceTokenizer

    path = folder / WORDPIECE_VOCAB
    text = _read_text(path, "a WordPiece vocab.txt")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    vocab = {token: i for i, token in enumerate(lines)}  # a repeated token: its last line
    specials = {k: _token(settings, k, v) for k, v in BERT_SPECIALS.items()}
    absent = [t for k, t in specials.items() if k != "mask_token" and t not in vocab]
    if absent:
        raise FileProblem(
            f"has no {', '.join(map(str, absent))} line; a BERT vocabulary does", path
        )
    flags = {}
    for key, default in (("do_lower_case", True), ("tokenize_chinese_chars", True)):
        value = settings.get(key, default)
        if not isinstance(value, bool):
            raise FileProblem(f"{key} must be true or false, got {brief(value)}")
        flags[key] = value
    strip_accents = settings.get("strip_accents")
    if strip_accents is not None and not isinstance(strip_accents, bool):
        raise FileProblem(f"strip_accents must be true, false or null, got {brief(strip_accents)}")
    wordpiece = BertWordPieceTokenizer(
        vocab,
        **specials,  # type: ignore[arg-type]
        clean_text=True,
        handle_chinese_chars=flags["tokenize_chinese_chars"],
        strip_accents=strip_accents,
        lowercase=flags["do_lower_case"],
    )
    return wordpiece._tokenizer


def _from_bpe(folder: Path, settings: Mapping[str, Any]) -> Tokenizer:
    """GPT-2's byte-level BPE, as transformers' GPT2Tokenizer builds it from vocab.json and
    merges.txt; its special tokens (<|endoftext|>) are matched whole before the BPE runs."""
    from tokenizers import models
    from tokenizers.implementations import ByteLevelBPETokenizer

    vocab_path, merges_path = folder / BPE_VOCAB, folder / BPE_MERGES
    vocab = parse_json_file(vocab_path, "a BPE vocab.json", MAX_TOKENIZER_BYTES)
    if not isinstance(vocab, dict) or not all(is_int(i) for i in vocab.values()):
        raise FileProblem("must hold a JSON object of token: id", vocab_path)
    read_bytes(merges_path, "a BPE merges.txt", MAX_TOKENIZER_BYTES)  # a regular file, not huge
    try:
        # The library's Rust takes names as UTF-8: one that is not goes by its open file's.
        with library_path(vocab_path) as vocab_name, library_path(merges_path) as merges_name:
            vocab, merges = models.BPE.read_file(vocab_name, merges_name)
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception
        raise FileProblem(f"not a BPE merges file ({_library_problem(exc)})", merges_path) from None
    prefix_space = settings.get("add_prefix_space", False)
    if not isinstance(prefix_space, bool):
        raise FileProblem(f"add_prefix_space must be true or false, got {brief(prefix_space)}")
    try:
        bpe = ByteLevelBPETokenizer(vocab, merges, add_prefix_space=prefix_space)
    except Exception as exc:  # noqa: BLE001 - a merge of tokens the vocabulary lacks
        raise FileProblem(
            f"does not fit {BPE_VOCAB} ({_library_problem(exc)})", merges_path
        ) from None
    tokenizer = bpe._tokenizer
    tokenizer.post_processor = None  # GPT2Tokenizer adds no BOS/EOS to the ids
    specials = {k: _token(settings, k, v) for k, v in GPT2_SPECIALS.items()}
    specials["pad_token"] = _token(settings, "pad_token", None)
    tokenizer.add_special_tokens(sorted({t for t in specials.values() if t is not None}))
    return tokenizer


def _add_declared_tokens(tokenizer: Tokenizer, settings: Mapping[str, Any], where: Path) -> None:
    """tokenizer_config.json's added_tokens_decoder ({id: {content, special}}), in id order,
    each checked to land on its declared id."""
    from tokenizers import AddedToken

    declared = settings.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise FileProblem(
            f"added_tokens_decoder must be an object, got {json_type(declared)}", where
        )
    entries = []
    for key, entry in declared.items():
        if not (
            key.isdecimal() and isinstance(entry, dict) and isinstance(entry.get("content"), str)
        ):
            raise FileProblem(
                f"added_tokens_decoder entry {brief(key)} is not id: {{content}}", where
            )
        entries.append((int(key), entry))
    for token_id, entry in sorted(entries, key=lambda e: e[0]):
        token = AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not entry.get("special", False))),
        )
        if entry.get("special", False):
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(entry["content"]) != token_id:
            raise FileProblem(
                f"added token {brief(entry['content'])} is declared as id {token_id}, but the "
                f"vocabulary gives it {tokenizer.token_to_id(entry['content'])}",
                where,
            )


# -- truncation -------------------------------------------------------------------------------


def _positions(folder: Path, config: TransformerConfig | None) -> int | None:
    """How many positions the model has: its learned table's rows, else config.json's."""
    if config is not None and config.position_kind == "learned":
        return config.max_len
    hf = _read_json(folder / MODEL_CONFIG, "a Hugging Face config.json", {})
    for key in POSITION_KEYS:
        if is_int(hf.get(key)) and hf[key] > 0:
            return int(hf[key])
    return None if config is None else config.max_len


def _is_encoder(folder: Path, config: TransformerConfig | None) -> bool:
    if config is not None:
        return config.kind == "encoder_only"
    if os.path.lexists(folder / ST_CONFIG) or os.path.lexists(folder / ST_MODULES):
        return True
    hf = _read_json(folder / MODEL_CONFIG, "a Hugging Face config.json", {})
    return hf.get("model_type") in ENCODER_TYPES


def truncation_length(
    folder: Path, settings: Mapping[str, Any], config: TransformerConfig | None = None
) -> int | None:
    """The length sentence-transformers cuts an encoder's inputs to (None: a decoder, no cut):
    sentence_bert_config.json's max_seq_length, else tokenizer_config.json's model_max_length
    (a sentence-transformers Transformer module's own fallback), at most the model's positions."""
    if not _is_encoder(folder, config):
        return None
    limits = []
    path = folder / ST_CONFIG
    st = _read_json(path, "sentence-transformers' sentence_bert_config.json", {})
    if "max_seq_length" in st and st["max_seq_length"] is not None:
        if not (is_int(st["max_seq_length"]) and st["max_seq_length"] > 0):
            raise FileProblem(
                f"max_seq_length must be an integer >= 1, got {brief(st['max_seq_length'])}", path
            )
        limits.append(int(st["max_seq_length"]))
    elif is_int(settings.get("model_max_length")) and settings["model_max_length"] > 0:
        limits.append(int(settings["model_max_length"]))
    positions = _positions(folder, config)
    if positions is not None:
        limits.append(positions)
    return min(limits) if limits else None


# -- the public entry ----------------------------------------------------------------------------


def folder_tokenizer(folder: Path, *, config: TransformerConfig | None = None) -> Tokenizer | None:
    """The tokenizer of a Hugging Face / sentence-transformers model folder, or None when it
    holds none (tokenizer.json, else vocab.txt, else vocab.json + merges.txt; see the module
    docstring). `config`, the model imported from the folder, sets whether it is an encoder
    (truncated) and its positions; without it config.json says. A malformed file is one
    FileProblem (a RosettaError) naming it."""
    folder = Path(folder)
    has = {name: os.path.lexists(folder / name) for name in (*SOURCES, BPE_MERGES)}
    if not (has[TOKENIZER_JSON] or has[WORDPIECE_VOCAB] or (has[BPE_VOCAB] and has[BPE_MERGES])):
        return None  # nothing else of the folder is read (a Marian folder's files stay unread)
    settings = _read_json(folder / TOKENIZER_CONFIG, "a tokenizer_config.json", {})
    try:
        if has[TOKENIZER_JSON]:
            tokenizer = _from_tokenizer_json(folder / TOKENIZER_JSON)
        elif has[WORDPIECE_VOCAB]:
            tokenizer = _from_wordpiece(folder, settings)
            _add_declared_tokens(tokenizer, settings, folder / TOKENIZER_CONFIG)
        else:
            tokenizer = _from_bpe(folder, settings)
            _add_declared_tokens(tokenizer, settings, folder / TOKENIZER_CONFIG)
    except FileProblem as exc:
        if exc.path is None:  # a problem of tokenizer_config.json's values
            raise FileProblem(exc.problem, folder / TOKENIZER_CONFIG) from None
        raise
    tokenizer.no_padding()
    limit = truncation_length(folder, settings, config)
    if limit is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length=limit)
    return tokenizer


def tokenizer_problems(tokenizer: Tokenizer, config: TransformerConfig) -> list[str]:
    """What makes `tokenizer` unfit for the model of `config`: ids beyond its embedding's rows."""
    rows = config.src_vocab_size if config.has_encoder else config.tgt_vocab_size
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= rows:
        return [
            f"the tokenizer ({size:,} tokens) gives ids up to {largest}, but the model's "
            f"embedding has {rows:,} rows"
        ]
    return []


def source_tokenizer(src: Path, from_kind: str, config: TransformerConfig) -> Tokenizer | None:
    """The tokenizer a conversion's source carries: a model folder's files, or the one a weight
    file in the shared format stores; None for everything else. Checked against `config`
    (FileProblem naming the source)."""
    if src.is_dir():
        tokenizer = folder_tokenizer(src, config=config)
    elif from_kind == "rosetta":
        from transformer_rosetta.weights.tokenizer import read_tokenizer

        tokenizer = read_tokenizer(src)
    else:
        return None
    if tokenizer is not None:
        problems = tokenizer_problems(tokenizer, config)
        if problems:
            raise FileProblem("; ".join(problems), src)
    return tokenizer


def carried_note(tokenizer: Tokenizer, to_kind: str) -> str:
    """A conversion note: the tokenizer that travels with the weights, or why it cannot."""
    from transformer_rosetta.weights.tokenizer import describe_tokenizer

    what = describe_tokenizer(tokenizer)
    if to_kind == "rosetta":
        return f"tokenizer stored in the file's metadata ({what})"
    return f"tokenizer not stored ({what}): only a .safetensors in the shared format carries one"
