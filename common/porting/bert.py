"""Import a Hugging Face BERT folder (`config.json` + `model.safetensors`, or a `pytorch_model.bin`
read with `weights_only`), with a sentence-transformers pooling when the folder has one, as numpy,
with no framework imported here.

BERT (Devlin et al. 2019) is the encoder of "Attention Is All You Need" with these choices, each
mapped onto a field of our spec:
- encoder only: num_decoder_layers=0, no output projection (tie_output=false, output_bias=false),
  one embedding (share_embeddings=false).
- post-LN (section 3.1) with no final norm, and a LayerNorm over the summed embeddings:
  norm_position="post", final_norm=false, embedding_norm=true, eps from `layer_norm_eps` (1e-12).
- learned absolute positions of `max_position_embeddings` rows (position_kind="learned"); no
  sqrt(d_model) scale on the token embedding (scale_embeddings=false).
- segment (token type) embeddings of `type_vocab_size` rows. Our models take no segment ids:
  every token is of type 0, which is what BertModel computes when token_type_ids are all zero
  (or not given) and what single-sentence embedding feeds it.
- `hidden_act` through transformers' ACT2FN names: "gelu" is the exact erf GELU.
- the attention scales Q K^T by 1/sqrt(d_k), Eq. (1); the projections are copied unscaled.

Not part of the spec, and so dropped, always named in the import's notes (never silently):
- `pooler.dense` (BertPooler, tanh(W h_[CLS] + b), feeding next-sentence prediction and
  classification heads; sentence-transformers does not use it);
- `embeddings.position_ids`, the index buffer 0..max_len-1 that older files store (checked).
A task head (`cls.*`, `classifier.*`) is refused: save the BertModel alone.

sentence-transformers: when `modules.json` lists Transformer, Pooling (and Normalize), its
`1_Pooling/config.json` sets `pooling` ("mean", or "first" for the [CLS] token) and Normalize sets
`pooled_l2_norm`; any other module (Dense, another pooling mode) is refused by name. Without
modules.json the folder is a plain transformers model: pooling "none".

Anything else our spec cannot express is refused with a ConfigError naming the BERT key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.safe_read import FileProblem, brief, is_int, read_bytes, shown
from transformer_rosetta.porting.hf_folder import (
    CONFIG_FILE,
    HfModel,
    model_folder,
    read_config_json,
    read_folder_shapes,
    read_folder_weights,
    read_json_file,
)
from transformer_rosetta.porting.table import Rule, Table, check_counts, rows, to_canonical
from transformer_rosetta.spec.config import TransformerConfig

MODULES_FILE = "modules.json"  # sentence-transformers' pipeline: Transformer, Pooling, ...
ST_CONFIG_FILE = "sentence_bert_config.json"  # sentence-transformers' max_seq_length
VOCAB_FILE = "vocab.txt"
VOCAB_MAX_BYTES = 16 << 20  # a WordPiece vocabulary is about 1 MB even for multilingual BERT

# BertConfig's defaults (transformers 5.23, configuration_bert.py) for the keys read here;
# config.json may omit a key that equals its default.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",  # transformers 5 dropped the key: absolute only
    "is_decoder": False,
    "add_cross_attention": False,
}

HF_TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ),
        ("an integer",),
    ),
    **dict.fromkeys(
        ("hidden_dropout_prob", "attention_probs_dropout_prob", "layer_norm_eps"), ("a number",)
    ),
    **dict.fromkeys(("hidden_act", "position_embedding_type", "model_type"), ("a string",)),
    **dict.fromkeys(("is_decoder", "add_cross_attention"), ("true or false",)),
}

# Our config field -> the BERT key it comes from, to name the user's field in messages.
HF_FIELD = {
    "src_vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "num_encoder_layers": "num_hidden_layers",
    "max_len": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_eps": "layer_norm_eps",
    "activation": "hidden_act",
    "pad_id": "pad_token_id",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
}
BERT = HfModel(
    "BERT",
    "bert",
    HF_DEFAULTS,
    HF_TYPES,
    HF_FIELD,
    id_lists=False,  # BertModel's pad_token_id is its embedding's padding_idx: one integer
)

# Stored, but not part of the spec: dropped, and named in the import's notes.
POOLER = ("pooler.dense.weight", "pooler.dense.bias")
POSITION_IDS = "embeddings.position_ids"
PREFIX = "bert."  # BertFor* models keep the encoder under `bert.`


# -- reading the folder --------------------------------------------------------------------------


def special_ids(folder: Path, hf: Mapping[str, Any]) -> tuple[dict[str, int], list[str]]:
    """bos_id and eos_id: config.json's bos/eos_token_id when it has them, else the [CLS] and [SEP]
    rows of vocab.txt. An encoder-only model never decodes, so they only label the vocabulary; a
    folder with neither gets two placeholder ids (noted)."""
    found = {
        ours: hf[key]
        for ours, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"))
        if is_int(hf.get(key))
    }
    notes = []
    if len(found) < 2 and os.path.lexists(folder / VOCAB_FILE):
        try:
            tokens = read_bytes(folder / VOCAB_FILE, "a WordPiece vocab.txt", VOCAB_MAX_BYTES)
        except FileProblem as exc:
            raise ConfigError([str(exc)]) from None
        index = {t: i for i, t in enumerate(tokens.decode("utf-8", "replace").splitlines())}
        for ours, token in (("bos_id", "[CLS]"), ("eos_id", "[SEP]")):
            if ours not in found and token in index:
                found[ours] = index[token]
                notes.append(f"{ours} {index[token]}: {token} in {VOCAB_FILE}")
    if len(found) < 2:
        pad = BERT.get(hf, "pad_token_id")
        free = [i for i in range(3) if i != pad and i not in found.values()]
        for ours in ("bos_id", "eos_id"):
            if ours not in found:
                found[ours] = free.pop(0)
                notes.append(
                    f"{ours} {found[ours]}: a placeholder (no bos/eos in config.json, no "
                    f"{VOCAB_FILE}); an encoder-only model never decodes"
                )
    return found, notes


# -- sentence-transformers ------------------------------------------------------------------------

# sentence-transformers' Pooling modes -> ours; the others have no field in the spec.
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}
UNSUPPORTED_POOLING = {
    "pooling_mode_max_tokens": "max over tokens",
    "pooling_mode_mean_sqrt_len_tokens": "sum / sqrt(length)",
    "pooling_mode_weightedmean_tokens": "position-weighted mean",
    "pooling_mode_lasttoken": "the last token",
}
# `pooling_mode` as newer sentence-transformers may write it.
POOLING_NAMES = {"mean": "mean", "cls": "first"}


def sentence_pooling(folder: Path, d_model: int) -> tuple[dict[str, Any], list[str]]:
    """({"pooling", "pooled_l2_norm"}, notes) from sentence-transformers' modules.json, its
    Pooling module's config.json and a Normalize module; pooling "none" without modules.json.
    Every module or mode the spec cannot compute is refused by name (ConfigError)."""
    if not os.path.lexists(folder / MODULES_FILE):
        return {"pooling": "none", "pooled_l2_norm": False}, [
            f"pooling none: no {MODULES_FILE} (not a sentence-transformers folder)"
        ]
    modules = read_json_file(folder / MODULES_FILE, "sentence-transformers' modules.json", list)
    problems: list[str] = []
    pooling, l2, kinds = "none", False, []
    for n, module in enumerate(modules):
        kind = module.get("type") if isinstance(module, dict) else None
        if not isinstance(kind, str):
            problems.append(f"{MODULES_FILE}: module {n} has no type")
            continue
        name = kind.rsplit(".", 1)[-1]
        where = module.get("path", "")
        kinds.append(name)
        if name == "Transformer" and where not in ("", "."):
            problems.append(
                f"{MODULES_FILE}: the Transformer module is in {brief(where)}; convert that folder "
                "(older sentence-transformers layout)"
            )
        elif name == "Transformer" and n != 0:
            problems.append(f"{MODULES_FILE}: the Transformer module must come first")
        elif name == "Pooling" and isinstance(where, str):
            pooling = _pooling_mode(folder / where / CONFIG_FILE, d_model, problems)
        elif name == "Normalize" and kinds[:-1] and kinds[-2] == "Pooling":
            l2 = True
        elif name not in ("Transformer", "Pooling"):
            problems.append(
                f"{MODULES_FILE}: module {n} ({kind}) has no place in the spec; only Transformer, "
                "Pooling and a Normalize after the Pooling are imported"
            )
    if problems:
        raise ConfigError(problems)
    what = {"mean": "mean over the non-pad tokens", "first": "the [CLS] token", "none": "none"}
    notes = [
        f"pooling {pooling} ({what[pooling]}){', then L2 norm' if l2 else ''}: from {MODULES_FILE}"
    ]
    if os.path.lexists(folder / ST_CONFIG_FILE):
        st = read_json_file(
            folder / ST_CONFIG_FILE, "sentence-transformers' sentence_bert_config.json"
        )
        if is_int(st.get("max_seq_length")):
            notes.append(
                f"sentence-transformers truncates inputs to max_seq_length {st['max_seq_length']} "
                f"({ST_CONFIG_FILE}); the stored tokenizer (rosetta embed) truncates there too, "
                "while ids given to rosetta forward are taken as they are"
            )
    return {"pooling": pooling, "pooled_l2_norm": l2}, notes


def _pooling_mode(path: Path, d_model: int, problems: list[str]) -> str:
    config = read_json_file(path, "sentence-transformers' Pooling config.json")
    modes = [k for k in (*POOLING_MODES, *UNSUPPORTED_POOLING) if config.get(k) is True]
    if isinstance(config.get("pooling_mode"), str):  # newer files may name the mode
        mode = config["pooling_mode"]
        if mode in POOLING_NAMES:
            modes = [k for k, v in POOLING_MODES.items() if v == POOLING_NAMES[mode]]
        else:
            problems.append(f"{shown(path)}: pooling_mode {brief(mode)} has no field in the spec")
            return "none"
    dim = config.get("word_embedding_dimension", d_model)
    if dim != d_model:
        problems.append(
            f"{shown(path)}: word_embedding_dimension {brief(dim)} is not the model's "
            f"hidden_size {d_model}"
        )
    if config.get("include_prompt", True) is not True:
        problems.append(
            f"{shown(path)}: include_prompt false (the prompt's tokens left out of the pool) has "
            "no field in the spec; the pool covers every non-pad token"
        )
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        unsupported = [f"{k} ({UNSUPPORTED_POOLING[k]})" for k in modes if k in UNSUPPORTED_POOLING]
        if len(modes) > 1:
            problems.append(
                f"{shown(path)}: {', '.join(modes)} are all on (sentence-transformers "
                "concatenates them); the spec pools one way"
            )
        elif unsupported:
            problems.append(f"{shown(path)}: {unsupported[0]} has no field in the spec")
        else:
            problems.append(f"{shown(path)}: no pooling mode is on")
        return "none"
    return POOLING_MODES[modes[0]]


# -- the config ---------------------------------------------------------------------------------


def bert_config(
    hf: Mapping[str, Any], ids: Mapping[str, int], pooling: Mapping[str, Any]
) -> TransformerConfig:
    """Our config for the model that transformers' BertModel builds from `hf` (config.json), with
    the special ids of `special_ids` and the pooling of `sentence_pooling`.

    The mapping is in the module docstring. Every field it cannot express is refused, all at once,
    in one ConfigError naming the BERT key; a key of the wrong JSON type is refused first."""
    BERT.check_types(hf)
    get = BERT.get
    problems = BERT.model_type_problems(hf)
    kind = get(hf, "position_embedding_type")
    if kind != "absolute":
        problems.append(
            f"position_embedding_type: {brief(kind)} is not supported; the spec's learned "
            "positions are BERT's 'absolute' table (relative position scores have no field)"
        )
    for key, what in (("is_decoder", "causal self-attention"), ("add_cross_attention", "")):
        if get(hf, key):
            problems.append(
                f"{key}: true is not supported; --from bert imports the bidirectional encoder "
                f"(BertModel){' without ' + what if what else ''}"
            )
    activation = BERT.activation(hf, "hidden_act", problems)
    pad = BERT.token_id(hf, "pad_token_id", problems)
    if problems:
        raise ConfigError(problems)

    vocab = get(hf, "vocab_size")
    return BERT.config(
        {
            "src_vocab_size": vocab,
            "tgt_vocab_size": vocab,  # unused by an encoder-only model; bos_id indexes it
            "d_model": get(hf, "hidden_size"),
            "num_heads": get(hf, "num_attention_heads"),
            "d_ff": get(hf, "intermediate_size"),
            "num_encoder_layers": get(hf, "num_hidden_layers"),
            "max_len": get(hf, "max_position_embeddings"),
            "dropout": get(hf, "hidden_dropout_prob"),
            "attention_dropout": get(hf, "attention_probs_dropout_prob"),
            **TABLE.fixed,
            "layer_norm_eps": get(hf, "layer_norm_eps"),
            "activation": activation,
            "type_vocab_size": get(hf, "type_vocab_size"),
            "pad_id": pad,
            **ids,
            **pooling,
        }
    )


# -- the tensors ---------------------------------------------------------------------------------

PROJECTIONS = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "output": "attention.output.dense",
}
NORMS = {
    "encoder.embedding_norm": "{prefix}embeddings.LayerNorm",
    "encoder.layers.{i}.self_attention_norm": "{prefix}encoder.layer.{i}.attention.output.LayerNorm",
    "encoder.layers.{i}.feed_forward_norm": "{prefix}encoder.layer.{i}.output.LayerNorm",
}
DENSES = {
    "feed_forward.intermediate": "intermediate.dense",
    "feed_forward.output": "output.dense",
}


def _rules() -> list[Rule]:
    out = [
        Rule("encoder.embedding", "{prefix}embeddings.word_embeddings.weight"),
        Rule("encoder.position_embedding", "{prefix}embeddings.position_embeddings.weight"),
        Rule("encoder.token_type_embedding", "{prefix}embeddings.token_type_embeddings.weight"),
    ]
    for here, there in NORMS.items():
        # Checkpoints converted from TensorFlow BERT name the LayerNorm's gain and bias gamma and
        # beta; transformers renames them on load, and so do we.
        out.append(Rule(f"{here}.scale", f"{there}.weight", fallbacks=(f"{there}.gamma",)))
        out.append(Rule(f"{here}.bias", f"{there}.bias", fallbacks=(f"{there}.beta",)))
    layer, there = "encoder.layers.{i}", "{prefix}encoder.layer.{i}"
    for proj, module in PROJECTIONS.items():
        here = f"{layer}.self_attention.{proj}"
        out.append(Rule(f"{here}.kernel", f"{there}.{module}.weight", ("transpose", "heads")))
        bias = () if proj == "output" else ("heads",)
        out.append(Rule(f"{here}.bias", f"{there}.{module}.bias", bias))
    for ours, module in DENSES.items():
        out.append(Rule(f"{layer}.{ours}.kernel", f"{there}.{module}.weight", ("transpose",)))
        out.append(Rule(f"{layer}.{ours}.bias", f"{there}.{module}.bias"))
    return out


_HEAD = (
    "is a task head, not part of the spec; save the BertModel alone (model.bert.save_pretrained)"
)
TABLE = Table(
    kind="bert",
    model="a BERT model",
    rules=tuple(_rules()),
    # What BertModel's code fixes and no tensor would catch (the sizes are read from config.json).
    fixed={
        "num_decoder_layers": 0,
        "norm_position": "post",
        "final_norm": False,
        "norm_kind": "layer_norm",
        "embedding_norm": True,
        "position_kind": "learned",
        "scale_embeddings": False,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": False,
        "attention_bias": True,
    },
    # What the shapes tell, checked against config.json (check_counts) before any work.
    sizes={
        "src_vocab_size": ("{prefix}embeddings.word_embeddings.weight", 0),
        "d_model": ("{prefix}embeddings.word_embeddings.weight", 1),
        "max_len": ("{prefix}embeddings.position_embeddings.weight", 0),
        "type_vocab_size": ("{prefix}embeddings.token_type_embeddings.weight", 0),
        "d_ff": ("{prefix}encoder.layer.0.intermediate.dense.weight", 0),
    },
    optional_prefix=PREFIX,
    hints={
        "cls.predictions.bias": f"cls.predictions.* (the masked-LM head) {_HEAD}",
        "cls.seq_relationship.weight": f"cls.seq_relationship.* (next-sentence) {_HEAD}",
        "classifier.weight": f"classifier.* {_HEAD}",
    },
)


@dataclass(frozen=True)
class BertImport:
    """An imported BERT folder: our config, the canonical tensors, and what the import decided
    that the tensors do not show (what it dropped, where pooling and the ids came from)."""

    config: TransformerConfig
    tensors: dict[str, np.ndarray]
    notes: tuple[str, ...]


def split_dropped(
    tensors: Mapping[str, np.ndarray], config: TransformerConfig, source: str
) -> tuple[dict[str, np.ndarray], list[str]]:
    """(the tensors without the pooler and position_ids, a note for each dropped). A stored
    position_ids must be 0..n-1 with n <= max_len (WeightFileError otherwise)."""
    prefix = PREFIX if any(k.startswith(PREFIX) for k in tensors) else ""
    kept = dict(tensors)
    notes = []
    pooler = [prefix + k for k in POOLER if prefix + k in kept]
    for key in pooler:
        del kept[key]
    if pooler:
        notes.append(
            f"dropped {', '.join(pooler)}: BertPooler (tanh of a dense layer on the [CLS] state, "
            "for next-sentence and classification heads) is not part of the spec"
        )
    key = prefix + POSITION_IDS
    if key in kept:
        ids = np.asarray(kept.pop(key))
        n = ids.shape[-1] if ids.ndim else 0
        if (
            ids.ndim not in (1, 2)
            or n > config.max_len
            or not np.array_equal(ids.reshape(-1), np.arange(n))
        ):
            raise WeightFileError(
                source,
                [f"{key}: not the positions 0..{config.max_len - 1}; other position ids have no "
                 "field in the spec"],
            )  # fmt: skip
        notes.append(f"dropped {key}: the index buffer 0..{n - 1}, which our positions compute")
    return kept, notes


def bert_to_canonical(
    tensors: Mapping[str, np.ndarray], config: TransformerConfig, source: str = "<BERT weights>"
) -> tuple[dict[str, np.ndarray], list[str]]:
    """(canonical tensors in canonical order, notes on what was dropped) from a BertModel state
    dict (names as in its model.safetensors, with or without `bert.`) for `config` from
    `bert_config`. Every missing, unexpected, wrong-shaped and wrong-dtype tensor is reported at
    once, in one WeightFileError labelled `source`."""
    kept, notes = split_dropped(tensors, config, source)
    return to_canonical(TABLE, kept, config, source), notes


def import_bert(path: str | Path) -> BertImport:
    """Read a BERT folder whole: config.json, the weights, sentence-transformers' pooling."""
    folder = model_folder(path, "BERT")
    hf = read_config_json(folder)
    BERT.check_types(hf)
    d_model = BERT.get(hf, "hidden_size")
    pooling, pooling_notes = sentence_pooling(folder, d_model)
    ids, id_notes = special_ids(folder, hf)
    config = bert_config(hf, ids, pooling)
    # Every count of config.json against the header's shapes before any tensor is read or any
    # name is built per layer.
    check_counts(TABLE, config, read_folder_shapes(folder), BERT.name_keys)
    tensors, dropped = bert_to_canonical(read_folder_weights(folder), config, shown(folder))
    notes = (*dropped, *pooling_notes, *id_notes)
    return BertImport(config, tensors, notes)


def mapping_table(config: TransformerConfig, patterns: bool = False) -> list[tuple[str, str, str]]:
    """(BERT name, canonical name, steps) for every tensor a BertModel file may hold, in
    canonical order, then the alternative names and what is dropped (`patterns` keeps {i} in the
    names). For docs/PORTING.md."""
    dropped = [
        (POSITION_IDS, "(none: computed)", "optional; checked to be 0..max_len-1, then dropped"),
        *((k, "(none: dropped)", "optional; BertPooler, not part of the spec") for k in POOLER),
    ]
    return [*rows(TABLE, config, patterns=patterns), *dropped]
