"""The importers of decoder-only language models (GPT; `num_encoder_layers` 0), each a `Table`
(common/porting/table.py) of data:

- `mingpt`: Karpathy's minGPT (`mingpt/model.py`): `transformer.wte`/`wpe`, blocks
  `transformer.h.{i}` with `ln_1`, `attn.c_attn` (q, k, v packed in one nn.Linear [3d, d]),
  `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj` with NewGELU (the tanh GELU), `transformer.ln_f`,
  and `lm_head`, its own bias-free nn.Linear (minGPT does not tie it). Each block's causal mask is
  a persistent buffer, `attn.bias`: checked, then dropped. Seed text 000 quotes minGPT's
  attention (as `SelfAttention`, with an `is_causal` switch), NewGELU and Block: the same modules
  and so the same keys, read by this table.
- `nanogpt`: nanoGPT (`model.py`), the same keys, but nn.GELU (the exact, erf GELU), `lm_head`
  tied to `wte`, and `GPTConfig(bias=False)` for models without biases. Compiled models save
  their keys under `_orig_mod.`, which is read as an optional prefix.
- `gpt2`: transformers' `GPT2LMHeadModel` (or `GPT2Model`, whose keys lack the `transformer.`
  prefix): Conv1D layers store their weights [in, out] (c_attn [d, 3d]), `lm_head` is tied to
  `wte`, gelu_new is the tanh GELU. Older transformers saved `attn.bias` (the causal mask) and
  `attn.masked_bias` (-1e4): checked, then dropped. A save_pretrained folder (config.json with
  model.safetensors, its shards and index, or pytorch_model.bin) is read whole by
  `import_gpt2_folder`: its config.json gives the sizes, activation, eps, dropout and special ids,
  and every switch the spec cannot express is refused by name.
- `encoder-gpt` (alias `seed-gpt`): the `GPT` of seed text 002, "embedding, encoder, out": an
  `nn.Embedding`, a `TransformerEncoder` of the "Transformers from Scratch" style (one
  `AttentionHead` module per head, each with its own q, k, v nn.Linear; post-norm `Residual` and
  `Residual_ffn` wrappers; a `feed_forward` Sequential) run with a causal mask added to the
  scores, and `out`, an untied nn.Linear with a bias. Its positions are computed, never stored, by
  `pos / 1e4 ** (dim // dim_model)`: `ENCODER_GPT_POSITIONS` says why that is not the paper's
  sinusoid and how it is imported.

None of these models masks anything by token id, and none has a start or end token that its
weights tell: `bos_id` and `eos_id` are `needs`. Nor has any a pad token, so none is masked: the
import's `pad_id` is the virtual pad, `tgt_vocab_size`, an id that names no token (`no_pad`,
TransformerConfig.virtual_pad), unless --config names one (docs/PORTING.md, "Decoder-only
models").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.files.safe_read import brief, shown
from transformer_rosetta.porting.hf_folder import (
    HfModel,
    model_folder,
    read_config_json,
    read_folder_shapes,
    read_folder_weights,
)
from transformer_rosetta.porting.table import (
    Computed,
    Constant,
    Rule,
    Table,
    check_counts,
    is_causal_mask,
    to_canonical,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.names import TensorSpec

_QKV = ("query", "key", "value")
# What no GPT file tells: the heads (c_attn is [3d, d] for any h), BOS and EOS (above); pad_id
# is the virtual pad unless given (common/porting/table.py, assemble_config).
_GPT_NEEDS = ("num_heads", "bos_id", "eos_id")
# A decoder-only model with GPT-2's layout: one stack, pre-norm with a final LayerNorm (ln_f),
# learned positions added to unscaled token embeddings, no output bias.
_GPT_FIXED = {
    "num_encoder_layers": 0,
    "norm_position": "pre",
    "final_norm": True,
    "norm_kind": "layer_norm",
    "position_kind": "learned",
    "scale_embeddings": False,
    "share_embeddings": False,
    "output_bias": False,
}
_GPT_WHY = {
    "num_encoder_layers": "a GPT is decoder-only: one causal stack, no encoder",
    "norm_position": "a GPT block is pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))",
    "final_norm": "a GPT ends its stack with ln_f",
    "position_kind": "a GPT learns its positions (wpe)",
    "scale_embeddings": "a GPT adds wte(idx) + wpe(pos) without scaling by sqrt(d_model)",
    "output_bias": "a GPT's lm_head has no bias",
}
CAUSAL_MASK = "the causal mask (a lower-triangular matrix of ones)"


def _gpt_rules(root: str, head: str, conv1d: bool, optional_biases: bool = False) -> list[Rule]:
    """GPT-2's layout under `root` (the key prefix of wte, h.{i}, ln_f) with the untied `head`
    (lm_head's weight). `conv1d`: the weights are stored [in, out] (transformers' Conv1D), else
    [out, in] (nn.Linear). `optional_biases`: nanoGPT's bias=False, told by the file's
    attention_bias flag: then the projections have no bias, and a missing feed-forward or
    LayerNorm bias is zeros (F.linear and F.layer_norm with bias None add nothing)."""
    linear = () if conv1d else ("transpose",)

    def biased(canonical: str, source: str, steps: tuple[str, ...] = ()) -> list[Rule]:
        if not optional_biases:
            return [Rule(canonical, source, steps)]
        return [
            Rule(canonical, source, steps, when=(("attention_bias", True),)),
            Rule(canonical, source, steps, when=(("attention_bias", False),), absent_zeros=True),
        ]

    def norm(canonical: str, source: str) -> list[Rule]:
        return [Rule(f"{canonical}.scale", f"{source}.weight")] + biased(
            f"{canonical}.bias", f"{source}.bias"
        )

    out = [
        Rule(
            "decoder.embedding", f"{root}wte.weight", copies=(head,), when=(("tie_output", True),)
        ),
        Rule("decoder.embedding", f"{root}wte.weight", when=(("tie_output", False),)),
        Rule("output.kernel", head, ("transpose",)),
        Rule("decoder.position_embedding", f"{root}wpe.weight"),
    ]
    layer, block = "decoder.layers.{i}", f"{root}h.{{i}}"
    attention, c_attn = f"{layer}.self_attention", f"{block}.attn.c_attn"
    for part, proj in enumerate(_QKV):
        # q, k, v are the three blocks of c_attn's output features, in that order (its forward
        # splits them with .split(n_embd)); each block is heads-major, as .view(B, T, h, d_k).
        split = f"columns:{part}/3" if conv1d else f"split:{part}/3"
        kernel_steps = (split, "heads") if conv1d else (split, "transpose", "heads")
        out.append(Rule(f"{attention}.{proj}.kernel", f"{c_attn}.weight", kernel_steps))
        out.append(Rule(f"{attention}.{proj}.bias", f"{c_attn}.bias", (f"split:{part}/3", "heads")))
    out.append(
        Rule(f"{attention}.output.kernel", f"{block}.attn.c_proj.weight", (*linear, "heads"))
    )
    out.append(Rule(f"{attention}.output.bias", f"{block}.attn.c_proj.bias"))
    out += norm(f"{layer}.self_attention_norm", f"{block}.ln_1")
    out += norm(f"{layer}.feed_forward_norm", f"{block}.ln_2")
    for canonical, module in (("intermediate", "c_fc"), ("output", "c_proj")):
        ff, mlp = f"{layer}.feed_forward.{canonical}", f"{block}.mlp.{module}"
        out.append(Rule(f"{ff}.kernel", f"{mlp}.weight", linear))
        out += biased(f"{ff}.bias", f"{mlp}.bias")
    out += norm("decoder.final_norm", f"{root}ln_f")
    return out


def _gpt_sizes(root: str, conv1d: bool) -> dict[str, tuple[str, int]]:
    wte = f"{root}wte.weight"
    return {
        "src_vocab_size": (wte, 0),  # unused by a decoder-only model; kept equal to the vocabulary
        "tgt_vocab_size": (wte, 0),
        "d_model": (wte, 1),
        "d_ff": (f"{root}h.0.mlp.c_fc.weight", 1 if conv1d else 0),
        "max_len": (f"{root}wpe.weight", 0),  # block_size, n_positions
    }


_WRONG_KIND = {
    "embedding.weight": "embedding.weight and encoder.layers.* are the encoder GPT's keys (a GPT "
    "of embedding, encoder, out): give --from encoder-gpt",
}
# minGPT's and GPT-2's files share every key; c_attn's layout tells them apart.
_C_ATTN = "transformer.h.0.attn.c_attn.weight"
_CONV1D_HINT = {
    _C_ATTN: f"{_C_ATTN} is stored [in, out], as transformers' Conv1D stores it: give --from gpt2"
}
_LINEAR_HINT = {
    _C_ATTN: f"{_C_ATTN} is stored [out, in], as nn.Linear stores it (minGPT, nanoGPT): give "
    "--from mingpt or nanogpt"
}

# -- minGPT and nanoGPT ---------------------------------------------------------------------------

_KARPATHY_ROOT = "{prefix}transformer."
MINGPT = Table(
    kind="mingpt",
    model="minGPT",
    rules=tuple(_gpt_rules(_KARPATHY_ROOT, "{prefix}lm_head.weight", conv1d=False)),
    fixed={
        **_GPT_FIXED,
        "layer_norm_eps": 1e-5,
        "activation": "gelu_tanh",
        "tie_output": False,
        "attention_bias": True,
    },
    why={
        **_GPT_WHY,
        "layer_norm_eps": "minGPT's nn.LayerNorm keeps torch's default eps, 1e-5",
        "activation": "minGPT's NewGELU is the tanh GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + "
        "0.044715 x^3)))",
        "tie_output": "minGPT's lm_head is its own nn.Linear, not tied to wte (nanoGPT ties it: "
        "--from nanogpt)",
        "attention_bias": "minGPT's c_attn and c_proj are nn.Linear with a bias",
    },
    # GPT.get_default_config: embd_pdrop, resid_pdrop and attn_pdrop are 0.1.
    defaults={"dropout": 0.1, "attention_dropout": 0.1},
    needs=_GPT_NEEDS,
    sizes=_gpt_sizes(_KARPATHY_ROOT, conv1d=False),
    layer_counts={"num_decoder_layers": f"{_KARPATHY_ROOT}h.{{i}}."},
    constants=(Constant(f"{_KARPATHY_ROOT}h.{{i}}.attn.bias", CAUSAL_MASK, is_causal_mask),),
    hints={**_WRONG_KIND, **_CONV1D_HINT},
)

NANOGPT = Table(
    kind="nanogpt",
    model="nanoGPT",
    rules=tuple(
        _gpt_rules(_KARPATHY_ROOT, "{prefix}lm_head.weight", conv1d=False, optional_biases=True)
    ),
    fixed={**_GPT_FIXED, "layer_norm_eps": 1e-5, "activation": "gelu", "tie_output": True},
    why={
        **_GPT_WHY,
        "layer_norm_eps": "nanoGPT's LayerNorm calls F.layer_norm with eps 1e-5",
        "activation": "nanoGPT's MLP uses nn.GELU(), the exact erf GELU (minGPT's NewGELU is the "
        "tanh one: --from mingpt)",
        "tie_output": "nanoGPT ties wte to lm_head (self.transformer.wte.weight = "
        "self.lm_head.weight)",
    },
    # GPTConfig: dropout 0.0 everywhere (its training configs set their own).
    defaults={"dropout": 0.0, "attention_dropout": 0.0},
    needs=_GPT_NEEDS,
    sizes=_gpt_sizes(_KARPATHY_ROOT, conv1d=False),
    layer_counts={"num_decoder_layers": f"{_KARPATHY_ROOT}h.{{i}}."},
    # GPTConfig(bias=False) saves no bias at all: c_attn's tells.
    flags={"attention_bias": f"{_KARPATHY_ROOT}h.0.attn.c_attn.bias"},
    # Without flash attention (torch < 2.0) each block registers its causal mask.
    constants=(Constant(f"{_KARPATHY_ROOT}h.{{i}}.attn.bias", CAUSAL_MASK, is_causal_mask),),
    optional_prefix="_orig_mod.",  # the keys of a torch.compile'd model, as nanoGPT saves them
    hints={**_WRONG_KIND, **_CONV1D_HINT},
    tie_reason="nanoGPT ties them (minGPT does not: --from mingpt)",
)


# -- Hugging Face GPT-2 ---------------------------------------------------------------------------


def _is_masked_bias(a: np.ndarray) -> bool:
    a = np.asarray(a)
    return a.size == 1 and a.dtype.kind == "f" and float(a.reshape(())) == -1e4


GPT2 = Table(
    kind="gpt2",
    model="Hugging Face GPT-2",
    rules=tuple(_gpt_rules("{prefix}", "lm_head.weight", conv1d=True)),
    fixed={**_GPT_FIXED, "tie_output": True, "attention_bias": True},
    why={
        **_GPT_WHY,
        "tie_output": "GPT2LMHeadModel ties lm_head to wte",
        "attention_bias": "GPT-2's Conv1D layers have a bias",
    },
    # GPT2Config's defaults: activation_function "gelu_new" (the tanh GELU; "gelu" is the erf
    # one), layer_norm_epsilon 1e-5, resid_pdrop = embd_pdrop = attn_pdrop = 0.1. For a bare
    # state_dict a config.json that says otherwise is given in --config; a save_pretrained folder's
    # config.json is read (import_gpt2_folder, below).
    defaults={
        "activation": "gelu_tanh",
        "layer_norm_eps": 1e-5,
        "dropout": 0.1,
        "attention_dropout": 0.1,
    },
    needs=_GPT_NEEDS,
    sizes=_gpt_sizes("{prefix}", conv1d=True),
    layer_counts={"num_decoder_layers": "{prefix}h.{i}."},
    constants=(
        Constant("{prefix}h.{i}.attn.bias", CAUSAL_MASK, is_causal_mask),
        Constant("{prefix}h.{i}.attn.masked_bias", "the number -1e4", _is_masked_bias),
    ),
    optional_prefix="transformer.",  # GPT2LMHeadModel's; GPT2Model's keys have none
    hints={**_WRONG_KIND, **_LINEAR_HINT},
    tie_reason="GPT2LMHeadModel ties them",
)


# -- a GPT-2 save_pretrained folder -----------------------------------------------------------------

# GPT2Config's defaults (transformers 5.23, configuration_gpt2.py) for the keys read here; a
# config.json may omit a key that equals its default.
GPT2_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,  # 4 * n_embd
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "pad_token_id": None,
}
GPT2_HF_TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"), ("an integer",)),
    "n_inner": ("an integer", "null"),
    **dict.fromkeys(
        ("resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon"), ("a number",)
    ),
    **dict.fromkeys(("activation_function", "model_type"), ("a string",)),
    **dict.fromkeys(
        (
            "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",
            "add_cross_attention",
            "tie_word_embeddings",
        ),
        ("true or false",),
    ),
}
# Our field -> the GPT-2 key it comes from, to name the key in messages.
GPT2_HF_FIELD = {
    "src_vocab_size": "vocab_size",
    "tgt_vocab_size": "vocab_size",
    "d_model": "n_embd",
    "num_heads": "n_head",
    "d_ff": "n_inner",
    "num_decoder_layers": "n_layer",
    "max_len": "n_positions",
    "dropout": "resid_pdrop",
    "attention_dropout": "attn_pdrop",
    "layer_norm_eps": "layer_norm_epsilon",
    "activation": "activation_function",
    "pad_id": "pad_token_id",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
}
# Switches of GPT2Attention that change the function computed, and so have no place in the spec
# (which scales every score by 1/sqrt(d_k), Eq. (1), and has no cross-attention in a GPT).
_GPT2_REFUSED = {
    "scale_attn_by_inverse_layer_idx": (
        True,
        "true divides layer i's scores by i + 1 as well, which the spec (1/sqrt(d_k), Eq. (1)) "
        "cannot express",
    ),
    "scale_attn_weights": (
        False,
        "false leaves the scores unscaled; the spec scales by 1/sqrt(d_k)",
    ),
    "add_cross_attention": (True, "true adds cross-attention, which a decoder-only model has not"),
    "tie_word_embeddings": (False, "false unties lm_head from wte; GPT-2's table ties them"),
}
GPT2_HF = HfModel("GPT-2", "gpt2", GPT2_HF_DEFAULTS, GPT2_HF_TYPES, GPT2_HF_FIELD)


def gpt2_config_fields(hf: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(our config fields, notes) for the model GPT2LMHeadModel builds from `hf` (config.json):
    the sizes, activation, eps, dropout and special ids. Every value the spec cannot express is
    refused in one ConfigError naming the GPT-2 key, a wrong JSON type first. pad_id is never
    among them (`no_pad`: GPT-2 masks nothing by id); the key "pad" holds config.json's
    pad_token_id when it names one (GPT-2 names none), for the notes."""
    GPT2_HF.check_types(hf)
    get = GPT2_HF.get
    notes: list[str] = []
    problems = GPT2_HF.model_type_problems(hf)
    for key, (bad, why) in _GPT2_REFUSED.items():
        if get(hf, key) is bad:
            problems.append(f"{key}: {why}")
    activation = GPT2_HF.activation(hf, "activation_function", problems)
    ids = {
        ours: GPT2_HF.token_id(hf, key, problems)
        for ours, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"))
    }
    pad = GPT2_HF.token_id(hf, "pad_token_id", problems, optional=True)
    if problems:
        raise ConfigError(problems)
    if get(hf, "reorder_and_upcast_attn"):
        notes.append(
            "reorder_and_upcast_attn true: GPT-2 then computes its attention scores in float32 "
            "under autocast; the function is the same, so nothing changes in the import"
        )
    if get(hf, "embd_pdrop") != get(hf, "resid_pdrop"):
        notes.append(
            f"embd_pdrop {get(hf, 'embd_pdrop')} differs from resid_pdrop "
            f"{get(hf, 'resid_pdrop')}: the spec has one dropout, imported as resid_pdrop "
            "(training only; eval is the same)"
        )
    n_embd = get(hf, "n_embd")
    fields: dict[str, Any] = {
        **GPT2.fixed,
        "src_vocab_size": get(hf, "vocab_size"),
        "tgt_vocab_size": get(hf, "vocab_size"),
        "d_model": n_embd,
        "num_heads": get(hf, "n_head"),
        "d_ff": get(hf, "n_inner") if get(hf, "n_inner") is not None else 4 * n_embd,
        "num_decoder_layers": get(hf, "n_layer"),
        "max_len": get(hf, "n_positions"),
        "dropout": get(hf, "resid_pdrop"),
        "attention_dropout": get(hf, "attn_pdrop"),
        "layer_norm_eps": get(hf, "layer_norm_epsilon"),
        "activation": activation,
        **ids,
    }
    if pad is not None:
        fields["pad"] = pad
    return fields, notes


