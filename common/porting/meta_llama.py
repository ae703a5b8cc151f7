"""Import Meta's original Llama layout, `--from meta-llama`: a folder of `params.json` and one
`consolidated.NN.pth` per model-parallel rank, as Meta's download gives it (read with
`weights_only`: no pickle code runs), with no framework imported here.

The model is meta-llama/llama's `llama/model.py` (Llama 2; Llama 3's is the same code with other
sizes): `tok_embeddings`, pre-norm `TransformerBlock`s `h = x + attention(attention_norm(x))`,
`out = h + feed_forward(ffn_norm(h))`, a final `norm` and `output`, its own matrix; every norm an
RMSNorm (`_norm(x.float()).type_as(x) * weight`, eps `norm_eps`); no bias anywhere; `FeedForward`
is `w2(silu(w1(x)) * w3(x))` with hidden size `multiple_of * ceil(int(ffn_dim_multiplier *
int(2 * 4 dim / 3)) / multiple_of)` (`meta_d_ff`); `Attention` has `n_heads` query heads and
`n_kv_heads` key/value heads of `dim / n_heads` (repeat_kv), scores scaled by 1/sqrt(head_dim).

Its rotary positions (`apply_rotary_emb`) view each head's `(x_2i, x_2i+1)` as one complex number
and multiply it by e^(i pos theta^(-2i/d_k)): the interleaved layout. They import in the
half-split layout of transformers (the default): the table's `rotary_permute` step reorders the
rows of wq and wk within each head, Hugging Face's convert_llama_weights_to_hf.py permute, so
that the pair (2i, 2i+1) lands on (i, i + d_k/2), and the same weights compute the same logits
(parity_tests/porting/test_meta_llama.py). With `--config '{"rotary_layout": "interleaved"}'`
they import as stored, unpermuted, to the spec's interleaved layout: the same function again.

Several ranks (13B: 2, 70B: 8) are joined as Hugging Face's converter joins them: the column-
parallel wq, wk, wv, w1, w3 and output along their rows, the row-parallel wo and w2 along their
columns, tok_embeddings along the axis its shards are split on (Llama 2's ParallelEmbedding
splits the model dimension, Llama 3's VocabParallelEmbedding the vocabulary), and the norms,
held whole by every rank, checked equal.

params.json does not tell the special ids (they are the tokenizer's): `--config` gives bos_id
and eos_id (Llama 2: 1 and 2; Llama 3: 128000 and 128001); Meta's model has no pad token, so
pad_id is the virtual pad, one past the vocabulary (common/porting/gpt.py, no_pad: nothing is
masked), unless given. Nor does it tell the
context length (a runtime argument, max_seq_len): max_len is 2048, ModelArgs' default, unless
given; rotary positions run past it. What the spec cannot hold is refused by name: Llama 3.1's
`use_scaled_rope`, and any key of params.json this importer does not know (a vision or MoE
model's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import BackendUnavailable, ConfigError, WeightFileError
from transformer_rosetta.files.safe_read import (
    FileProblem,
    MissingFile,
    regular_file,
    shown,
)
from transformer_rosetta.porting.hf_folder import HfModel, model_folder, read_json_file
from transformer_rosetta.porting.llama import (
    LlamaImport,
    folder_config,
    table_for,
)
from transformer_rosetta.porting.table import Rule, Table, check_counts, rows, to_canonical
from transformer_rosetta.spec.config import TransformerConfig

PARAMS_FILE = "params.json"
SHARD = re.compile(r"consolidated\.(\d{2})\.pth")
# ModelArgs' defaults (meta-llama/llama, llama/model.py) for what params.json may omit; rope_theta
# as Hugging Face's converter reads it (params.get("rope_theta", 10000.0)).
PARAMS_DEFAULTS: dict[str, Any] = {
    "n_kv_heads": None,  # n_heads
    "vocab_size": -1,  # "defined later by tokenizer": then the tensors tell it
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "use_scaled_rope": False,
    "max_seq_len": 2048,  # a runtime argument of Llama.build, never in Meta's params.json
}
PARAMS_TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"), ("an integer",)),
    **dict.fromkeys(("n_kv_heads", "max_batch_size", "max_seq_len"), ("an integer", "null")),
    "ffn_dim_multiplier": ("a number", "null"),
    **dict.fromkeys(("norm_eps", "rope_theta"), ("a number",)),
    "use_scaled_rope": ("true or false",),
}
REQUIRED = ("dim", "n_layers", "n_heads")
HF_FIELD = {  # our field -> the params.json key, for messages
    "d_model": "dim",
    "num_decoder_layers": "n_layers",
    "num_heads": "n_heads",
    "num_kv_heads": "n_kv_heads",
    "d_ff": "multiple_of, ffn_dim_multiplier",
    "src_vocab_size": "vocab_size",
    "tgt_vocab_size": "vocab_size",
    "layer_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "max_len": "max_seq_len",
    "bos_id": "bos_id",
    "eos_id": "eos_id",
}
PARAMS = HfModel("Meta Llama", "", PARAMS_DEFAULTS, PARAMS_TYPES, HF_FIELD)


def meta_d_ff(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """FeedForward's hidden size as llama/model.py computes it from hidden_dim = 4 * dim:
    int(2 * hidden_dim / 3), times ffn_dim_multiplier (then int) when given, rounded up to a
    multiple of multiple_of. 7B: 11008; Llama 3 8B (1.3, 1024): 14336."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def params_fields(params: Any) -> dict[str, Any]:
    """Our config fields from params.json (or its "model" object, as some releases nest it): the
    vocabulary None where params.json says -1 (the tensors tell it), max_len only where it has
    max_seq_len. Every key the spec cannot hold or this importer does not know is refused in one
    ConfigError."""
    params = params.get("model", params) if isinstance(params, Mapping) else params
    PARAMS.check_types(params)
    get = PARAMS.get
    problems = [f"{k}: params.json must give it" for k in REQUIRED if k not in params]
    unknown = sorted(k for k in params if k not in PARAMS_TYPES and k not in REQUIRED)
    if unknown:
        problems.append(
            f"params.json: unknown key {', '.join(map(repr, unknown))}; --from meta-llama reads "
            f"{', '.join(sorted({*REQUIRED, *PARAMS_TYPES}))} (a vision or mixture-of-experts "
            "model is not a Llama the spec holds)"
        )
    if get(params, "use_scaled_rope"):
        problems.append(
            "use_scaled_rope: true rescales the rotary frequencies (Llama 3.1's scaling), which "
            "the spec (angle pos * rope_theta^(-2i/d_k)) cannot express"
        )
    multiple_of, multiplier = get(params, "multiple_of"), get(params, "ffn_dim_multiplier")
    if multiple_of is not None and multiple_of < 1:
        problems.append(f"multiple_of: must be >= 1, got {multiple_of}")
    vocab = get(params, "vocab_size")
    vocab = None if vocab == -1 else vocab
    if problems:
        raise ConfigError(problems)
    dim, heads, kv = params["dim"], params["n_heads"], get(params, "n_kv_heads")
    fields: dict[str, Any] = {
        **META_TABLE.fixed,
        "src_vocab_size": vocab,
        "tgt_vocab_size": vocab,
        "d_model": dim,
        "num_heads": heads,
        "num_kv_heads": None if kv is None or kv == heads else kv,
        "d_ff": meta_d_ff(dim, multiple_of, multiplier),
        "num_decoder_layers": params["n_layers"],
        **({"max_len": params["max_seq_len"]} if params.get("max_seq_len") else {}),
        "layer_norm_eps": get(params, "norm_eps"),
        "rope_theta": float(get(params, "rope_theta")),
    }  # rotary_layout: the spec's default, half_split, unless --config says interleaved
    return fields


