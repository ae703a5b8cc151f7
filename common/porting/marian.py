"""Import a Hugging Face MarianMTModel folder (`config.json` + `model.safetensors`, or a
`pytorch_model.bin` read with `weights_only`, either maybe in shards; common/porting/hf_folder.py
reads the folder), as numpy, with no framework imported here. The way back, `--to marian`, is
common/porting/marian_export.py.

Marian (Junczys-Dowmunt et al. 2018, as ported to transformers) is the base Transformer of
"Attention Is All You Need" with these choices, each mapped onto a field of our spec:
- post-LN (section 3.1), no final norm and no embedding LayerNorm: norm_position="post",
  final_norm=false. Its per-layer `final_layer_norm` is the feed-forward sublayer's norm, not a
  stack-final norm.
- every LayerNorm is `nn.LayerNorm(d_model)` with torch's default eps: layer_norm_eps=1e-5.
- static sinusoidal positions, every sin first and then every cos, with the frequencies of Eq. (5):
  position_kind="sinusoidal", sinusoid_layout="concatenated". The table is a constant, so it is
  not a canonical tensor; when a file carries it (older checkpoints), it is checked against
  `transformer_rosetta.oracle.reference.sinusoidal_positions` and dropped (a `Buffer` of the table).
- `scale_embedding` -> scale_embeddings (x sqrt(d_model), section 3.4); MarianConfig defaults it
  to false, the converted OPUS-MT models set it to true.
- `final_logits_bias` [1, V], always added to the logits: output_bias=true. transformers lists it
  as ignorable when missing and then uses zeros; so do we.
- q_proj's output is scaled by d_k^-0.5 inside the attention (`scaling`); that is Eq. (1)'s
  1/sqrt(d_k), applied before instead of after Q K^T, so the weights are copied unscaled.
- the decoder starts from `decoder_start_token_id`, which Marian sets to the pad id: bos_id may
  equal pad_id, and our decoder never masks position 0 (transformer_rosetta.spec.masks.decoder_key_padding_mask).

Embedding sharing and tying follow what transformers 5 computes, not what the flags suggest:
`share_encoder_decoder_embeddings` ties the encoder, decoder and output matrices to
`model.shared` only together with `tie_word_embeddings`. With sharing on and tying off, the three
are independent parameters (`model.shared` is then unused), so the import is untied and unshared.
Older files that stored only `model.shared.weight` still import: it is the fallback for a
missing `embed_tokens`.

Anything our spec cannot express is refused with a ConfigError that names the Marian field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.porting.hf_folder import (
    HfModel,
    model_folder,
    read_config_json,
    read_folder_shapes,
    read_folder_weights,
)
from transformer_rosetta.porting.table import (
    Buffer,
    Rule,
    Table,
    check_counts,
    rows,
    to_canonical,
)
from transformer_rosetta.spec.config import TransformerConfig

# torch.nn.LayerNorm's default; every Marian LayerNorm is built without an eps argument.
LAYER_NORM_EPS = 1e-5

# MarianConfig's defaults (transformers 5.23, configuration_marian.py) for the keys read here;
# config.json may omit a key that equals its default.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 58101,
    "decoder_vocab_size": None,  # None means vocab_size
    "max_position_embeddings": 1024,
    "encoder_layers": 12,
    "encoder_ffn_dim": 4096,
    "encoder_attention_heads": 16,
    "decoder_layers": 12,
    "decoder_ffn_dim": 4096,
    "decoder_attention_heads": 16,
    "encoder_layerdrop": 0.0,
    "decoder_layerdrop": 0.0,
    "activation_function": "gelu",
    "d_model": 1024,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "decoder_start_token_id": 58100,
    "scale_embedding": False,
    "pad_token_id": 58100,
    "eos_token_id": 0,
    "share_encoder_decoder_embeddings": True,
    "tie_word_embeddings": True,
}

# Keys of older (BART-era) Marian configs. MarianMTModel ignores them and always computes the
# value on the right; a file that says otherwise was made for a different model, so it is refused
# rather than imported as something that neither model computes.
LEGACY_KEYS: dict[str, tuple[Any, str]] = {
    "normalize_before": (False, "MarianMTModel is post-LN (LayerNorm after each residual)"),
    "add_final_layer_norm": (False, "MarianMTModel has no final encoder/decoder LayerNorm"),
    "normalize_embedding": (False, "MarianMTModel has no LayerNorm on the embeddings"),
    "layernorm_embedding": (False, "MarianMTModel has no LayerNorm on the embeddings"),
    "static_position_embeddings": (True, "MarianMTModel has fixed sinusoidal positions only"),
    "add_bias_logits": (False, "MarianMTModel's only logits bias is final_logits_bias"),
}

# Training-time knobs our spec has no field for. They do not change an eval forward pass, but a
# config we write must reproduce the model, so a nonzero value is refused rather than dropped.
UNEXPRESSIBLE_ZEROS = {
    "activation_dropout": "dropout inside the feed-forward, after the activation",
    "encoder_layerdrop": "LayerDrop (Fan et al. 2019) over encoder layers",
    "decoder_layerdrop": "LayerDrop (Fan et al. 2019) over decoder layers",
}

# Our config field -> the Marian key it comes from, to name the user's field in messages.
HF_FIELD = {
    "src_vocab_size": "vocab_size",
    "tgt_vocab_size": "decoder_vocab_size",
    "d_model": "d_model",
    "num_heads": "encoder_attention_heads",
    "d_ff": "encoder_ffn_dim",
    "num_encoder_layers": "encoder_layers",
    "num_decoder_layers": "decoder_layers",
    "max_len": "max_position_embeddings",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "activation": "activation_function",
    "scale_embeddings": "scale_embedding",
    "share_embeddings": "share_encoder_decoder_embeddings",
    "tie_output": "tie_word_embeddings",
    "pad_id": "pad_token_id",
    "bos_id": "decoder_start_token_id",
    "eos_id": "eos_token_id",
}

POSITION_KEYS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
SHARED = "model.shared.weight"
ENCODER_EMBEDDING = "model.encoder.embed_tokens.weight"
DECODER_EMBEDDING = "model.decoder.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
LOGITS_BIAS = "final_logits_bias"


# -- reading the folder --------------------------------------------------------------------------


def read_marian_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json as a dict, {name: array}) from a Hugging Face model folder, its weights
    read as hf_folder reads every model's: model.safetensors, pytorch_model.bin (weights_only:
    loading never runs code), or either in shards. Raises ConfigError for a missing or malformed
    config.json and WeightFileError for a missing folder or weight file. Every count of
    config.json (marian_config's) is checked against the header's shapes before any tensor is
    read (check_counts): a count the file cannot hold costs no work proportional to it.
    """
    folder = model_folder(path, "Marian")
    hf = read_config_json(folder)
    check_counts(TABLE, marian_config(hf), read_folder_shapes(folder), MARIAN.name_keys)
    return hf, read_folder_weights(folder)