def no_pad(
    fields: Mapping[str, Any], named: int | None, model: str, source: str = "config.json"
) -> tuple[int, list[str]]:
    """(pad_id, notes) of a decoder-only import whose --config names no pad_id: the virtual pad,
    tgt_vocab_size (TransformerConfig.virtual_pad), an id that names no token, so that no token
    is masked. `model` masks nothing by id (transformers pads a batch through its
    attention_mask, never by id), and neither does the import, whatever pad_token_id `source`
    names (`named`): the notes say which one it named, and that it is not masked."""
    pad = int(fields["tgt_vocab_size"])
    if named is None:
        return pad, []
    return pad, [
        f"pad_id: {source}'s pad_token_id {named} is not masked, as {model} masks nothing by id "
        f"(its attention_mask pads a batch); the model has no pad (pad_id {pad}, one past the "
        "vocabulary, names no token): give pad_id in --config to mask an id"
    ]


@dataclass(frozen=True)
class GPT2Import:
    """An imported GPT-2 folder: our config, the canonical tensors, and what the import decided
    that the files do not show (where pad_id came from, what it ignored)."""

    config: TransformerConfig
    tensors: dict[str, np.ndarray]
    notes: tuple[str, ...]


def gpt2_folder_config(
    hf: Mapping[str, Any], given: Mapping[str, Any] | None = None
) -> tuple[TransformerConfig, list[str]]:
    """(config, notes) from config.json and the user's --config fields. --config may give what
    config.json does not tell (pad_id: else the model has none, `no_pad`); a field it tells too
    must agree (ConfigError naming both)."""
    fields, notes = gpt2_config_fields(hf)
    named = fields.pop("pad", None)
    given = dict(given or {})
    problems = [
        f"{name}: --config says {brief(value)}, but config.json's "
        f"{GPT2_HF_FIELD.get(name, name)} says {brief(fields[name])}"
        for name, value in given.items()
        if name in fields and value != fields[name]
    ]
    if problems:
        raise ConfigError(problems)
    fields.update(given)
    if "pad_id" not in fields:
        fields["pad_id"], said = no_pad(fields, named, "GPT-2")
        notes += said
    return GPT2_HF.config(fields), notes