# -- the shards -----------------------------------------------------------------------------------

# How each kind of tensor is split across model-parallel ranks (fairscale's ColumnParallelLinear
# splits the output rows, RowParallelLinear the input columns); tok_embeddings by its shapes.
COLUMN_PARALLEL = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "feed_forward.w1",
    "feed_forward.w3",
    "output",
)
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")
EMBEDDING = "tok_embeddings.weight"


def shard_files(folder: Path) -> list[Path]:
    """consolidated.00.pth .. consolidated.NN.pth, in rank order; WeightFileError naming a gap
    or a folder without any."""
    found = {int(m[1]): folder / n for n in os.listdir(folder) if (m := SHARD.fullmatch(n))}
    if not found:
        raise WeightFileError(
            shown(folder),
            ["no consolidated.00.pth: Meta's layout is params.json and consolidated.NN.pth"],
        )
    missing = [f"consolidated.{i:02d}.pth" for i in range(max(found) + 1) if i not in found]
    if missing:
        raise WeightFileError(shown(folder), [f"missing shard {', '.join(missing)}"])
    return [found[i] for i in sorted(found)]


def _read_pth(path: Path) -> dict[str, np.ndarray]:
    from transformer_rosetta.adapter.backends import tensor_reader

    try:
        regular_file(path, "a weight file")
        return tensor_reader().read_tensors(path)
    except (MissingFile, FileProblem) as exc:
        raise WeightFileError(shown(path), [exc.problem]) from None
    except BackendUnavailable as exc:
        raise WeightFileError(shown(path), [f"reading a torch file needs torch ({exc})"]) from None