# -- the config ---------------------------------------------------------------------------------

# The JSON type of every config.json key read here (token ids are checked by HfModel.token_id).
# A wrong type is refused first, naming the key: the checks after this assume these types.
HF_TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "max_position_embeddings",
            "encoder_layers",
            "encoder_ffn_dim",
            "encoder_attention_heads",
            "decoder_layers",
            "decoder_ffn_dim",
            "decoder_attention_heads",
            "d_model",
        ),
        ("an integer",),
    ),
    "decoder_vocab_size": ("an integer", "null"),
    **dict.fromkeys(
        (
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "encoder_layerdrop",
            "decoder_layerdrop",
        ),
        ("a number",),
    ),
    "activation_function": ("a string",),
    "model_type": ("a string",),
    **dict.fromkeys(
        ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings"),
        ("true or false",),
    ),
}
MARIAN = HfModel("Marian", "marian", HF_DEFAULTS, HF_TYPES, HF_FIELD)


def marian_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """Our config for the model that transformers' MarianMTModel builds from `hf` (config.json).

    The mapping is in the module docstring. Every field it cannot express is refused, all at
    once, in one ConfigError naming the Marian key; a key of the wrong JSON type is refused
    before anything else.
    """
    MARIAN.check_types(hf)
    get = MARIAN.get
    problems = MARIAN.model_type_problems(hf)
    for key, (ok, why) in LEGACY_KEYS.items():
        if key in hf and hf[key] != ok:
            problems.append(f"{key}: {brief(hf[key])} is not supported; {why}")
    for key, what in UNEXPRESSIBLE_ZEROS.items():
        value = get(hf, key)
        if value:
            problems.append(
                f"{key}: {brief(value)} ({what}) has no field in our spec; set it to 0 to import "
                "(it changes training only)"
            )
    heads = {k: get(hf, k) for k in ("encoder_attention_heads", "decoder_attention_heads")}
    if len(set(heads.values())) > 1:
        problems.append(
            f"encoder_attention_heads ({heads['encoder_attention_heads']}) and "
            f"decoder_attention_heads ({heads['decoder_attention_heads']}) differ; our spec has "
            "one num_heads"
        )
    ffn = {k: get(hf, k) for k in ("encoder_ffn_dim", "decoder_ffn_dim")}
    if len(set(ffn.values())) > 1:
        problems.append(
            f"encoder_ffn_dim ({ffn['encoder_ffn_dim']}) and decoder_ffn_dim "
            f"({ffn['decoder_ffn_dim']}) differ; our spec has one d_ff"
        )
    activation = MARIAN.activation(hf, "activation_function", problems)

    vocab = get(hf, "vocab_size")
    decoder_vocab = get(hf, "decoder_vocab_size") or vocab
    share = bool(get(hf, "share_encoder_decoder_embeddings"))
    tie = bool(get(hf, "tie_word_embeddings"))
    if share and decoder_vocab != vocab:
        problems.append(
            f"decoder_vocab_size: {decoder_vocab} differs from vocab_size {vocab}, but "
            "share_encoder_decoder_embeddings is true (one matrix cannot have both sizes)"
        )
    pad_id = MARIAN.token_id(hf, "pad_token_id", problems)
    bos_id = MARIAN.token_id(hf, "decoder_start_token_id", problems)
    eos_id = MARIAN.token_id(hf, "eos_token_id", problems)
    if problems:
        raise ConfigError(problems)

    # transformers 5 ties encoder, decoder and output to model.shared only when both flags are on.
    shared = share and tie
    return MARIAN.config(
        {
            "src_vocab_size": vocab,
            "tgt_vocab_size": vocab if share else decoder_vocab,
            "d_model": get(hf, "d_model"),
            "num_heads": heads["encoder_attention_heads"],
            "d_ff": ffn["encoder_ffn_dim"],
            "num_encoder_layers": get(hf, "encoder_layers"),
            "num_decoder_layers": get(hf, "decoder_layers"),
            "max_len": get(hf, "max_position_embeddings"),
            "dropout": get(hf, "dropout"),
            "attention_dropout": get(hf, "attention_dropout"),
            "norm_position": "post",
            "final_norm": False,
            "layer_norm_eps": LAYER_NORM_EPS,
            "activation": activation,
            "position_kind": "sinusoidal",
            "sinusoid_layout": "concatenated",
            "scale_embeddings": bool(get(hf, "scale_embedding")),
            "share_embeddings": shared,
            "tie_output": tie,
            "output_bias": True,
            "attention_bias": True,
            "pad_id": pad_id,
            "bos_id": bos_id,
            "eos_id": eos_id,
        }
    )