def import_gpt2_folder(path: str | Path, given: Mapping[str, Any] | None = None) -> GPT2Import:
    """Read a GPT-2 save_pretrained folder whole: config.json (GPT2Config) and the weights,
    sharded or not. `given`: --config's fields (see gpt2_folder_config)."""
    folder = model_folder(path, "GPT-2")
    config, notes = gpt2_folder_config(read_config_json(folder), given)
    # Every count of config.json against the header's shapes before any tensor is read or any
    # name is built per layer.
    check_counts(GPT2, config, read_folder_shapes(folder), GPT2_HF.name_keys)
    tensors = to_canonical(GPT2, read_folder_weights(folder), config, shown(folder))
    return GPT2Import(config, tensors, tuple(notes))


# -- the encoder GPT (seed text 002) ------------------------------------------------------------


def encoder_gpt_positions(spec: TensorSpec, c: TransformerConfig) -> np.ndarray:
    """The encoder GPT's position table, [max_len, d_model], as its `position_encoding` computes
    it: `phase = pos / 1e4 ** (dim // dim_model)`, then sin(phase) at even dims and cos(phase) at
    odd ones. `dim // dim_model` is 0 for every dim < dim_model, so every frequency is 1: row pos
    is (sin pos, cos pos, sin pos, cos pos, ...). The paper's Eq. (5) divides 2i by d_model; this
    formula divides with `//`, and we reproduce it as written, not as meant."""
    length, d_model = spec.shape
    pos = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    dim = np.arange(d_model, dtype=np.float64)[None, :]  # (1, d)
    phase = pos / 1e4 ** (dim // d_model)  # (L, d); the exponent is 0 everywhere
    return np.where(dim % 2 == 0, np.sin(phase), np.cos(phase))


ENCODER_GPT_POSITIONS = Computed(
    "computed: the text's pos / 1e4 ** (dim // dim_model), sin at even and cos at odd dims; "
    "// makes every frequency 1 (not the paper's sinusoid)",
    encoder_gpt_positions,
)


def _encoder_gpt_rules() -> list[Rule]:
    out = [
        Rule("decoder.embedding", "embedding.weight"),
        Rule("decoder.position_embedding", "", computed=ENCODER_GPT_POSITIONS),
        # self.out = nn.Linear(dim_model, n_vocab)
        Rule("output.kernel", "out.weight", ("transpose",)),
        Rule("output.bias", "out.bias"),
    ]
    layer, there = "decoder.layers.{i}", "encoder.layers.{i}"
    # Residual(sublayer, dimension): LayerNorm(x + dropout(sublayer(x, x, x, mask))), post-norm.
    attention, mha = f"{layer}.self_attention", f"{there}.attention.sublayer"
    for proj, linear in zip(_QKV, ("q", "k", "v"), strict=True):
        # heads.{h}.q is head h's own nn.Linear(dim_model, dim_k); the heads' outputs are
        # concatenated in order, so the stacked weights are one [h d_k, d_model] Linear.
        head = f"{mha}.heads.{{h}}.{linear}"
        out.append(Rule(f"{attention}.{proj}.kernel", f"{head}.weight", ("transpose", "heads")))
        out.append(Rule(f"{attention}.{proj}.bias", f"{head}.bias", ("heads",)))
    out.append(Rule(f"{attention}.output.kernel", f"{mha}.linear.weight", ("transpose", "heads")))
    out.append(Rule(f"{attention}.output.bias", f"{mha}.linear.bias"))
    # Residual_ffn(feed_forward(dim_model, dim_feedforward), dimension): the same post-norm;
    # feed_forward is Sequential(Linear, ReLU, Linear), so 0 and 2.
    ff = f"{there}.feed_forward.sublayer"
    for canonical, index in (("intermediate", 0), ("output", 2)):
        out.append(
            Rule(f"{layer}.feed_forward.{canonical}.kernel", f"{ff}.{index}.weight", ("transpose",))
        )
        out.append(Rule(f"{layer}.feed_forward.{canonical}.bias", f"{ff}.{index}.bias"))
    for canonical, module in (
        ("self_attention_norm", "attention"),
        ("feed_forward_norm", "feed_forward"),
    ):
        out.append(Rule(f"{layer}.{canonical}.scale", f"{there}.{module}.norm.weight"))
        out.append(Rule(f"{layer}.{canonical}.bias", f"{there}.{module}.norm.bias"))
    return out


_ENCODER_GPT_Q = "encoder.layers.0.attention.sublayer.heads.0.q.weight"
# The output layer under another name than the text's: said first, with the fix.
_NOT_OUT = (
    "linear.weight and linear.bias are not the encoder GPT's: its output layer is `out` "
    "(self.out = nn.Linear(dim_model, n_vocab)); a file saved from the text's code holds out.weight "
    "and out.bias"
)
ENCODER_GPT = Table(
    kind="encoder-gpt",
    model="the encoder GPT",
    rules=tuple(_encoder_gpt_rules()),
    fixed={
        "num_encoder_layers": 0,
        "norm_position": "post",
        "final_norm": False,
        "norm_kind": "layer_norm",
        "layer_norm_eps": 1e-5,
        "activation": "relu",
        "position_kind": "learned",
        "scale_embeddings": False,
        "share_embeddings": False,
        "tie_output": False,
        "output_bias": True,
        "attention_bias": True,
    },
    why={
        "num_encoder_layers": "the encoder GPT is one causal stack (its TransformerEncoder run "
        "with a causal mask): decoder-only",
        "norm_position": "the encoder GPT's Residual and Residual_ffn are post-norm: "
        "norm(x + dropout(sublayer(x)))",
        "final_norm": "the encoder GPT's TransformerEncoder ends without a LayerNorm",
        "norm_kind": "the encoder GPT's norms are nn.LayerNorm",
        "layer_norm_eps": "the encoder GPT's nn.LayerNorm keeps torch's default eps, 1e-5",
        "activation": "the encoder GPT's feed_forward is Linear, nn.ReLU(), Linear",
        "position_kind": "the encoder GPT's positions, pos / 1e4 ** (dim // dim_model), are not "
        "the paper's sinusoid: they are imported as a learned table computed from that formula",
        "scale_embeddings": "the encoder GPT adds its positions to nn.Embedding's output unscaled",
        "tie_output": "the encoder GPT's out is its own nn.Linear",
        "output_bias": "the encoder GPT's out nn.Linear has a bias",
        "attention_bias": "the encoder GPT's q, k, v and linear are nn.Linear with a bias",
    },
    # Its dropout (on the sublayer outputs only; none on the attention probabilities). Its
    # positions are computed for any length: max_len is how many rows the imported table has.
    defaults={"dropout": 0.1, "attention_dropout": 0.0, "max_len": 512},
    needs=("bos_id", "eos_id"),
    sizes={
        "src_vocab_size": ("embedding.weight", 0),
        "tgt_vocab_size": ("embedding.weight", 0),
        "d_model": ("embedding.weight", 1),
        "d_ff": ("encoder.layers.0.feed_forward.sublayer.0.weight", 0),
        "key_dim": (_ENCODER_GPT_Q, 0),  # dim_k = dim_v = dim_model // num_heads in the text
    },
    layer_counts={
        "num_decoder_layers": "encoder.layers.{i}.",
        "num_heads": "encoder.layers.0.attention.sublayer.heads.{i}.",
    },
    hints={
        **{
            key: "transformer.* and lm_head.weight are minGPT's, nanoGPT's or GPT-2's keys: give "
            "--from mingpt, nanogpt or gpt2"
            for key in ("transformer.wte.weight", "wte.weight", "_orig_mod.transformer.wte.weight")
        },
        "linear.weight": _NOT_OUT,  # once: linear.bias comes with it
    },
)

# Other names a kind is given by: seed-gpt, this table's first name.
KIND_ALIASES = {"seed-gpt": "encoder-gpt"}
_BY_KIND = {t.kind: t for t in (MINGPT, NANOGPT, GPT2, ENCODER_GPT)}
TABLES: dict[str, Table] = {**_BY_KIND, **{a: _BY_KIND[k] for a, k in KIND_ALIASES.items()}}