def _axis(key: str, shapes: list[tuple[int, ...]], dim: int) -> int | None:
    """The axis Meta's model-parallel ranks split `key` along, from the ranks' shapes of it;
    None: held whole by each."""
    if len(shapes[0]) < 2:
        return None
    if key == EMBEDDING:
        return 1 if shapes[0][1] * len(shapes) == dim else 0
    module = key.removesuffix(".weight").split(".", 2)[
        -1
    ]  # "layers.3.attention.wo" -> "attention.wo"
    if module in ROW_PARALLEL:
        return 1
    return 0  # COLUMN_PARALLEL (another key is named by the table as unexpected)


def joined_shapes(shards: list[dict[str, np.ndarray]], dim: int) -> dict[str, tuple[int, ...]]:
    """The shapes join_shards gives, from the ranks' shapes alone (no tensor is read or joined):
    what check_counts compares params.json with before any work. A key that join_shards refuses
    (missing from a rank, shapes that do not join) is left out here; join_shards names it."""
    out: dict[str, tuple[int, ...]] = {}
    for key in shards[0]:
        if not all(key in s for s in shards):
            continue
        shapes = [tuple(s[key].shape) for s in shards]
        axis = _axis(key, shapes, dim)
        if axis is None or len(shards) == 1:
            out[key] = shapes[0]
        elif len({(*s[:axis], *s[axis + 1 :]) for s in shapes}) == 1:
            out[key] = (*shapes[0][:axis], sum(s[axis] for s in shapes), *shapes[0][axis + 1 :])
    return out


