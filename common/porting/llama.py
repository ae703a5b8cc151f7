"""Import Hugging Face's Llama family, `--from llama`: `LlamaForCausalLM`, `MistralForCausalLM` and
`Qwen2ForCausalLM` save_pretrained folders (`config.json` + `model.safetensors`, or its shards with
their index, or `pytorch_model.bin` read with `weights_only`; common/porting/hf_folder.py reads
the folder), as numpy, with no framework imported here. The way back, `--to llama`, is
common/porting/llama_export.py; Meta's original layout, `--from meta-llama`, is
common/porting/meta_llama.py.

The three are one decoder (transformers 5.23, modeling_llama.py and its Mistral and Qwen2 copies),
each choice mapped onto a field of our spec:
- decoder-only (num_encoder_layers 0), pre-norm blocks `x + attn(input_layernorm(x))`, then
  `x + mlp(post_attention_layernorm(x))`, and a final `model.norm`: norm_position "pre",
  final_norm true.
- every norm is an RMSNorm (Zhang & Sennrich 2019), `weight * x / sqrt(mean(x^2) + eps)` with no
  bias: norm_kind "rms_norm", layer_norm_eps = `rms_norm_eps`.
- the MLP is gated (Shazeer 2020): `down(act(gate(x)) * up(x))`: gated_feed_forward true,
  gate_proj -> feed_forward.gate, up_proj -> feed_forward.intermediate, down_proj ->
  feed_forward.output; `hidden_act` through transformers' ACT2FN names (silu: SwiGLU).
- rotary positions (Su et al. 2021) in the half-split layout of transformers' `rotate_half`,
  angle pos * theta^(-2i/d_k): position_kind "rotary", rotary_layout "half_split", rope_theta
  from either layout of config.json (`read_rope`). No position table; token embeddings unscaled.
- grouped-query attention (Ainslie et al. 2023): `num_key_value_heads` -> num_kv_heads, query
  head n reads key/value head n // (heads / kv_heads) (transformers' repeat_kv); `head_dim`, when
  it is not hidden_size / heads, -> key_dim. Scores are scaled by head_dim^-0.5, Eq. (1).
- biases: Llama's `attention_bias` covers q, k, v and o, `mlp_bias` the three MLP projections;
  Mistral has none; Qwen2 has q, k and v biases and none on o or the MLP (attention_output_bias
  false).
- `tie_word_embeddings` -> tie_output; `lm_head` has no bias.

Llama masks nothing by token id (its attention_mask is the caller's), and neither does the
import: pad_id is the virtual pad, `vocab_size`, an id that names no token
(common/porting/gpt.py, `no_pad`), whatever config.json's `pad_token_id` says, unless --config
names one; the conversion's notes say which pad_token_id config.json named, unmasked.

What the spec cannot hold is refused by name, all at once, before any weight is read: a sliding
window in effect, a rope type other than "default" (llama3, linear, dynamic, yarn, longrope),
a partial rotary factor, logit soft-capping, an unknown activation, model type or architecture.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError
from transformer_rosetta.files.safe_read import brief, is_int, is_number, shown
from transformer_rosetta.porting.gpt import no_pad
from transformer_rosetta.porting.hf_folder import (
    ACTIVATIONS,
    HfModel,
    model_folder,
    read_config_json,
    read_folder_shapes,
    read_folder_weights,
)
from transformer_rosetta.porting.table import (
    Constant,
    Rule,
    Table,
    check_counts,
    rows,
    to_canonical,
)
from transformer_rosetta.porting.unread import lacking
from transformer_rosetta.spec.config import TransformerConfig

# model_type -> the one architecture read. A base model (LlamaModel) has no lm_head, and a task
# head (...ForSequenceClassification) is not a language model.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta

# The decoder the three share: what their code fixes, whatever config.json says.
FIXED: dict[str, Any] = {
    "num_encoder_layers": 0,
    "norm_position": "pre",
    "final_norm": True,
    "norm_kind": "rms_norm",
    "gated_feed_forward": True,
    "position_kind": "rotary",
    "rotary_layout": "half_split",
    "scale_embeddings": False,
    "share_embeddings": False,
    "output_bias": False,
    "dropout": 0.0,  # no dropout on the residuals or the embeddings, only on the attention
}

# The config classes' defaults (transformers 5.23: configuration_llama.py, _mistral.py, _qwen2.py)
# for the keys read here; config.json may omit a key that equals its default.
_SHARED_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "head_dim": None,  # hidden_size // num_attention_heads
    "pad_token_id": None,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_SHARED_DEFAULTS,
        "intermediate_size": 11008,
        "num_key_value_heads": None,  # num_attention_heads
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    },
    "mistral": {
        **_SHARED_DEFAULTS,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,  # in effect unless config.json says null
    },
    "qwen2": {
        **_SHARED_DEFAULTS,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "max_window_layers": 28,
        "layer_types": None,
    },
}
# The JSON type of each key read (token ids are checked as ids); a wrong type is refused first.
TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "max_window_layers",
        ),
        ("an integer",),
    ),
    **dict.fromkeys(
        ("num_key_value_heads", "head_dim", "sliding_window", "pretraining_tp"),
        ("an integer", "null"),
    ),
    **dict.fromkeys(("rms_norm_eps", "attention_dropout", "rope_theta"), ("a number",)),
    "partial_rotary_factor": ("a number", "null"),
    **dict.fromkeys(("hidden_act", "model_type"), ("a string",)),
    **dict.fromkeys(
        ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
        ("true or false",),
    ),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), ("an object", "null")),
    **dict.fromkeys(("architectures", "layer_types"), ("an array", "null")),
}
# Our field -> the config.json key it comes from, to name the key in messages.
HF_FIELD = {
    "src_vocab_size": "vocab_size",
    "tgt_vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "d_ff": "intermediate_size",
    "num_decoder_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "key_dim": "head_dim",
    "max_len": "max_position_embeddings",
    "layer_norm_eps": "rms_norm_eps",
    "activation": "hidden_act",
    "attention_dropout": "attention_dropout",
    "rope_theta": "rope_parameters.rope_theta",
    "tie_output": "tie_word_embeddings",
    "attention_bias": "attention_bias",
    "feed_forward_bias": "mlp_bias",
    "pad_id": "pad_token_id",
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
}
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
# transformers' ACT2FN names -> ours: every folder's, and SiLU, the family's own (SwiGLU).
LLAMA_ACTIVATIONS = {**ACTIVATIONS, "silu": "silu"}
HF_MODELS = {
    kind: HfModel(NAMES[kind], kind, DEFAULTS[kind], TYPES, HF_FIELD, activations=LLAMA_ACTIVATIONS)
    for kind in ARCHITECTURES
}
# Keys of other families' configs that change the function; LlamaForCausalLM ignores them, so a
# file that sets them was made for another model, whose function would be lost.
SOFT_CAPPING = ("attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping")


# -- config.json ----------------------------------------------------------------------------------


def hf_model_of(hf: Any) -> HfModel:
    """The HfModel of config.json's model_type; ConfigError naming an unknown one."""
    if not isinstance(hf, Mapping):
        HF_MODELS["llama"].check_types(hf)  # raises, naming the JSON type
    found = hf.get("model_type")
    if found not in HF_MODELS:
        raise ConfigError(
            [
                f"model_type: {brief(found)} is not a model of the Llama family that rosetta "
                f"reads (expected {', '.join(map(repr, ARCHITECTURES))}){lacking(found)}"
            ]
        )
    return HF_MODELS[found]