# -- the tensors ---------------------------------------------------------------------------------

# Canonical sublayer -> Marian submodule. Marian's `final_layer_norm` is the feed-forward norm of
# each layer (BART naming), not a final norm of the stack.
SUBMODULES = {
    "self_attention": "self_attn",
    "self_attention_norm": "self_attn_layer_norm",
    "cross_attention": "encoder_attn",
    "cross_attention_norm": "encoder_attn_layer_norm",
    "feed_forward.intermediate": "fc1",
    "feed_forward.output": "fc2",
    "feed_forward_norm": "final_layer_norm",
}
PROJECTIONS = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "out_proj"}


def _layer_rules() -> list[Rule]:
    """Every tensor of an encoder or decoder layer (the decoder's cross-attention only matches
    decoder names, as canonical_specs has it only there)."""
    out = []
    for stack in ("encoder", "decoder"):
        for sublayer, module in SUBMODULES.items():
            here = f"{stack}.layers.{{i}}.{sublayer}"
            there = f"model.{stack}.layers.{{i}}.{module}"
            if sublayer.endswith("_attention"):
                for proj, native in PROJECTIONS.items():
                    kernel = ("transpose", "heads")
                    out.append(Rule(f"{here}.{proj}.kernel", f"{there}.{native}.weight", kernel))
                    bias = () if proj == "output" else ("heads",)
                    out.append(Rule(f"{here}.{proj}.bias", f"{there}.{native}.bias", bias))
            elif sublayer.endswith("_norm"):
                out.append(Rule(f"{here}.scale", f"{there}.weight"))
                out.append(Rule(f"{here}.bias", f"{there}.bias"))
            else:  # fc1 / fc2
                out.append(Rule(f"{here}.kernel", f"{there}.weight", ("transpose",)))
                out.append(Rule(f"{here}.bias", f"{there}.bias"))
    return out