def join_shards(
    shards: list[dict[str, np.ndarray]], dim: int, folder: str
) -> dict[str, np.ndarray]:
    """One state dict from the ranks' (module docstring), every disagreement named at once: a key
    some rank lacks, a replicated tensor that differs, shapes that do not stack."""
    if len(shards) == 1:
        return shards[0]
    problems: list[str] = []
    out: dict[str, np.ndarray] = {}
    for key in shards[0]:
        lacking = [f"consolidated.{r:02d}.pth" for r, s in enumerate(shards) if key not in s]
        if lacking:
            problems.append(f"{key}: missing from {', '.join(lacking)}")
            continue
        parts = [s[key] for s in shards]
        axis = _axis(key, [p.shape for p in parts], dim)
        if axis is None:
            if any(p.tobytes() != parts[0].tobytes() or p.shape != parts[0].shape for p in parts):
                problems.append(f"{key}: differs between ranks, which each hold it whole")
            out[key] = parts[0]
            continue
        try:
            out[key] = np.concatenate(parts, axis=axis)
        except ValueError:
            shapes = ", ".join(str(list(p.shape)) for p in parts)
            problems.append(f"{key}: the ranks' shapes {shapes} do not join along axis {axis}")
    extra = sorted({k for s in shards[1:] for k in s} - shards[0].keys())
    if extra:
        problems.append(f"only in later ranks: {', '.join(extra)}")
    if problems:
        raise WeightFileError(folder, problems)
    return out


# -- the table ------------------------------------------------------------------------------------


def _rules() -> list[Rule]:
    out = [
        Rule("decoder.embedding", EMBEDDING),
        Rule("output.kernel", "output.weight", ("transpose",)),
        Rule("decoder.final_norm.scale", "norm.weight"),
    ]
    layer, there = "decoder.layers.{i}", "layers.{i}"
    for proj, native in (("query", "wq"), ("key", "wk")):
        here, source = f"{layer}.self_attention.{proj}.kernel", f"{there}.attention.{native}.weight"
        # wk's rows are permuted over its n_kv_heads heads: the spec's key kernel has kv_heads.
        permuted = ("rotary_permute", "transpose", "heads")
        out.append(Rule(here, source, permuted, when=(("rotary_layout", "half_split"),)))
        out.append(
            Rule(here, source, ("transpose", "heads"), when=(("rotary_layout", "interleaved"),))
        )
    for proj, native in (("value", "wv"), ("output", "wo")):
        here, source = f"{layer}.self_attention.{proj}.kernel", f"{there}.attention.{native}.weight"
        out.append(Rule(here, source, ("transpose", "heads")))
    for proj, native in (("gate", "w1"), ("intermediate", "w3"), ("output", "w2")):
        out.append(
            Rule(
                f"{layer}.feed_forward.{proj}.kernel",
                f"{there}.feed_forward.{native}.weight",
                ("transpose",),
            )
        )
    out.append(Rule(f"{layer}.self_attention_norm.scale", f"{there}.attention_norm.weight"))
    out.append(Rule(f"{layer}.feed_forward_norm.scale", f"{there}.ffn_norm.weight"))
    return out


META_TABLE = Table(
    kind="meta-llama",
    model="Meta's Llama (llama/model.py)",
    rules=tuple(_rules()),
    fixed={
        "num_encoder_layers": 0,
        "norm_position": "pre",
        "final_norm": True,
        "norm_kind": "rms_norm",
        "activation": "silu",
        "gated_feed_forward": True,
        "feed_forward_bias": False,
        "position_kind": "rotary",
        "scale_embeddings": False,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": False,
        "attention_bias": False,
        "dropout": 0.0,
        "attention_dropout": 0.0,
    },
    # What the shapes tell, checked against params.json (check_counts) before any work.
    sizes={
        "tgt_vocab_size": (EMBEDDING, 0),  # src_vocab_size is the same key's, unused
        "d_model": (EMBEDDING, 1),
        "d_ff": ("layers.0.feed_forward.w1.weight", 0),
    },
    head_sizes={
        "num_heads": ("layers.0.attention.wq.weight", 0),
        "num_kv_heads": ("layers.0.attention.wk.weight", 0),
    },
    why={
        "num_encoder_layers": "Meta's Llama is decoder-only",
        "norm_position": "a TransformerBlock is pre-norm: x + attention(attention_norm(x))",
        "final_norm": "Meta's Transformer ends with norm",
        "norm_kind": "Meta's norms are RMSNorm, without a bias",
        "activation": "Meta's FeedForward is w2(F.silu(w1(x)) * w3(x))",
        "gated_feed_forward": "Meta's FeedForward is w2(F.silu(w1(x)) * w3(x))",
        "feed_forward_bias": "Meta's linears have bias=False",
        "position_kind": "Meta's Attention rotates its queries and keys (apply_rotary_emb)",
        "scale_embeddings": "Meta's Transformer does not scale tok_embeddings",
        "tie_output": "Meta's output is its own ColumnParallelLinear",
        "output_bias": "Meta's linears have bias=False",
        "attention_bias": "Meta's linears have bias=False",
        "dropout": "Meta's model.py has no dropout",
        "attention_dropout": "Meta's model.py has no dropout",
    },
    hints={
        "model.embed_tokens.weight": "model.embed_tokens.weight is a Hugging Face Llama's key: "
        "give --from llama and the save_pretrained folder",
    },
)
# Llama 1's checkpoints store the rotary frequencies: checked, then dropped.
ROPE_FREQS = ("rope.freqs",)