def _architecture_problems(hf: Mapping[str, Any], model_type: str) -> list[str]:
    found = hf.get("architectures")
    want = ARCHITECTURES[model_type]
    if found is None or found == [want]:
        return []
    return [
        f"architectures: {brief(found)} is not what --from llama reads for model_type "
        f"{model_type!r} (expected [{want!r}]: a causal language model with its lm_head)"
    ]


def read_rope(hf: Mapping[str, Any]) -> tuple[float | None, list[str]]:
    """(rope_theta, problems) from config.json in either layout: transformers 5's
    `rope_parameters: {"rope_type": "default", "rope_theta": ...}` (or one such object per layer
    type), or transformers 4's top-level `rope_theta` with `rope_scaling` (null, or an object with
    `type` or `rope_type`). As transformers 5 reads them: `rope_scaling`, when set, takes the
    place of `rope_parameters`; the object's rope_theta comes first, then the top-level one,
    then 10000. Only the "default" type is the spec's angle pos * theta^(-2i/d_k); every other
    (llama3, linear, dynamic, yarn, longrope) rescales it, and a partial_rotary_factor rotates
    only part of each head: each is a problem naming its key."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    nested = [k for k in ("full_attention", "sliding_attention") if isinstance(rope.get(k), dict)]
    objects = [(f"{key}.{k}", rope[k]) for k in nested] or [(key, rope)]
    problems: list[str] = []
    thetas = set()
    for where, entry in objects:
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind != "default":
            problems.append(
                f"{where}: rope type {brief(kind)} rescales the rotary angles, which the spec "
                "(angle pos * rope_theta^(-2i/d_k)) cannot express; only 'default' is imported"
            )
        factor = entry.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if factor is not None and factor != 1.0:
            problems.append(
                f"partial_rotary_factor: {brief(factor)} rotates only part of each head; the spec "
                "rotates all of it (1.0)"
            )
        theta = entry.get("rope_theta", hf.get("rope_theta", ROPE_DEFAULT_THETA))
        if not is_number(theta):
            problems.append(f"{where}.rope_theta: must be a number, got {brief(theta)}")
        else:
            thetas.add(float(theta))
    if len(thetas) > 1:
        problems.append(
            f"{key}: the layer types' rope_theta differ ({sorted(thetas)}); the spec has one"
        )
    return (thetas.pop() if len(thetas) == 1 and not problems else None), problems


def _window_problems(hf: Mapping[str, Any], model: HfModel) -> list[str]:
    """A sliding window (each token attends only the `sliding_window` tokens before it) in effect:
    the spec's causal attention sees every earlier token. Mistral's `sliding_window` is in effect
    unless null; Qwen2's on the layers from `max_window_layers` on when `use_sliding_window`, or
    where `layer_types` says "sliding_attention"."""
    get = model.get
    if model.model_type == "mistral":
        window = get(hf, "sliding_window")
        if window is None:
            return []
        return [
            f"sliding_window: {window} lets each token attend only the {window} tokens before "
            "it; the spec's causal attention sees every earlier token (null imports)"
        ]
    if model.model_type != "qwen2":
        return []
    layers = get(hf, "num_hidden_layers")
    types = get(hf, "layer_types")
    if types is None:
        # transformers' layer_types, "sliding_attention" for i >= max_window_layers when
        # use_sliding_window: some layer slides iff max_window_layers < num_hidden_layers. Said
        # without listing the layers, whose count the file has not yet confirmed.
        first = get(hf, "max_window_layers")
        windowed = get(hf, "use_sliding_window") and first < layers and layers > 0
        types = ["sliding_attention"] if windowed else []
    other = sorted({t for t in types if t != "full_attention"}, key=str)
    if not other:
        return []
    return [
        f"layer_types: {brief(other)} layers (use_sliding_window, max_window_layers) attend a "
        f"window of {get(hf, 'sliding_window')} tokens; the spec's causal attention sees every "
        "earlier token"
    ]


def _token_ids(
    hf: Mapping[str, Any], model: HfModel, problems: list[str], notes: list[str]
) -> dict[str, int]:
    """bos_id, eos_id and (when config.json names one) pad_token_id, as read; a missing BOS or
    EOS is left out for --config to give. A list of EOS ids (Llama 3's instruct models) gives its
    first, the others said in the notes: the spec stops at one id."""
    found: dict[str, int] = {}
    for ours, key in (
        ("bos_id", "bos_token_id"),
        ("eos_id", "eos_token_id"),
        ("pad", "pad_token_id"),
    ):
        value = model.get(hf, key)
        if isinstance(value, list) and value and all(is_int(v) for v in value):
            if len(value) > 1:
                notes.append(
                    f"{ours}: {key} lists {value}; the spec stops at one id, the first, {value[0]}"
                )
            value = value[0]
        if value is None:
            continue
        if not is_int(value) or value < 0:
            problems.append(f"{key}: must be one token id (an integer), got {brief(value)}")
            continue
        found[ours] = value
    return found


def llama_config_fields(hf: Any) -> tuple[dict[str, Any], list[str]]:
    """(our config fields, notes) for the model that transformers builds from `hf` (config.json):
    every mapping of the module docstring. Every value the spec cannot hold is refused in one
    ConfigError naming its key, a wrong JSON type first. bos_id and eos_id are absent where
    config.json names none (Qwen2's defaults), and pad_id is always absent (folder_config);
    the key "pad" holds config.json's pad_token_id when it names one, for the notes."""
    model = hf_model_of(hf)
    model.check_types(hf)
    get = model.get
    notes: list[str] = []
    problems = _architecture_problems(hf, model.model_type)
    problems += _window_problems(hf, model)
    theta, rope_problems = read_rope(hf)
    problems += rope_problems
    for key in SOFT_CAPPING:
        if hf.get(key) is not None:
            problems.append(
                f"{key}: {brief(hf[key])} caps scores with c * tanh(x / c), which the spec cannot "
                "express"
            )
    activation = model.activation(hf, "hidden_act", problems)
    ids = _token_ids(hf, model, problems, notes)
    if problems:
        raise ConfigError(problems)
    if (get(hf, "pretraining_tp") or 1) > 1:
        notes.append(
            f"pretraining_tp {get(hf, 'pretraining_tp')}: transformers 4 split each projection "
            "into that many slices, the same function; transformers 5 and the import ignore it"
        )
    hidden, heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    head_dim, kv_heads = get(hf, "head_dim"), get(hf, "num_key_value_heads")
    bias = {  # (q/k/v, o, MLP): each family's code (Mistral's and Qwen2's ignore the keys)
        "llama": (get(hf, "attention_bias"), None, get(hf, "mlp_bias")),
        "mistral": (False, None, False),
        "qwen2": (True, False, False),
    }[model.model_type]
    fields: dict[str, Any] = {
        **FIXED,
        "src_vocab_size": get(hf, "vocab_size"),  # unused by a decoder-only model
        "tgt_vocab_size": get(hf, "vocab_size"),
        "d_model": hidden,
        "num_heads": heads,
        "key_dim": None if head_dim is None or head_dim * heads == hidden else head_dim,
        "num_kv_heads": None if kv_heads is None or kv_heads == heads else kv_heads,
        "d_ff": get(hf, "intermediate_size"),
        "num_decoder_layers": get(hf, "num_hidden_layers"),
        "max_len": get(hf, "max_position_embeddings"),
        "attention_dropout": get(hf, "attention_dropout"),
        "layer_norm_eps": get(hf, "rms_norm_eps"),
        "activation": activation,
        "rope_theta": theta,
        "tie_output": get(hf, "tie_word_embeddings"),
        "attention_bias": bias[0],
        "attention_output_bias": bias[1],
        "feed_forward_bias": bias[2],
        **ids,
    }
    return fields, notes


def folder_config(
    fields: dict[str, Any],
    notes: list[str],
    given: Mapping[str, Any] | None,
    model: HfModel,
    table: Table,
    source: str = "config.json",
) -> TransformerConfig:
    """Our config from the fields a file tells and --config's: --config may add what the file
    does not tell (BOS and EOS where it names none, pad_id), and must agree with the rest and
    with what the model's code fixes (`table`'s fixed fields): ConfigError naming both. pad_id,
    when nobody gives it, is the virtual pad (common/porting/gpt.py, no_pad: the model has none;
    a pad_token_id the file names is said in `notes`, unmasked). Shared by --from llama and
    --from meta-llama (`source` names the file in messages)."""
    given = dict(given or {})
    pad_token_id = fields.pop("pad", None)
    problems = [
        f"{name}: --config says {brief(value)}, but "
        + (
            table.why.get(name, f"{table.model} has {fields[name]!r}")
            if name in table.fixed
            else f"{source}'s {model.hf_field.get(name, name)} says {brief(fields[name])}"
        )
        for name, value in given.items()
        if name in fields and value != fields[name]
    ]
    fields.update(given)
    for ours in ("bos_id", "eos_id"):
        if ours not in fields:
            problems.append(
                f"{ours}: {source} names no {model.hf_field[ours]}; give {ours} in --config"
            )
    if problems:
        raise ConfigError(problems)
    if "pad_id" not in fields:
        fields["pad_id"], said = no_pad(fields, pad_token_id, model.name, source)
        notes += said
    return model.config(fields)


def llama_folder_config(
    hf: Any, given: Mapping[str, Any] | None = None
) -> tuple[TransformerConfig, list[str]]:
    """(config, notes) from config.json and the user's --config fields (folder_config)."""
    fields, notes = llama_config_fields(hf)
    return folder_config(fields, notes, given, hf_model_of(hf), TABLE), notes


# -- the tensors ---------------------------------------------------------------------------------

PROJECTIONS = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
MLP = {"gate": "gate_proj", "intermediate": "up_proj", "output": "down_proj"}
EMBEDDING, LM_HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def _rules() -> list[Rule]:
    """Every tensor of LlamaForCausalLM (a bias rule is read only where the config has it)."""
    out = [
        # Tied, save_pretrained writes embed_tokens alone; a .bin may hold lm_head too.
        Rule("decoder.embedding", EMBEDDING, copies=(LM_HEAD,), when=(("tie_output", True),)),
        Rule("decoder.embedding", EMBEDDING, when=(("tie_output", False),)),
        Rule("output.kernel", LM_HEAD, ("transpose",)),
        Rule("decoder.final_norm.scale", FINAL_NORM),
    ]
    layer, there = "decoder.layers.{i}", "model.layers.{i}"
    for proj, native in PROJECTIONS.items():
        # q/k/v: [heads d_k, d] nn.Linear, heads-major (.view(..., -1, head_dim)); o: [d, h d_k].
        here, linear = f"{layer}.self_attention.{proj}", f"{there}.self_attn.{native}"
        out.append(Rule(f"{here}.kernel", f"{linear}.weight", ("transpose", "heads")))
        out.append(Rule(f"{here}.bias", f"{linear}.bias", () if proj == "output" else ("heads",)))
    for proj, native in MLP.items():
        here, linear = f"{layer}.feed_forward.{proj}", f"{there}.mlp.{native}"
        out.append(Rule(f"{here}.kernel", f"{linear}.weight", ("transpose",)))
        out.append(Rule(f"{here}.bias", f"{linear}.bias"))
    out.append(Rule(f"{layer}.self_attention_norm.scale", f"{there}.input_layernorm.weight"))
    out.append(Rule(f"{layer}.feed_forward_norm.scale", f"{there}.post_attention_layernorm.weight"))
    return out


TABLE = Table(
    kind="llama",
    model="a Llama-family model (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)",
    rules=tuple(_rules()),
    fixed=FIXED,
    # What the shapes tell, checked against config.json (check_counts) before any work.
    sizes={
        "tgt_vocab_size": (EMBEDDING, 0),  # src_vocab_size is the same key's, unused
        "d_model": (EMBEDDING, 1),
        "d_ff": ("model.layers.0.mlp.gate_proj.weight", 0),
    },
    head_sizes={
        "num_heads": ("model.layers.0.self_attn.q_proj.weight", 0),
        "num_kv_heads": ("model.layers.0.self_attn.k_proj.weight", 0),
    },
    why={
        "num_encoder_layers": "a Llama is decoder-only",
        "norm_position": "a Llama block is pre-norm: x + attn(input_layernorm(x))",
        "final_norm": "a Llama ends its stack with model.norm",
        "norm_kind": "a Llama's norms are RMSNorm, without a bias",
        "gated_feed_forward": "a Llama's MLP is down(act(gate(x)) * up(x))",
        "position_kind": "a Llama rotates its queries and keys (rotary positions)",
        "rotary_layout": "transformers' rotate_half pairs dimension i with i + d_k/2",
        "scale_embeddings": "a Llama does not scale its token embeddings",
        "output_bias": "a Llama's lm_head has no bias",
        "dropout": "a Llama drops out nothing but attention probabilities",
    },
    tie_reason="tie_word_embeddings ties them",
)
# Older transformers (4.28 to 4.30) saved each layer's rotary inverse frequencies, a buffer; later
# ones keep it out of the file (persistent=False).
INV_FREQ_KEYS = ("model.layers.{i}.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq")


def rotary_frequencies(source: str, c: TransformerConfig) -> Constant:
    """A stored rotary frequency vector (transformers' inv_freq, Meta's rope.freqs), checked to be
    theta^(-2i/d_k), i = 0 .. d_k/2 - 1, then dropped: our models compute it.

    Both compute it in float32, `1 / theta ** (arange(0, d_k, 2).float() / d_k)`, maybe stored
    in the model's dtype. With u the float32 unit roundoff: the exponent is rounded (u relative,
    hence ln(theta) u relative on theta ** e, e <= 1), pow and the quotient add about u each, so
    (ln(theta) + 2) u, which the bound doubles; storing in another dtype adds its own eps/2.
    Relative to each entry; a wrong theta or layout is off by O(1)."""
    want = np.power(float(c.rope_theta), -np.arange(0, c.head_dim, 2) / c.head_dim)
    float32 = (math.log(c.rope_theta) + 2) * float(np.finfo(np.float32).eps)

    def check(a: np.ndarray) -> bool:
        a = np.asarray(a)
        if a.dtype.kind != "f" or a.shape != want.shape:
            return False
        bound = float32 + float(np.finfo(a.dtype).eps) / 2
        return bool(np.all(np.abs(a.astype(np.float64) / want - 1) <= bound))

    return Constant(
        source,
        f"the rotary frequencies rope_theta^(-2i/d_k) (rope_theta {c.rope_theta:g}, d_k "
        f"{c.head_dim})",
        check,
    )


def table_for(table: Table, keys: tuple[str, ...], c: TransformerConfig) -> Table:
    """`table` with the stored frequency vectors under `keys` as its constants, checked for `c`."""
    return dataclasses.replace(table, constants=tuple(rotary_frequencies(k, c) for k in keys))


@dataclass(frozen=True)
class LlamaImport:
    """An imported folder: our config, the canonical tensors, and what the import decided that
    the files do not show (pad_id, the EOS ids past the first, what it ignored)."""

    config: TransformerConfig
    tensors: dict[str, np.ndarray]
    notes: tuple[str, ...]


def import_llama_folder(path: str | Path, given: Mapping[str, Any] | None = None) -> LlamaImport:
    """Read a Llama, Mistral or Qwen2 save_pretrained folder whole: config.json first (every
    refusal before any weight is read), then the weights, sharded or not. `given`: --config's
    fields (folder_config)."""
    folder = model_folder(path, "Llama")
    hf = read_config_json(folder)
    config, notes = llama_folder_config(hf, given)
    # Every count against the header's shapes before anything proportional to one (the rotary
    # frequencies of head_dim, the names of every layer) is built, or any tensor read.
    check_counts(TABLE, config, read_folder_shapes(folder), hf_model_of(hf).name_keys)
    table = table_for(TABLE, INV_FREQ_KEYS, config)
    tensors = to_canonical(table, read_folder_weights(folder), config, shown(folder))
    return LlamaImport(config, tensors, tuple(notes))


def mapping_table(config: TransformerConfig) -> list[tuple[str, str, str]]:
    """(source name, canonical name, steps) for every tensor of a LlamaForCausalLM folder, with
    the layer index as {i}: for docs/PORTING.md."""
    return rows(table_for(TABLE, INV_FREQ_KEYS, config), config, patterns=True)
