"""Import a Hugging Face MarianMTModel folder (`config.json` + `model.safetensors`, or a
`pytorch_model.bin` read with `weights_only`), as numpy, with no framework imported here.

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

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.files.safe_read import (
    brief,
    is_int,
    json_type,
    type_problem,
)
from transformer_rosetta.porting.hf_folder import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    model_folder,
    name_hf_key,
    read_config_json,
    read_folder_weights,
)
from transformer_rosetta.porting.table import (
    Buffer,
    Rule,
    Table,
    from_canonical,
    rows,
    to_canonical,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import canonical_specs

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

# transformers' ACT2FN names -> ours. gelu_fast and gelu_accurate are the tanh form with
# sqrt(2/pi) written as a constant (0.7978845608, 3e-12 off); gelu_python is the erf form.
ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
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
    """(config.json as a dict, {name: array}) from a Hugging Face model folder.

    model.safetensors is read with safetensors' numpy API. Without it, pytorch_model.bin is read
    through the torch backend's `read_tensors` (torch.load with weights_only=True: loading never
    runs code). Raises ConfigError for a missing or malformed config.json and WeightFileError for
    a missing folder or weight file.
    """
    folder = model_folder(path, "Marian")
    return read_config_json(folder), read_folder_weights(folder)


# -- the config ---------------------------------------------------------------------------------


def _get(hf: Mapping[str, Any], key: str) -> Any:
    return hf.get(key, HF_DEFAULTS.get(key))


def _token_id(hf: Mapping[str, Any], key: str, problems: list[str]) -> int:
    value = _get(hf, key)
    if isinstance(value, list) and len(value) == 1:  # eos_token_id may be a one-id list
        value = value[0]
    if not is_int(value):
        problems.append(f"{key}: must be one token id (an integer), got {brief(value)}")
        return 0
    return value


# The JSON type of every config.json key read here (token ids are checked by _token_id). A
# wrong type is refused first, naming the key: the checks after this assume these types.
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


def hf_type_problems(hf: Mapping[str, Any]) -> list[str]:
    """'key: must be an integer, got a string '512'' for every key of HF_TYPES in `hf` whose
    JSON type is wrong."""
    problems = []
    for key, expected in HF_TYPES.items():
        if key in hf:
            problem = type_problem(key, hf[key], *expected)
            if problem:
                problems.append(problem)
    return problems


def marian_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """Our config for the model that transformers' MarianMTModel builds from `hf` (config.json).

    The mapping is in the module docstring. Every field it cannot express is refused, all at
    once, in one ConfigError naming the Marian key; a key of the wrong JSON type is refused
    before anything else.
    """
    if not isinstance(hf, Mapping):
        raise ConfigError([f"config.json must hold a JSON object, got {json_type(hf)}"])
    type_problems = hf_type_problems(hf)
    if type_problems:
        raise ConfigError(type_problems)
    problems: list[str] = []
    model_type = hf.get("model_type")
    if model_type != "marian":
        problems.append(
            f"model_type: {brief(model_type)} is not a Marian model (expected 'marian')"
        )
    for key, (ok, why) in LEGACY_KEYS.items():
        if key in hf and hf[key] != ok:
            problems.append(f"{key}: {brief(hf[key])} is not supported; {why}")
    for key, what in UNEXPRESSIBLE_ZEROS.items():
        value = _get(hf, key)
        if value:
            problems.append(
                f"{key}: {brief(value)} ({what}) has no field in our spec; set it to 0 to import "
                "(it changes training only)"
            )
    heads = {k: _get(hf, k) for k in ("encoder_attention_heads", "decoder_attention_heads")}
    if len(set(heads.values())) > 1:
        problems.append(
            f"encoder_attention_heads ({heads['encoder_attention_heads']}) and "
            f"decoder_attention_heads ({heads['decoder_attention_heads']}) differ; our spec has "
            "one num_heads"
        )
    ffn = {k: _get(hf, k) for k in ("encoder_ffn_dim", "decoder_ffn_dim")}
    if len(set(ffn.values())) > 1:
        problems.append(
            f"encoder_ffn_dim ({ffn['encoder_ffn_dim']}) and decoder_ffn_dim "
            f"({ffn['decoder_ffn_dim']}) differ; our spec has one d_ff"
        )
    act = _get(hf, "activation_function")
    if act not in ACTIVATIONS:
        problems.append(
            f"activation_function: {brief(act)} is not supported; allowed: {', '.join(ACTIVATIONS)}"
        )

    vocab = _get(hf, "vocab_size")
    decoder_vocab = _get(hf, "decoder_vocab_size") or vocab
    share = bool(_get(hf, "share_encoder_decoder_embeddings"))
    tie = bool(_get(hf, "tie_word_embeddings"))
    if share and decoder_vocab != vocab:
        problems.append(
            f"decoder_vocab_size: {decoder_vocab} differs from vocab_size {vocab}, but "
            "share_encoder_decoder_embeddings is true (one matrix cannot have both sizes)"
        )
    pad_id = _token_id(hf, "pad_token_id", problems)
    bos_id = _token_id(hf, "decoder_start_token_id", problems)
    eos_id = _token_id(hf, "eos_token_id", problems)
    if problems:
        raise ConfigError(problems)

    # transformers 5 ties encoder, decoder and output to model.shared only when both flags are on.
    shared = share and tie
    fields = {
        "src_vocab_size": vocab,
        "tgt_vocab_size": vocab if share else decoder_vocab,
        "d_model": _get(hf, "d_model"),
        "num_heads": heads["encoder_attention_heads"],
        "d_ff": ffn["encoder_ffn_dim"],
        "num_encoder_layers": _get(hf, "encoder_layers"),
        "num_decoder_layers": _get(hf, "decoder_layers"),
        "max_len": _get(hf, "max_position_embeddings"),
        "dropout": _get(hf, "dropout"),
        "attention_dropout": _get(hf, "attention_dropout"),
        "norm_position": "post",
        "final_norm": False,
        "layer_norm_eps": LAYER_NORM_EPS,
        "activation": ACTIVATIONS[act],
        "position_kind": "sinusoidal",
        "sinusoid_layout": "concatenated",
        "scale_embeddings": bool(_get(hf, "scale_embedding")),
        "share_embeddings": shared,
        "tie_output": tie,
        "output_bias": True,
        "attention_bias": True,
        "pad_id": pad_id,
        "bos_id": bos_id,
        "eos_id": eos_id,
    }
    try:
        return TransformerConfig(**fields)
    except ConfigError as exc:  # name the Marian key behind each of our fields
        raise ConfigError([name_hf_key(p, HF_FIELD, "Marian") for p in exc.problems]) from None


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
    return to_canonical(TABLE, tensors, config, source, extra_problems=_no_lm_head)


def mapping_table(config: TransformerConfig) -> list[tuple[str, str, str]]:
    """(Marian name, canonical name, steps) for every tensor a MarianMTModel file may hold, in
    canonical order, then the tied aliases and the dropped position tables. For
    docs/PORTING.md."""
    return rows(TABLE, config)


# -- the way out: --to marian ----------------------------------------------------------------------

# Ours -> transformers' ACT2FN name that computes it (gelu_new is the tanh form).
EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
GENERATION_FILE = "generation_config.json"
EXPORT_FILES = (SAFETENSORS_FILE, CONFIG_FILE, GENERATION_FILE)


def export_problems(c: TransformerConfig) -> list[str]:
    """'field: why' for everything of `c` that a MarianMTModel cannot hold. A missing bias is not
    among them: it is written as zeros, the same function."""
    problems = []
    if c.norm_position != "post":
        problems.append("norm_position: MarianMTModel is post-norm (LayerNorm after each residual)")
    if c.final_norm:
        problems.append("final_norm: MarianMTModel has no final encoder or decoder LayerNorm")
    if c.norm_kind != "layer_norm":
        problems.append(f"norm_kind: MarianMTModel's norms are nn.LayerNorm, not {c.norm_kind!r}")
    if c.layer_norm_eps != LAYER_NORM_EPS:
        problems.append(
            f"layer_norm_eps: MarianMTModel's LayerNorms use torch's default {LAYER_NORM_EPS:g}, "
            f"and its config has no field for {c.layer_norm_eps:g}"
        )
    if c.position_kind != "sinusoidal":
        problems.append("position_kind: MarianMTModel has fixed sinusoidal positions only")
    elif c.sinusoid_layout != "concatenated":
        problems.append(
            "sinusoid_layout: MarianMTModel's sinusoids are concatenated (every sin, then every "
            f"cos), not {c.sinusoid_layout!r}"
        )
    if c.key_dim is not None and c.key_dim * c.num_heads != c.d_model:
        problems.append(f"key_dim: MarianMTModel's heads are d_model / heads wide, not {c.key_dim}")
    if c.share_embeddings and not c.tie_output:
        problems.append(
            "share_embeddings: transformers 5 shares Marian's embedding only together with "
            "tie_word_embeddings; a shared embedding with an untied output is three separate "
            "matrices there: set share_embeddings to false"
        )
    return problems


def hf_config_for(c: TransformerConfig) -> dict[str, Any]:
    """config.json for `c`, the inverse of marian_config (export_problems must be empty)."""
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": c.src_vocab_size,
        "decoder_vocab_size": c.tgt_vocab_size,
        "share_encoder_decoder_embeddings": c.share_embeddings,
        "tie_word_embeddings": c.tie_output,
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        "max_position_embeddings": c.max_len,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "activation_function": EXPORT_ACTIVATIONS[c.activation],
        "scale_embedding": c.scale_embeddings,
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        "forced_eos_token_id": None,
    }


def generation_config_for(c: TransformerConfig) -> dict[str, Any]:
    """generation_config.json: decoding starts where ours does (bos_id) and stops at eos_id,
    with nothing forced, as common/decoding/search.py decodes."""
    return {
        "decoder_start_token_id": c.bos_id,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "forced_eos_token_id": None,
    }


def canonical_to_marian(
    tensors: Mapping[str, np.ndarray], c: TransformerConfig
) -> dict[str, np.ndarray]:
    """MarianMTModel's state dict (the names save_pretrained writes) from canonical tensors. A
    bias the config does not have is written as zeros: q/k/v/output biases without
    attention_bias, final_logits_bias without output_bias."""
    problems = export_problems(c)
    if problems:
        raise ConfigError(problems)
    # Marian always has the biases: take the config that has them, with zeros where ours has none.
    held = c.replace(attention_bias=True, output_bias=True)
    full = dict(tensors)
    dtype = np.asarray(next(iter(tensors.values()))).dtype
    for spec in canonical_specs(held):
        if spec.name not in full:
            full[spec.name] = np.zeros(spec.shape, dtype=dtype)
    return from_canonical(TABLE, full, held)


def write_marian_dir(
    folder: str | Path, c: TransformerConfig, tensors: Mapping[str, np.ndarray]
) -> None:
    """Write a MarianMTModel folder: model.safetensors, config.json, generation_config.json.

    Everything is computed before the first byte is written (a config Marian cannot hold is a
    ConfigError naming each field); each file is written atomically, the weights first, and if a
    later file fails the files this call wrote are removed again (and the folder, if it made it)."""
    from safetensors.numpy import save_file

    from transformer_rosetta.files.outputs import atomic_write, make_folder, text_writer

    state = canonical_to_marian(tensors, c)
    texts = {
        CONFIG_FILE: json.dumps(hf_config_for(c), indent=2) + "\n",
        GENERATION_FILE: json.dumps(generation_config_for(c), indent=2) + "\n",
    }
    folder = Path(folder)
    made = not folder.exists()
    make_folder(folder, "DST")
    written: list[Path] = []
    try:
        size = sum(a.nbytes for a in state.values())
        atomic_write(
            folder / SAFETENSORS_FILE,
            lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
            size,
        )
        written.append(folder / SAFETENSORS_FILE)
        for name, text in texts.items():
            atomic_write(folder / name, text_writer(text))
            written.append(folder / name)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