def import_meta_llama(path: str | Path, given: Mapping[str, Any] | None = None) -> LlamaImport:
    """Read Meta's folder whole: params.json first (every refusal before any weight is read), the
    ranks' shards joined, then the table with its rotary_permute. `given`: --config's fields
    (bos_id and eos_id needed; common/porting/llama.py, folder_config)."""
    folder = model_folder(path, "Meta Llama")
    params = read_json_file(folder / PARAMS_FILE, "Meta's params.json")
    fields = params_fields(params)  # its refusals first, before any shard is read
    unknown = [ours for ours in ("bos_id", "eos_id") if ours not in (given or {})]
    if unknown:
        raise ConfigError(
            [
                f"{ours}: params.json does not tell it (the tokenizer's); give {ours} in --config"
                for ours in unknown
            ]
        )
    notes: list[str] = []
    if "max_len" not in fields and "max_len" not in (given or {}):
        fields["max_len"] = PARAMS_DEFAULTS["max_seq_len"]
        notes.append(
            "max_len 2048: params.json does not tell the context length (max_seq_len is an "
            "argument of Llama.build; 2048 is ModelArgs' default); rotary positions run past it: "
            "give max_len in --config"
        )
    files = shard_files(folder)
    shards = [_read_pth(f) for f in files]  # mapped: no tensor's data is read yet
    shapes = joined_shapes(shards, fields["d_model"])
    if fields["tgt_vocab_size"] is None:  # params.json's -1: the embedding's rows tell
        rows_ = shapes.get(EMBEDDING)
        if rows_ is None or len(rows_) != 2:
            raise WeightFileError(shown(folder), [f"missing tensors (1): {EMBEDDING}"])
        fields["src_vocab_size"] = fields["tgt_vocab_size"] = int(rows_[0])
    config = folder_config(fields, notes, given, PARAMS, META_TABLE, PARAMS_FILE)
    # Every count of params.json against the shards' shapes before any work proportional to
    # one (the rotary frequencies of head_dim, the names of n_layers layers) or any join.
    check_counts(META_TABLE, config, shapes, PARAMS.name_keys)
    merged = join_shards(shards, fields["d_model"], shown(folder))
    if len(files) > 1:
        notes.append(
            f"{len(files)} model-parallel ranks joined (consolidated.00 .. {len(files) - 1:02d})"
        )
    table = table_for(META_TABLE, ROPE_FREQS, config)
    return LlamaImport(config, to_canonical(table, merged, config, shown(folder)), tuple(notes))


def mapping_table(config: TransformerConfig) -> list[tuple[str, str, str]]:
    """(Meta name, canonical name, steps) for every tensor of Meta's layout, with the layer index
    as {i}: for docs/PORTING.md."""
    return rows(table_for(META_TABLE, ROPE_FREQS, config), config, patterns=True)