def _embedding_rules() -> list[Rule]:
    """One matrix, saved once (safetensors drops aliases) or under every tied name (.bin); older
    files that stored only model.shared.weight read it for a missing embed_tokens."""
    both = (ENCODER_EMBEDDING, DECODER_EMBEDDING)
    return [
        Rule(
            "shared_embedding",
            SHARED,
            copies=(*both, LM_HEAD),
            when=(("share_embeddings", True), ("tie_output", True)),
        ),
        Rule(
            "shared_embedding",
            SHARED,
            copies=both,
            when=(("share_embeddings", True), ("tie_output", False)),
        ),
        Rule(
            "encoder.embedding",
            ENCODER_EMBEDDING,
            fallbacks=(SHARED,),
            when=(("share_embeddings", False),),
        ),
        Rule(
            "decoder.embedding",
            DECODER_EMBEDDING,
            copies=(LM_HEAD,),
            fallbacks=(SHARED,),
            when=(("share_embeddings", False), ("tie_output", True)),
        ),
        Rule(
            "decoder.embedding",
            DECODER_EMBEDDING,
            fallbacks=(SHARED,),
            when=(("share_embeddings", False), ("tie_output", False)),
        ),
        Rule("output.kernel", LM_HEAD, ("transpose",)),
        # [1, V], always added to the logits; transformers lists it as ignorable when missing
        # and then uses zeros, and so do we.
        Rule("output.bias", LOGITS_BIAS, ("squeeze:0",), absent_zeros=True),
    ]


TABLE = Table(
    kind="marian",
    model="a Marian model",
    rules=(*_embedding_rules(), *_layer_rules()),
    # A config that no MarianMTModel has (build it with marian_config) would make us read the
    # file as a different model; these are the fields that have no tensor to catch the mistake.
    fixed={
        "position_kind": "sinusoidal",
        "sinusoid_layout": "concatenated",
        "final_norm": False,
        "output_bias": True,
        "attention_bias": True,
    },
    # What the shapes tell, checked against config.json (check_counts) before any work; a shared
    # matrix saved once is model.shared.weight, whose rows final_logits_bias tells too.
    sizes={
        "src_vocab_size": (ENCODER_EMBEDDING, 0),
        "tgt_vocab_size": (LOGITS_BIAS, 1),
        "d_model": ("model.encoder.layers.0.fc1.weight", 1),
        "d_ff": ("model.encoder.layers.0.fc1.weight", 0),
    },
    # transformers builds the table in float64 and rounds it to the weights' dtype.
    buffers=tuple(Buffer(key, "concatenated", computed_in="float64") for key in POSITION_KEYS),
    tie_reason="transformers ties them (share_encoder_decoder_embeddings / tie_word_embeddings)",
)


def _no_lm_head(arrays: Mapping[str, np.ndarray]) -> list[str]:
    if arrays and not any(k.startswith("model.") for k in arrays):
        return [
            "no name starts with 'model.': this looks like a MarianModel without its LM head; "
            "a MarianMTModel folder is needed"
        ]
    return []


def marian_to_canonical(
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    source: str = "<Marian weights>",
) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and each in its own dtype, from a MarianMTModel
    state dict (names as in its model.safetensors) for `config` from `marian_config`.

    Reports every missing, unexpected, wrong-shaped and wrong-dtype tensor, every broken tie and
    a position table that is not our sinusoid table, at once, in one WeightFileError labelled
    `source`.
    """
    shapes = {k: tuple(np.shape(v)) for k, v in tensors.items()}
    check_counts(TABLE, config, shapes, MARIAN.name_keys)  # named by the Marian keys
    return to_canonical(TABLE, tensors, config, source, extra_problems=_no_lm_head)


def mapping_table(config: TransformerConfig) -> list[tuple[str, str, str]]:
    """(Marian name, canonical name, steps) for every tensor a MarianMTModel file may hold, in
    canonical order, then the tied aliases and the dropped position tables. For
    docs/PORTING.md."""
    return rows(TABLE, config)
